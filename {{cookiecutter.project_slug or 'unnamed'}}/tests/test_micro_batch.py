"""train.micro_batch_size=auto: the search (sizes doubled, then halved; a size predicted over the
limit not tried under FSDP), its refusal off a GPU, and a real 2-process run where the GPU's
memory is played by the bytes each try saves for the backward (tests/auto_micro_batch.py)."""

import json
import math

import pytest
import torch
from auto_micro_batch import SavedBytes
from test_faults import final_model

from conftest import TINY, only_run_dir, run
from ddpkit import recipes
from ddpkit.config import UserError, load_config
from ddpkit.data import DataModule
from ddpkit.dist_utils import DistEnv
from ddpkit.memory_plan import size as in_bytes
from ddpkit.micro_batch import divisors, largest_fitting
from ddpkit.parallel import build_model
from ddpkit.run_state import forward_backward
from ddpkit.speed import resolve_speed
from ddpkit.tasks import build_task


def search(limit: float, peak_of, predict: bool = False) -> tuple:
    calls = []

    def recorded(size: int) -> float:
        calls.append(size)
        return peak_of(size)

    size, tried, predicted = largest_fitting(divisors(48), recorded, limit, predict)
    return size, calls, predicted


def test_the_search_doubles_then_halves_and_keeps_the_largest_that_fits():
    linear = lambda size: 100 + 10 * size  # noqa: E731
    # fits up to 20 samples: 16 is the largest divisor of 48 that does; 24 does not
    assert search(300, linear) == (16, [1, 2, 4, 8, 16, 24], set())
    assert search(190, linear) == (8, [1, 2, 4, 8, 16, 12], set())  # halved back from 16
    assert search(1000, linear) == (48, [1, 2, 4, 8, 16, 24, 48], set())
    assert search(105, linear) == (None, [1], set())  # not even one sample
    out_of_memory = lambda size: math.inf if size >= 12 else linear(size)  # noqa: E731
    assert search(1000, out_of_memory) == (8, [1, 2, 4, 8, 16, 12], set())


def test_under_fsdp_a_size_the_line_puts_over_the_limit_is_not_tried():
    # (sizes 8 and 16 fitted: the line through them puts 24 at 340, over 300)
    assert search(300, lambda size: 100 + 10 * size, predict=True) == (
        16, [1, 2, 4, 8, 16], {24})


@pytest.mark.parametrize("args, message", [
    (["train.micro_batch_size=auto", "train.grad_accum_steps=2"],
     "train.micro_batch_size=auto and train.grad_accum_steps=2 both set the accumulation"),
    (["train.micro_batch_size=big"], "train.micro_batch_size=big is not valid: give a number "
     "of samples (0: from the global batch) or auto"),
    (["train.micro_batch_size=1.5"], "train.micro_batch_size=1.5 is not valid (command line): "
     "train.micro_batch_size must be a whole number or a name (auto)"),
])
def test_a_micro_batch_size_that_cannot_work_is_one_line(args, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_config([*TINY, *args], world_size=2)


@pytest.mark.slow
def test_auto_is_refused_off_a_gpu_in_one_line(tmp_path):
    result = run(["./run.sh", *TINY, "train.micro_batch_size=auto", f"run.output_dir={tmp_path}"],
                 NPROC_PER_NODE="2")
    assert result.returncode == 2, result.stdout
    assert result.stdout.strip().splitlines() == [
        "error: train.micro_batch_size=auto finds the micro-batch by trying it on the GPU, and "
        "this run is on cpu: set a number of samples (e.g. train.micro_batch_size=8), or 0 for "
        "the global batch / processes"]
    assert list(tmp_path.iterdir()) == []  # no run folder


def saved_bytes(args: list[str], sizes: list[int]) -> list[int]:
    """What a try of each size saves for the backward, as the run's tries measure it."""
    recipes.load()
    cfg = load_config(args)
    data = DataModule(cfg, DistEnv(0, 0, 2, True), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    shape = task.input_shape(data.first_samples()[0])
    model = build_model(cfg.model, shape, task.num_outputs)
    speed = resolve_speed(cfg, torch.device("cpu"), shape)
    peaks = []
    for size in sizes:
        with SavedBytes(2**40).measure() as measured:
            forward_backward(model, data.sample_batch(size), task, torch.device("cpu"), speed, None)
        peaks.append(measured["peak"])
    return peaks


def losses(run_dir) -> list:
    return [record["loss"] for record in map(json.loads, (run_dir / "train_log.jsonl")
                                             .read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, third", [
    ("ddp", "out of memory"), ("fsdp", "not tried, over on the line through the last two")])
def test_auto_trains_with_the_largest_micro_batch_every_rank_fits(tmp_path, strategy, third):
    """Each rank's share is 6 samples: 1 and 2 fit, 3 does not on rank 1 (DDP: tried, out of
    memory there only; FSDP: not tried, as the line through 1 and 2 puts it over the limit).
    Both ranks train with 2 samples a pass and 3 accumulation steps, exactly as
    train.micro_batch_size=2 does: the tries left no trace."""
    args = [*TINY, "train.epochs=1", "train.log_every=1", f"parallel.strategy={strategy}"]
    one, two, three = saved_bytes(args, [1, 2, 3])
    capacity = int(two / 0.9) + 1  # 2 fits within 90% of it, 3 does not fit at all
    assert three > capacity and 2 * two - one > 0.9 * capacity
    auto = run(["./run.sh", "tests/auto_micro_batch.py", *args, "train.micro_batch_size=auto",
                f"run.output_dir={tmp_path / 'auto'}"], NPROC_PER_NODE="2",
               AUTO_CAPACITY=f"{2**40},{capacity}")
    assert auto.returncode == 0, auto.stdout
    assert (f"train.micro_batch_size=auto: 2 sample(s) a pass, 3 accumulation step(s) for the "
            f"global batch of 12 (peaks 1: {in_bytes(one)}, 2: {in_bytes(two)}, 3: {third}; "
            f"limit {in_bytes(int(0.9 * capacity))}, 90% of what the GPU could give); "
            "train.micro_batch_size=2 skips the tries") in auto.stdout
    assert auto.stdout.count("train.micro_batch_size=auto") == 1, auto.stdout
    assert "2 per micro-batch x 2 process(es) x 3 accumulation step(s)" in auto.stdout
    pinned = run(["./run.sh", *args, "train.micro_batch_size=2",
                  f"run.output_dir={tmp_path / 'pinned'}"], NPROC_PER_NODE="2")
    assert pinned.returncode == 0, pinned.stdout
    auto_dir, pinned_dir = only_run_dir(tmp_path / "auto"), only_run_dir(tmp_path / "pinned")
    assert losses(auto_dir) == losses(pinned_dir) and len(losses(auto_dir)) == 19
    weights, expected = final_model(auto_dir), final_model(pinned_dir)
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    assert "micro_batch_size: auto" in (auto_dir / "config.yaml").read_text()
