"""Run folders and checkpoints: where a run lives, what a checkpoint holds, how a run resumes.

- The run folder is chosen by rank 0 and shared with the other ranks (one folder per job, never
  one per process): `run.dir`, or the folder of this torchrun job (found again by the run id
  torchrun gives every attempt of a job), or a new timestamped one.
- A checkpoint holds everything training needs to continue exactly: the model (keys without
  `module.` / `_orig_mod.`), optimizer, LR schedule, loss scaler, the running training
  statistics, the position (step, epoch, step within it), every rank's random generators and the
  config. Every rank writes its part (torch.distributed.checkpoint), into a hidden folder renamed
  into place when all parts are on disk; the newest `train.keep_checkpoints` are kept, and the
  best validation's (train.keep_best, ddpkit/validation.py) beside them. It loads at
  any process count, with either strategy (DDP or FSDP). With train.checkpoint_async=true the
  ranks train on while a background thread writes.
- Loading is safe (tensors and plain data, never code: `weights_only=True`, and DCP's metadata
  read by an unpickler that allows its own classes only), and every mistake (a missing,
  truncated or foreign checkpoint, a model of another shape) is one line. Every checkpoint's
  files are checked against its manifest first; a run folder means its newest intact one.
- model.pt, written at the end of training (export.py makes one from any checkpoint), is the
  whole model in one file: what evaluate.py loads as well as a checkpoint, and what you ship.
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import pickle
import random
import shutil
import socket
import time
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, staging
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ddpkit import dist_utils
from ddpkit.config import UserError
from ddpkit.dist_utils import DistEnv

log = logging.getLogger("ddp")

JOB_ID_FILE = ".job_id"  # the id of the job that made the folder: a requeue finds it by this
LOCK_FILE = ".lock"  # held by the job training in the folder; names its host and pid
_held_locks: list = []  # open lock files: the lock lasts as long as the process


def job_id() -> str:
    """The id a restarted or requeued job keeps: run.sh's DDP_JOB_ID (RDZV_ID, else the SLURM
    job id), else the torchrun run id (the same for every restart of one torchrun)."""
    return os.environ.get("DDP_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")


def lock_run_dir(path: Path, name: str = LOCK_FILE) -> None:
    """Rank 0 takes the run folder for this job, or refuses with one line naming the holder.

    An flock: the kernel releases it when its process ends, however it ends, so a lock left by
    a killed job is free again; taking it over from another job says so once.
    """
    lock = path / name
    existed = lock.exists()
    try:
        handle = open(lock, "a+")  # noqa: SIM115 (kept open: the lock lasts with it)
    except OSError as error:
        raise UserError(write_failure(error, lock)) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        handle.seek(0)
        holder = _read_holder(handle.read())
        handle.close()
        raise UserError(f"run folder {path} is in use by another job (host {holder.get('host')}, "
                        f"pid {holder.get('pid')}): wait for it to end, or use another run.dir"
                        ) from None
    handle.seek(0)
    previous = _read_holder(handle.read())
    if previous and previous.get("job") != job_id():
        log.warning("took over run folder %s from host %s, pid %s, which is no longer running",
                    path, previous.get("host"), previous.get("pid"))
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "job": job_id()}))
        handle.flush()
    except OSError as error:  # a full disk: no lock file of this launch's left behind
        with contextlib.suppress(OSError):
            handle.close()
        if not existed:
            lock.unlink(missing_ok=True)
        raise UserError(write_failure(error, lock)) from None
    _held_locks.append(handle)


def _read_holder(text: str) -> dict:
    with contextlib.suppress(ValueError):
        return json.loads(text)
    return {}
MODEL_PREFIXES = ("module.", "_orig_mod.")  # added by DDP and by torch.compile


# --- the run folder ------------------------------------------------------------------------------

@dataclass
class RunDir:
    path: Path
    created: bool  # by this job: removed again if the job fails before it writes anything

    def discard_if_unused(self) -> None:
        """Rank 0, after a failure before training started: remove a folder this job created
        and left empty (but for the run id marker), so failed launches leave no litter."""
        if not (self.created and dist_utils.is_main_process() and self.path.is_dir()):
            return
        markers = [p for p in self.path.iterdir()
                   if p.name == JOB_ID_FILE or p.name.startswith(LOCK_FILE)]
        if len(markers) == len(list(self.path.iterdir())):
            for marker in markers:
                marker.unlink(missing_ok=True)
            self.path.rmdir()


def _create_run_dir(cfg: DictConfig) -> RunDir:
    if cfg.run.dir:
        path = Path(cfg.run.dir)
        if cfg.train.resume == "never" and (path / "config.yaml").exists():
            raise UserError(f"run.dir={path} already holds a run and train.resume=never: pick a "
                            "new folder, delete it, or resume it with train.resume=auto")
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        return RunDir(path, created)
    output_dir = Path(cfg.run.output_dir)
    run_id = job_id()
    if run_id and cfg.train.resume != "never":
        for marker in output_dir.glob(f"*/{JOB_ID_FILE}"):
            if marker.read_text() == run_id:
                return RunDir(marker.parent, created=False)
    base = output_dir / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    new_output_dir = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):  # another run may have started in the same second
        path = base.with_name(f"{base.name}-{attempt}") if attempt else base
        try:
            path.mkdir()
            if run_id:
                (path / JOB_ID_FILE).write_text(run_id)
        except FileExistsError:
            continue
        except OSError as error:  # a full disk: the folders this made are removed again
            shutil.rmtree(path, ignore_errors=True)
            if new_output_dir:
                with contextlib.suppress(OSError):
                    output_dir.rmdir()
            raise OSError(error.errno, error.strerror, str(path)) from None
        return RunDir(path, created=True)
    raise UserError(f"cannot create a new run folder next to {base}: too many exist")


def _replica_run_dir(cfg: DictConfig) -> RunDir:
    """Replica groups share one run folder, named by the job id they share (run.dir if set), so
    that groups starting at once find the same one without asking each other."""
    if cfg.run.dir:
        path = Path(cfg.run.dir)
    elif os.environ.get("DDP_JOB_ID"):  # run.sh's: RDZV_ID or the SLURM job id
        path = Path(cfg.run.output_dir) / f"{cfg.run.name}-{os.environ['DDP_JOB_ID']}"
    else:
        raise UserError("replica groups need a job id to share their run folder: set RDZV_ID "
                        "(run_replicas.sh sets one), or give run.dir")
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    return RunDir(path, created)


def open_run_dir(cfg: DictConfig, env: DistEnv, group: int | None = None) -> RunDir:
    """The run folder, created (or found again) and locked by rank 0, the same on every rank
    (collective). With replica groups, each group's rank 0 opens the shared folder and locks
    its group's part of it."""
    with dist_utils.agree_on_errors():
        opens = env.rank == 0 if group is not None else env.is_main
        run = _open_and_lock(cfg, group) if opens else None
    path, created = dist_utils.broadcast_object((str(run.path), run.created) if run else None)
    return RunDir(Path(path), created)


def _open_and_lock(cfg: DictConfig, group: int | None) -> RunDir:
    """Rank 0's part of open_run_dir: a folder it cannot create or lock (a full disk, say) is
    one line, and a folder this launch created is removed again."""
    try:
        run = _replica_run_dir(cfg) if group is not None else _create_run_dir(cfg)
    except OSError as error:
        where = Path(error.filename or cfg.run.dir or cfg.run.output_dir)
        raise UserError(write_failure(error, where)) from None
    try:
        lock_run_dir(run.path, LOCK_FILE if group is None else f"{LOCK_FILE}-group-{group}")
    except UserError:
        run.discard_if_unused()
        raise
    return run


# --- the checkpoint format ----------------------------------------------------------------------
#
#   checkpoints/step-00000200/       one checkpoint: a folder, renamed into place once complete
#       .metadata, __<rank>_0.distcp   the model and the optimizer, written by every rank through
#                                      torch.distributed.checkpoint (DCP): with FSDP each rank its
#                                      own shards, with DDP each rank a share of the (replicated)
#                                      tensors. DCP loads them at any process count and strategy.
#       state.pt                       the rest, small (position, LR schedule, loss scaler, training
#                                      statistics, every rank's random generators, the config),
#                                      written by rank 0
#       manifest.json                  every file's size and checksum, written last by rank 0:
#                                      verified before a checkpoint is read
#   model.pt                         the final weights in one file (export.py makes one from any
#                                    checkpoint): what evaluate.py and a shipped model need

SHARDED_PARTS = ("model", "optimizer")  # saved by every rank through DCP; the rest in state.pt
# The checkpoint format, recorded in state.pt as `format_version`. 1 (no entry): written before
# the version was recorded, with or without a manifest; 2: always with its manifest.
FORMAT_VERSION = 2
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.pt"  # the run's final model, in one file
EXPORT_FORMAT = "model export"  # the `format` entry of a one-file export


# --- finding checkpoints -------------------------------------------------------------------------

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


# --- verifying and holding checkpoints -----------------------------------------------------------

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
    tmp = Path(folder) / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, Path(folder) / MANIFEST_FILE)


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


# --- saving --------------------------------------------------------------------------------------

@dataclass
class Position:
    """Where training is: optimizer steps done, the epoch, and the steps done within it."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


def clean_state_dict(state_dict: dict) -> dict:
    """Keys without DDP's `module.` or torch.compile's `_orig_mod.`, so any wrapping loads them."""
    cleaned = {}
    for key, value in state_dict.items():
        while key.startswith(MODEL_PREFIXES):
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned


def rng_state() -> dict:
    """This process's random number generators, as tensors and plain data (weights_only-safe)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, python_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "internal": list(internal), "gauss": python_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # make a rename in it durable
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_atomically(state: dict, path: Path) -> None:
    """torch.save into a temporary file in the same folder, flushed to disk, then renamed over
    `path`: a reader (or a restarted job) sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            try:
                torch.save(state, handle)
            except RuntimeError as error:  # the zip writer's complaint about a failed write
                if isinstance(error.__context__, OSError):
                    raise error.__context__ from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """A small file written whole (temporary file, renamed), or one line saying why not."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise UserError(write_failure(error, path)) from None


def tensor_bytes(value) -> int:
    """The bytes of every tensor in a (nested) state: about what saving it writes."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()  # a DTensor: the whole tensor's
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def write_failure(error: OSError, path: Path, needed: int | None = None,
                  free: int | None = None) -> str:
    """One line for a failed write: what, why, and for a full disk the space there (`free`, as
    measured when the write failed, before its partial files were removed) and needed."""
    folder = path.parent
    message = f"cannot write {path}: {error.strerror or error}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        if free is None:
            free = shutil.disk_usage(folder).free if folder.exists() else 0
        need = f", about {needed / 1e6:.1f} MB needed" if needed else ""
        message += (f" ({free / 1e6:.1f} MB free in {folder}{need}); free space there or set "
                    "run.output_dir / run.dir to a larger disk, then rerun to resume")
    return message


def _cause(error: BaseException, kind: type = OSError):
    """The exception of `kind` behind a failure (DCP wraps each rank's exception in a
    CheckpointException), if there is one."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if id(current) in seen or current is None:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        stack += [current.__cause__, current.__context__]
        for failure in getattr(current, "failures", {}).values():  # CheckpointException
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def reused_staging_buffers():
    """DCP's stager for asynchronous saves that keeps its CPU copies of the state from one save
    to the next: a save then copies into memory already there instead of allocating (and
    faulting in) a fresh copy of the model and optimizer each time, which on CPU costs several
    times the copy itself. Pinned memory when there is a GPU. One save in flight at most: the
    next save overwrites the buffers (Checkpointer.save waits for the write first). None on a
    torch without DefaultStager: async_save's own staging then copies afresh each time."""
    if not hasattr(staging, "DefaultStager"):
        return None
    gpu = torch.cuda.is_available()
    return staging.DefaultStager(staging.StagingOptions(
        use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=False,
        use_non_blocking_copy=False))


def refuse_non_finite(model_state: dict, step: int, folder: Path) -> None:
    """A UserError on every rank if any rank's part of the weights holds NaN or inf (collective):
    such a checkpoint would be resumed from and diverge again, while the one before is still
    good. One wait for the device in all (a GPU): every tensor's verdict is read at once."""
    with dist_utils.agree_on_errors():
        _refuse_non_finite_part(model_state, step, folder)


def _refuse_non_finite_part(model_state: dict, step: int, folder: Path) -> None:
    tensors = {name: value.to_local() if hasattr(value, "to_local") else value
               for name, value in model_state.items() if isinstance(value, torch.Tensor)}
    tensors = {name: value for name, value in tensors.items() if value.is_floating_point()}
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(value).all() for value in tensors.values()]).tolist()
    if all(finite):
        return
    name = next(name for name, ok in zip(tensors, finite, strict=True) if not ok)
    saved = list_checkpoints(folder)
    kept = (f"the newest, {saved[-1].name}, stays the one to resume from" if saved
            else "there is none before it")
    raise UserError(
        f"training diverged: the weights hold NaN or inf at step {step} ({name}), so no "
        f"checkpoint was saved ({kept}); lower optim.lr, set optim.grad_clip (e.g. 1.0) or use "
        "speed.precision=bf16 or fp32")


class Checkpointer:
    """Writes the checkpoints of a run (collective: every rank calls save and wait).

    save() stages the state and writes it: synchronously (every rank returns once the
    checkpoint is on disk), or with train.checkpoint_async=true in a background thread, so the
    ranks go back to training as soon as the state is copied, with one write in flight at most.
    wait() returns once the write in flight is on disk: before the next save, on preemption and
    at the end of training. A write that fails (a full disk, say) stops every rank with one line
    at the save or the wait that sees it; the checkpoints written before stay as they were.
    """

    def __init__(self, run_dir: Path, cfg: DictConfig, env: DistEnv):
        self.folder = run_dir / "checkpoints"
        self.keep = cfg.train.keep_checkpoints
        self.every = cfg.train.ckpt_every  # a checkpoint every that many steps (0: only the end)
        self.last_saved = -1  # the step of the last checkpoint saved (or resumed): -1 for none
        self.best: str | None = None  # the best validation's checkpoint (its name): never pruned
        self.env = env
        self.asynchronous = bool(cfg.train.checkpoint_async)
        # The background write coordinates the ranks through collectives of its own: on a gloo
        # group of its own, they never meet the training's collectives.
        self.group = (dist.new_group(backend="gloo") if self.asynchronous
                      and dist.is_initialized() else None)
        self.stager = reused_staging_buffers() if self.asynchronous else None
        self.pending: Future | None = None  # done when the write in flight is renamed into place
        self.pending_path: Path | None = None
        self.pending_bytes = 0
        self.free_at_failure: int | None = None  # disk space when the last write failed

    def due(self, step: int) -> bool:
        """Whether a periodic checkpoint is due after optimizer step `step`."""
        return bool(self.every) and step % self.every == 0

    def save(self, parts: dict, position: Position, cfg: DictConfig) -> None:
        """A checkpoint of `parts` (name -> object with state_dict(), or None) from which
        training continues exactly."""
        self.wait()
        self.last_saved, env = position.step, self.env
        rngs = dist_utils.gather_objects(rng_state())  # each rank's generators
        small = {name: part.state_dict() if part is not None else None
                 for name, part in parts.items() if name not in SHARDED_PARTS}
        small.update(format_version=FORMAT_VERSION, step=position.step, epoch=position.epoch,
                     step_in_epoch=position.step_in_epoch, world_size=env.world_size, rng=rngs,
                     config=OmegaConf.to_container(cfg))
        sharded = {name: parts[name].state_dict() for name in SHARDED_PARTS}
        path = self.folder / f"step-{position.step:08d}"
        tmp = self.folder / f".{path.name}.tmp"
        refuse_non_finite(sharded["model"], position.step, self.folder)
        self.pending_path, self.pending_bytes = path, tensor_bytes(sharded) + tensor_bytes(small)
        self.free_at_failure = None
        with dist_utils.agree_on_errors():  # also a barrier: nobody writes into tmp before this
            if env.is_main:
                self._start_folder(tmp, small)
        writer = FileSystemWriter(tmp)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(single process|TypedStorage).*")
            if not self.asynchronous:
                done: Future = Future()
                try:
                    dcp.save(sharded, storage_writer=writer, no_dist=not dist.is_initialized())
                    self._finish(tmp, path)
                    done.set_result(None)
                except (Exception, CheckpointException) as error:  # reported by wait()
                    self._discard(tmp)
                    done.set_exception(error)
                self.pending = done
                self.wait()
                return
            # No no_dist: the save() that async_save runs detects a single process itself, and
            # async_save's own no_dist may be newer than the torch floor (2.9, for async_stager).
            upload = dcp.async_save(sharded, storage_writer=writer, process_group=self.group,
                                    async_stager=self.stager)
        if isinstance(upload, AsyncSaveResponse):
            upload = upload.upload_completion
        done = Future()

        def finish(upload: Future) -> None:  # the writer thread, once every rank has written
            try:
                upload.result()
                self._finish(tmp, path)
                done.set_result(None)
            except (Exception, CheckpointException) as error:  # reported by wait()
                self._discard(tmp)
                done.set_exception(error)

        upload.add_done_callback(finish)
        self.pending = done

    def _start_folder(self, tmp: Path, small: dict) -> None:
        """Rank 0: the checkpoint's temporary folder, with its state.pt."""
        try:
            if tmp.exists():  # left by a job killed while it wrote this checkpoint
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            write_atomically(small, tmp / STATE_FILE)
        except OSError as error:
            self._discard(tmp)
            raise UserError(self._write_failure(error)) from None

    def _finish(self, tmp: Path, path: Path) -> None:
        """Rank 0: the complete checkpoint renamed into place (atomic), older ones pruned."""
        if not self.env.is_main:
            return
        write_manifest(tmp)  # DCP's save returns on rank 0 once every rank's part is on disk
        if path.exists():  # a checkpoint of this step from an attempt that ended after it
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync_folder(self.folder)
        prune_checkpoints(self.folder, self.keep, self.best)

    def _discard(self, tmp: Path) -> None:
        """Rank 0: what a failed write left (a full disk gets its space back), the space free
        before that noted for the message."""
        if self.env.is_main:
            with contextlib.suppress(OSError):
                self.free_at_failure = shutil.disk_usage(self.folder).free
            shutil.rmtree(tmp, ignore_errors=True)

    def _write_failure(self, error: OSError) -> str:
        return write_failure(error, self.pending_path, self.pending_bytes, self.free_at_failure)

    def _full_disk(self) -> OSError | None:
        """A full disk, when a failed write does not say so itself: DCP passes each rank's
        exception on without its cause, and torch.save's zip writer reports a failed write as
        'unexpected pos'. The partial checkpoint is gone by now, so this is the space there was."""
        with contextlib.suppress(OSError):
            if shutil.disk_usage(self.folder).free < self.pending_bytes:
                return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return None

    def wait(self) -> None:
        """Until the write in flight (if any) is on disk; its failure, as one line everywhere."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with dist_utils.agree_on_errors():
            try:
                pending.result()
            except CheckpointException as error:  # DCP's: every rank has it
                # Rank 0's account of it, so that every rank reports the same line.
                cause = (_cause(error) or self._full_disk()) if self.env.is_main else None
                message = dist_utils.broadcast_object(
                    self._write_failure(cause) if cause else None)
                if message:
                    raise UserError(message) from None
                raise RuntimeError(f"writing {self.pending_path} failed: {one_line(error)}"
                                   ) from None
            except Exception as error:  # this rank's alone (rank 0 renaming, say)
                if (cause := _cause(error)) is not None:
                    raise UserError(self._write_failure(cause)) from None
                raise


def prune_checkpoints(folder: Path, keep: int, best: str | None = None) -> None:
    """Rank 0 deletes all but the newest `keep` checkpoints (keep=0: delete none) and the one
    named `best`, and any temporary file or folder a killed writer left behind."""
    if not dist_utils.is_main_process():
        return
    for leftover in Path(folder).glob(".step-*.tmp*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
    if keep:
        for old in list_checkpoints(folder)[:-keep]:
            if old.name != best:
                _remove_unless_held(old)


def _remove_unless_held(path: Path) -> None:
    """Delete a checkpoint, unless a reader holds it (hold): then a later save prunes it."""
    doomed = path.with_name(f".{path.name}.tmp-pruned")  # a leftover the next prune removes
    try:
        # r+: NFS takes an exclusive lock only on a file open for writing.
        with open(path / STATE_FILE, "r+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(path, doomed)  # under the lock: a reader waits, then finds it gone
        shutil.rmtree(doomed, ignore_errors=True)
        return
    except BlockingIOError:
        return
    except OSError:  # no state.pt, or a file system without locks
        pass
    shutil.rmtree(path, ignore_errors=True)


def export_model(model_state: dict, path: Path, step: int, cfg: DictConfig) -> None:
    """The whole model's weights in one file, with the config that builds the model: loads with
    torch.load(weights_only=True) into the bare model (rank 0 writes it)."""
    state = {"format": EXPORT_FORMAT, "model": clean_state_dict(model_state), "step": step,
             "config": OmegaConf.to_container(cfg)}
    try:
        write_atomically(state, path)
    except OSError as error:
        raise UserError(write_failure(error, Path(path), tensor_bytes(state))) from None


# --- loading -------------------------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this reads it without running code: only DCP's own metadata
    classes, torch's sizes, dtypes and layouts, and paths may appear in it."""

    def find_class(self, module: str, name: str):
        allowed = (module in ("torch.distributed.checkpoint.metadata",
                              "torch.distributed.checkpoint.filesystem")
                   or (module == "torch" and (name == "Size" or isinstance(
                       getattr(torch, name, None), torch.dtype | torch.layout
                       | torch.memory_format)))
                   or (module, name) == ("torch.serialization", "_get_layout")
                   or (module == "pathlib" and name in ("PosixPath", "PurePosixPath",
                                                         "WindowsPath", "PureWindowsPath")))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by _MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor values (optimizer hyperparameters) loaded as
    tensors and plain data only (weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        # Checked with weights_only (a pickle beyond plain data raises here), then handed to
        # DCP's own load_bytes, which puts the value back into the caller's nested state dict
        # (the learning rate and other hyperparameters of the optimizer's param_groups).
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def _read_metadata(path: Path) -> Metadata:
    try:
        return SafeReader(path).read_metadata()
    except FileNotFoundError:
        raise UserError(f"cannot load checkpoint {path}: its .metadata is missing (not a "
                        "complete checkpoint folder)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
        raise UserError(f"cannot load checkpoint {path}: its .metadata is damaged or holds "
                        f"Python objects beyond checkpoint metadata ({error})") from None


def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """A checkpoint's small state (its state.pt), or a model export's whole content; loaded
    safely (`weights_only=True`: tensors and plain data, never code)."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights_only" in str(error):
            raise UserError(
                f"refusing to load checkpoint {file}: it holds Python objects beyond tensors and "
                "plain data, which could run code when loaded; re-save it with state_dict()s only"
            ) from None
        raise UserError(f"cannot load checkpoint {file}: it is not a PyTorch checkpoint") from None
    except Exception:  # a truncated zip archive, or another kind of file
        raise UserError(
            f"cannot load checkpoint {file}: the file is truncated or not a PyTorch checkpoint"
        ) from None
    if not isinstance(state, dict) or ("model" not in state and "step" not in state):
        raise UserError(f"{file} is not a checkpoint of this project (no 'model' entry)")
    return state


def _check_keys(path: Path, metadata: Metadata, targets: dict) -> None:
    """One line when the checkpoint's tensors do not match the model's (DCP alone would load a
    subset silently, or fail with a page of detail)."""
    for name in ("model",):
        if name not in targets:
            continue
        saved = {key.split(".", 1)[1] for key in metadata.state_dict_metadata
                 if key.startswith(f"{name}.")}
        wanted = set(targets[name])
        missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
        if missing or unexpected:
            detail = "; ".join(part for part in (
                f"missing {', '.join(missing[:5])}" if missing else "",
                f"unexpected {', '.join(unexpected[:5])}" if unexpected else "") if part)
            raise UserError(f"checkpoint {path} does not fit the model: {detail}")


def read_sharded(path: Path, targets: dict, distributed: bool) -> None:
    """Fill `targets` (part name -> its state dict, in the layout of this run: plain tensors, or
    this rank's shards) from a checkpoint folder, in place. DCP reads what each rank needs,
    whatever the number of processes or the strategy that saved it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(targets, storage_reader=SafeReader(path), planner=SafeLoadPlanner(),
                     no_dist=not distributed)
    except (Exception, CheckpointException) as error:
        detail = " ".join(str(error).split())
        if _cause(error, pickle.UnpicklingError) is not None:
            raise UserError(f"refusing to load checkpoint {path}: it holds Python objects beyond "
                            "tensors and plain data, which could run code when loaded") from None
        if "size mismatch" in detail.lower():
            raise UserError(f"checkpoint {path} does not fit the model: a tensor's shape "
                            f"differs ({one_line(error)})") from None
        if (cause := _cause(error)) is not None:
            raise UserError(f"cannot load checkpoint {path}: {cause}") from None
        raise UserError(f"cannot load checkpoint {path}: reading its shards failed "
                        f"({one_line(error)}), so a file is likely truncated or damaged: copy it "
                        "again, or give an earlier checkpoint") from None


def one_line(error: BaseException) -> str:
    """A failure in one short line: the exception a rank raised inside DCP (not DCP's wrapper,
    whose text is every rank's traceback), its first sentence."""
    root = next(iter(getattr(error, "failures", {}).values()), error)
    root = root[0] if isinstance(root, tuple) else root
    text = " ".join(str(root).split()).split(". ")[0][:200]
    return f"{type(root).__name__}: {text}" if text else type(root).__name__


def read_tensors(path: Path, part: str = "model") -> dict:
    """One part's tensors in a checkpoint folder, whole, keyed by their flat names (the model's:
    parameter names; the optimizer's: `state.<parameter>.<name>`), read on this process alone
    with no model needed: what export.py writes, and what a test compares."""
    metadata = _read_metadata(path)
    prefix = f"{part}."
    tensors = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
               for key, entry in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    read_sharded(path, {part: tensors}, distributed=False)
    return tensors


def read_model(path: Path) -> dict:
    """The whole model's weights in a checkpoint folder, keyed by parameter name."""
    return read_tensors(path, "model")


def load_model_weights(model: torch.nn.Module, source: Path, state: dict) -> None:
    """A checkpoint's (or a model export's) weights into the bare model, on this process alone."""
    weights = read_model(source) if source.is_dir() else state["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # missing / unexpected keys, shape mismatch
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"checkpoint {source} does not fit the model: {detail}") from None


def restore(source: Path, parts: dict, env: DistEnv) -> Position:
    """Everything a checkpoint holds back into `parts` (name -> object with state_dict() and
    load_state_dict(), or None), on every rank (collective); returns the position."""
    state = load_checkpoint(source)
    targets = {name: parts[name].state_dict() for name in SHARDED_PARTS}
    _check_keys(source, _read_metadata(source), targets)
    read_sharded(source, targets, distributed=dist.is_initialized())
    try:
        for name, part in parts.items():
            if name in SHARDED_PARTS:
                part.load_state_dict(targets[name])
            elif part is not None and state.get(name) is not None:
                part.load_state_dict(state[name])
        position = Position(*(int(state[k]) for k in ("step", "epoch", "step_in_epoch")))
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot resume from {source}: its optimizer or position does not fit "
                        f"this run ({error})") from None
    if state.get("world_size") == env.world_size and "rng" in state:
        set_rng_state(state["rng"][env.rank])
    elif env.is_main:  # a restart at another size, by hand or by an elastic job
        log.warning("world %s -> %d at step %d: model, optimizer and data position carry over "
                    "(resharded; the global batch and the epoch's order stay), random streams "
                    "(dropout) start afresh", state.get("world_size", "?"), env.world_size,
                    position.step)
    return position
