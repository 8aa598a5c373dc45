"""Which samples each rank reads: the training order (ShuffledShard, DistributedSampler's order
held as a tensor; SkipFirst, to begin an epoch part-way for an exact resume) and evaluation's
blocks (EvalShardSampler: contiguous, no padding, no sample on two ranks). data.DataModule puts
them into its loaders."""

import itertools

import torch
from torch.utils.data import DistributedSampler, Sampler


class EvalShardSampler(Sampler[int]):
    """Rank r's contiguous block of the dataset: no padding, no sample on two ranks.

    Block sizes differ by at most one. Because the blocks are in rank order, concatenating the
    ranks' outputs in rank order gives the dataset order back.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int):
        self.dataset_len, self.num_replicas = dataset_len, num_replicas
        self.start = rank * dataset_len // num_replicas
        self.end = (rank + 1) * dataset_len // num_replicas

    def block_sizes(self) -> list[int]:
        """The size of every rank's block: known to each rank without asking the others."""
        n, world = self.dataset_len, self.num_replicas
        return [(r + 1) * n // world - r * n // world for r in range(world)]

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self) -> int:
        return self.end - self.start


class ShuffledShard(DistributedSampler):
    """DistributedSampler's order, kept as a tensor instead of a list of Python ints.

    The same indices in the same order for every (seed, epoch, rank), padding and drop_last
    included, so a run and its resume see what they always saw. DistributedSampler makes the
    whole epoch's order a Python list on every rank (about 40 bytes a sample: 40 MB for a
    million samples, most of it held through the epoch); here the order takes 4 bytes a sample
    while it is drawn, this rank's share of it after that, read out a chunk at a time."""

    CHUNK = 4096  # indices made Python ints at a time

    def __iter__(self):
        n, ranks = len(self.dataset), self.num_replicas
        # randperm draws the same permutation whatever its dtype (the swaps use the generator
        # alone): int32 halves it wherever the indices fit.
        dtype = torch.int32 if n < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator, dtype=dtype)
        else:
            order = torch.arange(n, dtype=dtype)
        # This rank takes positions rank, rank + ranks, ... of DistributedSampler's padded
        # order, whose position p is order[p % n] (the padding repeats the order from its
        # start), or of the order cut to total_size (drop_last).
        mine = order[self.rank:min(n, self.total_size):ranks].clone()
        if self.total_size > n:  # the padding's positions that fall to this rank
            first = min(self.rank + ranks * len(mine), self.total_size)
            padding = torch.arange(first, self.total_size, ranks)
            mine = torch.cat([mine, order[padding % n]])
        del order
        return itertools.chain.from_iterable(
            map(torch.Tensor.tolist, torch.split(mine, self.CHUNK)))


class SkipFirst(Sampler[int]):
    """A training sampler that can begin an epoch part-way, for an exact mid-epoch resume.

    `start` drops this rank's first indices of the epoch's order (which depends only on the seed
    and the epoch), so a resumed run sees exactly the batches an uninterrupted one would have.
    """

    def __init__(self, sampler: Sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.start
