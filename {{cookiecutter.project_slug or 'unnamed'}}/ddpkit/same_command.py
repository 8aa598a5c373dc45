"""The same command again: what the lines that leave a run unfinished (a preemption, a Ctrl-C, a
run folder not continued) tell the user to run, with the command itself wherever it is known.

run.sh passes its own command line to the workers, shell-quoted (RUN_SH_COMMAND: empty on a job
of several nodes, where each node has a command of its own); a process started as `python
<script> ...` writes its own; under a bare torchrun the words say it. Which run folder the same
command then continues: run_folder.py (docs/checkpoints.md, "Which run the same command
continues"); replica groups find theirs by the job id alone, which the line names.
"""

import os
import shlex
import sys

RUN_SH_COMMAND = "RUN_SH_COMMAND"


def known_command() -> str | None:
    """The command line that started this job, shell-quoted: run.sh's on one machine, or
    `python <script> <arguments>`; None under a bare torchrun or on several nodes."""
    if RUN_SH_COMMAND in os.environ:
        return os.environ[RUN_SH_COMMAND] or None
    if "LOCAL_RANK" in os.environ:  # torchrun's, not run.sh's
        return None
    return shlex.join(["python", *sys.argv])


def run_again(*added: str) -> str:
    """'run the same command again', for a message: the command itself where it is known, with
    the arguments `added` at its end (run.dir=<folder>, say)."""
    if os.environ.get("REPLICA_GROUP") and not added:  # (extras/replicas/launch.py)
        return f"run the same command again with RDZV_ID={os.environ.get('DDP_JOB_ID', '')}"
    command, extra = known_command(), shlex.join(added)
    with_extra = f" with {extra} added" if added else " again"
    if command:
        return f"run the same command{with_extra}: {command}{' ' + extra if added else ''}"
    if RUN_SH_COMMAND in os.environ:
        return f"run the same command{with_extra} on every node"
    return f"run the same torchrun command{with_extra}"
