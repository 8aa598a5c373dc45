"""speed.float8 (ddpkit/extras/float8.py): torchao's float8 linear layers, on GPUs with float8
tensor cores only. On the CPU: the layers it swaps (under torchao's emulation) and the one line
that refuses a real run here."""

import sys

import pytest
import torch

from conftest import TINY, needs_extra, run
from ddpkit.config import UserError, load_config
from ddpkit.lm import build_gpt
from ddpkit.speed import resolve_speed


def test_the_eligible_linear_layers_but_the_head_train_in_float8():
    needs_extra("float8", "torchao")
    from ddpkit.extras.float8 import convert_to_float8

    cfg = load_config(["model.name=gpt", "model.hidden_dim=64", "model.num_layers=2",
                       "model.dropout=0"]).model
    torch.manual_seed(0)
    plain = build_gpt(cfg, (16,), 50)
    torch.manual_seed(0)
    model = build_gpt(cfg, (16,), 50)
    # 2 blocks x (qkv, attention out, 2 MLP layers); the head (tied to the embedding) stays.
    assert convert_to_float8(model, emulate=True) == 8
    assert type(model.head) is torch.nn.Linear and model.head.weight is (
        model.token_embedding.weight)
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = [network(tokens).logsumexp(-1).mean() for network in (plain, model)]
    losses[1].backward()
    # float8's 3 mantissa bits round the products: the same loss to about a percent.
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=0.02)
    assert all(p.grad is not None for p in model.parameters())


def test_float8_on_the_cpu_is_one_line():
    cfg = load_config(["speed.float8=true"])
    with pytest.raises(UserError) as error:
        resolve_speed(cfg, torch.device("cpu"), (64,))
    assert str(error.value) == (
        "speed.float8=true needs an NVIDIA GPU with float8 tensor cores (compute capability 8.9 "
        "or newer: L4, RTX 40xx, H100 ...), and this run is on cpu: set speed.float8=false")


@pytest.mark.slow
def test_a_float8_run_on_the_cpu_stops_before_training_in_one_line(tmp_path):
    result = run([sys.executable, "train.py", *TINY, "speed.float8=true",
                  f"run.output_dir={tmp_path}"])
    assert result.returncode == 2, result.stdout
    assert result.stdout.splitlines()[-1].startswith("error: speed.float8=true needs an NVIDIA")
    assert "Traceback" not in result.stdout and not list(tmp_path.iterdir())
