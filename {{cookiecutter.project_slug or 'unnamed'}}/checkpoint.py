"""Run folders and checkpoints: where a run lives, what a checkpoint holds, how a run resumes.

- The run folder is chosen by rank 0 and shared with the other ranks (one folder per job, never
  one per process): `run.dir`, or the folder of this torchrun job (found again by the run id
  torchrun gives every attempt of a job), or a new timestamped one.
- A checkpoint holds everything training needs to continue exactly: the unwrapped model (keys
  without `module.` / `_orig_mod.`), optimizer, LR schedule, loss scaler, the running training
  statistics, the position (step, epoch, step within it), every rank's random generators and the
  config. Rank 0 writes it atomically (a temporary file renamed into place); the newest
  `train.keep_checkpoints` are kept.
- Loading is safe (`weights_only=True`: tensors and plain data, never code), and every mistake
  (a missing, truncated or foreign file, a model of another shape) is one line.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import dist_utils
from config import UserError
from dist_utils import DistEnv

log = logging.getLogger("ddp")

JOB_ID_FILE = ".job_id"  # the id of the job that made the folder: a requeue finds it by this
LOCK_FILE = ".lock"  # held by the job training in the folder; names its host and pid
_held_locks: list = []  # open lock files: the lock lasts as long as the process


def job_id() -> str:
    """The id a restarted or requeued job keeps: run.sh's DDP_JOB_ID (RDZV_ID, else the SLURM
    job id), else the torchrun run id (the same for every restart of one torchrun)."""
    return os.environ.get("DDP_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")


def lock_run_dir(path: Path) -> None:
    """Rank 0 takes the run folder for this job, or refuses with one line naming the holder.

    An flock: the kernel releases it when its process ends, however it ends, so a lock left by
    a killed job is free again; taking it over from another job says so once.
    """
    handle = open(path / LOCK_FILE, "a+")  # noqa: SIM115 (kept open: the lock lasts with it)
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
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": job_id()}))
    handle.flush()
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
        markers = {JOB_ID_FILE, LOCK_FILE}
        if {p.name for p in self.path.iterdir()} <= markers:
            for name in markers:
                (self.path / name).unlink(missing_ok=True)
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
    base.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1000):  # another run may have started in the same second
        path = base.with_name(f"{base.name}-{attempt}") if attempt else base
        try:
            path.mkdir()
        except FileExistsError:
            continue
        if run_id:
            (path / JOB_ID_FILE).write_text(run_id)
        return RunDir(path, created=True)
    raise UserError(f"cannot create a new run folder next to {base}: too many exist")


def open_run_dir(cfg: DictConfig, env: DistEnv) -> RunDir:
    """The run folder, created (or found again) and locked by rank 0, the same on every rank
    (collective)."""
    with dist_utils.agree_on_errors():
        run = _create_run_dir(cfg) if env.is_main else None
        if run:
            lock_run_dir(run.path)
    path, created = dist_utils.broadcast_object((str(run.path), run.created) if run else None)
    return RunDir(Path(path), created)


# --- finding checkpoints -------------------------------------------------------------------------

def list_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints of a run's checkpoints/ folder, oldest first. Only finished
    files are named step-*.pt (save_checkpoint renames them into place), so a write cut short
    by a crash is never among them."""
    return sorted(Path(folder).glob("step-*.pt"))  # zero-padded step numbers sort in order


def find_checkpoint(spec: str) -> Path:
    """A checkpoint file, or the latest `step-*.pt` of a run folder."""
    path = Path(spec)
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = list_checkpoints(folder)
        if not found:
            raise UserError(f"no checkpoint in {path}: expected {folder}/step-*.pt")
        return found[-1]
    return path


def newest_run(output_dir: Path) -> Path | None:
    """The run folder under `output_dir` whose latest checkpoint was written last."""
    latest = [found[-1] for run in Path(output_dir).glob("*/checkpoints")
              if (found := list_checkpoints(run))]
    return max(latest, key=lambda p: p.stat().st_mtime).parent.parent if latest else None


def checkpoint_to_resume(cfg: DictConfig, run_dir: Path) -> Path | None:
    """train.resume: auto -> this run's latest checkpoint (None for a new run); never -> None;
    anything else -> that checkpoint file, or that run folder's latest checkpoint. Once this run
    has checkpoints of its own (a torchrun restart), its latest one wins over both."""
    if cfg.train.resume == "never":
        return None
    found = list_checkpoints(run_dir / "checkpoints")
    if found or cfg.train.resume == "auto":
        return found[-1] if found else None
    path = find_checkpoint(cfg.train.resume)
    if not path.exists():
        raise UserError(f"train.resume={cfg.train.resume}: no such checkpoint file or run folder")
    return path


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
        with contextlib.suppress(OSError):  # make the rename itself durable
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state: dict, path: Path) -> None:
    """Write a checkpoint atomically, on rank 0 only; every rank returns once it is complete.
    A write that fails (a full disk, say) stops every rank with one line; the checkpoints
    written before stay as they were, and no partial file is left."""
    with dist_utils.agree_on_errors():  # also the barrier: every rank waits for the write
        if dist_utils.is_main_process():
            try:
                write_atomically(state, path)
            except OSError as error:
                raise UserError(write_failure(error, Path(path), tensor_bytes(state))) from None


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
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


def write_failure(error: OSError, path: Path, needed: int | None = None) -> str:
    """One line for a failed write: what, why, and for a full disk the space there and needed."""
    folder = path.parent
    message = f"cannot write {path}: {error.strerror or error}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        need = f", about {needed / 1e6:.1f} MB needed" if needed else ""
        message += (f" ({free / 1e6:.1f} MB free in {folder}{need}); free space there or set "
                    "run.output_dir / run.dir to a larger disk, then rerun to resume")
    return message


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Rank 0 deletes all but the newest `keep` checkpoints (keep=0: delete none), and any
    temporary file a killed writer left behind."""
    if not dist_utils.is_main_process():
        return
    for leftover in Path(folder).glob(".step-*.tmp-*"):
        leftover.unlink(missing_ok=True)
    if keep:
        for old in list_checkpoints(folder)[:-keep]:
            old.unlink(missing_ok=True)


def save(run_dir: Path, parts: dict, position: Position, cfg: DictConfig, env: DistEnv) -> None:
    """A checkpoint of `parts` (name -> object with state_dict(), or None) from which training
    continues exactly (collective: call on every rank)."""
    rngs = dist_utils.gather_objects(rng_state())  # each rank's generators
    state = {name: part.state_dict() if part is not None else None
             for name, part in parts.items()}
    state["model"] = clean_state_dict(state["model"])
    state.update(step=position.step, epoch=position.epoch, step_in_epoch=position.step_in_epoch,
                 world_size=env.world_size, rng=rngs, config=OmegaConf.to_container(cfg))
    folder = run_dir / "checkpoints"
    save_checkpoint(state, folder / f"step-{position.step:08d}.pt")
    prune_checkpoints(folder, cfg.train.keep_checkpoints)


# --- loading -------------------------------------------------------------------------------------

def load_checkpoint(path: Path, map_location="cpu") -> dict:
    """Load a checkpoint safely (`weights_only=True`: tensors and plain data, never code)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights_only" in str(error):
            raise UserError(
                f"refusing to load checkpoint {path}: it holds Python objects beyond tensors and "
                "plain data, which could run code when loaded; re-save it with state_dict()s only"
            ) from None
        raise UserError(f"cannot load checkpoint {path}: it is not a PyTorch checkpoint") from None
    except Exception:  # a truncated zip archive, or another kind of file
        raise UserError(
            f"cannot load checkpoint {path}: the file is truncated or not a PyTorch checkpoint"
        ) from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a checkpoint of this project (no 'model' entry)")
    return state


def restore_model_weights(model: torch.nn.Module, state: dict, source: Path) -> None:
    """The checkpoint's weights into the bare model (before DDP copies rank 0's everywhere)."""
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:  # missing / unexpected keys, shape mismatch
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"checkpoint {source} does not fit the model: {detail}") from None


def restore(state: dict, parts: dict, source: Path, env: DistEnv) -> Position:
    """Everything but the model weights back into `parts` (name -> object with
    load_state_dict(), or None); returns the position to continue from."""
    try:
        for name, part in parts.items():
            if name != "model" and part is not None and state.get(name) is not None:
                part.load_state_dict(state[name])
        position = Position(*(int(state[k]) for k in ("step", "epoch", "step_in_epoch")))
    except (KeyError, ValueError, TypeError) as error:
        raise UserError(f"cannot resume from {source}: its optimizer or position does not fit "
                        f"this run ({error})") from None
    if state.get("world_size") == env.world_size and "rng" in state:
        set_rng_state(state["rng"][env.rank])
    elif env.is_main:
        log.warning("resuming %d process(es) from a checkpoint of %d: model, optimizer and "
                    "data position carry over; random streams (dropout) start afresh",
                    env.world_size, state.get("world_size"))
    return position
