"""What DataLoader worker processes receive, checked before any of them starts.

With data.num_workers > 0 and a start method other than fork (forkserver, the default, or
spawn), each worker gets the split it reads, and the collate, by pickle. A lambda or a local
function in them cannot be pickled, and torch's error then comes from deep inside the loader with
no hint of the fix. Here the splits and the collate are pickled at start-up, without their tensors
and arrays (their bytes are never copied), so such a dataset is one line naming it and the fix.
"""

import io
import pickle

import numpy as np
import torch
from omegaconf import DictConfig

from ddpkit.config import UserError
from ddpkit.splits import Splits

UNPICKLABLE = (pickle.PicklingError, AttributeError, TypeError)  # what pickle raises for them


class _WithoutArrays(pickle.Pickler):
    """A pickler that walks the objects but leaves tensors and arrays out."""

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor | np.ndarray | torch.UntypedStorage | torch.TypedStorage):
            return id(obj)
        return None


def check_sendable(cfg: DictConfig, splits: Splits) -> None:
    """Each split and the collate pickle, as the loader workers will receive them."""
    if not cfg.data.num_workers or cfg.data.worker_start_method == "fork":
        return
    parts = {f"{name} split": getattr(splits, name) for name in ("train", "val", "test")}
    parts["collate"] = splits.collate
    for part, value in parts.items():
        try:
            _WithoutArrays(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        except UNPICKLABLE as error:
            method = cfg.data.worker_start_method
            raise UserError(
                f"data.dataset={cfg.data.dataset}: its {part} cannot be sent to the "
                f"data.num_workers={cfg.data.num_workers} loader processes, which "
                f"data.worker_start_method={method} starts by pickling it ({error}): use a "
                "module-level function instead of a lambda or a local function, or, on CPU, "
                "data.worker_start_method=fork") from None
