"""train.py as one replica group of a test (tests/test_replicas.py), with a known failure.

Group LOSE_GROUP's rank 0 kills itself (SIGKILL) at optimizer step LOSE_AT, once (LOSE_MARKER
notes it); its torchrun starts the group again, and the group heals from the live one. While a
group is missing, each step of the others waits SLOW_STEP_S before it starts, so that the lost
group (a restart takes seconds; the whole run, about one) comes back while the run goes on, and
at the last step they wait for it, so that it comes back whatever the machine's speed. With
HOLD_AT instead, every group holds before that step until a preemption signal reaches it.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import lifecycle, supervisor  # noqa: E402
from ddpkit.extras.replicas import groups  # noqa: E402

real_step = groups.train_step  # a replica group's voted step


def lose_a_group(replicas, step: int) -> None:
    marker = Path(os.environ["LOSE_MARKER"])
    if (replicas.group == int(os.environ["LOSE_GROUP"]) and step == int(os.environ["LOSE_AT"])
            and os.environ["RANK"] == "0" and not marker.exists()):
        marker.write_text(str(step))
        os.kill(os.getpid(), signal.SIGKILL)
    if marker.exists() and replicas.participants() < replicas.groups:
        if step == replicas.run.total_steps:
            replicas.wait_for_every_group()
        else:
            time.sleep(float(os.environ["SLOW_STEP_S"]))


def train_step_of_a_group(model, optimizer, *args, **kwargs):
    replicas = optimizer.replicas
    step = replicas.run.position.step + 1
    if step == int(os.environ.get("HOLD_AT", "0")):
        while not supervisor.PREEMPTION_SIGNALS_RECEIVED:
            time.sleep(0.05)  # until run_replicas.sh passes the test's SIGTERM on
    if "LOSE_GROUP" in os.environ:
        lose_a_group(replicas, step)
    return real_step(model, optimizer, *args, **kwargs)


groups.train_step = train_step_of_a_group

if __name__ == "__main__":
    lifecycle.run_main(train.main)
