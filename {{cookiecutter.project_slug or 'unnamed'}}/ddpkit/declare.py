"""How a setting is declared: `setting(default, doc, **what it takes)` on a dataclass field, and
the Declared record config.py checks a value against. The settings themselves are in
ddpkit/schema.py; yours in settings.py may use `setting` too.

No torch here: run.sh checks every command line before it starts a worker.
"""

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DECLARED = "declared"  # the key of a field's metadata that holds its Declared


@dataclass(frozen=True)
class Declared:
    """What a setting's field declares besides its type and default. A value outside it is
    refused by config.py in one line: `key=value is not valid: <what problem() says>`."""

    doc: str  # one or two sentences, shown in configs/default.yaml
    choices: tuple = ()  # the only values it takes
    known: tuple = ()  # the built-in values of an open choice (yours are looked up at run time)
    above: float | None = None  # the range: above / at_least the low end, below / at_most the high
    at_least: float | None = None
    below: float | None = None
    at_most: float | None = None
    what: str = "it"  # the range's subject in its message: "a seed must be between ..."
    why: str = ""  # the range's reason, in brackets after it
    rule: Callable[[Any], str | None] | None = None  # a check of its own: the problem, or None
    # Where it acts at all: (another key, the values it acts with); no values: any but 0 or false
    acts_with: tuple = ()

    def choices_in_words(self) -> str:
        """The choices as a config file writes them (true, not True)."""
        return ", ".join(str(choice).lower() if isinstance(choice, bool) else str(choice)
                         for choice in self.choices)

    def bounds(self) -> str:
        """The range in words: '> 0', '>= 2', 'between 0 and 1', 'at least 0 and below 1'."""
        low = ((">", "above", self.above) if self.above is not None else
               (">=", "at least", self.at_least) if self.at_least is not None else None)
        high = (("<", "below", self.below) if self.below is not None else
                ("<=", "at most", self.at_most) if self.at_most is not None else None)
        if low and high:
            if low[0] == ">=" and high[0] == "<=":
                return f"between {low[2]} and {high[2]}"
            return f"{low[1]} {low[2]} and {high[1]} {high[2]}"
        sign, _, end = low or high
        return f"{sign} {end}"

    def within(self, value) -> bool:
        ends = ((self.above, operator.gt), (self.at_least, operator.ge),
                (self.below, operator.lt), (self.at_most, operator.le))
        return value is None or all(end is None or test(value, end) for end, test in ends)

    def problem(self, value) -> str | None:
        """What is wrong with `value`, as the end of a sentence; None when nothing is."""
        if self.choices and value not in self.choices:
            return f"choose one of {self.choices_in_words()}"
        if not self.within(value):
            return f"{self.what} must be {self.bounds()}" + (f" ({self.why})" if self.why else "")
        return self.rule(value) if self.rule else None


def setting(default, doc: str, **declared) -> Any:
    """A setting's field: its default, its doc and what it takes (the keywords of Declared).
    Your classes in settings.py may declare theirs so too, or as plain fields with a default."""
    metadata = {DECLARED: Declared(doc, **declared)}
    if isinstance(default, list | dict):  # a mutable default: each config gets its own copy
        return field(default_factory=default.copy, metadata=metadata)
    return field(default=default, metadata=metadata)


def whole_or_fraction(value: float) -> str | None:
    if value >= 1 and value != int(value):
        return "give a whole number of batches, a fraction below 1, or 0 for all of them"
    return None


def micro_batch_rule(value) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    return "give a number of samples (0: from the global batch) or auto"


def increasing_steps(value: list) -> str | None:
    steps = list(value)
    if any(step <= 0 for step in steps) or steps != sorted(set(steps)):
        return "give increasing step numbers above 0, e.g. optim.milestones=[1000,2000]"
    return None
