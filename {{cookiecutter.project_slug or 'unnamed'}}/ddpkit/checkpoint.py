"""Writing checkpoints: what a checkpoint holds, the Checkpointer that saves them during training
(synchronously, or in the background), pruning the old ones, and the final model export.

A checkpoint holds everything training needs to continue exactly: the model (keys without
`module.` / `_orig_mod.`), optimizer, LR schedule, loss scaler, the running training statistics,
the position (step, epoch, step within it), every rank's random generators, the config, and
which of its parts a reader must understand (`requires`, checkpoint_files.REQUIRED_PARTS). Every
rank writes its part (torch.distributed.checkpoint), into a hidden folder renamed into place when
all parts are on disk; the newest `train.keep_checkpoints` are kept, and the best validation's
(train.keep_best) beside them. It loads at any process count, with either strategy (DDP or FSDP):
checkpoint_load.py. With train.checkpoint_async=true the ranks train on while a background thread
writes. Its files and their manifest: checkpoint_files.py.

model.pt, written at the end of training (export.py makes one from any checkpoint), is the whole
model in one file: what evaluate.py loads as well as a checkpoint, and what you ship.
"""

import contextlib
import errno
import fcntl
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import FileSystemWriter, staging
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ddpkit import __version__, dist_utils
from ddpkit.checkpoint_files import (
    EXPORT_FORMAT,
    FORMAT_VERSION,
    SHARDED_PARTS,
    STATE_FILE,
    list_checkpoints,
    requirements,
    write_manifest,
)
from ddpkit.checkpoint_load import cause_of, clean_state_dict, one_line
from ddpkit.config import UserError
from ddpkit.dist_utils import DistEnv
from ddpkit.position import Position, rng_state
from ddpkit.writes import (
    fsync_folder,
    put_in_place,
    remove_whole,
    write_atomically,
    write_failure,
)


def tensor_bytes(value) -> int:
    """The bytes of every tensor in a (nested) state: about what saving it writes."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()  # a DTensor: the whole tensor's
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v) for v in value)
    return 0


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
        training continues exactly. With replica groups, the leading group's alone: the others
        hold the same state (DistEnv.leads)."""
        if self.env.leads is not None and not self.env.leads():
            self.last_saved = position.step
            return
        self.wait()
        self.last_saved, env = position.step, self.env
        rngs = dist_utils.gather_objects(rng_state())  # each rank's generators
        small = {name: part.state_dict() if part is not None else None
                 for name, part in parts.items() if name not in SHARDED_PARTS}
        small.update(format_version=FORMAT_VERSION, template_version=__version__,
                     step=position.step, epoch=position.epoch,
                     step_in_epoch=position.step_in_epoch, world_size=env.world_size, rng=rngs,
                     config=OmegaConf.to_container(cfg), requires=requirements(parts))
        sharded = {name: parts[name].state_dict() for name in SHARDED_PARTS
                   if parts.get(name) is not None}
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
        # (A checkpoint of this step that an attempt ending after it left is replaced.)
        put_in_place(tmp, path, exists="replace")
        fsync_folder(self.folder)
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
                cause = (cause_of(error) or self._full_disk()) if self.env.is_main else None
                message = dist_utils.broadcast_object(
                    self._write_failure(cause) if cause else None)
                if message:
                    raise UserError(message) from None
                raise RuntimeError(f"writing {self.pending_path} failed: {one_line(error)}"
                                   ) from None
            except Exception as error:  # this rank's alone (rank 0 renaming, say)
                if (cause := cause_of(error)) is not None:
                    raise UserError(self._write_failure(cause)) from None
                raise


def prune_checkpoints(folder: Path, keep: int, best: str | None = None) -> None:
    """Delete all but the newest `keep` checkpoints (keep=0: delete none) and the one named
    `best`, and any temporary file or folder a killed writer left behind (rank 0's job)."""
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
    try:
        # r+: NFS takes an exclusive lock only on a file open for writing.
        with open(path / STATE_FILE, "r+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Under the lock: a reader waits, then finds it gone; a leftover of a killed prune
            # is hidden, and the next prune removes it.
            remove_whole(path)
        return
    except BlockingIOError:
        return
    except OSError:  # no state.pt, or a file system without locks
        pass
    shutil.rmtree(path, ignore_errors=True)


def export_model(model_state: dict, path: Path, step: int, cfg: DictConfig,
                 weights: str) -> None:
    """The whole model's weights in one file, with the config that builds the model and which
    weights they are (`weights`: averaged or trained, docs/checkpoints.md): loads with
    torch.load(weights_only=True) into the bare model (rank 0 writes it)."""
    state = {"format": EXPORT_FORMAT, "model": clean_state_dict(model_state), "step": step,
             "weights": weights, "config": OmegaConf.to_container(cfg)}
    try:
        write_atomically(state, path)
    except OSError as error:
        raise UserError(write_failure(error, Path(path), tensor_bytes(state))) from None



