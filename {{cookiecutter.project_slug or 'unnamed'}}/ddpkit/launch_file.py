"""A hand-edited launch file (launch/trainjob.yaml, launch/sky.yaml) read key by key, each key
with the type it must have: a missing key, or a value of another type (`num_nodes: two`, an env
item written as a plain string), is one line naming the file, the key's path in the YAML and
what it must be.

No torch here: `python -m ddpkit.targets` reads these files on any machine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ddpkit.project import UserError

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a key must hold: `read` returns the value as the reader uses it, or None when the
    value is not of this kind; `words` says what it must be, for the message."""

    words: str
    read: Callable[[Any], Any]


def _whole(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(value):  # a Kubernetes quantity of devices: 8 or "8"
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return _whole(value)


def _each(kind: Kind) -> Callable[[Any], Any]:
    def read(value):
        if not isinstance(value, list):
            return None
        items = [kind.read(item) for item in value]
        return None if any(item is None for item in items) else items
    return read


TEXT = Kind("text", lambda value: value if isinstance(value, str) else None)
WHOLE = Kind("a whole number, e.g. 2", _whole)
COUNT = Kind('a whole number, e.g. "8"', _count)
MAPPING = Kind("a mapping (key: value lines)", lambda value: value if isinstance(value, dict)
               else None)
LIST = Kind("a list", lambda value: value if isinstance(value, list) else None)
WORDS = Kind("a list of text items, e.g. [bash, launch/node.sh]", _each(TEXT))
WHOLES = Kind("a list of whole numbers, e.g. [75]", _each(WHOLE))


def key_path(path: tuple) -> str:
    """A key's path as a reader finds it in the file: spec.trainer.env[0].name."""
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else f".{step}" if text else str(step)
    return text


class LaunchFile:
    """The YAML file `name` of the project at `project`, read one typed key at a time."""

    def __init__(self, project: Path, name: str):
        self.name = name
        try:
            loaded = yaml.safe_load((project / name).read_text())
        except yaml.YAMLError as error:
            raise UserError(f"{name} is not valid YAML: {str(error).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"{name} must be a mapping, as the template wrote it")
        self.data = loaded

    def read(self, path: tuple, kind: Kind, default: Any = _REQUIRED) -> Any:
        """The value at `path` (keys and list indices) as `kind` reads it; `default` when the
        key is missing or empty (without one, a missing key is one line)."""
        value = self.data
        for depth, step in enumerate(path):
            if value is None and default is not _REQUIRED:
                return default
            self._check(path[:depth], value, MAPPING if isinstance(step, str) else LIST)
            if (step not in value) if isinstance(value, dict) else step >= len(value):
                if default is _REQUIRED:
                    raise UserError(f"{self.name}: {key_path(path)} not found: restore it from "
                                    "the template")
                return default
            value = value[step]
        if value is None and default is not _REQUIRED:
            return default
        return self._check(path, value, kind)

    def items(self, path: tuple, kind: Kind) -> list[tuple]:
        """The paths of the items of the list at `path` (none if it is missing), each item
        checked to be of `kind`."""
        paths = [(*path, index) for index in range(len(self.read(path, LIST, [])))]
        for item in paths:
            self.read(item, kind)
        return paths

    def _check(self, path: tuple, value: Any, kind: Kind) -> Any:
        read = kind.read(value)
        if read is None:
            where = key_path(path) or "the file"
            raise UserError(f"{self.name}: {where} must be {kind.words}, not "
                            f"{json.dumps(value, default=str)}")
        return read
