"""Text that came from a user, made safe to show: short, and free of control characters.

Error messages echo what was given (`(got 'relu')`), and tables print model
names read from files. A config file is not trusted: a YAML alias bomb can make
a value whose repr is gigabytes, a 5000-digit integer has no repr at all, and a
name can carry terminal escapes (ESC, OSC) or rich markup. Everything echoed
goes through `short_repr` or `printable`; rich output through `for_rich`.
"""

from __future__ import annotations

import reprlib

ECHO_LIMIT = 60  # characters of an echoed value; enough to recognise it, never a flood
_DIGITS_SHOWN = 40  # an integer with more digits than this is shown by its length

class _Short(reprlib.Repr):
    """reprlib's bounded repr, with integers measured before they are written out.

    str() of a 5000-digit integer raises in Python 3.11, and reprlib's own
    repr_int calls it before cutting.
    """

    def repr_int(self, x: int, level: int) -> str:
        digits = len(str(abs(x))) if x.bit_length() < 3.3 * _DIGITS_SHOWN else int(x.bit_length() * 0.30103) + 1
        return repr(x) if digits <= _DIGITS_SHOWN else f"<an integer of about {digits} digits>"


_repr = _Short()
_repr.maxlevel, _repr.maxlist, _repr.maxtuple, _repr.maxdict, _repr.maxset = 2, 4, 4, 4, 4
_repr.maxstring = _repr.maxother = ECHO_LIMIT


def short_repr(value: object) -> str:
    """repr(value), bounded in the work it does and the characters it returns, and printable.

    reprlib stops at a depth and a length, so an alias bomb (a list holding
    nine copies of a list holding nine copies ...) costs a few dozen steps.
    """
    return _cut(printable(_repr.repr(value)))


def printable(text: str) -> str:
    """`text` with every non-printable character (ESC, BEL, a newline, U+2028 ...) written as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def for_rich(text: str) -> str:
    """`text` printable, and with rich's markup ('[bold]', '[/x]') escaped, for console.print."""
    from rich.markup import escape  # rich is loaded by whoever prints with it

    return escape(printable(text))


def _cut(text: str) -> str:
    return text if len(text) <= ECHO_LIMIT else f"{text[:ECHO_LIMIT - 3]}..."
