"""A checkpoint's files on disk: their layout, finding a run's checkpoints, the manifest every
checkpoint carries, checking a checkpoint against it before it is read, and holding a checkpoint
being read so that pruning leaves it.

A run folder given where a checkpoint is expected means its newest intact checkpoint: damaged
ones (a file missing, or differing from the manifest) are skipped with one line each; one named
directly is refused in one line.

The layout:

  checkpoints/step-00000200/       one checkpoint: a folder, renamed into place once complete
      .metadata, __<rank>_0.distcp   the model and the optimizer, written by every rank through
                                     torch.distributed.checkpoint (DCP): with FSDP each rank its
                                     own shards, with DDP each rank a share of the (replicated)
                                     tensors. DCP loads them at any process count and strategy.
      state.pt                       the rest, small (position, LR schedule, loss scaler, training
                                     statistics, every rank's random generators, the config, the
                                     parts a reader must understand: `requires`), written by
                                     rank 0
      manifest.json                  every file's size and checksum, written last by rank 0:
                                     verified before a checkpoint is read
  model.pt                         the final weights in one file (export.py makes one from any
                                   checkpoint): what evaluate.py and a shipped model need
"""

import contextlib
import fcntl
import json
import logging
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from ddpkit import dist_utils
from ddpkit.config import UserError
from ddpkit.writes import write_whole

log = logging.getLogger("ddp")


# Saved by every rank through DCP (the averaged weights only when a run keeps them); the rest
# in state.pt.
SHARDED_PARTS = ("model", "optimizer", "ema")


# The checkpoint format, recorded in state.pt as `format_version`, beside `template_version` (the
# template release that wrote it, ddpkit.__version__); CHANGELOG.md lists each format and its
# change. 1 (no entry): written by release 1.0.0 or before, with or without a manifest; 2 (release
# 1.1.0): always with its manifest, and `requires` (REQUIRED_PARTS; none where a state.pt written
# before it has no such entry). checkpoint_load.migrate brings an older one up to this format.
FORMAT_VERSION = 2


# The oldest format a resume reads whole. Older still (PRE_RELEASE_FORMAT: a format-1 state.pt
# without a `plateau` entry, written before the optimizer and LR-schedule rewrite of template
# commit b37dc3c, before release 1.0.0): its weights load, its resume is refused in one line.
OLDEST_FORMAT = 1


PRE_RELEASE_FORMAT = 0


class RequiredPart(NamedTuple):
    release: str  # the template release that first wrote it
    what: str  # what it holds, for the one line a reader says about it
    setting: str  # the setting that makes a run keep it (a run without it drops it)


# The parts beyond the model and the optimizer that a reader must understand, since one that
# does not would drop them without a word (release 1.0.0 resumes a checkpoint of averaged weights
# without them). A checkpoint names those it holds in its state.pt's `requires`, each with the
# release that first wrote it, and a reader whose engine does not know one refuses the
# checkpoint in one line (checkpoint_load.check_requires). A part added by a later release goes
# here; the format version changes only when a reader must migrate what it reads.
REQUIRED_PARTS = {
    "ema": RequiredPart("1.1.0", "the averaged weights", "train.ema_decay"),
    "guard": RequiredPart("1.1.0", "the step guard's recent losses", "guard.enabled"),
}


def requirements(parts: dict) -> dict[str, str]:
    """A checkpoint's `requires`: each part of REQUIRED_PARTS it holds, with its release."""
    return {name: part.release for name, part in REQUIRED_PARTS.items()
            if parts.get(name) is not None}


STATE_FILE = "state.pt"


MANIFEST_FILE = "manifest.json"


MODEL_FILE = "model.pt"  # the run's final model, in one file


EXPORT_FORMAT = "model export"  # the `format` entry of a one-file export


def is_checkpoint(path: Path) -> bool:
    return (Path(path) / STATE_FILE).is_file()


def looks_like_checkpoint(path: Path) -> bool:
    """A folder that is a checkpoint, whole or damaged: a step-N folder, or one with the
    files only a checkpoint has (a run folder has none of them)."""
    path = Path(path)
    return path.name.startswith("step-") or any(
        (path / name).exists() for name in (STATE_FILE, MANIFEST_FILE, ".metadata"))


def list_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints of a run's checkpoints/ folder, oldest first. A checkpoint is
    written in a hidden temporary folder renamed to step-N only when every rank's part is on
    disk, so a write cut short by a crash is never among them."""
    return sorted(path for path in Path(folder).glob("step-*") if path.is_dir())


def find_checkpoint(spec: str) -> Path:
    """A checkpoint folder or a model file as given, verified; or the newest intact checkpoint
    of a run folder. Either is held (`hold`): pruning leaves it while this process lives."""
    path = Path(spec)
    if path.is_dir() and not looks_like_checkpoint(path):
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        return newest_intact(folder, "reading")
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if path.is_dir():
        if not hold(path):
            raise Vanished(path)
        verified(path)
    return path


def newest_run(output_dir: Path) -> Path | None:
    """The run folder under `output_dir` whose latest checkpoint was written last."""
    written = {}
    for run in Path(output_dir).glob("*/checkpoints"):
        with contextlib.suppress(OSError, IndexError):  # pruned while it is looked at
            written[run.parent] = list_checkpoints(run)[-1].stat().st_mtime
    return max(written, key=written.get) if written else None


def checkpoint_to_resume(cfg: DictConfig, run_dir: Path) -> Path | None:
    """Rank 0: train.resume: auto -> this run's newest intact checkpoint (None for a new run);
    never -> None; anything else -> that checkpoint, verified, or that run folder's newest intact
    one. Once this run has checkpoints of its own (a torchrun restart), they win over both."""
    if cfg.train.resume == "never":
        return None
    if list_checkpoints(run_dir / "checkpoints") or cfg.train.resume == "auto":
        return newest_intact(run_dir / "checkpoints", "resuming from", none_ok=True)
    if not Path(cfg.train.resume).exists():
        raise UserError(f"train.resume={cfg.train.resume}: no such checkpoint or run folder")
    path = find_checkpoint(cfg.train.resume)
    if not is_checkpoint(path):
        raise UserError(f"train.resume={cfg.train.resume} is not a checkpoint folder (a model "
                        "file holds weights only): give a run folder or its checkpoints/step-<N>")
    return path


def chosen_by_rank_0(choose: Callable[[], Path | None]) -> Path | None:
    """The checkpoint `choose()` returns on rank 0 (there verified and held), the same on every
    rank (collective): one process reads the checksums, and a mistake is one line."""
    with dist_utils.agree_on_errors():
        chosen = choose() if dist_utils.is_rank_0() else None  # each replica group's too
    chosen = dist_utils.broadcast_object(str(chosen) if chosen else None)
    return Path(chosen) if chosen else None


class Damaged(UserError):
    """A checkpoint file that is missing, or differs from its manifest."""

    def __init__(self, path: Path, file: str, why: str):
        self.path, self.file, self.why = path, file, why
        state = "is missing" if why == "missing" else f"is damaged ({why})"
        super().__init__(
            f"cannot load checkpoint {path}: {file} {state}: give an earlier "
            "checkpoint of the run, or its run folder to use the newest intact one, or copy "
            "this one again from where it came from")


class Vanished(UserError):
    """A checkpoint deleted while it was being opened (pruned by the training that wrote it)."""

    def __init__(self, path: Path):
        super().__init__(f"cannot load checkpoint {path}: it was deleted while it was being "
                         "opened (pruned by the training that wrote it?): give its run folder")


def _crc32(file: Path) -> int:
    # crc32, not sha256: the manifest is there to catch damage (a bad disk, a cut copy), not
    # tampering (loading is safe anyway), and zlib's crc32 reads a checkpoint several times faster.
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: Path) -> None:
    """manifest.json: every file of a complete checkpoint folder, its size and checksum; written
    last (temporary file, flushed, renamed), so a folder with one holds everything it names."""
    files = {file.name: {"bytes": file.stat().st_size, "crc32": _crc32(file)}
             for file in sorted(Path(folder).iterdir()) if file.is_file()}
    write_whole(Path(folder) / MANIFEST_FILE,
                lambda path: path.write_text(json.dumps({"files": files}, indent=1)),
                report=False)


# Deprecated, removed in release 2.0.0 (CHANGELOG.md): a checkpoint without a manifest (format 1,
# from a run that wrote none) loads unverified, the `return False` of verified() and all of
# _had_a_manifest; from 2.0.0 on a checkpoint without one is Damaged.
def verified(path: Path) -> bool:
    """Whether a checkpoint folder matches its manifest: True; False (and one line) when it has
    none and was saved by an older version that wrote none; Damaged names the first file that
    is missing or differs (the manifest too, where one was written); Vanished when the folder
    itself is gone."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST_FILE).read_text())["files"]
        expected = {name: (int(entry["bytes"]), int(entry["crc32"]))
                    for name, entry in files.items()}
    except FileNotFoundError:
        if not path.is_dir():
            raise Vanished(path) from None
        if _had_a_manifest(path):
            raise Damaged(path, MANIFEST_FILE, "missing") from None
        log.warning("%s has no %s (saved by an older version): it could not be verified",
                    path, MANIFEST_FILE)
        return False
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        raise Damaged(path, MANIFEST_FILE, "unreadable") from None
    for name, (size, _) in expected.items():  # sizes first: a cut copy shows at once
        if (found := _measure(path, name, lambda file: file.stat().st_size)) != size:
            raise Damaged(path, name, f"{found} bytes, {size} in its manifest")
    for name, (_, crc) in expected.items():
        if _measure(path, name, _crc32) != crc:
            raise Damaged(path, name, "checksum differs")
    return True


def _had_a_manifest(path: Path) -> bool:
    """Whether a checkpoint without a manifest lost it: its state.pt is of a format that always
    has one, or another checkpoint of its run has one (its run writes them). Only a run of an
    older version, which never wrote one, may be read unverified."""
    if any((other / MANIFEST_FILE).is_file() for other in list_checkpoints(path.parent)):
        return True
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise Damaged(path, STATE_FILE, "missing") from None
    except Exception:  # truncated, foreign, or holding code: load_checkpoint says which
        return False
    return isinstance(state, dict) and state.get("format_version", 1) >= 2


def _measure(path: Path, name: str, measure) -> int:
    try:
        return measure(path / name)
    except FileNotFoundError:
        if not path.is_dir():
            raise Vanished(path) from None
        raise Damaged(path, name, "missing") from None


_held: dict[Path, object] = {}  # checkpoint -> its open state.pt, share-locked


def hold(path: Path) -> bool:
    """A shared lock on a checkpoint (its state.pt) until release() or the end of this process:
    prune_checkpoints leaves a held checkpoint for a later save, so evaluate.py and export.py
    read a whole one while training prunes. False when it was deleted before the lock; Damaged
    when its folder is there without a state.pt."""
    path = Path(path)
    if path in _held:
        return True
    try:
        handle = open(path / STATE_FILE, "rb")  # noqa: SIM115 (kept open: the lock lasts with it)
    except FileNotFoundError:
        if path.is_dir():  # the folder is there without its state.pt: damaged, not pruned
            raise Damaged(path, STATE_FILE, "missing") from None
        return False
    with contextlib.suppress(OSError):  # a file system without locks: read it unprotected
        fcntl.flock(handle, fcntl.LOCK_SH)  # waits while a pruner deletes it
    try:
        still_there = os.path.samestat(os.fstat(handle.fileno()), os.stat(path / STATE_FILE))
    except FileNotFoundError:
        still_there = False
    if not still_there:
        handle.close()
        return False
    _held[path] = handle
    return True


def release(path: Path) -> None:
    if (handle := _held.pop(Path(path), None)) is not None:
        handle.close()


def newest_intact(folder: Path, purpose: str, none_ok: bool = False, tries: int = 5) -> Path | None:
    """The newest checkpoint in `folder` that matches its manifest, held (`hold`). Damaged ones
    are skipped, with one line naming each and why; one deleted while it was opened (pruned by
    the training that wrote it) gives way to the then newest, `tries` times at most."""
    skipped: dict[str, str] = {}
    for _ in range(tries):
        candidates = [path for path in reversed(list_checkpoints(folder))
                      if path.name not in skipped]
        try:
            chosen = next((path for path in candidates if _intact(path, skipped)), None)
        except Vanished as gone:
            log.warning("%s; taking the then newest checkpoint", gone)
            continue
        if skipped:
            damaged = "; ".join(f"{name} is damaged ({why})" for name, why in skipped.items())
            if chosen is None:
                raise UserError(f"no intact checkpoint in {folder}: {damaged}; copy the run "
                                "again from where it came from, or train anew in another folder")
            log.warning("%s; %s %s", damaged, purpose, chosen.name)
        if chosen is None and not none_ok:
            raise UserError(f"no checkpoint in {folder}: expected {folder}/step-<N>/")
        return chosen
    raise UserError(f"the checkpoints in {folder} were deleted as fast as they were opened, "
                    f"{tries} times: is something pruning them all?")


def _intact(path: Path, skipped: dict) -> bool:
    """Held and verified (or without a manifest); a damaged one is noted in `skipped`."""
    try:
        if not hold(path):
            raise Vanished(path)
        verified(path)
    except Damaged as damaged:
        release(path)
        skipped[path.name] = f"{damaged.file}: {damaged.why}"
        return False
    except Vanished:
        release(path)
        raise
    return True
