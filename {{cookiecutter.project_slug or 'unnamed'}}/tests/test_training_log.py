"""The training log: named values reach train_log.jsonl, metrics.jsonl and TensorBoard; the
logged throughput counts training steps only; epoch times are split into training and
validation."""

import json
import math
import sys
import time

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, fixture, only_run_dir, run, torchrun
from dist_utils import DistEnv
from training_log import TrainingLog


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
    # Throughput of the job and of one of its 2 ranks, and the model TFLOP/s of a rank (the
    # FLOPs counted on a dict model too); no MFU on a CPU. The first window has no rate.
    timed = steps[1:]
    assert "samples_per_s" not in steps[0] and timed
    for step in timed:
        assert math.isclose(step["samples_per_s_per_rank"], step["samples_per_s"] / 2)
        assert step["tflops_per_rank"] > 0 and "mfu" not in step
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert {f"train/{name}" for name in names} | {"val/loss_embedding_l2"} <= set(
        events.Tags()["scalars"])


def test_throughput_counts_training_steps_only(tmp_path):
    # Validation made slow on purpose (a large val split read one sample at a time). If its time
    # leaked into the clock of the next epoch's first window, the windows of that epoch would add
    # up to more than the epoch's training time by a whole validation. Both sides are measured
    # over the same seconds, so a busy machine (other tests beside this one) moves them alike.
    # 105 training samples: 21 steps of 5 an epoch, windows of 3 steps.
    batch = 5
    result = run([sys.executable, "train.py", *TINY, "data.val_fraction=0.5",
                  "eval.batch_size=1", "model.hidden_dim=512", "model.num_layers=4",
                  f"train.global_batch_size={batch}", "train.epochs=4", "train.log_every=3",
                  "train.ckpt_every=0", f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path)
    logged = records(run_dir / "train_log.jsonl")
    epochs = records(run_dir / "metrics.jsonl")
    assert [r["step"] for r in logged] == sorted({1, *range(3, 85, 3), 21, 42, 63, 84})
    seconds = {}  # each window's training seconds, from its samples and its rate
    for before, window in zip(logged, logged[1:], strict=False):
        seconds[window["step"]] = (window["step"] - before["step"]) * batch / window[
            "samples_per_s"]
    assert min(e["val_seconds"] for e in epochs) > 0.05  # the test has teeth
    for epoch, previous in zip(epochs[1:], epochs, strict=False):
        first, last = previous["step"], epoch["step"]
        in_epoch = sum(s for step, s in seconds.items() if first < step <= last)
        assert in_epoch <= epoch["train_seconds"] + 0.01, (epoch, in_epoch)
        assert in_epoch < epoch["train_seconds"] + previous["val_seconds"] / 2
    for epoch in epochs:
        assert abs(epoch["epoch_seconds"] - epoch["train_seconds"] - epoch["val_seconds"]) < 1e-6


class SlowTracker:
    """A tracker whose every call takes a while (a remote server, a busy SQLite store)."""

    def __init__(self):
        self.steps = []

    def __bool__(self):
        return True

    def log_metrics(self, metrics, step):
        time.sleep(0.02)
        self.steps.append(step)


def test_a_checkpoint_waits_until_the_trackers_hold_every_window_before_it(tmp_path):
    # A job killed right after a checkpoint resumes after it: a window still queued for the
    # trackers or the files then would never be logged anywhere.
    tracker = SlowTracker()
    train_log = TrainingLog(tmp_path, DistEnv(rank=0, local_rank=0, world_size=1, launched=False),
                            torch.device("cpu"), trackers=tracker)
    for step in range(1, 31):
        train_log.add_step({"loss": torch.tensor(1.0 / step)}, samples=4)
        train_log.flush(step, lr=0.1)
    train_log.state_dict()  # what a checkpoint at step 30 takes
    assert tracker.steps == list(range(1, 31))
    assert [r["step"] for r in records(tmp_path / "train_log.jsonl")] == list(range(1, 31))
    train_log.close()


def test_a_window_sums_the_same_kept_as_numbers_or_as_tensors(tmp_path):
    # The CPU keeps a window's values as numbers, an accelerator as tensors (read at the window's
    # end only); both weigh each step by its samples, an epoch's smaller last step included.
    env = DistEnv(rank=0, local_rank=0, world_size=1, launched=False)
    windows = {}
    for kept in ("numbers", "tensors"):
        train_log = TrainingLog(tmp_path / kept, env, torch.device("cpu"))
        train_log.on_cpu = kept == "numbers"
        generator = torch.Generator().manual_seed(0)
        for step in range(1, 8):
            loss, accuracy = torch.rand(2, generator=generator)
            train_log.add_step({"loss": loss, "accuracy": accuracy}, samples=3 if step == 7 else 8)
        train_log.flush(7, lr=0.1)
        train_log.close()
        (windows[kept],) = records(tmp_path / kept / "train_log.jsonl")
    numbers, tensors = windows["numbers"], windows["tensors"]
    values = torch.rand(7, 2, generator=torch.Generator().manual_seed(0)).double()
    weights = torch.tensor([8.0] * 6 + [3.0], dtype=torch.float64)
    expected = (values * weights[:, None]).sum(0) / weights.sum()
    assert math.isclose(numbers["loss"], expected[0].item(), rel_tol=1e-12)
    assert math.isclose(numbers["accuracy"], expected[1].item(), rel_tol=1e-12)
    assert math.isclose(tensors["loss"], numbers["loss"], rel_tol=1e-12)
    assert math.isclose(tensors["accuracy"], numbers["accuracy"], rel_tol=1e-12)
