"""Files and folders written whole or not at all, and a failed write as one line that says what,
why, and for a full disk the space there and the space needed.

write_whole is the one way to write: `write(path)` makes a file, or fills a folder, at a hidden
temporary path beside the target (`.<name>.tmp-<pid>-<random>`); then the temporary is flushed
to disk, given the permissions that open() and mkdir() give under the umask (some writers make
files for their owner alone), and renamed into place, and the folder that holds it is flushed.
On any failure, or a stop (Ctrl-C, a signal that ends a command at once), the temporary is
removed: a reader sees the old target or the new one, never half of one. An OSError is one line
(write_failure). write_text, write_atomically (torch.save) and write_folder_once are its common
uses; writing_alone is a lock on a target for writers that must not run at once.
"""

import contextlib
import errno
import fcntl
import glob
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from ddpkit.project import UserError

FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
EXISTING = ("replace", "keep", "refuse")  # what write_whole does with a target that exists


def fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # make a rename in it durable
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask can only
    read it by setting it, and a thread that creates a file meanwhile would get the other)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def temporary_path(target: Path) -> Path:
    """Where write_whole writes `target` first: hidden, beside it, this call's own (processes
    of two machines may have the same id and write one folder of a shared file system)."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def remove_leftovers(target: Path) -> list[Path]:
    """Remove the temporaries of `target` that killed writers left (SIGKILL, a lost machine),
    and return them. Only for a caller that holds writing_alone(target): then no live writer
    has one."""
    found = [Path(path) for path in glob.glob(
        str(target.parent / f".{glob.escape(target.name)}.tmp-*"))]
    for path in found:
        remove(path)
    return found


def remove(path: Path) -> None:
    """A file or folder gone, whichever it is (or was never made)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def write_whole(target: Path, write: Callable[[Path], None], *, folder: bool = False,
                exists: str = "replace", needed: int | None = None, report: bool = True,
                advice: str = "", durable: bool = True) -> bool:
    """Make `target` whole or not at all (the module's docstring): `write(path)` writes the
    file `path`, or with folder=True fills the folder `path` (made empty for it). A target that
    exists is replaced (exists="replace"; a folder too), kept when another process made it
    first (exists="keep": returns False; for folders written once, by ranks that start at
    once), or refused in one line (exists="refuse"). An OSError is one line naming the target
    (write_failure; `needed`: the bytes it takes, and `advice`, what to do, for a full disk), or
    with report=False raised as it is, for a caller that words it. durable=False leaves out the
    flush of each file (a folder of many small files the project writes itself, and writes
    again when it finds one damaged): other processes still see it whole or not at all. Returns
    True when this call put the target in place."""
    if exists not in EXISTING:
        raise ValueError(f"exists={exists!r}: one of {EXISTING}")
    target = Path(target)
    temporary = temporary_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if folder:
            temporary.mkdir()
        write(temporary)
        settle(temporary, durable)
        placed = put_in_place(temporary, target, exists)
        fsync_folder(target.parent)
        return placed
    except OSError as error:
        # The space there when the write failed: removing the temporary frees it again.
        free = free_space(target.parent) if error.errno in FULL_DISK else None
        remove(temporary)
        if not report:
            raise
        raise UserError(write_failure(error, target, needed, free, advice)) from None
    finally:
        remove(temporary)  # any other failure, or a stop: nothing half written stays


def settle(path: Path, durable: bool = True) -> None:
    """A written file, or every file and folder of a written folder, flushed to disk (unless
    not `durable`) and given the umask's permissions (executable files stay executable)."""
    umask = current_umask()
    entries = [path] if path.is_file() else [path, *path.rglob("*")]
    for entry in entries:
        if entry.is_symlink():
            continue
        mode = entry.stat().st_mode
        wanted = (0o777 if entry.is_dir() or mode & 0o111 else 0o666) & ~umask
        if mode & 0o777 != wanted:
            entry.chmod(wanted)
        if not durable:
            continue
        if entry.is_file():
            with open(entry, "rb") as handle:
                os.fsync(handle.fileno())
        else:
            fsync_folder(entry)


def put_in_place(temporary: Path, target: Path, exists: str) -> bool:
    """The written temporary renamed to `target` (write_whole's `exists`); False when another
    process's target is kept."""
    if exists == "refuse" and os.path.lexists(target):
        kind = "folder" if temporary.is_dir() else "file"
        raise UserError(f"{target} exists: choose a new {kind}, or delete that one")
    aside = target.with_name(f".{target.name}.old-{os.getpid()}")
    if exists == "replace" and temporary.is_dir() and target.is_dir():
        os.replace(target, aside)  # a folder cannot replace a folder that holds files
    try:
        os.replace(temporary, target)
    except OSError as error:
        if os.path.lexists(aside):
            os.replace(aside, target)  # the earlier one back
        if exists == "keep" and error.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False  # another process got there first: theirs is as good
        raise
    remove(aside)
    return True


def remove_whole(path: Path) -> None:
    """Delete a file or folder so that no reader ever sees half of it: renamed to a hidden
    temporary first (which remove_leftovers takes away if this process is killed), then
    deleted."""
    doomed = temporary_path(path)
    os.replace(path, doomed)
    remove(doomed)


def free_space(folder: Path) -> int:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(folder).free
    return 0


def write_text(path: Path, text: str) -> None:
    """A small file written whole, or one line saying why not."""
    write_whole(path, lambda temporary: temporary.write_text(text))


def write_atomically(state: dict, path: Path) -> None:
    """torch.save to `path`, whole or not at all; an OSError is raised as it is (the callers
    word it with what they know: the bytes needed)."""

    import torch  # (here: the launcher's checks use this module and need no torch)

    def save(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            try:
                torch.save(state, handle)
            except RuntimeError as error:  # the zip writer's complaint about a failed write
                if isinstance(error.__context__, OSError):
                    raise error.__context__ from None
                raise

    write_whole(path, save, report=False)


def write_folder_once(root: Path, marker: str, write: Callable[[Path], None]) -> None:
    """Make the folder `root` with `write(folder)`, whole: ranks that start at once never see
    half of it, and the first one's is kept (`marker`, a file `write` makes, tells a complete
    folder). Not flushed file by file: the built-in datasets' folders hold thousands of files,
    and one found damaged is written again once deleted."""
    try:
        write_whole(root, write, folder=True, exists="keep", durable=False)
    except UserError:
        if not (root / marker).is_file():
            raise


@contextlib.contextmanager
def writing_alone(target: Path, wait: bool = False) -> Iterator[None]:
    """An flock on `.<name>.lock` beside `target` while the block runs, so that two writers of
    one target never run at once: another holder is one line naming it, or with wait=True is
    waited for. The kernel releases an flock when its process ends, however it ends; the lock
    file is removed at the end of the block (a killed holder's is taken over)."""
    target = Path(target)
    lock = target.with_name(f".{target.name}.lock")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle = _take_lock(lock, target, wait)
    except OSError as error:
        raise UserError(write_failure(error, target)) from None
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # still held: a writer waiting on it finds it gone, retries
        handle.close()


def _take_lock(lock: Path, target: Path, wait: bool):
    while True:
        handle = open(lock, "a+")  # noqa: SIM115 (kept open: the lock lasts with it)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise UserError(f"{target} is being written by {holder}: wait for it to end, or "
                            "write another") from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(lock).st_ino == os.fstat(handle.fileno()).st_ino:
                break
        handle.close()  # removed by its holder as it ended: take the one there now
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
    except OSError:
        lock.unlink(missing_ok=True)
        handle.close()
        raise
    return handle


RUN_ADVICE = ("free space there or set run.output_dir / run.dir to a larger disk, then rerun to "
              "resume")


def write_failure(error: OSError, path: Path, needed: int | None = None,
                  free: int | None = None, advice: str = "") -> str:
    """One line for a failed write: what, why, and for a full disk the space there (`free`, as
    measured when the write failed, before its partial files were removed), needed, and what
    to do (`advice`; a run's files by default)."""
    folder = path.parent
    message = f"cannot write {path}: {error.strerror or error}"
    if error.errno in FULL_DISK:
        if free is None:
            free = shutil.disk_usage(folder).free if folder.exists() else 0
        need = f", about {needed / 1e6:.1f} MB needed" if needed else ""
        message += f" ({free / 1e6:.1f} MB free in {folder}{need}); {advice or RUN_ADVICE}"
    return message
