"""Settings changed between a checkpoint and the run that resumes it: refused in one line when a
resume cannot honour them (the data seen so far follows from them), applied otherwise, so that
what the records say (config.yaml, model.pt, new checkpoints) is what trains."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ddpkit.config import UserError
from ddpkit.run_state import Run

log = logging.getLogger("ddp")

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


def apply_changed_settings(run: Run, saved: dict | None) -> None:
    """After a resume, the settings changed since the checkpoint take effect. The optimizer and
    the schedule came back with the checkpoint's learning rate and weight decay: this run's
    replace them, on this run's schedule. The rest is read from the config anyway."""
    changes = changed_settings(run.cfg, saved)
    scheduler = run.scheduler
    if "optim.lr" in changes:
        before, value = changes["optim.lr"]
        scheduler.base_lrs = [base * value / before for base in scheduler.base_lrs]
    # The rate at this step on this run's schedule (its length or warmup may have changed too).
    for group, base, factor in zip(run.optimizer.param_groups, scheduler.base_lrs,
                                   scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    if "optim.weight_decay" in changes:
        for group in run.optimizer.param_groups:
            group["weight_decay"] = changes["optim.weight_decay"][1]
    if changes and run.env.is_main:
        log.info("changed since the checkpoint, in effect from step %d: %s",
                 run.position.step + 1, ", ".join(f"{key} {before} -> {value}"
                                                  for key, (before, value) in changes.items()))
