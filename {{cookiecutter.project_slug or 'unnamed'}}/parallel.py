"""The model factory: build the model named in the config, place it on this rank's device, wrap it.

`wrap_model` converts BatchNorm to statistics over all ranks when asked, wraps the model in
DistributedDataParallel when there is a process group, and compiles it when asked; `unwrap`
gives the user's module back (what checkpoints store). model.py holds the models themselves.
"""

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from config import lookup
from dist_utils import DistEnv
from model import MODELS
from speed import Speed


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) that autograd can differentiate: every rank's output is the sum of all
    inputs, so the gradient of each input is the sum of all ranks' output gradients."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics cover the global batch, on any backend.

    Each rank's per-channel sums are all-reduced with autograd, so forward and backward equal
    one process normalising the whole batch. PyTorch's nn.SyncBatchNorm does the same with fused
    GPU kernels but refuses CPU tensors; this one is what `sync_batchnorm` uses on gloo / CPU.
    Parameter and buffer names match nn.BatchNorm*d, so checkpoints load either way.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        channels, dims = x.shape[1], [0, *range(2, x.dim())]
        wide = x.double()  # sums of squares in float64: no cancellation in E[x^2] - E[x]^2
        count = torch.full((1,), x.numel() // channels, dtype=torch.float64, device=x.device)
        sums = torch.cat([wide.sum(dims), (wide * wide).sum(dims), count])
        totals = _SumOverRanks.apply(sums)
        n = totals[-1]
        mean = totals[:channels] / n
        var = totals[channels: 2 * channels] / n - mean * mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = (1.0 / self.num_batches_tracked.item() if self.momentum is None
                            else self.momentum)
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        out = (wide - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        out = out.to(x.dtype)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def convert_sync_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Every BatchNorm layer with statistics over all ranks: nn.SyncBatchNorm on CUDA,
    GlobalBatchNorm elsewhere; weights and running statistics carried over."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, _BatchNorm) and not isinstance(module, GlobalBatchNorm):
        synced = GlobalBatchNorm(module.num_features, module.eps, module.momentum,
                                 module.affine, module.track_running_stats)
        synced.load_state_dict(module.state_dict())
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, device))
    return module


def build_model(cfg: DictConfig, input_shape: tuple, num_classes: int) -> nn.Module:
    """The bare model named by `model.name`, on the CPU: no device, no wrapping."""
    builder = lookup(MODELS, cfg.name, "model.name", "a model")
    return builder(cfg, input_shape, num_classes)


def wrap_model(model: nn.Module, cfg: DictConfig, env: DistEnv, device: torch.device,
               speed: Speed) -> nn.Module:
    """Move the model to this rank's device, wrap it in DDP when there is a process group, and
    compile it when asked (DDP first, so the compiler sees DDP's gradient buckets)."""
    if cfg.model.sync_batchnorm and env.world_size > 1:
        model = convert_sync_batchnorm(model, device)
    model = model.to(device, memory_format=speed.memory_format)
    if env.launched:
        model = DistributedDataParallel(
            model,
            # One process per GPU: the module lives on exactly this rank's device. CPU: none.
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=cfg.ddp.find_unused_parameters,
            static_graph=cfg.ddp.static_graph,
            gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
        )
    if speed.compile:
        model = torch.compile(model, mode=None if speed.compile_mode == "default"
                              else speed.compile_mode)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any DDP / torch.compile wrappers (what checkpoints store)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
