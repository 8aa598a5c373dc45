"""A worker that crashes in native code under run.sh (a segmentation fault, an abort, a bus error,
an illegal instruction, a floating-point exception) is not started again:

    python -m ddpkit.crash_report FOLDER   (run.sh, once torchrun has ended: FOLDER is its launch's)

A crashed process runs no Python, so each worker's faulthandler writes its Python stack to a file
of its own beside run.sh's status file (`status.crash.<attempt>.<rank>`) instead of to stderr.
The workers torchrun restarts after a crash find that file and leave at once: the crash would
come back the same. run.sh then runs ddpkit/crash_report.py, which prints the first crash's stack
and one line naming the rank and the signal, removes the run folder the launch made if it holds
nothing but its markers (.lock, .job_id), and exits 1 (0, saying nothing, when no worker
crashed). This module is the workers' side: imported by every worker, it needs no torch.

A crash in a thread of a library's own, with no Python frame (NCCL's watchdog aborting after a
peer was lost), is not the code's: torchrun restarts the workers, as after a killed one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import re
import signal
from pathlib import Path

# faulthandler's first line for each fatal signal: "Fatal Python error: Segmentation fault"
SIGNALS = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT,
           "Bus error": signal.SIGBUS, "Illegal instruction": signal.SIGILL,
           "Floating-point exception": signal.SIGFPE}
STATUS_NAME = "status"  # run.sh's status file in its launch folder ($RUN_SH_STATUS_FILE)

_open_files: list = []  # faulthandler writes to these: open for the life of the process


@dataclasses.dataclass(frozen=True)
class Crash:
    rank: str
    attempt: int
    text: str  # what faulthandler wrote

    @property
    def words(self) -> str:
        return self.text.partition("Fatal Python error: ")[2].partition("\n")[0].strip()

    @property
    def of_the_code(self) -> bool:
        """The crash came in a Python thread, in a call the code made (faulthandler names it
        "Current thread"), not in a native thread of a library's own."""
        return "\nCurrent thread " in self.text

    def where(self) -> str:
        """The innermost Python frame of the crashing thread: 'f (file line n)'."""
        stack = self.text.partition("\nCurrent thread ")[2]
        frame = re.search(r'File "(.+)", line (\d+) in (\S+)', stack)
        if not frame:
            return ""
        path = re.sub(r".*/(site-packages|lib/python3\.\d+)/", "", frame[1])
        with contextlib.suppress(ValueError):
            path = str(Path(path).relative_to(Path.cwd()))
        return f" in {frame[3]} ({path} line {frame[2]})"


def record(status_file: str) -> None:
    """faulthandler, for a worker under run.sh: its crash goes to a file of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    handle = open(f"{status_file}.crash.{attempt}.{os.environ.get('RANK', '0')}", "w")  # noqa: SIM115
    _open_files.append(handle)
    faulthandler.enable(handle)


def crashes(status_file: str) -> list[Crash]:
    """The crashes of the code this launch's workers recorded, the earliest attempt first."""
    found = []
    for path in Path(status_file).parent.glob(f"{Path(status_file).name}.crash.*.*"):
        _, attempt, rank = path.name.rsplit(".", 2)
        with contextlib.suppress(OSError):
            crash = Crash(rank, int(attempt), path.read_text(errors="replace"))
            if crash.words in SIGNALS and crash.of_the_code:
                found.append(crash)
    return sorted(found, key=lambda crash: (crash.attempt, int(crash.rank)))


def leave_after_a_crash() -> None:
    """A worker torchrun restarted after a worker of this launch crashed in the code leaves at
    once, before it imports torch: exit 0, so that torchrun ends, and `crashed` for run.sh."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if status_file and attempt and any(crash.attempt < attempt
                                       for crash in crashes(status_file)):
        Path(status_file).write_text("crashed\n")
        os._exit(0)
