"""The training log: named values reach train_log.jsonl, metrics.jsonl and TensorBoard; the
logged throughput counts training steps only; epoch times are split into training and
validation."""

import json
import statistics
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, fixture, only_run_dir, run, torchrun


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loss_terms_and_scalars_of_a_task_reach_every_log(tmp_path):
    # Dict samples, a model taking and returning dicts, a loss of two named terms and one more
    # logged scalar: all named by the task, nothing by the trainer.
    result = torchrun(2, "train.py", *TINY, f"data.dataset={fixture('dict_vectors')}",
                      f"model.name={fixture('dict_model')}", f"task.name={fixture('TermsTask')}",
                      f"run.output_dir={tmp_path}")
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path)
    names = ("loss", "loss_ce", "loss_embedding_l2", "accuracy", "confidence")
    steps, epochs = records(run_dir / "train_log.jsonl"), records(run_dir / "metrics.jsonl")
    assert all(name in step for step in steps for name in names)
    assert all(f"train_{name}" in epoch for epoch in epochs for name in names)
    assert all(step["loss"] == step["loss_ce"] + step["loss_embedding_l2"] or abs(
        step["loss"] - step["loss_ce"] - step["loss_embedding_l2"]) < 1e-6 for step in steps)
    assert {"val_loss_ce", "val_loss_embedding_l2", "val_accuracy"} <= epochs[-1].keys()
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert {f"train/{name}" for name in names} | {"val/loss_embedding_l2"} <= set(
        events.Tags()["scalars"])


def test_throughput_counts_training_steps_only(tmp_path):
    # Validation made slow on purpose (a large val split read one sample at a time): if its
    # time leaked into the next window's clock, that window's samples/s would collapse.
    # 105 training samples in 21 steps of 5: seven windows of 3 steps an epoch; 176 val samples,
    # about three windows' time.
    result = run([sys.executable, "train.py", *TINY, "data.val_fraction=0.5",
                  "eval.batch_size=1", "model.hidden_dim=512", "model.num_layers=4",
                  "train.global_batch_size=5", "train.epochs=4", "train.log_every=3",
                  "train.ckpt_every=0", f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path)
    windows = [r for r in records(run_dir / "train_log.jsonl") if "samples_per_s" in r]
    epochs = records(run_dir / "metrics.jsonl")
    rates = [w["samples_per_s"] for w in windows]
    median = statistics.median(rates)
    window_seconds = 15 / median  # 3 steps x 5 samples
    # The test has teeth: validation takes longer than a window of training, so a window that
    # counted it would run at less than half the others' rate (the check below).
    assert min(e["val_seconds"] for e in epochs) > 1.2 * window_seconds, (epochs, rates)
    assert len(windows) == 28  # 7 windows an epoch, every step covered
    assert min(rates) > median / 2, rates
    for epoch in epochs:
        assert abs(epoch["epoch_seconds"] - epoch["train_seconds"] - epoch["val_seconds"]) < 1e-6
