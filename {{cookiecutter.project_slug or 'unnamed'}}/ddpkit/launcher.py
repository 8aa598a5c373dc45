"""run.sh's launch, before torchrun starts:

    python -m ddpkit.launcher FOLDER --nproc-per-node N --nnodes M|MIN:MAX [script.py]
                              [--config FILE] [key=value ...]

run.sh's settings (its environment: NPROC_PER_NODE, NNODES, MAX_RESTARTS, RDZV_*,
REPLICA_GROUP, ...) checked, this Python's packages and torchrun looked up, the preflight's
checks of the command line and this machine (preflight.py), then torchrun's command line: its
flags, those this torchrun has (read from its --help, kept between launches), the workers'
environment, written NUL-separated to FOLDER/command, which run.sh starts. It also removes
the temporary folders of earlier launches killed outright.
Nothing but the standard library is imported here: the project's packages are looked up
before anything imports them.
"""

from __future__ import annotations  # (a Python too old to run the project gets its one line)

import contextlib
import dataclasses
import getpass
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ddpkit.preflight import Refused, preflight
from ddpkit.writes import write_whole

# The packages training needs: pyproject.toml's dependencies but optuna, which only sweep.py
# imports (the name to import: pip's name). Looked up without importing them, before anything
# that imports them, so that a Python without them gets one line instead of a traceback.
PACKAGES = {"torch": "torch", "numpy": "numpy", "omegaconf": "omegaconf", "sklearn": "scikit-learn",
            "tensorboard": "tensorboard", "matplotlib": "matplotlib", "tqdm": "tqdm"}
POSITIVE, COUNT = "[1-9][0-9]*", "[0-9]+"  # whole numbers: at least 1, at least 0


def check_python() -> None:
    """This Python can run the project: 3.10 or later, with its packages."""
    if sys.version_info < (3, 10):  # noqa: UP036 (PYTHON may be any python3)
        raise Refused(f"{sys.executable} is Python {sys.version.split()[0]}: set PYTHON to a "
                      "Python 3.10+ that has the project's packages (README: Quick start)")
    missing = [pip for name, pip in PACKAGES.items() if importlib.util.find_spec(name) is None]
    if missing:
        raise Refused(f"{sys.executable} lacks the project's packages ({', '.join(missing)}): "
                      "activate the project's environment, or run pip install -e . there "
                      "(README: Quick start)")


def setting(name: str, value: str, pattern: str, must: str) -> str:
    if not re.fullmatch(pattern, value):
        raise Refused(f"{name}={value} is not valid: it must be {must}")
    return value


@dataclasses.dataclass(frozen=True)
class LaunchSettings:
    """run.sh's settings, checked: what torchrun is started with."""

    nproc: str  # NPROC_PER_NODE
    nnodes: str  # NNODES: N, or MIN:MAX for an elastic job (2:2 is 2)
    max_restarts: str  # MAX_RESTARTS
    shutdown_timeout: str  # SHUTDOWN_TIMEOUT
    join_timeout: str  # RDZV_JOIN_TIMEOUT
    replica_groups: str  # REPLICA_GROUPS with REPLICA_GROUP, else ""

    @property
    def node_range(self) -> tuple[int, int]:
        low, _, high = self.nnodes.partition(":")
        return int(low), int(high or low)


def launch_settings(nproc: str, nnodes: str) -> LaunchSettings:
    """run.sh's environment, each setting checked (NPROC_PER_NODE and NNODES with the defaults
    the project was baked with, which run.sh passes)."""
    setting("NPROC_PER_NODE", nproc, POSITIVE, "a whole number of processes, at least 1")
    setting("NNODES", nnodes, f"{POSITIVE}(:{POSITIVE})?", "a whole number of machines, at "
            "least 1, or a range MIN:MAX such as 1:4")
    low, _, high = nnodes.partition(":")
    if high and int(low) > int(high):
        raise Refused(f"NNODES={nnodes} is not valid: the range's minimum {low} is above its "
                      f"maximum {high}")
    return LaunchSettings(
        nproc, low if low == high else nnodes,
        setting("MAX_RESTARTS", os.environ.get("MAX_RESTARTS") or "3", COUNT,
                "a whole number, 0 or more"),
        setting("SHUTDOWN_TIMEOUT", os.environ.get("SHUTDOWN_TIMEOUT") or "120", COUNT,
                "a whole number of seconds"),
        setting("RDZV_JOIN_TIMEOUT", os.environ.get("RDZV_JOIN_TIMEOUT") or "600", POSITIVE,
                "a whole number of seconds, at least 1"),
        replica_groups(low if low == high else nnodes))


def replica_groups(nnodes: str) -> str:
    """REPLICA_GROUPS when this launch is a replica group (REPLICA_GROUP is set), else ""."""
    group, groups = os.environ.get("REPLICA_GROUP", ""), os.environ.get("REPLICA_GROUPS", "")
    if not group:
        return ""
    if not (re.fullmatch(POSITIVE, groups) and re.fullmatch(COUNT, group)) or int(group) >= int(
            groups):
        raise Refused(f"REPLICA_GROUP={group} and REPLICA_GROUPS={groups} are not valid: "
                      "REPLICA_GROUPS is the number of replica groups, REPLICA_GROUP this group's, "
                      "0 to REPLICA_GROUPS-1")
    if nnodes != "1":
        raise Refused(f"NNODES={nnodes} with REPLICA_GROUP: a replica group runs on one machine, "
                      "so set NNODES=1 (start one group per machine)")
    if not os.environ.get("TORCHFT_LIGHTHOUSE"):
        raise Refused("REPLICA_GROUP is set but TORCHFT_LIGHTHOUSE is not: give the lighthouse's "
                      "address, http://<host>:<port> (run_replicas.sh starts one)")
    return groups


def split_script(args: list[str]) -> tuple[str, list[str]]:
    """run.sh's arguments: the script (a first argument ending in .py; train.py without one),
    then its own."""
    script, args = (args[0], args[1:]) if args and args[0].endswith(".py") else ("train.py", args)
    if not Path(script).is_file():
        raise Refused(f"{script} not found in {os.getcwd()}: run train.py, evaluate.py or another "
                      "script of this project")
    return script, args


def rendezvous(settings: LaunchSettings) -> tuple[list[str], str]:
    """torchrun's rendezvous flags, and the endpoint of a job of several nodes ("" on one)."""
    if settings.nnodes == "1":
        return ["--standalone", "--nnodes=1"], ""
    job_id = os.environ.get("RDZV_ID") or os.environ.get("SLURM_JOB_ID", "")
    if not os.environ.get("MASTER_ADDR") or not job_id:
        raise Refused(f"NNODES={settings.nnodes} needs MASTER_ADDR (the head node's address) and "
                      "RDZV_ID (a job id), the same on every node; to run on this machine alone, "
                      "start it as NNODES=1 ./run.sh")
    endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT') or '29500'}"
    conf = ",".join(filter(None, [f"join_timeout={settings.join_timeout}",
                                  os.environ.get("RDZV_CONF", "")]))
    return [f"--nnodes={settings.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job_id}", f"--rdzv-conf={conf}"], endpoint


def worker_environment(settings: LaunchSettings, launch_folder: Path) -> list[str]:
    """NAME=value for torchrun and the workers: each one's own value when set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a user id without a name (a container)
        user = str(os.getuid())
    defaults = {
        # Cores / processes: they do not oversubscribe the CPU, and torchrun does not warn.
        "OMP_NUM_THREADS": str(max(1, (cores or 1) // int(settings.nproc))),
        # Restarted workers must not share torchrun's rendezvous store: with it shared, one can
        # read a peer address left by the previous attempt and fail to connect
        # (pytorch/pytorch#135712). Each attempt then gets a fresh store, hosted by its rank 0.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # torch.compile's cache is worth keeping between launches: where torch puts it unless
        # TMPDIR is the launch's folder.
        "TORCHINDUCTOR_CACHE_DIR": str(launch_folder.parent / f"torchinductor_{user}"),
        # A restarted or requeued job (same RDZV_ID or SLURM job id) finds its run folder by it.
        "DDP_JOB_ID": os.environ.get("RDZV_ID") or os.environ.get("SLURM_JOB_ID", ""),
    }
    if settings.replica_groups:
        defaults["RUST_LOG"] = "warn"  # torchft's Manager logs every quorum at info
    environment = [f"{name}={os.environ.get(name) or value}" for name, value in defaults.items()]
    if settings.nnodes != "1" or settings.replica_groups:
        # run.sh's command line is this node's: the lines of rank 0 say "on every node" instead.
        environment.append("RUN_SH_COMMAND=")
    return environment


# torchrun's flags differ between torch versions (2.9 to 2.14 here), and torchrun stops at one it
# does not know: its --help lists those it has. Reading it costs an import of torch (seconds of
# CPU), so it runs while the other checks do, and is kept per torchrun installation (its path and
# modification time) for the next launches.
def help_cache(torchrun: str) -> Path | None:
    try:
        stamp = os.stat(torchrun).st_mtime_ns
    except OSError:
        return None
    folder = os.environ.get("DDP_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "ddp-template")
    key = hashlib.sha256(f"{torchrun} {stamp}".encode()).hexdigest()[:16]
    return Path(folder) / f"torchrun-help-{key}"


def cached_help(cache: Path | None) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return cache.read_text() if cache else ""
    return ""


def finish_help(reading: subprocess.Popen, cache: Path | None) -> str:
    text = reading.communicate()[0]
    if reading.returncode != 0:
        last = (text.strip().splitlines() or [f"status {reading.returncode}"])[-1]
        raise Refused(f"torchrun --help failed, so torchrun would too: {last}")
    if cache:
        with contextlib.suppress(OSError):  # whole or not at all, whichever launch writes it
            write_whole(cache, lambda partial: partial.write_text(text), report=False)
    return text


def has_flag(help_text: str, flag: str) -> bool:
    """Whether torchrun's --help lists `flag`."""
    return re.search(rf"(^|[\[ ]){re.escape(flag)}([\] =,]|$)", help_text, re.M) is not None


# A torchrun without --signals-to-handle (torch 2.9; 2.10 has it) installs handlers for SIGTERM,
# SIGINT and SIGHUP over the ignored ones run.sh starts it with: a scheduler's SIGTERM or a Ctrl-C
# sent to the whole job would reach it, and it would kill the workers and print its own traceback.
# So it starts with the four blocked instead: a handler does not unblock a signal, so it never
# gets them. The workers inherit the mask and unblock them once they listen
# (supervisor.handle_signals).
EXEC_WITH_SIGNALS_BLOCKED = (
    "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, "
    "signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)); os.execvp(sys.argv[1], sys.argv[1:])")


def signals_kept_from(help_text: str) -> list[str]:
    """What starts torchrun, before its path: nothing where it has --signals-to-handle, else this
    Python with the signals blocked, which then becomes torchrun (the same process)."""
    if has_flag(help_text, "--signals-to-handle"):
        return []
    return [sys.executable, "-c", EXEC_WITH_SIGNALS_BLOCKED]


def optional_flags(settings: LaunchSettings, help_text: str) -> list[str]:
    """The flags of later torch versions, where this torchrun has them.

    --signals-to-handle (torch 2.10, pytorch#160690) without SIGTERM, SIGUSR1, SIGHUP and SIGINT:
    torchrun keeps ignoring them (run.sh starts it so), and run.sh passes them to the workers.
    --shutdown-timeout (2.12, pytorch#172596): how long torchrun waits for the workers to leave
    after the signals it handles (SIGQUIT) or a failed worker. An older one waits 30 s: a note
    says so when SHUTDOWN_TIMEOUT asks for longer (run.sh's own wait after Ctrl-C applies it
    whatever the torchrun)."""
    flags = ["--signals-to-handle=SIGQUIT"] if has_flag(help_text, "--signals-to-handle") else []
    if has_flag(help_text, "--shutdown-timeout"):
        flags.append(f"--shutdown-timeout={settings.shutdown_timeout}")
    elif int(os.environ.get("SHUTDOWN_TIMEOUT") or 0) > 30:  # (checked: a whole number)
        print(f"note: this torchrun has no --shutdown-timeout (torch 2.12+), so SHUTDOWN_TIMEOUT="
              f"{settings.shutdown_timeout} does not apply: it waits 30 s", file=sys.stderr)
    return flags


def remove_stale_launch_folders(own: Path) -> None:
    """The temporary folders of earlier launches on this machine that were killed outright
    (SIGKILL leaves run.sh no time to clean up): those whose processes are all gone. Each folder's
    `owner` file holds the host, then run.sh's pid, its preflight's and torchrun's. What remains:
    the workers of a launch whose run.sh and torchrun were both killed outright (torchrun starts
    each in a session of its own) may outlive them, and lose their folder to the next launch."""
    host = os.uname().nodename
    for folder in own.parent.glob("run-sh.*"):
        with contextlib.suppress(OSError, ValueError):
            if folder == own or folder.stat().st_uid != os.getuid():
                continue
            owner_host, *pids = (folder / "owner").read_text().split()
            if owner_host == host and not any(map(is_running, map(int, pids))):
                shutil.rmtree(folder, ignore_errors=True)


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: a pid taken again since
        return True
    with contextlib.suppress(OSError):  # (Linux) a zombie has ended: its parent was killed
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    return True


def launch(folder: Path, argv: list[str]) -> list[str]:
    """Check run.sh's launch and return torchrun's command line: `env NAME=value ... torchrun
    <flags> -m ddpkit.worker <script> <args>` (each worker runs the script through
    ddpkit.worker, which installs its signal handlers before the script is imported; an older
    torchrun started through signals_kept_from)."""
    remove_stale_launch_folders(folder)
    _, nproc, _, nnodes, *args = argv  # --nproc-per-node N --nnodes M, then run.sh's arguments
    settings = launch_settings(nproc, nnodes)
    script, args = split_script(args)
    joining, endpoint = rendezvous(settings)
    check_python()
    torchrun = shutil.which("torchrun")
    if not torchrun:
        raise Refused("torchrun not found on PATH: activate the project's environment (pip "
                      "install -e . puts torchrun there)")
    cache = help_cache(torchrun)
    help_text = cached_help(cache)
    reading = None if help_text else subprocess.Popen(
        [torchrun, "--help"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        batch_nodes = settings.replica_groups or settings.nnodes  # the global batch's split
        preflight(["--nproc-per-node", settings.nproc, "--nnodes", batch_nodes, "--script", script,
                   "--endpoint", endpoint, "--node-rank", os.environ.get("NODE_RANK", ""),
                   "--rdzv-conf", os.environ.get("RDZV_CONF", "") if endpoint else "", *args])
        help_text = help_text or finish_help(reading, cache)
    finally:
        if reading and reading.poll() is None:  # refused meanwhile
            reading.kill()
            reading.wait()
    low, high = settings.node_range
    if low < high:
        print(f"elastic job of {low} to {high} nodes: waiting up to {settings.join_timeout} s for "
              f"{low} at {endpoint} (RDZV_JOIN_TIMEOUT)", file=sys.stderr)
    elif high > 1:
        print(f"waiting up to {settings.join_timeout} s for the other nodes at {endpoint} "
              "(RDZV_JOIN_TIMEOUT)", file=sys.stderr)
    return ["env", *worker_environment(settings, folder), *signals_kept_from(help_text), torchrun,
            *joining, f"--nproc_per_node={settings.nproc}",
            f"--max-restarts={settings.max_restarts}", *optional_flags(settings, help_text), "-m",
            "ddpkit.worker", script, *args]


def main(argv: list[str]) -> int:
    """Check the launch; torchrun's command line, NUL-separated, to FOLDER/command."""
    folder = Path(argv[0])
    try:
        command = launch(folder, argv[1:])
    except Refused as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    path = folder / "command"
    try:
        path.write_bytes(b"".join(os.fsencode(word) + b"\0" for word in command))
    except OSError as error:  # a full disk under TMPDIR
        print(f"error: cannot write {path}: {error.strerror or error}: free space in "
              f"{folder.parent}, or set TMPDIR to a folder on another disk", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)  # not waiting for a store client that never got an answer
