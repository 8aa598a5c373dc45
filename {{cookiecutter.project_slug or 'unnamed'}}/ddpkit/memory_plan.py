"""Will it fit? One training process's memory, planned before any process starts:

    python config.py --plan [--world-size N] [--config FILE] [key=value ...]

prints the bytes a process holds for parameters, gradients, optimizer state and (an estimate)
activations, under DDP and FSDP2 at the job's process count (--world-size, else NPROC_PER_NODE x
NNODES as run.sh reads them), against the GPU's memory where there is one. Nothing is allocated:
under torch's FakeTensorMode (tensors with a shape, dtype and device, no memory) the model is
built, one micro-batch of the data's shapes goes through forward and loss on the run's device and
precision, and the configured optimizer takes a step, so its state is what it makes.

DDP: each process holds it all; with ddp.gradient_as_bucket_view=false DDP's gradient buckets
are a second copy of the gradients. FSDP2: each process holds its row shard (1/N, rounded up) of
each parameter, gradient and optimizer state of the parameter's shape, and for a moment whole
weights: those outside the blocks and two blocks (running, fetched next), or all of them with
parallel.reshard_after_forward=false. Activations: the storages the forward saves for the
backward, each once, parameters left out. A checkpointed block (speed.activation_checkpointing)
keeps only its inputs and is recomputed in the backward; an outer saved_tensors_hooks sees
nothing inside it, so the trace runs without checkpointing, notes which block saved what, and
works out the peak from that. A model or optimizer that reads values (`.item()`) cannot run on
fake tensors: its part is left out, and the plan says so.
"""

import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
import traceback

import torch
from omegaconf import DictConfig
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ddpkit import recipes
from ddpkit.blocks import checkpoint_activations, repeated_blocks
from ddpkit.config import load_config
from ddpkit.data import DataModule, map_tensors
from ddpkit.dist_utils import DistEnv, select_device
from ddpkit.evaluation import loss_terms
from ddpkit.models import call_model
from ddpkit.optimizers import build_optimizer, check_optimizer
from ddpkit.parallel import build_model, fsdp_blocks
from ddpkit.project import PROJECT_DIR, UserError
from ddpkit.speed import describe_speed, resolve_speed
from ddpkit.tasks import build_task


@dataclasses.dataclass
class Traced:
    """What one traced step tells about the tensors a process holds (bytes)."""

    parameters: list[tuple[torch.Size, int, bool]]  # shape, bytes, trainable
    buffers: int  # whole on every process
    outside_blocks: int  # FSDP: the parameters outside its units (the root's own)
    largest_block: int  # FSDP: the largest unit's parameters
    states: list[list[tuple[torch.Size, int]]] | None = None  # each parameter's optimizer state
    activations: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)  # what could not be traced


@dataclasses.dataclass
class Footprint:
    """Bytes one process holds under one strategy (None: not known)."""

    parameters: int
    buffers: int
    gradients: int
    optimizer: int | None
    gathered: int
    activations: int | None

    @property
    def total(self) -> int:
        return sum(value or 0 for value in dataclasses.astuple(self))


def nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def shard(shape: torch.Size, size: int, world_size: int) -> int:
    """Bytes of the largest of `world_size` row shards of a tensor (FSDP2 pads to it)."""
    return -(-shape[0] // world_size) * (size // shape[0]) if shape and shape[0] else size


def footprints(traced: Traced, cfg: DictConfig, world_size: int, gathered_size: float = 1.0
               ) -> dict[str, Footprint]:
    """DDP's and FSDP2's bytes per process. `gathered_size`: bytes of a gathered weight per byte
    of the parameter (0.5: gathered in bf16 from float32)."""
    parameters = [(shape, size) for shape, size, _ in traced.parameters]
    trainable = [(shape, size) for shape, size, learns in traced.parameters if learns]
    states = [(shape, state_shape, state_size) for (shape, _), state in
              zip(parameters, traced.states or [[]] * len(parameters), strict=True)
              for state_shape, state_size in state]
    known = traced.states is not None
    whole = sum(size for _, size in parameters)
    ddp = Footprint(whole, traced.buffers, (1 if cfg.ddp.gradient_as_bucket_view else 2)
                    * sum(size for _, size in trainable),
                    sum(size for *_, size in states) if known else None, 0, traced.activations)
    gathered = (traced.outside_blocks + 2 * traced.largest_block
                if cfg.parallel.reshard_after_forward else whole)
    fsdp = Footprint(sum(shard(*p, world_size) for p in parameters), traced.buffers,
                     sum(shard(*p, world_size) for p in trainable),
                     sum(shard(state_shape, size, world_size) if state_shape == shape else size
                         for shape, state_shape, size in states) if known else None,
                     int(min(gathered, whole) * gathered_size), traced.activations)
    return {"ddp": ddp, "fsdp": fsdp}


class SavedTensors:
    """The storages a forward saves for the backward, each once (parameters and buffers left
    out): their bytes, the repeated blocks that saved each (None: outside them) and where in the
    forward it was first saved (the block running or last run; -1 before the first); and each
    block's input storages. The backward frees them in the reverse order."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module]):
        self.skip = {tensor.untyped_storage()._cdata
                     for tensor in [*model.parameters(), *model.buffers()]}
        self.saved: dict[int, tuple[int, set, int]] = {}  # storage: (bytes, owners, position)
        self.inputs: list[dict[int, int]] = [{} for _ in blocks]  # storage: bytes
        self.inside: list[int] = []  # the blocks running now, innermost last
        self.position = -1
        self.storages = []  # kept alive while counting, so that their addresses stay theirs
        self.handles = [handle for index, block in enumerate(blocks) for handle in (
            block.register_forward_pre_hook(functools.partial(self._enter, index),
                                            with_kwargs=True),
            block.register_forward_hook(self._leave))]

    def _enter(self, index: int, module, args, kwargs) -> None:
        self.inside.append(index)
        self.position = index
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                self.storages.append(storage := value.untyped_storage())
                self.inputs[index][storage._cdata] = storage.nbytes()

    def _leave(self, *_) -> None:  # (a forward hook that returns a value replaces the output)
        self.inside.pop()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.skip:
            self.storages.append(storage)
            _, owners, _ = self.saved.setdefault(storage._cdata,
                                                 (storage.nbytes(), set(), self.position))
            owners.add(self.inside[-1] if self.inside else None)
        return tensor

    def peak(self, checkpointed: set[int]) -> int:
        """The most bytes alive at once with the `checkpointed` blocks recomputed: at the
        backward's start (all that is saved, and the checkpointed blocks' inputs), or as it
        recomputes block i (what was saved before it, the inputs of blocks up to i, and what
        block i saves again)."""
        recomputed = dict.fromkeys(checkpointed, 0)
        kept = {}  # storage: (position, bytes)
        for key, (size, owners, position) in self.saved.items():
            if owners <= checkpointed:  # only checkpointed blocks saved it: recomputed
                recomputed[min(owners)] += size
            else:
                kept[key] = (position, size)
        for index in sorted(checkpointed, reverse=True):  # an input lives to its first block
            kept.update({key: (index - 0.5, size) for key, size in self.inputs[index].items()
                         if kept.get(key, (index,))[0] >= index})
        moments = [sum(size for _, size in kept.values())]
        moments += [sum(size for position, size in kept.values() if position < index)
                    + recomputed[index] for index in checkpointed]
        return max(moments)


@contextlib.contextmanager
def quiet_fake_tensors():
    """FakeTensorMode logs a traceback for each op that fails on fake tensors: the plan says it
    in one line instead."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.disabled, was = True, logger.disabled
    try:
        yield
    finally:
        logger.disabled = was


@quiet_fake_tensors()
def trace(build, forward_and_loss, batch, cfg: DictConfig, device: torch.device, speed
          ) -> Traced:
    """Build the model (`build()`), run `forward_and_loss(model, batch)` and one optimizer step
    on fake tensors on `device`, and read what a process would hold."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.random.fork_rng(devices=[]), device:  # built there: nothing to move
        model = build()
        batch = map_tensors(lambda tensor: mode.from_tensor(tensor).to(device), batch)
    units = [nbytes(unit.parameters()) for unit in fsdp_blocks(model)]
    traced = Traced([(p.shape, nbytes([p]), p.requires_grad) for p in model.parameters()],
                    nbytes(model.buffers()), nbytes(model.parameters()) - sum(units),
                    max(units, default=0))
    try:
        traced.activations = activations(model, mode, forward_and_loss, batch,
                                         speed.activation_checkpointing)
    except Exception as error:
        if isinstance(error, UserError):
            raise
        traced.notes.append(f"activations: not estimated, the forward failed on fake tensors "
                            f"({cause(error)})")
    try:
        with mode:
            optimizer = step_optimizer(model, cfg, speed)
    except Exception as error:
        if isinstance(error, UserError):
            raise
        traced.notes.append(f"optimizer state: not counted, optim.name={cfg.optim.name} cannot "
                            f"step on fake tensors ({cause(error)})")
        return traced
    traced.states = [[(t.shape, nbytes([t])) for t in optimizer.state.get(p, {}).values()
                      if isinstance(t, torch.Tensor)] for p in model.parameters()]
    return traced


def activations(model: nn.Module, mode: FakeTensorMode, forward_and_loss, batch, every: int
                ) -> int:
    """The activations' bytes at their peak (SavedTensors.peak), with activation checkpointing
    of every `every`-th repeated block (0: none)."""
    blocks = repeated_blocks(model)
    saved = SavedTensors(model, blocks)
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            forward_and_loss(model.train(), batch)
    finally:
        for handle in saved.handles:
            handle.remove()
    if every:  # the blocks found as the run finds them, or its one line
        checkpoint_activations(model, every)
    return saved.peak(set(range(len(blocks))[::every]) if every else set())


def step_optimizer(model: nn.Module, cfg: DictConfig, speed) -> torch.optim.Optimizer:
    """The run's optimizer over `model`, after one step (most make their state in it)."""
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter) if parameter.requires_grad else None
    optimizer = build_optimizer(model, cfg, speed.fused_adamw)
    optimizer.step()
    return optimizer


def cause(error: BaseException) -> str:
    """An exception in a few words: its type and first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def forward_and_loss(task, speed, device: torch.device, model: nn.Module, batch) -> torch.Tensor:
    """A training step's forward and loss (run_state.forward_backward's)."""
    with speed.autocast(device):
        outputs = call_model(model, speed.inputs(task.model_inputs(batch)))
        return loss_terms(task.loss(outputs, batch))["loss"]


def plan(cfg: DictConfig, world_size: int) -> tuple[str, dict[str, Footprint], list[str]]:
    """The run `cfg` describes at `world_size` processes: what is traced (a line), each
    strategy's footprint, and notes."""
    env = DistEnv(rank=0, local_rank=0, world_size=world_size, launched=True)
    device = select_device(env, cfg.train.device)
    check_optimizer(cfg)
    data = DataModule(cfg, env, torch.device("cpu"))
    task = build_task(cfg, data.splits)
    input_shape = task.input_shape(data.first_samples()[0])
    speed = resolve_speed(cfg, device, input_shape)
    build = functools.partial(build_model, cfg.model, input_shape, task.num_outputs)
    batch = data.sample_batch(data.micro_batch_size)
    try:
        traced = trace(build, functools.partial(forward_and_loss, task, speed, device), batch,
                       cfg, device, speed)
    except Exception as error:  # (a model that cannot be built on a fake GPU: the CPU's kernels)
        if device.type != "cuda" or isinstance(error, UserError):
            raise
        cpu = torch.device("cpu")
        traced = trace(build, functools.partial(forward_and_loss, task, speed, cpu), batch,
                       cfg, cpu, speed)
        traced.notes.append(f"traced with the CPU's kernels: a fake GPU failed ({cause(error)})")
    gathered_size = 1.0
    if device.type == "cuda" and speed.autocast_dtype is not None:  # FSDP's mp_policy
        gathered_size = speed.autocast_dtype.itemsize / 4
    notes = traced.notes
    if not cfg.ddp.gradient_as_bucket_view:
        notes.append("ddp: gradients twice, as ddp.gradient_as_bucket_view=false keeps DDP's "
                     "buckets beside them")
    if cfg.parallel.cpu_offload:
        notes.append("fsdp: parallel.cpu_offload=true keeps the parameters, gradients and "
                     "optimizer state in CPU memory")
    auto = " (train.micro_batch_size=auto: the largest it tries)" if (
        cfg.train.micro_batch_size == "auto") else ""
    traced_as = (f"micro-batch of {data.micro_batch_size} sample(s){auto} x "
                 f"{data.grad_accum_steps} accumulation step(s), {describe_speed(speed)}, on "
                 f"{device.type}")
    return traced_as, footprints(traced, cfg, world_size, gathered_size), notes


ROWS = (("parameters", "parameters"), ("buffers", "buffers"), ("gradients", "gradients"),
        ("optimizer state", "optimizer"), ("gathered weights", "gathered"),
        ("activations (estimate)", "activations"), ("total", "total"))


def size(count: int | None) -> str:
    if count is None:
        return "unknown"
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if count >= scale:
            return f"{count / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{count} B"


def table(parts: dict[str, Footprint], strategy: str) -> list[str]:
    """A row per part, a column per strategy; against the GPU's memory where there is one."""
    names = [f"{name} (configured)" if name == strategy else name for name in parts]
    lines = [" " * 24 + "".join(f"{name:>20}" for name in names)]
    for label, part in ROWS:
        values = [getattr(footprint, part) for footprint in parts.values()]
        if part != "buffers" or any(values):
            cells = ["-" if part == "gathered" and not value else size(value) for value in values]
            lines.append(f"{label:24}" + "".join(f"{cell:>20}" for cell in cells))
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0)
        shares = [f"{footprint.total / gpu.total_memory:.0%}" for footprint in parts.values()]
        lines.append(f"{'of the ' + size(gpu.total_memory):24}"
                     + "".join(f"{share:>20}" for share in shares) + f"  ({gpu.name})")
    return lines


def launch_world_size(environ=os.environ) -> tuple[int, str]:
    """NPROC_PER_NODE x NNODES (an elastic MIN:MAX at its MAX), as run.sh reads them: from the
    environment, else run.sh's defaults (the project's baked ones)."""
    script = PROJECT_DIR / "run.sh"
    text = script.read_text() if script.is_file() else ""
    values = {}
    for name in ("NPROC_PER_NODE", "NNODES"):
        default = re.search(r"\$\{" + name + r":-([0-9:]+)\}", text)
        values[name] = environ.get(name) or (default.group(1) if default else "1")
        if not re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", values[name]):
            raise UserError(f"{name}={values[name]} is not a whole number of at least 1: fix it, "
                            "or give --world-size N")
    count = int(values["NPROC_PER_NODE"]) * int(values["NNODES"].rpartition(":")[2])
    return count, (f"{count} process(es) (NPROC_PER_NODE={values['NPROC_PER_NODE']} x "
                   f"NNODES={values['NNODES']})")


def in_your_files(error: BaseException) -> str:
    """Where in a file of yours (not ddpkit's, nor an installed package's) an exception was
    raised: "model.py line 12: ", or ""."""
    skip = (sys.prefix, sys.base_prefix, str(PROJECT_DIR / "ddpkit"))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.realpath(frame.filename)
        if os.path.isfile(path) and not path.startswith(skip):
            inside = path.startswith(str(PROJECT_DIR))
            return f"{os.path.relpath(path, PROJECT_DIR) if inside else path} line {frame.lineno}: "
    return ""


def main(argv: list[str]) -> int:
    """`python config.py --plan [--world-size N] [--config FILE] [key=value ...]`."""
    try:
        if argv[:1] == ["--world-size"]:
            if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
                raise UserError("--world-size needs a whole number of processes, at least 1")
            world_size, processes = int(argv[1]), f"{argv[1]} process(es) (--world-size)"
            argv = argv[2:]
        else:
            world_size, processes = launch_world_size()
        recipes.load()
        cfg = load_config(argv, world_size)
        traced_as, parts, notes = plan(cfg, world_size)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # in a file of yours: one line naming it (train.py: traceback)
        print(f"error: the memory plan stopped: {in_your_files(error)}{cause(error)}",
              file=sys.stderr)
        return 2
    print("\n".join([f"memory per process at {processes}: {traced_as}",
                     *table(parts, cfg.parallel.strategy), *(f"note: {n}" for n in notes),
                     "activations: an estimate, what one micro-batch's forward keeps for the "
                     "backward; its temporaries, the data loader and the CUDA context come on "
                     "top (docs/speed.md)"]))
    return 0
