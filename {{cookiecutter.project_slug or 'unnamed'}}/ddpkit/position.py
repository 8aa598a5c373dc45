"""Where training is (Position: optimizer steps done, the epoch, the steps done within it) and the
random generators of a process, as tensors and plain data: the small state a checkpoint keeps
besides the model and optimizer, so that a resumed run continues exactly.
"""

import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Position:
    """Where training is: optimizer steps done, the epoch, and the steps done within it."""

    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0


def rng_state() -> dict:
    """This process's random number generators, as tensors and plain data (weights_only-safe)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, python_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "python": {"version": version, "internal": list(internal), "gauss": python_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
