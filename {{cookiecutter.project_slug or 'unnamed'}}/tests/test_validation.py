"""Validation during training (ddpkit/validation.py): its step cadence, the best checkpoint kept
beside the newest ones (through retention, a preemption and a requeue), model.pt from the best
or the last weights, early stopping, and training left bitwise as it was."""

import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from test_cluster import PREEMPTED, launch
from test_faults import epoch_records, finish, wait_for

import evaluate
from conftest import TINY, run
from ddpkit.checkpoint_files import list_checkpoints
from ddpkit.checkpoint_load import read_model
from ddpkit.config import UserError, load_config
from ddpkit.validation import Validation, restored

# 19 steps an epoch; a validation every 7 steps besides each epoch's end. The best by the lowest
# accuracy is the first validation's for good: a best far older than the newest checkpoint.
STEPS = 3 * 19
CADENCE = [*TINY, "train.val_every_steps=7", "train.keep_checkpoints=1"]
FIRST_IS_BEST = ["train.best_metric=accuracy", "train.best_mode=min"]


class Headline:
    headline, higher_is_better = "accuracy", True


def validation(*overrides: str) -> Validation:
    return Validation(load_config(list(overrides)), Headline())


def test_best_and_patience_follow_the_metric_mode_and_min_delta():
    auto = validation("train.best_metric=loss", "train.early_stop_patience=2",
                      "train.early_stop_min_delta=0.1")
    assert not auto.higher  # a loss: lower is better
    assert [auto.judge({"step": s, "val_loss": v}) for s, v in
            [(1, 1.0), (2, 0.95), (3, 0.97), (4, 0.5)]] == [True, True, False, True]
    assert auto.best == {"value": 0.5, "step": 4, "checkpoint": "step-00000004"}
    assert auto.waited == 0 and not auto.stopped_early  # 0.95 was no improvement by 0.1
    auto.judge({"step": 5, "val_loss": 0.45})
    auto.judge({"step": 6, "val_loss": float("nan")})
    assert auto.stopped_early and auto.best["step"] == 5
    headline = validation()
    assert headline.metric == "accuracy" and headline.higher
    assert not validation("train.best_mode=min").higher
    restored = validation()
    restored.load_state_dict(auto.state_dict())
    assert restored.state_dict() == auto.state_dict()


def test_a_resume_keeps_the_best_of_its_own_folder_and_weighs_patience_anew(tmp_path):
    stopped = validation("train.early_stop_patience=1")
    stopped.judge({"step": 5, "val_accuracy": 0.5})
    stopped.judge({"step": 10, "val_accuracy": 0.4})
    (tmp_path / "step-00000005").mkdir()
    for patience, best, stops in ((1, tmp_path, True), (3, tmp_path / "other", False)):
        resumed = validation(f"train.early_stop_patience={patience}")
        resumed.load_state_dict(stopped.state_dict())
        run = SimpleNamespace(validation=resumed,
                              checkpointer=SimpleNamespace(folder=best, best=None))
        restored(run)
        assert resumed.stopped_early is stops
        kept = "step-00000005" if best == tmp_path else None
        assert run.checkpointer.best == kept and (resumed.best is not None) == bool(kept)


def test_an_unknown_best_metric_is_one_sentence_naming_the_choices():
    with pytest.raises(UserError, match=r"^train.best_metric=acc is not a validation metric of "
                       r"this task: choose one of loss, accuracy$"):
        validation("train.best_metric=acc").judge(
            {"step": 1, "val_loss": 1.0, "val_accuracy": 0.5, "val_seconds": 0.1})


def test_export_best_needs_the_best_checkpoint():
    with pytest.raises(UserError, match="train.export=best needs the best checkpoint"):
        load_config(["train.export=best", "train.keep_best=false"])


@pytest.fixture(scope="module")
def cadence_run(tmp_path_factory) -> tuple[Path, str]:
    """CADENCE's run at 2 processes, model.pt from the best weights (a checkpoint every 20 steps,
    each step logged): its folder and its output. The step cadence test's run, and the
    uninterrupted reference of the DDP preemption test below."""
    run_dir = tmp_path_factory.mktemp("cadence") / "run"
    result = run(["./run.sh", *CADENCE, *FIRST_IS_BEST, "train.export=best", "train.log_every=1",
                  f"run.dir={run_dir}"], NPROC_PER_NODE="2")
    assert result.returncode == 0, result.stdout
    return run_dir, result.stdout


def test_step_cadence_keeps_the_best_beside_the_newest_and_exports_it(tmp_path, cadence_run):
    run_dir, output = cadence_run
    records = epoch_records(run_dir)
    assert [(r["step"], r.get("mid_epoch", False)) for r in records] == [
        (7, True), (14, True), (19, False), (21, True), (28, True), (35, True), (38, False),
        (42, True), (49, True), (56, True), (57, False)]
    assert all("val_accuracy" in r for r in records)
    # The newest (train.keep_checkpoints=1) and the best, whatever was saved between them.
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000007", f"step-{STEPS:08d}"]
    summary = json.loads((run_dir / "summary.json").read_text())
    best = run_dir / "checkpoints" / "step-00000007"
    assert summary["best_checkpoint"] == str(best)
    assert summary["exported"] == {"from": "best", "step": 7, "weights": "trained"}
    assert summary["stopped_early"] is False
    exported = torch.load(run_dir / "model.pt", weights_only=True)
    assert exported["step"] == 7
    assert all(torch.equal(exported["model"][k], v) for k, v in read_model(best).items())
    # Evaluating the run folder scores what it exported, as the hint at its end says.
    assert (f"evaluate with: ./run.sh evaluate.py eval.checkpoint={run_dir} (its model.pt: the "
            "best validation's weights, step 7)") in output
    assert evaluate.chosen(str(run_dir)) == run_dir / "model.pt"

    again = run([sys.executable, "export.py", str(run_dir), str(tmp_path / "best.pt"),
                 "--best"])
    assert again.returncode == 0, again.stdout
    assert f"the trained weights of {best} (step 7)" in again.stdout
    last = run([sys.executable, "export.py", str(run_dir), str(tmp_path / "last.pt")])
    assert last.returncode == 0 and "(step 57)" in last.stdout, last.stdout


@pytest.mark.slow
def test_validation_leaves_training_bitwise_as_it_was(tmp_path):
    # Dropout draws from the generators a validation's loader also draws from.
    models = {}
    for cadence in ("0", "5"):
        run_dir = tmp_path / cadence
        result = run([sys.executable, "train.py", *TINY, "train.epochs=2",
                      f"train.val_every_steps={cadence}", "model.dropout=0.3",
                      f"run.dir={run_dir}"])
        assert result.returncode == 0, result.stdout
        models[cadence] = read_model(list_checkpoints(run_dir / "checkpoints")[-1])
    assert all(torch.equal(models["0"][k], models["5"][k]) for k in models["0"])


@pytest.mark.slow
def test_early_stopping_ends_the_run_and_exports_the_last_weights(tmp_path):
    run_dir = tmp_path / "run"
    # No loss falls by 10 in one validation: the second one stops the run.
    result = run([sys.executable, "train.py", *TINY, "train.val_every_steps=5",
                  "train.best_metric=loss", "train.early_stop_patience=1",
                  "train.early_stop_min_delta=10", f"run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout
    assert "early stop: val_loss has not improved by more than 10 for 1 validation(s)" in (
        result.stdout)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] is True and summary["step"] == 10
    assert summary["exported"] == {"from": "last", "step": 10, "weights": "trained"}
    assert [r["step"] for r in epoch_records(run_dir)] == [5, 10]
    # Run again, it stays stopped: nothing is trained or written anew.
    again = run([sys.executable, "train.py", *TINY, "train.val_every_steps=5",
                 "train.best_metric=loss", "train.early_stop_patience=1",
                 "train.early_stop_min_delta=10", f"run.dir={run_dir}"])
    assert again.returncode == 0, again.stdout
    assert [r["step"] for r in epoch_records(run_dir)] == [5, 10]


def test_an_unknown_best_metric_stops_the_run_with_one_line_from_rank_0(tmp_path):
    result = run(["./run.sh", *TINY, "train.best_metric=acc", f"run.dir={tmp_path / 'run'}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stdout
    assert result.stdout.count("train.best_metric=acc is not a validation metric") == 1, (
        result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [[], ["parallel.strategy=fsdp", "train.checkpoint_async=true"]],
                         ids=["ddp-sync", "fsdp-async"])
def test_a_preemption_inside_a_validation_keeps_the_best(tmp_path, request, variant):
    args = [*CADENCE, *FIRST_IS_BEST, "train.log_every=1", "train.ckpt_every=0",
            "train.export=best", *variant]
    if variant:  # the uninterrupted run of these settings
        reference = tmp_path / "reference"
        result = run(["./run.sh", *args, f"run.dir={reference}"], NPROC_PER_NODE="2")
        assert result.returncode == 0, result.stdout
    else:  # DDP's: the step cadence test's run, the same but for its periodic checkpoints
        reference = request.getfixturevalue("cadence_run")[0]

    run_dir, marker = tmp_path / "preempted", tmp_path / "validating"
    job = {"RDZV_ID": f"validation-{tmp_path.name}"}
    # The fifth validation is step 28's, mid-epoch: every checkpoint but the best's is newer.
    launcher = launch(["tests/preempt_in_validation.py", *args, f"run.dir={run_dir}"], **job,
                      PREEMPT_VALIDATION="5", PREEMPT_MARKER=str(marker))
    wait_for(marker.exists, launcher, "the fifth validation")
    os.killpg(launcher.pid, signal.SIGTERM)
    output = finish(launcher)
    assert launcher.returncode == PREEMPTED, output
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000007", "step-00000028"]
    assert [r["step"] for r in epoch_records(run_dir)] == [7, 14, 19, 21]  # 28's not done

    again = run(["./run.sh", *args, f"run.dir={run_dir}"], NPROC_PER_NODE="2", **job)
    assert again.returncode == 0, again.stdout
    assert epoch_records(run_dir) == epoch_records(reference)  # step 28's validated again
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == [
        "step-00000007", f"step-{STEPS:08d}"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best_checkpoint"] == str(run_dir / "checkpoints" / "step-00000007")
    for name in ("model.pt",):
        resumed = torch.load(run_dir / name, weights_only=True)["model"]
        expected = torch.load(reference / name, weights_only=True)["model"]
        assert all(torch.equal(resumed[k], expected[k]) for k in expected)
    last = read_model(list_checkpoints(run_dir / "checkpoints")[-1])
    assert all(torch.equal(v, read_model(list_checkpoints(reference / "checkpoints")[-1])[k])
               for k, v in last.items())
    assert OmegaConf.load(run_dir / "config.yaml").train.val_every_steps == 7
    assert Path(summary["best_checkpoint"]).is_dir()
