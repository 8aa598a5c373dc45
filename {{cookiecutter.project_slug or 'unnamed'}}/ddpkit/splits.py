"""What a dataset builder returns, and the helpers builders use: the train / val / test split.

`Splits` holds the three splits (each a map-style `Dataset`, or a `streams.ShardedStream` for data
written as shard files) and what the task needs to know of the targets. `split_indices` makes a
fixed, stratified split from the `data` config; `array_splits` builds all of `Splits` for data that
fits in memory (`TensorSamples`: whole batches read with one indexing operation).
ddpkit/datasets.py uses them for the examples; your builders in data_sources.py can too.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset, Sampler

from ddpkit.config import UserError


@dataclass
class Splits:
    """What a dataset builder returns: the three splits and what the task needs to know."""

    train: Dataset
    val: Dataset
    test: Dataset
    task: str  # the task the data is made for (a key of TASKS); task.name overrides it
    num_classes: int = 0  # classification: labels are 0 .. num_classes - 1
    target_mean: float = 0.0  # regression: the task trains on (target - mean) / std and
    target_std: float = 1.0  # reports metrics in the target's own units
    # How samples become a batch: a function of a list of samples (padding sequences of
    # different lengths, say); None: torch's default_collate. Every loader uses it.
    collate: Callable | None = None
    # The training order: train_sampler(dataset, num_replicas, rank, seed) gives this rank's
    # sampler (set_epoch(epoch) is called when it has one); None: a shuffled DistributedSampler.
    train_sampler: Callable[..., Sampler] | None = None
    drop_last: bool = False  # training: drop an epoch's last, incomplete batch instead of
    # padding it with repeated samples (a streamed split: instead of a smaller, weighted step)


ONE_INDEX = (int, np.integer)  # a tuple built once: `int | np.integer` would build a union a call


class TensorSamples(Dataset):
    """Samples held in memory as two tensors (inputs, targets), row i being sample i.

    `transform`, if given, takes a *batch* of inputs (first dimension: samples) and returns it
    transformed: a training-split augmentation, say. A list of indices reads a whole batch with
    one indexing operation (`batch_indexing`), which `DataModule` uses to skip per-sample calls
    and the collate step.
    """

    batch_indexing = True

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs, self.targets, self.transform = inputs, targets, transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index):
        if isinstance(index, ONE_INDEX):
            inputs, target = self[[int(index)]]
            return inputs[0], target[0]
        index = torch.as_tensor(index)  # once for both tensors (a list would be converted twice)
        inputs = self.inputs[index]
        return (self.transform(inputs) if self.transform else inputs), self.targets[index]


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


def split_indices(cfg: DictConfig, total: int, labels: np.ndarray | None = None) -> dict:
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


def array_splits(cfg: DictConfig, inputs: np.ndarray, targets: np.ndarray, task: str,
                 train_transform: Callable | None = None) -> Splits:
    """Splits of data held in arrays (one sample per row), for a classification task (integer
    labels, stratified split) or regression (float targets, standardised for training)."""
    regression = np.issubdtype(targets.dtype, np.floating)
    indices = split_indices(cfg, len(targets), None if regression else targets)

    def part(name: str, transform=None) -> TensorSamples:
        rows = indices[name]
        return TensorSamples(torch.from_numpy(inputs[rows]), torch.from_numpy(targets[rows]),
                             transform)

    splits = Splits(part("train", train_transform if cfg.augment else None), part("val"),
                    part("test"), task)
    if regression:
        train_targets = targets[indices["train"]].astype(np.float64)
        splits.target_mean, splits.target_std = train_targets.mean(), train_targets.std()
    else:
        splits.num_classes = int(targets.max()) + 1
    return splits
