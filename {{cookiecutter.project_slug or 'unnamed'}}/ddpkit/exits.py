"""How a process of the job ends, and how it tells run.sh the way the job ended (its status
file: `error: <message>`, `preempted`, `stalled`, `failed` or `crashed` (ddpkit/crashes.py),
which run.sh turns into exit status 2, 75, 1, 1 or 1; `interrupted`: rank 0 has said where a
Ctrl-C left the run, so run.sh adds no line of its own).
"""

import atexit
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.util
import os
import sys
from pathlib import Path
from typing import NoReturn

from ddpkit.dist_utils import cleanup

log = logging.getLogger("ddp")


def leave(code: int) -> NoReturn:
    """End a process that stops early (an error, a preemption) in order, but without the
    interpreter's own teardown: leave the process groups, run the exit handlers (logging,
    trackers, DataLoader workers), flush, and exit.

    The teardown would free what is still alive at the end (the DDP model, and the process
    group its reducer holds) with the interpreter lock held. Gloo's destructor joins its worker
    threads, and a worker still releasing the tensors of a collective that just finished waits
    for that lock: the process hangs for good (seen with torch 2.13 on a busy machine, once in a
    few preempted runs). os._exit skips the teardown; the kernel frees the rest.
    """
    cleanup()
    atexit._run_exitfuncs()
    exit_now(code)


def end_cleanly() -> None:
    """A run that finished, on every rank after the same last collective: the process groups left
    in order and what held them freed now, with no collective in flight (see leave for what a
    teardown with one can do); the interpreter then exits on its own, its `finally` blocks and
    exit handlers run.

    What is still alive then lives until the process ends, so it is frozen (gc.freeze): the
    interpreter's collections at exit skip it. Walking the millions of objects that importing
    torch made, only for the kernel to free their memory a moment later, cost about a second of
    CPU at the end of every process. Exit handlers and `finally` blocks still run, and what the
    teardown frees by reference count (a file a module held: flushed) is finalized as before; a
    reference cycle among the frozen objects is left to the kernel, as CPython leaves whatever
    outlives its teardown."""
    cleanup()
    gc.collect()
    gc.freeze()


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
    remove_torch_temp_folder()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def remove_torch_temp_folder() -> None:
    """The temporary folder torch 2.9 makes when torch.distributed.nn is imported (DCP imports
    it), for the source of its RemoteModule: its exit handler, which os._exit skips, removes it.
    (torch 2.10 and later make none, hence the lookup.)"""
    instantiator = sys.modules.get("torch.distributed.nn.jit.instantiator")
    folder = getattr(instantiator, "_TEMP_DIR", None)
    if folder is not None:
        with contextlib.suppress(OSError):
            folder.cleanup()  # (once: after that, or after the exit handler, it does nothing)


def world_size_given() -> int:
    """WORLD_SIZE as torchrun sets it; 0 when it is missing or not a number."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else 0


def tell_run_sh(status: str) -> None:
    """Tell run.sh how the job ended (its status file): `error: <message>`, `preempted`,
    `stalled` or `failed`. run.sh exits 2, 75, 1 or 1 for them, whatever torchrun returns
    (`interrupted`: 130, as for any Ctrl-C)."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    if status_file:
        Path(status_file).write_text(status + "\n")




STALLED_EXIT = 1


def job_failed() -> bool:
    """Whether a rank of this run.sh launch has failed in a way that a restart would repeat."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    with contextlib.suppress(OSError):
        return bool(status_file) and Path(status_file).read_text().startswith(("failed",
                                                                                "error:"))
    return False
