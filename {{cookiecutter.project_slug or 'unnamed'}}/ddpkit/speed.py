"""Speed settings: the `speed` section of the config, resolved for this run's device and data.

Each setting changes how fast a step runs, never what the model learns in exact arithmetic.
`auto` picks what pays off on the device at hand: on a recent GPU bf16 autocast, TF32,
channels_last for image batches and fused AdamW; on a CPU fused AdamW and plain float32, which
is both the fastest and the exactly reproducible precision there. See docs/speed.md.
"""

import contextlib
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from ddpkit.config import UserError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FUSED_ADAMW_DEVICES = ("cuda", "cpu")  # where PyTorch (2.4+) has a fused AdamW kernel
NO_AUTOCAST = contextlib.nullcontext()  # reusable: entering it does nothing


@dataclass(frozen=True)
class Speed:
    """The speed settings this run uses, `auto` resolved."""

    autocast_dtype: torch.dtype | None  # None: plain float32
    channels_last: bool
    compile: bool | str  # True: the whole model; "blocks": each repeated block (blocks.py)
    compile_mode: str
    fused_adamw: bool  # Adam / AdamW in one kernel where PyTorch has it (ddpkit/optimizers.py)
    activation_checkpointing: int = 0  # every k-th repeated block recomputed (ddpkit/blocks.py)
    float8: bool = False  # linear layers in float8 through torchao (extras/float8.py)

    def autocast(self, device: torch.device):
        """Mixed precision for forward and loss (backward follows the forward's dtypes)."""
        if self.autocast_dtype is None:
            return NO_AUTOCAST
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    @property
    def memory_format(self) -> torch.memory_format:
        """For `model.to(memory_format=...)`: channels_last applies to 4-D weights only."""
        return torch.channels_last if self.channels_last else torch.preserve_format

    def inputs(self, batch):
        """Model inputs (a tensor, or a dict of them) in the memory format the model expects."""
        if not self.channels_last:
            return batch
        if isinstance(batch, dict):
            return {key: self.inputs(value) for key, value in batch.items()}
        if isinstance(batch, torch.Tensor) and batch.dim() == 4:
            return batch.contiguous(memory_format=torch.channels_last)
        return batch


FLOAT32 = Speed(autocast_dtype=None, channels_last=False, compile=False, compile_mode="default",
                fused_adamw=False)  # every setting off


def resolve_speed(cfg: DictConfig, device: torch.device, input_shape: tuple | dict) -> Speed:
    """The settings of `cfg.speed` for this device and inputs; also sets TF32 (process-wide)."""
    cuda = device.type == "cuda"
    precision = cfg.speed.precision
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise UserError("speed.precision=bf16 needs a GPU with bfloat16 (Ampere or newer): use "
                        "speed.precision=fp16 on this GPU")
    if cuda:
        set_tf32(cfg.speed.tf32)
    image_batches = isinstance(input_shape, tuple) and len(input_shape) == 3  # C x H x W
    channels_last = cfg.speed.channels_last
    if channels_last is None:
        channels_last = cuda and image_batches
    return Speed(
        autocast_dtype=AUTOCAST_DTYPES.get(precision),
        channels_last=channels_last,
        compile=cfg.speed.compile,
        compile_mode=cfg.speed.compile_mode,
        fused_adamw=(device.type in FUSED_ADAMW_DEVICES if cfg.speed.fused_adamw is None
                     else cfg.speed.fused_adamw),
        activation_checkpointing=cfg.speed.activation_checkpointing,
        float8=checked_float8(cfg, device),
    )


def checked_float8(cfg: DictConfig, device: torch.device) -> bool:
    """speed.float8, refused in one line where it cannot run."""
    if cfg.speed.float8:
        from ddpkit.extras.float8 import check_float8

        check_float8(device)
    return cfg.speed.float8


def set_tf32(enabled: bool) -> None:
    """TensorFloat-32 for float32 matmuls and convolutions: ~8x the float32 math rate on Ampere
    and newer GPUs, with a 10-bit mantissa in the products (sums stay float32)."""
    mode = "tf32" if enabled else "ieee"
    if hasattr(torch.backends, "fp32_precision"):  # PyTorch 2.9+; the older flags are deprecated
        torch.backends.cuda.matmul.fp32_precision = mode
        torch.backends.cudnn.conv.fp32_precision = mode
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def grad_scaler(speed: Speed, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling (its small gradients would underflow to 0); bf16 and fp32 don't.

    With fused AdamW the scaler hands the inf/nan check to the optimizer's kernel, so a step
    needs no GPU -> CPU synchronisation; with other optimizers it reads one flag per step.
    """
    if speed.autocast_dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def describe_speed(speed: Speed) -> str:
    names = {dtype: name for name, dtype in AUTOCAST_DTYPES.items()}
    dtype = names.get(speed.autocast_dtype, "fp32")
    parts = [f"precision {dtype}"]
    if speed.channels_last:
        parts.append("channels_last")
    if speed.compile:
        scope = " of each block" if speed.compile == "blocks" else ""
        parts.append(f"torch.compile{scope} ({speed.compile_mode})")
    if speed.float8:
        parts.append("float8 linear layers (torchao)")
    every = speed.activation_checkpointing
    if every:
        parts.append("activation checkpointing of " + ("every block" if every == 1
                                                        else f"1 block in {every}"))
    return ", ".join(parts)
