"""The data module: how each rank gets its share of any dataset.

A dataset builder (data_sources.py) returns `splits.Splits`: train, val and test as map-style
`Dataset`s of any kind, in memory or read from disk, or as streams of shards
(`streams.ShardedStream`, planned in ddpkit/streams.py). This module turns them into loaders:

- training: `ShuffledShard` (DistributedSampler's order, held as a tensor; or the builder's
  `Splits.train_sampler`) gives each rank a disjoint 1/world_size of a shuffled order that is
  the same on every rank (same seed);
  `DataModule.train_batches(epoch)` calls `set_epoch`, so the order changes each epoch, and can
  start part-way into an epoch for an exact resume;
- evaluation: `EvalShardSampler` gives each rank a contiguous block of the split with no
  padding, so every sample is counted exactly once.

Every loader makes its batches with the builder's `Splits.collate` (collate.py when it has
none: default_collate, with samples it cannot stack one line naming `Splits(collate=...)`). A
sample (and a batch) is a tuple `(inputs, target)` or a dict of tensors; `to_device` moves
either whole. The task (tasks.py) decides which parts the model and the loss read.
"""

import contextlib
import copy
import functools
import logging
import math
import os
import select
import signal
import sys
import threading
import time

import torch
from omegaconf import DictConfig
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    TensorDataset,
)

from ddpkit.collate import stacking_collate
from ddpkit.config import UserError, accumulation_steps, lookup
from ddpkit.datasets import DATASETS
from ddpkit.dist_utils import DistEnv, gather_objects
from ddpkit.loader_workers import check_sendable
from ddpkit.samplers import EvalShardSampler, ShuffledShard, SkipFirst
from ddpkit.splits import Splits
from ddpkit.streams import EvalPlan, RankStream, SampledStream, TrainPlan, as_stream

log = logging.getLogger("ddp")


def map_tensors(function, nested):
    """`function` applied to every tensor of a batch or a model output: a tensor, or a tuple /
    list / dict of them (nested), or an object holding them as attributes (a copy of it);
    anything else is kept as it is."""
    if isinstance(nested, torch.Tensor):
        return function(nested)
    if isinstance(nested, dict):
        return {key: map_tensors(function, value) for key, value in nested.items()}
    if isinstance(nested, (list, tuple)):
        return type(nested)(map_tensors(function, value) for value in nested)
    attributes = getattr(nested, "__dict__", None)
    if attributes and any(isinstance(value, torch.Tensor) for value in attributes.values()):
        twin = copy.copy(nested)
        twin.__dict__.update({key: map_tensors(function, value)
                              for key, value in attributes.items()})
        return twin
    return nested


CPU = torch.device("cpu")


def to_device(batch, device: torch.device):
    """A batch (tensor, or tuple / list / dict of them, nested) on `device`, copied
    asynchronously from pinned memory when the loader pinned it."""
    # CPU training: the loader's tensors are already there. (Compared as devices: reading
    # device.type builds a string, a cost that showed in a profile of the one-process step.)
    if device == CPU:
        return batch
    return map_tensors(lambda tensor: tensor.to(device, non_blocking=True), batch)


def detached(outputs):
    """Model outputs without their graph."""
    if isinstance(outputs, torch.Tensor):  # the common case, without one more call a step
        return outputs.detach()
    return map_tensors(torch.Tensor.detach, outputs)


def count_samples(batch) -> int:
    """The samples in a batch: the length of its first tensor."""
    while not isinstance(batch, torch.Tensor):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(batch)


def supports_batch_indexing(dataset: Dataset) -> bool:
    """Whether `dataset[list_of_indices]` returns the whole batch at once, as splits.TensorSamples
    and TensorDataset do. Set `batch_indexing = True` on a dataset class of your own that can."""
    return isinstance(dataset, TensorDataset) or getattr(dataset, "batch_indexing", False)


def refuse_text(sample, dataset: str, where: str = "sample") -> None:
    """A UserError for text in a sample made of tuples (dict samples, Hugging Face style, may
    hold text that the model takes by keyword)."""
    if isinstance(sample, str | bytes):
        shown = repr(sample[:40]) + ("..." if len(sample) > 40 else "")
        raise UserError(
            f"data.dataset={dataset} returned text as a training sample ({where} is {shown}, "
            f"a {type(sample).__name__}), which no model or loss takes: return tensors, numpy "
            "arrays or numbers (tokenise the text in the dataset), or give its Splits a collate "
            "that makes tensors of a batch (Splits(collate=...))")
    if isinstance(sample, tuple | list):
        for index, part in enumerate(sample):
            refuse_text(part, dataset, f"{where}[{index}]")


def limited(setting: float, total: int) -> int:
    """How many of `total` batches a train.limit_*_batches setting keeps: all for 0, N for a
    whole number N, a fraction for 0 < f < 1 (at least one)."""
    if not setting:
        return total
    if setting >= 1:
        return min(int(setting), total)
    return max(1, int(total * setting))


def build_splits(cfg: DictConfig) -> Splits:
    """The splits of `data.dataset`: a key of DATASETS (built in, or added
    in data_sources.py), or module:function."""
    builder = lookup(DATASETS, cfg.data.dataset, "data.dataset", "a dataset")
    splits = builder(cfg.data)
    if not isinstance(splits, Splits):
        raise UserError(f"data.dataset={cfg.data.dataset}: its builder must return "
                        f"splits.Splits, not {type(splits).__name__}")
    for name in ("train", "val", "test"):
        if isinstance(getattr(splits, name), IterableDataset):
            setattr(splits, name, as_stream(getattr(splits, name), name))
        if len(getattr(splits, name)) == 0:
            raise UserError(f"data.dataset={cfg.data.dataset} has an empty {name} split")
    return splits


def end_with_rank(rank_pid: int, worker_id: int) -> None:
    """A loader worker's init: end the worker when its rank ends, however it ends (SIGKILL
    included). PyTorch's own check watches the worker's parent, which under forkserver is the
    forkserver: that lives as long as the workers do, so they would never notice."""

    def wait_for_rank() -> None:
        with contextlib.suppress(ProcessLookupError):  # raised once the rank is gone
            if hasattr(os, "pidfd_open"):  # Linux: readable once the rank has exited
                select.select([os.pidfd_open(rank_pid)], [], [])
            else:
                while True:  # elsewhere: ask every second
                    os.kill(rank_pid, 0)
                    time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    # SIGTERM (from here or from the rank) ends the worker in order, through multiprocessing's
    # exit handler: its pymp-* temp folder goes with it.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(0))
    threading.Thread(target=wait_for_rank, name="end-with-rank", daemon=True).start()


class Step(list):
    """The micro-batches of one optimizer step on this rank. `weight` scales this rank's loss
    when the ranks' shares of the step differ (a stream's last step: ddpkit/streams.py), so that
    the gradient averaged over ranks is that of the step's mean loss; 1.0 otherwise."""

    weight = 1.0


class DataFingerprint:
    """What a checkpoint records of the data it trained on (a part of Run.parts), where the
    training split can say it: a `fingerprint()` method (or attribute) returning a string that
    changes when the data does (token data: tokens.fingerprint). A resume on data whose
    fingerprint differs from the checkpoint's (a folder written again in place) is refused in
    one line, unless data.resume_changed=true, which resumes on the data as it is now."""

    def __init__(self, value: str, cfg: DictConfig):
        self.value, self.cfg = value, cfg

    @classmethod
    def of(cls, split, cfg: DictConfig) -> "DataFingerprint | None":
        """The training split's fingerprint, taken now; None when it has none."""
        make = getattr(split, "fingerprint", None)
        return cls(str(make()), cfg.data) if callable(make) else None

    def state_dict(self) -> dict:
        return {"fingerprint": self.value}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("fingerprint")
        if saved is None or saved == self.value:
            return
        where = (f"data.root={self.cfg.root}" if self.cfg.root
                 else f"the default folder of data.dataset={self.cfg.dataset}")
        if not self.cfg.resume_changed:
            raise UserError(f"the data in {where} changed since the checkpoint was written (its "
                            "fingerprint differs: written again in place?): put that data back, "
                            "or set data.resume_changed=true to resume on it as it is now")
        log.info("the data in %s changed since the checkpoint was written: resuming on it as it "
                 "is now (data.resume_changed=true)", where)


class DataModule:
    """Datasets and loaders for one rank."""

    def __init__(self, cfg: DictConfig, env: DistEnv, device: torch.device,
                 train_env: DistEnv | None = None):
        self.cfg, self.env, self.device = cfg, env, device
        # The ranks the training split is sharded over: the job's, or with replica groups
        # every group's processes (extras/replicas); evaluation stays within `env`.
        self.train_env = train_env or env
        self.splits = build_splits(cfg)
        check_sendable(cfg, self.splits)
        self.datasets = {"train": self.splits.train, "val": self.splits.val,
                         "test": self.splits.test}
        if len(self.splits.train) < cfg.train.global_batch_size:
            raise UserError(
                f"the training split has {len(self.splits.train)} samples, fewer than one global "
                f"batch (train.global_batch_size={cfg.train.global_batch_size}): lower "
                "train.global_batch_size, or give the dataset more samples")

        # The config's batch size is the global one; config.check_batch_divides has made sure
        # it splits evenly, so every rank runs the same number of steps per epoch.
        self.batch_size_per_rank = cfg.train.global_batch_size // self.train_env.world_size
        # With gradient accumulation each optimizer step takes grad_accum_steps loader batches.
        self.grad_accum_steps = accumulation_steps(cfg, self.train_env.world_size)
        self.micro_batch_size = self.batch_size_per_rank // self.grad_accum_steps
        self.collate = self.splits.collate or functools.partial(stacking_collate,
                                                                dataset=cfg.data.dataset)
        self.drop_last = self.splits.drop_last
        self._eval_loaders: dict[tuple, DataLoader] = {}
        self.streamed = isinstance(self.splits.train, IterableDataset)
        # Windows drawn with replacement for train.max_steps steps: the data has no passes to
        # count, so the run is one epoch and its log, summary and validations go by steps.
        self.by_steps = bool(isinstance(self.splits.train, SampledStream)
                             and cfg.train.max_steps)
        self._training_loader()

    def _training_loader(self) -> None:
        steps = self._stream_training() if self.streamed else self._map_training()
        # Optimizer steps per epoch, or fewer with train.limit_train_batches. A plain number:
        # the loop reads it every epoch.
        self.steps_per_epoch = limited(self.cfg.train.limit_train_batches, steps)
        if self.streamed:
            self.train_stream.plan.limit = self.steps_per_epoch

    def use_micro_batch(self, size: int) -> None:
        """Train in micro-batches of `size` samples (a divisor of this rank's share of the
        global batch): the accumulation steps make up the rest (train.micro_batch_size=auto)."""
        self.micro_batch_size, self.grad_accum_steps = size, self.batch_size_per_rank // size
        self._training_loader()

    def _map_training(self) -> int:
        """The training loader of a map-style split; returns the steps of an epoch (a last,
        smaller step takes what is left, unless the builder asked for drop_last)."""
        self.train_sampler = SkipFirst(self._train_order(self.splits))
        # No shuffle=True here: the sampler shuffles; a DataLoader refuses both.
        self.train_loader = self._loader(self.datasets["train"], self.micro_batch_size,
                                         self.train_sampler, drop_last=self.drop_last)
        per_rank = len(self.train_sampler) / self.batch_size_per_rank
        steps = math.floor(per_rank) if self.drop_last else math.ceil(per_rank)
        if steps == 0:
            raise UserError(f"data.dataset={self.cfg.data.dataset}: its training sampler gives "
                            f"this process {len(self.train_sampler)} samples, fewer than one "
                            f"full batch of {self.batch_size_per_rank}")
        return steps

    def _stream_training(self) -> int:
        """The training loader of a streamed split (ddpkit/streams.py); returns the steps of an
        epoch."""
        if self.splits.train_sampler is not None:
            raise UserError(f"data.dataset={self.cfg.data.dataset}: Splits.train_sampler orders "
                            "a map-style training split, and this one is streamed: leave it "
                            "out (the stream's order is set by ShardedStream.shuffle_window)")
        if self.by_steps:  # one epoch is the whole run (the draws stay the same)
            self.splits.train.cover(self.cfg.train.max_steps * self.cfg.train.global_batch_size)
        plan = TrainPlan(len(self.splits.train), self.cfg.train.global_batch_size,
                         self.train_env.world_size, self.train_env.rank, self.grad_accum_steps,
                         self.drop_last)
        self.train_stream = RankStream(self.splits.train, plan, self.cfg.run.seed, self.collate)
        self.train_loader = self._loader(self.train_stream, None, None)
        self._live = None  # the loader's iterator, running on into the next epoch (_stream_steps)
        return plan.steps

    def _train_order(self, splits: Splits) -> Sampler:
        """This rank's sampler of the training split: the builder's, or a DistributedSampler."""
        env, seed = self.train_env, self.cfg.run.seed
        if splits.train_sampler is not None:
            sampler = splits.train_sampler(splits.train, env.world_size, env.rank, seed)
            sizes = gather_objects(len(sampler))  # [its own] without a process group
            if len(set(sizes)) > 1:  # the ranks would run different numbers of steps, and hang
                raise UserError(f"data.dataset={self.cfg.data.dataset}: its train_sampler gives "
                                f"the ranks different numbers of samples ({sizes}): every rank "
                                "must take as many as the others")
            return sampler
        # drop_last: the tail that does not divide among ranks is left out, not padded.
        return ShuffledShard(splits.train, num_replicas=env.world_size, rank=env.rank,
                             shuffle=True, seed=seed, drop_last=splits.drop_last)

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Sampler,
                drop_last: bool = False) -> DataLoader:
        """A DataLoader giving `sampler`'s indices in batches of `batch_size` (the last may be
        smaller, or dropped), made by the splits' collate. For a dataset that supports batch
        indexing and no collate of the builder's, each batch is read with one
        `dataset[indices]` instead of one `dataset[i]` per sample and a collate that stacks
        them: the same batches, for a fraction of the Python work per step."""
        workers = self.cfg.data.num_workers
        collate = self.collate
        if isinstance(dataset, RankStream):  # its workers make whole batches
            collate = None
        elif supports_batch_indexing(dataset) and self.splits.collate is None:
            # batch_size=None: the loader passes each list from the BatchSampler to the
            # dataset as it is, and returns what comes back.
            sampler = BatchSampler(sampler, batch_size, drop_last=drop_last)
            batch_size, drop_last, collate = None, False, None
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
            collate_fn=collate, num_workers=workers,
            pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
            # Workers start once (persistent) by forkserver or spawn, not fork: a forked copy of
            # a process that has started CUDA or NCCL threads can deadlock.
            multiprocessing_context=self.cfg.data.worker_start_method if workers else None,
            # Its own generator: the seed of the worker processes is drawn from it, and drawing
            # it from the global RNG would shift dropout masks after a resume. PyTorch seeds
            # each worker's torch, random and numpy generators from it and the worker's id, so
            # every worker of every rank has its own random stream (see train_batches).
            generator=torch.Generator().manual_seed(self._worker_seed(epoch=0)),
            worker_init_fn=functools.partial(end_with_rank, os.getpid()) if workers else None,
        )

    def _worker_seed(self, epoch: int) -> int:
        """Seeds of the worker processes: distinct for every (run.seed, epoch, rank)."""
        return (self.cfg.run.seed * 1_000_003 + epoch) * 1_009 + self.train_env.rank

    def smallest_micro_batch(self) -> int:
        """The fewest samples a training micro-batch of any rank holds: the micro-batch size,
        or fewer in an epoch's last step, where what is left of the split does not fill it
        (unless the builder asked for drop_last, or train.limit_train_batches stops before)."""
        if self.streamed:
            plan = self.train_stream.plan
            if plan.limit < plan.steps:
                return self.micro_batch_size
            shares = [TrainPlan(plan.samples, plan.batch, plan.world, rank, plan.micro_batches,
                                self.drop_last).step_chunks(plan.steps - 1)
                      for rank in range(plan.world)]
            return min(end - first for chunks in shares for _, _, first, end in chunks)
        samples = len(self.train_sampler)  # (the same number on every rank)
        reaches_the_end = self.steps_per_epoch * self.batch_size_per_rank >= samples
        left = samples % self.micro_batch_size
        return left if left and reaches_the_end and not self.drop_last else self.micro_batch_size

    @property
    def full_steps_per_epoch(self) -> int:
        """Optimizer steps per epoch whose global batch holds only distinct samples of the
        global batch size (the sampler pads the last one with repeats when the set does not
        divide; a stream's last step may be smaller or larger)."""
        return min(len(self.datasets["train"]) // self.cfg.train.global_batch_size,
                   self.steps_per_epoch)

    def first_samples(self, size: int = 1) -> list:
        """The first `size` training samples (of the shards' order, for a stream). Text where
        torch's default collate would keep it as text (a sample that is a string, or a string
        in a tuple sample) is one line naming the dataset: no model or loss takes it."""
        train = self.datasets["train"]
        if self.streamed:
            samples = train.head(size)
        else:
            samples = [train[index] for index in range(min(size, len(train)))]
        if self.splits.collate is None:  # (a builder's collate may tokenise text samples)
            for sample in samples:
                refuse_text(sample, self.cfg.data.dataset)
        return samples

    def sample_batch(self, size: int = 2):
        """The first `size` training samples made into a batch as training makes them."""
        return self.collate(self.first_samples(size))

    def train_batches(self, epoch: int, skip_steps: int = 0):
        """This rank's batches for `epoch`, in an order that differs from epoch to epoch,
        leaving out the first `skip_steps` optimizer steps (when resuming mid-epoch)."""
        if self.streamed:
            for step in self._stream_steps(epoch, skip_steps):
                yield from step
            return
        self.train_sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        self.train_sampler.start = skip_steps * self.batch_size_per_rank
        # The workers' seeds are drawn from this generator when they start (persistent: at the
        # first epoch this process runs), so they depend on (seed, epoch, rank) only.
        self.train_loader.generator.manual_seed(self._worker_seed(epoch))
        try:
            yield from self.train_loader
        finally:
            self.train_sampler.start = 0

    def train_steps(self, epoch: int, skip_steps: int = 0):
        """The micro-batches of each optimizer step of `epoch`: lists of grad_accum_steps
        batches, fewer for a last, partial step. Ends after steps_per_epoch steps."""
        if self.streamed:
            yield from self._stream_steps(epoch, skip_steps)
            return
        step = Step()
        left = self.steps_per_epoch - skip_steps
        for batch in self.train_batches(epoch, skip_steps):
            step.append(batch)
            if len(step) == self.grad_accum_steps:
                yield step
                step, left = Step(), left - 1
                if left <= 0:
                    return
        if step:
            yield step

    def _stream_steps(self, epoch: int, skip_steps: int):
        """A stream's steps. Its loader gives (epoch, step, weight, micro-batch) in order and runs
        on into the next epoch, so the workers read ahead across the epoch's end; the iterator is
        kept for the next epoch when this one is read to its end, and a new one starts anywhere
        else (a resume, a run stopped part-way)."""
        live, self._live = self._live, None
        if live is None or live[0] != (epoch, skip_steps):
            self.train_stream.start(epoch, skip_steps)  # read by the workers as they begin
            live = ((epoch, skip_steps), iter(self.train_loader), None)
        _, batches, pending = live
        step, current = Step(), skip_steps
        while True:
            item = pending if pending is not None else next(batches)
            pending = None
            item_epoch, index, weight, batch = item
            if item_epoch != epoch:  # the next epoch's first micro-batch: this one is complete
                self._live = ((epoch + 1, 0), batches, item)
                if step:
                    yield step
                return
            if index != current:
                yield step
                step, current = Step(), index
            step.weight = weight
            step.append(batch)

    def eval_loader(self, split: str, limit: float = 0.0) -> DataLoader:
        """This rank's shard of `split` ("val" or "test"), each sample on exactly one rank.
        With `limit` (as train.limit_val_batches), only the split's first samples: that many
        batches of eval.batch_size on every rank, or that fraction of the split. (The sampler
        stops there: the dataset stays itself, its batch indexing and collate with it.)"""
        key = (split, limit)
        if key not in self._eval_loaders:  # kept: its workers persist between evaluations
            dataset = self.datasets[split]
            samples = len(dataset)
            if limit:  # N batches on each rank: N x batch x ranks samples; or a fraction
                per_batch = 1 if limit < 1 else self.cfg.eval.batch_size * self.env.world_size
                samples = limited(limit * per_batch, samples)
            if isinstance(dataset, IterableDataset):
                plan = EvalPlan(samples, self.cfg.eval.batch_size, self.env.world_size,
                                self.env.rank)
                self._eval_loaders[key] = self._loader(
                    RankStream(dataset, plan, self.cfg.run.seed, self.collate), None, None)
            else:
                sampler = EvalShardSampler(samples, self.env.world_size, self.env.rank)
                self._eval_loaders[key] = self._loader(dataset, self.cfg.eval.batch_size,
                                                       sampler)
        return self._eval_loaders[key]
