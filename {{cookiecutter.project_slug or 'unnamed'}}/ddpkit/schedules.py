"""The learning-rate schedule: linear warmup, then constant or cosine decay to 0 at the last step.

A torch LambdaLR, so a checkpoint keeps and restores it through its state_dict like any torch
scheduler; ddpkit.resume_settings re-reads its factor when a resumed run changes the schedule.
"""

import functools
import math

import torch


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
