"""train.micro_batch_size=auto: the largest micro-batch that fits the GPU, found by trying.

Before the first step every process runs forward and backward on micro-batches of the first
training samples and reads the allocator's peak (torch.cuda.max_memory_reserved). The sizes
tried divide the process's share of the global batch, so the accumulation steps are whole and the
global batch stays what the config says. They double from 1 until one does not fit, then halve
the interval between the largest that fits and the smallest that does not. A size fits when its
peak stays under 90% of what the allocator could hold at the start (its free memory and what it
had): the rest is for fragmentation, the optimizer step's temporaries and batches longer than the
first samples. The ranks agree after each try (the largest peak counts; a rank out of memory
fails the size for all), so all of them choose the same size.

Before the optimizer's first step its state does not exist: the tries hold its planned bytes
(ddpkit/memory_plan.py) aside. Under DDP the tries run the module inside the wrapper, so no
gradient is all-reduced and a process that runs out of memory leaves no other waiting in a
collective. FSDP2 gathers weights inside forward and backward (and SyncBatchNorm all-reduces in
forward), so there a size is not tried when the line through the last two that fitted puts it
above the limit. The tries leave no trace:
random state forked, buffers (BatchNorm's running statistics) put back, gradients dropped.
"""

import contextlib
import logging
import math
from collections.abc import Callable

import torch
from omegaconf import DictConfig

from ddpkit import dist_utils
from ddpkit.parallel import unwrap
from ddpkit.project import UserError
from ddpkit.run_state import forward_backward

log = logging.getLogger("ddp")

HEADROOM = 0.9  # of the memory the allocator could hold: fragmentation, the optimizer's temporaries


class GpuMemory:
    """What the tries read of one GPU: the memory the allocator could hold, and a try's peak."""

    def __init__(self, device: torch.device):
        self.device = device

    def usable(self) -> int:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)

    @contextlib.contextmanager
    def measure(self):
        """Yields a dict whose "peak" is the allocator's peak while the block ran."""
        measured = {}
        torch.cuda.empty_cache()  # a larger try before leaves nothing held that counts here
        torch.cuda.reset_peak_memory_stats(self.device)
        yield measured
        torch.cuda.synchronize(self.device)
        measured["peak"] = torch.cuda.max_memory_reserved(self.device)


def memory_for(cfg: DictConfig, device: torch.device) -> GpuMemory | None:
    """The memory the tries read (train.micro_batch_size=auto on a GPU), None without auto; one
    line on any other device."""
    if cfg.train.micro_batch_size != "auto":
        return None
    if device.type != "cuda":
        raise UserError(f"train.micro_batch_size=auto finds the micro-batch by trying it on the "
                        f"GPU, and this run is on {device.type}: set a number of samples (e.g. "
                        f"train.micro_batch_size=8), or 0 for the global batch / processes")
    return GpuMemory(device)


def divisors(number: int) -> list[int]:
    return [size for size in range(1, number + 1) if number % size == 0]


def next_size(sizes: list[int], tried: dict[int, float], limit: float) -> int | None:
    """The size to try next, None when the search is over: the largest size up to twice the
    largest that fitted until one does not fit, then the middle of the sizes between the two."""
    fitted = [size for size, peak in tried.items() if peak <= limit]
    if not fitted:
        return None
    low = max(fitted)
    high = min((size for size, peak in tried.items() if peak > limit), default=math.inf)
    between = [size for size in sizes if low < size < high]
    if not between:
        return None
    if high == math.inf:  # still doubling (to the next size when none is at most double)
        return max([size for size in between if size <= 2 * low] or between[:1])
    return between[(len(between) - 1) // 2]


def predicted_over(size: int, tried: dict[int, float], limit: float) -> bool:
    """Whether the line through the two largest sizes that fitted puts `size` above `limit`."""
    fitted = sorted((tried_size, peak) for tried_size, peak in tried.items() if peak <= limit)
    if len(fitted) < 2:
        return False
    (small, low), (large, high) = fitted[-2:]
    return high + (high - low) / (large - small) * (size - large) > limit


# (accelerate's find_executable_batch_size halves on one process's OOM alone: here the ranks
# must agree, sizes must divide the share, and FSDP2 must not run out of memory mid-collective.)
def largest_fitting(sizes: list[int], peak_of: Callable[[int], float], limit: float,
                    predict: bool = False) -> tuple[int | None, dict[int, float], set[int]]:
    """The largest of `sizes` (ascending) whose peak_of(size) is within `limit` (inf: out of
    memory), the peaks of the sizes tried, and those not tried: with `predict`, a size that the
    line through the two largest that fitted puts over the limit fails without a try."""
    tried: dict[int, float] = {}
    predicted: set[int] = set()
    size = sizes[0]
    while size is not None:
        if predict and predicted_over(size, tried, limit):
            predicted.add(size)
            tried[size] = math.inf
        else:
            tried[size] = peak_of(size)
        size = next_size(sizes, tried, limit)
    fitted = [size for size, peak in tried.items() if peak <= limit]
    return max(fitted, default=None), tried, predicted


def choose_micro_batch(run, memory: GpuMemory) -> None:
    """Try micro-batch sizes on every rank, train with the largest that fits on all of them and
    say what was tried. Raises UserError when not even one sample a pass fits."""
    fsdp = run.cfg.parallel.strategy == "fsdp" and run.env.launched
    model = unwrap(run.model)  # DDP's module (no all-reduce in a try), uncompiled; FSDP2's own
    # FSDP2's gathers and SyncBatchNorm's all-reduce run inside a try: no size predicted over
    collectives = fsdp or (run.cfg.model.sync_batchnorm and run.env.world_size > 1)
    limit = min(dist_utils.gather_objects(HEADROOM * memory.usable()))

    def peak_of(size: int) -> float:
        return max(dist_utils.gather_objects(try_size(run, model, memory, size)))

    with holding(optimizer_reserve(run, fsdp), run.device), untouched(model, run.device):
        size, tried, predicted = largest_fitting(divisors(run.data.batch_size_per_rank),
                                                 peak_of, limit, predict=collectives)
    tries = ", ".join(f"{tried_size}: {in_words(peak, tried_size in predicted)}"
                      for tried_size, peak in tried.items())
    peaks = f"peaks {tries}; limit {in_words(limit)}, {HEADROOM:.0%} of what the GPU could give"
    if size is None:
        raise UserError(f"train.micro_batch_size=auto: not even 1 sample a pass fits ({peaks}): "
                        "shard the model (parallel.strategy=fsdp), recompute activations "
                        "(speed.activation_checkpointing=1) or train in bf16")
    run.data.use_micro_batch(size)
    log.info("train.micro_batch_size=auto: %d sample(s) a pass, %d accumulation step(s) for the "
             "global batch of %d (%s); train.micro_batch_size=%d skips the tries", size,
             run.data.grad_accum_steps, run.cfg.train.global_batch_size, peaks, size)


def try_size(run, model: torch.nn.Module, memory: GpuMemory, size: int) -> float:
    """The peak of forward and backward of `size` samples on this rank; inf: out of memory."""
    batch = run.data.sample_batch(size)
    try:
        with memory.measure() as measured:
            forward_backward(model, batch, run.task, run.device, run.speed, None)
        return measured["peak"]
    except torch.OutOfMemoryError:
        return math.inf
    finally:
        for parameter in model.parameters():
            parameter.grad = None


def optimizer_reserve(run, fsdp: bool) -> int:
    """The bytes the optimizer's state will take at its first step (none once it has state: a
    resumed run), as ddpkit/memory_plan.py plans them."""
    if run.optimizer.state:
        return 0
    from ddpkit.memory_plan import plan  # here: only auto needs the plan (and its fake tensors)

    return plan(run.cfg, run.env.world_size)[1]["fsdp" if fsdp else "ddp"].optimizer or 0


@contextlib.contextmanager
def holding(size: int, device: torch.device):
    """`size` bytes taken on `device` while the block runs (never written)."""
    try:
        held = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    except torch.OutOfMemoryError:
        raise UserError(f"train.micro_batch_size=auto: the optimizer's state alone ("
                        f"{in_words(size)}) does not fit this GPU: shard it "
                        "(parallel.strategy=fsdp)") from None
    try:
        yield
    finally:
        del held


@contextlib.contextmanager
def untouched(model: torch.nn.Module, device: torch.device):
    """The random state and the model's buffers as they were before the block."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    buffer.copy_(buffers[name])


def in_words(peak: float, predicted: bool = False) -> str:
    from ddpkit.memory_plan import size

    if predicted:
        return "not tried, over on the line through the last two"
    return "out of memory" if peak == math.inf else size(int(peak))
