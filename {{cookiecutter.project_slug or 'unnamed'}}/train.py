"""Train the model, on one process or many.

    python train.py                      # one process: CPU, or the first GPU
    ./run.sh                             # torchrun: one process per GPU (see run.sh)
    ./run.sh train.epochs=50 optim.lr=0.001 --config configs/my_experiment.yaml

Each run gets one folder, runs/<run.name>-<time>/ (chosen by rank 0 and shared with the others),
holding config.yaml, checkpoints/, tb/ (TensorBoard), train_log.jsonl, metrics.jsonl,
summary.json (how the run ended, its headline metric) and curves.png. Only rank 0 writes.
The distributed parts are the few lines that mention dist_utils, the sampler's epoch and the
wrapped model; the data, model and task are what the config names.
"""

import contextlib
import functools
import json
import logging
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import default_collate
from tqdm import tqdm

from ddpkit import checkpoint, dist_utils, flops, recipes, report, trackers
from ddpkit.checkpoint import Position
from ddpkit.config import UserError, load_config
from ddpkit.data import DataModule, count_samples, detached, to_device
from ddpkit.evaluation import evaluate_split, loss_terms, scalars
from ddpkit.parallel import (
    ModelState,
    build_model,
    full_tensor,
    settle_gradient_buckets,
    skip_gradient_sync,
    with_rank0_buffers,
    wrap_model,
)
from ddpkit.profiling import StepProfiler
from ddpkit.speed import FLOAT32, Speed, build_optimizer, grad_scaler, resolve_speed
from ddpkit.speed import describe as describe_speed
from ddpkit.tasks import Task, build_task
from ddpkit.training_log import TrainingLog

log = logging.getLogger("ddp")


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lr_schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int, schedule: str
                ) -> torch.optim.lr_scheduler.LambdaLR:
    """Each parameter group's base rate times lr_factor of the steps done (checkpointed through
    its state_dict like any torch scheduler)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_factor, warmup=warmup, total=total, schedule=schedule))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list,
               task: Task, device: torch.device, speed: Speed = FLOAT32,
               scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0
               ) -> tuple[dict[str, torch.Tensor], int, torch.Tensor | None]:
    """One optimizer step over this rank's micro-batches. Returns the step's logged values
    (means over its samples: the loss, its named terms, the task's train_scalars), its sample
    count, and the gradient norm before clipping (None without clipping). Tensors stay on the
    device: reading them would make the CPU wait for the GPU.

    With several micro-batches (gradient accumulation) the gradients are all-reduced once, on
    the last one: the others run forward *and* backward inside no_sync(), since DDP decides in
    forward whether the coming backward will communicate.
    """
    optimizer.zero_grad(set_to_none=True)
    if len(micro_batches) == 1:  # no accumulation: the common case, with no bookkeeping
        samples = count_samples(micro_batches[0])
        values = forward_backward(model, micro_batches[0], task, device, speed, scaler)
    else:
        sizes = [count_samples(batch) for batch in micro_batches]
        samples = sum(sizes)
        values = {}
        for index, (batch, size) in enumerate(zip(micro_batches, sizes, strict=True)):
            # Each micro-batch's mean loss weighted by its share of the step's samples: the
            # accumulated gradient is that of the mean over the whole step, as without
            # accumulation. On the last micro-batch DDP averages the gradients over ranks.
            share = size / samples
            with (skip_gradient_sync(model) if index < len(micro_batches) - 1
                  else contextlib.nullcontext()):
                part = forward_backward(model, batch, task, device, speed, scaler, share)
            for name, value in part.items():
                values[name] = values[name] + value if name in values else value
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
    return values, samples, grad_norm


def forward_backward(model: torch.nn.Module, batch, task: Task, device: torch.device,
                     speed: Speed, scaler: torch.amp.GradScaler | None, share: float = 1.0
                     ) -> dict[str, torch.Tensor]:
    """Forward and backward of one micro-batch whose loss counts `share` of the step's; returns
    its logged values (detached), times `share`."""
    batch = to_device(batch, device)
    with speed.autocast(device):
        outputs = model(speed.inputs(task.model_inputs(batch)))
        terms = loss_terms(task.loss(outputs, batch))
    loss = terms["loss"] if share == 1 else terms["loss"] * share
    (scaler.scale(loss) if scaler else loss).backward()
    # The task's scalars are computed from outputs cut off the graph: they build none, with no
    # no_grad() context to enter and leave every step.
    terms.update(task.train_scalars(detached(outputs), batch))
    if share == 1:
        return {name: value.detach() for name, value in terms.items()}
    return {name: value.detach() * share for name, value in terms.items()}


@dataclass
class Setup:
    """What the loop works with: built once by setup(), then only read (but the position)."""

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
    log: TrainingLog
    run_dir: Path
    position: Position
    total_steps: int
    resumed: bool
    supervisor: dist_utils.Supervisor  # preemption signals and stalls
    checkpointer: checkpoint.Checkpointer
    trackers: trackers.Trackers | None  # MLflow / W&B, rank 0 only, when the config asks
    buckets_settled: bool = False  # resumed: see epoch_steps

    def parts(self) -> dict:
        """Everything a checkpoint saves and a resume restores, by name."""
        # Model and optimizer keyed by parameter name, each rank its part (checkpoint.py), so a
        # checkpoint resumes at any process count and with either strategy.
        return {"model": ModelState(self.model), "optimizer": ModelState(self.model,
                self.optimizer), "scheduler": self.scheduler, "scaler": self.scaler,
                "train_log": self.log}

    def save(self) -> None:
        """A checkpoint of where training is (collective)."""
        self.checkpointer.save(self.parts(), self.position, self.cfg)


def setup(argv: list[str]) -> Setup:
    """Config, process group, run folder, data, task, model, optimizer; resumed if there is a
    checkpoint to resume. Bad input is one line from rank 0, and leaves no run folder behind."""
    env = dist_utils.get_dist_env()
    cfg = load_config(argv, world_size=env.world_size)
    dist_utils.setup_logging(env)
    if cfg.train.fast_dev_run:
        dist_utils.no_retries()
        cfg = smoke_test_config(cfg)
    if cfg.ddp.debug:
        dist_utils.debug_mode()
    device = dist_utils.select_device(env, cfg.train.device)
    dist_utils.init_distributed(env, device, cfg.ddp.backend, cfg.ddp.timeout_minutes)
    run = checkpoint.open_run_dir(cfg, env)
    saved_config = None
    try:
        with dist_utils.agree_on_errors():  # bad input stops every rank together, reported once
            torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP syncs too)
            data = DataModule(cfg, env, device)
            task = build_task(cfg, data.splits)
            input_shape = task.input_shape(data.datasets["train"][0])
            model = build_model(cfg.model, input_shape, task.num_outputs)
            speed = resolve_speed(cfg, device, input_shape)
            trackers.check_installed(cfg)
        resume_from = checkpoint.chosen_by_rank_0(
            functools.partial(checkpoint.checkpoint_to_resume, cfg, run.path))
        if resume_from:
            with dist_utils.agree_on_errors():  # a damaged checkpoint: one line, nothing wrapped
                saved_config = checkpoint.load_checkpoint(resume_from).get("config")
                refuse_fixed_settings(cfg, saved_config, resume_from)
    except BaseException:
        run.discard_if_unused()  # a launch that failed before training leaves no folder
        raise
    # Per-rank seed from here on: dropout masks differ between ranks, as they would between
    # the samples of one big batch on one process.
    torch.manual_seed(cfg.run.seed + env.rank)

    total_steps = cfg.train.epochs * data.steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    model = wrap_model(model, cfg, env, device, speed)
    optimizer = build_optimizer(model, cfg, speed)
    scheduler = lr_schedule(optimizer, cfg.optim.warmup_steps, total_steps, cfg.optim.schedule)
    tracked = trackers.Trackers(cfg, run.path) if env.is_main and trackers.enabled(cfg) else None
    train_log = TrainingLog(run.path, env, device, tracked)
    train_log.flops_per_sample = count_flops(cfg, data, task, input_shape)
    train_log.peak_flops = peak_flops(cfg, device, speed)[0]
    s = Setup(cfg, env, device, data, task, speed, model, optimizer, scheduler,
              grad_scaler(speed, device), train_log, run.path,
              Position(), total_steps, resumed=resume_from is not None,
              supervisor=dist_utils.Supervisor(env, cfg.ddp.timeout_minutes),
              checkpointer=checkpoint.Checkpointer(run.path, cfg, env), trackers=tracked)
    if resume_from:
        try:
            with dist_utils.agree_on_errors():  # into the wrapped model: each rank its part
                s.position = checkpoint.restore(resume_from, s.parts(), env)
        except BaseException:
            run.discard_if_unused()
            raise
        checkpoint.release(resume_from)  # read on every rank: this run's saves may prune it
        s.log.resume(s.position, truncate=s.position.step < total_steps)
        apply_changed_settings(s, saved_config)
        log.info("resumed from %s: step %d, epoch %d, %d step(s) into it", resume_from,
                 s.position.step, s.position.epoch + 1, s.position.step_in_epoch)
    elif not run.created:  # restarted before its first checkpoint: it logs from step 1 again
        s.log.resume(s.position, truncate=True)
    with dist_utils.agree_on_errors():  # a full disk is one line, not a traceback on rank 0
        if env.is_main:
            checkpoint.write_text(run.path / "config.yaml", OmegaConf.to_yaml(cfg))
            write_summary(s, "running")
    if tracked:  # before step 1: the tracker run exists (or its failure is said) from the start
        tracked.start()
    return s


# Settings a resumed run cannot change: the data it has seen this epoch, and how it is split and
# ordered, follow from them, so a new value would train some samples twice and skip others.
FIXED_ON_RESUME = (
    "run.seed", "train.global_batch_size", "train.limit_train_batches", "data.dataset",
    "data.root", "data.val_fraction", "data.test_fraction", "data.split_seed",
    "data.synthetic_samples", "data.synthetic_features", "data.synthetic_classes",
    "data.image_size")
# Where the run is written and what it resumes from: not settings of the training itself.
NOT_COMPARED = ("run.name", "run.output_dir", "run.dir", "train.resume")


def changed_settings(cfg: DictConfig, saved: dict | None) -> dict[str, tuple]:
    """Each setting whose value differs from the one a checkpoint was written with:
    name -> (checkpoint's value, this run's). Empty for a checkpoint that holds no config."""
    if not saved:
        return {}
    old, new = (OmegaConf.to_container(c) for c in (OmegaConf.create(saved), cfg))
    changes = {}
    for section, values in new.items():
        for name, value in values.items() if isinstance(values, dict) else ():
            key = f"{section}.{name}"
            before = old.get(section, {}).get(name, value)
            if key not in NOT_COMPARED and before != value:
                changes[key] = (before, value)
    return changes


def refuse_fixed_settings(cfg: DictConfig, saved: dict | None, source: Path) -> None:
    """One line when a setting that a resume cannot honour differs from the checkpoint's."""
    for key, (before, value) in changed_settings(cfg, saved).items():
        if key in FIXED_ON_RESUME:
            raise UserError(
                f"{key}={value} differs from {before} in checkpoint {source}, and a resumed run "
                f"cannot change it (the epoch's data would be seen twice or skipped): resume with "
                f"{key}={before}, or start a new run with train.resume=never")


def apply_changed_settings(s: Setup, saved: dict | None) -> None:
    """After a resume, the settings changed since the checkpoint take effect, so that what the
    records say (config.yaml, model.pt, new checkpoints) is what trains. The optimizer and the
    schedule came back with the checkpoint's learning rate and weight decay: this run's replace
    them, on this run's schedule. The rest is read from the config anyway."""
    changes = changed_settings(s.cfg, saved)
    if "optim.lr" in changes:
        before, value = changes["optim.lr"]
        s.scheduler.base_lrs = [base * value / before for base in s.scheduler.base_lrs]
    # The rate at this step on this run's schedule (its length or warmup may have changed too).
    scheduler = s.scheduler
    for group, base, factor in zip(s.optimizer.param_groups, scheduler.base_lrs,
                                   scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    if "optim.weight_decay" in changes:
        for group in s.optimizer.param_groups:
            group["weight_decay"] = changes["optim.weight_decay"][1]
    if changes and s.env.is_main:
        log.info("changed since the checkpoint, in effect from step %d: %s", s.position.step + 1,
                 ", ".join(f"{key} {before} -> {value}"
                           for key, (before, value) in changes.items()))


def training_loss(task: Task, model: torch.nn.Module, batch) -> torch.Tensor:
    """The loss a training step differentiates (what count_flops counts)."""
    return loss_terms(task.loss(model(task.model_inputs(batch)), batch))["loss"]


def count_flops(cfg: DictConfig, data: DataModule, task: Task, input_shape) -> float | None:
    """Model FLOPs of one training sample (forward, loss, backward), counted on a copy of the
    model on the meta device (flops.py); None for a model that cannot run there."""
    train = data.datasets["train"]
    batch = default_collate([train[0], train[min(1, len(train) - 1)]])  # 2: BatchNorm trains
    try:
        total = flops.count_training_flops(
            functools.partial(build_model, cfg.model, input_shape, task.num_outputs),
            functools.partial(training_loss, task), batch)
    except Exception:  # a model that reads values (.item(), data-dependent shapes); describe()
        return None  # says so, and a real bug in it is reported by the training step
    return total / count_samples(batch)


def peak_flops(cfg: DictConfig, device: torch.device, speed: Speed) -> tuple[float | None, str]:
    """The device's peak FLOP/s at the run's precision (None if unknown), and its name."""
    return flops.peak_flops(device, "fp32" if speed.autocast_dtype is None else "bf16",
                            cfg.speed.tf32)


def write_summary(s: Setup, status: str) -> None:
    """<run>/summary.json (rank 0): how the run stands, and its task's headline validation
    metric, last and best (what report.py and sweep.py rank runs by)."""
    summary = {"status": status, "step": s.position.step, "epoch": s.position.epoch,
               "total_steps": s.total_steps, "world_size": s.env.world_size,
               "headline": s.task.headline, "higher_is_better": s.task.higher_is_better}
    if status != "running":
        summary["throughput"] = s.log.throughput()  # this job's timed windows (training_log)
        history = report.read_run(s.run_dir)
        values = history.val_values()
        summary.update({"metric": f"val_{history.headline}", "best": history.best(),
                        "last": values[-1] if values else None})
    checkpoint.write_text(s.run_dir / report.SUMMARY_FILE, json.dumps(summary, indent=1))


def finish(s: Setup, status: str) -> None:
    """Rank 0, after the training log is closed: summary.json, curves.png (when done), the
    trackers' files, and the trackers closed."""
    if not s.env.is_main:
        return
    write_summary(s, status)
    files = [s.run_dir / "config.yaml", s.run_dir / report.SUMMARY_FILE]
    if status == "done" and s.cfg.train.plot_curves:
        files.append(report.plot_runs([report.read_run(s.run_dir)], s.run_dir
                                      / report.CURVES_FILE, title=s.run_dir.name))
    if s.trackers:
        s.trackers.log_files(files, "run")
        s.trackers.close("finished" if status == "done" else status)


def describe(s: Setup) -> None:
    cfg, env, data = s.cfg, s.env, s.data
    log.info("run folder: %s", s.run_dir)
    log.info("%d process(es) on %s, backend %s, %s | %s task, %d outputs | %d steps per epoch, "
             "%d steps", env.world_size, s.device, dist_utils.backend_name(),
             describe_speed(s.speed), cfg.task.name or data.splits.task, s.task.num_outputs,
             data.steps_per_epoch, s.total_steps)
    log.info("effective global batch %d = %d per micro-batch x %d process(es) x %d "
             "accumulation step(s)", data.micro_batch_size * env.world_size
             * cfg.train.grad_accum_steps, data.micro_batch_size, env.world_size,
             cfg.train.grad_accum_steps)
    peak, device_name = peak_flops(cfg, s.device, s.speed)
    log.info(flops.describe(s.log.flops_per_sample, peak, device_name, s.device))


def stop_for_preemption(s: Setup) -> None:
    """Save where every rank stopped, then leave with the 'preempted' status (collective)."""
    s.log.flush(s.position.step, s.scheduler.get_last_lr()[0])
    s.save()
    s.checkpointer.wait()  # an asynchronous write too: on disk before the job leaves
    s.log.close()
    with dist_utils.agree_on_errors():
        finish(s, "preempted")
    raise dist_utils.Preempted(f"saved step {s.position.step} in {s.run_dir}; run the same "
                               "command again to continue from there")


@contextlib.contextmanager
def summary_on_failure(s: Setup):
    """summary.json says how a run that did not finish ended: "failed" (an error) or
    "interrupted" (Ctrl-C); a preemption has written "preempted" itself."""
    try:
        yield
    except dist_utils.Preempted:
        raise
    except BaseException as error:
        if s.env.is_main:
            status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
            with contextlib.suppress(Exception):  # never hide the error that ended the run
                write_summary(s, status)
        raise


def main(argv: list[str]) -> None:
    started = time.perf_counter()
    recipes.load()  # your model.py, data_sources.py and tasks.py add to the registries
    s = setup(argv)
    describe(s)
    if s.cfg.train.fast_dev_run:
        with removed_at_the_end(s):
            end_smoke_test(s, train_epochs(s), started)
        return
    with summary_on_failure(s):
        save_and_export(s, train_epochs(s))
    with dist_utils.agree_on_errors():  # summary.json, curves.png, the trackers' files
        finish(s, "done")
    log.info(s.log.describe_throughput())
    log.info("done: checkpoints in %s, the final model in %s, TensorBoard logs in %s",
             s.run_dir / "checkpoints", s.run_dir / checkpoint.MODEL_FILE, s.run_dir / "tb")
    log.info("evaluate with: ./run.sh evaluate.py eval.checkpoint=%s", s.run_dir)


def train_epochs(s: Setup) -> int:
    """The training loop, from where setup left it to the end; returns the step of the last
    checkpoint it saved (-1: none)."""
    cfg, model, data, task, position, train_log = s.cfg, s.model, s.data, s.task, s.position, s.log
    # Settings the loop reads every step, as plain numbers (an OmegaConf read is far slower).
    epochs, log_every, ckpt_every = cfg.train.epochs, cfg.train.log_every, cfg.train.ckpt_every
    grad_clip, limit_val = cfg.optim.grad_clip, cfg.train.limit_val_batches
    last_saved = position.step if s.resumed else -1
    show_bar = s.env.is_main and cfg.train.progress_bar and sys.stderr.isatty()
    profiler = StepProfiler(cfg, s.run_dir, s.env.rank, s.device, position.step)
    while position.epoch < epochs and position.step < s.total_steps:
        model.train()
        train_log.start_epoch(resumed_within=position.step_in_epoch > 0)
        bar = tqdm(total=data.steps_per_epoch, initial=position.step_in_epoch, leave=False,
                   desc=f"epoch {position.epoch + 1}/{epochs}", disable=not show_bar)
        for micro_batches in epoch_steps(s):
            values, samples, grad_norm = train_step(model, s.optimizer, micro_batches, task,
                                                    s.device, s.speed, s.scaler, grad_clip)
            train_log.add_step(values, samples, grad_norm)
            s.scheduler.step()
            profiler.step()
            position.step += 1
            position.step_in_epoch += 1
            bar.update()
            # The first step is logged too: it shows when training really started. (Not the
            # first after a resume: its windows stay those of an uninterrupted run, which a
            # tracker already holds when a restarted job repeats steps.)
            if position.step % log_every == 0 or position.step == 1:
                train_log.flush(position.step, s.scheduler.get_last_lr()[0])
                bar.set_postfix(loss=f"{train_log.last.get('loss', math.nan):.4f}")
            if s.supervisor.should_stop():  # a preemption signal: every rank stops here
                stop_for_preemption(s)
            if ckpt_every and position.step % ckpt_every == 0:
                train_log.flush(position.step, s.scheduler.get_last_lr()[0])
                s.save()
                train_log.restart_clock()  # the write is not training time of the next window
                last_saved = position.step
            if position.step == s.total_steps:
                break
        train_log.end_training(position.step, s.scheduler.get_last_lr()[0])
        bar.close()
        # Validation: the exact, sharded evaluation of evaluate.py, on the unwrapped model (the
        # same on every rank: BatchNorm statistics are rank 0's, as DDP's next forward has them).
        val = evaluate_split(with_rank0_buffers(model), data.eval_loader("val", limit_val),
                             s.device, task, s.speed, cfg.eval.binned_thresholds, detail=False,
                             supervisor=s.supervisor)
        if val is None:  # preempted during validation: it runs again after the resume
            stop_for_preemption(s)
        record = train_log.end_epoch(position.epoch + 1, position.step, scalars(val))
        log.info("epoch %3d/%d  step %5d  %s", position.epoch + 1, epochs,
                 position.step, "  ".join(f"{name} {value:.4f}" for name, value in record.items()
                                          if isinstance(value, float)))
        if position.step_in_epoch >= data.steps_per_epoch:
            position.epoch, position.step_in_epoch = position.epoch + 1, 0
    profiler.close()
    return last_saved


def epoch_steps(s: Setup):
    """The micro-batches of the epoch's steps from the position on. The first step of a resumed
    process runs its first micro-batch once more before, thrown away: DDP then all-reduces in
    the bucket layout the uninterrupted run had at that step (parallel.settle_gradient_buckets),
    and the resumed run stays bitwise equal to it at any process count."""
    for micro_batches in s.data.train_steps(s.position.epoch, s.position.step_in_epoch):
        if s.resumed and not s.buckets_settled:
            settle_gradient_buckets(s.model, functools.partial(
                forward_backward, s.model, micro_batches[0], s.task, s.device, s.speed, None))
            s.buckets_settled = True
        yield micro_batches


def save_and_export(s: Setup, last_saved: int) -> None:
    """The last checkpoint (unless the loop just saved it), on disk, the final model exported,
    and the training log closed."""
    if last_saved != s.position.step:
        s.save()
    s.checkpointer.wait()
    export(s)
    s.log.close()


# --- train.fast_dev_run: a smoke test of the whole path in seconds ------------------------------

SMOKE_TEST_SETTINGS = {
    "run.name": ".fast_dev_run", "run.dir": "", "train.resume": "never", "train.epochs": 1,
    "train.max_steps": 0, "train.limit_train_batches": 2, "train.limit_val_batches": 1,
    "train.log_every": 1, "train.ckpt_every": 0, "train.progress_bar": False,
    "train.plot_curves": False, "tracking.mlflow": False, "tracking.wandb": False,
    "profile.enabled": False,
}


def smoke_test_config(cfg: DictConfig) -> DictConfig:
    """The run's config, cut down to a smoke test in a temporary run folder."""
    cfg = cfg.copy()
    for key, value in SMOKE_TEST_SETTINGS.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@contextlib.contextmanager
def removed_at_the_end(s: Setup):
    """The smoke test's run folder is deleted when it ends, whether it passed or failed."""
    try:
        yield
    finally:
        if s.env.is_main:
            shutil.rmtree(s.run_dir, ignore_errors=True)


def end_smoke_test(s: Setup, last_saved: int, started: float) -> None:
    """After the smoke test's training steps: a checkpoint, the export, one test batch on every
    rank; then "ok" with what ran."""
    save_and_export(s, last_saved)
    test = evaluate_split(with_rank0_buffers(s.model), s.data.eval_loader("test", limit=1),
                          s.device, s.task, s.speed, s.cfg.eval.binned_thresholds, detail=False)
    loss, test_loss = s.log.last.get("loss", math.nan), test.get("loss", math.nan)
    log.info("fast_dev_run ok in %.1f s on %d process(es): %d training steps (loss %.4f), a "
             "validation and a test batch on every rank (test loss %.4f), a checkpoint and the "
             "export; the temporary run folder is removed", time.perf_counter() - started,
             s.env.world_size, s.position.step, loss, test_loss)


def export(s: Setup) -> None:
    """The final model as one file (collective: with FSDP the shards are gathered)."""
    weights = ModelState(s.model, whole=True).state_dict()
    with dist_utils.agree_on_errors():
        if s.env.is_main:
            checkpoint.export_model(weights, s.run_dir / checkpoint.MODEL_FILE, s.position.step,
                                    s.cfg)


if __name__ == "__main__":
    dist_utils.run_main(main)
