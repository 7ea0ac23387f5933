"""What the config sections share to check their own fields: the range a number must lie in, declared
with the field (``ranged``) and written as its error message says it, and the choices a name must be
one of. Every error names the dotted field, the value and the fix."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Range:
    """Where a number must lie."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text


AT_LEAST_0, AT_LEAST_1, POSITIVE, FRACTION = Range(0), Range(1), Range(0, low_open=True), Range(0, 1)


def check_choice(field: str, value: str, choices: Sequence[str]) -> None:
    """``value`` is one of ``choices``; ``field``: its dotted name."""
    if value not in choices:
        raise ValueError(f"{field} = {value!r}: use one of {', '.join(choices)}")


def ranged(default: float, allowed: Range) -> Any:
    """A dataclass field with ``default`` that must lie in ``allowed`` (``check_ranges`` checks it)."""
    return dataclasses.field(default=default, metadata={"range": allowed})


def check_ranges(section: Any, prefix: str) -> None:
    """Each ``ranged`` field of ``section`` lies in its range; ``prefix``: the section's dotted path."""
    for spec in dataclasses.fields(section):
        allowed = spec.metadata.get("range")
        value = getattr(section, spec.name)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{prefix}.{spec.name} = {value!r}: it must be {allowed}")
