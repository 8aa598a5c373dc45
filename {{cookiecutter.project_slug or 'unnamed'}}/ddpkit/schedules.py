"""The learning-rate schedule: linear warmup over optim.warmup_steps, then

- cosine, linear: decay from each group's own base rate to optim.min_lr_ratio times it at the
  last step;
- step, multistep: times optim.gamma every optim.step_size steps, or at each of optim.milestones
  (optimizer steps counted from the start, as torch's StepLR / MultiStepLR count them), never
  below optim.min_lr_ratio times the base rate;
- constant;
- plateau: torch's ReduceLROnPlateau on the task's headline validation metric, times
  optim.gamma after optim.plateau_patience validations without improvement (stepped after each
  validation, not each step; the warmup is then torch's LinearLR);
- or a key of SCHEDULES (model.py): builder(optimizer, cfg, total_steps) returns any torch
  LRScheduler (stepped after every optimizer step) or a ReduceLROnPlateau.

Each is a torch scheduler, so a checkpoint keeps and restores it through its state_dict;
ddpkit.resume_settings re-reads the factor when a resumed run changes the schedule's settings.
"""

import bisect
import functools
import math
from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch.optim.lr_scheduler import LambdaLR, LinearLR, LRScheduler, ReduceLROnPlateau

from ddpkit.config import UserError, lookup
from ddpkit.schema import SCHEDULE_NAMES

# optim.schedule=<key>: builder(optimizer, cfg, total_steps) -> LRScheduler | ReduceLROnPlateau
SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, DictConfig, int], LRScheduler]] = {}


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float = 0.0,
              step_size: int = 1, milestones: tuple = (), gamma: float = 1.0) -> float:
    """The factor on each group's base rate after `step` optimizer steps: linear warmup over
    `warmup` steps, then the schedule (module docstring)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule in ("step", "multistep"):
        decays = step // step_size if schedule == "step" else bisect.bisect_right(milestones, step)
        return max(min_ratio, gamma ** decays)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * decay


def factor_of(cfg: DictConfig, total: int) -> Callable[[int], float]:
    """lr_factor with this config's settings: what LambdaLR multiplies each base rate by."""
    optim = cfg.optim
    return functools.partial(lr_factor, warmup=optim.warmup_steps, total=total,
                             schedule=optim.schedule, min_ratio=optim.min_lr_ratio,
                             step_size=optim.step_size, milestones=tuple(optim.milestones),
                             gamma=optim.gamma)


def build_schedule(optimizer: torch.optim.Optimizer, cfg: DictConfig, total: int,
                   higher_is_better: bool) -> tuple[LRScheduler, ReduceLROnPlateau | None]:
    """The scheduler stepped after every optimizer step, and the one stepped after each
    validation with the headline metric (None but for a plateau schedule)."""
    name = cfg.optim.schedule
    if name == "plateau":
        plateau = ReduceLROnPlateau(
            optimizer, mode="max" if higher_is_better else "min", factor=cfg.optim.gamma,
            patience=cfg.optim.plateau_patience,
            min_lr=[cfg.optim.min_lr_ratio * group["lr"] for group in optimizer.param_groups],
            eps=0.0)  # the floor is min_lr (torch's eps=1e-8 would stop every cut of a rate < 1e-8)
        return warmup_only(optimizer, cfg.optim.warmup_steps), plateau
    if name in SCHEDULE_NAMES:
        # torch's CosineAnnealingLR / LinearLR take one absolute floor (eta_min), not a share of
        # each group's own base rate, and chained by SequentialLR their curve is computed step
        # by step: a closed form in a LambdaLR keeps both, and lets a resume re-read it.
        return LambdaLR(optimizer, factor_of(cfg, total)), None
    made = schedule_builder(name)(optimizer, cfg, total)
    if isinstance(made, ReduceLROnPlateau):
        return warmup_only(optimizer, cfg.optim.warmup_steps), made
    if not isinstance(made, LRScheduler):
        raise UserError(f"optim.schedule={name} returned {type(made).__name__}, not a torch "
                        "LRScheduler")
    return made, None


def schedule_builder(name: str) -> Callable:
    """Your schedule's builder (SCHEDULES in model.py, or module:function)."""
    if name not in SCHEDULES and ":" not in name:
        yours = f", or yours ({', '.join(SCHEDULES)})" if SCHEDULES else ""
        raise UserError(f"optim.schedule={name} is not a schedule: choose one of "
                        f"{', '.join(SCHEDULE_NAMES)}{yours}, or add a builder to SCHEDULES in "
                        "model.py")
    return lookup(SCHEDULES, name, "optim.schedule", "a schedule")


def warmup_only(optimizer: torch.optim.Optimizer, warmup: int) -> LinearLR:
    """Linear warmup to each group's base rate, then the rate left alone (LinearLR works on the
    current rate, so a ReduceLROnPlateau's cuts stay)."""
    return LinearLR(optimizer, start_factor=1.0 / warmup if warmup else 1.0, end_factor=1.0,
                    total_iters=warmup)
