"""train.py with a bug planted: rank FAIL_RANK raises ValueError at optimizer step FAIL_STEP.

Run by test_faults.py through run.sh, to see how a real exception in one worker ends the job.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import lifecycle  # noqa: E402

real_step = train.train_step
calls = [0]


def train_step_with_bug(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(os.environ["FAIL_STEP"]) and os.environ["RANK"] == os.environ["FAIL_RANK"]:
        raise ValueError(f"planted bug at step {calls[0]}")
    return real_step(*args, **kwargs)


train.train_step = train_step_with_bug

if __name__ == "__main__":
    lifecycle.run_main(train.main)
