"""The training log: named values reach train_log.jsonl, metrics.jsonl and TensorBoard; the
logged throughput counts training steps only, on a clock read once the device has finished them
(tested on a clock of the test's own); epoch times are split into training and validation."""

import json
import math
import sys
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import TINY, fixture, only_run_dir, run, torchrun
from ddpkit import training_log
from ddpkit.config import load_config
from ddpkit.dist_utils import DistEnv
from ddpkit.schedules import factor_of
from ddpkit.training_log import TrainingLog


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


class AsyncDevice:
    """A device whose steps run after the CPU has queued them, on a clock the test controls:
    queuing a step takes `launch` seconds of the clock, the device's work `work` seconds more,
    which the clock sees only when someone waits for the device (synchronize), as with a GPU."""

    def __init__(self):
        self.time, self.busy_until = 100.0, 100.0

    def clock(self) -> float:
        return self.time

    def synchronize(self) -> None:
        self.time = max(self.time, self.busy_until)

    def step(self, launch: float, work: float) -> None:
        self.time += launch
        self.busy_until = max(self.busy_until, self.time) + work

    def spend(self, seconds: float) -> None:  # host time with the device idle (a write, say)
        self.synchronize()
        self.time += seconds


ONE_RANK = DistEnv(rank=0, local_rank=0, world_size=1, launched=False)


def run_epochs(train_log: TrainingLog, device: AsyncDevice, epochs: int = 3,
               steps: int = 20, log_every: int = 5, batch: int = 8) -> list[dict]:
    """The training loop's calls to the log, with 0.1 s of device work a step (after 1 ms to
    queue it), a 2 s checkpoint at step 10 of each epoch and a 3 s validation."""
    records, step = [], 0
    for epoch in range(1, epochs + 1):
        train_log.start_epoch(resumed_within=False)
        for _ in range(steps):
            device.step(launch=0.001, work=0.1)
            train_log.add_step({"loss": torch.tensor(1.0)}, samples=batch, rates={"lr": 0.1})
            step += 1
            if step % log_every == 0:
                train_log.flush(step)
            if step % steps == 10:
                device.spend(2.0)  # the checkpoint: between windows, inside the epoch
                train_log.restart_clock()
        train_log.end_training(step)
        device.spend(3.0)  # validation
        records.append(train_log.end_epoch(epoch, step, {"accuracy": 0.5}))
    train_log.close()
    return records


def test_window_rates_and_mfu_are_those_of_the_device_on_an_injected_clock(tmp_path):
    # 8 samples in 0.1 s a step: 80 samples/s; a sample of 1.25 GFLOP on a 100 GFLOP/s device
    # keeps it busy all the time, MFU 1 (the 1 ms to queue a step overlaps the last one).
    device = AsyncDevice()
    train_log = TrainingLog(tmp_path, ONE_RANK, torch.device("cpu"), clock=device.clock,
                            synchronize=device.synchronize)
    train_log.flops_per_sample, train_log.peak_flops = 1.25e9, 100e9
    epochs = run_epochs(train_log, device)
    windows = records(tmp_path / "train_log.jsonl")
    assert [w["step"] for w in windows] == list(range(5, 61, 5))
    assert "samples_per_s" not in windows[0]  # start-up
    for window in windows[1:]:
        assert math.isclose(window["samples_per_s"], 80, rel_tol=0.01), window
        assert window["mfu"] <= 1 and math.isclose(window["mfu"], 1, rel_tol=0.01), window
    for epoch in epochs:  # the epoch's clock: 20 steps, the checkpoint; then the validation
        assert math.isclose(epoch["train_seconds"], 20 * 0.1 + 2.0, rel_tol=0.01), epoch
        assert math.isclose(epoch["val_seconds"], 3.0, rel_tol=1e-9), epoch
        assert math.isclose(epoch["epoch_seconds"], epoch["train_seconds"] + 3.0, rel_tol=1e-9)
    # Window throughput and the epoch clock's (less its checkpoint) agree: 80 samples/s.
    for epoch in epochs:
        assert math.isclose(20 * 8 / (epoch["train_seconds"] - 2.0), 80, rel_tol=0.02)
    headline = train_log.throughput()
    assert headline["windows"] == 11 and headline["windows_left_out"] == 1
    assert math.isclose(headline["samples_per_s"], 80, rel_tol=0.01)
    assert headline["mfu"] <= 1


def test_without_waiting_for_the_device_the_rates_would_be_wrong(tmp_path):
    # The premise of the test above: a clock read without waiting stops before the steps have
    # run, and the window rates come out 100 times too high, the MFU far above 1.
    device = AsyncDevice()
    train_log = TrainingLog(tmp_path, ONE_RANK, torch.device("cpu"), clock=device.clock,
                            synchronize=lambda: None)
    train_log.flops_per_sample, train_log.peak_flops = 1.25e9, 100e9
    run_epochs(train_log, device, epochs=1)
    rates = [w["samples_per_s"] for w in records(tmp_path / "train_log.jsonl")[1:]]
    assert min(rates) > 50 * 80
    assert train_log.throughput()["mfu"] > 1


def test_windows_that_compiled_are_left_out_of_the_headline(tmp_path, monkeypatch):
    compiled = iter([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2])  # one read per window, and at start
    monkeypatch.setattr(training_log, "compilations", lambda: next(compiled))
    device = AsyncDevice()
    train_log = TrainingLog(tmp_path, ONE_RANK, torch.device("cpu"), clock=device.clock,
                            synchronize=device.synchronize)
    run_epochs(train_log, device, epochs=2)
    headline = train_log.throughput()
    # 8 windows: the first (start-up) and the two that compiled (the 3rd, the 5th) left out.
    assert headline["windows"] == 5 and headline["windows_left_out"] == 3
    assert math.isclose(headline["samples_per_s"], 80, rel_tol=0.01)
    assert "5 window(s)" in train_log.describe_throughput()


def test_a_real_run_times_every_window_and_epoch(tmp_path):
    # The rates' arithmetic is tested above on a clock of its own; here, that a real run writes
    # them: every window after the first has a rate, every epoch its three times.
    result = run([sys.executable, "train.py", *TINY, "train.epochs=2", "train.log_every=3",
                  f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path)
    windows = records(run_dir / "train_log.jsonl")
    assert "samples_per_s" not in windows[0]
    assert all(math.isfinite(w["samples_per_s"]) for w in windows[1:])
    # Each window logs the rates its last step trained with, every group's under its name: step
    # 1 the warmup's first (lr / 5), the last step the cosine's last, not the 0 after it.
    factor = factor_of(load_config([*TINY, "train.epochs=2"]), 2 * 19)
    assert [(w["step"], w["lr"]) for w in windows] == [
        (w["step"], pytest.approx(0.01 * factor(w["step"] - 1))) for w in windows]
    assert (windows[0]["step"], windows[0]["lr"]) == (1, pytest.approx(0.002))
    assert windows[-1]["step"] == 38 and windows[-1]["lr"] > 0
    assert all(w["lr/decay"] == w["lr/no_decay"] == w["lr"] for w in windows)
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    assert {"train/lr", "train/lr/decay", "train/lr/no_decay"} <= set(events.Tags()["scalars"])
    for epoch in records(run_dir / "metrics.jsonl"):
        assert math.isclose(epoch["epoch_seconds"], epoch["train_seconds"] + epoch["val_seconds"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["throughput"]["windows"] == len(windows) - 1
    assert "throughput: " in result.stdout


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
        train_log.flush(step)
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
        train_log.flush(7)
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
