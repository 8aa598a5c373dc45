"""Evaluate a checkpoint on the test (or val) split, with one process or many.

    ./run.sh evaluate.py                                      # the newest run in runs/
    ./run.sh evaluate.py eval.checkpoint=runs/<run>           # torchrun, as many as run.sh says
    ./run.sh evaluate.py eval.checkpoint=runs/<run>/model.pt  # the final model, in one file
    python evaluate.py eval.checkpoint=runs/<run> data.root=/scratch/moved   # one process

A run folder means what the run gives as its result: with train.export=best, the model.pt it
exported (the best validation's weights); otherwise its newest intact checkpoint (the last
weights), and one line says which it took and how to take another (runs/<run>/checkpoints: the
newest checkpoint; runs/<run>/checkpoints/step-N: that one). A checkpoint folder (saved by any
number of processes, DDP or FSDP) and a one-file model (model.pt, export.py) load alike, into
the bare model on every rank. Which weights (docs/checkpoints.md, "Which weights"): a run that
kept averaged weights (train.ema_decay) is scored on its averages, as its validation scored
them; eval.weights=trained takes the trained ones; the line that reports it names them. The
model and the task come from the checkpoint (with the config it was trained with); data
settings may be overridden (data that moved: `data.root=`), and so may the evaluation, speed
and device settings. A `model.*` or `task.*` override that contradicts the checkpoint is an
error. Every rank evaluates its own block of the split and the metrics are computed once from
all of them (evaluation.py), so every number (PR curves included) is the one a single process
gives.
Rank 0 writes, into <run>/eval-<split>/: metrics.json, curves.json, the task's plots,
TensorBoard scalars and curves in tb/, and predictions.npz with eval.save_predictions=true.
When the run was trained with a tracker on (tracking.*), the metrics (as <split>/<metric>) and
these files go to the same tracker run too.
"""

import logging
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ddpkit import (
    checkpoint_files,
    checkpoint_load,
    dist_utils,
    lifecycle,
    recipes,
    weight_choice,
)
from ddpkit.checkpoint_files import MODEL_FILE
from ddpkit.config import UserError, config_from_dict, given_keys, load_config
from ddpkit.data import DataModule
from ddpkit.evaluation import (
    OutputFolder,
    evaluate_split,
    run_folder_choice,
    scalars,
    summary_lines,
    write_outputs,
)
from ddpkit.parallel import build_model
from ddpkit.run_setup import trackers, tracking_on
from ddpkit.speed import resolve_speed
from ddpkit.supervisor import Preempted, Supervisor
from ddpkit.tasks import build_task

log = logging.getLogger("ddp")

FROM_THIS_CALL = ("eval", "speed", "ddp")  # sections taken whole from this call's config
FIXED_BY_CHECKPOINT = ("model", "task")  # sections an override may not contradict


def checkpoint_to_evaluate(cfg: DictConfig) -> Path:
    """eval.checkpoint, or the newest run in run.output_dir when it is not set."""
    if cfg.eval.checkpoint:
        return chosen(cfg.eval.checkpoint)
    newest = checkpoint_files.newest_run(Path(cfg.run.output_dir))
    if newest is None:
        raise UserError(f"eval.checkpoint is not set and {cfg.run.output_dir}/ holds no run with "
                        "a checkpoint: train first (./run.sh), or pass eval.checkpoint=<run "
                        "folder, checkpoint folder or model.pt>")
    log.info("eval.checkpoint not set: evaluating the newest run, %s", newest)
    return chosen(str(newest))


def chosen(spec: str) -> Path:
    """What eval.checkpoint=`spec` names, found and verified: a checkpoint or a model file as
    given; for a run folder, what the run gives as its result (evaluation.run_folder_choice),
    said in one line with how to take another."""
    run_dir = Path(spec)
    if not (run_dir / "checkpoints").is_dir():  # a checkpoint, a model file, a checkpoints/
        return checkpoint_files.find_checkpoint(spec)
    target, weights = run_folder_choice(run_dir)
    source = checkpoint_files.find_checkpoint(str(target))
    other = (f"its newest checkpoint: eval.checkpoint={run_dir / 'checkpoints'}"
             if source.name == MODEL_FILE else
             f"another: eval.checkpoint={run_dir / 'checkpoints'}/step-<N>")
    log.info("run folder %s: evaluating %s (%s); %s", run_dir, source, weights, other)
    return source


def evaluation_config(cfg: DictConfig, argv: list[str], stored: dict, source: Path) -> DictConfig:
    """The checkpoint's training config with this call's settings for what may change."""
    trained = config_from_dict(stored, f"config stored in {source}")
    for key in given_keys(argv):
        section = key.split(".")[0]
        value, was = OmegaConf.select(cfg, key), OmegaConf.select(trained, key)
        if section in FIXED_BY_CHECKPOINT and value != was:
            raise UserError(f"{key}={value} contradicts the checkpoint {source}, which was "
                            f"trained with {key}={was}: drop the override (the model and the "
                            "task come from the checkpoint)")
        if section in ("data", "tracking") or key == "train.device":
            OmegaConf.update(trained, key, value)
    for section in FROM_THIS_CALL:
        trained[section] = cfg[section]
    return trained


def output_folder(cfg: DictConfig, source: Path) -> tuple[Path, Path]:
    """The run folder of the checkpoint, and where the evaluation goes."""
    in_run = source.parent.name == "checkpoints"  # else model.pt (or a file) in its run folder
    run_dir = source.parent.parent if in_run else source.parent
    return run_dir, Path(cfg.eval.output_dir or run_dir / f"eval-{cfg.eval.split}")


def stop_if_asked(result: dict | None, supervisor: Supervisor) -> dict:
    """A preemption signal (SIGTERM, SIGUSR1) stops every rank, before anything is written."""
    if result is None or supervisor.should_stop(first=True):
        raise Preempted("evaluation stopped by a signal, nothing written: run the "
                                   "same command again")
    return result


def main(argv: list[str]) -> None:
    recipes.load()  # your model.py, data_sources.py and tasks.py add to the registries
    cfg = load_config(argv)
    env = dist_utils.get_dist_env()
    dist_utils.setup_logging(env)
    device = dist_utils.select_device(env, cfg.train.device)
    dist_utils.init_distributed(env, device, cfg.ddp.backend, cfg.ddp.timeout_minutes)
    supervisor = Supervisor(env, cfg.ddp.timeout_minutes)

    folder = None
    # Chosen, verified and held by rank 0: a run that trains on may not prune it meanwhile.
    source = checkpoint_files.chosen_by_rank_0(lambda: checkpoint_to_evaluate(cfg))
    try:
        with dist_utils.agree_on_errors():  # a bad checkpoint stops every rank, reported once
            state = checkpoint_load.load_checkpoint(source)
            which = weight_choice.choose(source, state, cfg.eval.weights,
                                         f"eval.weights={cfg.eval.weights}")
            run_cfg = evaluation_config(cfg, argv, state.get("config", {}), source)
            run_dir, out_dir = output_folder(cfg, source)
            # Rank 0's own work after the evaluation, checked before it: trackers, the folder.
            if tracking_on(run_cfg):
                trackers().check_for_evaluation(run_cfg, run_dir)
            if env.is_main:
                folder = OutputFolder(out_dir)
                folder.open()
            data = DataModule(run_cfg, env, device)
            task = build_task(run_cfg, data.splits)
            input_shape = task.input_shape(data.first_samples()[0])
            model = build_model(run_cfg.model, input_shape, task.num_outputs,
                                task.model_inputs(data.sample_batch()))
            checkpoint_load.load_model_weights(model, source,
                                               weight_choice.read(source, state, which))
            # Precision and memory format from this call's speed settings (no compile).
            speed = resolve_speed(run_cfg, device, input_shape)
        result, seconds = evaluate(cfg, model, data, task, device, speed, supervisor)
        with dist_utils.agree_on_errors():  # a full disk on rank 0 stops every rank, once
            if env.is_main:
                header = {"checkpoint": str(source), "step": state.get("step"),
                          "weights": which, "split": cfg.eval.split,
                          "task": run_cfg.task.name or data.splits.task,
                          "world_size": env.world_size}
                written = write_outputs(folder, result, task, header, state.get("step") or 0,
                                        cfg.eval.split, cfg.eval.save_predictions)
    finally:
        if folder is not None:
            folder.discard()
    if env.is_main:
        log.info("evaluated %s on the %s split: %d samples, %d process(es), %.2fs",
                 weight_choice.describe(which, source, state.get("step")), cfg.eval.split,
                 result["num_samples"], env.world_size, seconds)
        for line in summary_lines(result, task):
            log.info(line)
        log.info("wrote %s in %s", ", ".join(written), out_dir)
        track(run_cfg, run_dir, result, state.get("step") or 0, cfg.eval.split,
              [out_dir / name for name in written], out_dir.name)


def evaluate(cfg: DictConfig, model, data: DataModule, task, device, speed,
             supervisor: Supervisor) -> tuple[dict, float]:
    """The split's metrics on every rank, and the seconds they took."""
    # No DDP wrapper: evaluation computes no gradients, and the weights are the same everywhere.
    model = model.to(device, memory_format=speed.memory_format)
    start = time.perf_counter()
    split, bins = cfg.eval.split, cfg.eval.binned_thresholds
    reference = None
    if split != "val" and task.needs_reference:  # e.g. the decision threshold, chosen on val
        reference = stop_if_asked(evaluate_split(
            model, data.eval_loader("val"), device, task, speed, bins, detail=False,
            supervisor=supervisor), supervisor)
    result = stop_if_asked(evaluate_split(model, data.eval_loader(split), device, task, speed,
                                          bins, reference, supervisor=supervisor), supervisor)
    return result, time.perf_counter() - start


def track(run_cfg: DictConfig, run_dir: Path, result: dict, step: int, split: str,
          files: list[Path], folder: str) -> None:
    """The run's MLflow / W&B run, when it had one: the metrics and the files."""
    tracked = trackers().continue_for_evaluation(run_cfg, run_dir) if tracking_on(
        run_cfg) else None
    if tracked:
        tracked.log_metrics({f"{split}/{name}": value for name, value in scalars(result).items()},
                            step)
        tracked.log_files(files, folder)
        tracked.close()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    lifecycle.run_main(main, one_shot=True)
