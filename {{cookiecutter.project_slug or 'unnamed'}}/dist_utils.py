"""Every distributed concern of the project, in one file.

The same scripts run as `python train.py` (one process, no process group) and under
`torchrun` (one process per GPU, or per CPU slot with gloo). Everything here reads torchrun's
environment and degrades to a no-op when there is only one process, so the training loop never
needs an `if distributed:` of its own.
"""

import contextlib
import datetime
import gc
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from config import UserError

log = logging.getLogger("ddp")


@dataclass(frozen=True)
class DistEnv:
    rank: int  # this process among all processes of the job
    local_rank: int  # this process among those on its machine: picks the GPU
    world_size: int  # processes in the job
    launched: bool  # started by torchrun (even with a single process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


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


def is_main_process() -> bool:
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


def init_distributed(env: DistEnv, device: torch.device, backend: str, timeout_minutes: float):
    """Join the process group (when launched by torchrun); a no-op for a single process."""
    if device.type == "cuda":
        # Before init: NCCL binds each process to the current device, and without this
        # every rank would create its context on GPU 0.
        torch.cuda.set_device(device)
    if not env.launched or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("ddp.backend=nccl needs CUDA GPUs: use ddp.backend=gloo on CPU")
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
    """Rank 0 logs at INFO; other ranks stay quiet unless something is wrong."""
    handler = logging.StreamHandler(sys.stdout)
    prefix = "" if env.is_main else f"[rank {env.rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if env.is_main else logging.WARNING)
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
        message = _describe_failures(messages)
    if message is not None:
        raise UserError(message)


def _describe_failures(messages: list) -> str | None:
    failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
    if not failed:
        return None
    if all(text == failed[0][1] for _, text in failed) and len(failed) == len(messages):
        return failed[0][1]  # the same on every rank: say it once, without ranks
    return f"rank {failed[0][0]}: {failed[0][1]}"


def _exit_on_user_error(message: str) -> None:
    """Print a user error once (rank 0, after hearing from every rank), then exit 2 everywhere.

    The ranks leave only after rank 0 has printed, so torchrun cannot cut rank 0 short by
    tearing the job down when another rank exits first.
    """
    rank = int(os.environ.get("RANK", "0"))
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            # The error came before the job's process group existed (e.g. a config typo with a
            # bare torchrun): a small CPU group just to agree on who reports it.
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        if dist.is_initialized():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
            if dist.get_rank() == 0:
                message = _describe_failures(messages)
                print(f"error: {message}", file=sys.stderr, flush=True)
                _tell_run_sh(message)
            dist.barrier()
        elif rank == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
            _tell_run_sh(message)
    except Exception:  # the other ranks are not coming: this rank alone hit the problem
        print(f"error (rank {rank}): {message}", file=sys.stderr, flush=True)
        os._exit(2)
    cleanup()
    # Under run.sh every rank has agreed and the error is on record: exit 0 so that torchrun
    # does not restart a job whose input is wrong; run.sh exits 2. Elsewhere: exit 2.
    sys.exit(0 if os.environ.get("RUN_SH_ERROR_FILE") else 2)


def _tell_run_sh(message: str) -> None:
    error_file = os.environ.get("RUN_SH_ERROR_FILE")
    if error_file:
        Path(error_file).write_text(message + "\n")


def _is_peer_failure(error: BaseException) -> bool:
    """A collective that broke because another process died: a consequence, not the cause."""
    backend_error = getattr(dist, "DistBackendError", ())
    text = str(error)
    return isinstance(error, backend_error) or (isinstance(error, RuntimeError) and any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer",
                                  "Broken pipe", "NCCL communicator was aborted")))


UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"


def run_main(main: Callable[[list[str]], None]) -> None:
    """Run an entry point: a UserError prints once and exits 2; any other error prints its
    traceback once, from the rank it happened on, and exits 1; the group is always left."""
    try:
        main(sys.argv[1:])
    except UserError as error:
        _exit_on_user_error(str(error))
    except KeyboardInterrupt:
        cleanup()
        sys.exit(130)
    except Exception as error:
        if UNUSED_PARAMETERS in str(error):
            # DDP's own message is a page long; the fix is one setting. Every rank runs the same
            # model, so every rank gets here and they agree as for any input mistake.
            _exit_on_user_error(
                "the model has parameters that got no gradient (a branch that forward did not "
                "use): set ddp.find_unused_parameters=true, or remove them")
        rank = os.environ.get("RANK", "0")
        if _is_peer_failure(error):
            # Another rank failed (its own report says why) or was killed: leave quietly;
            # torchrun stops the job, or restarts it from the last checkpoint.
            print(f"rank {rank}: stopping, another process of the job is gone", file=sys.stderr)
        else:
            print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, end="")
        sys.stderr.flush()
        # No destroy_process_group: with a peer gone it could wait for that peer forever.
        os._exit(1)
    # Free objects kept alive only by reference cycles (a DDP model often is) while the
    # interpreter and the process group are still whole: freed during interpreter shutdown
    # instead, a DDP model with a Python communication hook can abort the process (SIGABRT,
    # "terminate called without an active exception"), which torchrun takes for a failure.
    gc.collect()
    cleanup()
