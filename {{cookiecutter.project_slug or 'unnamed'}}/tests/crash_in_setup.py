"""train.py with a crash in native code planted: rank CRASH_RANK dies of CRASH_SIGNAL (SIGSEGV or
SIGABRT) as it wraps the model, before the run has written anything to its folder.

Run by test_faults.py through run.sh, to see how a worker that crashes (no Python runs after
it: no exception, no exit handler) ends the job.
"""

import faulthandler
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import lifecycle, parallel, run_setup  # noqa: E402

real_wrap = parallel.wrap_model


def crashing_wrap_model(*args, **kwargs):
    if os.environ["RANK"] == os.environ["CRASH_RANK"]:
        print(f"rank {os.environ['RANK']} crashes now", flush=True)
        crash = faulthandler._sigsegv if os.environ["CRASH_SIGNAL"] == "SIGSEGV" else os.abort
        crash()
    return real_wrap(*args, **kwargs)


run_setup.wrap_model = crashing_wrap_model

if __name__ == "__main__":
    lifecycle.run_main(train.main)
