"""The project's own error types.

Domain code raises these; the CLI turns each into one line on stderr and a
non-zero exit (see `memcalc.cli.main`). Nothing here imports click.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class MemcalcError(Exception):
    """Any failure memcalc can explain to its user in one line."""

    exit_code = 2


class ConfigError(MemcalcError):
    """A model configuration that breaks a rule (a size, a divisibility, a key)."""


class DoesNotFit(MemcalcError):
    """A valid question whose answer is "nothing fits": distinct from bad input, so scripts can tell."""

    exit_code = 3


class ProbeError(MemcalcError):
    """The probe could not run, or one of its workers failed."""

    exit_code = 1


@contextmanager
def in_file(path: Path | None) -> Iterator[None]:
    """Name `path` at the front of any ConfigError raised inside, so the user knows which file is wrong."""
    try:
        yield
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"{path}: {exc}") from None


def debugging() -> bool:
    """Whether MEMCALC_DEBUG asks for tracebacks (and torch's own log): any value but empty, 0, false, no or off, so
    that MEMCALC_DEBUG=0 turns it off as it reads."""
    return os.environ.get("MEMCALC_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
