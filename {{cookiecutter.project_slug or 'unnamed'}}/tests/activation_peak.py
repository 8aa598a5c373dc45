"""Peak memory of one training step of the built-in GPT (8 blocks), beyond what the model and
its gradients hold: printed as MiB, with and without activation checkpointing.

    python tests/activation_peak.py EVERY     # EVERY: speed.activation_checkpointing (0: off)

Run by tests/test_blocks.py in a process of its own, so that the process's peak resident memory
(ru_maxrss) is this step's: the allocator hands the large activations back to the system once
they are freed, so the peak measures what was alive at once.
"""

import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit.blocks import checkpoint_activations  # noqa: E402
from ddpkit.config import load_config  # noqa: E402
from ddpkit.lm import build_gpt  # noqa: E402


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def resident_kib() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() // 1024


def main(every: int) -> None:
    torch.manual_seed(0)
    cfg = load_config(["model.name=gpt", "model.hidden_dim=128", "model.num_layers=8"]).model
    model = build_gpt(cfg, (256,), 256)
    if every:
        checkpoint_activations(model, every)
    tokens = torch.randint(0, 256, (16, 256))
    model(tokens[:1]).mean().backward()  # gradients allocated, kernels warmed up
    before = max(peak_kib(), resident_kib())
    model(tokens).logsumexp(-1).mean().backward()
    print(f"{(peak_kib() - before) / 1024:.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
