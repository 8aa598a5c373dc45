"""Streamed splits (ddpkit/streams.py): every sample once an epoch over any process and worker
count, every rank the same steps, the same global batches and augmentation at 1, 2 and 3
processes, an exact resume from any step, evaluation blocks in the split's order."""

import json

import pytest
import torch
from torch.utils.data import IterableDataset

from conftest import TINY, fixture, torchrun
from ddpkit.config import UserError, load_config
from ddpkit.data import DataModule, Step
from ddpkit.dist_utils import DistEnv
from ddpkit.parallel import build_model
from ddpkit.run_state import train_step
from ddpkit.streams import EpochOrder, EvalPlan, ShardedStream, TrainPlan, as_stream, read_chunks
from ddpkit.tasks import build_task
from fixtures import ID_SHARDS, id_shard

STREAM = [*TINY, f"data.dataset={fixture('id_stream')}", "train.global_batch_size=12",
          "run.seed=3"]
SAMPLES = sum(ID_SHARDS)  # 77: 6 steps of 12 and one of 5


@pytest.mark.parametrize("samples", [77, 73, 72, 12, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_plan_counts_every_sample_once_with_the_same_steps_everywhere(samples, world,
                                                                         micro_batches):
    plans = [TrainPlan(samples, 12, world, rank, micro_batches, drop_last=False)
             for rank in range(world)]
    chunks = [plan.chunks(0) for plan in plans]
    counted = sorted(p for rank in chunks for _, weight, lo, hi in rank if weight
                     for p in range(lo, hi))
    assert counted == list(range(samples))
    steps = [sorted({step for step, *_ in rank}) for rank in chunks]
    assert all(s == list(range(-(-samples // 12))) for s in steps)
    for step in steps[0]:  # the weights average to 1: DDP's mean is the step's mean loss
        weights = {rank: w for rank, c in enumerate(chunks) for s, w, *_ in c if s == step}
        assert sum(weights.values()) == pytest.approx(world)
    dropped = TrainPlan(samples, 12, world, 0, micro_batches, drop_last=True)
    assert dropped.steps == samples // 12


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_step_at_weight_0_trains_and_logs_no_sample(accumulation):
    """A rank with no share of an epoch's last step runs a stand-in at weight 0 (it joins the
    all-reduce): no gradient, and no sample in the logged means or the throughput."""
    cfg = load_config(TINY)
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    model = build_model(cfg.model, task.input_shape(data.datasets["train"][0]), task.num_outputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = data.datasets["train"][[0, 1]]
    for weight, expected in [(0.0, 0), (1.0, 2 * accumulation)]:
        step = Step([batch] * accumulation)
        step.weight = weight
        _, samples, _ = train_step(model, optimizer, step, task, torch.device("cpu"))
        assert samples == expected
        assert all(p.grad.abs().sum() > 0 for p in model.parameters()) == bool(weight)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_evaluation_blocks_are_the_split_in_order(world):
    plans = [EvalPlan(29, 4, world, rank) for rank in range(world)]
    positions = [p for plan in plans for _, _, lo, hi in plan.chunks() for p in range(lo, hi)]
    assert positions == list(range(29))
    assert plans[0].block_sizes() == [len(range(p.first, p.end)) for p in plans]


def global_steps(ranks: list[list[dict]]) -> list[tuple]:
    """Each step's counted samples, ranks' shares concatenated in rank order (ids and draws)."""
    return [(tuple(i for r in share if r["weight"] for i in r["ids"]),
             tuple(x for r in share if r["weight"] for x in r["drawn"]))
            for share in zip(*ranks, strict=True)]


def in_process(world: int, *extra: str) -> list[dict]:
    """The probe's records of every rank of `world`, made in this process without workers."""
    from probes import stream_steps

    cfg = load_config([*STREAM, *extra])
    records = []
    for rank in range(world):
        data = DataModule(cfg, DistEnv(rank, rank, world, False), torch.device("cpu"))
        records.append({"epochs": [stream_steps(data.train_steps(e)) for e in range(2)],
                        "resumed": stream_steps(data.train_steps(1, skip_steps=4))})
    return records


def test_three_processes_with_two_workers_each_see_every_sample_once(tmp_path):
    result = torchrun(3, "tests/probes.py", "streams", str(tmp_path), *STREAM,
                      "data.num_workers=2", "train.grad_accum_steps=2")
    assert result.returncode == 0, result.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for epoch in range(2):
        shares = [rank["epochs"][epoch] for rank in ranks]
        assert [len(share) for share in shares] == [7, 7, 7]  # the same steps on every rank
        seen = [i for share in shares for step in share if step["weight"] for i in step["ids"]]
        assert sorted(seen) == list(range(SAMPLES))  # each sample exactly once
    orders = [global_steps([rank["epochs"][e] for rank in ranks]) for e in range(2)]
    assert orders[0] != orders[1]  # a new order every epoch
    # The last step's 5 samples: shares 1, 2, 2, each rank's loss weighted by its share.
    assert [rank["epochs"][0][-1]["weight"] for rank in ranks] == [0.6, 1.2, 1.2]
    # A resume from step 4 of epoch 1 reads what the uninterrupted epoch read from there.
    assert global_steps([rank["resumed"] for rank in ranks]) == orders[1][4:]
    # Evaluation: rank blocks in rank order are the test split in shard order.
    assert [i for rank in ranks for i in rank["test"]] == list(range(2000, 2029))

    # The same seed at 1 and 2 processes, without workers: the same global batches, the same
    # draws of the augmentation, in the same order (the global batch held at 12). Resumed at
    # step 4 by 1 or 2 processes, the 3-process epoch goes on: every remaining sample once.
    for world in (1, 2):
        records = in_process(world)
        assert [global_steps([r["epochs"][e] for r in records]) for e in range(2)] == orders
        assert global_steps([r["resumed"] for r in records]) == orders[1][4:]
    other_seed = in_process(1, "run.seed=4")
    assert global_steps([other_seed[0]["epochs"][0]]) != orders[0]


def test_a_stream_without_a_length_or_with_wrong_counts_is_one_line():
    class Endless(IterableDataset):
        def __iter__(self):
            yield 1

    with pytest.raises(UserError, match="without a length: return a streams.ShardedStream"):
        as_stream(Endless(), "train")
    Endless.__len__ = lambda self: 2  # says 2, yields 1 (as one that splits itself by worker)
    wrapped = as_stream(Endless(), "train")
    with pytest.raises(UserError, match=r"Endless yielded 1 samples .* len\(\) is 2: yield every"):
        list(read_chunks(wrapped, EpochOrder(wrapped, 0, 0, False), [(0, 1.0, 0, 2)]))
    with pytest.raises(UserError, match="give one sample count"):
        ShardedStream(["a", "b"], list, [3])
    wrong = ShardedStream([(0, 5)], id_shard, [6])
    with pytest.raises(UserError, match=r"holds 5 samples but its ShardedStream counts 6"):
        list(read_chunks(wrong, EpochOrder(wrong, 0, 0, False), [(0, 1.0, 0, 6)]))
