"""Model FLOPs: how much arithmetic one training step does, and how much of the device's peak a
run gets (model FLOPs utilisation, MFU).

The count is made once, before training, by `torch.utils.flop_counter` on a copy of the model
built on the meta device: one forward, loss and backward of a micro-batch of the real shapes,
with no memory, no time on the device, and no effect on the real model, its BatchNorm statistics
or the random generators. A model that cannot run on meta tensors (one that reads values, or
Hugging Face models, whose attention masks are checked by value) is counted on the run's model
itself instead (up to MAX_COPY_BYTES of weights), which is then put back as it was: its
gradients, buffers (BatchNorm statistics), training mode and the random generators. (A copy of
the model would hold a second set of weights while it runs.) Matrix products and convolutions
are counted (2 FLOPs per
multiply-add), including the backward's gradients of weights and of inputs; element-wise work,
the optimizer and communication are not: this is the usual "model FLOPs" of MFU.

MFU = achieved model FLOPs per second of one device / that device's dense peak at the run's
precision, from PEAK_TFLOPS. A device missing from the table is reported as unknown: add its
datasheet's dense (not sparse) numbers to report it.
"""

import itertools
import logging
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger("ddp")

# Dense peak TFLOP/s per device, by the precision of the matrix products: bf16 (also fp16),
# tf32 (float32 with speed.tf32 on Ampere and later) and fp32. The first name that
# torch.cuda.get_device_name() contains wins, so more specific names come first.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    ("H200", {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    ("H800", {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    ("GH200", {"bf16": 989.0, "tf32": 495.0, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    ("L40", {"bf16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("RTX A6000", {"bf16": 154.8, "tf32": 77.4, "fp32": 38.7}),
    ("V100", {"bf16": 125.0, "fp32": 15.7}),  # fp16 tensor cores; no bf16, no tf32
    ("T4", {"bf16": 65.0, "fp32": 8.1}),  # fp16 tensor cores
    ("MI300X", {"bf16": 1307.0, "tf32": 654.0, "fp32": 163.4}),
]


def to_meta(value):
    """A batch (tensors, in dicts, lists and tuples) on the meta device: its shapes alone."""
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {key: to_meta(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(item) for item in value)
    return value


def count_training_flops(build: Callable[[], nn.Module], forward_and_loss, batch) -> int:
    """FLOPs of one forward, loss and backward of `batch` through the model `build()` makes.

    `build` runs with the meta device as the default, `batch` is moved there, and
    `forward_and_loss(model, batch)` returns the loss to differentiate. Raises what the model
    raises on meta tensors (a model that reads tensor values, with .item() say, cannot be
    counted this way).
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build()
        model.train()
        counter = FlopCounterMode(display=False)
        with counter:
            forward_and_loss(model, to_meta(batch)).backward()
    return counter.get_total_flops()


MAX_COPY_BYTES = 2 * 1024**3  # a larger model is not counted in place (its gradients' memory)


def count_in_place(model: nn.Module, forward_and_loss, batch) -> int | None:
    """FLOPs of one forward, loss and backward of `batch` through `model` itself (on the device
    it is on), which is then put back as it was: its gradients, buffers, each module's training
    mode, and the random generators. None for a model over MAX_COPY_BYTES or one that fails."""
    from torch.utils.flop_counter import FlopCounterMode

    size = sum(tensor.numel() * tensor.element_size()
               for tensor in itertools.chain(model.parameters(), model.buffers()))
    if size > MAX_COPY_BYTES:
        return None
    counter = FlopCounterMode(display=False)
    parameters = list(model.parameters())
    gradients = [parameter.grad for parameter in parameters]  # None before training
    buffers = [(buffer, buffer.clone()) for buffer in model.buffers()]
    modes = [(module, module.training) for module in model.modules()]  # some may be frozen
    with torch.random.fork_rng(devices=[]):  # dropout leaves the run's RNG as it was
        try:
            for parameter in parameters:  # the count's gradients are new tensors, dropped after
                parameter.grad = None
            model.train()
            with counter:
                forward_and_loss(model, batch).backward()
        except Exception:
            return None
        finally:
            with torch.no_grad():
                for parameter, gradient in zip(parameters, gradients, strict=True):
                    parameter.grad = gradient
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for module, training in modes:
                module.train(training)
    return counter.get_total_flops()


def peak_flops(device: torch.device, precision: str, tf32: bool) -> tuple[float | None, str]:
    """The device's dense peak FLOP/s at the run's precision, and the device's name; None for
    a device that is not a CUDA GPU in PEAK_TFLOPS."""
    if device.type != "cuda":
        return None, device.type
    name = torch.cuda.get_device_name(device)
    kind = "bf16" if precision in ("bf16", "fp16") else "tf32" if tf32 else "fp32"
    for known, peaks in PEAK_TFLOPS:
        if known in name:
            peak = peaks.get(kind, peaks["fp32"])
            return peak * 1e12, name
    return None, name


def describe_flops(flops_per_sample: float | None, peak: float | None, device_name: str,
             device: torch.device, tokens_per_sample: int | None = None) -> str:
    if flops_per_sample is None:
        return ("model FLOPs: not counted (the model runs neither on the meta device nor, up "
                f"to {MAX_COPY_BYTES / 1024**3:g} GiB of weights, itself on the CPU)")
    text = f"model FLOPs: {flops_per_sample / 1e9:.4g} GFLOP per training sample"
    if tokens_per_sample:  # a language model's window
        text += f" ({flops_per_sample / tokens_per_sample / 1e6:.4g} MFLOP per token)"
    if peak:
        return f"{text}; MFU against the {peak / 1e12:.0f} TFLOP/s peak of {device_name}"
    if device.type == "cuda":
        return (f"{text}; MFU unknown: {device_name} is not in flops.PEAK_TFLOPS (add its "
                "dense peak there)")
    return text
