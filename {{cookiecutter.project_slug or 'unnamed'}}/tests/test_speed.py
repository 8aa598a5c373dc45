"""Speed settings and the data path: each setting trains on the CPU, none changes the batches."""

import dataclasses
import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import IMAGES, TINY, TINY_SPLIT, only_run_dir, torchrun
from ddpkit.checkpoint_load import load_checkpoint, read_model
from ddpkit.config import load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.parallel import build_model, for_evaluation
from ddpkit.run_state import train_step
from ddpkit.speed import FLOAT32, Speed, grad_scaler
from ddpkit.tasks import build_task

STEPS_PER_EPOCH = TINY_SPLIT["train"] // 12  # TINY's global batch


def test_whole_batch_indexing_gives_the_samplers_batches():
    cfg = load_config(TINY)
    data = DataModule(cfg, DistEnv(1, 1, 3, True), torch.device("cpu"))
    assert data.train_loader.batch_size is None  # the fast path: one dataset[indices] a batch
    data.train_sampler.set_epoch(2)
    # What a DataLoader does by default: dataset[i] for each sample, then stack them.
    per_sample = list(DataLoader(data.datasets["train"], batch_size=data.micro_batch_size,
                                 sampler=data.train_sampler))
    fast = list(data.train_batches(2))
    assert len(fast) == len(per_sample) == data.steps_per_epoch
    for batch, reference in zip(fast, per_sample, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(batch, reference, strict=True))
    shard = data.eval_loader("test").sampler.sampler  # this rank's block of the test split
    inputs = torch.cat([x for x, _ in data.eval_loader("test")])
    assert torch.equal(inputs, data.datasets["test"].inputs[shard.start:shard.end])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_step_clips_the_unscaled_gradients(dtype):
    cfg = load_config([*TINY, "optim.grad_clip=0.01"])
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    batches = next(data.train_steps(0))

    def one_step(speed: Speed, clip: float):
        torch.manual_seed(0)
        shape = task.input_shape(data.datasets["train"][0])
        model = build_model(cfg.model, shape, task.num_outputs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the weights
        scaler = grad_scaler(speed, torch.device("cpu"))
        values, _, norm = train_step(model, optimizer, batches, task, torch.device("cpu"),
                                     speed, scaler, clip)
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        return values, norm, clipped, scaler

    _, exact_norm, _, _ = one_step(FLOAT32, 1e9)
    speed = Speed(dtype, channels_last=False, compile=False, compile_mode="default",
                  fused_adamw=False)
    stats, norm, clipped, scaler = one_step(speed, 0.01)
    assert (scaler is not None) == (dtype == torch.float16)  # loss scaling for fp16 only
    assert math.isfinite(stats["loss"].item())
    # The norm is that of the true gradients (unscaled: a scaled one would be ~65536x) ...
    assert norm.item() == pytest.approx(exact_norm.item(), rel=0.05)
    assert norm.item() > 0.01
    assert clipped.item() == pytest.approx(0.01, rel=1e-3)  # ... and clipped to optim.grad_clip


def test_validation_runs_the_users_module_compiled_when_training_is():
    module = torch.nn.Linear(3, 2)
    assert for_evaluation(module, FLOAT32) is module
    compiling = dataclasses.replace(FLOAT32, compile=True)
    trained = torch.compile(module)  # as wrap_model leaves it on one process
    evaluated = for_evaluation(trained, compiling)
    # Its own compiled wrapper (not training's), around the user's module: the same parameters.
    assert isinstance(evaluated, torch._dynamo.eval_frame.OptimizedModule)
    assert evaluated is not trained and evaluated._orig_mod is module


def test_the_task_scalars_get_outputs_without_a_graph():
    """train_step hands the task's train_scalars outputs cut off the graph (no no_grad()
    context is entered): what they compute builds none and needs no detach."""
    cfg = load_config(TINY)
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    seen = []

    def train_scalars(outputs, batch):
        seen.append(outputs.requires_grad)
        return {"mean_logit": outputs.mean()}

    task.train_scalars = train_scalars
    model = build_model(cfg.model, task.input_shape(data.datasets["train"][0]), task.num_outputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    values, _, _ = train_step(model, optimizer, next(data.train_steps(0)), task,
                              torch.device("cpu"))
    assert seen == [False]
    assert set(values) == {"loss", "mean_logit"}
    assert not any(value.requires_grad for value in values.values())
    assert all(p.grad is not None for p in model.parameters())  # the loss was differentiated


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "shown"),
    [
        ([*IMAGES, "speed.precision=bf16", "speed.channels_last=true", "speed.fused_adamw=true",
          "speed.tf32=true", "optim.grad_clip=0.5", "model.batchnorm=true",
          "model.sync_batchnorm=true"], "precision bf16, channels_last"),
        (["speed.precision=fp16", "optim.grad_clip=0.5", "speed.fused_adamw=false"],
         "precision fp16"),
        (["speed.compile=true", "train.grad_accum_steps=2"],
         "precision fp32, torch.compile (default)"),
    ],
    ids=["cnn-bf16-channels_last-fused-clip", "fp16-scaler-clip", "compile-accum"],
)
def test_speed_setting_trains_with_a_finite_loss(tmp_path, settings, shown):
    result = torchrun(2, "train.py", *TINY, f"run.output_dir={tmp_path}", "train.epochs=2",
                      "train.log_every=2", *settings)
    assert result.returncode == 0, result.stdout
    assert f"2 process(es) on cpu, backend gloo, {shown} |" in result.stdout
    # Fused where asked (or by default) and PyTorch has the CPU kernel, and said only then.
    assert ("optimizer fused AdamW," in result.stdout) == (
        "speed.fused_adamw=false" not in settings), result.stdout
    run_dir = only_run_dir(tmp_path)
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 * STEPS_PER_EPOCH
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]  # it learns
    clipping = "optim.grad_clip=0.5" in settings
    assert all(("grad_norm" in r) == clipping for r in records)
    saved = run_dir / "checkpoints" / f"step-{records[-1]['step']:08d}"
    assert (load_checkpoint(saved)["scaler"] is not None) == ("speed.precision=fp16" in settings)
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in read_model(saved))


@pytest.mark.slow
def test_dataloader_workers_under_ddp(tmp_path):
    result = torchrun(2, "tests/probes.py", "workers", str(tmp_path), *TINY, "data.num_workers=2")
    assert result.returncode == 0, result.stdout
    ranks = json.loads((tmp_path / "workers.json").read_text())
    assert all(rank["same_batches"] for rank in ranks)  # workers change nothing in the batches
    draws = [draw for rank in ranks for draw in rank["first_draws"]]
    assert len(draws) == 4  # 2 ranks x 2 workers, each with its own seed and random streams
    for column in range(1, 5):  # seed, torch, numpy, random
        assert len({draw[column] for draw in draws}) == 4
