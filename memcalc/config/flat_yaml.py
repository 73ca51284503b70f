"""The flat YAML of a typical config, read without importing PyYAML (a tenth of `estimate`'s start-up).

`read_flat` reads `key: value` lines only where it is sure what PyYAML's safe loader would return (decimal
numbers, true/false, plain words, quoted text without escapes); anything else makes it return None and the caller
uses PyYAML, which decides and words every error. tests/config/test_flat_yaml.py checks both read the same.
"""

from __future__ import annotations

import re
from typing import Any

# Patterns compiled on first use (re caches them): nothing here costs at import.
_LINE = r"([A-Za-z_][A-Za-z0-9_]*):(?: +(.*?))? *"
_INT = r"[-+]?(?:0|[1-9][0-9]{0,17})"  # at most 18 digits: longer ones go to the loader's own rule
_FLOAT = r"[-+]?[0-9]+\.[0-9]*(?:[eE][-+][0-9]+)?"  # YAML 1.1's exponent has a sign; no '_' or ':'
_QUOTED = r"\"([^\"\\]*)\"|'([^']*)'"
# Text: from a letter (never a number, date or flow indicator), or from a digit with a space after it (no number
# or date has one, and ':' is not among the characters: no time, no base 60).
_WORD = r"[A-Za-z][A-Za-z0-9 _.,()/+-]*|[0-9][A-Za-z0-9_.,()/+-]* [A-Za-z0-9 _.,()/+-]*"
# YAML 1.1's booleans and null, as keys or values: PyYAML would not read them as text.
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null"}


def read_flat(text: str) -> dict[str, Any] | None:
    """The mapping a flat `key: value` config holds, exactly as PyYAML's safe loader reads it; None if unsure."""
    if not text.isascii() or "\t" in text or "\r" in text or any(c < " " and c != "\n" for c in text):
        return None
    fields: dict[str, Any] = {}
    for line in text.split("\n"):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        found = re.fullmatch(_LINE, line)
        if found is None:
            return None
        key, raw = found.group(1), _without_comment(found.group(2) or "")
        value = _scalar(raw) if raw else None
        if key in fields or key.lower() in _RESERVED or value is None:
            return None
        fields[key] = value
    return fields or None


def _without_comment(raw: str) -> str:
    """The value before a ' #' comment (a quoted value's own text is checked first: it may hold ' #')."""
    if raw[:1] in ("'", '"'):
        return raw
    return raw.split(" #", 1)[0].rstrip()


def _scalar(raw: str) -> Any:
    """An int, float, bool or str, or None when PyYAML should decide."""
    if re.fullmatch(_INT, raw):
        return int(raw)
    if re.fullmatch(_FLOAT, raw):
        return float(raw)
    if raw in ("true", "false"):
        return raw == "true"
    quoted = re.fullmatch(rf"(?:{_QUOTED})(?: +#.*)?", raw)
    if quoted is not None:
        return quoted.group(1) if quoted.group(1) is not None else quoted.group(2)
    if re.fullmatch(_WORD, raw) and raw.lower() not in _RESERVED and ": " not in raw and not raw.endswith(":"):
        return raw
    return None
