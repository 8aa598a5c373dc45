"""train.py with train.micro_batch_size=auto tried on the CPU, for test_micro_batch.py: a GPU's
memory is played by the bytes a try's forward saves for the backward (SavedBytes), each rank's
capacity given by AUTO_CAPACITY ("<rank 0's bytes>,<rank 1's bytes>,..."). A try that saves more
than its rank's capacity raises torch.OutOfMemoryError there, as the GPU's allocator would."""

import contextlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from ddpkit import lifecycle, micro_batch  # noqa: E402


class SavedBytes:
    """Bytes saved for the backward as memory: what grows with the micro-batch."""

    def __init__(self, capacity: int):
        self.capacity = capacity

    def usable(self) -> int:
        return self.capacity

    @contextlib.contextmanager
    def measure(self):
        measured = {"peak": 0}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            measured["peak"] += tensor.numel() * tensor.element_size()
            if measured["peak"] > self.capacity:
                raise torch.OutOfMemoryError(f"{measured['peak']} bytes, {self.capacity} here")
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield measured


def capacity() -> int:
    return int(os.environ["AUTO_CAPACITY"].split(",")[int(os.environ.get("RANK", "0"))])


def memory_on_the_cpu(cfg, device):
    return SavedBytes(capacity()) if cfg.train.micro_batch_size == "auto" else None


micro_batch.memory_for = memory_on_the_cpu

if __name__ == "__main__":
    lifecycle.run_main(train.main)
