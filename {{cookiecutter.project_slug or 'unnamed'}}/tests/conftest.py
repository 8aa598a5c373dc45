"""Shared helpers: a tiny synthetic setup and a way to run the project's commands for real."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]


def fixture(name: str) -> str:
    """How a run names a builder of tests/fixtures.py (the tests' own data and models)."""
    return f"tests/fixtures.py:{name}"


# The tests' own 352 samples split into 228 train (divisible by 1, 2, 3, 4 and 6 processes),
# 53 val and 71 test (divisible by neither 2 nor 3): uneven evaluation shards on purpose.
TINY = [
    f"data.dataset={fixture('vectors')}", f"model.name={fixture('mlp')}", "model.hidden_dim=32",
    "train.global_batch_size=12", "train.epochs=3", "train.log_every=5", "train.ckpt_every=20",
    "optim.warmup_steps=5", "optim.lr=0.01", "train.progress_bar=false",
    "train.plot_curves=false",  # test_tracking.py draws them
]
TINY_SPLIT = {"train": 228, "val": 53, "test": 71}
# Trials of the tests that interrupt a run at random steps: 1 in the suite; TRIALS=6 (say) for
# more (SIGTERM: the first inside a validation, the others at random steps; SIGKILL of an FSDP
# worker: asynchronous checkpoints in even trials, synchronous in odd ones).
TRIALS = int(os.environ.get("TRIALS", "1"))
IMAGES = [f"data.dataset={fixture('images')}", f"model.name={fixture('convnet')}",
          "model.channels=8"]


def command_env(**extra: str) -> dict:
    """The environment for a child command: this interpreter's tools first, one thread each."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(args: list[str], timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    """Run a command in the project folder; stdout and stderr together in `.stdout`."""
    return subprocess.run(
        args, cwd=PROJECT, env=command_env(**extra_env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False,
    )


def torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", script, *args])


def only_run_dir(output_dir: Path) -> Path:
    runs = list(output_dir.iterdir())
    assert len(runs) == 1, f"expected one run folder, found {runs}"
    return runs[0]


@pytest.fixture
def tiny_args(tmp_path) -> list[str]:
    return [*TINY, f"run.output_dir={tmp_path / 'runs'}"]


class RunsCode:
    """Pickled into a checkpoint, this runs `touch marker` when unpickled: what a malicious
    checkpoint would do. Tests check that loading refuses it and the marker never appears."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
