"""The training log: step statistics kept by name, reduced over ranks, written by rank 0.

Every step the trainer hands over named values, each a mean over the step's batch: `loss`, the
named loss terms (`loss_<name>`) and the task's `train_scalars`. They are summed on the device,
weighted by the step's samples, and read only when a window of `train.log_every` steps is
logged, so a GPU never waits for the CPU in between. The window's all-reduce (which makes the
sums global) runs in the background while training goes on; the window is written out when the
next one starts, before a checkpoint, or at the end of the epoch:

    train_log.jsonl    one line per window: step, each value, the learning rates the
                       window's last step trained with (lr/<group> for each parameter group,
                       lr the first group's), samples_per_s (training steps only; none for a
                       process's first window, which includes start-up), grad_norm, time
    metrics.jsonl      one line per epoch: train_<name> over the whole epoch, val_<metric>,
                       train_seconds, val_seconds, epoch_seconds (a run by steps, by_steps:
                       no epoch, its last line's train_<name> over the whole run)
    tb/                TensorBoard: train/<name> (train/lr/<group> too), val/<metric>
    trackers           MLflow / W&B when the config turns them on (extras/trackers.py): the same
                       values, plus epoch/<name> for the rest of an epoch's record

A new value reaches all of them by being in the dict the task returns; nothing here names one.

Time: windows and epochs are timed on one clock, read only once the device has finished the work
queued so far (a GPU runs kernels asynchronously: without the wait, a window's clock would stop
before its steps had run, and its rate and MFU would be too high). The wait comes at the window
and epoch boundaries only, every log_every steps. A window's seconds are its training steps';
writing the log and saving checkpoints fall between windows. The run's throughput headline
leaves out the windows that include start-up or a torch.compile compilation.
"""

import contextlib
import itertools
import json
import logging
import math
import queue
import sys
import threading
import time
from pathlib import Path

import torch

from ddpkit import dist_utils, writes
from ddpkit.config import UserError
from ddpkit.dist_utils import DistEnv
from ddpkit.position import Position

log = logging.getLogger("ddp")


def _keep_records(path: Path, keep) -> None:
    """Rewrite a JSON-lines file with only the records `keep` accepts (atomically). A line that
    is not a whole record (cut short by a killed job or a full disk) is left out, with one line."""
    if not path.exists():
        return
    lines, damaged = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            if keep(json.loads(line)):
                lines.append(line)
        except (ValueError, KeyError, TypeError):  # not JSON, or not one of this log's records
            damaged += 1
    if damaged:
        log.warning("%s: left out %d line(s) that are not whole records (cut short when a job "
                    "was killed?)", path, damaged)
    writes.write_text(path, "".join(f"{line}\n" for line in lines))


class Writer:
    """Rank 0's log files and TensorBoard, and the trackers.

    Files are written at once, by the training loop itself, between windows (outside their
    clocks), and TensorBoard's SummaryWriter is flushed there too, so that its writer thread
    does its work between windows rather than during the next steps. The trackers, whose calls
    can take long (a remote server, a busy SQLite store), get the records in order from a thread
    of their own; drain() waits for it, close() too.
    """

    def __init__(self, run_dir: Path, purge_step: int | None, trackers=None):
        # Imported with the first record rank 0 writes, after the first step: TensorBoard and
        # its protobufs take 0.1 s and 6 MB that the other ranks never need.
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir, self.trackers = run_dir, trackers
        # With purge_step, TensorBoard hides what an earlier attempt logged after the checkpoint.
        self.tensorboard = SummaryWriter(run_dir / "tb", purge_step=purge_step)
        self.files: dict = {}  # file name -> open handle, appended to a line at a time
        self.failed: BaseException | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = None
        if trackers:  # their modules are imported already, by this thread (see Trackers)
            self.thread = threading.Thread(target=self._track, name="trackers", daemon=True)
            self.thread.start()

    def write(self, file_name: str, record: dict, scalars: dict, step: int,
              tracked: dict | None = None) -> None:
        """Append `record` to `file_name`, `scalars` (tag -> number) to TensorBoard and
        `tracked` (default: `scalars`) to the trackers."""
        if not self.failed:
            try:
                for tag, value in scalars.items():
                    self.tensorboard.add_scalar(tag, value, step)
                self.tensorboard.flush()  # on disk as the log files are: a killed job loses none
                self._append(file_name, json.dumps(record) + "\n")
            except OSError as error:  # a full disk, say: say so once; training goes on
                self.failed = error
                log.warning("cannot write the training log in %s (%s): training goes on; a "
                            "checkpoint that cannot be written stops it", self.run_dir, error)
        if self.thread:
            self.queue.put((scalars if tracked is None else tracked, step))

    def _append(self, file_name: str, line: str) -> None:
        """One line, on disk as soon as written (flushed: a killed job loses no record); the
        file stays open, an open and a close a record cost more than the write."""
        handle = self.files.get(file_name)
        if handle is None:
            handle = self.files[file_name] = open(self.run_dir / file_name, "a")  # noqa: SIM115
        handle.write(line)
        handle.flush()

    def _track(self) -> None:
        while (item := self.queue.get()) is not None:
            if isinstance(item, threading.Event):  # drain(): everything before it is logged
                item.set()
            else:  # never raises: a failing tracker is reported and dropped
                self.trackers.log_metrics(*item)

    def drain(self) -> None:
        """Wait until the trackers hold every record written so far (the files already do)."""
        if self.thread is None:
            return
        done = threading.Event()
        self.queue.put(done)
        while not done.wait(timeout=1.0) and self.thread.is_alive():
            pass

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
        for handle in (self.tensorboard, *self.files.values()):
            with contextlib.suppress(OSError):  # a full disk: said already, when writing
                handle.close()


def device_synchronizer(device: torch.device):
    """A function that waits until `device` has finished the work queued on it (nothing to wait
    for on the CPU)."""
    if device.type == "cpu":
        return lambda: None
    module = getattr(torch, device.type)  # torch.cuda, torch.xpu, torch.mps, ...
    if device.type == "mps":  # one device, no argument
        return module.synchronize
    return lambda: module.synchronize(device)


def compilations() -> int:
    """Frames torch.compile has compiled in this process so far (0 where torch does not say)."""
    # Looked up, not imported: torch.compile loads it, and importing it costs a second.
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return int(counters["frames"]["ok"]) if counters is not None else 0


class TrainingLog:
    def __init__(self, run_dir: Path, env: DistEnv, device: torch.device, trackers=None,
                 clock=time.perf_counter, synchronize=None, log_every: int = 1):
        self.run_dir, self.env, self.device, self.trackers = run_dir, env, device, trackers
        self.log_every = log_every  # train.log_every: a window ends every that many steps
        # The clock and the wait for the device (tests give their own: time made deterministic).
        self.clock = clock
        self.synchronize = synchronize or device_synchronizer(device)
        self.purge_step = None  # resumed: TensorBoard hides what came after the checkpoint
        self.names: list[str] = []
        self.steps: list = []  # this window's (values, samples) of every step (see add_step)
        self.on_cpu = device.type == "cpu"
        self.grad_norm = None  # the last step's, before clipping
        self.rates: dict[str, float] = {}  # the learning rates the last step trained with
        self.replica_groups: list[int] = []  # with replica groups: how many took part, per step
        self.window_start = self.epoch_start = self.validation_start = self.now()
        self.warming_up = True  # the first window of a process: its time includes start-up
        self.compiled = compilations()  # a window in which this grows compiled: not timed
        self.timed = {"samples": 0, "seconds": 0.0, "windows": 0, "left_out": 0}  # headline
        self.in_flight: list = []  # windows being all-reduced: (handle, sums, names, record)
        self.epoch_sums: dict[str, float] = {}
        self.last: dict = {}  # the last window written (for the progress bar)
        self.flops_per_sample: float | None = None  # model FLOPs of a training sample (flops.py)
        self.peak_flops: float | None = None  # one device's peak FLOP/s, where known
        self.tokens_per_sample: int | None = None  # a language model's window: tokens/s too
        self.by_steps = False  # a run counted in steps only (DataModule.by_steps): no epochs
        self.guard = None  # step_guard.StepGuard: each window counts the steps it skipped
        self._writer: Writer | None = None

    # -- during the step: no work on the device ---------------------------------------------------

    def add_step(self, values: dict[str, torch.Tensor], samples: int, grad_norm=None,
                 rates: dict[str, float] | None = None) -> None:
        """One optimizer step's values (means over its `samples` samples), kept until the window
        is logged: on an accelerator as tensors (adding them up now would launch kernels every
        step, reading them would wait for the device); on the CPU as numbers, which waits for
        nothing and is cheaper than keeping a window of small tensors alive (measured: about
        20 us a step of the default MLP). `rates`: the learning rates the step trained with
        (run_state.Run.rates, read before the scheduler sets the next step's); a window logs
        its last step's."""
        if list(values) != self.names:
            if self.steps:
                raise RuntimeError(f"the logged values changed within a window: {self.names} -> "
                                   f"{list(values)}; return the same names every step")
            self.names = list(values)
        if self.on_cpu:
            self.steps.append(([value.item() for value in values.values()], samples))
        else:
            self.steps.append((list(values.values()), samples))
        self.grad_norm = grad_norm  # a new tensor each step: keeping it needs no copy
        if rates is not None:
            self.rates = rates

    def now(self) -> float:
        """The clock, read once the device has run every step queued so far."""
        self.synchronize()
        return self.clock()

    def restart_clock(self) -> None:
        """Time from here on counts as training time of the window (after a checkpoint, say)."""
        self.window_start = self.now()

    def _window_sums(self) -> tuple[torch.Tensor, int]:
        """Every value summed over the window's steps, weighted by each step's samples, and the
        window's samples (every rank has as many: the sampler pads). The weights are Python
        numbers: a weight tensor would be a copy from the host, which waits for the device."""
        counts = [count for _, count in self.steps]
        if self.on_cpu:  # numbers: summed in Python, one tensor for the all-reduce
            totals = [0.0] * len(self.names)
            for step, count in self.steps:
                for index, value in enumerate(step):
                    totals[index] += value * count
            return torch.tensor(totals, dtype=torch.float64), sum(counts) * self.env.world_size
        # One stack of every value (step-major: each step's list is in the order of self.names),
        # a handful of kernels per window whatever the number of names.
        values = torch.stack([value for step, _ in self.steps for value in step])
        values = values.view(len(self.steps), len(self.names)).double()  # [steps, names]
        sums, start = None, 0
        for count, run in itertools.groupby(counts):  # steps of one size; an epoch's last differs
            length = len(list(run))
            part = values[start:start + length].sum(0) * count
            sums = part if sums is None else sums + part
            start += length
        return sums, sum(counts) * self.env.world_size

    # -- logging a window -------------------------------------------------------------------------

    def maybe_flush(self, step: int) -> bool:
        """End the window at `step` if one ends there (every log_every steps). The first step
        is logged too: it shows when training really started. (Not the first after a resume:
        its windows stay those of an uninterrupted run, which a tracker already holds when a
        restarted job repeats steps.) True when the window ended."""
        if step % self.log_every and step != 1:
            return False
        self.flush(step)
        return True

    def flush(self, step: int) -> None:
        """End the window at `step`: start its all-reduce (every rank calls this at the same
        steps) and write out any earlier window, whose all-reduce has had time to finish."""
        if self.steps:
            seconds = self.now() - self.window_start
            sums, samples = self._window_sums()
            self.steps = []
            record = {"step": step, **self.rates, "samples": samples, "seconds": seconds}
            compiled, self.compiled = self.compiled, compilations()
            if self.warming_up:  # first allocations, first DDP step: not a rate to report
                record["seconds"], self.warming_up = None, False
            self._count_for_headline(samples, seconds, timed=record["seconds"] is not None
                                     and compiled == self.compiled)
            if self.grad_norm is not None:
                record["grad_norm"] = self.grad_norm
            if self.guard is not None:
                record["skipped_steps"] = self.guard.skipped_in_window
                self.guard.skipped_in_window = 0
            if self.replica_groups:  # the fewest groups in a step of the window, and the most
                record["replica_groups_min"] = min(self.replica_groups)
                record["replica_groups_max"] = max(self.replica_groups)
                self.replica_groups = []
            if self.device.type == "cuda":  # this rank's peak since the last window: no sync
                record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                torch.cuda.reset_peak_memory_stats(self.device)
            handle = dist_utils.all_reduce_sum_async(sums)
            self.in_flight.append((handle, sums, list(self.names), record))
        while len(self.in_flight) > 1:
            self._write_window(*self.in_flight.pop(0))
        self.restart_clock()  # writing the log is not training time of the next window

    def write_pending(self) -> None:
        """Write out every window still in flight (waits for their all-reduces)."""
        while self.in_flight:
            self._write_window(*self.in_flight.pop(0))

    def _write_window(self, handle, sums: torch.Tensor, names: list[str], record: dict) -> None:
        if handle is not None:
            handle.wait()
        totals, samples = sums.tolist(), record.pop("samples")
        for name, total in zip(names, totals, strict=True):
            self.epoch_sums[name] = self.epoch_sums.get(name, 0.0) + total
        self.epoch_sums["samples"] = self.epoch_sums.get("samples", 0.0) + samples
        seconds = record.pop("seconds")
        if samples:  # (none when the step guard skipped every step of the window)
            record.update({name: total / samples for name, total in zip(names, totals,
                                                                        strict=True)})
        if seconds is not None and samples:
            record.update(self._rates(samples, seconds))
        if "grad_norm" in record:
            record["grad_norm"] = record["grad_norm"].item()  # the same on every rank
        if not math.isfinite(record.get("loss", 0.0)):  # the same all-reduced value everywhere
            raise UserError(
                f"training diverged: the loss is {record['loss']} at step {record['step']}; lower "
                "optim.lr, set optim.grad_clip (e.g. 1.0) or use speed.precision=bf16 or fp32")
        if self.env.is_main:
            scalars = {f"train/{name}": value for name, value in record.items() if name != "step"}
            self.writer().write("train_log.jsonl", {**record, "time": time.time()}, scalars,
                                record["step"])
        self.last = record

    def _count_for_headline(self, samples: int, seconds: float, timed: bool) -> None:
        """The run's throughput headline adds up the windows without start-up or compilation."""
        if timed:
            self.timed["samples"] += samples
            self.timed["seconds"] += seconds
            self.timed["windows"] += 1
        else:
            self.timed["left_out"] += 1

    def throughput(self) -> dict[str, float]:
        """This process's training throughput over its timed windows (samples_per_s, per rank,
        tflops_per_rank, mfu as a window's), and how many windows were left out; {} if none."""
        if not self.timed["windows"]:
            return {}
        return {**self._rates(self.timed["samples"], self.timed["seconds"]),
                "windows": self.timed["windows"], "windows_left_out": self.timed["left_out"]}

    def describe_throughput(self) -> str:
        """One line for the log: the headline throughput and what it leaves out."""
        rates = self.throughput()
        if not rates:
            return "throughput: no timed window (too few steps after start-up)"
        parts = [f"{rates['samples_per_s']:,.0f} samples/s",
                 f"{rates['samples_per_s_per_rank']:,.0f} per rank"]
        if "tokens_per_s" in rates:
            parts[:0] = [f"{rates['tokens_per_s']:,.0f} tokens/s"]
        if "tflops_per_rank" in rates:
            parts.append(f"{rates['tflops_per_rank']:.3g} TFLOP/s per rank")
        if "mfu" in rates:
            parts.append(f"MFU {rates['mfu']:.3f}")
        return (f"throughput: {', '.join(parts)}, over {rates['windows']} window(s) of training "
                f"steps ({rates['windows_left_out']} with start-up or compilation left out)")

    def _rates(self, samples: int, seconds: float) -> dict[str, float]:
        """Throughput of a window: samples/s of the job and of one rank (the ranks step
        together), the model TFLOP/s of one rank and, on a GPU of known peak, the MFU."""
        per_rank = samples / seconds / self.env.world_size
        rates = {"samples_per_s": samples / seconds, "samples_per_s_per_rank": per_rank}
        if self.tokens_per_sample:
            rates["tokens_per_s"] = rates["samples_per_s"] * self.tokens_per_sample
            rates["tokens_per_s_per_rank"] = per_rank * self.tokens_per_sample
        if self.flops_per_sample:
            rates["tflops_per_rank"] = per_rank * self.flops_per_sample / 1e12
            if self.peak_flops:
                rates["mfu"] = per_rank * self.flops_per_sample / self.peak_flops
        return rates

    # -- epochs -----------------------------------------------------------------------------------

    def start_epoch(self, resumed_within: bool) -> None:
        """A new epoch's sums; kept when resuming part-way into it (they were in the checkpoint).
        The epoch's clock starts (training from here on)."""
        if not resumed_within:
            self.epoch_sums = {}
        self.restart_clock()
        self.epoch_start = self.window_start

    def end_training(self, step: int) -> None:
        """The epoch's training steps are done (its last window ends); validation comes next."""
        self.flush(step)
        self.validation_start = self.now()

    def end_epoch(self, epoch: int, step: int, val: dict) -> dict:
        """The epoch's record: training means over the epoch, the validation metrics and the
        time spent (on the epoch's clock); written to metrics.jsonl and TensorBoard by rank 0."""
        end = self.now()
        self.write_pending()
        samples = self.epoch_sums.get("samples", 0.0)
        record = self._where(epoch, step)
        if samples:
            record.update({f"train_{name}": total / samples
                           for name, total in self.epoch_sums.items() if name != "samples"})
        record.update({f"val_{name}": value for name, value in val.items()})
        record.update({"train_seconds": self.validation_start - self.epoch_start,
                       "val_seconds": end - self.validation_start})
        if not self.by_steps:
            record["epoch_seconds"] = end - self.epoch_start
        if self.env.is_main:  # TensorBoard: the validation metrics (train/ has the windows)
            scalars = {f"val/{name}": value for name, value in val.items()}
            part = "run" if self.by_steps else "epoch"
            rest = {f"{part}/{name}": value for name, value in record.items()
                    if name != "step" and not name.startswith("val_")}
            self.writer().write("metrics.jsonl", record, scalars, step, {**scalars, **rest})
        return record

    def validation_record(self, epoch: int, step: int, val: dict) -> dict:
        """A step-cadence validation's record (train.val_every_steps), written as end_epoch's
        is, marked mid_epoch: the validation metrics and their time."""
        record = {**self._where(epoch, step), **({} if self.by_steps else {"mid_epoch": True})}
        record.update({f"val_{name}": value for name, value in val.items()})
        record["val_seconds"] = self.now() - self.validation_start
        if self.env.is_main:
            scalars = {f"val/{name}": value for name, value in val.items()}
            self.writer().write("metrics.jsonl", record, scalars, step)
        return record

    def _where(self, epoch: int, step: int) -> dict:
        """Where a record was made: its step, and its epoch unless the run goes by steps."""
        return {"step": step} if self.by_steps else {"epoch": epoch, "step": step}

    # -- resume and output ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the epoch's sums so far. Every window is written first, to
        the files and the trackers: a job killed after the checkpoint resumes after them, so a
        record still queued then would be lost."""
        self.write_pending()
        if self._writer is not None:
            self._writer.drain()
        return {"epoch_sums": dict(self.epoch_sums)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch_sums = dict(state.get("epoch_sums", {}))

    def resume(self, position: Position, truncate: bool) -> None:
        """On resume (after load_state_dict): drop the records that training from `position`
        writes again (rank 0). A finished run rerun writes nothing again: `truncate=False`."""
        self.purge_step = position.step + 1
        if truncate and self.env.is_main:
            _keep_records(self.run_dir / "train_log.jsonl", lambda r: r["step"] <= position.step)
            # A validation inside an epoch (or in a run by steps) is kept by its step.
            _keep_records(self.run_dir / "metrics.jsonl",
                          lambda r: r.get("epoch", 0) <= position.epoch
                          or (r.get("mid_epoch", "epoch" not in r) and r["step"] <= position.step))

    def writer(self) -> Writer:
        """Rank 0's writer, started at the first record (not before step 1)."""
        if self._writer is None:
            self._writer = Writer(self.run_dir, self.purge_step, self.trackers)
        return self._writer

    def close(self) -> None:
        self.write_pending()
        if self._writer is not None:
            self._writer.close()
