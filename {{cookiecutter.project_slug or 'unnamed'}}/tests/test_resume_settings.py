"""A resume tells the truth: settings changed since the checkpoint are applied (the learning rate
and weight decay the optimizer would otherwise bring back) or refused in one line (those that
would replay or skip data), and summary.json says how a run that did not finish ended."""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import TINY, run
from ddpkit.checkpoint_files import list_checkpoints

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 228 // 12

# The optimizer as start_run() leaves it after a resume: each group's lr and weight decay.
PROBE = """
import json, sys
from ddpkit.run_setup import start_run
s = start_run(sys.argv[1:])
print("PROBE", json.dumps([[g["lr"], g["weight_decay"]] for g in s.optimizer.param_groups]))
"""


def lr_by_step(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {record["step"]: record["lr"] for record in records if "lr" in record}


def probe(*args: str) -> list[list[float]]:
    result = run([sys.executable, "-c", PROBE, *args])
    assert result.returncode == 0, result.stdout
    line = next(line for line in result.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


def test_a_new_learning_rate_and_weight_decay_take_effect_at_the_resumed_step(tmp_path):
    first = tmp_path / "first"
    assert run([sys.executable, "train.py", *TINY, "train.epochs=1",
                f"run.dir={first}"]).returncode == 0
    reference = tmp_path / "reference"
    assert run([sys.executable, "train.py", *TINY, "train.epochs=2",
                f"run.dir={reference}"]).returncode == 0

    # What the optimizer holds once resumed: the new values, the schedule's factor kept.
    # Weights decay at the new rate; biases still do not.
    [[lr, weight_decay], [bias_lr, bias_decay]] = probe(
        *TINY, "train.epochs=2", "optim.lr=0.02", "optim.weight_decay=0.3",
        f"run.dir={tmp_path / 'probe'}",
        f"train.resume={list_checkpoints(first / 'checkpoints')[-1]}")
    assert (weight_decay, bias_decay) == (0.3, 0.0)
    assert lr == bias_lr == pytest.approx(2 * lr_by_step(reference)[STEPS_PER_EPOCH + 1])

    resumed = run([sys.executable, "train.py", *TINY, "train.epochs=2", "optim.lr=0.02",
                   f"run.dir={first}"])
    assert resumed.returncode == 0, resumed.stdout
    assert (f"changed since the checkpoint, in effect from step {STEPS_PER_EPOCH + 1}: "
            "optim.lr 0.01 -> 0.02") in resumed.stdout
    assert "train.epochs 1 -> 2" in resumed.stdout
    # Every step after the resume at twice the uninterrupted run's rate, on its schedule.
    expected, logged = lr_by_step(reference), lr_by_step(first)
    later = [step for step in logged if step > STEPS_PER_EPOCH]
    assert later
    for step in later:
        assert logged[step] == pytest.approx(2 * expected[step]), step
    # The records say what trained.
    assert "lr: 0.02" in (first / "config.yaml").read_text()


@pytest.fixture(scope="module")
def stopped_at_step_10(tmp_path_factory) -> Path:
    """One run for the refusals below, each on a copy of its own: it stopped at step 10."""
    first = tmp_path_factory.mktemp("stopped") / "first"
    assert run([sys.executable, "train.py", *TINY, "train.epochs=1", "train.max_steps=10",
                f"run.dir={first}"]).returncode == 0
    return first


@pytest.mark.parametrize("setting", ["train.global_batch_size=24", "run.seed=3",
                                     "data.split_seed=5", "optim.name=sgd",
                                     "optim.schedule=plateau"])
def test_a_setting_a_resume_cannot_honour_is_refused_in_one_line(tmp_path, setting,
                                                                  stopped_at_step_10):
    first = Path(shutil.copytree(stopped_at_step_10, tmp_path / "first",
                                 ignore=shutil.ignore_patterns(".lock")))
    before = sorted(p.name for p in (first / "checkpoints").iterdir())
    config = (first / "config.yaml").read_text()
    result = run([sys.executable, "train.py", *TINY, "train.epochs=2", setting,
                  f"run.dir={first}"])
    assert result.returncode == 2, result.stdout
    key, value = setting.split("=")
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {setting} differs from "), lines
    assert f"resume with {key}=" in lines[0]
    # Nothing of the run changed.
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == before
    assert (first / "config.yaml").read_text() == config


def test_summary_says_failed_when_the_run_fails(tmp_path):
    out = tmp_path / "failing"
    with tempfile.TemporaryDirectory(prefix="tr") as temp:  # for torchrun's torchelastic_*
        result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node=1", "tests/fail_at_step.py", *TINY, f"run.dir={out}"],
                     FAIL_STEP="7", FAIL_RANK="0", TMPDIR=temp)
    assert result.returncode != 0
    assert "planted bug at step 7" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["step"] == 6
