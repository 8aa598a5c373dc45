"""The training log: step statistics kept by name, reduced over ranks, written by rank 0.

Every step the trainer hands over named values, each a mean over the step's batch: `loss`, the
named loss terms (`loss_<name>`) and the task's `train_scalars`. They are summed on the device,
weighted by the step's samples, and read only when a window of `train.log_every` steps is
logged, so a GPU never waits for the CPU in between. The window's all-reduce (which makes the
sums global) runs in the background while training goes on; the window is written out when the
next one starts, before a checkpoint, or at the end of the epoch:

    train_log.jsonl    one line per window: step, each value, lr, samples_per_s, grad_norm, time
    metrics.jsonl      one line per epoch: train_<name> over the whole epoch, val_<metric>,
                       train_seconds, val_seconds, epoch_seconds
    tb/                TensorBoard: train/<name>, val/<metric>

A new value reaches all three by being in the dict the task returns; nothing here names one.
"""

import json
import math
import time
from pathlib import Path

import torch

import dist_utils
from checkpoint import Position
from config import UserError
from dist_utils import DistEnv


def _append_json(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _keep_records(path: Path, keep) -> None:
    """Rewrite a JSON-lines file with only the records `keep` accepts (atomically)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if keep(json.loads(line))]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        tmp.replace(path)


class TrainingLog:
    def __init__(self, run_dir: Path, env: DistEnv, device: torch.device):
        self.run_dir, self.env, self.device = run_dir, env, device
        self.purge_step = None  # resumed: TensorBoard hides what came after the checkpoint
        self.names: list[str] = []
        self.window: torch.Tensor | None = None  # value sums, then the sample count
        self.window_steps = 0
        self.grad_norm = None  # the last step's, before clipping
        self.clock = time.perf_counter()  # start of the window's training time
        self.in_flight: list = []  # windows being all-reduced: (handle, sums, names, record)
        self.epoch_sums: dict[str, float] = {}
        self.last: dict = {}  # the last window written (for the progress bar)
        self._writer = None

    # -- during the step: device-side only --------------------------------------------------------

    def add_step(self, values: dict[str, torch.Tensor], samples: int, grad_norm=None) -> None:
        """One optimizer step's values (means over its `samples` samples), left on the device."""
        if list(values) != self.names:
            self._start_names(list(values))
        sums = torch.stack(list(values.values())).detach().double() * samples
        self.window[:-1] += sums
        self.window[-1] += samples
        self.window_steps += 1
        self.grad_norm = grad_norm  # a new tensor each step: keeping it needs no copy

    def _start_names(self, names: list[str]) -> None:
        """A new set of names (the first step, or a task that changed what it logs)."""
        if self.window_steps:
            raise RuntimeError(f"the logged values changed within a window: {self.names} -> "
                               f"{names}; return the same names every step")
        self.names = names
        self.window = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)

    def restart_clock(self) -> None:
        """Time from here on counts as training time of the window (after validation, say)."""
        self.clock = time.perf_counter()

    # -- logging a window -------------------------------------------------------------------------

    def flush(self, step: int, lr: float) -> None:
        """End the window at `step`: start its all-reduce (every rank calls this at the same
        steps) and write out any earlier window, whose all-reduce has had time to finish."""
        if self.window_steps:
            sums = self.window.clone()
            self.window.zero_()
            record = {"step": step, "lr": lr, "seconds": time.perf_counter() - self.clock}
            if self.grad_norm is not None:
                record["grad_norm"] = self.grad_norm
            handle = dist_utils.all_reduce_sum_async(sums)
            self.in_flight.append((handle, sums, list(self.names), record))
            self.window_steps = 0
            self.restart_clock()
        while len(self.in_flight) > 1:
            self._write_window(*self.in_flight.pop(0))

    def write_pending(self) -> None:
        """Write out every window still in flight (waits for their all-reduces)."""
        while self.in_flight:
            self._write_window(*self.in_flight.pop(0))

    def _write_window(self, handle, sums: torch.Tensor, names: list[str], record: dict) -> None:
        if handle is not None:
            handle.wait()
        *totals, samples = sums.tolist()
        for name, total in zip(names, totals, strict=True):
            self.epoch_sums[name] = self.epoch_sums.get(name, 0.0) + total
        self.epoch_sums["samples"] = self.epoch_sums.get("samples", 0.0) + samples
        seconds = record.pop("seconds")
        record.update({name: total / samples for name, total in zip(names, totals, strict=True)})
        record["samples_per_s"] = samples / seconds
        if "grad_norm" in record:
            record["grad_norm"] = record["grad_norm"].item()  # the same on every rank
        if not math.isfinite(record["loss"]):  # the same all-reduced value on every rank
            raise UserError(
                f"training diverged: the loss is {record['loss']} at step {record['step']}; lower "
                "optim.lr, set optim.grad_clip (e.g. 1.0) or use speed.precision=bf16 or fp32")
        if self.env.is_main:
            for name, value in record.items():
                if name != "step":
                    self.writer().add_scalar(f"train/{name}", value, record["step"])
            _append_json(self.run_dir / "train_log.jsonl", {**record, "time": time.time()})
        self.last = record

    # -- epochs -----------------------------------------------------------------------------------

    def start_epoch(self, resumed_within: bool) -> None:
        """A new epoch's sums; kept when resuming part-way into it (they were in the checkpoint)."""
        if not resumed_within:
            self.epoch_sums = {}
        self.restart_clock()

    def end_epoch(self, epoch: int, step: int, val: dict, seconds: dict) -> dict:
        """The epoch's record: training means over the epoch, the validation metrics and the
        time spent; written to metrics.jsonl and TensorBoard by rank 0."""
        self.write_pending()
        samples = self.epoch_sums.get("samples", 0.0)
        record = {"epoch": epoch, "step": step}
        if samples:
            record.update({f"train_{name}": total / samples
                           for name, total in self.epoch_sums.items() if name != "samples"})
        record.update({f"val_{name}": value for name, value in val.items()})
        record.update({f"{name}_seconds": value for name, value in seconds.items()})
        if self.env.is_main:
            for name, value in val.items():
                self.writer().add_scalar(f"val/{name}", value, step)
            _append_json(self.run_dir / "metrics.jsonl", record)
        return record

    # -- resume and output ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the epoch's sums so far (every window is written first)."""
        self.write_pending()
        return {"epoch_sums": dict(self.epoch_sums)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch_sums = dict(state.get("epoch_sums", {}))

    def resume(self, position: Position, truncate: bool) -> None:
        """On resume (after load_state_dict): drop the records that training from `position`
        writes again (rank 0). A finished run rerun writes nothing again: `truncate=False`."""
        self.purge_step = position.step + 1
        if truncate and self.env.is_main:
            _keep_records(self.run_dir / "train_log.jsonl", lambda r: r["step"] <= position.step)
            _keep_records(self.run_dir / "metrics.jsonl", lambda r: r["epoch"] <= position.epoch)

    def writer(self):
        """Rank 0's TensorBoard writer, made at the first record (not before step 1)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # imported by rank 0 only

            # purge_step: TensorBoard hides what an earlier attempt logged after the checkpoint.
            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tb"),
                                         purge_step=self.purge_step)
        return self._writer

    def close(self) -> None:
        self.write_pending()
        if self._writer is not None:
            self._writer.close()
