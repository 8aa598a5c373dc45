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
"""

import math  # noqa: F401

import torch  # noqa: F401
from omegaconf import DictConfig  # noqa: F401
from torch import nn  # noqa: F401

from ddpkit.config import UserError  # noqa: F401
from ddpkit.models import MODELS  # noqa: F401
