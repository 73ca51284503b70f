"""The two number types every flag uses: whole numbers in ASCII digits, and finite reals.

click's `int` also reads '1_000' and full-width or Arabic-Indic digits, its `float` 'nan' and '1e400', and
FloatRange lets NaN through; these refuse them at the parameter (a usage error, exit 2). Whole numbers are read
by `memcalc.text.whole_number`, as sweeps' ranges and YAML configs read theirs.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import click

from memcalc.errors import ConfigError
from memcalc.text import short_repr, whole_number

# re's [0-9] is ASCII, unlike str.isdigit or float(); compiled on first use (re caches it), not at start-up
_REAL = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"


class Integer(click.ParamType):
    """A whole number by `whole_number`'s rule (signed: the model's rule names a negative size), within min and max."""

    name = "integer"

    def __init__(self, min: int | None = None, max: int | None = None) -> None:
        self.min, self.max = min, max

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = whole_number(str(value))
            except ConfigError as exc:
                self.fail(str(exc), param, ctx)
        if self.min is not None and number < self.min:
            self.fail(f"{number} is below {self.min}", param, ctx)
        if self.max is not None and number > self.max:
            self.fail(f"{number} is above {self.max}", param, ctx)
        return number


class Real(click.ParamType):
    """A finite number in decimal notation (never NaN or infinity), above `above`, within `least` and `most`."""

    name = "number"

    def __init__(self, above: float | None = None, least: float | None = None, most: float | None = None) -> None:
        self.above, self.least, self.most = above, least, most

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        text = str(value).strip()
        if isinstance(value, float):
            number = value
        elif len(text) > 100 or not re.fullmatch(_REAL, text):
            self.fail(f"{short_repr(value)} is not a valid float (a finite number in the digits 0-9)", param, ctx)
        else:
            number = float(text)
        if not math.isfinite(number):
            self.fail(f"{text[:60]} is not a valid float (a finite number in the digits 0-9)", param, ctx)
        if self.above is not None and number <= self.above:
            self.fail(f"{number:g} is not above {self.above:g}", param, ctx)
        if self.least is not None and number < self.least:
            self.fail(f"{number:g} is below {self.least:g}", param, ctx)
        if self.most is not None and number > self.most:
            self.fail(f"{number:g} is above {self.most:g}", param, ctx)
        return number


class Parsed(click.ParamType):
    """A flag's text read by `parse` (a size such as 80GiB, a list or range of sizes), its ConfigError a usage
    error; a value that is not text (a default) is taken as it is."""

    def __init__(self, name: str, parse: Callable[[str], Any]) -> None:
        self.name, self.parse = name, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


INTEGER = Integer()
POSITIVE = Integer(min=1)
