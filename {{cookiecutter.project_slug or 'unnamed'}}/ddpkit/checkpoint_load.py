"""Reading checkpoints: safely (tensors and plain data, never code: `weights_only=True`, and DCP's
metadata read by an unpickler that allows its own classes only), at any process count and with
either strategy (DCP reshards), with every mistake (a truncated or foreign checkpoint, a model of
another shape) in one line; a checkpoint of an older format brought up to this one (migrate),
one this engine cannot read refused in one line; and a resume's restore of everything a checkpoint
holds.
"""

import logging
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ddpkit import __version__
from ddpkit.checkpoint_files import (
    FORMAT_VERSION,
    OLDEST_FORMAT,
    PRE_RELEASE_FORMAT,
    REQUIRED_PARTS,
    SHARDED_PARTS,
    STATE_FILE,
)
from ddpkit.config import UserError
from ddpkit.dist_utils import DistEnv
from ddpkit.position import Position, set_rng_state

log = logging.getLogger("ddp")


MODEL_PREFIXES = ("module.", "_orig_mod.")  # added by DDP and by torch.compile


def clean_state_dict(state_dict: dict) -> dict:
    """Keys without DDP's `module.` or torch.compile's `_orig_mod.`, so any wrapping loads them."""
    cleaned = {}
    for key, value in state_dict.items():
        while key.startswith(MODEL_PREFIXES):
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned


def cause_of(error: BaseException, kind: type = OSError):
    """The exception of `kind` behind a failure (DCP wraps each rank's exception in a
    CheckpointException), if there is one."""
    seen = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if id(current) in seen or current is None:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        stack += [current.__cause__, current.__context__]
        for failure in getattr(current, "failures", {}).values():  # CheckpointException
            stack.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this reads it without running code: only DCP's own metadata
    classes, torch's sizes, dtypes and layouts, and paths may appear in it."""

    def find_class(self, module: str, name: str):
        allowed = (module in ("torch.distributed.checkpoint.metadata",
                              "torch.distributed.checkpoint.filesystem")
                   or (module == "torch" and (name == "Size" or isinstance(
                       getattr(torch, name, None), torch.dtype | torch.layout
                       | torch.memory_format)))
                   or (module, name) == ("torch.serialization", "_get_layout")
                   or (module == "pathlib" and name in ("PosixPath", "PurePosixPath",
                                                         "WindowsPath", "PureWindowsPath")))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read by _MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor values (optimizer hyperparameters) loaded as
    tensors and plain data only (weights_only=True)."""

    def load_bytes(self, read_item, value) -> None:
        # Checked with weights_only (a pickle beyond plain data raises here), then handed to
        # DCP's own load_bytes, which puts the value back into the caller's nested state dict
        # (the learning rate and other hyperparameters of the optimizer's param_groups).
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def _read_metadata(path: Path) -> Metadata:
    try:
        return SafeReader(path).read_metadata()
    except FileNotFoundError:
        raise UserError(f"cannot load checkpoint {path}: its .metadata is missing (not a "
                        "complete checkpoint folder)") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as error:
        raise UserError(f"cannot load checkpoint {path}: its .metadata is damaged or holds "
                        f"Python objects beyond checkpoint metadata ({error})") from None


def load_checkpoint(path: Path, map_location="cpu", resuming: bool = False) -> dict:
    """A checkpoint's small state (its state.pt), in this engine's format (migrate), or a model
    export's whole content; loaded safely (`weights_only=True`: tensors and plain data, never
    code). `resuming`: the whole state is needed, not only the weights."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights_only" in str(error):
            raise UserError(
                f"refusing to load checkpoint {file}: it holds Python objects beyond tensors and "
                "plain data, which could run code when loaded; re-save it with state_dict()s only"
            ) from None
        raise UserError(f"cannot load checkpoint {file}: it is not a PyTorch checkpoint") from None
    except Exception:  # a truncated zip archive, or another kind of file
        raise UserError(
            f"cannot load checkpoint {file}: the file is truncated or not a PyTorch checkpoint"
        ) from None
    if not isinstance(state, dict) or ("model" not in state and "step" not in state):
        raise UserError(f"{file} is not a checkpoint of this project (no 'model' entry)")
    if file.name != STATE_FILE:
        return state
    state = migrate(state, path, resuming)
    check_requires(state, path)
    return state


# Formats older than OLDEST_FORMAT: what changed since, which this engine cannot undo, for the
# one line that refuses to resume one (their weights still load: evaluate.py, export.py).
RETIRED_FORMATS = {PRE_RELEASE_FORMAT: (
    "before template release 1.0.0, before the optimizer and LR-schedule rewrite (optimizers by "
    "name, biases and norm weights in a group without weight decay), so its optimizer state "
    "does not fit this engine's")}


def written_format(state: dict) -> int:
    """The checkpoint format a state.pt was written in: its `format_version`; without one
    (written before it was recorded), 1, or PRE_RELEASE_FORMAT for one from before release
    1.0.0's optimizer and schedule rewrite, which saved no `plateau` entry."""
    if "format_version" in state:
        return state["format_version"]
    return 1 if "plateau" in state else PRE_RELEASE_FORMAT


def migrate(state: dict, path: Path, resuming: bool = False) -> dict:
    """A checkpoint's state.pt in this engine's format: an older format brought up to date
    (each step is one function of MIGRATIONS); a newer one, or one too old to resume, refused in
    one line that says which release wrote it and what to do."""
    found = written_format(state)
    if type(found) is not int or found < PRE_RELEASE_FORMAT:
        raise UserError(f"cannot load checkpoint {path}: its {STATE_FILE} holds format_version "
                        f"{found!r}, which no template release wrote: the file is damaged; give "
                        "an earlier checkpoint of the run")
    if found > FORMAT_VERSION:
        release = state.get("template_version")
        raise UserError(
            f"cannot load checkpoint {path}: it was written by "
            f"{f'template release {release}' if release else 'a later template release'}, "
            f"checkpoint format {found}, which this engine (release {__version__}, format "
            f"{FORMAT_VERSION}) does not know: update the project to that release or a later one "
            "(cruft update, docs/updates.md), or load it with the project that wrote it")
    if found < OLDEST_FORMAT and resuming:
        raise UserError(
            f"cannot resume from {path}: it was written {RETIRED_FORMATS[found]}: finish that run "
            "with your project as it was before `cruft update` (its previous commit), or start "
            "a new run; evaluate.py and export.py still read its weights")
    for version in range(max(found, OLDEST_FORMAT), FORMAT_VERSION):
        state = MIGRATIONS[version](state)
    return state


def check_requires(state: dict, path: Path) -> None:
    """The parts a checkpoint says a reader must understand (its `requires`: part -> the
    release that first wrote it), each known to this engine; one that is not is refused in one
    line, where a reader that did not look would drop it."""
    requires = state.get("requires", {})
    if not isinstance(requires, dict) or not all(
            isinstance(name, str) and isinstance(release, str)
            for name, release in requires.items()):
        raise UserError(f"cannot load checkpoint {path}: its {STATE_FILE} holds a `requires` "
                        f"entry no template release wrote ({requires!r}): the file is damaged; "
                        "give an earlier checkpoint of the run")
    unknown = {name: release for name, release in requires.items()
               if name not in REQUIRED_PARTS}
    if not unknown:
        return
    names = " and ".join(f"'{name}'" for name in unknown)
    needed = max(unknown.values(), key=_release_order)
    raise UserError(
        f"cannot load checkpoint {path}: it holds {'parts' if len(unknown) > 1 else 'a part'} "
        f"{names}, written by template release {needed}, which this engine (release "
        f"{__version__}) does not know and would drop: update the project to release {needed} "
        "or a later one (cruft update, docs/updates.md), or read the checkpoint with the "
        "project that wrote it")


def _release_order(release: str) -> tuple:
    """A release number (1.10.0) as numbers to compare; anything else after them."""
    parts = release.split(".")
    return tuple(int(part) for part in parts) if all(p.isdigit() for p in parts) else (
        float("inf"), release)


def _format_1_to_2(state: dict) -> dict:
    # Format 2 always has its manifest, which verified() checked before this (a format-1
    # checkpoint may have none); nothing in state.pt changed but the entry that says so.
    return {**state, "format_version": 2}


# format N -> the function that brings a state.pt of format N to N + 1.
MIGRATIONS = {1: _format_1_to_2}


def _check_keys(path: Path, metadata: Metadata, targets: dict) -> None:
    """One line when the checkpoint's tensors do not match the model's (DCP alone would load a
    subset silently, or fail with a page of detail)."""
    for name in ("model",):
        if name not in targets:
            continue
        saved = {key.split(".", 1)[1] for key in metadata.state_dict_metadata
                 if key.startswith(f"{name}.")}
        wanted = set(targets[name])
        missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
        if missing or unexpected:
            detail = "; ".join(part for part in (
                f"missing {', '.join(missing[:5])}" if missing else "",
                f"unexpected {', '.join(unexpected[:5])}" if unexpected else "") if part)
            raise UserError(f"checkpoint {path} does not fit the model: {detail}")


def _skip_unsaved_optimizer_state(targets: dict, metadata: Metadata) -> None:
    """Leave out of the optimizer's targets the parameters the checkpoint holds no state for.

    An optimizer makes a parameter's state at its first gradient, so one that never had any (a
    head the run leaves unused) has none in a checkpoint; a fresh optimizer's state_dict() holds
    every parameter's (torch fills it), and DCP would ask the checkpoint for the missing ones.
    A parameter with part of its state missing is still asked for: that is damage."""
    state = targets.get("optimizer", {}).get("state")
    if not state:
        return
    prefix = "optimizer.state."
    # A state entry's own name (step, exp_avg, momentum_buffer) has no dot; a parameter's may.
    saved = {key[len(prefix):].rsplit(".", 1)[0] for key in metadata.state_dict_metadata
             if key.startswith(prefix)}
    for name in [name for name in state if name not in saved]:
        del state[name]


def read_sharded(path: Path, targets: dict, distributed: bool) -> None:
    """Fill `targets` (part name -> its state dict, in the layout of this run: plain tensors, or
    this rank's shards) from a checkpoint folder, in place. DCP reads what each rank needs,
    whatever the number of processes or the strategy that saved it."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(targets, storage_reader=SafeReader(path), planner=SafeLoadPlanner(),
                     no_dist=not distributed)
    except (Exception, CheckpointException) as error:
        detail = " ".join(str(error).split())
        if cause_of(error, pickle.UnpicklingError) is not None:
            raise UserError(f"refusing to load checkpoint {path}: it holds Python objects beyond "
                            "tensors and plain data, which could run code when loaded") from None
        if "size mismatch" in detail.lower():
            raise UserError(f"checkpoint {path} does not fit the model: a tensor's shape "
                            f"differs ({one_line(error)})") from None
        if (cause := cause_of(error)) is not None:
            raise UserError(f"cannot load checkpoint {path}: {cause}") from None
        raise UserError(f"cannot load checkpoint {path}: reading its shards failed "
                        f"({one_line(error)}), so a file is likely truncated or damaged: copy it "
                        "again, or give an earlier checkpoint") from None


def one_line(error: BaseException) -> str:
    """A failure in one short line: the exception a rank raised inside DCP (not DCP's wrapper,
    whose text is every rank's traceback), its first sentence."""
    root = next(iter(getattr(error, "failures", {}).values()), error)
    root = root[0] if isinstance(root, tuple) else root
    text = " ".join(str(root).split()).split(". ")[0][:200]
    return f"{type(root).__name__}: {text}" if text else type(root).__name__


def read_tensors(path: Path, part: str = "model") -> dict:
    """One part's tensors in a checkpoint folder, whole, keyed by their flat names (the model's:
    parameter names; the optimizer's: `state.<parameter>.<name>`), read on this process alone
    with no model needed: what export.py writes, and what a test compares."""
    metadata = _read_metadata(path)
    prefix = f"{part}."
    tensors = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
               for key, entry in metadata.state_dict_metadata.items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    read_sharded(path, {part: tensors}, distributed=False)
    return tensors


def read_model(path: Path) -> dict:
    """The whole model's weights in a checkpoint folder, keyed by parameter name."""
    return read_tensors(path, "model")


def saved_parts(path: Path) -> set[str]:
    """The parts whose tensors a checkpoint folder holds: model, optimizer, and ema where its
    run kept averaged weights."""
    return _parts_in(_read_metadata(path))


def _parts_in(metadata: Metadata) -> set[str]:
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def read_weights(path: Path, averaged: bool) -> dict:
    """A checkpoint folder's whole model state, keyed by name: as trained (its `model` part), or
    with its averaged weights (its `ema` part) in place of the trained parameters."""
    weights = read_model(path)
    return with_averages(weights, read_tensors(path, "ema")) if averaged else weights


def with_averages(weights: dict, averages: dict) -> dict:
    """A model's state with the averages in place of its trained parameters; its buffers (and
    any frozen parameter) as they are. The averages are keyed as named_parameters() lists the
    parameters, a shared one once (the GPT's head.weight is its token_embedding.weight): a key
    without an average of its own whose trained tensor equals an averaged key's, bit for bit,
    is that parameter under its other name (a shared parameter's keys always hold the same
    tensor) and takes its average too, or loading would put the trained one back."""
    averaged = {**weights, **averages}
    for name, tensor in weights.items():
        if name in averages:
            continue
        twin = next((other for other in averages if _same(weights[other], tensor)), None)
        if twin is not None:
            averaged[name] = averages[twin]
    return averaged


def _same(one: torch.Tensor, other: torch.Tensor) -> bool:
    return (one.shape == other.shape and one.dtype == other.dtype
            and torch.equal(one, other))


def load_model_weights(model: torch.nn.Module, source: Path, weights: dict) -> None:
    """Weights read from `source` (a checkpoint or a model export) into the bare model, on this
    process alone."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # missing / unexpected keys, shape mismatch
        detail = " ".join(str(error).split())[:300]
        raise UserError(f"checkpoint {source} does not fit the model: {detail}") from None


def restore_parts(source: Path, parts: dict, env: DistEnv) -> Position:
    """Everything a checkpoint holds back into `parts` (name -> object with state_dict() and
    load_state_dict(), or None), on every rank (collective); returns the position."""
    state = load_checkpoint(source, resuming=True)
    metadata = _read_metadata(source)
    saved = _parts_in(metadata)
    if env.is_main:
        for line in dropped_parts(source, state, saved, parts):
            log.warning(line)
    targets = {name: parts[name].state_dict() for name in SHARDED_PARTS
               if parts.get(name) is not None and (name in saved or name != "ema")}
    _check_keys(source, metadata, targets)
    _skip_unsaved_optimizer_state(targets, metadata)
    read_sharded(source, targets, distributed=dist.is_initialized())
    try:
        for name, part in parts.items():
            if name in targets:
                part.load_state_dict(targets[name])
            elif name == "ema" and part is not None:  # saved without averages: start them
                part.restart()
            elif part is not None and state.get(name) is not None:
                part.load_state_dict(state[name])
        position = Position(*(int(state[k]) for k in ("step", "epoch", "step_in_epoch")))
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise UserError(f"cannot resume from {source}: its optimizer or position does not fit "
                        f"this run ({error})") from None
    if state.get("world_size") == env.world_size and "rng" in state:
        set_rng_state(state["rng"][env.rank])
    elif env.is_main:  # a restart at another size, by hand or by an elastic job
        log.warning("world %s -> %d at step %d: model, optimizer and data position carry over "
                    "(resharded; the global batch and the epoch's order stay), random streams "
                    "(dropout) start afresh", state.get("world_size", "?"), env.world_size,
                    position.step)
    return position


def dropped_parts(source: Path, state: dict, saved: set[str], parts: dict) -> list[str]:
    """One line for each part a checkpoint holds that this run does not keep (its setting off:
    the user's choice), which a resume drops."""
    held = set(state.get("requires") or ()) | (saved & REQUIRED_PARTS.keys()) | {
        name for name in REQUIRED_PARTS if state.get(name) is not None}
    lines = []
    for name in sorted(held & REQUIRED_PARTS.keys()):
        if parts.get(name) is not None:
            continue
        part = REQUIRED_PARTS[name]
        then = state.get("config", {})
        for key in part.setting.split("."):
            then = then.get(key) if isinstance(then, dict) else None
        lines.append(f"resuming without {part.what} that {source} holds: {part.setting} is off "
                     f"in this run, so they are dropped ({part.setting}={str(then).lower()} "
                     "keeps them)")
    return lines
