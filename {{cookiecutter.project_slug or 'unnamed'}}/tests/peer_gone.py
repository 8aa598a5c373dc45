"""Two processes of a gloo group, started by test_dist_utils.py without torchrun (which would
stop rank 0 itself): rank 1 leaves, and rank 0 prints whether lifecycle.is_peer_failure takes the
error of its next all-reduce for a lost peer. Gloo raises a plain RuntimeError there, so that
check reads the error's text: this is what tells when a torch release changes it."""

import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddpkit.lifecycle import is_peer_failure  # noqa: E402

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
tensor = torch.ones(1000)
dist.all_reduce(tensor)
if dist.get_rank() == 1:
    os._exit(0)
try:
    for _ in range(100):  # the first all-reduce after the peer left may still go through
        dist.all_reduce(tensor)
    print("no error")
except Exception as error:
    print(f"peer failure: {is_peer_failure(error)} ({type(error).__name__}: "
          f"{' '.join(str(error).split())[:200]})")
os._exit(0)
