"""The search space and the plan drawn from it: parse_space splits a sweep's overrides into the
swept keys (a list `key=a,b,c`, split at the commas outside brackets and quotes, or a range
`key=loguniform(low,high)` for --random and --optuna, checked against the key's type) and the
fixed overrides; plan_trials draws each trial's settings once with an in-memory Optuna study (the
whole grid in an order shuffled by the seed, or --random's draws). optuna is imported here, on
first use (import_optuna): only a sweep pays for its import."""

import math
import re
from typing import Any

from ddpkit.config import UserError, schema_type

RANGE = re.compile(r"^(uniform|loguniform|int)\((.+),(.+)\)$")
BRACKETS = {"[": "]", "(": ")", "{": "}"}


def import_optuna():
    """optuna, imported on first use: only a sweep pays for its import (a second or so)."""
    try:
        import optuna
    except ModuleNotFoundError:
        raise UserError("sweeps need the optuna package, one of the project's dependencies: "
                        "pip install -e . in the project's environment") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _parse_range(item: str, key: str, ranged: re.Match, random_search: bool) -> tuple:
    """(kind, low, high) of a `key=kind(low,high)` override, checked."""
    if not random_search:
        raise UserError(f"{item}: a range needs --random N (a grid takes lists: {key}=a,b,c)")
    kind, low, high = ranged.groups()
    declared = schema_type(key)
    if declared not in (int, float, Any):  # a draw is a number: a string or a flag takes none
        raise UserError(f"{item}: {key} is not a number: give it a list of values, "
                        f"e.g. {key}=a,b")
    if declared is int and kind != "int":
        raise UserError(f"{item}: {key} takes whole numbers: use int({low},{high})")
    try:
        low_value, high_value = float(low), float(high)
    except ValueError:
        raise UserError(f"{item}: the range's ends must be numbers") from None
    if not low_value < high_value or (kind == "loguniform" and low_value <= 0):
        raise UserError(f"{item}: needs 0 < low < high for loguniform, low < high otherwise")
    if kind == "int" and math.ceil(low_value) > math.floor(high_value):
        raise UserError(f"{item}: {key} has no whole number between {low} and {high}: "
                        "widen the range")
    return kind, low_value, high_value


def split_values(item: str, value: str) -> list[str]:
    """The values of `key=a,b,c`, split at the commas outside brackets and quotes, each kept as
    written: optim.milestones=[100,200],[300] has two values, optim.milestones=[100,200] one."""
    values, start, closing, quote = [], 0, [], ""
    for at, char in enumerate(value):
        if quote or char in "'\"":
            quote = "" if char == quote else quote or char
        elif char in BRACKETS:
            closing.append(BRACKETS[char])
        elif char in BRACKETS.values() and (not closing or closing.pop() != char):
            raise UserError(f"{item}: its values do not parse: a {char} closes nothing: "
                            "check the brackets")
        elif char == "," and not closing:
            values.append(value[start:at])
            start = at + 1
    if quote or closing:
        raise UserError(f"{item}: its values do not parse: a {quote or closing[-1]} is missing")
    return [*values, value[start:]]


def parse_space(overrides: list[str], random_search: bool) -> tuple[dict, list[str]]:
    """{key: [values] or (kind, low, high)} for the swept keys, and the fixed overrides."""
    space, fixed = {}, []
    for item in overrides:
        key, has_value, value = item.partition("=")
        if not has_value or not key:
            raise UserError(f"{item!r} is not a key=value override, e.g. optim.lr=1e-3,3e-3")
        if schema_type(key) is None:
            raise UserError(f"{key} is not a config key (python config.py lists them all)")
        if key in ("run.dir", "run.output_dir"):
            raise UserError(f"{key} is set by the sweep for each trial: drop it (use --out)")
        ranged = RANGE.match(value.replace(" ", ""))
        values = [] if ranged else split_values(item, value)
        if not ranged and len(values) == 1:
            fixed.append(item)
            continue
        # A trial's own settings follow the fixed ones: a list wins over a fixed value of its
        # key (a command's base overrides may hold one), but of two lists neither would.
        if key in space:
            raise UserError(f"{key} is swept twice: give one list of its values")
        if len(set(values)) != len(values) or "" in values:
            raise UserError(f"{item}: list each value once, separated by commas")
        space[key] = _parse_range(item, key, ranged, random_search) if ranged else values
    if not space:
        raise UserError("nothing to sweep: give at least one key a list of values, e.g. "
                        "optim.lr=1e-3,3e-3")
    return space, fixed


def suggest(trial, key: str, spec) -> str:
    """The setting an Optuna trial draws for one key, as the override's text."""
    if isinstance(spec, list):
        return trial.suggest_categorical(key, spec)
    kind, low, high = spec
    if kind == "int":
        return str(trial.suggest_int(key, math.ceil(low), math.floor(high)))
    return f"{trial.suggest_float(key, low, high, log=kind == 'loguniform'):.4g}"


def _count(spec) -> float:
    """How many settings a swept key has (a float range: unbounded)."""
    if isinstance(spec, list):
        return len(spec)
    kind, low, high = spec
    return math.floor(high) - math.ceil(low) + 1 if kind == "int" else math.inf


def plan_trials(space: dict, random_trials: int = 0, seed: int = 0) -> list[dict]:
    """Each trial's swept settings, in order, drawn by an in-memory Optuna study: the whole grid
    (GridSampler, its order shuffled by `seed`), or `random_trials` draws (RandomSampler),
    distinct while the space has that many."""
    samplers = import_optuna().samplers
    size = math.prod(_count(spec) for spec in space.values())
    sampler = (samplers.RandomSampler(seed=seed) if random_trials
               else samplers.GridSampler(space, seed=seed))
    study = import_optuna().create_study(sampler=sampler)
    trials, seen = [], set()
    while len(trials) < (random_trials or size):
        trial = study.ask()
        drawn = {key: suggest(trial, key, spec) for key, spec in space.items()}
        if tuple(drawn.values()) in seen and len(seen) < size:
            continue
        seen.add(tuple(drawn.values()))
        trials.append(drawn)
    return trials
