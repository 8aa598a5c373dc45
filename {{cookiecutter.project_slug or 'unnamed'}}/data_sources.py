"""Your datasets. This file is yours: the template starts it and never changes it again
(`cruft update` skips it), so write here freely.

Add a builder and register it in `DATASETS`; select it with `data.dataset=<key>`:

    def my_data(cfg: DictConfig) -> Splits:  # cfg: the `data` section of the config
        ...
        return Splits(train, val, test, task="binary", num_classes=2)

    DATASETS["my_data"] = my_data

A builder returns `splits.Splits`: the train, val and test splits and what the task needs to
know of them; for batches of any shape, also how samples become a batch (`collate=`), the
training order (`train_sampler=`) and `drop_last=` (docs/data.md: "Batches of any shape"). A
split is a map-style dataset (any `torch.utils.data.Dataset`) or, for data written as shard
files, a `streams.ShardedStream`: the shards, a module-level function that reads one, and the
sample count of each (docs/data.md: "Data in shard files", ddpkit/streams.py).
Every command loads this file (ddpkit/recipes.py) before it looks a dataset up, so every entry you
add here is seen. The built-in datasets (digits, digits_files, digits_shards, breast_cancer,
diabetes, synthetic, images) and the helpers imported below live in ddpkit/datasets.py, which is
the template's. A setting of your own (`data.<name>`) is declared in settings.py.
"""

import json  # noqa: F401
from pathlib import Path  # noqa: F401

import numpy as np  # noqa: F401
import torch  # noqa: F401
from omegaconf import DictConfig  # noqa: F401
from torch.utils.data import Dataset  # noqa: F401

from ddpkit.datasets import DATASETS, read_labels  # noqa: F401
from ddpkit.splits import Splits, array_splits, split_indices  # noqa: F401
from ddpkit.streams import ShardedStream  # noqa: F401
