"""Files written whole or not at all (a temporary file, flushed, renamed into place), and a failed
write as one line that says what, why, and for a full disk the space there and the space needed.
"""

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ddpkit.config import UserError


def fsync_folder(folder: Path) -> None:
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
        fsync_folder(path.parent)
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


def write_folder_once(root: Path, marker: str, write) -> None:
    """Make the folder `root` with `write(folder)`, atomically: into a temporary folder renamed
    into place, so ranks that start at once never see half of it (the first one's is kept;
    `marker`, a file `write` makes, tells a complete folder)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        write(tmp)
        os.rename(tmp, root)  # fails if another process got there first: theirs is as good
    except OSError:
        if not (root / marker).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
