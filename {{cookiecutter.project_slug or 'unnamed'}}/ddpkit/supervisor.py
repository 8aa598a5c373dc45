"""Preemption signals and stalls: SIGTERM / SIGUSR1 noted and acted on at a step every rank agrees
on (Supervisor.should_stop), or, in a one-shot command, at once (stop_at_once); and a watchdog
thread that names the rank a stalled job waits for.
"""

import atexit
import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ddpkit.dist_utils import DistEnv
from ddpkit.exits import STALLED_EXIT, exit_now, tell_run_sh
from ddpkit.project import PROJECT_DIR

log = logging.getLogger("ddp")


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
    if status_file and os.path.exists(f"{status_file}.interrupted"):
        # run.sh is stopping the launch (Ctrl-C, or a signal before torchrun had workers): a
        # worker that starts only now, that ignored the SIGINT while it was starting, or that
        # torchrun restarted, leaves at once as the others did (exit 0: torchrun restarts none).
        exit_now(0)
    if status_file and os.path.exists(f"{status_file}.preempted"):
        PREEMPTION_SIGNALS_RECEIVED.append(signal.SIGTERM)
    # An older torchrun was started with these blocked (launcher.signals_kept_from), and this
    # process inherited the mask: one that came meanwhile is handled now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (*PREEMPTION_SIGNALS, signal.SIGINT, signal.SIGHUP))


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


# What stops a command that stops at once: SIGHUP (a closed terminal) as SIGTERM, as run.sh has it.
STOP_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGHUP)


class Stopped(BaseException):
    """A command that stops at once (stop_at_once) got a stop signal. A BaseException, as
    KeyboardInterrupt is: no `except Exception` on its way words it as a failure."""


def stop_at_once() -> None:
    """For a one-process command that writes its result at its end (sample.py, export.py, the
    token preparation, evaluate.py of one process): SIGTERM, SIGUSR1 and SIGHUP raise Stopped
    and Ctrl-C raises KeyboardInterrupt, wherever the main thread is, so the command ends now
    and what it was writing is removed (writes.write_whole). A signal noted before this call
    (by handle_signals, or by run.sh's mark) stops it here. While it ends, further signals are
    ignored: its clean-up is not cut short."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in STOP_SIGNALS:
        signal.signal(number, _stop)
    signal.signal(signal.SIGINT, _interrupt_and_hold)
    if PREEMPTION_SIGNALS_RECEIVED:
        _stop(PREEMPTION_SIGNALS_RECEIVED[0], None)


def _ignore_further_signals() -> None:
    for number in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)


def _stop(number, frame) -> None:
    _ignore_further_signals()
    raise Stopped(f"stopped by {signal.Signals(number).name}")


def _interrupt_and_hold(number, frame) -> None:
    try:
        _interrupt_once(number, frame)
    except KeyboardInterrupt:
        _ignore_further_signals()
        raise


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that stopped training, on rank 0: its message says where the run stands."""


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
            atexit.register(_WATCHDOG.stop)

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


# Where torch's own code runs a collective (and backward, whose DDP hooks all-reduce). torch has
# no API that says a thread is waiting in one; gloo names no late peer, and NCCL's flight
# recorder is NCCL's alone. test_cluster's stall test fails if these paths stop matching.
COLLECTIVE_FILES = (f"{os.sep}torch{os.sep}distributed{os.sep}",
                    f"{os.sep}torch{os.sep}autograd{os.sep}", f"{os.sep}torch{os.sep}_tensor.py")


_WATCHDOG: "Watchdog | None" = None  # this rank's, where there is a process group


def running_watchdog() -> "Watchdog | None":
    """This rank's stall watchdog, once a Supervisor of a job of several processes started it."""
    return _WATCHDOG


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
        self.stopping = threading.Event()

    def stop(self) -> None:
        """End the thread, from the exit handlers (before the interpreter's teardown).

        A daemon thread still running at the teardown is ended by the interpreter where it next
        takes the interpreter lock; the watchdog takes it on coming back from a store call, in
        native code that cannot be unwound, and the process aborts ("terminate called without an
        active exception"; seen as a rank of a finished run killed by SIGABRT)."""
        if threading.current_thread() is self:
            return
        self.stopping.set()
        self.join(timeout=30)  # the store's own timeout bounds a call in flight

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
        while not self.stopping.wait(self.period):
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
        tell_run_sh("stalled")
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
