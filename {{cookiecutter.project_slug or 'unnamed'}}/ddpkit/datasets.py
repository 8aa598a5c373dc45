"""The built-in example datasets, the helpers they share, and the registry `DATASETS`.

This file is the template's (`cruft update` brings its fixes in): add your datasets to
data_sources.py, which is yours and which the template imports before any dataset is looked up.

A builder takes the `data` section of the config and returns `splits.Splits`: the train, val and
test splits as map-style datasets (any `torch.utils.data.Dataset`: in memory or read from disk,
with a transform for the training split only if you like) or as streams of shard files
(`streams.ShardedStream`), plus what the task needs to know: the task the data is made for, the
number of classes, or the targets' scale. Select one with `data.dataset=<key>`. The loaders,
samplers, sharding and resume in data.py (and streams.py) work for any of them.
The built-in ones:

    digits         scikit-learn's 1797 8x8 handwritten digits, in memory (multiclass, default)
    digits_files   the same digits as one .npy file per sample + labels.csv under data.root,
                   read from disk in __getitem__, with a training-only random shift: the
                   pattern for data too big for memory (written on first use, no download)
    digits_shards  the same digits' splits as shard files of 128 samples (.npy pairs) +
                   counts.json, read as a stream (streams.ShardedStream): the pattern for
                   data written as shards
    breast_cancer  scikit-learn's 569 tumours, 30 features, malignant = positive (binary)
    diabetes       scikit-learn's 442 patients, 10 features, disease progression (regression)
    synthetic      Gaussian clusters in data.synthetic_features dimensions (multiclass)
    images         synthetic 3 x image_size x image_size class patterns + noise (multiclass)
    tokens         token files (train.bin, val.bin, test.bin, meta.json) under data.root, for
                   a language model (next_token): windows of data.block_size tokens; empty
                   data.root: the project's docs, one token per character (ddpkit/tokens.py)

Samples are `(inputs, target)` pairs here; a dict of tensors works too (the task reads it).
Honour `cfg.augment` in your training transform: check_equivalence.py switches it off.
"""

import csv
import functools
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import Dataset

from ddpkit.config import PROJECT_DIR, UserError
from ddpkit.splits import Splits, array_splits, split_indices
from ddpkit.streams import DataError, ShardedStream, check_npy, load_npy
from ddpkit.tokens import tokens
from ddpkit.writes import write_folder_once


def sklearn_csv(name: str) -> Path | None:
    """A data file that ships inside scikit-learn (read directly: importing scikit-learn costs
    each process about a second)."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / name if spec else None
    return path if path and path.is_file() else None


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as 1x8x8 float32 images in 0..1, and their labels."""
    csv_file = sklearn_csv("digits.csv.gz")
    if csv_file:
        table = np.loadtxt(csv_file, delimiter=",", dtype=np.float32)
        pixels, labels = table[:, :-1], table[:, -1]
    else:  # the file moved in some scikit-learn version: the public loader always works
        from sklearn.datasets import load_digits

        pixels, labels = load_digits(return_X_y=True)
    images = (pixels / 16.0).reshape(-1, 1, 8, 8)  # intensities 0..16 -> 0..1
    return images.astype(np.float32), labels.astype(np.int64)


def digits(cfg: DictConfig) -> Splits:
    return array_splits(cfg, *load_digits_images(), task="multiclass")


# --- digits_files: one file per sample, read from disk -----------------------------------------

class NpyFolder(Dataset):
    """Samples stored one `.npy` file each in `root`, listed with their labels in
    `root/labels.csv` (columns: file, label). Only the files of the samples a rank asks for are
    read, so the data need not fit in memory; `transform` applies to each sample's tensor.
    A sample file that cannot be read is a DataError naming it, ending with `fix` (what to do);
    its headers are not checked at start-up (millions of files would take minutes)."""

    def __init__(self, root: Path, files: list[str], labels: list[int], transform=None,
                 fix: str = "write it again"):
        self.root, self.files, self.labels, self.transform = root, files, labels, transform
        self.fix = fix

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        inputs = torch.from_numpy(load_npy(self.root / self.files[index], self.fix))
        if self.transform:
            inputs = self.transform(inputs)
        return inputs, torch.tensor(self.labels[index])


def random_shift(image: torch.Tensor) -> torch.Tensor:
    """Shift an image by up to one pixel in each direction (edges wrap): a small augmentation.
    Its randomness comes from the torch generator of the process that loads the sample (the
    training process, or a DataLoader worker), which the template seeds per rank and worker."""
    dy, dx = torch.randint(-1, 2, (2,)).tolist()
    return torch.roll(image, shifts=(dy, dx), dims=(-2, -1))


def read_labels(root: Path, fix: str = "fix it") -> tuple[list[str], list[int]]:
    """The sample files and labels listed in root/labels.csv (columns: file, label; labels whole
    numbers from 0). A file that is not such a table is a DataError naming it and the line at
    fault, ending with `fix` (what to do)."""
    table = root / "labels.csv"
    if not table.is_file():
        raise UserError(f"data.root={root} has no labels.csv: point data.root at the folder "
                        "that holds the sample files and labels.csv")
    try:
        with open(table, newline="") as handle:
            files, labels = _label_rows(csv.DictReader(handle), table, fix)
    except (UnicodeDecodeError, csv.Error) as error:
        reason = " ".join(str(error).split())
        raise DataError(f"{table} is not a CSV table ({reason}): {fix}") from None
    except OSError as error:
        raise DataError(f"{table} cannot be read ({error.strerror}): {fix}") from None
    if not files:
        raise DataError(f"{table} lists no samples: {fix}")
    return files, labels


def _label_rows(reader: csv.DictReader, table: Path, fix: str) -> tuple[list[str], list[int]]:
    if not {"file", "label"} <= set(reader.fieldnames or ()):
        raise DataError(f"{table} has the columns {reader.fieldnames}, not file and label: {fix}")
    files, labels = [], []
    for row in reader:
        name, label = row["file"], row["label"]
        if not name or label is None:
            raise DataError(f"{table} line {reader.line_num} gives no "
                            f"{'file' if not name else 'label'}: {fix}")
        if not label.strip().isdecimal():
            raise DataError(f"{table} line {reader.line_num}: the label {label!r} is not a whole "
                            f"number from 0: {fix}")
        files.append(name)
        labels.append(int(label))
    return files, labels


def first_missing(root: Path, files: list[str]) -> str | None:
    """The first of `files` (paths under `root`) that is not there, or None. One listing per
    folder rather than one stat per file: cheap at start-up even for millions of samples."""
    listed: dict[str, set[str]] = {}
    for name in files:
        folder, base = os.path.split(name)
        if folder not in listed:
            directory = root / folder
            listed[folder] = set(os.listdir(directory)) if directory.is_dir() else set()
        if base not in listed[folder]:
            return name
    return None


def rewrite_hint(root: Path, written_here: bool, what: str) -> str:
    """What to do about a damaged file of a built-in dataset's folder: one the run wrote itself
    (data.root left empty) is written anew once deleted; one of data.root is the user's."""
    if written_here:
        return f"delete the folder {root} and the next run writes it anew"
    return f"write {what} again"


def write_digits_folder(root: Path) -> None:
    """Write the digits as one .npy file per sample plus labels.csv (write_folder_once)."""
    images, labels = load_digits_images()

    def write(folder: Path) -> None:
        with open(folder / "labels.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["file", "label"])
            for index, (image, label) in enumerate(zip(images, labels, strict=True)):
                np.save(folder / f"{index:05d}.npy", image)
                writer.writerow([f"{index:05d}.npy", int(label)])

    write_folder_once(root, "labels.csv", write)


def digits_files(cfg: DictConfig) -> Splits:
    root = Path(cfg.root) if cfg.root else PROJECT_DIR / "data" / "digits_files"
    if not cfg.root and not root.exists():
        write_digits_folder(root)
    fix = rewrite_hint(root, not cfg.root, "it")
    files, labels = read_labels(root, fix)
    missing = first_missing(root, files)
    if missing is not None:  # found now, not when a worker reaches it mid-epoch
        raise DataError(f"{root / missing} is missing (labels.csv lists it): {fix}")
    indices = split_indices(cfg, len(files), np.array(labels))

    def part(name: str, transform=None) -> NpyFolder:
        chosen = indices[name]
        return NpyFolder(root, [files[i] for i in chosen], [labels[i] for i in chosen], transform,
                         fix)

    return Splits(part("train", random_shift if cfg.augment else None), part("val"), part("test"),
                  task="multiclass", num_classes=max(labels) + 1)


# --- digits_shards: the digits as shard files, read as a stream ------------------------------

SHARD_SAMPLES = 128  # samples per shard file of digits_shards (the last of a split has fewer)


class NpyShard:
    """One shard of digits_shards: `<name>.x.npy` (inputs) and `<name>.y.npy` (labels), memory
    mapped, so that indexing reads only the rows asked for. (check_npy_shard has checked both
    at start-up; a file damaged since is a DataError naming it, ending with `fix`.)"""

    def __init__(self, prefix: str, fix: str = "write it again"):
        self.inputs = load_npy(f"{prefix}.x.npy", fix, mmap_mode="r")
        self.labels = load_npy(f"{prefix}.y.npy", fix, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, row: int):
        return torch.from_numpy(np.array(self.inputs[row])), torch.tensor(int(self.labels[row]))


def check_npy_shard(prefix: str, count: int | None, fix: str = "write it again") -> None:
    """digits_shards' start-up check of a shard (ShardedStream's `check`): both of its files
    whole, with `count` rows each. Headers and sizes only: milliseconds for hundreds."""
    for part in ("x", "y"):
        check_npy(f"{prefix}.{part}.npy", count, fix)


def read_counts(table: Path, fix: str) -> dict[str, dict[str, int]]:
    """counts.json of digits_shards: {split: {shard name: samples}} for train, val and test."""
    try:
        counts = json.loads(table.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        reason = " ".join(str(error).split())
        raise DataError(f"{table} is not valid JSON ({reason}): {fix}") from None
    except OSError as error:
        raise DataError(f"{table} cannot be read ({error.strerror}): {fix}") from None
    for split in ("train", "val", "test"):
        shards = counts.get(split) if isinstance(counts, dict) else None
        if not shards or not isinstance(shards, dict) or not all(
                type(count) is int and count >= 0 for count in shards.values()):
            raise DataError(f"{table} gives no sample counts of the {split} split (an object "
                            f"of shard names and their samples): {fix}")
    return counts


def shift_sample(sample: tuple) -> tuple:
    """random_shift of a sample's inputs (a stream's transform takes the whole sample)."""
    inputs, target = sample
    return random_shift(inputs), target


def write_digits_shards(root: Path, cfg: DictConfig) -> None:
    """Write the digits' train / val / test splits (data.split_seed's) as shards of
    SHARD_SAMPLES samples plus counts.json (write_folder_once)."""
    images, labels = load_digits_images()
    chosen = split_indices(cfg, len(labels), labels)

    def write(folder: Path) -> None:
        counts: dict[str, dict[str, int]] = {}
        for split, rows in chosen.items():
            counts[split] = {}
            for number, start in enumerate(range(0, len(rows), SHARD_SAMPLES)):
                part, name = rows[start:start + SHARD_SAMPLES], f"{split}-{number:05d}"
                np.save(folder / f"{name}.x.npy", images[part])
                np.save(folder / f"{name}.y.npy", labels[part])
                counts[split][name] = len(part)
        (folder / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")

    write_folder_once(root, "counts.json", write)


def digits_shards(cfg: DictConfig) -> Splits:
    """The digits as a stream of shard files under data.root (written once, from
    data.split_seed's split, when data.root is left empty): train shuffled across windows of 4
    shards and within them, augmented by random_shift when data.augment is on."""
    root = Path(cfg.root) if cfg.root else PROJECT_DIR / "data" / f"digits_shards-{cfg.split_seed}"
    if not cfg.root and not root.exists():
        write_digits_shards(root, cfg)
    table = root / "counts.json"
    if not table.is_file():
        raise UserError(f"data.root={root} has no counts.json: point data.root at a folder "
                        "written by digits_shards")
    fix = rewrite_hint(root, not cfg.root, "the shards")
    counts = read_counts(table, fix)

    def stream(split: str, transform=None) -> ShardedStream:
        names = sorted(counts[split])
        # Every shard's headers checked once here, in each process: a bad file is one line now
        return ShardedStream([str(root / name) for name in names],
                             functools.partial(NpyShard, fix=fix),
                             [counts[split][name] for name in names], transform=transform,
                             check=functools.partial(check_npy_shard, fix=fix))

    return Splits(stream("train", shift_sample if cfg.augment else None), stream("val"),
                  stream("test"), task="multiclass", num_classes=10)


# --- scikit-learn's tabular sets -----------------------------------------------------------------

def standardise(splits: Splits) -> Splits:
    """Inputs scaled to mean 0 and std 1 per feature, with the training split's statistics."""
    train = splits.train.inputs
    mean, std = train.mean(0), train.std(0).clamp(min=1e-8)
    for part in (splits.train, splits.val, splits.test):
        part.inputs = (part.inputs - mean) / std
    return splits


def breast_cancer(cfg: DictConfig) -> Splits:
    from sklearn.datasets import load_breast_cancer  # bundled with scikit-learn, offline

    features, benign = load_breast_cancer(return_X_y=True)
    malignant = (benign == 0).astype(np.int64)  # the class to find is the positive one
    return standardise(array_splits(cfg, features.astype(np.float32), malignant, task="binary"))


def diabetes(cfg: DictConfig) -> Splits:
    from sklearn.datasets import load_diabetes  # bundled offline; features already scaled

    features, targets = load_diabetes(return_X_y=True)
    return array_splits(cfg, features.astype(np.float32), targets.astype(np.float32),
                        task="regression")


# --- synthetic data ------------------------------------------------------------------------------

def check_classes(cfg: DictConfig) -> None:
    if cfg.synthetic_classes < 2:
        raise UserError(f"data.synthetic_classes={cfg.synthetic_classes} is not valid: it must "
                        "be at least 2")


def synthetic(cfg: DictConfig) -> Splits:
    """Vectors: one Gaussian cluster per class around a random corner of a hypercube in the
    first few features (the rest is noise). Generated from data.split_seed."""
    check_classes(cfg)
    rng = np.random.default_rng(cfg.split_seed)
    classes, features = cfg.synthetic_classes, cfg.synthetic_features
    informative = min(features, max(2, classes))
    centres = np.zeros((classes, features))
    centres[:, :informative] = 2.0 * rng.choice([-1.0, 1.0], size=(classes, informative))
    labels = rng.permutation(np.arange(cfg.synthetic_samples) % classes)
    vectors = centres[labels] + rng.standard_normal((cfg.synthetic_samples, features))
    return array_splits(cfg, vectors.astype(np.float32), labels.astype(np.int64), "multiclass")


def random_flip(images: torch.Tensor) -> torch.Tensor:
    """Mirror each image of a batch left-right with probability 1/2."""
    flip = torch.rand(len(images)) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def images(cfg: DictConfig) -> Splits:
    """3 x size x size images: each class a smooth random pattern (a 4x4 grid of colours,
    upsampled), each sample its class's pattern plus strong pixel noise; random left-right
    flips of the training split when data.augment is on."""
    check_classes(cfg)
    rng = np.random.default_rng(cfg.split_seed)
    size, classes = cfg.image_size, cfg.synthetic_classes
    cell = math.ceil(size / 4)
    patterns = rng.standard_normal((classes, 3, 4, 4)).repeat(cell, 2).repeat(cell, 3)
    labels = rng.permutation(np.arange(cfg.synthetic_samples) % classes)
    pixels = np.empty((cfg.synthetic_samples, 3, size, size), dtype=np.float32)
    for start in range(0, len(labels), 512):  # in chunks: float64 noise for all would be large
        chunk = labels[start:start + 512]
        noise = rng.standard_normal((len(chunk), 3, size, size))
        pixels[start:start + 512] = 0.5 * patterns[chunk, :, :size, :size] + noise
    return array_splits(cfg, pixels, labels.astype(np.int64), "multiclass",
                        train_transform=random_flip)


# Builders take the `data` config section and return splits.Splits. Yours are added in
# data_sources.py (or named on the command line as module:function).
DATASETS = {
    "digits": digits,
    "digits_files": digits_files,
    "digits_shards": digits_shards,
    "breast_cancer": breast_cancer,
    "diabetes": diabetes,
    "synthetic": synthetic,
    "images": images,
    "tokens": tokens,
}
