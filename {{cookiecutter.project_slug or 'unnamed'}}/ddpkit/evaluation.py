"""Evaluation as a library: exact metrics of a split on any number of processes, and the files an
evaluation writes. train.py (validation every epoch) and evaluate.py (a checkpoint) both use it.

Each rank runs the model on its own contiguous block of the split (samplers.EvalShardSampler: no
sample twice, none padded in) and keeps what the task asks for each sample: one float64 row
(task.rows), plus the loss summed in float64. One all-gather brings every rank's rows together in
rank order, which is the split's own order, and the task computes every metric once over the
whole split, on every rank. So the numbers (PR curves included) are those a single process
gives, whatever the process count; averaging per-rank metrics would not be (a PR curve cannot
be averaged, and a mean of means is wrong when shards differ in size).

Memory: the rows of the whole split, `samples x task.row_width x 8` bytes on every rank (40,000
samples of 100 classes: 32 MB). For splits of millions, `eval.binned_thresholds=N` keeps a
fixed-size summary per rank instead (task.summarize: counts at N score thresholds; regression is
exact this way) and all-reduces it: memory independent of the split's size.
"""

import contextlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader

from ddpkit import dist_utils
from ddpkit.checkpoint_files import MODEL_FILE
from ddpkit.config import UserError
from ddpkit.data import count_samples, map_tensors, to_device
from ddpkit.models import call_model
from ddpkit.parallel import is_sharded
from ddpkit.report import SUMMARY_FILE
from ddpkit.samplers import EvalShardSampler
from ddpkit.speed import FLOAT32, Speed
from ddpkit.streams import RankStream
from ddpkit.supervisor import Supervisor
from ddpkit.tasks import Task
from ddpkit.writes import put_in_place

log = logging.getLogger("ddp")


def loss_terms(loss) -> dict[str, torch.Tensor]:
    """A task's loss as named terms: {"loss": total}, plus "loss_<name>" for each term of a
    loss given as a dict (the total is their sum)."""
    if not isinstance(loss, dict):
        return {"loss": loss}
    if not loss:
        raise ValueError("the task's loss returned an empty dict: return at least one term")
    return {"loss": sum(loss.values()), **{f"loss_{name}": term for name, term in loss.items()}}


def as_float64(outputs):
    """Model outputs (a tensor, or a dict / tuple of them) in float64, whatever the autocast:
    metrics and the evaluation loss are computed in double precision."""
    return map_tensors(lambda tensor: tensor.double() if tensor.is_floating_point() else tensor,
                       outputs)


def shard_sizes(loader: DataLoader) -> list[int] | None:
    """Every rank's sample count, when the loader's sampler (or a stream's plan) knows it
    without asking."""
    if isinstance(loader.dataset, RankStream):
        return loader.dataset.block_sizes
    sampler = loader.sampler.sampler if isinstance(loader.sampler, BatchSampler) else loader.sampler
    return sampler.block_sizes() if isinstance(sampler, EvalShardSampler) else None


class SplitOutputs:
    """What one rank keeps of its shard: per-sample rows (or, binned, a fixed-size summary) and
    the loss terms summed over its samples."""

    def __init__(self, task: Task, bins: int = 0):
        self.task, self.bins = task, bins
        self.rows: list[torch.Tensor] = []
        self.summary = None
        self.loss_sums: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, outputs, batch) -> None:
        samples = count_samples(batch)
        for name, value in loss_terms(self.task.loss(outputs, batch)).items():
            total = value.detach().double() * samples
            self.loss_sums[name] = self.loss_sums[name] + total if name in self.loss_sums else total
        rows = self.task.rows(outputs, batch)
        if self.bins:
            summary = self.task.summarize(rows, self.bins)
            self.summary = summary if self.summary is None else self.summary + summary
        else:
            self.rows.append(rows)
        self.count += samples

    def compute(self, sizes: list[int] | None, reference: dict | None = None,
                detail: bool = True) -> dict:
        """Metrics of the whole split (collectives: every rank calls it, whatever its shard)."""
        names = list(self.loss_sums)
        device = next(iter(self.loss_sums.values())).device if names else torch.device("cpu")
        sums = (torch.stack(list(self.loss_sums.values())) if names
                else torch.zeros(0, dtype=torch.float64))
        if self.bins:
            width = self.task.summary_size(self.bins)
            mine = self.summary if self.summary is not None else torch.zeros(
                width, dtype=torch.float64, device=device)
            total, sums, names, count = _sum_over_ranks(mine, sums, names, self.count, sizes)
            result = self.task.summary_metrics(total, self.bins, reference, detail)
        else:
            mine = torch.cat(self.rows) if self.rows else torch.zeros(
                0, self.task.row_width, dtype=torch.float64, device=device)
            rows, sums, names = _gather_rows(mine, sums, names, sizes)
            count = len(rows)
            result = self.task.metrics(rows, reference, detail)
            if detail:
                result["rows"] = rows
        losses = {name: (value / max(count, 1)) for name, value in zip(names, sums.tolist(),
                                                                       strict=True)}
        return {**losses, **result, "num_samples": count}


def _empty_shard(sizes: list[int] | None) -> bool:
    return sizes is None or min(sizes) == 0


def _gather_rows(rows: torch.Tensor, sums: torch.Tensor, names: list[str],
                 sizes: list[int] | None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Every rank's rows in rank order, and the loss sums added up, on every rank: one
    all_gather (rows padded to the largest shard, the sums in one extra row)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows, sums, names
    if _empty_shard(sizes):  # a rank without samples does not know the loss's term names
        mine = dict(zip(names, sums.tolist(), strict=True))
        parts = dist_utils.gather_objects((rows.cpu(), mine))
        return _combine(parts, rows.device)
    width = max(rows.shape[1], len(sums))
    padded = rows.new_zeros(max(sizes) + 1, width)
    padded[:len(rows), :rows.shape[1]] = rows
    padded[-1, :len(sums)] = sums
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    gathered = torch.cat([part[:size, :rows.shape[1]] for part, size in zip(parts, sizes,
                                                                            strict=True)])
    totals = torch.stack([part[-1, :len(sums)] for part in parts]).sum(0)
    return gathered, totals, names


def _combine(parts: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    names = next((list(p[1]) for p in parts if p[1]), [])
    rows = torch.cat([p[0] for p in parts]).to(device)
    sums = torch.tensor([sum(p[1].get(n, 0.0) for p in parts) for n in names],
                        dtype=torch.float64)
    return rows, sums, names


def _sum_over_ranks(summary: torch.Tensor, sums: torch.Tensor, names: list[str], count: int,
                    sizes: list[int] | None):
    """Binned mode: the summaries, loss sums and sample counts of all ranks added up."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return summary, sums, names, count
    if _empty_shard(sizes):
        mine = dict(zip(names, sums.tolist(), strict=True))
        parts = dist_utils.gather_objects((summary.cpu(), mine, count))
        _, totals, names = _combine([(torch.zeros(0, 1), p[1]) for p in parts], summary.device)
        summary = torch.stack([p[0] for p in parts]).sum(0).to(summary.device)
        return summary, totals, names, sum(p[2] for p in parts)
    packed = torch.cat([summary, sums.to(summary.device), summary.new_tensor([count])])
    dist.all_reduce(packed)
    return (packed[:len(summary)], packed[len(summary):-1].cpu(), names,
            int(packed[-1].item()))


@torch.no_grad()
def evaluate_split(model: torch.nn.Module, loader: DataLoader, device: torch.device, task: Task,
                   speed: Speed = FLOAT32, bins: int = 0, reference: dict | None = None,
                   detail: bool = True, supervisor: Supervisor | None = None) -> dict | None:
    """Exact metrics of the whole split (see the module's docstring); call it on every rank.

    Pass the unwrapped model: DDP's forward may sync buffers, which would need every rank to run
    the same number of batches, and shards may differ by one sample. With a supervisor, every
    rank asks it about a preemption at each batch that all ranks have (shards differ by at most
    one sample; it checks at the first and then as often as in training), and all of them return
    None when it comes.
    """
    was_training = model.training
    model.eval()
    outputs = SplitOutputs(task, bins)
    counts = batch_counts(loader)
    common = min(counts) if supervisor and counts else 0
    sharded = is_sharded(model)
    if sharded and counts and min(counts) == 0:  # every rank knows: all of them stop here
        raise UserError("parallel.strategy=fsdp evaluates with at least one sample per process: "
                        "use fewer processes than the split has samples")
    inputs = None
    for index, batch in enumerate(loader):
        if index < common and supervisor.should_stop(first=index == 0):
            model.train(was_training)
            return None
        batch = to_device(batch, device)
        inputs = speed.inputs(task.model_inputs(batch))
        with speed.autocast(device):
            predicted = call_model(model, inputs)
        # Metrics in float64, whatever the autocast (a task may convert its rows itself).
        outputs.add(as_float64(predicted) if task.outputs_in_float64 else predicted, batch)
    if sharded and counts and len(loader) < max(counts):
        # An FSDP forward gathers weights from every rank: a rank whose shard has one batch
        # fewer runs its last batch once more, unrecorded, so that no rank waits in vain.
        with speed.autocast(device):
            call_model(model, inputs)
    model.train(was_training)
    return outputs.compute(shard_sizes(loader), reference, detail)  # the same calls everywhere


def batch_counts(loader: DataLoader) -> list[int]:
    """Every rank's number of batches ([] when the shards' sizes are not known)."""
    sizes = shard_sizes(loader) or []
    if isinstance(loader.dataset, RankStream):
        batch_size = loader.dataset.plan.batch
    else:  # whole batches: a BatchSampler
        batch_size = loader.batch_size or loader.sampler.batch_size
    return [math.ceil(size / batch_size) for size in sizes]


def scalars(result: dict) -> dict:
    """The single-number metrics of a result (for logs, TensorBoard and summary tables)."""
    return {key: value for key, value in result.items() if isinstance(value, float)}


def run_folder_choice(run_dir: Path) -> tuple[Path, str]:
    """What evaluating a run folder takes (evaluate.py eval.checkpoint=<run>, sample.py, and the
    hint at the end of training), and which step's weights those are: the model a finished run
    exported from its best validation (model.pt: the run's result); else the run folder itself,
    whose newest intact checkpoint holds the last weights (averaged or trained, as the reader
    chooses: weight_choice)."""
    run_dir = Path(run_dir)
    summary = {}
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    exported = summary.get("exported") or {}
    model = run_dir / MODEL_FILE
    if summary.get("status") == "done" and exported.get("from") == "best" and model.is_file():
        return model, f"the best validation's weights, step {exported['step']}"
    return run_dir, "the last weights"


class OutputFolder:
    """Where rank 0 writes an evaluation. Every file goes to a hidden folder inside it first and
    is moved in place once all of them are written, so a failure (a full disk, a folder that
    cannot be written) or a stop leaves no file half written; folders this evaluation created
    are removed again. An OSError becomes one line naming the folder (UserError)."""

    def __init__(self, path: Path):
        self.path = path
        self.staging = path / f".eval-{os.getpid()}.tmp"
        self.created: list[Path] = []  # innermost first
        self.done = False

    def open(self) -> None:
        """Create the folders: before the evaluation, so that one that cannot be written is said
        before any work."""
        self.created = [p for p in (self.path, *self.path.parents) if not p.exists()]
        with self.writing():
            self.staging.mkdir(parents=True)

    def commit(self) -> None:
        with self.writing():
            for entry in sorted(self.staging.rglob("*")):
                if entry.is_file():
                    target = self.path / entry.relative_to(self.staging)
                    target.parent.mkdir(exist_ok=True)
                    put_in_place(entry, target, exists="replace")
        self.done = True
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        for folder in [] if self.done else self.created:
            with contextlib.suppress(OSError):  # not empty: someone else's files are there now
                folder.rmdir()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            self.discard()
            raise UserError(f"cannot write the evaluation in {self.path} ({error}): free some "
                            "space or pass a folder you can write, eval.output_dir=...") from None


def write_json(path: Path, value, indent: int | None = 1) -> None:
    path.write_text(json.dumps(value, indent=indent) + "\n")


def write_outputs(folder: OutputFolder, result: dict, task: Task, header: dict, step: int,
                  split: str, save_predictions: bool) -> list[str]:
    """Rank 0: metrics.json, curves.json, the task's plots, TensorBoard, predictions.npz, all or
    none of them (OutputFolder)."""
    from torch.utils.tensorboard import SummaryWriter

    out_dir = folder.staging
    report = {**header, **{k: v for k, v in result.items() if k not in ("curves", "rows")}}
    with folder.writing():
        write_json(out_dir / "metrics.json", report)
        written = ["metrics.json"]
        if "curves" in result:
            write_json(out_dir / "curves.json", result["curves"], indent=None)
            written.append("curves.json")
        with SummaryWriter(log_dir=str(out_dir / "tb")) as writer:
            for name, value in scalars(result).items():
                writer.add_scalar(f"{split}/{name}", value, step)
            written += task.write_outputs(result, out_dir, writer, step, split)
        written.append("tb/")
        if save_predictions:
            arrays = task.predictions(result["rows"])
            np.savez(out_dir / "predictions.npz", **arrays)
            written.append("predictions.npz")
    folder.commit()
    return written


def summary_lines(result: dict, task: Task) -> list[str]:
    lines = [f"  {name:<24} {value:.6f}" for name, value in scalars(result).items()]
    per_class = result.get("average_precision_per_class")
    if per_class and "confusion_matrix" in result:
        matrix = np.array(result["confusion_matrix"])
        recall = matrix.diagonal() / np.maximum(matrix.sum(axis=1), 1)
        order = sorted(range(len(per_class)), key=per_class.__getitem__)
        shown = order[:task.plot_classes]
        lines.append(f"  per class ({'all' if len(shown) == len(order) else 'lowest AP'}):"
                     "  class  AP        recall")
        lines += [f"              {cls:>5}  {per_class[cls]:.6f}  {recall[cls]:.6f}"
                  for cls in sorted(shown)]
    return lines
