"""The distributed primitives: rank, local rank and world size from torchrun's environment, the
device, the process group, the collectives the engine uses, rank-aware logging, and errors that
every rank agrees on.

The same scripts run as `python train.py` (one process, no process group) and under
`torchrun` (one process per GPU, or per CPU slot with gloo). Everything here reads torchrun's
environment and degrades to a no-op when there is only one process, so the training loop never
needs an `if distributed:` of its own. Importing this module changes nothing: how an entry
point's processes start and end (signals, errors, exits) is lifecycle.py, called by run_main.
"""

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddpkit.config import UserError

log = logging.getLogger("ddp")

@dataclass(frozen=True)
class DistEnv:
    rank: int  # this process among all processes of the job
    local_rank: int  # this process among those on its machine: picks the GPU
    world_size: int  # processes in the job
    launched: bool  # started by torchrun (even with a single process)
    # With replica groups (extras/replicas.py): whether this process's group is the one that
    # writes the run's files now. None: there is one group, the job.
    leads: Callable[[], bool] | None = field(default=None, compare=False)

    @property
    def is_main(self) -> bool:
        """The process that writes the run's files: rank 0 (of the leading replica group)."""
        return self.rank == 0 and (self.leads is None or self.leads())


def get_dist_env() -> DistEnv:
    """Rank, local rank and world size from torchrun's variables; one process without them."""
    if "RANK" not in os.environ:
        return DistEnv(rank=0, local_rank=0, world_size=1, launched=False)
    try:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        world_size = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UserError(
            "RANK is set but RANK, LOCAL_RANK and WORLD_SIZE are not all whole numbers: "
            "launch with torchrun (or ./run.sh), or unset RANK to run a single process"
        ) from None
    if not 0 <= rank < world_size:
        raise UserError(f"RANK={rank} must be between 0 and WORLD_SIZE-1={world_size - 1}")
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, launched=True)


def is_rank_0() -> bool:
    """Rank 0 of the process group: of the job, or with replica groups of this group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def select_device(env: DistEnv, requested: str) -> torch.device:
    """This rank's device: its own GPU (by local rank) when CUDA is used, else the CPU."""
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA GPU is visible: use train.device=auto")
    if env.local_rank >= torch.cuda.device_count():
        raise UserError(
            f"local rank {env.local_rank} has no GPU: this machine has "
            f"{torch.cuda.device_count()}; launch at most that many processes per node"
        )
    return torch.device("cuda", env.local_rank)


# NCCL's flight recorder: the last collectives of every rank, dumped when one times out (to
# /tmp/nccl_trace_rank_<rank> unless TORCH_FR_DUMP_TEMP_FILE says otherwise; read them with
# `torchfrtrace`). Set for the nccl backend; your own settings of these variables win. Every torch
# the project supports (2.9 on) reads the buffer's size as TORCH_FR_BUFFER_SIZE (its name since
# 2.8); the old name, TORCH_NCCL_TRACE_BUFFER_SIZE, would only make torch warn at every start.
FLIGHT_RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def init_distributed(env: DistEnv, device: torch.device, backend: str, timeout_minutes: float):
    """Join the process group (when launched by torchrun); a no-op for a single process."""
    if device.type == "cuda":
        # Before init: NCCL binds each process to the current device, and without this
        # every rank would create its context on GPU 0.
        torch.cuda.set_device(device)
    if not env.launched or dist.is_initialized():
        return
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UserError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: launch "
                        "with torchrun (or ./run.sh), which sets them all, or unset RANK and "
                        "WORLD_SIZE to run a single process")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("ddp.backend=nccl needs CUDA GPUs: use ddp.backend=gloo on CPU")
    if backend == "nccl":
        for name, value in FLIGHT_RECORDER_ENV.items():
            os.environ.setdefault(name, value)
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(minutes=timeout_minutes),
        device_id=device if device.type == "cuda" else None,
    )


def backend_name() -> str:
    return dist.get_backend() if dist.is_initialized() else "none (single process)"


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum_async(tensor: torch.Tensor):
    """Start summing a tensor over all ranks, in place; returns a handle to wait() on (None
    without a process group, where the sum is the tensor itself)."""
    if dist.is_initialized():
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
    return None


def gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj):
    """Rank 0's value of a picklable object, on every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def setup_logging(env: DistEnv) -> None:
    """Rank 0 logs at INFO; other ranks stay quiet unless something is wrong. With replica
    groups, rank 0 of each group logs, its lines marked with the group."""
    handler = logging.StreamHandler(sys.stdout)
    group = os.environ.get("REPLICA_GROUP")
    prefix = (f"[group {group}{f' rank {env.rank}' if env.rank else ''}] " if group is not None
              else "" if env.rank == 0 else f"[rank {env.rank}] ")
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if env.rank == 0 else logging.WARNING)
    log.propagate = False


@contextlib.contextmanager
def agree_on_errors() -> Iterator[None]:
    """Run a block that may raise UserError on some ranks only, and raise it on all of them.

    Every rank reaches the same all-gather whether its block failed or not, so a rank that
    failed never leaves the others waiting in a collective: they all stop together.
    """
    message = None
    try:
        yield
    except UserError as error:
        message = str(error)
    if dist.is_initialized():
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        message = describe_failures(messages)
    if message is not None:
        raise UserError(message)


def describe_failures(messages: list) -> str | None:
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return None
    if all(text == failed[0][1] for _, text in failed) and len(failed) == len(messages):
        return failed[0][1]  # the same on every rank: say it once, without ranks
    if [rank for rank, _ in failed] == [0]:
        return failed[0][1]  # rank 0 does the job's writing (lock, config, checkpoints)
    return f"rank {failed[0][0]}: {failed[0][1]}"



def debug_mode() -> None:
    """ddp.debug: PyTorch's distributed debug mode for this process; call before the process
    group starts. TORCH_DISTRIBUTED_DEBUG=INFO: DDP names the parameters that got no gradient and
    logs its set-up and statistics. Not DETAIL, which would also check every collective for the
    same shapes on all ranks: with it DDP's constructor crashes (segmentation fault) in torch
    2.13 on the CPU; a DETAIL set in the environment is kept, to try on your own setup."""
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG") not in ("INFO", "DETAIL"):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
    dist.set_debug_level_from_env()
