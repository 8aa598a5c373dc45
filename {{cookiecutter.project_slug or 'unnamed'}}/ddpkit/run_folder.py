"""The run folder: where a run lives, chosen by rank 0 and shared with the other ranks (one folder
per job, never one per process), and its lock.

`run.dir`; or the folder of this job, found again by its job id (run.sh's RDZV_ID or the SLURM
job id, else the id torchrun gives every attempt of a job); or the run the same command left
unfinished (continued_run: the rule is docs/checkpoints.md's "Which run the same command
continues"); or a new timestamped one. Rank 0 takes an flock on the folder for the job's
lifetime, so two jobs never train in one folder. A folder that cannot be made or locked (a full
disk) is one line, and leaves nothing behind.
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ddpkit import dist_utils
from ddpkit.checkpoint_files import list_checkpoints
from ddpkit.config import UserError
from ddpkit.dist_utils import DistEnv
from ddpkit.resume_settings import changed_settings
from ddpkit.same_command import run_again
from ddpkit.writes import write_failure

log = logging.getLogger("ddp")


JOB_ID_FILE = ".job_id"  # the id of the job that made the folder: a requeue finds it by this


LOCK_FILE = ".lock"  # held by the job training in the folder; names its host and pid


RUN_FOLDER_NOTE = ".run_folder"  # beside run.sh's status file: the run folder the launch made


_held_locks: list = []  # open lock files: the lock lasts as long as the process


# Settings that say where a run's folder is or how it is shown, not what it trains: the same
# command with another value of one of them still continues the run.
NOT_SETTINGS_OF_THE_RUN = ("run.name", "run.output_dir", "run.dir", "train.progress_bar",
                           "train.plot_curves")


def job_id() -> str:
    """The id a restarted or requeued job keeps: run.sh's DDP_JOB_ID (RDZV_ID, else the SLURM
    job id), else the torchrun run id (the same for every restart of one torchrun). A bare
    torchrun without --rdzv-id has the id "none", the same for every job: no id."""
    run_id = os.environ.get("DDP_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return "" if run_id == "none" else run_id


def lock_run_dir(path: Path, name: str = LOCK_FILE, announce_takeover: bool = True) -> None:
    """Rank 0 takes the run folder for this job, or refuses with one line naming the holder.

    An flock: the kernel releases it when its process ends, however it ends, so a lock left by
    a killed job is free again; taking it over from another job says so once (unless the
    folder is a run this job continues, which said so already).
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
    if announce_takeover and previous and previous.get("job") != job_id():
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


def note_run_folder(path: Path) -> None:
    """Rank 0 under run.sh, having created the run folder: which one, so that run.sh removes
    it if a worker crashes in native code before the run writes anything (ddpkit/crashes.py).
    The first attempt's: a restarted one finds the folder and did not create it."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if status_file:
        with contextlib.suppress(FileExistsError), open(status_file + RUN_FOLDER_NOTE, "x") as note:
            note.write(str(path))


def lock_holder(path: Path) -> dict | None:
    """The job holding a run folder's lock ({"host", "pid"}), or None when none does."""
    try:
        handle = open(path / LOCK_FILE)  # noqa: SIM115 (closed below, the lock test done)
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return _read_holder(handle.read())
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


@dataclass
class RunDir:
    path: Path
    created: bool  # by this job: removed again if the job fails before it writes anything
    opened_here: bool = True  # by this process (rank 0), which removes it again
    continued: bool = False  # the run the same command left unfinished (continued_run)

    def discard_if_unused(self) -> None:
        """Rank 0, after a failure before training started: remove a folder this job created
        and left empty (but for the run id marker), so failed launches leave no litter."""
        if not (self.created and self.opened_here and self.path.is_dir()):
            return
        markers = [p for p in self.path.iterdir()
                   if p.name == JOB_ID_FILE or p.name.startswith(LOCK_FILE)]
        if len(markers) == len(list(self.path.iterdir())):
            for marker in markers:
                marker.unlink(missing_ok=True)
            self.path.rmdir()


def unfinished_runs(output_dir: Path, name: str) -> list[tuple[Path, str]]:
    """The runs of run.name in `output_dir` that did not finish, newest first (by the time and
    number their folders' names end with), each with how it stands. A folder without
    config.yaml (only the markers of a launch that failed before its run started) is no run."""
    named = re.compile(re.escape(name) + r"-(\d{8}-\d{6})(?:-(\d+))?")
    found = []
    with contextlib.suppress(OSError):
        for path in output_dir.iterdir():
            match = named.fullmatch(path.name)
            if match and (path / "config.yaml").is_file() and (status := run_status(path)) != (
                    "done"):
                found.append(((match[1], int(match[2] or 0)), path, status))
    return [(path, status) for _, path, status in sorted(found, reverse=True)]


def run_status(path: Path) -> str:
    """How a run folder's run stands, by its summary.json: done, preempted, interrupted, failed,
    or running (also a job killed outright, which wrote no end)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return str(json.loads((path / "summary.json").read_text()).get("status", "running"))
    return "running"


def saved_step(path: Path) -> str:
    """Where a run folder's run resumes from, in words."""
    checkpoints = list_checkpoints(path / "checkpoints")
    if not checkpoints:
        return "step 0 (it saved no checkpoint)"
    return f"its checkpoint of step {int(checkpoints[-1].name.removeprefix('step-'))}"


def continued_run(cfg: DictConfig) -> Path | None:
    """The run the same command continues: the newest run of run.name in run.output_dir that
    did not finish and was started with these settings (but for NOT_SETTINGS_OF_THE_RUN), when
    no job is running in it. None for a new run folder, with one line when a run did not finish:
    the one a job is running in, or the newest, started with other settings, and the command
    that continues it anyway."""
    other = None  # the newest unfinished run of other settings
    for path, status in unfinished_runs(Path(cfg.run.output_dir), cfg.run.name):
        changes = settings_changed(cfg, path)
        if changes:
            other = other or (path, status, changes)
            continue
        which = f"{path}, the newest run of {cfg.run.name} with these settings"
        holder = lock_holder(path)
        if holder is not None:
            log.warning("%s that did not finish, is in use by another job (host %s, pid %s): a "
                        "new run folder", which, holder.get("host"), holder.get("pid"))
            return None
        status = "its job was killed" if status == "running" else status  # (it wrote no end)
        log.info("continuing %s, which did not finish (%s), from %s (train.resume=never starts "
                 "a new run instead)", which, status, saved_step(path))
        return path
    if other:
        path, status, changes = other
        named = ", ".join(f"{key} {before} -> {value}" for key, (before, value)
                          in list(changes.items())[:3])
        more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        log.warning("%s, the newest run of %s that did not finish (%s), was started with other "
                    "settings (%s%s): a new run folder. To continue that run instead, from %s, "
                    "with these settings where a resume allows them, %s", path, cfg.run.name,
                    status, named, more, saved_step(path), run_again(f"run.dir={path}"))
    return None


def settings_changed(cfg: DictConfig, path: Path) -> dict[str, tuple]:
    """The settings of this run that differ from those a run folder's config.yaml holds: name
    -> (its value, this run's). A config.yaml that cannot be read differs."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"))
    except Exception:  # a damaged file: YAML's errors come in several types
        return {"config.yaml": ("unreadable", "this run's")}
    if not isinstance(saved, dict):
        return {"config.yaml": ("unreadable", "this run's")}
    return changed_settings(cfg, saved, ignored=NOT_SETTINGS_OF_THE_RUN)


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
    continued = continued_run(cfg) if cfg.train.resume != "never" else None
    if continued:
        if run_id:  # torchrun's restarts of this job find it by its id
            (continued / JOB_ID_FILE).write_text(run_id)
        return RunDir(continued, created=False, continued=True)
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


def open_run_dir(cfg: DictConfig, env: DistEnv, group: int | None = None) -> RunDir:
    """The run folder, created (or found again) and locked by rank 0, the same on every rank
    (collective). With replica groups, each group's rank 0 opens the shared folder and locks
    its group's part of it."""
    with dist_utils.agree_on_errors():
        opens = env.rank == 0 if group is not None else env.is_main
        run = _open_and_lock(cfg, group) if opens else None
    path, created = dist_utils.broadcast_object((str(run.path), run.created) if run else None)
    return RunDir(Path(path), created, opened_here=run is not None)


def _open_and_lock(cfg: DictConfig, group: int | None) -> RunDir:
    """Rank 0's part of open_run_dir: a folder it cannot create or lock (a full disk, say) is
    one line, and a folder this launch created is removed again."""
    try:
        if group is not None:  # a replica group's: the folder of the job id the groups share
            from ddpkit.extras.replicas.launch import replica_run_dir

            run = RunDir(*replica_run_dir(cfg))
        else:
            run = _create_run_dir(cfg)
    except OSError as error:
        where = Path(error.filename or cfg.run.dir or cfg.run.output_dir)
        raise UserError(write_failure(error, where)) from None
    try:
        lock_run_dir(run.path, LOCK_FILE if group is None else f"{LOCK_FILE}-group-{group}",
                     announce_takeover=not run.continued)
    except UserError:
        run.discard_if_unused()
        raise
    if run.created:  # a crash in native code leaves it to run.sh to remove, if still unused
        note_run_folder(run.path)
    return run
