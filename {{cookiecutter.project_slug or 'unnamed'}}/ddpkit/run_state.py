"""A training run as the loop sees it (Run: what it trains, with what, and where it is), and the
learner's work of one step (train_step, forward_backward, epoch_steps)."""

import contextlib
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from ddpkit import checkpoint, dist_utils
from ddpkit.data import DataModule, count_samples, detached, to_device
from ddpkit.evaluation import loss_terms
from ddpkit.models import call_model
from ddpkit.optimizers import rate_names
from ddpkit.parallel import (
    ModelState,
    for_evaluation,
    full_tensor,
    settle_gradient_buckets,
    skip_gradient_sync,
    with_rank0_buffers,
)
from ddpkit.position import Position
from ddpkit.speed import FLOAT32, Speed
from ddpkit.supervisor import Supervisor
from ddpkit.tasks import Task
from ddpkit.training_log import TrainingLog


@dataclass
class Run:
    """What the loop works with: built once by run_setup.start_run, then only read (but the
    position, which the loop advances)."""

    cfg: DictConfig
    env: dist_utils.DistEnv
    device: torch.device
    data: DataModule
    task: Task
    speed: Speed
    model: torch.nn.Module  # wrapped (DDP, compiled) as wrap_model made it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    training_log: TrainingLog
    run_dir: Path
    position: Position
    total_steps: int
    resumed: bool
    supervisor: Supervisor  # preemption signals and stalls
    checkpointer: checkpoint.Checkpointer  # knows when a checkpoint is due, and the last saved
    trackers: object | None  # extras.trackers.Trackers: MLflow / W&B, rank 0 only, if asked
    # optim.schedule=plateau: stepped after each validation with the headline metric
    plateau: torch.optim.lr_scheduler.ReduceLROnPlateau | None = None
    buckets_settled: bool = False  # resumed: see epoch_steps
    evaluated: torch.nn.Module | None = None  # parallel.for_evaluation's, when compiling
    validation: object = None  # validation.Validation: the cadence, the best, early stopping
    # What model.pt holds: {"from": last | best, "step", "weights": averaged | trained}
    exported: dict | None = None
    replicas: object = None  # extras.replicas.groups.ReplicaGroups: one of torchft's replica groups
    # A step of the extras' own in place of train_step (replica groups: each update voted on)
    train_step: Callable | None = None
    guard: object = None  # step_guard.StepGuard (guard.enabled): its train_step is the step
    ema: object = None  # ema.WeightAverage (train.ema_decay): the averaged weights
    fingerprint: object = None  # data.DataFingerprint: what the data was, where it says

    def __post_init__(self):
        # Named as the groups were built: a checkpoint of release 1.0.0 loads groups unnamed.
        self.rate_names = rate_names(self.optimizer)

    def parts(self) -> dict:
        """Everything a checkpoint saves and a resume restores, by name."""
        # Model and optimizer keyed by parameter name, each rank its part (checkpoint.py), so a
        # checkpoint resumes at any process count and with either strategy.
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # a VotedOptimizer's
        return {"model": ModelState(self.model), "optimizer": ModelState(self.model,
                optimizer), "scheduler": self.scheduler, "scaler": self.scaler,
                "train_log": self.training_log, "plateau": self.plateau,
                "validation": self.validation, "guard": self.guard, "ema": self.ema,
                "data": self.fingerprint}

    def averaged_weights(self):
        """With train.ema_decay, the averaged weights in the model for a block (validation, the
        export); else nothing changes."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

    def model_for_evaluation(self) -> torch.nn.Module:
        """What validation and the smoke test's test batch run: the user's module, compiled when
        training is, its buffers (BatchNorm statistics) rank 0's on every rank, as DDP's next
        forward has them (collective)."""
        with_rank0_buffers(self.model)
        if self.evaluated is None:
            self.evaluated = for_evaluation(self.model, self.speed)
        return self.evaluated

    def progress_bar(self) -> tqdm:
        """The epoch's progress bar: rank 0, on a terminal, unless train.progress_bar=false."""
        show = self.env.is_main and self.cfg.train.progress_bar and sys.stderr.isatty()
        epoch = f"epoch {self.position.epoch + 1}/{self.cfg.train.epochs}"
        return tqdm(total=self.data.steps_per_epoch, initial=self.position.step_in_epoch,
                    leave=False, desc="steps" if self.data.by_steps else epoch,
                    disable=not show)

    def rates(self) -> dict[str, float]:
        """The learning rates of the step about to run, as the optimizer holds them (whichever
        scheduler set them last: per step, plateau, a resume), by the names they are logged
        under: lr/<group> for each group, and lr, the first group's. The loop hands them to
        the training log before the scheduler sets the next step's."""
        groups = self.optimizer.param_groups
        rates = {"lr": groups[0]["lr"]}
        rates.update(zip(self.rate_names, (group["lr"] for group in groups), strict=True))
        return rates

    def validated(self, record: dict) -> None:
        """After a validation: a plateau schedule weighs the task's headline metric (the same
        on every rank, so every rank cuts the rate together)."""
        if self.plateau is not None:
            self.plateau.step(record[f"val_{self.task.headline}"])

    def save(self) -> None:
        """A checkpoint of where training is (collective)."""
        self.checkpointer.save(self.parts(), self.position, self.cfg)

    def save_mid_training(self) -> None:
        """A checkpoint during the steps (a periodic one, or a preemption's): the log's window
        ends at it first, so the resumed run's windows are those of an uninterrupted one."""
        self.training_log.flush(self.position.step)
        self.save()


def epoch_steps(run: Run):
    """The micro-batches of the epoch's steps from the position on. The first step of a resumed
    process runs its first micro-batch once more before, thrown away: DDP then all-reduces in
    the bucket layout the uninterrupted run had at that step (parallel.settle_gradient_buckets),
    and the resumed run stays bitwise equal to it at any process count."""
    for micro_batches in run.data.train_steps(run.position.epoch, run.position.step_in_epoch):
        if run.resumed and not run.buckets_settled:
            settle_gradient_buckets(run.model, functools.partial(
                forward_backward, run.model, micro_batches[0], run.task, run.device, run.speed,
                None))
            run.buckets_settled = True
        yield micro_batches


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list,
               task: Task, device: torch.device, speed: Speed = FLOAT32,
               scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0
               ) -> tuple[dict[str, torch.Tensor], int, torch.Tensor | None]:
    """One optimizer step over this rank's micro-batches. Returns the step's logged values
    (means over its samples: the loss, its named terms, the task's train_scalars), its sample
    count, and the gradient norm before clipping (None without clipping). Tensors stay on the
    device: reading them would make the CPU wait for the GPU."""
    optimizer.zero_grad(set_to_none=True)
    values, samples = compute_gradients(model, micro_batches, task, device, speed, scaler)
    return values, samples, apply_gradients(model, optimizer, scaler, grad_clip)


def compute_gradients(model, micro_batches, task, device, speed, scaler
                      ) -> tuple[dict[str, torch.Tensor], int]:
    """Forward and backward of the step's micro-batches: the gradients, averaged over the ranks
    (DDP's all-reduce, or FSDP's reduce-scatter); the logged values and the sample count.

    With several micro-batches (gradient accumulation) the gradients are all-reduced once, on
    the last one: the others run forward *and* backward inside no_sync(), since DDP decides in
    forward whether the coming backward will communicate."""
    weight = getattr(micro_batches, "weight", 1.0)  # data.Step: this rank's share of the step
    if len(micro_batches) == 1:  # no accumulation: the common case, with no bookkeeping
        # A weight-0 step (a stream's rank with no share of the last step) trains on nothing:
        # its stand-in sample stays out of the logged means and the throughput.
        samples = count_samples(micro_batches[0]) if weight else 0
        return forward_backward(model, micro_batches[0], task, device, speed, scaler,
                                weight=weight), samples
    sizes = [count_samples(batch) for batch in micro_batches]
    total = sum(sizes)
    values = {}
    for index, (batch, size) in enumerate(zip(micro_batches, sizes, strict=True)):
        # Each micro-batch's mean loss weighted by its share of the step's samples: the
        # accumulated gradient is that of the mean over the whole step, as without
        # accumulation. On the last micro-batch DDP averages the gradients over ranks.
        share = size / total
        with (skip_gradient_sync(model) if index < len(micro_batches) - 1
              else contextlib.nullcontext()):
            part = forward_backward(model, batch, task, device, speed, scaler, share, weight)
        for name, value in part.items():
            values[name] = values[name] + value if name in values else value
    return values, total if weight else 0


def apply_gradients(model, optimizer, scaler, grad_clip: float) -> torch.Tensor | None:
    """Clip (when asked) and apply the averaged gradients; returns the norm before clipping."""
    grad_norm = None
    if grad_clip:
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the loss-scaled ones
        # The gradients are already averaged over ranks, so every rank computes the same norm.
        # (With FSDP each rank holds a shard: the norm is over all shards, the same everywhere.)
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if scaler:
        scaler.step(optimizer)  # skipped if fp16 overflowed; the scale then shrinks
        scaler.update()
    else:
        optimizer.step()
    return grad_norm


def forward_backward(model: torch.nn.Module, batch, task: Task, device: torch.device,
                     speed: Speed, scaler: torch.amp.GradScaler | None, share: float = 1.0,
                     weight: float = 1.0) -> dict[str, torch.Tensor]:
    """Forward and backward of one micro-batch whose loss counts `share` of the step's on this
    rank, and this rank's loss `weight` times the ranks' mean share (data.Step); returns its
    logged values (detached), times `share`."""
    batch = to_device(batch, device)
    with speed.autocast(device):
        outputs = call_model(model, speed.inputs(task.model_inputs(batch)))
        terms = loss_terms(task.loss(outputs, batch))
    loss = terms["loss"] if share * weight == 1 else terms["loss"] * (share * weight)
    (scaler.scale(loss) if scaler else loss).backward()
    # The task's scalars are computed from outputs cut off the graph: they build none, with no
    # no_grad() context to enter and leave every step.
    terms.update(task.train_scalars(detached(outputs), batch))
    if share == 1:
        return {name: value.detach() for name, value in terms.items()}
    return {name: value.detach() * share for name, value in terms.items()}
