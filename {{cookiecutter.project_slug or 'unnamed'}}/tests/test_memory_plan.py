"""The memory plan (ddpkit/memory_plan.py, `python config.py --plan`): its parameter, gradient and
optimizer figures are the bytes a real training step allocates, FSDP's are a process's share of
them, activation checkpointing lowers the activation estimate, and the command prints the
table, or one line for a model that fails."""

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import run
from ddpkit import memory_plan
from ddpkit.config import load_config
from ddpkit.lm import build_gpt
from ddpkit.optimizers import build_optimizer
from ddpkit.speed import resolve_speed

GPT = ["model.name=gpt", "model.hidden_dim=64", "model.num_layers=4", "model.dropout=0.1"]
WINDOW, VOCAB = (32,), 50


def next_token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())


def traced(*overrides: str) -> tuple[memory_plan.Traced, object]:
    cfg = load_config([*GPT, *overrides])
    speed = resolve_speed(cfg, torch.device("cpu"), WINDOW)
    tokens = torch.randint(0, VOCAB, (8, *WINDOW), generator=torch.Generator().manual_seed(0))
    build = functools.partial(build_gpt, cfg.model, WINDOW, VOCAB)
    return memory_plan.trace(build, next_token_loss, tokens, cfg, torch.device("cpu"), speed), cfg


def allocated_by_a_real_step(cfg) -> dict[str, int]:
    """The bytes of the parameters, gradients and optimizer state after one real CPU step of
    the built-in GPT (the fused AdamW kernel where the run would use it)."""
    torch.manual_seed(0)
    model = build_gpt(cfg.model, WINDOW, VOCAB)
    optimizer = build_optimizer(model, cfg, fused=True)
    next_token_loss(model, torch.randint(0, VOCAB, (2, *WINDOW))).backward()
    optimizer.step()
    parameters = list(model.parameters())
    state = [tensor for p in parameters for tensor in optimizer.state[p].values()
             if isinstance(tensor, torch.Tensor)]
    return {"parameters": memory_plan.nbytes(parameters),
            "gradients": memory_plan.nbytes(p.grad for p in parameters),
            "optimizer": memory_plan.nbytes(state)}


@pytest.mark.parametrize("optimizer", [["optim.name=adamw"],
                                       ["optim.name=sgd", "optim.args.momentum=0.9"]])
def test_parameters_gradients_and_optimizer_state_are_what_a_real_step_allocates(optimizer):
    plan, cfg = traced(*optimizer)
    ddp = memory_plan.footprints(plan, cfg, world_size=1)["ddp"]
    planned = {"parameters": ddp.parameters, "gradients": ddp.gradients,
               "optimizer": ddp.optimizer}
    assert planned == allocated_by_a_real_step(cfg)
    assert plan.notes == []
    # AdamW: two moments the size of the parameters and a 4-byte step count each; SGD: one.
    moments = 2 if "optim.name=adamw" in optimizer else 1
    steps = 4 * len(plan.parameters) if moments == 2 else 0
    assert ddp.optimizer == moments * ddp.parameters + steps


def test_fsdp_holds_a_share_of_them_and_ddp_buckets_without_views_a_second_copy():
    plan, cfg = traced()
    rows = sum(size // shape[0] for shape, size, _ in plan.parameters)  # one row of each
    at_3 = memory_plan.footprints(plan, cfg, world_size=3)
    ddp, fsdp = at_3["ddp"], at_3["fsdp"]
    for part in ("parameters", "gradients"):
        share = getattr(ddp, part) / 3
        assert share <= getattr(fsdp, part) < share + rows, part
    moments = ddp.optimizer - 4 * len(plan.parameters)  # AdamW's step counts: whole everywhere
    assert moments / 3 <= fsdp.optimizer - 4 * len(plan.parameters) < moments / 3 + 2 * rows
    assert fsdp.activations == ddp.activations and ddp.gathered == 0 < fsdp.gathered
    no_views = load_config([*GPT, "ddp.gradient_as_bucket_view=false"])
    assert memory_plan.footprints(plan, no_views, 3)["ddp"].gradients == 2 * ddp.gradients


def test_activation_checkpointing_lowers_the_activation_estimate():
    """Measured on the CPU allocator (torch.profiler's memory timeline) for 8 blocks of width
    128 and 16 windows of 256 tokens, the step's peak beyond the weights was 502, 270 and 90 MiB
    with checkpointing off, of every second block and of every block; the estimates 491, 258 and
    78 MiB."""
    estimates = {every: traced(f"speed.activation_checkpointing={every}")[0].activations
                 for every in (0, 2, 1)}
    assert estimates[0] > estimates[2] > estimates[1] > 0
    assert estimates[1] < 0.4 * estimates[0], estimates


def test_python_config_plan_prints_the_table():
    result = run([sys.executable, "config.py", "--plan", "--world-size", "2"])
    assert result.returncode == 0, result.stdout
    assert result.stdout.splitlines() == [
        "memory per process at 2 process(es) (--world-size): micro-batch of 32 sample(s) x 1 "
        "accumulation step(s), precision fp32, on cpu",
        "                            ddp (configured)                fsdp",
        "parameters                         332.0 KiB           166.0 KiB",
        "gradients                          332.0 KiB           166.0 KiB",
        "optimizer state                    664.1 KiB           332.1 KiB",
        "gathered weights                           -           332.0 KiB",
        "activations (estimate)             201.5 KiB           201.5 KiB",
        "total                                1.5 MiB             1.2 MiB",
        "activations: an estimate, what one micro-batch's forward keeps for the backward; its "
        "temporaries, the data loader and the CUDA context come on top (docs/speed.md)"]


def test_a_model_that_fails_to_build_is_one_line(tmp_path, capsys):
    mine = tmp_path / "mine.py"
    mine.write_text("def build(cfg, input_shape, num_outputs):\n    return Linear(1, 1)\n")
    assert memory_plan.main(["--world-size", "1", f"model.name={mine}:build"]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"error: the memory plan stopped: {mine} line 2: NameError: name "
                              "'Linear' is not defined\n")
