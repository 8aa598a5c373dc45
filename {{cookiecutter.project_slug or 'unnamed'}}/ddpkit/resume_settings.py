"""Settings changed between a checkpoint and the run that resumes it: refused in one line when a
resume cannot honour them (the data seen so far follows from them), applied otherwise, so that
what the records say (config.yaml, model.pt, new checkpoints) is what trains."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR

from ddpkit.config import UserError
from ddpkit.optimizers import optimizer_args
from ddpkit.run_state import Run
from ddpkit.schema import SCHEDULE_NAMES

log = logging.getLogger("ddp")

# Settings a resumed run cannot change: the data it has seen this epoch, and how it is split and
# ordered, follow from them, so a new value would train some samples twice and skip others.
FIXED_ON_RESUME = (
    "run.seed", "train.global_batch_size", "train.limit_train_batches", "data.dataset",
    "data.root", "data.val_fraction", "data.test_fraction", "data.split_seed",
    "data.synthetic_samples", "data.synthetic_features", "data.synthetic_classes",
    "data.image_size")
# The schedules a resume may switch between: each is a LambdaLR whose factor is re-read.
CLOSED_FORM = [name for name in SCHEDULE_NAMES if name != "plateau"]
# Settings the optimizer's restored state would not fit (its per-parameter state, its groups).
NEW_OPTIMIZER = ("optim.name", "optim.param_groups")
# Where the run is written and what it resumes from: not settings of the training itself.
NOT_COMPARED = ("run.name", "run.output_dir", "run.dir", "train.resume")


def changed_settings(cfg: DictConfig, saved: dict | None, ignored: tuple = NOT_COMPARED
                     ) -> dict[str, tuple]:
    """Each setting whose value differs from the one a checkpoint was written with (but those
    `ignored`): name -> (checkpoint's value, this run's). Empty for a checkpoint that holds no
    config."""
    if not saved:
        return {}
    old, new = (OmegaConf.to_container(c) for c in (OmegaConf.create(saved), cfg))
    changes = {}
    for section, values in new.items():
        for name, value in values.items() if isinstance(values, dict) else ():
            key = f"{section}.{name}"
            before = old.get(section, {}).get(name, value)
            if key not in ignored and before != value:
                changes[key] = (before, value)
    return changes


def refuse_fixed_settings(cfg: DictConfig, saved: dict | None, source: Path) -> None:
    """One line when a setting that a resume cannot honour differs from the checkpoint's."""
    for key, (before, value) in changed_settings(cfg, saved).items():
        reason = refusal(key, before, value)
        if reason:
            raise UserError(
                f"{key}={value} differs from {before} in checkpoint {source}, and a resumed run "
                f"cannot change it ({reason}): resume with {key}={before}, or start a new run "
                "with train.resume=never")


def refusal(key: str, before, value) -> str | None:
    """Why a resumed run cannot change `key` from `before` to `value` (None: it can)."""
    if key in FIXED_ON_RESUME:
        return "the epoch's data would be seen twice or skipped"
    if key in NEW_OPTIMIZER:
        return "the checkpoint's optimizer state is that of its optimizer and groups"
    if key == "optim.schedule" and not {before, value} <= set(CLOSED_FORM):
        return "the checkpoint's scheduler state is that of its schedule"
    if key == "optim.weight_decay" and not before:
        return "which parameter groups decay is not recorded when none did"
    return None


def apply_changed_settings(run: Run, saved: dict | None) -> None:
    """After a resume, the settings changed since the checkpoint take effect. The optimizer and
    the schedule came back with the checkpoint's learning rates, weight decays and arguments:
    this run's replace them, on this run's schedule. The rest is read from the config anyway."""
    changes = changed_settings(run.cfg, saved)
    ratio = changes["optim.lr"][1] / changes["optim.lr"][0] if "optim.lr" in changes else 1.0
    scale_learning_rates(run, ratio)
    if "optim.weight_decay" in changes:
        before, value = changes["optim.weight_decay"]
        for group in run.optimizer.param_groups:
            # The config's decay takes the new value; a group's own (or 0) is scaled alike.
            decay = group.get("weight_decay", 0.0)
            group["weight_decay"] = value if decay == before else decay * value / before
    if "optim.args" in changes:
        for key, value in optimizer_args(run.cfg).items():
            for group in run.optimizer.param_groups:
                if key in group:
                    group[key] = value
    if changes and run.env.is_main:
        log.info("changed since the checkpoint, in effect from step %d: %s",
                 run.position.step + 1, ", ".join(f"{key} {before} -> {value}"
                                                  for key, (before, value) in changes.items()))


def scale_learning_rates(run: Run, ratio: float) -> None:
    """A changed optim.lr scales each group's base rate by new / old, so groups of their own
    rate keep their proportions. A closed-form schedule then sets the rate at this step on this
    run's schedule (its length, warmup or decays may have changed too); any other scheduler's
    current rate is scaled alike."""
    scheduler, plateau = run.scheduler, run.plateau
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [base * ratio for base in scheduler.base_lrs]
    if isinstance(scheduler, LambdaLR):
        for group, base, factor in zip(run.optimizer.param_groups, scheduler.base_lrs,
                                       scheduler.lr_lambdas, strict=True):
            group["lr"] = base * factor(scheduler.last_epoch)
            group["initial_lr"] = base
        return
    if ratio == 1.0:
        return
    for group in run.optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if plateau is not None:
        plateau.min_lrs = [rate * ratio for rate in plateau.min_lrs]
