"""Building a run: the config, the process group, the run folder, data, task, model, optimizer
and schedule, restored from a checkpoint when there is one to resume (start_run); and the lines
that describe it (describe_run)."""

import dataclasses
import functools
import logging
import os
import weakref
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ddpkit import (
    __version__,
    checkpoint,
    checkpoint_files,
    checkpoint_load,
    dist_utils,
    flops,
    lifecycle,
    micro_batch,
    optimizers,
    run_folder,
    supervisor,
    validation,
    writes,
)
from ddpkit.config import (
    UserError,
    check_profile_steps,
    given_keys,
    inactive_settings,
    load_config,
)
from ddpkit.data import DataFingerprint, DataModule
from ddpkit.estimates import estimate_streams
from ddpkit.parallel import build_model, check_batch_statistics, values_per_channel, wrap_model
from ddpkit.position import Position
from ddpkit.resume_settings import apply_changed_settings, refuse_fixed_settings
from ddpkit.run_end import write_summary
from ddpkit.run_folder import RunDir
from ddpkit.run_state import Run
from ddpkit.schedules import build_schedule, schedule_builder
from ddpkit.schema import SCHEDULE_NAMES
from ddpkit.smoke import smoke_test_config
from ddpkit.speed import Speed, describe_speed, grad_scaler, resolve_speed
from ddpkit.tasks import Task, build_task, check_best_metric
from ddpkit.training_log import TrainingLog
from ddpkit.utilization import count_flops, run_peak_flops

log = logging.getLogger("ddp")


def start_run(argv: list[str]) -> Run:
    """Config, process group, run folder, data, task, model, optimizer; resumed if there is a
    checkpoint to resume. Bad input is one line from rank 0, and leaves no run folder behind."""
    cfg, env, device, groups = start_processes(argv)
    ft = None
    if groups:  # one of torchft's replica groups (extras/replicas)
        from ddpkit.extras.replicas.groups import ReplicaGroups

        with dist_utils.agree_on_errors():
            ft = ReplicaGroups(*groups, env, device, cfg)
        env = dataclasses.replace(env, leads=ft.leads)  # the group that writes changes
    folder = run_folder.open_run_dir(cfg, env, groups[0] if groups else None)
    train_env = training_env(env, groups)
    try:
        with dist_utils.agree_on_errors():  # bad input stops every rank together, reported once
            memory = micro_batch.memory_for(cfg, device)  # micro_batch_size=auto: GPUs only
            data, task, model, input_shape, speed = checked_parts(cfg, env, device, train_env,
                                                                  groups)
        resume_from, saved_config = resume_point(cfg, folder.path)
    except BaseException:
        folder.discard_if_unused()  # a launch that failed before training leaves no folder
        raise
    if env.is_main and not cfg.train.fast_dev_run:
        for note in settings_without_effect(cfg, argv, data):
            log.warning(note)
    # Per-rank seed from here on: dropout masks differ between ranks, as they would between
    # the samples of one big batch on one process.
    torch.manual_seed(cfg.run.seed + train_env.rank)
    run = assemble(cfg, env, device, data, task, speed, model, input_shape, folder.path,
                   resumed=resume_from is not None)
    guard_and_average(run)  # before a resume: their state is in the checkpoint
    run.fingerprint = DataFingerprint.of(data.splits.train, cfg)  # (the data as it is now)
    if resume_from:
        resume(run, folder, resume_from, saved_config)
    elif not folder.created:  # restarted before its first checkpoint: it logs from step 1 again
        run.training_log.resume(run.position, truncate=True)
    if memory:  # the model, its optimizer state and averages in place: the tries see them
        fit_micro_batch(run, folder, memory)
    if ft:  # the live replica groups: this one's gradients averaged with theirs, healed by them
        ft.join(run, resumed=bool(resume_from) or not folder.created)
    with dist_utils.agree_on_errors():  # a full disk is one line, not a traceback on rank 0
        if env.is_main:
            writes.write_text(folder.path / "config.yaml", OmegaConf.to_yaml(cfg))
            write_summary(run, "running")
    if run.trackers:  # before step 1: the tracker run exists (or its failure is said) at once
        run.trackers.start()
    return run


def checked_parts(cfg: DictConfig, env: dist_utils.DistEnv, device: torch.device,
                  train_env: dist_utils.DistEnv, groups: tuple | None) -> tuple:
    """The data, task and model of the run, its input shape and speed settings, each checked
    before any step (a mistake is one line): (data, task, model, input_shape, speed)."""
    torch.manual_seed(cfg.run.seed)  # same initial weights on every rank (DDP syncs too)
    data = DataModule(cfg, env, device, train_env)
    task = build_task(cfg, data.splits)
    check_best_metric(cfg.train.best_metric, [type(task)],
                      f"the {cfg.task.name or data.splits.task} task")
    check_profile_steps(cfg, run_length(cfg, data))
    input_shape = task.input_shape(data.first_samples()[0])
    model = build_model(cfg.model, input_shape, task.num_outputs,
                        task.model_inputs(data.sample_batch()))
    check_batch_statistics(cfg, values_per_channel(
        model, functools.partial(build_model, cfg.model, input_shape, task.num_outputs),
        task.model_inputs(data.sample_batch(1))), data.micro_batch_size,
        data.smallest_micro_batch(), train_env.world_size)
    speed = resolve_speed(cfg, device, input_shape)
    check_optim(cfg)
    if cfg.guard.enabled and groups:
        raise UserError("guard.enabled does not work with replica groups yet (each "
                        "group's step is voted on): set guard.enabled=false")
    if tracking_on(cfg):
        trackers().check_installed(cfg)
    return data, task, model, input_shape, speed


def start_processes(argv: list[str]
                    ) -> tuple[DictConfig, dist_utils.DistEnv, torch.device, tuple | None]:
    """The config (cut down to a smoke test for train.fast_dev_run), logging, the device, the
    process group, and (this group, groups) when the job is one of torchft's replica groups."""
    env = dist_utils.get_dist_env()
    groups = replica_groups()
    cfg = load_config(argv, world_size=training_env(env, groups).world_size)
    dist_utils.setup_logging(env)
    if cfg.train.fast_dev_run:
        lifecycle.no_retries()
        cfg = smoke_test_config(cfg)
    if cfg.ddp.debug:
        dist_utils.debug_mode()
    device = dist_utils.select_device(env, cfg.train.device)
    dist_utils.init_distributed(env, device, cfg.ddp.backend, cfg.ddp.timeout_minutes)
    return cfg, env, device, groups


def replica_groups() -> tuple[int, int] | None:
    """(this group, groups) when run.sh launched this job as one of torchft's replica groups
    (REPLICA_GROUP set); their code (extras/replicas) is imported only then."""
    if "REPLICA_GROUP" not in os.environ:
        return None
    from ddpkit.extras.replicas.launch import from_environment

    return from_environment()


def training_env(env: dist_utils.DistEnv, groups: tuple[int, int] | None) -> dist_utils.DistEnv:
    """The ranks the training data is split over: the job's, or every replica group's."""
    if groups is None:
        return env
    from ddpkit.extras.replicas.launch import data_env

    return data_env(env, groups)


def tracking_on(cfg: DictConfig) -> bool:
    """Whether the config turns an experiment tracker on (MLflow, W&B), or a Kubeflow TrainJob
    asks for progress reports (its endpoint in the environment)."""
    return bool(cfg.tracking.mlflow or cfg.tracking.wandb
                or os.environ.get("KUBEFLOW_TRAINER_STATUS_URL"))


def trackers():
    """ddpkit.extras.trackers, imported only for a run that tracks (tracking_on)."""
    from ddpkit.extras import trackers

    return trackers


def check_optim(cfg: DictConfig) -> None:
    """The optimizer's name and arguments and the schedule's name, before any folder or model
    is made: a mistake is one line naming the key."""
    optimizers.check_optimizer(cfg)
    if cfg.optim.schedule not in SCHEDULE_NAMES:
        schedule_builder(cfg.optim.schedule)


def run_length(cfg: DictConfig, data: DataModule) -> int:
    """The optimizer steps of the whole run: its epochs, or train.max_steps if fewer."""
    total = cfg.train.epochs * data.steps_per_epoch
    return min(total, cfg.train.max_steps) if cfg.train.max_steps else total


def settings_without_effect(cfg: DictConfig, argv: list[str], data: DataModule) -> list[str]:
    """One line for each setting given that cannot take effect in this run: with the other
    settings (their declarations' acts_with), with this data, or in a run this long."""
    notes = inactive_settings(cfg, given_keys(argv))
    total_steps = run_length(cfg, data)
    every = cfg.train.val_every_steps
    if every and every >= total_steps:
        notes.append(f"train.val_every_steps={every} has no effect: the run has {total_steps} "
                     "steps, so it validates only at the end of each epoch")
    windows = cfg.train.estimate_windows
    if windows and not estimate_streams(data):
        notes.append(f"train.estimate_windows={windows} has no effect: the training split of "
                     f"data.dataset={cfg.data.dataset} is not drawn with replacement (a "
                     "streams.SampledStream, as data.dataset=tokens gives)")
    guard = cfg.guard
    if guard.enabled and guard.spike_factor and guard.window >= total_steps:
        notes.append(f"guard.window={guard.window} has no effect: the run has {total_steps} "
                     f"steps, so guard.spike_factor={guard.spike_factor} never judges one (it "
                     "waits for guard.window updated steps first): lower guard.window")
    return notes


def resume_point(cfg: DictConfig, run_dir: Path) -> tuple[Path | None, dict | None]:
    """The checkpoint this run resumes (None: a new run) and the config it was written with;
    a changed setting that a resume cannot honour is one line."""
    resume_from = checkpoint_files.chosen_by_rank_0(
        functools.partial(checkpoint_files.checkpoint_to_resume, cfg, run_dir))
    saved_config = None
    if resume_from:
        with dist_utils.agree_on_errors():  # a damaged checkpoint: one line, nothing wrapped
            saved_config = checkpoint_load.load_checkpoint(resume_from).get("config")
            refuse_fixed_settings(cfg, saved_config, resume_from)
    return resume_from, saved_config


def assemble(cfg: DictConfig, env: dist_utils.DistEnv, device: torch.device, data: DataModule,
             task: Task, speed: Speed, model: torch.nn.Module, input_shape, run_dir: Path,
             resumed: bool) -> Run:
    """The Run at step 0: the model wrapped, its optimizer and schedule, the training log (with
    what its MFU is measured against), the supervisor and the checkpointer."""
    total_steps = run_length(cfg, data)
    flops_per_sample = count_flops(cfg, data, task, input_shape, model)  # the bare model
    model = wrap_model(model, cfg, env, device, speed)
    with dist_utils.agree_on_errors():  # your param_groups / optimizer / schedule builders
        optimizer = optimizers.build_optimizer(model, cfg, speed.fused_adamw)
        scheduler, plateau = build_schedule(optimizer, cfg, total_steps,
                                            task.higher_is_better)
    tracked = (trackers().Trackers(cfg, run_dir, total_steps)
               if env.is_main and tracking_on(cfg) else None)
    training_log = TrainingLog(run_dir, env, device, tracked, log_every=cfg.train.log_every)
    training_log.flops_per_sample = flops_per_sample
    training_log.tokens_per_sample = task.tokens_per_sample(data.sample_batch(2))
    training_log.by_steps = data.by_steps
    training_log.peak_flops = run_peak_flops(cfg, device, speed)[0]
    return Run(cfg, env, device, data, task, speed, model, optimizer, scheduler,
               grad_scaler(speed, device), training_log, run_dir, Position(), total_steps,
               resumed=resumed, supervisor=supervisor.Supervisor(env, cfg.ddp.timeout_minutes),
               checkpointer=checkpoint.Checkpointer(run_dir, cfg, env), trackers=tracked,
               plateau=plateau, validation=validation.Validation(cfg, task))


def guard_and_average(run: Run) -> None:
    """guard.enabled: every step judged by the step guard before its update; train.ema_decay:
    the averaged weights kept beside the model."""
    if run.cfg.guard.enabled:
        from ddpkit.step_guard import StepGuard

        # Through a weak reference: a cycle (run -> guard -> run) would keep the DDP model and
        # its process group alive until exits.end_cleanly's gc.collect, which must not free them.
        runs = weakref.ref(run)
        run.guard = StepGuard(run.cfg, lambda: runs().position.step, run.env.is_main)
        run.train_step = run.guard.train_step
        run.training_log.guard = run.guard
    if run.cfg.train.ema_decay:
        from ddpkit.ema import WeightAverage

        run.ema = WeightAverage(run.model, run.cfg.train.ema_decay)


def fit_micro_batch(run: Run, folder: RunDir, memory) -> None:
    """train.micro_batch_size=auto: the largest micro-batch that fits every GPU, or one line."""
    try:
        with dist_utils.agree_on_errors():
            micro_batch.choose_micro_batch(run, memory)
    except BaseException:
        folder.discard_if_unused()
        raise


def resume(run: Run, folder: RunDir, resume_from: Path, saved_config: dict | None) -> None:
    """The run put back where the checkpoint left it, this run's changed settings in effect."""
    try:
        with dist_utils.agree_on_errors():  # into the wrapped model: each rank its part
            run.position = checkpoint_load.restore_parts(resume_from, run.parts(), run.env)
    except BaseException:
        folder.discard_if_unused()
        raise
    checkpoint_files.release(resume_from)  # read on every rank: this run's saves may prune it
    run.checkpointer.last_saved = run.position.step  # saved already: not again at the end
    validation.restored(run)  # the best checkpoint kept again
    run.training_log.resume(run.position, truncate=run.position.step < run.total_steps)
    apply_changed_settings(run, saved_config)
    if run.data.by_steps:
        log.info("resumed from %s: step %d", resume_from, run.position.step)
    else:
        log.info("resumed from %s: step %d, epoch %d, %d step(s) into it", resume_from,
                 run.position.step, run.position.epoch + 1, run.position.step_in_epoch)


def describe_run(run: Run) -> None:
    """What runs where: the folder, the processes and devices, the batch, the FLOPs."""
    cfg, env, data = run.cfg, run.env, run.data
    log.info("run folder: %s | template release %s", run.run_dir, __version__)
    length = (f"{run.total_steps} steps of windows drawn with replacement (no epochs)"
              if data.by_steps else f"{data.steps_per_epoch} steps per epoch, "
                                    f"{run.total_steps} steps")
    log.info("%d process(es) on %s, backend %s, %s | %s task, %d outputs | %s", env.world_size,
             run.device, dist_utils.backend_name(), describe_speed(run.speed),
             cfg.task.name or data.splits.task, run.task.num_outputs, length)
    ranks = data.train_env.world_size  # with replica groups, every group's processes
    log.info("effective global batch %d = %d per micro-batch x %d process(es)%s x %d "
             "accumulation step(s)", data.micro_batch_size * ranks * data.grad_accum_steps,
             data.micro_batch_size, ranks,
             f" in {run.replicas.groups} replica groups" if run.replicas else "",
             data.grad_accum_steps)
    optimizer = getattr(run.optimizer, "optimizer", run.optimizer)  # a replica group's voted one
    log.info("%s | %s", optimizers.describe_optimizer(optimizer, not cfg.optim.param_groups),
             describe_schedule(cfg, run.plateau is not None))
    peak, device_name = run_peak_flops(cfg, run.device, run.speed)
    log.info(flops.describe_flops(run.training_log.flops_per_sample, peak, device_name, run.device,
                                  run.training_log.tokens_per_sample))


def describe_schedule(cfg: DictConfig, plateau: bool) -> str:
    optim = cfg.optim
    # a schedule of yours (SCHEDULES) that is not a plateau gets no warmup from the engine
    warmup_applies = plateau or optim.schedule in SCHEDULE_NAMES
    warmup = (f"{optim.warmup_steps} warmup steps, then "
              if optim.warmup_steps and warmup_applies else "")
    if plateau:
        return (f"schedule: {warmup}x {optim.gamma:g} after {optim.plateau_patience} "
                "validation(s) without improvement (plateau)")
    floor = f" (floor {optim.min_lr_ratio:g} x lr)" if optim.min_lr_ratio else ""
    return f"schedule: {warmup}{optim.schedule}{floor}"
