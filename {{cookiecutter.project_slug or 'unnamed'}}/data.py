"""The data module: datasets, the train/val/test split, and how each rank gets its share.

Training: `DistributedSampler` gives each rank a disjoint 1/world_size of a shuffled order that is
the same on every rank (same seed), and `DataModule.train_batches(epoch)` calls `set_epoch` so
that order changes each epoch. Evaluation: `EvalShardSampler` gives each rank a contiguous block
of the split with no padding, so every sample is counted exactly once.

To use your own data, replace `load_arrays` (or build your own `Dataset` objects in
`DataModule.__init__`); the sharding below works for any map-style dataset.
"""

import logging
import math

import numpy as np
import torch
from omegaconf import DictConfig
from sklearn.datasets import load_diabetes, load_digits, make_classification
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from config import UserError
from dist_utils import DistEnv
from metrics import Task

log = logging.getLogger("ddp")


REGRESSION_DATASETS = ("diabetes",)


def load_arrays(cfg: DictConfig) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32, one row per sample) and targets for `data.dataset`: integer class
    labels, or float values for the regression datasets in REGRESSION_DATASETS."""
    if cfg.dataset == "diabetes":  # 442 patients, 10 features, disease progression (25..346)
        features, targets = load_diabetes(return_X_y=True)  # bundled offline, features scaled
        return features.astype(np.float32), targets.astype(np.float32)
    if cfg.dataset == "digits":
        features, labels = load_digits(return_X_y=True)  # 1797 8x8 images, bundled offline
        features = features / 16.0  # pixel intensities 0..16 -> 0..1
    else:  # synthetic: class-conditional clusters, generated from split_seed, needs nothing
        features, labels = make_classification(
            n_samples=cfg.synthetic_samples,
            n_features=cfg.synthetic_features,
            n_informative=min(cfg.synthetic_features, max(2, cfg.synthetic_classes)),
            n_redundant=0,
            n_classes=cfg.synthetic_classes,
            n_clusters_per_class=1,
            class_sep=2.0,
            random_state=cfg.split_seed,
        )
    return features.astype(np.float32), labels.astype(np.int64)


def split_arrays(cfg: DictConfig, features: np.ndarray, targets: np.ndarray) -> dict:
    """Train/val/test split fixed by data.split_seed (stratified by class for classification).

    Regression targets are standardised with the train split's mean and std (the model learns
    faster on unit scale); the returned Task turns predictions back into the original units.
    """
    regression = cfg.dataset in REGRESSION_DATASETS
    try:
        rest_x, test_x, rest_y, test_y = train_test_split(
            features, targets, test_size=cfg.test_fraction, random_state=cfg.split_seed,
            stratify=None if regression else targets,
        )
        train_x, val_x, train_y, val_y = train_test_split(
            rest_x, rest_y, test_size=cfg.val_fraction / (1 - cfg.test_fraction),
            random_state=cfg.split_seed, stratify=None if regression else rest_y,
        )
    except ValueError as error:  # e.g. a split too small to hold every class
        raise UserError(f"cannot split data.dataset={cfg.dataset}: {error}") from None
    if regression:
        mean, std = float(train_y.mean()), float(train_y.std())
        task = Task("regression", 1, target_mean=mean, target_std=std)
        train_y, val_y, test_y = ((y - mean) / std for y in (train_y, val_y, test_y))
    else:
        task = Task("classification", int(targets.max()) + 1)
    datasets = {
        name: TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        for name, x, y in (("train", train_x, train_y), ("val", val_x, val_y),
                           ("test", test_x, test_y))
    }
    return datasets, task


class EvalShardSampler(Sampler[int]):
    """Rank r's contiguous block of the dataset: no padding, no sample on two ranks.

    Block sizes differ by at most one. Because the blocks are in rank order, concatenating the
    ranks' outputs in rank order gives the dataset order back.
    """

    def __init__(self, dataset_len: int, num_replicas: int, rank: int):
        self.start = rank * dataset_len // num_replicas
        self.end = (rank + 1) * dataset_len // num_replicas

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
        self.num_features = self.datasets["train"].tensors[0].shape[1]

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

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Sampler) -> DataLoader:
        workers = self.cfg.data.num_workers
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
            pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
            # Its own generator: starting an epoch draws a seed for the worker processes, and
            # drawing it from the global RNG would shift dropout masks after a resume.
            generator=torch.Generator(),
        )

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (a last, smaller step takes what is left)."""
        return math.ceil(self.train_sampler.num_samples / self.batch_size_per_rank)

    def train_batches(self, epoch: int, skip_steps: int = 0):
        """This rank's batches for `epoch`, in an order that differs from epoch to epoch,
        leaving out the first `skip_steps` optimizer steps (when resuming mid-epoch)."""
        self.train_sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        self.train_sampler.start = skip_steps * self.batch_size_per_rank
        # Worker seeds depend on (seed, epoch, rank) only: the same after a resume.
        self.train_loader.generator.manual_seed(
            (self.cfg.run.seed * 1_000_003 + epoch) * 1_009 + self.env.rank)
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
        dataset = self.datasets[split]
        sampler = EvalShardSampler(len(dataset), self.env.world_size, self.env.rank)
        return self._loader(dataset, self.cfg.eval.batch_size, sampler)
