"""Your models. This file is yours: the template starts it and never changes it again
(`cruft update` skips it), so write here freely.

Write your network as a plain `nn.Module`, add a builder to `MODELS` and select it with
`model.name=<key>`:

    def build_my_net(cfg: DictConfig, input_shape: tuple, num_outputs: int) -> nn.Module:
        return MyNet(input_shape[0], num_outputs, cfg.channels)  # cfg: the `model` section

    MODELS["my_net"] = build_my_net

A builder gets one sample's input shape (a dict of shapes for dict inputs) and the number of
outputs the task needs. Keep the distributed parts out: ddpkit/parallel.py places the model on its
device and wraps it. Every command loads this file (ddpkit/recipes.py) before it looks a model up,
so every entry you add here is seen. The built-in models (mlp, cnn) live in ddpkit/models.py, which
is the template's. A setting of your own (`model.<name>`) is declared in settings.py.

The optimizer and the schedule come from the `optim` settings (docs/optimization.md); three
optional hooks take over where settings are not enough. Each gets the whole config (`cfg.optim`):

    def my_groups(model: nn.Module, cfg: DictConfig) -> list[dict]:  # optim.param_groups=mine
        def in_head(name):  # model: your module, unwrapped (parameter names as yours)
            return name.startswith("head.")
        decay = cfg.optim.weight_decay  # decay_groups: no decay on biases and norm weights
        return [*decay_groups(model, decay, only=lambda n: not in_head(n), name="body",
                              lr=cfg.optim.lr / 10),
                *decay_groups(model, decay, only=in_head, name="head")]

    PARAM_GROUPS["mine"] = my_groups  # frozen parameters (requires_grad False) are left out

    def my_optimizer(groups: list[dict], cfg: DictConfig) -> torch.optim.Optimizer:
        return torch.optim.SGD(groups, lr=cfg.optim.lr, momentum=0.9)

    OPTIMIZERS["my_sgd"] = my_optimizer  # optim.name=my_sgd; groups: yours or the default ones

    def my_schedule(optimizer, cfg: DictConfig, total_steps: int):
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, cfg.optim.lr, total_steps)

    SCHEDULES["one_cycle"] = my_schedule  # optim.schedule=one_cycle; stepped every optimizer
    # step (a ReduceLROnPlateau is stepped after each validation with the headline metric)
"""

import math  # noqa: F401

import torch  # noqa: F401
from omegaconf import DictConfig  # noqa: F401
from torch import nn  # noqa: F401

from ddpkit.config import UserError  # noqa: F401
from ddpkit.models import MODELS  # noqa: F401
from ddpkit.optimizers import OPTIMIZERS, PARAM_GROUPS, decay_groups  # noqa: F401
from ddpkit.schedules import SCHEDULES  # noqa: F401
