"""Validation during training: when it runs (after every epoch, and every train.val_every_steps
steps besides), what it keeps (the checkpoint of the best value of train.best_metric, beside
the newest train.keep_checkpoints) and when it ends training (train.early_stop_patience
validations without improvement).

A validation leaves training as it found it: the random generators are put back afterwards,
so a run trains bitwise the same whatever its validation cadence. The best and the patience
count travel in every checkpoint; a validation cut short by a preemption is run again by the
resumed job (an epoch's last too, and the run's last once its steps are all done), so the best
stays the best and metrics.jsonl holds every validation through any number of requeues.
"""

import logging
import math

from omegaconf import DictConfig

from ddpkit import dist_utils, estimates
from ddpkit.config import UserError
from ddpkit.evaluation import evaluate_split, scalars
from ddpkit.position import Position, rng_state, set_rng_state
from ddpkit.run_end import write_summary
from ddpkit.tasks import Task

log = logging.getLogger("ddp")

# Metric names that read as "lower is better" (train.best_mode=auto).
LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "rmse", "perplexity", "ece", "brier")


class Validation:
    """The cadence, the best validation so far and the early-stopping count of a run."""

    def __init__(self, cfg: DictConfig, task: Task):
        train = cfg.train
        self.every = train.val_every_steps
        self.metric = train.best_metric or task.headline
        self.higher = higher_is_better(self.metric, train.best_mode, task)
        self.keep_best, self.patience = train.keep_best, train.early_stop_patience
        self.min_delta = train.early_stop_min_delta
        self.best: dict | None = None  # {"value", "step", "checkpoint"}: the best validation
        self.reference: float | None = None  # the value the patience count measures against
        self.waited = 0  # validations since the last improvement (by more than min_delta)
        self.stopped_early = False
        # A validation a preemption cut short at that step, which the resumed job runs again: a
        # step-cadence one, or an epoch's last (two entries: 1.1.0 reads the first alone).
        self.interrupted_at = -1
        self.interrupted_at_end = -1

    def due(self, position: Position, steps_per_epoch: int, total_steps: int) -> bool:
        """Whether a step-cadence validation is due now (the epoch's end has its own)."""
        return bool(self.every) and position.step % self.every == 0 and (
            position.step_in_epoch < steps_per_epoch and position.step < total_steps)

    def judge(self, record: dict) -> bool:
        """Weigh a validation's record: True for a new best. Counts toward early stopping."""
        key = f"val_{self.metric}"
        if key not in record:
            names = ", ".join(name[4:] for name in record if name.startswith("val_")
                              and name != "val_seconds")
            raise UserError(f"train.best_metric={self.metric} is not a validation metric of "
                            f"this task: choose one of {names}")
        value, sign = float(record[key]), 1.0 if self.higher else -1.0
        if math.isnan(value):
            improved = better = False
        else:
            better = self.best is None or sign * (value - self.best["value"]) > 0
            improved = self.reference is None or sign * (value - self.reference) > self.min_delta
        if better:
            self.best = {"value": value, "step": record["step"],
                         "checkpoint": f"step-{record['step']:08d}"}
        if improved:
            self.reference, self.waited = value, 0
        else:
            self.waited += 1
        self.stopped_early = bool(self.patience) and self.waited >= self.patience
        return better

    def best_checkpoint(self, run_dir) -> str | None:
        if not (self.keep_best and self.best):
            return None
        return str(run_dir / "checkpoints" / self.best["checkpoint"])

    def state_dict(self) -> dict:
        return {"best": self.best, "reference": self.reference, "waited": self.waited,
                "stopped_early": self.stopped_early, "interrupted_at": self.interrupted_at,
                "interrupted_at_end": self.interrupted_at_end}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.reference = state.get("best"), state.get("reference")
        self.waited = int(state.get("waited", 0))
        self.stopped_early = bool(state.get("stopped_early", False))
        self.interrupted_at = int(state.get("interrupted_at", -1))
        self.interrupted_at_end = int(state.get("interrupted_at_end", -1))


def higher_is_better(metric: str, mode: str, task: Task) -> bool:
    if mode != "auto":
        return mode == "max"
    if metric == task.headline:
        return task.higher_is_better
    return not any(word in metric.lower() for word in LOWER_IS_BETTER)


def restored(run) -> None:
    """After a resume: the best's checkpoint is kept again, if it is this run folder's; an
    early stop is weighed again by this run's patience (raised, training goes on)."""
    validation = run.validation
    validation.stopped_early = bool(validation.patience) and validation.waited >= (
        validation.patience)
    best = run.validation.best
    if best and not (run.checkpointer.folder / best["checkpoint"]).is_dir():
        run.validation.best = None  # resumed from another run folder: its best is not here
    if run.validation.keep_best and run.validation.best:
        run.checkpointer.best = run.validation.best["checkpoint"]


def validate(run, mid_epoch: bool = False) -> dict | None:
    """A validation: the exact, sharded evaluation of evaluate.py, on the user's module
    (compiled when training is; the same on every rank), logged as the epoch's record or one of
    its own mid-epoch, the plateau schedule stepped on it. Returns the record; what to keep and
    whether to stop is the loop's call (train.py). None when a preemption signal cut it short:
    the loop then stops, and the resumed run validates again."""
    position, validation = run.position, run.validation
    if mid_epoch:  # the window so far is training time; the validation is not
        run.training_log.end_training(position.step)
    generators = rng_state()
    with run.averaged_weights():  # train.ema_decay: they are what is validated
        val = evaluate_split(run.model_for_evaluation(),
                             run.data.eval_loader("val", run.cfg.train.limit_val_batches),
                             run.device, run.task, run.speed, run.cfg.eval.binned_thresholds,
                             detail=False, supervisor=run.supervisor)
        if val is not None:  # train.estimate_windows: sampled losses beside it
            val = estimates.with_estimates(run, val)
    set_rng_state(generators)  # training's random streams, as if it had not run
    validation.interrupted_at = position.step if val is None and mid_epoch else -1
    validation.interrupted_at_end = position.step if val is None and not mid_epoch else -1
    if val is None:
        return None
    if mid_epoch:
        record = run.training_log.validation_record(position.epoch + 1, position.step,
                                                    scalars(val))
        run.training_log.restart_clock()
    else:
        record = run.training_log.end_epoch(position.epoch + 1, position.step, scalars(val))
    run.validated(record)  # a plateau schedule steps on the headline metric
    if run.data.by_steps:
        where = f"step {position.step:5d}/{run.total_steps}"
    else:
        where = f"epoch {position.epoch + 1:3d}/{run.cfg.train.epochs}{' (mid)' * mid_epoch}  " \
                f"step {position.step:5d}"
    log.info("%s  %s", where, "  ".join(f"{name} {value:.4f}" for name, value in record.items()
                       if isinstance(value, float)))
    return record


def log_early_stop(validation: Validation) -> None:
    best = validation.best or {"value": math.nan, "step": -1}
    log.info("early stop: val_%s has not improved by more than %g for %d validation(s); best "
             "%.4f at step %d", validation.metric, validation.min_delta, validation.waited,
             best["value"], best["step"])


def keep_best(run) -> None:
    """A new best: its checkpoint (saved now, unless the loop just saved this step) is kept
    beside the newest ones, and summary.json names it (collective)."""
    run.checkpointer.best = run.validation.best["checkpoint"]
    if run.checkpointer.last_saved != run.position.step:
        run.save_mid_training()
        run.training_log.restart_clock()
    with dist_utils.agree_on_errors():
        if run.env.is_main:
            write_summary(run, "running")
