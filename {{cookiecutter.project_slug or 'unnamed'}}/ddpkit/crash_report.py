"""run.sh's side of a worker's crash in native code (ddpkit/crashes.py), once torchrun has ended:

    python -m ddpkit.crash_report FOLDER      (FOLDER: the launch's folder)

prints the first crash's stack and one line naming the rank and the signal, removes the run
folder the launch made if it holds nothing but its markers (.lock, .job_id), and exits 1; 0,
saying nothing, when no worker crashed.
"""

from __future__ import annotations

import contextlib
import fcntl
import sys
from pathlib import Path

from ddpkit.crashes import SIGNALS, STATUS_NAME, crashes


def remove_unused_run_folder(status_file: str) -> None:
    """The run folder this launch created, removed if no job holds it and it holds nothing but
    its markers (the crash came before the run wrote anything)."""
    from ddpkit.run_folder import LOCK_FILE, RUN_FOLDER_NOTE, RunDir  # (torch: after a crash)

    note = Path(status_file + RUN_FOLDER_NOTE)
    if not note.is_file():
        return
    folder = Path(note.read_text())
    with contextlib.suppress(OSError), open(folder / LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no job is in the folder now
        RunDir(folder, created=True).discard_if_unused()


def report(status_file: str) -> int:
    """Print the first crash's stack and one line on it; 1 if a worker crashed, else 0."""
    found = crashes(status_file)
    if not found:
        return 0
    first = found[0]
    ranks = sorted({crash.rank for crash in found if crash.attempt == first.attempt}, key=int)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(ranks)}"
    print(first.text.split("\nExtension modules:")[0].rstrip(), file=sys.stderr)
    remove_unused_run_folder(status_file)
    print(f"{who} crashed in native code ({first.words}, {SIGNALS[first.words].name})"
          f"{first.where()}: a crash of the code would only come back, so the job is not "
          "retried; the Python stack above shows the call that crashed", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(report(str(Path(sys.argv[1]) / STATUS_NAME)))
