"""evaluate.py that lets a test stop it inside the evaluation: preempt_in_validation.py's wait
(rank 0 creates the file PREEMPT_MARKER, every rank waits for its preemption signal) before the
first split is evaluated. Run by test_evaluate_faults.py through run.sh, which then sends SIGTERM:
the signal arrives while the job evaluates, however fast this machine is."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["PREEMPT_VALIDATION"] = "1"  # the first evaluation of a split

from preempt_in_validation import evaluate_after_the_signal  # noqa: E402

import evaluate  # noqa: E402
from ddpkit import lifecycle  # noqa: E402

evaluate.evaluate_split = evaluate_after_the_signal

if __name__ == "__main__":
    import torch

    torch.set_grad_enabled(False)
    lifecycle.run_main(evaluate.main)
