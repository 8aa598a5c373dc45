"""The built-in example models, an MLP, a small CNN and a small GPT (ddpkit/lm.py), and the
registry `MODELS`.

This file is the template's (`cruft update` brings its fixes in): add your models to model.py,
which is yours and which the template imports before any model is looked up. Select one with
`model.name=<key>` (or name a builder elsewhere as module:function). A builder takes the `model`
config section, the shape of one sample's inputs (a dict of shapes for dict inputs) and the
number of outputs the task needs. A model is called with a batch's inputs: a tensor (or tuple)
as its one argument, a dict as keyword arguments (`call_model`), as Hugging Face models expect.
Keep the distributed parts out: parallel.py places the model on its device and wraps it
(SyncBatchNorm, DDP or FSDP, torch.compile).
"""

import inspect
import math
from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch import nn

from ddpkit.config import UserError
from ddpkit.lm import build_gpt


class MLP(nn.Module):
    """A multi-layer perceptron: [Linear -> (BatchNorm) -> ReLU -> Dropout] x n, then Linear.
    Inputs of any shape are flattened per sample."""

    def __init__(self, in_features: int, num_classes: int, hidden_dim: int, num_layers: int,
                 dropout: float, batchnorm: bool):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            # No bias before BatchNorm: BN subtracts the mean, so its gradient is rounding noise.
            layers.append(nn.Linear(width, hidden_dim, bias=not batchnorm))
            if batchnorm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers += [nn.ReLU(), nn.Dropout(dropout)]
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """A small convolutional network for images (channels x height x width): a 3x3 convolution,
    then n more that each halve the resolution and double the channels, each followed by
    (BatchNorm and) ReLU; global average pooling, dropout and a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, channels: int, num_layers: int,
                 dropout: float, batchnorm: bool):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_channels
        for index in range(num_layers + 1):
            out = channels * 2 ** index
            layers.append(nn.Conv2d(width, out, 3, stride=1 if index == 0 else 2, padding=1,
                                    bias=not batchnorm))
            if batchnorm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU())
            width = out
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                   nn.Linear(width, num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_mlp(cfg: DictConfig, input_shape: tuple, num_classes: int) -> nn.Module:
    return MLP(math.prod(input_shape), num_classes, cfg.hidden_dim, cfg.num_layers, cfg.dropout,
               cfg.batchnorm)


def build_cnn(cfg: DictConfig, input_shape: tuple, num_classes: int) -> nn.Module:
    if len(input_shape) != 3:
        raise UserError(f"model.name=cnn needs images (channels x height x width), but the data "
                        f"has samples of shape {list(input_shape)}: use data.dataset=images or "
                        "digits, or model.name=mlp")
    return CNN(input_shape[0], num_classes, cfg.channels, cfg.num_layers, cfg.dropout,
               cfg.batchnorm)


# Builders take the model config, the shape of one input sample and the number of outputs.
# Yours are added in model.py (or named on the command line as module:function).
MODELS: dict[str, Callable[[DictConfig, tuple, int], nn.Module]] = {
    "mlp": build_mlp, "cnn": build_cnn, "gpt": build_gpt,  # gpt: a language model (ddpkit/lm.py)
}


def call_model(model: nn.Module, inputs):
    """The model's outputs for a batch's model inputs: a dict's entries as keyword arguments."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def check_keyword_inputs(model: nn.Module, inputs: dict, name: str) -> None:
    """Dict inputs: refuse, before any step, a model whose forward cannot take them as keyword
    arguments (one written for the whole dict as its one argument, say)."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward Python cannot inspect: let it run
        return
    try:
        signature.bind(**inputs)
    except TypeError:
        keys = ", ".join(inputs)
        raise UserError(f"model.name={name}: dict samples reach the model as keyword arguments "
                        f"({keys}), which its forward{signature} does not take: write "
                        f"forward(self, {keys}) instead of a forward that takes the whole "
                        "dict") from None
