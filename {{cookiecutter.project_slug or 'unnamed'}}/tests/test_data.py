"""The data module in one process: splits, per-rank batch size, evaluation shards."""

import pytest
import torch

from config import load_config
from conftest import TINY, TINY_SPLIT
from data import DataModule, EvalShardSampler
from dist_utils import DistEnv


@pytest.mark.parametrize("size", [0, 1, 7, 71, 100])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_eval_shards_cover_each_sample_once(size, world_size):
    shards = [list(EvalShardSampler(size, world_size, rank)) for rank in range(world_size)]
    assert sorted(i for shard in shards for i in shard) == list(range(size))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_splits_are_fixed_and_batch_is_divided():
    cfg = load_config(TINY)
    cpu = torch.device("cpu")
    first = DataModule(cfg, DistEnv(0, 0, 3, True), cpu)
    again = DataModule(cfg, DistEnv(2, 2, 3, True), cpu)
    assert {k: len(v) for k, v in first.datasets.items()} == TINY_SPLIT
    assert torch.equal(first.datasets["test"].tensors[0], again.datasets["test"].tensors[0])
    assert first.batch_size_per_rank == cfg.train.global_batch_size // 3
    assert first.steps_per_epoch == TINY_SPLIT["train"] // cfg.train.global_batch_size


def test_digits_is_the_default_dataset():
    data = DataModule(load_config([]), DistEnv(0, 0, 1, False), torch.device("cpu"))
    assert sum(len(d) for d in data.datasets.values()) == 1797  # scikit-learn's digits
    assert (data.input_shape, data.task.kind, data.task.num_outputs) == ((1, 8, 8),
                                                                         "classification", 10)


def test_diabetes_is_regression_in_the_original_units():
    data = DataModule(load_config(["data.dataset=diabetes"]), DistEnv(0, 0, 1, False),
                      torch.device("cpu"))
    assert sum(len(d) for d in data.datasets.values()) == 442
    assert (data.task.kind, data.task.num_outputs) == ("regression", 1)
    train_targets = data.datasets["train"].tensors[1]
    assert abs(train_targets.mean().item()) < 1e-5  # standardised for training ...
    restored = data.task.originals(train_targets)
    assert restored.min().item() == pytest.approx(25, abs=1e-4)  # ... reported in the data's
    assert restored.max().item() <= 346 + 1e-4  # own units (disease progression, 25..346)
