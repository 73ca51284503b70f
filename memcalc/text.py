"""Text that came from a user, made safe to show: short, and free of control characters.

A config file is not trusted: an alias bomb makes a value whose repr is gigabytes, a 5000-digit integer has no
repr, and a name can carry terminal escapes or rich markup. Everything echoed goes through `short_repr` or
`printable` (rich output through `for_rich`); every whole number a user types is read by `whole_number`.
"""

from __future__ import annotations

import re
import reprlib

from memcalc.errors import ConfigError

ECHO_LIMIT = 60  # characters of an echoed value; enough to recognise it, never a flood
_DIGITS_SHOWN = 40  # an integer with more digits than this is shown by its length
MAX_INT_DIGITS = 40  # far above any size (2^63 has 19 digits), far below Python's 4300-digit limit
# re's [0-9] is ASCII, unlike str.isdigit or int(); compiled on first use (re caches it), not at start-up
_WHOLE = r"[+-]?(?:0|[1-9][0-9]*)"
WHOLE_NUMBER = "a whole number in the digits 0-9, without '_' or a leading zero"
_ASCII_SPACE = " \t\n\r\v\f"  # string.whitespace, without importing string

class _Short(reprlib.Repr):
    """reprlib's bounded repr, measuring integers before writing them out (str() of a 5000-digit integer raises,
    and reprlib's repr_int calls it)."""

    def repr_int(self, x: int, level: int) -> str:
        digits = len(str(abs(x))) if x.bit_length() < 3.3 * _DIGITS_SHOWN else int(x.bit_length() * 0.30103) + 1
        return repr(x) if digits <= _DIGITS_SHOWN else f"<an integer of about {digits} digits>"


_repr = _Short()
_repr.maxlevel, _repr.maxlist, _repr.maxtuple, _repr.maxdict, _repr.maxset = 2, 4, 4, 4, 4
_repr.maxstring = _repr.maxother = ECHO_LIMIT


def short_repr(value: object) -> str:
    """repr(value), bounded in work and length (an alias bomb costs a few dozen steps), and printable."""
    text = printable(_repr.repr(value))
    return text if len(text) <= ECHO_LIMIT else f"{text[:ECHO_LIMIT - 3]}..."


def whole_number(text: str) -> int:
    """The whole number `text` spells: an optional sign, then ASCII digits 0-9, ASCII whitespace around.

    int() would also read '1_000' or full-width digits, YAML 1.1 '017' as octal and '34:08' in base 60: none is what
    anyone meant, so each is refused. More than MAX_INT_DIGITS digits are refused before int() (which raises at 4300).
    """
    stripped = text.strip(_ASCII_SPACE)
    if not re.fullmatch(_WHOLE, stripped):
        raise ConfigError(f"{short_repr(text)} is not {WHOLE_NUMBER}")
    digits = len(stripped.lstrip("+-"))
    if digits > MAX_INT_DIGITS:
        raise ConfigError(f"a {digits}-digit integer is too large (at most {MAX_INT_DIGITS} digits)")
    return int(stripped)


def printable(text: str) -> str:
    """`text` with every non-printable character (ESC, BEL, a newline, U+2028 ...) written as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def for_rich(text: str) -> str:
    """`text` printable, and with rich's markup ('[bold]', '[/x]') escaped, for console.print."""
    from rich.markup import escape  # rich is loaded by whoever prints with it

    return escape(printable(text))
