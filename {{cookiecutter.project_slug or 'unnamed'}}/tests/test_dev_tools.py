"""Tools for changing the model: the fast dev run, shorter epochs, the profiler, PyTorch's
distributed debug mode, and the model FLOPs behind the logged throughput."""

import json
import math
import sys

import pytest
import torch

from conftest import TINY, fixture, only_run_dir, run, torchrun
from ddpkit.config import load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.parallel import build_model
from ddpkit.tasks import build_task
from ddpkit.utilization import count_flops


def run_sh(*args: str, nproc: int = 2):
    return run(["./run.sh", *args], NPROC_PER_NODE=str(nproc))


def test_fast_dev_run_says_ok_and_keeps_no_run(tmp_path):
    output = tmp_path / "runs"
    (output / "an-earlier-run").mkdir(parents=True)
    result = run_sh("train.fast_dev_run=true", f"run.output_dir={output}")  # the default setup
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("fast_dev_run ok") == 1, result.stdout
    assert "2 training steps" in result.stdout and "on 2 process(es)" in result.stdout
    assert [path.name for path in output.iterdir()] == ["an-earlier-run"]


@pytest.mark.slow  # the quick tier (-m 'not slow') skips it
def test_fast_dev_run_fails_once_with_the_models_error(tmp_path):
    output = tmp_path / "runs"
    result = run_sh("train.fast_dev_run=true", f"model.name={fixture('broken_mlp')}",
                    f"data.dataset={fixture('vectors')}", "model.hidden_dim=32",
                    f"run.output_dir={output}")
    assert result.returncode == 1, result.stdout
    # Once: one rank's traceback, and no torchrun restart that would print it again.
    assert result.stdout.count("mat1 and mat2 shapes cannot be multiplied") == 1, result.stdout
    assert result.stdout.count("Traceback") == 1, result.stdout
    assert "fast_dev_run ok" not in result.stdout
    assert list(output.iterdir()) == []  # its temporary run folder is gone too


def test_limits_shorten_the_epochs_of_a_real_run(tmp_path):
    result = run([sys.executable, "train.py", *TINY, "train.limit_train_batches=4",
                  "train.limit_val_batches=0.5", "train.epochs=2", f"run.output_dir={tmp_path}"])
    assert result.returncode == 0, result.stdout
    run_dir = only_run_dir(tmp_path)
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [epoch["step"] for epoch in epochs] == [4, 8]
    assert "4 steps per epoch, 8 steps" in result.stdout


def test_limited_loaders_keep_the_first_batches_of_every_rank():
    # 228 training samples in global batches of 12: 19 steps; 53 validation samples.
    cfg = load_config([*TINY, "train.limit_train_batches=0.25", "eval.batch_size=10"],
                      world_size=2)
    shards = [DataModule(cfg, DistEnv(rank, rank, 2, True), torch.device("cpu"))
              for rank in (0, 1)]
    assert shards[1].steps_per_epoch == 4  # int(19 * 0.25)
    assert len(list(shards[1].train_steps(epoch=0))) == 4
    assert len(list(shards[1].train_steps(epoch=0, skip_steps=1))) == 3
    # Two batches of 10 on each of 2 ranks: the split's first 40 samples, each on one rank
    # (rank 0 a block of 20, rank 1 the next).
    seen = torch.cat([inputs for data in shards for inputs, _ in data.eval_loader("val", 2)])
    val = shards[0].datasets["val"]
    assert torch.equal(seen, torch.stack([val[index][0] for index in range(40)]))
    half = shards[0].eval_loader("val", limit=0.5)  # half of 53, the dataset itself kept
    assert half.sampler.sampler.dataset_len == 26 and half.dataset is val


@pytest.mark.slow  # the quick tier (-m 'not slow') skips it
def test_profile_writes_a_trace_per_rank_and_prints_one_table(tmp_path):
    result = torchrun(2, "train.py", *TINY, "train.epochs=1", "profile.enabled=true",
                      "profile.start_step=3", "profile.steps=2", "profile.top_ops=12",
                      f"run.output_dir={tmp_path}")
    assert result.returncode == 0, result.stdout
    traces = sorted((only_run_dir(tmp_path) / "profile").glob("*.pt.trace.json"))
    assert [path.name.split(".")[0] for path in traces] == ["rank0", "rank1"]
    for rank, path in enumerate(traces):
        validator = pytest.importorskip("torch.profiler._trace_validator")  # torch's own loader
        passed, violations = validator.validate_trace(str(path))
        assert passed, violations
        trace = json.loads(path.read_text())
        assert trace["distributedInfo"]["rank"] == rank
        steps = {event["name"] for event in trace["traceEvents"]
                 if event.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#3", "ProfilerStep#4"}  # numbered as training steps
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"aten::addmm", "c10d::allreduce_"} <= names  # the model, and DDP's all-reduce
    assert result.stdout.count("the top 12 operations of rank 0") == 1, result.stdout


@pytest.mark.slow  # the quick tier (-m 'not slow') skips it
def test_debug_mode_names_the_parameters_that_got_no_gradient(tmp_path):
    result = run_sh(*TINY, f"model.name={fixture('unused_head')}", "ddp.debug=true",
                    f"run.output_dir={tmp_path}")
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stdout
    assert "spare_head.weight" in errors[0] and "spare_head.bias" in errors[0], errors[0]
    assert "ddp.find_unused_parameters=true" in errors[0]


def hand_count_mlp(features: int, hidden: int, layers: int, classes: int) -> int:
    """2 FLOPs per multiply-add. Forward: every Linear; backward: the gradient of every weight,
    and of every layer's input but the first (the data needs none)."""
    widths = [features] + [hidden] * layers + [classes]
    macs = [n_in * n_out for n_in, n_out in zip(widths, widths[1:], strict=False)]
    return 2 * (3 * sum(macs) - macs[0])


def hand_count_cnn(channels_in: int, size: int, channels: int, layers: int, classes: int) -> int:
    """The same rule for the 3x3 convolutions (padding 1; stride 1, then 2) and the classifier."""
    macs, width = [], channels_in
    for index in range(layers + 1):
        out = channels * 2 ** index
        size = size if index == 0 else math.ceil(size / 2)
        macs.append(out * size * size * width * 3 * 3)
        width = out
    macs.append(width * classes)
    return 2 * (3 * sum(macs) - macs[0])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_flops_of_a_training_step_of_the_default_models_equal_a_hand_count(name):
    cfg = load_config([f"model.name={name}"], world_size=2)  # the default digits, 2 processes
    data = DataModule(cfg, DistEnv(0, 0, 2, True), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    shape = task.input_shape(data.datasets["train"][0])
    bare = build_model(cfg.model, shape, task.num_outputs)
    per_step = count_flops(cfg, data, task, shape, bare) * data.batch_size_per_rank
    model = cfg.model
    if name == "mlp":
        hand = hand_count_mlp(math.prod(shape), model.hidden_dim, model.num_layers, 10)
    else:
        hand = hand_count_cnn(shape[0], shape[1], model.channels, model.num_layers, 10)
    assert per_step == hand * data.batch_size_per_rank  # one rank's step: 32 samples


@pytest.mark.parametrize("name, precision, tf32, peak", [
    ("NVIDIA H200", "bf16", True, 989e12), ("NVIDIA H100 80GB HBM3", "fp32", True, 495e12),
    ("NVIDIA H100 PCIe", "bf16", True, 756e12), ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5e12),
    ("NVIDIA L40", "bf16", True, 181e12), ("NVIDIA L4", "bf16", True, 121e12),
    ("Tesla V100-SXM2-32GB", "fp32", True, 15.7e12),  # no TF32 before Ampere
    ("NVIDIA Quadro X", "bf16", True, None),  # not in the table: MFU unknown, said so
])
def test_peak_flops_of_known_gpus_and_an_unknown_one(monkeypatch, name, precision, tf32, peak):
    from ddpkit import flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    found, device_name = flops.peak_flops(torch.device("cuda", 0), precision, tf32)
    assert found == peak and device_name == name
    text = flops.describe_flops(1e9, found, device_name, torch.device("cuda", 0))
    assert ("MFU unknown" in text) == (peak is None) and name in text
    assert flops.peak_flops(torch.device("cpu"), precision, tf32)[0] is None


def test_a_window_reports_mfu_against_the_peak(tmp_path):
    from ddpkit.training_log import TrainingLog

    log = TrainingLog(tmp_path, DistEnv(0, 0, 4, True), torch.device("cpu"))
    log.flops_per_sample, log.peak_flops = 3e9, 100e12
    rates = log._rates(samples=8000, seconds=2.0)  # 4000 samples/s on 4 ranks
    assert rates["samples_per_s"] == 4000 and rates["samples_per_s_per_rank"] == 1000
    assert math.isclose(rates["tflops_per_rank"], 3.0)  # 1000 x 3 GFLOP per second
    assert math.isclose(rates["mfu"], 0.03)
