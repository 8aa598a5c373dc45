"""The tests' own data, models and task: small, fast, and independent of the built-in examples
and of yours, so the tests keep checking the plumbing whatever you add or change.

Runs name them by file: data.dataset=tests/fixtures.py:vectors model.name=tests/fixtures.py:mlp.
"""

import functools
import gc
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from ddpkit import STARTUP_COLLECTION, supervisor
from ddpkit.config import UserError
from ddpkit.splits import Splits, TensorSamples, array_splits, split_indices
from ddpkit.streams import ShardedStream
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


class RecordedOrder(DistributedSampler):
    """The default training order (a shuffled DistributedSampler), which also tells its dataset
    where each sample stands in the epoch's order (every rank's alike), so that a batch read
    knows its global step whatever the world size."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        dataset.order = self

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)  # DistributedSampler's own shuffle
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        self.place = {index: place for place, index in enumerate(order)}


class RecordedSamples(TensorSamples):
    """The training split of `recorded_vectors`: each batch read is written down, one JSON line
    (process, world size, rank, epoch, global step, sample indices) in ELASTIC_RECORD/<pid>.jsonl,
    for tests/test_elastic.py. Two known events make its timeline certain: with ELASTIC_KILL_AT
    (steps counted over the run from 1) a process of a world of 2 kills its node's launch (run.sh
    and torchrun, SIGKILL) and itself on reading that step; a process of a world of 1 reads
    ELASTIC_HOLD_AFTER batches, then holds each read until it gets a stop signal (the elastic
    agent stops the workers when a node joins)."""

    order: RecordedOrder

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):  # a sample looked at, not a batch trained on
            return self.inputs[index], self.targets[index]
        batch = int(os.environ["ELASTIC_BATCH"])  # the global batch
        places = [self.order.place[int(i)] for i in index]
        step = self.order.epoch * math.ceil(len(self) / batch) + places[0] // batch + 1
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        record = Path(os.environ["ELASTIC_RECORD"]) / f"{os.getpid()}.jsonl"
        with record.open("a") as out:
            out.write(json.dumps({"world": world, "rank": rank, "epoch": self.order.epoch,
                                  "step": step, "places": places}) + "\n")
        reads = sum(1 for _ in record.open())
        if world == 2 and step == int(os.environ.get("ELASTIC_KILL_AT", "0")):
            os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)  # run.sh and torchrun
            os.kill(os.getpid(), signal.SIGKILL)
        while world == 1 and reads > int(os.environ["ELASTIC_HOLD_AFTER"]) and \
                not supervisor.PREEMPTION_SIGNALS_RECEIVED:
            time.sleep(0.05)  # waiting for a signal, which the handler notes
        return super().__getitem__(index)


def vectors_read_by(samples: type, cfg) -> Splits:
    """vectors whose training split is `samples` (a TensorSamples that watches its reads), in
    RecordedOrder."""
    splits = vectors(cfg)
    splits.train = samples(splits.train.inputs, splits.train.targets)
    splits.train_sampler = RecordedOrder
    return splits


def recorded_vectors(cfg) -> Splits:
    """vectors whose training reads are written down (RecordedSamples)."""
    return vectors_read_by(RecordedSamples, cfg)


class HeldSamples(TensorSamples):
    """The training split of `held_vectors`: with HOLD_AT_STEP=k in the environment, every rank
    holds the read of step k's batch (steps counted over the run from 1) until a signal comes
    (SIGTERM is noted, Ctrl-C raises), rank 0 first creating the file HOLD_MARKER. A test's
    signal then comes at step k however fast the machine; without HOLD_AT_STEP (the same
    command run again) these are vectors' samples, read as they are."""

    order: RecordedOrder

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):  # a sample looked at, not a batch trained on
            return self.inputs[index], self.targets[index]
        hold_at = int(os.environ.get("HOLD_AT_STEP", "0"))
        if hold_at:
            batch = len(index) * int(os.environ.get("WORLD_SIZE", "1"))  # (every step's full)
            step = (self.order.epoch * math.ceil(len(self) / batch)
                    + self.order.place[int(index[0])] // batch + 1)
            if step == hold_at:
                if os.environ.get("RANK", "0") == "0":
                    Path(os.environ["HOLD_MARKER"]).touch()
                while not supervisor.PREEMPTION_SIGNALS_RECEIVED:
                    time.sleep(0.05)  # waiting for a signal, which the handler notes or raises
        return super().__getitem__(index)


def held_vectors(cfg) -> Splits:
    """vectors whose training reads hold at a step until a signal comes (HeldSamples)."""
    return vectors_read_by(HeldSamples, cfg)


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


class Words(Dataset):
    """Samples of text: (a word, a label), or the word alone; as a dict, a text field beside
    the features (Hugging Face style, read by a model that takes it by keyword)."""

    def __init__(self, form: str):
        self.form = form

    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int):
        word = f"word {index}"
        if self.form == "dict":
            return {"features": torch.ones(4), "text": word, "target": index % 2}
        return (word, index % 2) if self.form == "pair" else word


def words(cfg, form: str = "pair") -> Splits:
    return Splits(Words(form), Words(form), Words(form), task="multiclass", num_classes=2)


def lambda_vectors(cfg) -> Splits:
    """vectors whose training split holds a lambda: loader workers started by pickle fail."""
    splits = vectors(cfg)
    splits.train.transform = lambda batch: batch * 1.0
    return splits


bare_words = functools.partial(words, form="word")
dict_words = functools.partial(words, form="dict")


# --- Streams: splits as shards (ddpkit/streams.py) -------------------------------------------

def whole_shard(shard: TensorSamples) -> TensorSamples:
    """A shard that is already in memory: indexed row by row."""
    return shard


def add_sample_noise(sample: tuple) -> tuple:
    inputs, target = sample
    return inputs + 0.1 * torch.randn_like(inputs), target


def as_shards(part: TensorSamples, cuts: list[int], transform=None) -> ShardedStream:
    bounds = [0, *cuts, len(part)]
    shards = [TensorSamples(part.inputs[a:b], part.targets[a:b])
              for a, b in zip(bounds, bounds[1:], strict=False)]
    return ShardedStream(shards, whole_shard, [len(shard) for shard in shards], transform)


def stream_vectors(cfg) -> Splits:
    """vectors streamed: train in 7 uneven shards (noise added per sample when data.augment),
    val in 2 and test in 3, each split's samples in the order of vectors' split."""
    splits = vectors(cfg)
    splits.train = as_shards(splits.train, [30, 41, 97, 130, 181, 200],
                             add_sample_noise if cfg.augment else None)
    splits.val, splits.test = as_shards(splits.val, [20]), as_shards(splits.test, [25, 50])
    return splits


ID_SHARDS = [13, 9, 17, 5, 11, 8, 14]  # 77 samples in 7 shards: neither divides by 3 or 6


def id_shard(shard: tuple[int, int]):
    """A shard read in order only (a generator): samples ([id, 0], id % 4) for its ids."""
    first, count = shard
    for index in range(first, first + count):
        yield torch.tensor([float(index), 0.0]), torch.tensor(index % 4)


def draw_second(sample: tuple) -> tuple:
    """A random second feature: the augmentation the probe compares across process counts."""
    inputs, target = sample
    return torch.stack([inputs[0], torch.rand(())]), target


def id_streams(sizes: list[int], first: int, transform=None) -> ShardedStream:
    starts = first + np.cumsum([0, *sizes[:-1]])
    return ShardedStream([(int(start), size) for start, size in zip(starts, sizes, strict=True)],
                         id_shard, sizes, transform, shuffle_window=3)


def id_stream(cfg) -> Splits:
    """Samples that name themselves (ids 0..76 in train, 1000.. in val, 2000.. in test), read as
    streams of uneven shards by a reader that cannot index."""
    return Splits(id_streams(ID_SHARDS, 0, draw_second if cfg.augment else None),
                  id_streams([10, 7, 12], 1000), id_streams([10, 7, 12], 2000),
                  task="multiclass", num_classes=4)


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
    # The user's code runs with the garbage collector as usual (a command starts with it rare).
    assert gc.get_threshold()[0] != STARTUP_COLLECTION, "the collector still runs rarely"
    return MLP(int(np.prod(input_shape)), num_outputs, cfg.hidden_dim, cfg.num_layers,
               cfg.dropout, cfg.batchnorm)


def padded_gpt(cfg, input_shape, num_outputs: int) -> nn.Module:
    """The built-in GPT with its outputs rounded up to a multiple of 64, as nanoGPT pads GPT-2's
    vocabulary: more token ids than the data's vocabulary decodes."""
    from ddpkit.lm import build_gpt

    return build_gpt(cfg, input_shape, 64 * math.ceil(num_outputs / 64))


class PoisonedMLP(nn.Module):
    """MLP whose outputs go bad at chosen training steps, for the step guard's tests: POISON
    ("8:spike,12:nan") maps a forward pass in training (counted from 1, the count a buffer, so
    that a checkpoint keeps it) to its outputs times -50 (confidently wrong) or times nan."""

    def __init__(self, mlp: nn.Module, poison: str):
        super().__init__()
        self.mlp = mlp
        self.poison = {int(step): how for step, how in
                       (part.split(":") for part in poison.split(",") if part)}
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, inputs):
        outputs = self.mlp(inputs)
        if not self.training:
            return outputs
        self.forwards += 1
        how = self.poison.get(int(self.forwards))
        return outputs * {"spike": -50.0, "nan": math.nan}[how] if how else outputs


def poisoned_mlp(cfg, input_shape, num_outputs: int) -> nn.Module:
    return PoisonedMLP(mlp(cfg, input_shape, num_outputs), os.environ.get("POISON", ""))


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


# --- Batches of any shape: variable-length sequences, dict samples, keyword inputs ---------------

VOCABULARY = 24


class Sequences(Dataset):
    """Dict samples of token sequences of different lengths: {"tokens", "label"}. Each of 4
    classes draws most of its tokens from its own quarter of the vocabulary."""

    def __init__(self, tokens: list[torch.Tensor], labels: np.ndarray):
        self.tokens, self.labels = tokens, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"tokens": self.tokens[index], "label": torch.tensor(int(self.labels[index]))}


def pad_sequences(samples: list[dict]) -> dict:
    """The collate of Sequences: tokens padded with 0 to the batch's longest, and a mask."""
    tokens = torch.nn.utils.rnn.pad_sequence([s["tokens"] for s in samples], batch_first=True)
    lengths = torch.tensor([len(s["tokens"]) for s in samples])
    mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return {"tokens": tokens, "mask": mask, "label": torch.stack([s["label"] for s in samples])}


def sequence_splits(cfg, **options) -> Splits:
    rng = np.random.default_rng(cfg.split_seed)
    labels = rng.permutation(np.arange(SAMPLES) % 4)
    quarter = VOCABULARY // 4
    tokens = []
    for label in labels:
        length = int(rng.integers(3, 13))
        own = rng.random(length) < 0.7
        drawn = np.where(own, label * quarter + rng.integers(0, quarter, length),
                         rng.integers(1, VOCABULARY, length))
        tokens.append(torch.from_numpy(np.maximum(drawn, 1)))  # 0 is padding
    split = split_indices(cfg, SAMPLES, labels)
    parts = [Sequences([tokens[i] for i in split[name]], labels[split[name]])
             for name in ("train", "val", "test")]
    return Splits(*parts, task="multiclass", num_classes=4, collate=pad_sequences, **options)


def sequences(cfg) -> Splits:
    """Variable-length token sequences as dict samples, padded by their own collate."""
    return sequence_splits(cfg)


def sequences_drop_last(cfg) -> Splits:
    return sequence_splits(cfg, drop_last=True)


class ByLength(torch.utils.data.Sampler):
    """A training sampler of the builder's own: the split sorted by length (shuffled within a
    length, per epoch), every rank taking each world_size-th index of it."""

    def __init__(self, dataset: Sequences, num_replicas: int, rank: int, seed: int):
        self.lengths = [len(t) for t in dataset.tokens]
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.per_rank = len(self.lengths) // num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        noise = torch.rand(len(self.lengths),
                           generator=torch.Generator().manual_seed(self.seed + self.epoch))
        keys = torch.tensor(self.lengths, dtype=torch.float64) + noise.double()
        return keys.argsort().tolist()[:self.per_rank * self.num_replicas]

    def __iter__(self):
        return iter(self.order()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return self.per_rank


def sequences_by_length(cfg) -> Splits:
    return sequence_splits(cfg, train_sampler=ByLength)


class Uneven(ByLength):
    """A faulty sampler: rank r takes r samples fewer than rank 0."""

    def __len__(self) -> int:
        return self.per_rank - self.rank

    def __iter__(self):
        return iter(self.order()[self.rank::self.num_replicas][:len(self)])


def sequences_uneven(cfg) -> Splits:
    return sequence_splits(cfg, train_sampler=Uneven)


class BagOfTokens(nn.Module):
    """Mean of the embeddings of a sequence's tokens (padding masked out), then a linear head.
    Its inputs are keyword arguments; `returns` picks what it gives back."""

    def __init__(self, outputs: int, hidden: int, returns: str = "tensor"):
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, hidden)
        self.head = nn.Linear(hidden, outputs)
        self.returns = returns

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor):
        weights = mask.to(self.head.weight.dtype)
        pooled = (self.embed(tokens) * weights[..., None]).sum(1) / weights.sum(1, keepdim=True)
        logits = self.head(pooled)
        if self.returns == "dict":  # a loss of its own, which the task ignores
            return {"logits": logits, "loss": logits.sum() * 1000}
        if self.returns == "object":
            return Outputs(logits=logits, loss=logits.sum() * 1000)
        return logits


class Outputs:
    """A model output object with attributes, as a Hugging Face ModelOutput has them."""

    def __init__(self, logits: torch.Tensor, loss: torch.Tensor):
        self.logits, self.loss = logits, loss


def bag_of_tokens(cfg, input_shape: dict, num_outputs: int) -> nn.Module:
    return BagOfTokens(num_outputs, cfg.hidden_dim)


def bag_of_tokens_dict(cfg, input_shape: dict, num_outputs: int) -> nn.Module:
    return BagOfTokens(num_outputs, cfg.hidden_dim, returns="dict")


class WholeDictModel(nn.Module):
    """The old style: a forward that takes the whole dict batch as its one argument."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.linear(batch["features"])


def whole_dict_model(cfg, input_shape: dict, num_outputs: int) -> nn.Module:
    return WholeDictModel(input_shape["features"][0], num_outputs)
