"""The project's own error types.

Domain code raises these; the CLI turns each into one line on stderr and a
non-zero exit (see `memcalc.cli.errors`). Nothing here imports click.
"""


class MemcalcError(Exception):
    """Any failure memcalc can explain to its user in one line."""

    exit_code = 2


class ConfigError(MemcalcError):
    """A model configuration that breaks a rule (a size, a divisibility, a key)."""


class ProbeError(MemcalcError):
    """The probe could not run, or one of its workers failed."""

    exit_code = 1
