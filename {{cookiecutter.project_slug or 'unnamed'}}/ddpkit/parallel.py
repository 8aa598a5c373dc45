"""The model factory: build the model named in the config, place it on this rank's device, wrap it.

`wrap_model` converts BatchNorm to statistics over all ranks when asked, then, when there is a
process group, wraps the model in DistributedDataParallel (`parallel.strategy=ddp`) or shards it
with FSDP2 (`parallel.strategy=fsdp`), and compiles it when asked; `unwrap` gives the user's
module back. `skip_gradient_sync` (gradient accumulation) and `ModelState` (checkpoints) hide
which of the two it is from the training loop. The models themselves are in ddpkit/models.py
(the examples) and model.py (yours).
"""

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from ddpkit.blocks import checkpoint_activations, compile_blocks
from ddpkit.config import UserError, accumulation_steps, lookup
from ddpkit.dist_utils import DistEnv
from ddpkit.flops import to_meta
from ddpkit.models import MODELS, call_model, check_keyword_inputs
from ddpkit.position import rng_state, set_rng_state
from ddpkit.speed import Speed


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


def values_per_channel(model: nn.Module, build: Callable[[], nn.Module],
                       inputs) -> dict[str, tuple[str, int]]:
    """Each BatchNorm layer of `model`: (its type, the values per channel it normalises for one
    sample of `inputs`, a batch of one), found on a copy that `build()` makes on the meta device:
    no memory, no arithmetic, nothing of the run's model or random generators touched. Empty
    when the model has none or cannot run there (its training step then says what it says)."""
    found = {}
    if not any(isinstance(layer, _BatchNorm) for layer in model.modules()):
        return found  # (no copy made: a Hugging Face model's would read its weights again)

    def note(name):
        def hook(module, args):
            shape = args[0].shape
            found[name] = (type(module).__name__, shape[0] * shape[2:].numel())
        return hook

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            copy = build().eval()
            for name, layer in copy.named_modules():
                if isinstance(layer, _BatchNorm):
                    layer.register_forward_pre_hook(note(name))
            call_model(copy, to_meta(inputs))
    except Exception:  # noqa: BLE001 (a model that reads values: no check, as before)
        return {}
    return found


def check_batch_statistics(cfg: DictConfig, layers: dict[str, tuple[str, int]], micro: int,
                           smallest: int, world_size: int) -> None:
    """BatchNorm trains on the statistics of each micro-batch (of every rank's, synchronised)
    and needs more than one value per channel: a micro-batch that gives a layer one (`micro`
    samples, or `smallest` in an epoch's last step) is one line naming the settings to change,
    before any step."""
    synced = cfg.model.sync_batchnorm and world_size > 1
    samples = smallest * (world_size if synced else 1)
    tight = [(name, kind) for name, (kind, values) in layers.items()
             if values * samples <= 1 and (synced or kind != "SyncBatchNorm")]
    if not tight:
        return
    name, kind = tight[0]
    accumulation = accumulation_steps(cfg, world_size)
    if smallest < micro:
        how = (f"an epoch's last micro-batch holds {smallest} sample (what the training split "
               f"leaves after micro-batches of {micro})")
        fixes = ["a train.global_batch_size that leaves more"]
    else:
        split = (f"train.global_batch_size={cfg.train.global_batch_size} over {world_size} "
                 "process(es)" + (f" and {accumulation} accumulation steps" if accumulation > 1
                                  else ""))
        how = f"a training micro-batch holds {micro} sample ({split})"
        fixes = ["a larger train.global_batch_size"]
        if accumulation > 1:
            fixes.append("fewer accumulation steps")
    if world_size > 1 and not synced:
        fixes.append(f"model.sync_batchnorm=true (statistics over all {world_size} processes)")
    raise UserError(f"BatchNorm layer {name} ({kind}) needs more than 1 value per channel to "
                    f"train, and {how}: use {' or '.join(fixes)}")


def build_model(cfg: DictConfig, input_shape: tuple, num_classes: int, inputs=None
                ) -> nn.Module:
    """The bare model named by `model.name`, on the CPU: no device, no wrapping. With `inputs`
    (a batch's model inputs), a model that cannot be called with them is refused."""
    builder = lookup(MODELS, cfg.name, "model.name", "a model")
    model = builder(cfg, input_shape, num_classes)
    if isinstance(inputs, dict):
        check_keyword_inputs(model, inputs, cfg.name)
    return model


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP gathers one at a time: the model's own `fsdp_blocks()` if it has one, else
    the children (with parameters) of the outermost nn.Sequential / nn.ModuleList stacks."""
    if hasattr(model, "fsdp_blocks"):
        return list(model.fsdp_blocks())
    blocks = []
    for child in model.children():
        if isinstance(child, nn.Sequential | nn.ModuleList):
            blocks += [block for block in child if any(True for _ in block.parameters())]
        else:
            blocks += fsdp_blocks(child)
    return blocks


def shard_model(model: nn.Module, cfg: DictConfig, device: torch.device, speed: Speed,
                world_size: int) -> nn.Module:
    """FSDP2: each block, then the rest of the model, sharded over every process."""
    mesh = init_device_mesh(device.type, (world_size,))
    options = {"mesh": mesh, "reshard_after_forward": cfg.parallel.reshard_after_forward}
    if speed.autocast_dtype is not None and device.type == "cuda":
        # Weights gathered in the autocast dtype, gradients reduced in float32.
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=speed.autocast_dtype,
                                                    reduce_dtype=torch.float32)
    if cfg.parallel.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for block in fsdp_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def wrap_model(model: nn.Module, cfg: DictConfig, env: DistEnv, device: torch.device,
               speed: Speed) -> nn.Module:
    """Move the model to this rank's device, wrap it in DDP or shard it with FSDP when there is a
    process group, and compile it when asked (after wrapping, so the compiler sees DDP's
    gradient buckets / FSDP's gathers)."""
    if cfg.model.sync_batchnorm and env.world_size > 1:
        model = convert_sync_batchnorm(model, device)
    model = model.to(device, memory_format=speed.memory_format)
    if speed.float8:  # first: torchao swaps the layers that the wrappers below then hold
        from ddpkit.extras.float8 import convert_to_float8

        convert_to_float8(model)
    if speed.activation_checkpointing:  # in place, before wrapping: the same names and units
        checkpoint_activations(model, speed.activation_checkpointing)
    if speed.compile == "blocks":  # in place too; the rest of the model stays eager
        compile_blocks(model, None if speed.compile_mode == "default" else speed.compile_mode)
    if env.launched and cfg.parallel.strategy == "fsdp":
        model = shard_model(model, cfg, device, speed, env.world_size)
    elif env.launched:
        model = DistributedDataParallel(
            model,
            # One process per GPU: the module lives on exactly this rank's device. CPU: none.
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=cfg.ddp.find_unused_parameters,
            static_graph=cfg.ddp.static_graph,
            gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
        )
    if speed.compile is True:
        model = _compiled(model, speed)
    return model


def _compiled(model: nn.Module, speed: Speed) -> nn.Module:
    mode = None if speed.compile_mode == "default" else speed.compile_mode
    return torch.compile(model, mode=mode)


def for_evaluation(model: nn.Module, speed: Speed) -> nn.Module:
    """The module validation runs: the user's inside the wrappers (no DDP: evaluation has no
    gradients to all-reduce), compiled when training is. Compiling it apart shares the
    parameters and buffers, and traces its own graphs for eval mode without gradients; build it
    once per run, as each compilation is paid once."""
    inner = unwrap(model)
    return _compiled(inner, speed) if speed.compile is True else inner


def settle_gradient_buckets(model: nn.Module, forward_backward: Callable[[], object]) -> None:
    """Give a resumed DDP process the gradient buckets an uninterrupted run has from step 2 on.

    DDP lays its buckets out twice: at wrapping, then again before the second forward, in the
    order the first backward produced the gradients. An all-reduce sums an element over the
    ranks in an order that depends on where the element sits in its bucket; with two ranks the
    order does not matter (a + b == b + a), with three or more it does (measured: 1e-8 apart
    after a resume at 3 processes). So a resumed process, whose first step would run in the
    first layout where the uninterrupted run was in the second, first runs `forward_backward`
    (one micro-batch, collective) and throws it away: weights, buffers (BatchNorm statistics),
    gradients and every random generator are left as they were.
    """
    ddp = _ddp_of(model)
    if ddp is None or (ddp.find_unused_parameters and not ddp.static_graph):
        return  # FSDP or one process (no buckets), or DDP keeping its first layout throughout
    buffers = [buffer.detach().clone() for buffer in ddp.module.buffers()]
    generators = rng_state()
    forward_backward()
    with torch.no_grad():
        for buffer, saved in zip(ddp.module.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    set_rng_state(generators)
    for parameter in ddp.module.parameters():
        parameter.grad = None


def _ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of a model (under torch.compile's), None if it has none."""
    while not isinstance(model, DistributedDataParallel):
        if not hasattr(model, "_orig_mod"):
            return None
        model = model._orig_mod
    return model


def with_rank0_buffers(model: nn.Module) -> nn.Module:
    """The user's module, its buffers (BatchNorm's running statistics) made rank 0's on every
    rank (collective). Under DDP each rank updates its own in its forward, and DDP copies rank
    0's to the others at the start of the next: so what every rank evaluates, and what a
    checkpoint holds (DCP saves one copy of a tensor all ranks have, from any of them), is
    what training goes on with. Nothing changes for training: DDP would copy them anyway."""
    ddp = _ddp_of(model)
    if ddp is not None and ddp.broadcast_buffers:
        for buffer in ddp.module.buffers():
            dist.broadcast(buffer, src=0)
    return unwrap(model)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(unwrap(model), FSDPModule)


def skip_gradient_sync(model: nn.Module):
    """A context in which backward accumulates gradients locally, without communicating (every
    micro-batch of a step but the last): DDP's no_sync(), FSDP's requires_gradient_sync."""
    inner = unwrap(model)
    if isinstance(inner, FSDPModule):
        return _fsdp_without_sync(inner)
    if hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_without_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value as one plain tensor, the same on every rank (collective)."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class ModelState:
    """The model's or the optimizer's state, keyed by parameter name, whatever the strategy.

    By default in the strategy's own layout, what checkpoints save and load (DCP): each rank's
    shards (DTensors) with FSDP, the whole tensors with DDP; no communication. whole=True: the
    whole tensors gathered onto rank 0 (a collective; the other ranks get an empty dict), what a
    one-file model export holds.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 whole: bool = False):
        self.wrapped, self.model, self.optimizer = model, unwrap(model), optimizer
        self.options = StateDictOptions(full_state_dict=True, cpu_offload=True) if whole else None

    def state_dict(self) -> dict:
        if self.optimizer is None:
            with_rank0_buffers(self.wrapped)
            return get_model_state_dict(self.model, options=self.options)
        state = get_optimizer_state_dict(self.model, self.optimizer, options=self.options)
        # A group's "name" (decay_groups) only labels its rate in the logs: checkpoints keep
        # the format of releases whose groups had none, so either loads into the other.
        groups = [{key: value for key, value in group.items() if key != "name"}
                  for group in state.get("param_groups", [])]
        return {**state, "param_groups": groups}

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state, options=self.options)
            return
        names = [group.get("name") for group in self.optimizer.param_groups]
        # Not strict: a parameter that never had a gradient has no state to load (the saved
        # state replaces the live one, so it has none after the load either, as when saved).
        options = replace(self.options or StateDictOptions(), strict=False)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=options)
        for group, name in zip(self.optimizer.param_groups, names, strict=True):
            if name is not None:  # the saved groups replace the live ones, names and all
                group["name"] = name


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any DDP / torch.compile wrappers (what checkpoints store)."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
