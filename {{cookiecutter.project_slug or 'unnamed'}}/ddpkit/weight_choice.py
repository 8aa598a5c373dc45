"""Which weights a reader takes, averaged or trained: one rule for every writer and reader
(docs/checkpoints.md, "Which weights").

A run that keeps averaged weights (train.ema_decay > 0) has the averages as its weights:
validation scores them, the best checkpoint is judged on them, and model.pt, every export,
evaluate.py and sample.py use them. The trained weights are taken only when asked for
(export.py and sample.py `--weights trained`, evaluate.py `eval.weights=trained`). A checkpoint
folder holds both (the `model` part, and the `ema` part where its run kept averages); a model
file holds one set and records which (`weights`). Each reader says which it took.
"""

import contextlib
import json
from pathlib import Path

from ddpkit.checkpoint_files import MODEL_FILE
from ddpkit.checkpoint_load import read_weights, saved_parts
from ddpkit.config import UserError
from ddpkit.report import SUMMARY_FILE

AVERAGED, TRAINED = "averaged", "trained"
CHOICES = ("auto", AVERAGED, TRAINED)  # auto: the source's own (the averages where it has them)


def held(source: Path, state: dict) -> tuple[str, ...]:
    """The weights a checkpoint folder or a model file holds, its own first."""
    if source.is_dir():
        return (AVERAGED, TRAINED) if "ema" in saved_parts(source) else (TRAINED,)
    return (recorded(source, state),)


def recorded(source: Path, state: dict) -> str:
    """Which weights a model file holds: its `weights` entry. A model.pt of release 1.x records
    none: it holds the averages where its run's summary.json says it exported them (from ema,
    or the best of a run with train.ema_decay), or, without a summary beside it, where its
    config says the run did (train.export=ema, or best with averages); else the trained ones."""
    if state.get("weights") in (AVERAGED, TRAINED):
        return state["weights"]
    train = (state.get("config") or {}).get("train") or {}
    exported = {"from": train.get("export")}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        summary = json.loads((source.parent / SUMMARY_FILE).read_text())
        if source.name == MODEL_FILE and isinstance(summary.get("exported"), dict):
            exported = summary["exported"]
    averaged = exported.get("from") == "ema" or (
        exported.get("from") == "best" and bool(train.get("ema_decay")))
    return AVERAGED if averaged else TRAINED


def choose(source: Path, state: dict, wanted: str, asked: str) -> str:
    """The weights to read from `source`: `wanted` (auto: the source's own), or one line when it
    does not hold them (`asked`: how the reader was asked, e.g. --weights averaged)."""
    have = held(source, state)
    if wanted == "auto":
        return have[0]
    if wanted in have:
        return wanted
    if source.is_dir():
        raise UserError(f"{asked}: {source} holds no averaged weights (its run kept none: "
                        "train.ema_decay=0): leave it out for the trained ones, or give a "
                        "checkpoint of a run trained with train.ema_decay")
    step = state.get("step")
    kept = source.parent / "checkpoints" / (f"step-{step:08d}" if isinstance(step, int)
                                            else "step-<N>")
    raise UserError(f"{asked}: {source} holds the {have[0]} weights only (a model file holds "
                    f"one set): give the checkpoint it was written from, {kept}")


def read(source: Path, state: dict, which: str) -> dict:
    """The chosen weights of a checkpoint folder or a model file, keyed by name."""
    if source.is_dir():
        return read_weights(source, which == AVERAGED)
    return state["model"]


def describe(which: str, source: Path, step) -> str:
    """How a reader names what it took: 'the averaged weights of <source> (step 40)'."""
    return f"the {which} weights of {source} (step {step})"
