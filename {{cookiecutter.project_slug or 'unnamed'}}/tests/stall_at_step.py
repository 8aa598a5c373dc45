"""train.py with a stall planted: rank STALL_RANK sleeps at optimizer step STALL_STEP, for longer
than any collective waits (ddp.timeout_minutes). Run by test_cluster.py through run.sh, to see
the stall reported, with the rank and the line it is stuck at, and the job ended."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import lifecycle  # noqa: E402

real_step = train.train_step
calls = [0]


def train_step_with_stall(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(os.environ["STALL_STEP"]) and os.environ["RANK"] == os.environ["STALL_RANK"]:
        time.sleep(3600)  # stuck here: the report must name this line
    return real_step(*args, **kwargs)


train.train_step = train_step_with_stall

if __name__ == "__main__":
    lifecycle.run_main(train.main)
