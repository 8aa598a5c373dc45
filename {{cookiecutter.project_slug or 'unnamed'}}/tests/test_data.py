"""The data module in one process: splits, per-rank batch size, evaluation shards, batches."""

import functools

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import IMAGES, TINY, TINY_SPLIT, fixture
from ddpkit.config import UserError, load_config
from ddpkit.data import DataModule, count_samples, map_tensors, to_device
from ddpkit.dist_utils import DistEnv
from ddpkit.parallel import build_model, check_batch_statistics, values_per_channel
from ddpkit.samplers import EvalShardSampler, ShuffledShard
from ddpkit.splits import TensorSamples
from ddpkit.tasks import build_task


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
    assert torch.equal(first.datasets["test"].inputs, again.datasets["test"].inputs)
    assert first.batch_size_per_rank == cfg.train.global_batch_size // 3
    assert first.steps_per_epoch == TINY_SPLIT["train"] // cfg.train.global_batch_size
    labels = torch.cat([first.datasets[s].targets for s in ("train", "val", "test")])
    assert sorted(labels.bincount().tolist()) == [88] * 4  # stratified: every class whole


def test_a_micro_batch_size_sets_the_accumulation_at_each_world_size():
    cfg = load_config([*TINY, "train.micro_batch_size=2"])  # global batch 12
    for world, accumulation in [(1, 6), (2, 3), (3, 2), (6, 1)]:
        data = DataModule(cfg, DistEnv(0, 0, world, world > 1), torch.device("cpu"))
        assert (data.micro_batch_size, data.grad_accum_steps) == (2, accumulation)
        steps = list(data.train_steps(0))
        assert len(steps) == data.steps_per_epoch == 19
        assert [len(step) for step in steps] == [accumulation] * 19


def test_augmentation_is_for_the_training_split_only_and_can_be_switched_off():
    noisy = [*TINY, f"data.dataset={fixture('noisy_vectors')}"]
    data = DataModule(load_config(noisy), DistEnv(0, 0, 1, False), torch.device("cpu"))
    train, test = data.datasets["train"], data.datasets["test"]
    assert not torch.equal(train[[0, 1]][0], train.inputs[[0, 1]])  # augmented
    assert torch.equal(test[[0, 1]][0], test.inputs[[0, 1]])
    off = DataModule(load_config([*noisy, "data.augment=false"]), DistEnv(0, 0, 1, False),
                     torch.device("cpu"))
    assert torch.equal(off.datasets["train"][[0, 1]][0], off.datasets["train"].inputs[[0, 1]])


def test_batches_of_tuples_and_dicts_move_whole():
    batch = {"features": torch.ones(3, 2), "extra": (torch.zeros(3), [torch.ones(3)]),
             "name": "kept"}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["name"] == "kept" and isinstance(moved["extra"], tuple)
    doubled = map_tensors(lambda tensor: tensor * 2, batch)  # what to_device does on a GPU
    assert doubled["name"] == "kept" and isinstance(doubled["extra"][1], list)
    assert doubled["features"].eq(2).all() and doubled["extra"][1][0].eq(2).all()
    assert count_samples(moved) == 3 and count_samples((torch.ones(5, 1), torch.ones(5))) == 5
    samples = TensorSamples(torch.arange(6.0)[:, None], torch.arange(6))
    assert samples[2][0].shape == (1,) and samples[[1, 2]][0].shape == (2, 1)


def test_a_dataset_that_does_not_build_splits_is_one_line(tmp_path):
    source = tmp_path / "broken_data_for_test.py"
    source.write_text("def build(cfg):\n    return [1, 2, 3]\n")
    from ddpkit.config import UserError
    with pytest.raises(UserError, match="its builder must return splits.Splits, not list"):
        DataModule(load_config([*TINY, f"data.dataset={source}:build"]), DistEnv(0, 0, 1, False),
                   torch.device("cpu"))


def test_a_training_split_smaller_than_one_global_batch_is_one_line():
    from ddpkit.config import UserError
    cfg = load_config([*TINY, "train.global_batch_size=240"])  # 228 training samples
    with pytest.raises(UserError, match="the training split has 228 samples, fewer than one"):
        DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))


class Sized:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(("n", "ranks", "drop_last"), [(1797, 2, False), (1797, 3, True),
                                                       (5, 4, False), (2, 5, False),
                                                       (7, 4, False), (64, 8, True)])
def test_the_training_order_is_distributed_samplers_index_for_index(n, ranks, drop_last):
    # A resume, and a run against its earlier self, depend on the order staying what it was.
    for rank in range(ranks):
        ours = ShuffledShard(Sized(n), ranks, rank, seed=3, drop_last=drop_last)
        theirs = DistributedSampler(Sized(n), ranks, rank, seed=3, drop_last=drop_last)
        for epoch in (0, 5):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def batch_statistics(world_size: int, *overrides: str) -> None:
    """start_run's check of the model's BatchNorm layers against the micro-batches."""
    cfg = load_config([*TINY, "model.batchnorm=true", *overrides], world_size=world_size)
    data = DataModule(cfg, DistEnv(0, 0, world_size, True), torch.device("cpu"))
    task = build_task(cfg, data.splits)
    build = functools.partial(build_model, cfg.model, task.input_shape(data.first_samples()[0]),
                              task.num_outputs)
    layers = values_per_channel(build(), build, task.model_inputs(data.sample_batch(1)))
    check_batch_statistics(cfg, layers, data.micro_batch_size, data.smallest_micro_batch(),
                           world_size)


def test_batchnorm_with_one_sample_in_a_micro_batch_is_one_line_naming_the_settings():
    with pytest.raises(UserError) as refused:
        batch_statistics(2, "train.global_batch_size=2")
    assert str(refused.value) == (
        "BatchNorm layer net.1 (BatchNorm1d) needs more than 1 value per channel to train, and "
        "a training micro-batch holds 1 sample (train.global_batch_size=2 over 2 process(es)): "
        "use a larger train.global_batch_size or model.sync_batchnorm=true (statistics over all "
        "2 processes)")
    with pytest.raises(UserError, match="over 1 process\\(es\\) and 4 accumulation steps\\): use "
                       "a larger train.global_batch_size or fewer accumulation steps$"):
        batch_statistics(1, "train.global_batch_size=4", "train.grad_accum_steps=4")
    # 228 training samples in micro-batches of 227: the epoch's last one holds 1 sample.
    with pytest.raises(UserError, match="an epoch's last micro-batch holds 1 sample"):
        batch_statistics(1, "train.global_batch_size=227")
    batch_statistics(1, "train.global_batch_size=227", "train.limit_train_batches=1")  # not read
    batch_statistics(2, "train.global_batch_size=2", "model.sync_batchnorm=true")  # 2 samples
    batch_statistics(1, "train.global_batch_size=1", *IMAGES)  # 1 image: 8 x 8 values a channel


@pytest.mark.parametrize(("dataset", "where"), [("words", "sample[0] is 'word 0'"),
                                                ("bare_words", "sample is 'word 0'")])
def test_a_dataset_returning_text_is_one_line_naming_it(dataset, where):
    cfg = load_config([*TINY, f"data.dataset={fixture(dataset)}"])
    data = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu"))
    with pytest.raises(UserError) as refused:
        data.first_samples()
    assert str(refused.value) == (
        f"data.dataset={fixture(dataset)} returned text as a training sample ({where}, a str), "
        "which no model or loss takes: return tensors, numpy arrays or numbers (tokenise the "
        "text in the dataset), or give its Splits a collate that makes tensors of a batch "
        "(Splits(collate=...))")
    # Text in dict samples (Hugging Face style) is the model's, by keyword: kept.
    cfg = load_config([*TINY, f"data.dataset={fixture('dict_words')}"])
    batch = DataModule(cfg, DistEnv(0, 0, 1, False), torch.device("cpu")).sample_batch(2)
    assert batch["text"] == ["word 0", "word 1"]


def test_a_dataset_that_loader_workers_cannot_receive_is_one_line_naming_the_fix():
    lambdas = [*TINY, f"data.dataset={fixture('lambda_vectors')}", "data.num_workers=2"]
    with pytest.raises(UserError) as refused:
        DataModule(load_config(lambdas), DistEnv(0, 0, 1, False), torch.device("cpu"))
    start, _, rest = str(refused.value).partition(" (")
    why, _, fix = rest.partition("): ")
    assert start == (f"data.dataset={fixture('lambda_vectors')}: its train split cannot be sent "
                     "to the data.num_workers=2 loader processes, which "
                     "data.worker_start_method=forkserver starts by pickling it")
    assert "lambda" in why  # pickle's own words, which vary with the Python version
    assert fix == ("use a module-level function instead of a lambda or a local function, or, on "
                   "CPU, data.worker_start_method=fork")
    forked = DataModule(load_config([*lambdas, "data.worker_start_method=fork"]),
                        DistEnv(0, 0, 1, False), torch.device("cpu"))
    assert len(next(iter(forked.train_batches(0)))) == 2  # (inputs, targets) from a worker
