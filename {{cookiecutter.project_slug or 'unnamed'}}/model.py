"""The model stub and the factory that builds, places and wraps it for DDP.

To use your own network: write it as a plain `nn.Module`, add a builder to `MODELS`, and select it
with `model.name=<key>`. The factory does the distributed part (device, SyncBatchNorm, DDP).
"""

from collections.abc import Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from config import UserError
from dist_utils import DistEnv


class MLP(nn.Module):
    """A multi-layer perceptron classifier: [Linear -> (BatchNorm) -> ReLU -> Dropout] x n."""

    def __init__(self, in_features: int, num_classes: int, hidden_dim: int, num_layers: int,
                 dropout: float, batchnorm: bool):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(num_layers):
            layers.append(nn.Linear(width, hidden_dim))
            if batchnorm:
                layers.append(nn.BatchNorm1d(hidden_dim))
            layers += [nn.ReLU(), nn.Dropout(dropout)]
            width = hidden_dim
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_mlp(cfg: DictConfig, in_features: int, num_classes: int) -> nn.Module:
    return MLP(in_features, num_classes, cfg.hidden_dim, cfg.num_layers, cfg.dropout,
               cfg.batchnorm)


MODELS: dict[str, Callable[[DictConfig, int, int], nn.Module]] = {"mlp": build_mlp}


def build_model(cfg: DictConfig, in_features: int, num_classes: int) -> nn.Module:
    """The bare model named by `model.name`, on the CPU: no device, no wrapping."""
    if cfg.name not in MODELS:
        raise UserError(f"model.name={cfg.name} is not a model: choose one of {', '.join(MODELS)}")
    return MODELS[cfg.name](cfg, in_features, num_classes)


def wrap_model(model: nn.Module, cfg: DictConfig, env: DistEnv,
               device: torch.device) -> nn.Module:
    """Move the model to this rank's device and wrap it in DDP when there is a process group."""
    if cfg.model.sync_batchnorm and env.world_size > 1:
        if device.type != "cuda":
            raise UserError("model.sync_batchnorm=true needs CUDA GPUs (PyTorch's SyncBatchNorm "
                            "has no CPU kernel): set it to false for CPU runs")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if not env.launched:
        return model
    return DistributedDataParallel(
        model,
        # One process per GPU: the module lives on exactly this rank's device. CPU: none.
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=cfg.ddp.find_unused_parameters,
        static_graph=cfg.ddp.static_graph,
        gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any DDP / torch.compile wrappers (what checkpoints store)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
