"""Shared helpers: a tiny synthetic setup and a way to run the project's commands for real."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]

# A suite started in the background of a shell without job control (`pytest ... &` in a script)
# inherits SIGINT ignored, and so would every run.sh it starts: bash cannot trap a signal that was
# ignored when it started, so the Ctrl-C tests would see the job run on. Handled here, SIGINT is
# back to its default in every child.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
    # torchrun leaves a torchelastic_* folder in the temp directory; run.sh gives each launch
    # its own and removes it, and so does this.
    with tempfile.TemporaryDirectory(prefix="tr", dir=os.environ.get("TMPDIR")) as tmp:
        return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={nproc}", script, *args], TMPDIR=tmp)


def needs_extra(extra: str, module: str | None = None):
    """The module an optional feature's test needs (by default the extra's own name), or a skip
    that names the extra to install: the quick tier passes with the README's install alone
    (`pip install -e '.[dev]'`), and `pip install -e '.[dev,all]'` runs every test."""
    return pytest.importorskip(module or extra, reason=f"needs the {extra} extra: "
                               f"pip install -e '.[{extra}]'")


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


# --- Nothing left behind: every test's processes end, and its temp directory is empty -----------

MARKER = "DDP_TEMPLATE_TEST"
LEFTOVER_DEADLINE = 30.0  # seconds a test's processes get to finish exiting after it ends


def pytest_configure(config):
    # Compile caches (speed.compile tests) live for the session, not in a test's temp folder.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config.inductor_cache = tempfile.mkdtemp(prefix="inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.inductor_cache
    # run.sh keeps what it learns of torchrun (its --help) here: for the session, not in ~/.cache.
    if "DDP_CACHE_DIR" not in os.environ:
        config.run_sh_cache = tempfile.mkdtemp(prefix="run-sh-cache-")
        os.environ["DDP_CACHE_DIR"] = config.run_sh_cache


def pytest_unconfigure(config):
    for cache in (getattr(config, "inductor_cache", None), getattr(config, "run_sh_cache", None)):
        if cache:
            shutil.rmtree(cache, ignore_errors=True)


def processes_of(marker: str) -> list[int]:
    """Processes started with DDP_TEMPLATE_TEST=<marker> in their environment: the test's own,
    wherever they are in the process tree (a new session or group does not hide them)."""
    found = []
    needle = f"{MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone, or not ours to read
                continue
    return found


def describe_process(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return str(pid)
    return f"{pid} ({command[:120]})"


@pytest.fixture(autouse=True)
def leaves_nothing_behind(monkeypatch):
    """Each test runs with its own temp directory and a marker in its children's environment.
    After it, a process of its own still alive (past a short deadline to finish exiting) or
    anything left in its temp directory fails the test; the processes are killed either way."""
    marker = uuid.uuid4().hex
    temp = tempfile.mkdtemp(prefix="t-", dir="/tmp")  # short: AF_UNIX socket paths live here
    monkeypatch.setenv(MARKER, marker)
    monkeypatch.setenv("TMPDIR", temp)
    try:
        yield
    finally:
        deadline = time.monotonic() + LEFTOVER_DEADLINE
        while (alive := processes_of(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)  # polling a condition with a deadline, not waiting for a race
        described = [describe_process(pid) for pid in alive]
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        left = sorted(p.name for p in Path(temp).iterdir())
        shutil.rmtree(temp, ignore_errors=True)
    assert not described, f"processes left running after the test: {described}"
    assert not left, f"left in the temp directory: {left}"
