"""The step guard (guard.enabled, ddpkit/step_guard.py) with real processes: a loss spike and a
nan loss planted at known steps (tests/fixtures.py:poisoned_mlp) are skipped and the run goes
on; skips in a row end it in one line; a run resumed from a checkpoint judges as the
uninterrupted one did, bit for bit."""

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from conftest import TINY, fixture, only_run_dir, run
from ddpkit.checkpoint_files import MODEL_FILE, list_checkpoints

pytestmark = pytest.mark.slow  # the quick tier (-m 'not slow') skips these

# 30 steps (19 an epoch), a checkpoint every 10, a spike judged against the last 5 steps.
GUARDED = [*TINY, f"model.name={fixture('poisoned_mlp')}", "train.max_steps=30",
           "train.log_every=1", "train.ckpt_every=10", "train.keep_checkpoints=0",
           "guard.enabled=true", "guard.spike_factor=3", "guard.window=5"]
POISON = "8:spike,14:nan,16:spike"


def windows(run_dir: Path) -> dict[int, dict]:
    return {record["step"]: record for record in map(
        json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("guarded")
    result = run(["./run.sh", *GUARDED, f"run.output_dir={out}"], NPROC_PER_NODE="2",
                 POISON=POISON)
    assert result.returncode == 0, result.stdout
    return only_run_dir(out), result.stdout


def test_a_spike_and_a_nan_are_skipped_and_the_run_goes_on(guarded):
    run_dir, output = guarded
    logged = windows(run_dir)
    assert sorted(logged) == list(range(1, 31))
    skipped = [step for step, record in logged.items() if record["skipped_steps"]]
    assert skipped == [8, 14, 16]
    for step in skipped:  # out of the means: nothing but the rates and the count
        assert "loss" not in logged[step] and "grad_norm" not in logged[step]
        # The schedule (the warmup, until step 5, then cosine) did not move on.
        assert logged[step + 1]["lr"] == logged[step]["lr"] != logged[step - 1]["lr"]
    assert all(record["loss"] < 3 for step, record in logged.items() if step not in skipped)
    warnings = [line.split(" ", 1)[1] for line in output.splitlines() if "skipped:" in line]
    assert warnings[1] == "step 14 skipped: the loss is nan"
    # Judged against the median of the 5 steps before it, as train_log.jsonl has their losses.
    median = statistics.median(logged[step]["loss"] for step in range(3, 8))
    assert re.fullmatch(rf"step 8 skipped: the loss [\d.]+ is [\d.]+x the median {median:.4g} "
                        r"of the last 5 steps \(guard.spike_factor=3.0\)", warnings[0])
    assert len(warnings) == 3  # once each: rank 0


def test_skips_in_a_row_end_the_run_in_one_line(tmp_path):
    result = run(["./run.sh", *GUARDED, "guard.max_skips=3", f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE="2", POISON="4:nan,5:nan,6:nan,7:nan")
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == ["error: the step guard skipped 3 steps in a row (steps 4, 5, 6; the last "
                      "because the loss is nan): lower optim.lr, set optim.grad_clip (e.g. 1.0), "
                      "or look at the data of those steps"]
    assert "Traceback" not in result.stdout


def test_a_resumed_run_judges_as_the_uninterrupted_one_did(guarded, tmp_path):
    """Resumed from step 10: the spike at 16 is judged against losses of steps before the
    checkpoint; the weights end bit for bit as the uninterrupted run's."""
    from test_checkpoints import assert_bitwise_equal, final_weights

    uninterrupted = guarded[0]
    copy = tmp_path / "run"
    shutil.copytree(uninterrupted, copy)
    for later in list_checkpoints(copy / "checkpoints")[1:]:
        shutil.rmtree(later)
    (copy / MODEL_FILE).unlink()
    result = run(["./run.sh", *GUARDED, f"run.dir={copy}"], NPROC_PER_NODE="2", POISON=POISON)
    assert result.returncode == 0, result.stdout
    assert "resumed from" in result.stdout and "step 14 skipped" in result.stdout
    assert_bitwise_equal(final_weights(copy), final_weights(uninterrupted))
    assert [r.get("skipped_steps") for r in windows(copy).values()] == [
        r.get("skipped_steps") for r in windows(uninterrupted).values()]
