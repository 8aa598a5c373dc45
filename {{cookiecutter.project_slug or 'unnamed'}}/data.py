"""The data module: datasets, the train/val/test split, and how each rank gets its share.

Training: `DistributedSampler` gives each rank a disjoint 1/world_size of a shuffled order that is
the same on every rank (same seed), and `DataModule.train_batches(epoch)` calls `set_epoch` so
that order changes each epoch. Evaluation: `EvalShardSampler` gives each rank a contiguous block
of the split with no padding, so every sample is counted exactly once.

To use your own data, replace `load_arrays` (or build your own `Dataset` objects in
`DataModule.__init__`); the sharding below works for any map-style dataset.
"""

import importlib.util
import logging
import math
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    TensorDataset,
)

from config import UserError
from dist_utils import DistEnv
from metrics import Task

log = logging.getLogger("ddp")


REGRESSION_DATASETS = ("diabetes",)


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 8x8 handwritten digits as 1x8x8 images in 0..1, and their labels.

    The CSV ships inside scikit-learn; reading it directly spares each process the second it
    takes to import scikit-learn. load_digits() is the fallback if the file ever moves.
    """
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec else None
    if csv and csv.is_file():
        table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
        pixels, labels = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits

        pixels, labels = load_digits(return_X_y=True)
    images = (pixels / 16.0).reshape(-1, 1, 8, 8)  # intensities 0..16 -> 0..1
    return images.astype(np.float32), labels.astype(np.int64)


def make_clusters(cfg: DictConfig) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic vectors: one Gaussian cluster per class around a random corner of a hypercube
    in the first few features (the rest is noise). Generated from data.split_seed."""
    rng = np.random.default_rng(cfg.split_seed)
    classes, features = cfg.synthetic_classes, cfg.synthetic_features
    informative = min(features, max(2, classes))
    centres = np.zeros((classes, features))
    centres[:, :informative] = 2.0 * rng.choice([-1.0, 1.0], size=(classes, informative))
    labels = rng.permutation(np.arange(cfg.synthetic_samples) % classes)
    vectors = centres[labels] + rng.standard_normal((cfg.synthetic_samples, features))
    return vectors.astype(np.float32), labels.astype(np.int64)


def make_images(cfg: DictConfig) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic 3 x size x size images: each class a smooth random pattern (a 4x4 grid of
    colours, upsampled), each sample its class's pattern plus strong pixel noise."""
    rng = np.random.default_rng(cfg.split_seed)
    size, classes = cfg.image_size, cfg.synthetic_classes
    cell = math.ceil(size / 4)
    patterns = rng.standard_normal((classes, 3, 4, 4)).repeat(cell, 2).repeat(cell, 3)
    labels = rng.permutation(np.arange(cfg.synthetic_samples) % classes)
    images = np.empty((cfg.synthetic_samples, 3, size, size), dtype=np.float32)
    for start in range(0, len(labels), 512):  # in chunks: float64 noise for all would be large
        chunk = labels[start:start + 512]
        noise = rng.standard_normal((len(chunk), 3, size, size))
        images[start:start + 512] = 0.5 * patterns[chunk, :, :size, :size] + noise
    return images, labels.astype(np.int64)


def load_arrays(cfg: DictConfig) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (float32, one sample per row: vectors or channels x height x width images) and
    targets for `data.dataset`: integer class labels, or float values for the regression
    datasets in REGRESSION_DATASETS."""
    if cfg.dataset == "diabetes":  # 442 patients, 10 features, disease progression (25..346)
        from sklearn.datasets import load_diabetes  # bundled offline; features scaled

        features, targets = load_diabetes(return_X_y=True)
        return features.astype(np.float32), targets.astype(np.float32)
    if cfg.dataset == "digits":
        return load_digits_images()
    if cfg.dataset == "images":
        return make_images(cfg)
    return make_clusters(cfg)


def _take(indices: np.ndarray, count: int, labels: np.ndarray | None, rng) -> np.ndarray:
    """`count` of `indices` at random; with labels, each class in proportion to its size."""
    if labels is None:
        return rng.permutation(indices)[:count]
    classes, sizes = np.unique(labels[indices], return_counts=True)
    quota = sizes * count / len(indices)
    per_class = np.floor(quota).astype(int)
    largest_remainders = np.argsort(per_class - quota, kind="stable")
    per_class[largest_remainders[:count - per_class.sum()]] += 1
    return np.concatenate([rng.permutation(indices[labels[indices] == c])[:n]
                           for c, n in zip(classes, per_class, strict=True)])


def split_indices(cfg: DictConfig, labels: np.ndarray | None, total: int) -> dict:
    """Sample indices of the train, val and test splits, fixed by data.split_seed.

    test takes ceil(test_fraction x total) samples and val ceil(val_fraction x total) of the
    rest (rounded as scikit-learn's train_test_split does), stratified by class when labels
    are given, so every split holds the classes in the proportions of the whole set.
    """
    rng = np.random.default_rng(cfg.split_seed)
    remaining = np.arange(total)
    splits = {}
    for name, fraction in (("test", cfg.test_fraction),
                           ("val", cfg.val_fraction / (1 - cfg.test_fraction))):
        chosen = _take(remaining, math.ceil(fraction * len(remaining)), labels, rng)
        splits[name] = rng.permutation(chosen)
        remaining = np.setdiff1d(remaining, chosen)
    splits["train"] = rng.permutation(remaining)
    for name, indices in splits.items():
        if len(indices) == 0:
            raise UserError(f"data.dataset={cfg.dataset} has {total} samples: too few to leave "
                            f"any for the {name} split; change data.val_fraction / "
                            "data.test_fraction")
    return splits


def supports_batch_indexing(dataset: Dataset) -> bool:
    """Whether `dataset[list_of_indices]` returns the whole batch at once, as a TensorDataset's
    does (tensors index with a list). Set `batch_indexing = True` on a dataset class of your own
    that can, and its loaders take the fast path in DataModule._loader too."""
    return isinstance(dataset, TensorDataset) or getattr(dataset, "batch_indexing", False)


def split_arrays(cfg: DictConfig, features: np.ndarray, targets: np.ndarray) -> dict:
    """The train/val/test datasets (see split_indices) and the Task.

    Regression targets are standardised with the train split's mean and std (the model learns
    faster on unit scale); the returned Task turns predictions back into the original units.
    """
    regression = cfg.dataset in REGRESSION_DATASETS
    splits = split_indices(cfg, None if regression else targets, len(targets))
    if regression:
        train_y = targets[splits["train"]]
        mean, std = float(train_y.mean()), float(train_y.std())
        task = Task("regression", 1, target_mean=mean, target_std=std)
        targets = ((targets - mean) / std).astype(np.float32)
    else:
        task = Task("classification", int(targets.max()) + 1)
    datasets = {name: TensorDataset(torch.from_numpy(features[indices]),
                                    torch.from_numpy(targets[indices]))
                for name, indices in splits.items()}
    return datasets, task


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


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can begin an epoch part-way, for an exact mid-epoch resume.

    `start` drops this rank's first indices of the epoch's order (which depends only on the seed
    and the epoch), so a resumed run sees exactly the batches an uninterrupted one would have.
    """

    start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


class DataModule:
    """Datasets and loaders for one rank."""

    def __init__(self, cfg: DictConfig, env: DistEnv, device: torch.device):
        self.cfg, self.env, self.device = cfg, env, device
        self.datasets, self.task = split_arrays(cfg.data, *load_arrays(cfg.data))
        self.input_shape = tuple(self.datasets["train"][0][0].shape)  # of one sample

        # The config's batch size is the global one; config.check_batch_divides has made sure
        # it splits evenly, so every rank runs the same number of steps per epoch.
        self.batch_size_per_rank = cfg.train.global_batch_size // env.world_size
        # With gradient accumulation each optimizer step takes grad_accum_steps loader batches.
        self.micro_batch_size = self.batch_size_per_rank // cfg.train.grad_accum_steps
        self.train_sampler = ResumableDistributedSampler(
            self.datasets["train"], num_replicas=env.world_size, rank=env.rank,
            shuffle=True, seed=cfg.run.seed,
        )
        # No shuffle=True here: the sampler shuffles; a DataLoader refuses both.
        self.train_loader = self._loader(self.datasets["train"], self.micro_batch_size,
                                         self.train_sampler)
        self._eval_loaders: dict[str, DataLoader] = {}

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Sampler) -> DataLoader:
        """A DataLoader giving `sampler`'s indices in batches of `batch_size` (the last may be
        smaller). For a dataset that supports batch indexing, each batch is read with one
        `dataset[indices]` instead of one `dataset[i]` per sample and a collate that stacks
        them: the same batches, for a fraction of the Python work per step."""
        workers = self.cfg.data.num_workers
        if supports_batch_indexing(dataset):
            # batch_size=None: the loader passes each list from the BatchSampler to the
            # dataset as it is, and returns what comes back.
            sampler, batch_size = BatchSampler(sampler, batch_size, drop_last=False), None
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
            pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
            # Workers start once (persistent) by forkserver or spawn, not fork: a forked copy of
            # a process that has started CUDA or NCCL threads can deadlock.
            multiprocessing_context=self.cfg.data.worker_start_method if workers else None,
            # Its own generator: the seed of the worker processes is drawn from it, and drawing
            # it from the global RNG would shift dropout masks after a resume. PyTorch seeds
            # each worker's torch, random and numpy generators from it and the worker's id, so
            # every worker of every rank has its own random stream (see train_batches).
            generator=torch.Generator().manual_seed(self._worker_seed(epoch=0)),
        )

    def _worker_seed(self, epoch: int) -> int:
        """Seeds of the worker processes: distinct for every (run.seed, epoch, rank)."""
        return (self.cfg.run.seed * 1_000_003 + epoch) * 1_009 + self.env.rank

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (a last, smaller step takes what is left)."""
        return math.ceil(self.train_sampler.num_samples / self.batch_size_per_rank)

    def train_batches(self, epoch: int, skip_steps: int = 0):
        """This rank's batches for `epoch`, in an order that differs from epoch to epoch,
        leaving out the first `skip_steps` optimizer steps (when resuming mid-epoch)."""
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
        (inputs, targets) pairs, fewer for a last, partial step."""
        step: list = []
        for batch in self.train_batches(epoch, skip_steps):
            step.append(batch)
            if len(step) == self.cfg.train.grad_accum_steps:
                yield step
                step = []
        if step:
            yield step

    def eval_loader(self, split: str) -> DataLoader:
        """This rank's shard of `split` ("val" or "test"), each sample on exactly one rank."""
        if split not in self._eval_loaders:  # kept: its workers persist between evaluations
            dataset = self.datasets[split]
            sampler = EvalShardSampler(len(dataset), self.env.world_size, self.env.rank)
            self._eval_loaders[split] = self._loader(dataset, self.cfg.eval.batch_size, sampler)
        return self._eval_loaders[split]
