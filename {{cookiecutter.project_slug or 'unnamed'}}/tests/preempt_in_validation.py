"""train.py that lets a test preempt it inside a validation: at validation number
PREEMPT_VALIDATION, rank 0 creates the file PREEMPT_MARKER and every rank waits for its
preemption signal before validating. Run by test_cluster.py through run.sh (and by
test_same_command.py on one process too), which then sends SIGTERM: the signal arrives while the
job is validating, however fast this machine is."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import lifecycle, supervisor, validation  # noqa: E402

real_evaluate = validation.evaluate_split
calls = [0]


def evaluate_after_the_signal(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(os.environ.get("PREEMPT_VALIDATION", "0")):  # (unset: run again)
        if os.environ.get("RANK", "0") == "0":  # (one process: no RANK)
            Path(os.environ["PREEMPT_MARKER"]).touch()
        while not supervisor.PREEMPTION_SIGNALS_RECEIVED:  # a signal cuts each wait short
            time.sleep(1)
    return real_evaluate(*args, **kwargs)


validation.evaluate_split = evaluate_after_the_signal

if __name__ == "__main__":
    lifecycle.run_main(train.main)
