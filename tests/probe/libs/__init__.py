"""Shared checks of the library probes' tests."""


def assert_exact(rows) -> None:
    """Every tensor of a measurement agrees to the byte, and every predicted one was found (none unlabelled)."""
    differing = [row.describe() for row in rows if not row.matches]
    assert differing == [], differing  # a helper module's asserts are not rewritten by pytest: say what differs
    missing = [row.name for row in rows if not row.measured > 0]
    assert missing == [], missing
