"""An entry point's life in a process of the job: run_main installs what the process needs (the
signal handlers, faulthandler), runs the entry point, and ends the process the way the outcome
calls for: a mistake in the input is one line from rank 0 and exit 2; an exception, its traceback
once, from the rank it happened on, and exit 1; a preemption, exit 75 after the save; a clean
run, the interpreter's own exit.
"""

import datetime
import errno
import faulthandler
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import torch.distributed as dist

from ddpkit import collector_as_usual, crashes
from ddpkit.dist_utils import describe_failures, is_rank_0
from ddpkit.exits import (
    end_cleanly,
    exit_now,
    job_failed,
    leave,
    tell_run_sh,
    world_size_given,
)
from ddpkit.project import PREEMPTED_EXIT, UserError
from ddpkit.supervisor import (
    Interrupted,
    Preempted,
    Stopped,
    handle_signals,
    running_watchdog,
    stop_at_once,
)

log = logging.getLogger("ddp")


def _exit_on_user_error(message: str) -> None:
    """Print a user error once (rank 0, after hearing from every rank), then exit 2 everywhere.

    The ranks leave only after rank 0 has printed, so torchrun cannot cut rank 0 short by
    tearing the job down when another rank exits first.
    """
    rank = int(os.environ.get("RANK", "0"))
    try:
        if world_size_given() > 1 and "MASTER_ADDR" in os.environ and not dist.is_initialized():
            # The error came before the job's process group existed (e.g. a config typo with a
            # bare torchrun): a small CPU group just to agree on who reports it.
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        if dist.is_initialized():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
            if dist.get_rank() == 0:
                message = describe_failures(messages)
                print(f"error: {message}", file=sys.stderr, flush=True)
                tell_run_sh(f"error: {message}")
            dist.barrier()
        elif rank == 0 or not world_size_given():
            print(f"error: {message}", file=sys.stderr, flush=True)
            tell_run_sh(f"error: {message}")
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
    at once (job_failed), and exits now, so that torchrun stops the others (a peer failure)."""
    rank = int(os.environ.get("RANK", "0"))
    text = f"rank {rank}: {message}" if world_size_given() > 1 else message
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    try:
        if status_file:
            os.close(os.open(f"{status_file}.reported", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        tell_run_sh(f"error: {text}")
        print(f"error: {text}", file=sys.stderr, flush=True)
    except FileExistsError:
        pass  # another rank of this machine has reported
    exit_now(2)


def is_peer_failure(error: BaseException) -> bool:
    """A collective that broke because another process died: a consequence, not the cause.
    NCCL raises DistBackendError; gloo and torchft a plain RuntimeError, told by its text
    (test_dist_utils.py loses a real peer, so a torch release that changes it is found)."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(error)
    return isinstance(error, backend_error) or (isinstance(error, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                  "Broken pipe", "NCCL communicator was aborted",
                                  # torchft: the group's rank 0, which hosts its Manager, is gone
                                  'message: "transport error"', "status: Unavailable")))


UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"


_SMOKE_TEST = False  # set by no_retries(): a failure ends the job, reported once


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


def report_failure(error: BaseException) -> NoReturn:
    """A rank raised: print the traceback once for this machine, and, under run.sh, end the
    job for a failure that would only come back (the ranks of a restart leave at once).

    Exit 1, so that torchrun stops the other ranks now (a rank waiting in an NCCL collective
    would otherwise wait for its timeout). Which rank prints: the first to create a file beside
    run.sh's status file; without run.sh, every failing rank."""
    rank = os.environ.get("RANK", "0")
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if is_peer_failure(error):
        # Another rank failed (its own report says why) or was killed: leave quietly;
        # torchrun stops the job, or restarts it from the last checkpoint.
        if not job_failed():
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
        tell_run_sh("failed")
    exit_now(1)


_INSTALLED: list[bool] = []  # install() has run in this process


def install() -> None:
    """What a process of the job needs from its start, once: faulthandler (a crash in native
    code prints every thread's Python stack; under run.sh, to a file that run.sh prints once:
    ddpkit/crashes.py), the preemption and Ctrl-C handlers, and under run.sh, when torchrun
    restarted the ranks after a failure that would come back (reported once already) or a
    crash in native code, leaving at once: torchrun ends, and run.sh exits 1."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    crashes.leave_after_a_crash()  # (ddpkit.worker has looked already, before importing torch)
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if status_file:
        crashes.record(status_file)
    else:
        faulthandler.enable()
    handle_signals()
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if status_file and restarted and job_failed():
        os._exit(0)


def leave_interrupted(where: str = "") -> NoReturn:
    """Ctrl-C: leave at once, rank 0 saying `where` the run stands when training had started
    (run.sh then adds no line of its own). No destroy_process_group: a peer interrupted in the
    middle of a collective would leave it waiting. Under run.sh, which passed the Ctrl-C on and
    exits 130 itself, exit 0, so that torchrun restarts none of the workers; elsewhere 130."""
    if where:
        print(f"interrupted (SIGINT) {where}", file=sys.stderr, flush=True)
        tell_run_sh("interrupted")
    exit_now(0 if os.environ.get("RUN_SH_STATUS_FILE") else 130)


def run_main(main: Callable[[list[str]], None], one_shot: bool = False) -> None:
    """Run an entry point: a UserError prints once and exits 2; any other error prints its
    traceback once, from the rank it happened on, and exits 1; the group is always left. A
    crash in native code (segmentation fault, abort) prints every thread's Python stack. A run
    that finishes returns, and the process ends through the interpreter's own exit.

    one_shot: a command that writes its result at its end and has nothing to save on the way
    (sample.py, export.py, the token preparation, evaluate.py). In one process it stops at once
    on SIGTERM, SIGUSR1 or SIGHUP (one line, exit 75) and on Ctrl-C (exit 130), nothing half
    written (supervisor.stop_at_once); training, and a command of several processes, stop
    where every rank agrees to (supervisor.Supervisor)."""
    install()
    collector_as_usual()
    try:
        if one_shot and world_size_given() <= 1:
            stop_at_once()
        main(sys.argv[1:])
    except Stopped as stop:
        print(f"{stop}: nothing is left half written; run the same command again",
              file=sys.stderr, flush=True)
        tell_run_sh("preempted")  # (run.sh, of one process, exits 75)
        leave(0 if os.environ.get("RUN_SH_STATUS_FILE") else PREEMPTED_EXIT)
    except UserError as error:
        if getattr(error, "raised_alone", False):  # (streams.DataError, from a read mid-run)
            _exit_alone_on_user_error(str(error))
        _exit_on_user_error(str(error))
    except Preempted as stop:
        from ddpkit.extras.elastic import stopped_by_torchrun

        if is_rank_0() and stopped_by_torchrun():  # the job re-forms: not an end of it
            print(f"stopped by torchrun: {stop}", file=sys.stderr, flush=True)
        else:
            if is_rank_0():  # (with replica groups, each group's run.sh exits 75)
                print(f"preempted: {stop}", file=sys.stderr, flush=True)
            if os.environ.get("LOCAL_RANK", "0") == "0":  # every node's run.sh exits 75
                tell_run_sh("preempted")
        leave(0 if os.environ.get("RUN_SH_STATUS_FILE") else PREEMPTED_EXIT)
    except KeyboardInterrupt as stop:
        leave_interrupted(str(stop) if isinstance(stop, Interrupted) else "")
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
        watchdog = running_watchdog()
        if watchdog is not None and watchdog.stall_reported():
            # A peer stalled and the job is ending (the report is printed): the collective
            # this rank waited in failed because the others left. Leave as they do, without
            # a failure that torchrun would restart into the same stall.
            watchdog.leave()
        # No destroy_process_group: with a peer gone it could wait for that peer forever.
        report_failure(error)
    end_cleanly()  # then the interpreter's own exit
