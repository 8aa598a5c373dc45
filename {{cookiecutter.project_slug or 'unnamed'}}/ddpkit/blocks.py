"""A model's repeated blocks: activation checkpointing (speed.activation_checkpointing) and
compilation (speed.compile=blocks) of each.

A transformer is mostly one block repeated, and in training most of its memory is the
activations each block keeps from the forward pass for the backward. With activation
checkpointing a chosen block keeps only its input and runs its forward again during the
backward: less memory for about a third more compute per block. Every block (k=1) saves the most,
every k-th block less.

Compiling the block instead of the whole model compiles one graph that every block runs
(their code is the same; the parameters are the graph's inputs), with the rest of the model
eager: a far shorter compilation for most of the speed.

The blocks are the model's own `repeated_blocks()`, where it defines one, else the children of
its longest nn.ModuleList (a transformer's layers). Each chosen block gets its forward replaced in
place, before DDP or FSDP wrap the model: parameter names, checkpoints and FSDP's units are the
same with it or without. The recomputation replays the random state of the forward (dropout draws
the same masks), so the loss and gradients are those of a run without it.
"""

import functools
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ddpkit.config import UserError


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's `repeated_blocks()`, else the children of its longest nn.ModuleList (the first
    of them, on a tie); [] if it has none."""
    if hasattr(model, "repeated_blocks"):
        return list(model.repeated_blocks())
    stacks = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    return list(max(stacks, key=len)) if stacks else []


def blocks_for(model: nn.Module, setting: str, other: str) -> list[nn.Module]:
    """The repeated blocks, or one line naming `setting` and the `other` way out."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise UserError(f"{setting} needs the model's repeated blocks, and it has no "
                        "nn.ModuleList: give the model a repeated_blocks() method that returns "
                        f"them, or set {other}")
    return blocks


def checkpoint_activations(model: nn.Module, every: int) -> tuple[int, int]:
    """Recompute the activations of every `every`-th repeated block (the first, then each
    `every` later) in the backward pass; returns (blocks chosen, blocks)."""
    blocks = blocks_for(model, f"speed.activation_checkpointing={every}",
                        "speed.activation_checkpointing=0")
    chosen = blocks[::every]
    for block in chosen:
        block.forward = functools.partial(_recomputed, block.forward)
    return len(chosen), len(blocks)


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward pass anyway
        return forward(*args, **kwargs)
    # Non-reentrant: torch's recommended mode, which takes keyword arguments and works under
    # DDP, FSDP2 and torch.compile; it restores the forward's random state for the recompute.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compile_blocks(model: nn.Module, mode: str | None) -> int:
    """torch.compile each repeated block's forward (after activation checkpointing, which the
    compiler then traces too); returns the number of blocks."""
    blocks = blocks_for(model, "speed.compile=blocks", "speed.compile=true (the whole model)")
    for block in blocks:
        # The bound forward, not Module.compile: on some torch releases that one runs eagerly.
        block.forward = torch.compile(block.forward, mode=mode)
    return len(blocks)


def compile_seconds() -> float | None:
    """The seconds torch.compile spent compiling in this process, where torch says (None where
    it does not: the figure comes from torch._dynamo.utils.compile_times, not a public API)."""
    compile_times = getattr(sys.modules.get("torch._dynamo.utils"), "compile_times", None)
    try:
        names, values = compile_times(repr="csv", aggregate=True)
        return float(values[names.index("_compile.compile_inner")])
    except (TypeError, ValueError, IndexError):  # no such function, no such figure
        return None
