"""Activation checkpointing (ddpkit/blocks.py, speed.activation_checkpointing): the repeated
blocks it finds, the same loss and gradients as without it (dropout on), and the memory of a
training step of the built-in GPT with 8 blocks. Real runs under DDP and FSDP:
test_language_model.py."""

import sys

import pytest
import torch
from torch import nn

from conftest import run
from ddpkit.blocks import checkpoint_activations, compile_blocks, repeated_blocks
from ddpkit.config import UserError, load_config
from ddpkit.lm import build_gpt


def gpt(layers: int = 4, dropout: float = 0.1) -> nn.Module:
    cfg = load_config(["model.name=gpt", "model.hidden_dim=64", f"model.num_layers={layers}",
                       f"model.dropout={dropout}"]).model
    torch.manual_seed(0)
    return build_gpt(cfg, (32,), 50)


class Stacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.short = nn.ModuleList([nn.Linear(2, 2)])
        self.long = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])


def test_the_blocks_are_the_models_own_else_its_longest_module_list():
    model = gpt()
    assert repeated_blocks(model) == list(model.blocks)
    stacks = Stacks()
    assert repeated_blocks(stacks) == list(stacks.long)
    stacks.repeated_blocks = lambda: [stacks.short[0]]  # the model says which
    assert repeated_blocks(stacks) == [stacks.short[0]]
    with pytest.raises(UserError) as error:
        checkpoint_activations(nn.Sequential(nn.Linear(2, 2)), 1)
    assert str(error.value) == (
        "speed.activation_checkpointing=1 needs the model's repeated blocks, and it has no "
        "nn.ModuleList: give the model a repeated_blocks() method that returns them, or set "
        "speed.activation_checkpointing=0")
    with pytest.raises(UserError, match=r"^speed.compile=blocks needs the model's repeated "
                       r"blocks, .* or set speed.compile=true \(the whole model\)$"):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)), None)


@pytest.mark.parametrize("every", [1, 3])
def test_the_same_loss_and_gradients_with_dropout_on(every):
    """The recomputed forward draws the same dropout masks: bitwise the same step."""
    tokens = torch.randint(0, 50, (4, 32), generator=torch.Generator().manual_seed(1))
    steps = []
    for checkpointed in (False, True):
        model = gpt()
        if checkpointed:
            assert checkpoint_activations(model, every) == (len(range(0, 4, every)), 4)
        torch.manual_seed(2)
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        steps.append((loss, {name: p.grad for name, p in model.named_parameters()}))
    (plain_loss, plain), (loss, grads) = steps
    assert torch.equal(loss, plain_loss)
    assert [name for name in plain if not torch.equal(grads[name], plain[name])] == []
    assert [name for name, _ in gpt().named_parameters()] == list(grads)  # names unchanged
    model = gpt()
    checkpoint_activations(model, every)
    with torch.no_grad():  # evaluation: the plain forward
        assert torch.equal(model.eval()(tokens), gpt().eval()(tokens))


@pytest.mark.slow
def test_checkpointing_every_block_cuts_a_steps_activation_memory_by_over_40_percent():
    """8 blocks, 16 windows of 256 tokens: the step's peak beyond the model and gradients, each
    in a process of its own (tests/activation_peak.py)."""
    peaks = {}
    for every in (0, 1):
        measured = run([sys.executable, "tests/activation_peak.py", str(every)])
        assert measured.returncode == 0, measured.stdout
        peaks[every] = float(measured.stdout)
    assert peaks[1] < 0.6 * peaks[0], peaks  # measured: 200 against 560 MiB
