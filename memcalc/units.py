"""Byte counts for people: binary units, and parsing '80GiB' style sizes."""

from __future__ import annotations

import re
from typing import Any

from memcalc.errors import ConfigError
from memcalc.text import short_repr

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_FACTORS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
            "t": 10**12, "tb": 10**12, "p": 10**15, "pb": 10**15,
            "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def minimum(x: Any, y: Any) -> Any:
    """min on numbers or numpy arrays alike (sweeps evaluate the same rules over a grid)."""
    return (x < y) * x + (x >= y) * y


def human_bytes(n: int) -> str:
    """'2.67 GiB': the largest binary unit that keeps the number at least 1."""
    value = float(n)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} {_UNITS[-1]}"


MAX_BYTES = 2**63 - 1  # bytes are int64 wherever memcalc counts them
MAX_DIGITS = 40  # digits of a size, fraction included: 2^63 has 19


def parse_bytes(text: str) -> int:
    """'80GiB' -> 85899345920; decimal (GB) and binary (GiB) units, case-insensitive.

    The number is read exactly (as a fraction, never a float that a 400-digit
    value would turn into infinity) and must come to at most MAX_BYTES. A
    fraction of a byte is dropped in larger units; in bytes, or where nothing
    would be left, it is refused.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _FACTORS:
        raise ConfigError(
            f"cannot read {short_repr(text)} as a size (examples: 80GiB, 40GB, 1024MiB, 123456789)"
        )
    number = match.group(1)
    if len(number) > MAX_DIGITS:  # before Fraction(): Python refuses to read 4300 digits and more
        raise ConfigError(f"size {short_repr(text)} has {len(number)} digits; at most {MAX_DIGITS}")
    from fractions import Fraction  # exact decimals; only a size flag pays for the import

    exact = Fraction(number) * _FACTORS[unit]
    size = int(exact)  # a fraction of a byte in a larger unit (1.3GiB) is dropped
    if exact != size and (_FACTORS[unit] == 1 or size == 0):  # "0.5B": half a byte is no size, never 0 B
        raise ConfigError(f"size {short_repr(text)} is not a whole number of bytes (B is bytes: 0.5GB is half a"
                          " gigabyte)")
    if size > MAX_BYTES:
        raise ConfigError(f"size {short_repr(text)} is too large (at most {MAX_BYTES} bytes, 8 EiB)")
    return size
