"""Streamed splits: data read shard by shard, split over ranks and their loader workers.

A builder returns a `ShardedStream` for any split whose data is written as shard files (npy,
jsonl, parquet, tar, ...) too big to index as a map-style dataset: the list of shards, a function
that reads one, and how many samples each holds. The engine never reads a whole split into
memory, and each rank and worker reads only the shards (and, where the reader can index, only the
rows) that hold its own samples.

How an epoch is cut (the *plan*, a pure function of run.seed, the epoch and the sample counts):

- **Order.** Shards are shuffled by (run.seed, epoch); consecutive groups of `shuffle_window`
  shards are each shuffled as one pool of samples (across and within shards). Validation and test
  splits keep the shards' own order. The order does not depend on the process or worker count.
- **Steps.** Global step k takes positions k x B .. (k+1) x B of that order (B: the global batch),
  and rank r the r-th of W equal slices of it, so the global batch of every step is the same at
  any process count. An epoch has ceil(N / B) steps and every rank takes each one, so no rank
  waits for another. The remainder: the last step holds the R < B samples left, split over the
  ranks (shares differ by at most one); each rank's loss is weighted by its share
  (`Step.weight`), so the gradient averaged over ranks is that of the step's mean loss. A rank
  whose share is empty (R smaller than the process count) runs the step's first sample at weight
  0: it takes part in the gradient all-reduce and adds nothing (its BatchNorm statistics do see
  that sample). Every sample counts exactly once an epoch. Splits(drop_last=True) leaves the
  remainder out instead.
- **Workers.** A rank's micro-batches are dealt to its loader workers in turn (0, 1, 0, 1, ...),
  which is the order the DataLoader collects them in, so the batches do not depend on the worker
  count either. The training iterator runs on from one epoch into the next, so the workers read
  the next epoch's first batches while the loop ends this one (and validates).
- **Randomness.** A `transform` (the training augmentation) draws from torch's generator seeded
  per sample by (run.seed, epoch, position): the same at any process or worker count and after a
  resume.
- **Resume.** The plan from step s on is known from (epoch, s) alone, so a resumed run, at the same
  or another process count, reads exactly the samples an uninterrupted run would have read next.
  (torchdata's StatefulDataLoader would save each worker's iterator instead: a state tied to one
  process and worker count, which this plan does not need.)
- **Evaluation.** Rank r reads the r-th contiguous block of the split in shard order; each sample
  is scored once, and the blocks in rank order are the split's order (evaluation.py).
- **Drawn samples.** A `SampledStream` (the windows of a token file: ddpkit/tokens.py) has no
  shards to order: the sample at each position of the plan is drawn, with replacement, as a pure
  function of (run.seed, epoch, position). Steps, ranks, workers and resume are as above.
"""

import bisect
import itertools
import math
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddpkit.config import UserError


class DataError(UserError):
    """A data file that is missing or damaged, or data that does not match its counts: a
    UserError (one line, exit 2) that stays one line when a DataLoader worker raises it.

    PyTorch re-raises a worker's exception in the training process as a new one of the same
    type, built from a text holding the worker's whole traceback; built from that text, this one
    takes back the original message (the traceback's last line)."""

    # Raised reading data mid-run, on one rank while the others wait in a collective: that rank
    # reports it and leaves without them (lifecycle.run_main). Raised while the job is built, it
    # is agreed on like any UserError (agree_on_errors raises a plain one).
    raised_alone = True

    def __init__(self, message: str):
        super().__init__(_original_message(message, type(self).__name__))


def _original_message(message: str, name: str) -> str:
    if message.startswith(f"Caught {name} ") and "\nOriginal Traceback" in message:
        last_line = message.rstrip().rsplit("\n", 1)[-1]  # "ddpkit.streams.DataError: ..."
        _, found, original = last_line.partition(f"{name}: ")
        if found:
            return original
    return message


class ShardedStream(IterableDataset):
    """A split stored as shards: `read(shard)` gives one shard's samples, either as an iterable
    (read in order; the rows of other ranks are skipped) or as an object with `len()` and
    indexing (a numpy memmap, a list, a Hugging Face Dataset: only this rank's rows are read).

    `counts[i]` is the number of samples of `shards[i]`: the engine plans every epoch with them
    (steps, the split over ranks) before reading anything. Leave it out to count once by reading
    every shard (slow for large data: write the counts next to the shards). `transform` takes
    each sample after reading and returns it changed (its randomness: the module's docstring).
    The shards and `read` must be picklable (module-level functions): loader workers get them.

    `check(shard, count)` runs on every shard once, here, when the builder makes the stream
    (in each process, before any loader worker starts), and raises `DataError` for a shard that
    is missing or damaged, so that a bad file is one line at start-up and not a traceback
    mid-epoch. Keep it cheap (sizes and headers, not contents: `check_npy` for .npy files).
    The default, `check=True`, finds missing local files (LocalShardsExist). False: none.

    Iterating it directly gives every sample in shard order (for a look at the data); training
    and evaluation read it through the engine's plan.
    """

    def __init__(self, shards: Sequence, read: Callable, counts: Sequence[int] | None = None,
                 transform: Callable | None = None, shuffle_window: int = 4,
                 check: Callable | bool = True):
        self.shards, self.read, self.transform = list(shards), read, transform
        if not self.shards:
            raise UserError("a ShardedStream was given no shards: check the folder or pattern "
                            "its builder reads")
        if counts is not None and len(counts) != len(self.shards):
            raise _bad_counts(self.shards, counts)
        # Before counting: reading a missing shard to count it would fail without naming it.
        _check_shards(LocalShardsExist() if check is True else check, self.shards, counts)
        if counts is None:
            counts = [_count(read(shard)) for shard in self.shards]
        self.counts = np.asarray(counts, dtype=np.int64)
        if (self.counts < 0).any():
            raise _bad_counts(self.shards, counts)
        if shuffle_window < 1:
            raise UserError(f"ShardedStream(shuffle_window={shuffle_window}): use 1 or more "
                            "shards")
        self.shuffle_window = shuffle_window

    def __len__(self) -> int:
        return int(self.counts.sum())

    def __iter__(self):
        for shard in self.shards:
            yield from _all_rows(self.read(shard))

    def head(self, size: int) -> list:
        """The first `size` samples in shard order, untransformed (no random draw)."""
        return list(itertools.islice(iter(self), size))


class SampledStream(ShardedStream):
    """A split whose samples are drawn with replacement, not read in a shuffled order (the
    windows of a token file: ddpkit/tokens.py). TrainPlan cuts its epochs of `len()` positions
    as any stream's, and position p of `epoch` holds `draw(seed, epoch, p, p + 1)`, a pure
    function of (run.seed, epoch, p): nothing is held per sample or step, and the global
    batches and a resume are the same at any process or worker count. Evaluated (an estimate
    over random windows), `epoch` is None. Subclasses implement `draw`."""

    def __init__(self, samples_per_epoch: int):  # no shards: nothing is read in an order
        self.shards, self.read, self.transform, self.shuffle_window = [], None, None, 1
        self.counts = np.asarray([samples_per_epoch], dtype=np.int64)

    def draw(self, seed: int, epoch: int | None, first: int, end: int) -> list:
        raise NotImplementedError  # the samples at positions first .. end - 1 of `epoch`

    def cover(self, samples: int) -> None:  # epochs of that many positions; the same draws
        self.counts = np.asarray([samples], dtype=np.int64)

    def __iter__(self):  # a look at the data: epoch 0's draws of seed 0, a block at a time
        for first in range(0, len(self), 1024):
            yield from self.draw(0, 0, first, min(first + 1024, len(self)))

    def head(self, size: int) -> list:
        return self.draw(0, 0, 0, min(size, len(self)))


def _check_shards(check: Callable | bool, shards: list, counts: Sequence[int] | None) -> None:
    if check:
        for shard, count in zip(shards, [None] * len(shards) if counts is None else counts,
                                strict=True):
            check(shard, None if count is None else int(count))


def _bad_counts(shards: list, counts: Sequence) -> UserError:
    return UserError(f"a ShardedStream has {len(shards)} shards but counts "
                     f"{list(counts)[:5]}...: give one sample count (>= 0) per shard")


class LocalShardsExist:
    """ShardedStream's default check: a shard given as a path to a local folder (a str or
    os.PathLike with a folder part, not a URL) whose folder exists must name a file or folder
    there, or begin the names of some (a prefix of several files, as digits_shards' shards are).
    Other shards (bare names a reader may resolve itself, objects) are not checked. One stat per
    shard, one listing per folder of prefixes: milliseconds for hundreds of shards."""

    def __init__(self):
        self.listings: dict[str, list[str]] = {}  # folder -> its entries, sorted

    def __call__(self, shard, count: int | None = None) -> None:
        if not isinstance(shard, (str, os.PathLike)) or "://" in str(shard):
            return
        path = os.fspath(shard)
        if os.path.exists(path):
            return
        folder, name = os.path.split(path)
        if not folder or not os.path.isdir(folder):  # not a local path we can place
            return
        if folder not in self.listings:
            self.listings[folder] = sorted(os.listdir(folder))
        entries = self.listings[folder]
        after = bisect.bisect_left(entries, name)  # the first entry >= name: a prefix match?
        if after == len(entries) or not entries[after].startswith(name):
            raise DataError(f"{path} is missing: write the shard again, or leave it out of the "
                            "ShardedStream's shards")


def check_npy(path, rows: int | None = None, fix: str = "write it again") -> tuple[int, ...]:
    """Check cheaply that `path` is a whole .npy file: it exists, its header reads, and its size
    is the header's plus the bytes of the array the header declares; given `rows`, that the array
    has that many rows (its first dimension). Only the header is read (about 128 bytes), so
    hundreds of files take milliseconds. Returns the array's shape; raises DataError, one line:
    the file, what is wrong with it, and `fix` (what to do)."""
    problem, shape = _npy_problem(os.fspath(path))
    if problem is None and rows is not None and shape[:1] != (rows,):
        problem = (f"holds {shape[0]} rows where {rows} are expected" if shape
                   else f"holds a scalar where {rows} rows are expected")
    if problem:
        raise DataError(f"{os.fspath(path)} {problem}: {fix}")
    return shape


def _npy_problem(path: str) -> tuple[str | None, tuple[int, ...]]:
    """What is wrong with a .npy file (None: nothing), and the shape its header declares."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                return "is empty (0 bytes)", ()
            try:
                version = np.lib.format.read_magic(handle)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)  # 2.0, 3.0: same layout
                shape, _, dtype = read_header(handle)
            except ValueError:  # no magic string, a header cut short or garbled
                return "is not a .npy file (bad header: damaged or cut short)", ()
            expected = handle.tell() + math.prod(shape) * dtype.itemsize
    except FileNotFoundError:
        return "is missing", ()
    except OSError as error:
        return f"cannot be read ({error.strerror})", ()
    if not dtype.hasobject and size != expected:  # (an object array's size is not known)
        return (f"is {size} bytes, but its header (a {shape} {dtype} array) says {expected} "
                "(cut short or damaged)"), shape
    return None, shape


def load_npy(path, fix: str = "write it again", **options) -> np.ndarray:
    """np.load(path, **options), but a file it cannot read is a DataError naming the file and
    what is wrong with it (check_npy), not numpy's message without the file."""
    try:
        return np.load(path, **options)
    except (OSError, ValueError, EOFError) as error:
        check_npy(path, fix=fix)  # raises, saying what is wrong, for a missing or damaged file
        reason = " ".join(str(error).split())  # one line
        raise DataError(f"{os.fspath(path)} cannot be read ({reason}): {fix}") from None


def _indexable(rows) -> bool:
    """Whether a shard's reader gave rows to index (an IterableDataset inherits an indexing
    that fails: it is read in order)."""
    return (hasattr(rows, "__getitem__") and hasattr(rows, "__len__")
            and not isinstance(rows, IterableDataset))


def _count(rows) -> int:
    return len(rows) if hasattr(rows, "__len__") else sum(1 for _ in rows)


def _all_rows(rows) -> Iterable:
    return (rows[index] for index in range(len(rows))) if _indexable(rows) else rows


def as_stream(dataset: IterableDataset, name: str) -> ShardedStream:
    """A split the engine can plan: a ShardedStream as it is; any other IterableDataset as one
    shard read in full by every rank (correct, but each rank reads everything), if it has a
    length."""
    if isinstance(dataset, ShardedStream):
        return dataset
    try:
        count = len(dataset)
    except TypeError:
        raise UserError(f"the {name} split is an IterableDataset without a length: return a "
                        "streams.ShardedStream (its shards, a reader and the sample count of "
                        "each) so that every rank knows how many steps to take") from None
    return ShardedStream([dataset], _itself, [count], shuffle_window=1)


def _itself(dataset):
    return dataset


class EpochOrder:
    """Which sample (shard, row) sits at each position of an epoch."""

    def __init__(self, stream: ShardedStream, seed: int, epoch: int, shuffle: bool):
        self.stream, self.seed, self.epoch, self.shuffle = stream, seed, epoch, shuffle
        counts = stream.counts
        self.shard_order = (np.random.default_rng([seed, epoch]).permutation(len(counts))
                            if shuffle else np.arange(len(counts)))
        self.window = stream.shuffle_window if shuffle else 1
        starts = np.concatenate([[0], np.cumsum(counts[self.shard_order])])
        self.window_starts = np.append(starts[:-1][::self.window], starts[-1])

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self.window_starts, position, side="right")) - 1

    def window_samples(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of each position of a window, in order."""
        shards = self.shard_order[window * self.window:(window + 1) * self.window]
        counts = self.stream.counts[shards]
        shard_ids = np.repeat(shards, counts)
        rows = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        if self.shuffle:
            pick = np.random.default_rng([self.seed, self.epoch, window]).permutation(len(rows))
            shard_ids, rows = shard_ids[pick], rows[pick]
        return shard_ids, rows

    def sample_seed(self, position: int) -> int:
        return ((self.seed * 1_000_003 + self.epoch) * 2_147_483_647 + position) % 2**63


class TrainPlan:
    """Rank `rank`'s share of each training step (see the module's docstring)."""

    def __init__(self, samples: int, global_batch: int, world: int, rank: int,
                 micro_batches: int, drop_last: bool):
        self.samples, self.batch, self.world, self.rank = samples, global_batch, world, rank
        self.micro_batches = micro_batches
        full, remainder = divmod(samples, global_batch)
        self.steps = full + (1 if remainder and not drop_last else 0)
        self.limit = self.steps  # the steps an epoch reads (fewer: train.limit_train_batches)

    def step_range(self, step: int) -> tuple[int, int]:
        start = step * self.batch
        return start, min(start + self.batch, self.samples)

    def chunks(self, start_step: int) -> list[tuple[int, float, int, int]]:
        """(step, weight, first, end) of each of this rank's micro-batches from `start_step`."""
        return list(self.iter_chunks(start_step))

    def iter_chunks(self, start_step: int):
        """chunks(), made one step at a time: memory independent of the epoch's length."""
        for step in range(start_step, min(self.steps, self.limit)):
            yield from self.step_chunks(step)

    def count_chunks(self, start_step: int) -> int:
        """len(chunks(start_step)), without making them: every step but a last, smaller one
        has `micro_batches` of them (a rank's share of a full step is at least that many)."""
        end = min(self.steps, self.limit)
        if start_step >= end:
            return 0
        last = len(self.step_chunks(end - 1))
        return (end - 1 - start_step) * self.micro_batches + last

    def step_chunks(self, step: int) -> list[tuple[int, float, int, int]]:
        """This rank's micro-batches of one step."""
        first, end = self.step_range(step)
        size = end - first
        lo = first + self.rank * size // self.world
        hi = first + (self.rank + 1) * size // self.world
        weight = (hi - lo) * self.world / size  # 1.0 exactly when the ranks' shares match
        if hi == lo:  # nothing left for this rank: the step's first sample, adding nothing
            return [(step, 0.0, first, first + 1)]
        mine, parts = hi - lo, self.micro_batches
        bounds = [lo + part * mine // parts for part in range(parts + 1)]
        return [(step, weight, a, b) for a, b in itertools.pairwise(bounds) if b > a]


class EvalPlan:
    """Rank `rank`'s contiguous block of an evaluated split, in batches."""

    def __init__(self, samples: int, batch: int, world: int, rank: int):
        self.samples, self.batch, self.world = samples, batch, world
        self.first = rank * samples // world
        self.end = (rank + 1) * samples // world

    def block_sizes(self) -> list[int]:
        n, world = self.samples, self.world
        return [(r + 1) * n // world - r * n // world for r in range(world)]

    def chunks(self, start_step: int = 0) -> list[tuple[int, float, int, int]]:
        return [(index, 1.0, lo, min(lo + self.batch, self.end))
                for index, lo in enumerate(range(self.first, self.end, self.batch))]


class RankStream(IterableDataset):
    """What one rank's DataLoader iterates: its micro-batches of a plan, each worker its turns.
    In evaluation, the batches of the split. In training, (epoch, step, weight, batch) from the
    epoch and step read from `control` (a tensor in shared memory, so that persistent workers
    see the values the rank set when an iteration starts) on, epoch after epoch without end:
    the workers read the next epoch's first batches while the loop ends this one."""

    def __init__(self, stream: ShardedStream, plan, seed: int, collate: Callable):
        self.stream, self.plan, self.seed, self.collate = stream, plan, seed, collate
        self.control = torch.zeros(2, dtype=torch.int64).share_memory_()  # epoch, first step

    def start(self, epoch: int, step: int) -> None:
        self.control[0], self.control[1] = epoch, step

    def __len__(self) -> int:
        if isinstance(self.plan, TrainPlan):
            return self.plan.count_chunks(0)
        return len(self.plan.chunks())

    @property
    def block_sizes(self):
        return self.plan.block_sizes() if isinstance(self.plan, EvalPlan) else None

    def __iter__(self):
        epoch, first_step = self.control.tolist()
        worker = get_worker_info()
        index, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        if not isinstance(self.plan, TrainPlan):
            mine = self.plan.chunks()[index::workers]
            for _, _, samples in self._read(None, mine):
                yield self.collate(samples)
            return
        dealt = 0  # micro-batches of the earlier epochs: the loader deals all of them in turn
        while True:
            mine = itertools.islice(self.plan.iter_chunks(first_step),
                                    (index - dealt) % workers, None, workers)
            for step, weight, samples in self._read(epoch, mine):
                yield epoch, step, weight, self.collate(samples)
            dealt += self.plan.count_chunks(first_step)
            epoch, first_step = epoch + 1, 0

    def _read(self, epoch: int | None, chunks):
        """(step, weight, samples) of each chunk: of `epoch`'s order in training, of the split's
        own order (None) in evaluation; a SampledStream draws them."""
        if isinstance(self.stream, SampledStream):
            return ((step, weight, self.stream.draw(self.seed, epoch, first, end))
                    for step, weight, first, end in chunks)
        order = EpochOrder(self.stream, self.seed, epoch or 0, shuffle=epoch is not None)
        return read_chunks(self.stream, order, list(chunks))


def read_chunks(stream: ShardedStream, order: EpochOrder, chunks: list):
    """The samples of each chunk (step, weight, first, end), reading each window of shards once
    for all the chunks that need it: memory holds this worker's samples of a window or two."""
    held: dict[int, object] = {}  # position -> sample, read ahead of its chunk
    loaded = -1  # the last window read
    for index, (step, weight, first, end) in enumerate(chunks):
        while order.window_of(end - 1) > loaded:
            loaded += 1
            held.update(_read_window(stream, order, loaded, chunks[index:]))
        samples = [held.pop(position) for position in range(first, end)]
        if stream.transform is not None:
            with torch.random.fork_rng(devices=[]):  # the rank's own generator is left as it was
                for offset, position in enumerate(range(first, end)):
                    torch.manual_seed(order.sample_seed(position))
                    samples[offset] = stream.transform(samples[offset])
        yield step, weight, samples


def _read_window(stream: ShardedStream, order: EpochOrder, window: int, chunks: list) -> dict:
    """This worker's samples of one window (the positions of `chunks` inside it)."""
    start, stop = order.window_starts[window], order.window_starts[window + 1]
    wanted = []
    for _, _, first, end in chunks:
        if first >= stop:
            break
        wanted.extend(range(max(first, start), min(end, stop)))
    if not wanted:
        return {}
    shard_ids, rows = order.window_samples(window)
    local = np.asarray(wanted) - start
    samples = {}
    for shard in np.unique(shard_ids[local]):
        mine = local[shard_ids[local] == shard]
        by_row = _read_rows(stream, int(shard), rows[mine])
        for position, row in zip(mine + start, rows[mine], strict=True):
            samples[int(position)] = by_row[int(row)]
    return samples


def _read_rows(stream: ShardedStream, shard: int, rows: np.ndarray) -> dict:
    """{row: sample} of the given rows of one shard."""
    data = stream.read(stream.shards[shard])
    expected = int(stream.counts[shard])
    if _indexable(data):
        if len(data) != expected:
            raise _miscounted(stream, shard, len(data))
        return {int(row): data[int(row)] for row in rows}
    wanted, last, found = set(rows.tolist()), int(rows.max()), {}
    seen = 0
    for seen, sample in enumerate(data, start=1):
        if seen - 1 in wanted:
            found[seen - 1] = sample
        if seen - 1 == last:
            break
    if len(found) < len(wanted):
        raise _miscounted(stream, shard, seen)
    return found


def _miscounted(stream: ShardedStream, shard: int, found: int) -> UserError:
    # DataError: raised in a loader worker, it is one line too
    if stream.read is _itself:  # as_stream's one shard: the user's IterableDataset
        return DataError(f"{type(stream.shards[0]).__name__} yielded {found} samples in a loader "
                         f"worker but its len() is {int(stream.counts[0])}: yield every sample in "
                         "every process and worker (the engine splits the stream; do not split "
                         "it by get_worker_info() yourself)")
    return DataError(f"shard {stream.shards[shard]!r} holds {found} samples but its "
                     f"ShardedStream counts {int(stream.counts[shard])}: fix the counts given "
                     "for it")
