"""Averaged weights (train.ema_decay): an exponential moving average of the parameters, kept
beside them and updated after each optimizer step, average = decay x average + (1 - decay) x
weight.

Averaged weights often validate better than the last step's, for no extra steps. The averages are
tensors shaped as the parameters, and under FSDP2 sharded as they are (each rank keeps its 1/N),
updated by one foreach lerp over all of them: the update torch.optim.swa_utils'
get_ema_multi_avg_fn makes. (Its AveragedModel keeps a deep copy of the whole module, which does
not fit a module FSDP2 has sharded, nor the checkpoints' layout by parameter name.)

Checkpoints save the averages beside the model, through DCP (resharded at another process count
as the model is), so a resumed run goes on bit for bit; a run resumed from a checkpoint without
them starts them from its weights. With averaging on, validation scores the averaged weights
(swapped in, then back): the best checkpoint, early stopping and a plateau schedule judge them.
train.export=ema writes them to model.pt, which evaluate.py then scores.
"""

import contextlib
import logging

import torch
from torch import nn

from ddpkit.parallel import unwrap

log = logging.getLogger("ddp")


class WeightAverage:
    """The averages of a model's trained parameters, by name."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.named = [(name, parameter) for name, parameter in unwrap(model).named_parameters()
                      if parameter.requires_grad]
        self.parameters = [parameter for _, parameter in self.named]
        with torch.no_grad():
            self.averages = [parameter.detach().clone() for parameter in self.parameters]
        self.started = False  # the first update takes the weights as they are, as torch's does

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: each average moves 1 - decay of the way to its weight."""
        if not self.started:
            self.restart()
            return
        torch._foreach_lerp_(self.averages, [p.detach() for p in self.parameters],
                             1.0 - self.decay)

    @contextlib.contextmanager
    def swapped_in(self):
        """The averages in the model's parameters for the block (validation, export), the
        trained weights back after it."""
        with torch.no_grad():
            trained = [parameter.detach().clone() for parameter in self.parameters]
            for parameter, average in zip(self.parameters, self.averages, strict=True):
                parameter.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for parameter, weight in zip(self.parameters, trained, strict=True):
                    parameter.copy_(weight)

    def state_dict(self) -> dict:
        return {name: average for (name, _), average in zip(self.named, self.averages,
                                                            strict=True)}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for (name, _), average in zip(self.named, self.averages, strict=True):
                average.copy_(state[name])
        self.started = True

    @torch.no_grad()
    def restart(self) -> None:
        """The averages set to the weights (the first update, or a resume from a checkpoint
        saved without averaging)."""
        for parameter, average in zip(self.parameters, self.averages, strict=True):
            average.copy_(parameter)
        self.started = True
