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
from sklearn.datasets import load_digits, make_classification
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from config import UserError
from dist_utils import DistEnv

log = logging.getLogger("ddp")


def load_arrays(cfg: DictConfig) -> tuple[np.ndarray, np.ndarray]:
    """Features (float32, one row per sample) and integer class labels for `data.dataset`."""
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


def split_arrays(cfg: DictConfig, features: np.ndarray, labels: np.ndarray) -> dict:
    """Stratified train/val/test split, fixed by data.split_seed."""
    try:
        rest_x, test_x, rest_y, test_y = train_test_split(
            features, labels, test_size=cfg.test_fraction, random_state=cfg.split_seed,
            stratify=labels,
        )
        train_x, val_x, train_y, val_y = train_test_split(
            rest_x, rest_y, test_size=cfg.val_fraction / (1 - cfg.test_fraction),
            random_state=cfg.split_seed, stratify=rest_y,
        )
    except ValueError as error:  # e.g. a split too small to hold every class
        raise UserError(f"cannot split data.dataset={cfg.dataset}: {error}") from None
    return {
        name: TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        for name, x, y in (("train", train_x, train_y), ("val", val_x, val_y),
                           ("test", test_x, test_y))
    }


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


class DataModule:
    """Datasets and loaders for one rank."""

    def __init__(self, cfg: DictConfig, env: DistEnv, device: torch.device):
        self.cfg, self.env, self.device = cfg, env, device
        self.datasets: dict[str, Dataset] = split_arrays(cfg.data, *load_arrays(cfg.data))
        features, labels = self.datasets["train"].tensors
        self.num_features = features.shape[1]
        self.num_classes = int(torch.cat([d.tensors[1] for d in self.datasets.values()]).max()) + 1

        # The config's batch size is the global one; config.check_batch_divides has made sure
        # it splits evenly, so every rank runs the same number of steps per epoch.
        self.batch_size_per_rank = cfg.train.global_batch_size // env.world_size
        self.train_sampler = DistributedSampler(
            self.datasets["train"], num_replicas=env.world_size, rank=env.rank,
            shuffle=True, seed=cfg.run.seed,
        )
        # No shuffle=True here: the sampler shuffles; a DataLoader refuses both.
        self.train_loader = self._loader(self.datasets["train"], self.batch_size_per_rank,
                                         self.train_sampler)

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Sampler) -> DataLoader:
        workers = self.cfg.data.num_workers
        return DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
            pin_memory=self.device.type == "cuda", persistent_workers=workers > 0,
        )

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.train_sampler) / self.batch_size_per_rank)

    def train_batches(self, epoch: int):
        """This rank's batches for `epoch`, in an order that differs from epoch to epoch."""
        self.train_sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        yield from self.train_loader

    def eval_loader(self, split: str) -> DataLoader:
        """This rank's shard of `split` ("val" or "test"), each sample on exactly one rank."""
        dataset = self.datasets[split]
        sampler = EvalShardSampler(len(dataset), self.env.world_size, self.env.rank)
        return self._loader(dataset, self.cfg.eval.batch_size, sampler)
