"""Shared checks of the library probes' tests."""


def assert_exact(rows) -> None:
    """Every tensor of a measurement agrees to the byte, and every predicted one was found (none unlabelled)."""
    differing = [row.describe() for row in rows if not row.matches]
    assert differing == [], differing  # a helper module's asserts are not rewritten by pytest: say what differs
    missing = [row.name for row in rows if not row.measured > 0]
    assert missing == [], missing


def assert_within_bounds(measured_rows, lower_rows, upper_rows) -> None:
    """With the real router, each tensor's bytes lie between the balanced and the worst bound's prediction."""
    measured = {row.name: row.measured for row in measured_rows}
    lower = {row.name: row.predicted for row in lower_rows}
    upper = {row.name: row.predicted for row in upper_rows}
    assert measured.keys() == lower.keys() == upper.keys()
    outside = [name for name in measured if not lower[name] <= measured[name] <= upper[name]]
    assert outside == [], [(name, lower[name], measured[name], upper[name]) for name in outside]
