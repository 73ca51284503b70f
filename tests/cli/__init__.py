"""Tests of the `memcalc` command line, and `memcalc_cli`, which runs it in-process.

`memcalc_cli` goes through `memcalc.cli.main`, the console script's entry point,
so errors are rendered exactly as a user sees them (one line on stderr, an exit
code); only a few tests in test_errors_cli.py pay for a real subprocess.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from memcalc.cli import main

CONFIGS = Path(__file__).parents[2] / "memcalc" / "configs"


def shipped(name: str) -> str:
    """The path of a shipped config, whatever directory the tests run from."""
    return str(CONFIGS / f"{name}.yaml")


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


def memcalc_cli(*args: str, width: int = 250) -> Run:
    """Run `memcalc ARGS` in-process; rich tables get `width` columns so rows never wrap."""
    from memcalc.cli import render

    out, err = io.StringIO(), io.StringIO()
    saved_width, render.console.width = render.console.width, width
    try:
        with redirect_stdout(out), redirect_stderr(err), pytest.raises(SystemExit) as exit:
            main(list(args))
    finally:
        render.console.width = saved_width
    return Run(exit.value.code, out.getvalue(), err.getvalue())


def one_line_error(run: Run, *needles: str) -> None:
    """Bad input: exit 2, nothing on stdout, one line on stderr that holds every needle."""
    assert (run.code, run.out) == (2, ""), run.err
    assert run.err.startswith("memcalc: error: ") and run.err.count("\n") == 1, run.err
    for needle in needles:
        assert needle in run.err, (needle, run.err)
