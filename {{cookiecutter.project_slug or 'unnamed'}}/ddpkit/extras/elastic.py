"""Elastic membership (NNODES=MIN:MAX): the job shrinks when a node is lost and grows when one
joins, each time torchrun's agents stop the workers and start them again at the new size, from
the last checkpoint (README: "When a machine is lost").

Most of it is torchrun's (the c10d rendezvous) and the launcher's (launcher.py: the range,
RDZV_CONF; preflight.py: the global batch checked at every size the job can take); a resumed run
reshards its checkpoint at the new size (checkpoint_load.restore_parts). What a worker needs to
know besides is here, imported only once a stop signal came: whether the signal was torchrun's
(the job re-forms, no end of it) or the scheduler's (a preemption).
"""

import os


def stopped_by_torchrun() -> bool:
    """Whether a stop signal came from torchrun rather than from the scheduler or the user.
    Under run.sh, which notes every signal it passes on (beside its status file), a SIGTERM it
    did not pass on is torchrun's own: an elastic job's agent stops its workers when a node joins
    or leaves, and starts them again at the new size straight away."""
    status_file = os.environ.get("RUN_SH_STATUS_FILE")
    return bool(status_file) and not os.path.exists(f"{status_file}.preempted")
