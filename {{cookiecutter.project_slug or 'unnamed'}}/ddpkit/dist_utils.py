"""Every distributed concern of the project, in one file.

The same scripts run as `python train.py` (one process, no process group) and under
`torchrun` (one process per GPU, or per CPU slot with gloo). Everything here reads torchrun's
environment and degrades to a no-op when there is only one process, so the training loop never
needs an `if distributed:` of its own.
"""

import atexit
import contextlib
import datetime
import errno
import faulthandler
import json
import logging
import multiprocessing.util
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from ddpkit.config import PROJECT_DIR, UserError

log = logging.getLogger("ddp")

# With replica groups (ddpkit/replicas.py): whether this process's group is the one that writes
# the run's files now. None: there is one group, the job.
lead_group: Callable[[], bool] | None = None


@dataclass(frozen=True)
class DistEnv:
    rank: int  # this process among all processes of the job
    local_rank: int  # this process among those on its machine: picks the GPU
    world_size: int  # processes in the job
    launched: bool  # started by torchrun (even with a single process)

    @property
    def is_main(self) -> bool:
        """The process that writes the run's files: rank 0 (of the leading replica group)."""
        return self.rank == 0 and (lead_group is None or lead_group())


def get_dist_env() -> DistEnv:
    """Rank, local rank and world size from torchrun's variables; one process without them."""
    if "RANK" not in os.environ:
        return DistEnv(rank=0, local_rank=0, world_size=1, launched=False)
    try:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        world_size = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UserError(
            "RANK is set but RANK, LOCAL_RANK and WORLD_SIZE are not all whole numbers: "
            "launch with torchrun (or ./run.sh), or unset RANK to run a single process"
        ) from None
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} must be between 0 and WORLD_SIZE-1={world_size - 1}")
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, launched=True)


def is_rank_0() -> bool:
    """Rank 0 of the process group: of the job, or with replica groups of this group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def is_main_process() -> bool:
    """The process that writes the run's files (see DistEnv.is_main)."""
    return is_rank_0() and (lead_group is None or lead_group())


def select_device(env: DistEnv, requested: str) -> torch.device:
    """This rank's device: its own GPU (by local rank) when CUDA is used, else the CPU."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA GPU is visible: use train.device=auto")
    if env.local_rank >= torch.cuda.device_count():
        raise UserError(
            f"local rank {env.local_rank} has no GPU: this machine has "
            f"{torch.cuda.device_count()}; launch at most that many processes per node"
        )
    return torch.device("cuda", env.local_rank)


# NCCL's flight recorder: the last collectives of every rank, dumped when one times out (to
# /tmp/nccl_trace_rank_<rank> unless TORCH_FR_DUMP_TEMP_FILE says otherwise; read them with
# `torchfrtrace`). Set for the nccl backend; your own settings of these variables win. Every torch
# the project supports (2.9 on) reads the buffer's size as TORCH_FR_BUFFER_SIZE (its name since
# 2.8); the old name, TORCH_NCCL_TRACE_BUFFER_SIZE, would only make torch warn at every start.
FLIGHT_RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def init_distributed(env: DistEnv, device: torch.device, backend: str, timeout_minutes: float):
    """Join the process group (when launched by torchrun); a no-op for a single process."""
    if device.type == "cuda":
        # Before init: NCCL binds each process to the current device, and without this
        # every rank would create its context on GPU 0.
        torch.cuda.set_device(device)
    if not env.launched or dist.is_initialized():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UserError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: launch "
                        "with torchrun (or ./run.sh), which sets them all, or unset RANK and "
                        "WORLD_SIZE to run a single process")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("ddp.backend=nccl needs CUDA GPUs: use ddp.backend=gloo on CPU")
    if backend == "nccl":
        for name, value in FLIGHT_RECORDER_ENV.items():
            os.environ.setdefault(name, value)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(minutes=timeout_minutes),
        device_id=device if device.type == "cuda" else None,
    )


def backend_name() -> str:
    return dist.get_backend() if dist.is_initialized() else "none (single process)"


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum_async(tensor: torch.Tensor):
    """Start summing a tensor over all ranks, in place; returns a handle to wait() on (None
    without a process group, where the sum is the tensor itself)."""
    if dist.is_initialized():
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    return None


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj):
    """Rank 0's value of a picklable object, on every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def setup_logging(env: DistEnv) -> None:
    """Rank 0 logs at INFO; other ranks stay quiet unless something is wrong. With replica
    groups, rank 0 of each group logs, its lines marked with the group."""
    handler = logging.StreamHandler(sys.stdout)
    group = os.environ.get("REPLICA_GROUP")
    prefix = (f"[group {group}{f' rank {env.rank}' if env.rank else ''}] " if group is not None
              else "" if env.rank == 0 else f"[rank {env.rank}] ")
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if env.rank == 0 else logging.WARNING)
    log.propagate = False


@contextlib.contextmanager
def agree_on_errors() -> Iterator[None]:
    """Run a block that may raise UserError on some ranks only, and raise it on all of them.

    Every rank reaches the same all-gather whether its block failed or not, so a rank that
    failed never leaves the others waiting in a collective: they all stop together.
    """
    message = None
    try:
        yield
    except UserError as error:
        message = str(error)
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        message = _describe_failures(messages)
    if message is not None:
        raise UserError(message)


def _describe_failures(messages: list) -> str | None:
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return None
    if all(text == failed[0][1] for _, text in failed) and len(failed) == len(messages):
        return failed[0][1]  # the same on every rank: say it once, without ranks
    if [rank for rank, _ in failed] == [0]:
        return failed[0][1]  # rank 0 does the job's writing (lock, config, checkpoints)
    return f"rank {failed[0][0]}: {failed[0][1]}"


def _exit_on_user_error(message: str) -> None:
    """Print a user error once (rank 0, after hearing from every rank), then exit 2 everywhere.

    The ranks leave only after rank 0 has printed, so torchrun cannot cut rank 0 short by
    tearing the job down when another rank exits first.
    """
    rank = int(os.environ.get("RANK", "0"))
    try:
        if _world_size_given() > 1 and "MASTER_ADDR" in os.environ and not dist.is_initialized():
            # The error came before the job's process group existed (e.g. a config typo with a
            # bare torchrun): a small CPU group just to agree on who reports it.
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        if dist.is_initialized():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
            if dist.get_rank() == 0:
                message = _describe_failures(messages)
                print(f"error: {message}", file=sys.stderr, flush=True)
                _tell_run_sh(f"error: {message}")
            dist.barrier()
        elif rank == 0 or not _world_size_given():
            print(f"error: {message}", file=sys.stderr, flush=True)
            _tell_run_sh(f"error: {message}")
    except Exception:  # the other ranks are not coming: this rank alone hit the problem
        print(f"error (rank {rank}): {message}", file=sys.stderr, flush=True)
        exit_now(2)
    # Under run.sh every rank has agreed and the error is on record: exit 0 so that torchrun
    # does not restart a job whose input is wrong; run.sh exits 2. Elsewhere: exit 2.
    leave(0 if os.environ.get("RUN_SH_STATUS_FILE") else 2)


def _exit_alone_on_user_error(message: str) -> NoReturn:
    """A user error this rank met alone while the others went on (a damaged sample read
    mid-epoch): no agreement, as they wait in a collective it will never join. It says so once
    (the first such rank of this machine), tells run.sh, which exits 2 and whose restarts leave
    at once (_job_failed), and exits now, so that torchrun stops the others (a peer failure)."""
    rank = int(os.environ.get("RANK", "0"))
    text = f"rank {rank}: {message}" if _world_size_given() > 1 else message
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    try:
        if status_file:
            os.close(os.open(f"{status_file}.reported", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        _tell_run_sh(f"error: {text}")
        print(f"error: {text}", file=sys.stderr, flush=True)
    except FileExistsError:
        pass  # another rank of this machine has reported
    exit_now(2)


def leave(code: int) -> NoReturn:
    """End this process in order, but without the interpreter's own teardown: leave the process
    groups, run the exit handlers (logging, trackers, DataLoader workers), flush, and exit.

    The teardown would free what is still alive at the end (the DDP model, and the process
    group its reducer holds) with the interpreter lock held. Gloo's destructor joins its worker
    threads, and a worker still releasing the tensors of a collective that just finished waits
    for that lock: the process hangs for good (seen with torch 2.13 on a busy machine, once in a
    few preempted runs). os._exit skips the teardown; the kernel frees the rest.
    """
    cleanup()
    atexit._run_exitfuncs()
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """os._exit, after ending this process's loader workers: a failing rank leaves without its
    teardown (a peer may be gone mid-collective), and DataLoader workers started by forkserver
    would outlive it (each waits for its parent, the forkserver, which waits for them).
    A worker left SIGTERM ends in order (data.end_with_rank); one that does not is killed."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    # multiprocessing's own exit handler, which os._exit skips: it removes its pymp-* temp
    # folder (once: after atexit it does nothing).
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _world_size_given() -> int:
    """WORLD_SIZE as torchrun sets it; 0 when it is missing or not a number."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else 0


def _tell_run_sh(status: str) -> None:
    """Tell run.sh how the job ended (its status file): `error: <message>`, `preempted`,
    `stalled` or `failed`. run.sh exits 2, 75, 1 or 1 for them, whatever torchrun returns."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if status_file:
        Path(status_file).write_text(status + "\n")


def _is_peer_failure(error: BaseException) -> bool:
    """A collective that broke because another process died: a consequence, not the cause."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(error)
    return isinstance(error, backend_error) or (isinstance(error, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                  "Broken pipe", "NCCL communicator was aborted",
                                  # torchft: the group's rank 0, which hosts its Manager, is gone
                                  'message: "transport error"', "status: Unavailable")))


# --- preemption and stalls ----------------------------------------------------------------------

PREEMPTED_EXIT = 75  # sysexits' EX_TEMPFAIL: stopped on purpose; the same command resumes
STALLED_EXIT = 1
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTION_SIGNALS_RECEIVED: list[int] = []  # noted by the handler; Supervisor acts on them


def handle_signals() -> None:
    """From the start of a process: SIGTERM and SIGUSR1 are noted (the training loop stops at a
    step every rank agrees on), SIGINT interrupts once (even if the launcher started us ignoring
    it). Under run.sh, a signal it passed on before this process listened (torchrun starts us
    with them ignored) is on record beside its status file."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in PREEMPTION_SIGNALS:
        signal.signal(number, lambda number, frame: PREEMPTION_SIGNALS_RECEIVED.append(number))
    signal.signal(signal.SIGINT, _interrupt_once)
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if status_file and os.path.exists(f"{status_file}.preempted"):
        PREEMPTION_SIGNALS_RECEIVED.append(signal.SIGTERM)


def _interrupt_once(number, frame) -> None:
    """Under run.sh, a Ctrl-C counts once run.sh passes it on: it stops torchrun first, which
    would otherwise restart the workers that leave (the terminal signals us all at once)."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if status_file and not os.path.exists(f"{status_file}.interrupted"):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one must not cut the exit short
    raise KeyboardInterrupt


class Preempted(Exception):
    """Every rank agreed to stop for a preemption signal (after saving, in training)."""


def stopped_by_torchrun() -> bool:
    """Whether a stop signal came from torchrun rather than from the scheduler or the user.
    Under run.sh, which notes every signal it passes on (beside its status file), a SIGTERM it
    did not pass on is torchrun's own: an elastic job's agent stops its workers when a node joins
    or leaves, and starts them again at the new size straight away."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    return bool(status_file) and not os.path.exists(f"{status_file}.preempted")


class Supervisor:
    """Watches the job from every rank: preemption signals, and collectives that never finish.

    Preemption: SIGTERM and SIGUSR1 (what SLURM sends ahead of a kill; torchrun forwards them to
    every worker) only set a flag. `should_stop()` is called by every rank at the same points
    (each optimizer step, each evaluation batch that every rank has); at some of them, the
    checks, the ranks all-reduce the flag on a CPU group of their own, so all of them see the
    same answer at the same point and stop there. A check comes at least every CHECK_SECONDS of
    work, and at every step that takes longer: each check also agrees on how many calls until
    the next one, from the slowest rank's recent pace. (An all-reduce at every step of a tiny
    model costs a fifth of its time on a busy CPU; once every CHECK_SECONDS, nothing to see.)
    A phase that begins (`first=True`: a validation's first batch) checks at once.

    Stalls: a thread samples where this rank's main thread is. When it has waited in a
    collective, without progress, for most of ddp.timeout_minutes, the first rank to notice
    reads every rank's last report from the rendezvous store, prints once which rank did not
    arrive and the file and line it was at, and has every rank leave.
    """

    CHECK_SECONDS = 0.1
    MAX_CALLS_BETWEEN_CHECKS = 10_000

    def __init__(self, env: DistEnv, timeout_minutes: float):
        self.env = env
        self.progress = 0  # bumped by the main thread at every step and evaluation batch
        self.next_check = 1  # the call (progress) of the next check, the same on every rank
        self.checked = (0, 0.0)  # the last check's progress and time
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")  # collective: every rank
            global _WATCHDOG
            _WATCHDOG = Watchdog(self, timeout_minutes * 60)
            _WATCHDOG.start()

    def should_stop(self, first: bool = False) -> bool:
        """Whether every rank has agreed to stop for a preemption signal (collective)."""
        self.progress += 1
        if self.group is None:
            return bool(PREEMPTION_SIGNALS_RECEIVED)
        if self.progress < self.next_check and not first:
            return False
        now = time.perf_counter()
        calls, since = self.progress - self.checked[0], now - self.checked[1]
        # Calls that take about CHECK_SECONDS at this rank's pace since the last check (one
        # until there is a pace); the all-reduce keeps the smallest proposal (the max of -n).
        proposal = 1 if self.checked[0] == 0 else min(
            self.MAX_CALLS_BETWEEN_CHECKS, max(1, int(self.CHECK_SECONDS * calls / since)))
        flags = torch.tensor([1.0 if PREEMPTION_SIGNALS_RECEIVED else 0.0, -proposal])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        stop, agreed = flags.tolist()
        self.next_check, self.checked = self.progress + int(-agreed), (self.progress, now)
        return stop > 0


COLLECTIVE_FILES = (f"{os.sep}torch{os.sep}distributed{os.sep}",
                    f"{os.sep}torch{os.sep}autograd{os.sep}", f"{os.sep}torch{os.sep}_tensor.py")


_WATCHDOG: "Watchdog | None" = None  # this rank's, where there is a process group


class Watchdog(threading.Thread):
    """Supervisor's stall detector (see there); a daemon thread per rank.

    Not faulthandler.dump_traceback_later, the process group's timeout or the flight recorder
    alone: they dump every rank's stack alike (waiting ranks included), gloo's timeout names no
    peer, and the flight recorder is NCCL's; none says which rank did not arrive, in one line."""

    def __init__(self, supervisor: Supervisor, timeout_s: float):
        super().__init__(name="stall-watchdog", daemon=True)
        self.supervisor, self.rank = supervisor, supervisor.env.rank
        self.period = min(5.0, max(0.5, timeout_s / 12))
        self.patience = timeout_s - 2 * self.period  # claim before the collective times out
        self.main_id = threading.main_thread().ident
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"stall-watchdog/{attempt}/"
        # A client of its own on the rendezvous store (torchrun's MASTER_ADDR / MASTER_PORT).
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False, timeout=datetime.timedelta(seconds=30))
        self.reported = threading.Event()  # the job's stall is reported (by any rank)
        self.leaving = threading.Event()

    def stall_reported(self) -> bool:
        """Whether a rank has reported the job stalled: then a collective that fails on this
        rank failed because the ranks are leaving, and this one should leave as they do."""
        if not self.reported.is_set():
            with contextlib.suppress(Exception):  # the store's host may be gone already
                if self.store.check([f"{self.prefix}abort"]):
                    self.reported.set()
        return self.reported.is_set()

    def where(self) -> tuple[str, bool]:
        """The main thread's innermost frame of the project (file:line in function), and
        whether it is waiting in a collective (torch.distributed, or backward under DDP)."""
        frame = sys._current_frames().get(self.main_id)
        stack = traceback.extract_stack(frame) if frame else []
        waiting = any(any(part in entry.filename for part in COLLECTIVE_FILES)
                      for entry in stack[-8:])
        ours = [entry for entry in stack if str(PROJECT_DIR) in entry.filename] or stack
        if not ours:
            return "unknown", waiting
        last = ours[-1]
        where = f"{os.path.relpath(last.filename, PROJECT_DIR)}:{last.lineno} in {last.name}"
        return where, waiting

    def run(self) -> None:
        seen, since = None, time.monotonic()
        while True:
            time.sleep(self.period)
            where, waiting = self.where()
            progress = self.supervisor.progress
            if progress != seen or not waiting:
                seen, since = progress, time.monotonic()
            report = {"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
                      "where": where, "waiting": waiting, "progress": progress,
                      "waited": time.monotonic() - since}
            with contextlib.suppress(Exception):  # the store may be gone at the job's end
                self.store.set(f"{self.prefix}rank{self.rank}", json.dumps(report))
                if self.stall_reported():
                    self.leave()
                if report["waited"] >= self.patience and self.store.add(
                        f"{self.prefix}claim", 1) == 1:
                    self.report_stall()
                    self.leave()

    def report_stall(self) -> None:
        """Print who stalled and where, once for the job; then every rank leaves."""
        world = dist.get_world_size()
        reports = []
        for rank in range(world):
            with contextlib.suppress(Exception):
                reports.append(json.loads(self.store.get(f"{self.prefix}rank{rank}")))
        stalled = [r for r in reports if not r["waiting"]] or reports
        silent = sorted(set(range(world)) - {r["rank"] for r in reports})
        lines = [f"rank {r['rank']} ({r['host']}, pid {r['pid']}) at {r['where']}"
                 for r in stalled]
        waited = max((r["waited"] for r in reports), default=0.0)
        message = (f"the job stalled: {'; '.join(lines)} did not reach the collective the other "
                   f"ranks waited {waited:.0f} s in (ddp.timeout_minutes)"
                   + (f"; rank(s) {silent} sent no report" if silent else ""))
        print(f"error: {message}", file=sys.stderr, flush=True)
        _tell_run_sh("stalled")
        self.reported.set()
        self.store.set(f"{self.prefix}abort", "1")

    def leave(self) -> None:
        """End this process, main thread and all, once the stall is reported. Rank 0 hosts the
        store (run.sh gives each attempt its own), so it waits for the others to go first.
        Called by the watchdog, or by the main thread when its collective failed meanwhile:
        the first caller ends the process, the other waits for it."""
        if self.leaving.is_set():
            threading.Event().wait()
        self.leaving.set()
        world = dist.get_world_size()
        with contextlib.suppress(Exception):
            gone = self.store.add(f"{self.prefix}gone", 1)
            deadline = time.monotonic() + 3 * self.period
            while self.rank == 0 and gone < world and time.monotonic() < deadline:
                time.sleep(0.05)
                gone = self.store.add(f"{self.prefix}gone", 0)
        exit_now(0 if os.environ.get("RUN_SH_STATUS_FILE") else STALLED_EXIT)


UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"
_SMOKE_TEST = False  # set by no_retries(): a failure ends the job, reported once


def debug_mode() -> None:
    """ddp.debug: PyTorch's distributed debug mode for this process; call before the process
    group starts. TORCH_DISTRIBUTED_DEBUG=INFO: DDP names the parameters that got no gradient and
    logs its set-up and statistics. Not DETAIL, which would also check every collective for the
    same shapes on all ranks: with it DDP's constructor crashes (segmentation fault) in torch
    2.13 on the CPU; a DETAIL set in the environment is kept, to try on your own setup."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG") not in ("INFO", "DETAIL"):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
    dist.set_debug_level_from_env()


def no_retries() -> None:
    """A run that must not be retried (train.fast_dev_run): under run.sh, an error ends the job
    at once, its traceback printed by the first rank that fails and by no other."""
    global _SMOKE_TEST
    _SMOKE_TEST = True


def is_transient(error: BaseException) -> bool:
    """Whether a failure may not happen again, so a restart from the last checkpoint is worth
    it: a loader worker killed (out of memory), a network or file-system hiccup. An exception of
    the code or the data (a bug, a bad sample, a model that does not fit) comes back the same."""
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    if isinstance(error, OSError):
        return error.errno in (errno.EIO, errno.ESTALE, errno.EAGAIN, errno.EINTR)
    return isinstance(error, RuntimeError) and "DataLoader worker (pid" in str(error)


def _report_failure(error: BaseException) -> NoReturn:
    """A rank raised: print the traceback once for this machine, and, under run.sh, end the
    job for a failure that would only come back (the ranks of a restart leave at once).

    Exit 1, so that torchrun stops the other ranks now (a rank waiting in an NCCL collective
    would otherwise wait for its timeout). Which rank prints: the first to create a file beside
    run.sh's status file; without run.sh, every failing rank."""
    rank = os.environ.get("RANK", "0")
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if _is_peer_failure(error):
        # Another rank failed (its own report says why) or was killed: leave quietly;
        # torchrun stops the job, or restarts it from the last checkpoint.
        if not _job_failed():
            print(f"rank {rank}: stopping, another process of the job is gone", file=sys.stderr)
        exit_now(1)
    try:
        if status_file:
            os.close(os.open(f"{status_file}.reported", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        print(f"rank {rank} failed:\n{''.join(traceback.format_exception(error))}",
              file=sys.stderr, end="")
    except FileExistsError:
        pass  # another rank of this machine has printed its own
    if _SMOKE_TEST or not is_transient(error):
        _tell_run_sh("failed")
    exit_now(1)


def _job_failed() -> bool:
    """Whether a rank of this run.sh launch has failed in a way that a restart would repeat."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    with contextlib.suppress(OSError):
        return bool(status_file) and Path(status_file).read_text().startswith(("failed",
                                                                                "error:"))
    return False


def _uncaught(kind: type, error: BaseException, trace) -> None:
    """sys.excepthook under run.sh: an error before run_main (a user file that does not
    import) is reported like one inside it, once and not retried."""
    if issubclass(kind, Exception):
        _report_failure(error)
    sys.__excepthook__(kind, error, trace)


if os.environ.get("RUN_SH_STATUS_FILE"):
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and _job_failed():
        # torchrun restarted the ranks after a failure that would come back (reported once):
        # they leave at once, torchrun ends, and run.sh exits 1.
        os._exit(0)
    sys.excepthook = _uncaught


def run_main(main: Callable[[list[str]], None]) -> None:
    """Run an entry point: a UserError prints once and exits 2; any other error prints its
    traceback once, from the rank it happened on, and exits 1; the group is always left. A
    crash in native code (segmentation fault, abort) prints every thread's Python stack."""
    faulthandler.enable()
    handle_signals()
    try:
        main(sys.argv[1:])
    except UserError as error:
        if getattr(error, "raised_alone", False):  # (streams.DataError, from a read mid-run)
            _exit_alone_on_user_error(str(error))
        _exit_on_user_error(str(error))
    except Preempted as stop:
        if is_rank_0() and stopped_by_torchrun():  # the job re-forms: not an end of it
            print(f"stopped by torchrun: {stop}", file=sys.stderr, flush=True)
        elif is_rank_0():  # (with replica groups, each group's run.sh exits 75)
            print(f"preempted: {stop}", file=sys.stderr, flush=True)
            _tell_run_sh("preempted")
        leave(0 if os.environ.get("RUN_SH_STATUS_FILE") else PREEMPTED_EXIT)
    except KeyboardInterrupt:
        # Ctrl-C: leave at once. No destroy_process_group: a peer interrupted in the middle of
        # a collective would leave it waiting (torchrun then kills the job after its timeout).
        exit_now(130)
    except Exception as error:
        if UNUSED_PARAMETERS in str(error):
            # DDP's own message is a page long; the fix is one setting. Every rank runs the same
            # model, so every rank gets here and they agree as for any input mistake.
            names = re.search(r"Parameters which did not receive grad for rank \d+: (.+)",
                              str(error))
            which = (f": {names.group(1).strip()}" if names
                     else " (ddp.debug=true names them)")
            _exit_on_user_error(
                f"the model has parameters that got no gradient{which}; a branch that forward "
                "did not use: set ddp.find_unused_parameters=true, or remove them")
        if _WATCHDOG is not None and _WATCHDOG.stall_reported():
            # A peer stalled and the job is ending (the report is printed): the collective
            # this rank waited in failed because the others left. Leave as they do, without
            # a failure that torchrun would restart into the same stall.
            _WATCHDOG.leave()
        # No destroy_process_group: with a peer gone it could wait for that peer forever.
        _report_failure(error)
    # Not the interpreter's teardown (see leave): freed there, a DDP model can also abort the
    # process (SIGABRT, "terminate called without an active exception"), which torchrun takes
    # for a failure.
    leave(0)
