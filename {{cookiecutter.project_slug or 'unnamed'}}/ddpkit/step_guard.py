"""The step guard (guard.enabled): one bad batch skips a step instead of ending or poisoning a run.

Before each update the guard looks at the step's loss (over every rank) and gradient norm. A
step is skipped when either is not finite, or when guard.spike_factor is above 0 and the loss is
more than that many times the median of the last guard.window updated steps (judged once that
many are known). A skipped step changes no weight and no optimizer state, leaves the
learning-rate schedule where it was, and stays out of the logged means; its window's line in
train_log.jsonl counts it (`skipped_steps`) and rank 0 says why. The data moves on: the next
step trains on the next batch. guard.max_skips skipped steps in a row end the run in one line
naming them. The recent losses and the skips in a row are saved in checkpoints, so a resumed
run judges as the uninterrupted one did.

Every rank reaches the same verdict: the loss is summed over the ranks (one small all-reduce a
step) and the gradient norm is global after DDP's all-reduce (or FSDP's). Reading the two makes
the CPU wait for the device once a step, the guard's only cost (none when it is off: the loop
then runs run_state.train_step as it is).
"""

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from ddpkit.config import UserError
from ddpkit.parallel import full_tensor
from ddpkit.run_state import compute_gradients
from ddpkit.speed import FLOAT32

log = logging.getLogger("ddp")


class StepGuard:
    """The guard's verdicts and its memory of the run (recent losses, skips in a row)."""

    def __init__(self, cfg: DictConfig, steps_done: Callable[[], int], is_main: bool):
        self.factor, self.max_skips = cfg.guard.spike_factor, cfg.guard.max_skips
        self.losses: deque[float] = deque(maxlen=cfg.guard.window)  # the updated steps'
        self.in_a_row: list[int] = []  # the steps skipped since the last update
        self.steps_done, self.is_main = steps_done, is_main  # (the run's position.step)
        self.updated = True  # the last step changed the weights (the loop then steps the schedule)
        self.skipped_in_window = 0  # read and reset by the training log at each window

    def train_step(self, model, optimizer, micro_batches, task, device, speed=FLOAT32,
                   scaler=None, grad_clip: float = 0.0):
        """run_state.train_step, judged before the update: the same returns (the gradient norm
        always), and a skipped step's values zero over 0 samples (left out of the means) and no
        gradient norm."""
        optimizer.zero_grad(set_to_none=True)
        values, samples = compute_gradients(model, micro_batches, task, device, speed, scaler)
        if scaler:
            scaler.unscale_(optimizer)  # judge (and clip) the true gradients
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(
            model.parameters(), grad_clip or math.inf))  # the norm; clipped when asked
        loss, norm = self.global_loss(values["loss"], samples), float(grad_norm)
        if scaler and math.isfinite(loss) and not math.isfinite(norm):
            reason = None  # fp16 overflow: the loss scaler skips the step and lowers its scale
        else:
            reason = self.judge(loss, norm)
        if reason is None:
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            self.losses.append(loss)
            self.in_a_row, self.updated = [], True
            return values, samples, grad_norm
        self.skip(reason)
        if scaler:
            scaler.update()  # the unscaled gradients are dropped; the scaler starts afresh
        optimizer.zero_grad(set_to_none=True)
        return {name: torch.zeros_like(value) for name, value in values.items()}, 0, None

    def global_loss(self, loss: torch.Tensor, samples: int) -> float:
        """The step's mean loss over every rank's samples (the same number on every rank)."""
        totals = torch.stack([loss.detach().double() * samples,
                              torch.tensor(float(samples), dtype=torch.float64,
                                           device=loss.device)])
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss_sum, count = totals.tolist()
        return loss_sum / count if count else 0.0

    def judge(self, loss: float, norm: float) -> str | None:
        """Why the step is skipped, or None."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        if not math.isfinite(norm):
            return f"the gradient norm is {norm}"
        if self.factor and len(self.losses) == self.losses.maxlen:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                return (f"the loss {loss:.4g} is {loss / median:.1f}x the median {median:.4g} of "
                        f"the last {len(self.losses)} steps (guard.spike_factor={self.factor})")
        return None

    def skip(self, reason: str) -> None:
        step = self.steps_done() + 1  # the loop advances the position after the step
        self.in_a_row.append(step)
        self.updated = False
        self.skipped_in_window += 1
        if len(self.in_a_row) >= self.max_skips:
            steps = ", ".join(map(str, self.in_a_row))
            raise UserError(f"the step guard skipped {len(self.in_a_row)} steps in a row (steps "
                            f"{steps}; the last because {reason}): lower optim.lr, set "
                            "optim.grad_clip (e.g. 1.0), or look at the data of those steps")
        if self.is_main:
            log.warning("step %d skipped: %s", step, reason)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "in_a_row": list(self.in_a_row)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.in_a_row = list(state["in_a_row"])
