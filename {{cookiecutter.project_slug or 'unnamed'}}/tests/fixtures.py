"""The tests' own data, models and task: small, fast, and independent of the built-in examples
and of yours, so the tests keep checking the plumbing whatever you add or change.

Runs name them by file: data.dataset=tests/fixtures.py:vectors model.name=tests/fixtures.py:mlp.
"""

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddpkit.config import UserError
from ddpkit.splits import Splits, array_splits, split_indices
from ddpkit.tasks import MulticlassTask

SAMPLES = 352  # -> 228 train (divisible by 1, 2, 3, 4, 6), 53 val, 71 test (neither by 2 nor 3)


def clusters(seed: int, samples: int = SAMPLES, features: int = 16, classes: int = 4):
    """Gaussian clusters, one per class, around random corners of a hypercube."""
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.choice([-1.0, 1.0], size=(classes, features))
    labels = rng.permutation(np.arange(samples) % classes)
    inputs = centres[labels] + 1.5 * rng.standard_normal((samples, features))
    return inputs.astype(np.float32), labels.astype(np.int64)


def vectors(cfg) -> Splits:
    """4 classes of 16-dimensional vectors (multiclass)."""
    return array_splits(cfg, *clusters(cfg.split_seed), task="multiclass")


def binary_vectors(cfg) -> Splits:
    """Two overlapping classes, 1 in 4 positive (binary)."""
    inputs, labels = clusters(cfg.split_seed)
    return array_splits(cfg, inputs, (labels == 0).astype(np.int64), task="binary")


def regression_vectors(cfg) -> Splits:
    """A noisy nonlinear function of the vectors, in units far from 0 (regression)."""
    inputs, _ = clusters(cfg.split_seed)
    weights = np.random.default_rng(1).standard_normal(inputs.shape[1])
    targets = 50 + 20 * np.tanh(inputs @ weights / 4) + np.random.default_rng(2).normal(
        0, 2, len(inputs))
    return array_splits(cfg, inputs, targets.astype(np.float32), task="regression")


def add_noise(batch: torch.Tensor) -> torch.Tensor:
    return batch + 0.1 * torch.randn_like(batch)


def noisy_vectors(cfg) -> Splits:
    """vectors with a random training-split augmentation (data.augment)."""
    return array_splits(cfg, *clusters(cfg.split_seed), "multiclass", train_transform=add_noise)


def images(cfg) -> Splits:
    """4 classes of noisy 3x12x12 colour patterns (multiclass, image-shaped)."""
    rng = np.random.default_rng(cfg.split_seed)
    labels = rng.permutation(np.arange(SAMPLES) % 4)
    patterns = rng.standard_normal((4, 3, 3, 3)).repeat(4, 2).repeat(4, 3)
    pixels = 0.7 * patterns[labels] + rng.standard_normal((SAMPLES, 3, 12, 12))
    return array_splits(cfg, pixels.astype(np.float32), labels, "multiclass")


class Files(Dataset):
    """One .npy file per sample, read when asked for."""

    def __init__(self, root: Path, indices: np.ndarray, labels: np.ndarray):
        self.root, self.indices, self.labels = root, indices, labels

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        sample = self.indices[index]
        return torch.from_numpy(np.load(self.root / f"{sample}.npy")), int(self.labels[sample])


def write_vector_files(root: Path) -> None:
    """vectors as files under root: <i>.npy and labels.txt."""
    inputs, labels = clusters(0)
    root.mkdir(parents=True)
    for index, row in enumerate(inputs):
        np.save(root / f"{index}.npy", row)
    np.savetxt(root / "labels.txt", labels, fmt="%d")


def vector_files(cfg) -> Splits:
    """vectors read from the files write_vector_files made under data.root."""
    root = Path(cfg.root)
    if not (root / "labels.txt").is_file():
        raise UserError(f"data.root={cfg.root} holds no labels.txt")
    labels = np.loadtxt(root / "labels.txt", dtype=np.int64)
    split = split_indices(cfg, len(labels), labels)
    return Splits(*(Files(root, split[name], labels) for name in ("train", "val", "test")),
                  task="multiclass", num_classes=4)


class DictSamples(Dataset):
    """Samples as dicts, read one at a time: {"features", "target"}."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> dict:
        return {"features": self.inputs[index], "target": self.targets[index]}


def dict_vectors(cfg) -> Splits:
    """vectors as dict samples, loaded sample by sample (no whole-batch indexing)."""
    splits = vectors(cfg)
    for name in ("train", "val", "test"):
        part = getattr(splits, name)
        setattr(splits, name, DictSamples(part.inputs, part.targets))
    return splits


class MLP(nn.Module):
    def __init__(self, inputs: int, outputs: int, hidden: int, layers: int, dropout: float,
                 batchnorm: bool):
        super().__init__()
        stack: list[nn.Module] = []
        for _ in range(layers):
            stack.append(nn.Linear(inputs, hidden, bias=not batchnorm))
            stack += [nn.BatchNorm1d(hidden)] if batchnorm else []
            stack += [nn.ReLU(), nn.Dropout(dropout)]
            inputs = hidden
        self.net = nn.Sequential(*stack, nn.Linear(inputs, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


def mlp(cfg, input_shape, num_outputs: int) -> nn.Module:
    return MLP(int(np.prod(input_shape)), num_outputs, cfg.hidden_dim, cfg.num_layers,
               cfg.dropout, cfg.batchnorm)


def two_groups(model: nn.Module, cfg) -> list[dict]:
    """Parameter groups of a user's own (optim.param_groups): the first layer at half the
    learning rate and without weight decay, the rest on the optim settings."""
    first = list(model.net[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first, "lr": cfg.optim.lr / 2, "weight_decay": 0.0}, {"params": rest}]


class ConvNet(nn.Module):
    def __init__(self, channels: int, width: int, outputs: int, batchnorm: bool):
        super().__init__()
        norm = [nn.BatchNorm2d(width)] if batchnorm else []
        self.net = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=not batchnorm), *norm, nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def convnet(cfg, input_shape, num_outputs: int) -> nn.Module:
    return ConvNet(input_shape[0], cfg.channels, num_outputs, cfg.batchnorm)


class BrokenMLP(MLP):
    """A model with a bug: its last layer expects one input feature more than it gets."""

    def __init__(self, inputs: int, outputs: int, hidden: int):
        super().__init__(inputs, outputs, hidden, 1, 0.0, False)
        self.net[-1] = nn.Linear(hidden + 1, outputs)


def broken_mlp(cfg, input_shape, num_outputs: int) -> nn.Module:
    return BrokenMLP(int(np.prod(input_shape)), num_outputs, cfg.hidden_dim)


class UnusedHead(MLP):
    """An MLP with a second head that forward never uses: its parameters get no gradient."""

    def __init__(self, inputs: int, outputs: int, hidden: int):
        super().__init__(inputs, outputs, hidden, 1, 0.0, False)
        self.spare_head = nn.Linear(inputs, outputs)


def unused_head(cfg, input_shape, num_outputs: int) -> nn.Module:
    return UnusedHead(int(np.prod(input_shape)), num_outputs, cfg.hidden_dim)


class DictModel(nn.Module):
    """Reads a dict batch (its entries as keyword arguments), returns a dict: logits, and an
    embedding the task regularises."""

    def __init__(self, inputs: int, outputs: int, hidden: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, outputs)

    def forward(self, features: torch.Tensor) -> dict:
        embedding = self.body(features)
        return {"logits": self.head(embedding), "embedding": embedding}


def dict_model(cfg, input_shape: dict, num_outputs: int) -> nn.Module:
    return DictModel(input_shape["features"][0], num_outputs, cfg.hidden_dim)


class TermsTask(MulticlassTask):
    """multiclass with a second named loss term and one more logged scalar."""

    def loss(self, outputs, batch):
        return {"ce": super().loss(outputs, batch),
                "embedding_l2": 1e-3 * outputs["embedding"].square().mean()}

    def train_scalars(self, outputs, batch):
        confidence = F.softmax(self.scores(outputs), dim=-1).amax(dim=-1).mean()
        return {**super().train_scalars(outputs, batch), "confidence": confidence}


class NanGradientTask(MulticlassTask):
    """multiclass whose loss gets a term at training step NAN_STEP that is 0 but whose gradient
    is NaN (the derivative of sqrt at 0 is inf, times 0): the loss stays finite, the weights
    after that step do not."""

    calls = 0

    def loss(self, outputs, batch):
        loss = super().loss(outputs, batch)
        if torch.is_grad_enabled() and outputs.device.type != "meta":  # not the FLOP count
            NanGradientTask.calls += 1
            if NanGradientTask.calls == int(os.environ.get("NAN_STEP", "14")):
                loss = loss + (outputs.sum() * 0).sqrt()
        return loss
