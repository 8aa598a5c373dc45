"""speed.float8: the model's linear layers trained in float8 through torchao (the float8 extra).

torchao's convert_to_float8_training swaps each chosen nn.Linear for its Float8Linear, whose
matrix products run on float8 tensor cores with dynamic per-tensor scaling, while the weights, the
optimizer and everything else stay as they were (bf16 autocast is the usual partner). It pays on
GPUs with float8 tensor cores (NVIDIA compute capability 8.9 or newer: L4, L40, RTX 40xx, H100,
H200, B200) and for layers large enough that the casts cost less than the faster product. Only
linear layers whose two sizes are multiples of 16 are swapped (the float8 kernel's rule), and
never the last layer of the model (the output head, which torchtitan keeps in high precision
too). Applied before activation checkpointing, FSDP2 and DDP wrap the model, as torchao asks.

Nothing here is imported unless speed.float8=true; torchao itself only then.
"""

import torch
from torch import nn

from ddpkit.config import UserError

FLOAT8_CAPABILITY = (8, 9)  # the first NVIDIA GPUs with float8 tensor cores (Ada, then Hopper)


def check_float8(device: torch.device) -> None:
    """One line unless this device trains in float8 and torchao is installed."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FLOAT8_CAPABILITY:
        where = (f"{torch.cuda.get_device_name(device)} (compute capability "
                 f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
                 if device.type == "cuda" else device.type)
        raise UserError(f"speed.float8=true needs an NVIDIA GPU with float8 tensor cores (compute "
                        f"capability 8.9 or newer: L4, RTX 40xx, H100 ...), and this run is on "
                        f"{where}: set speed.float8=false")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError("speed.float8=true needs torchao: pip install -e '.[float8]'") from None


def convert_to_float8(model: nn.Module, emulate: bool = False) -> int:
    """Swap the model's eligible nn.Linear layers for torchao's Float8Linear, in place; returns
    how many. `emulate`: float8 rounding done in higher precision (torchao's own switch, for
    testing on a machine without float8 hardware)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    last = linears[-1] if linears else None

    def eligible(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # torchao asks about every module on the way down
        return name != last and module.in_features % 16 == 0 and module.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=eligible,
                               config=Float8LinearConfig(emulate=emulate))
    return sum(type(module).__name__ == "Float8Linear" for module in model.modules())
