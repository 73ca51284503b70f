"""Every `$ memcalc ...` example in README.md and docs/*.md prints what the page shows.

A page shows a command's output as pasted from an 80-column terminal, so the
comparison ignores how lines wrap and how wide a table's frame is drawn: both
sides become their words, box-drawing characters left out. stderr and stdout
may interleave either way on a terminal, so either order is accepted. A block
that ends in `...` shows the first part of the output only.

Rules for the few examples that cannot run as pasted:
- `--out PATH` writes into a temporary directory (the page's PATH in the
  output stands for it), so that tracked images and files are never rewritten;
- a command piped into another (`| python -c ...`) runs in a subprocess; it, and
  `memcalc measure`, which starts processes, are marked `procs`;
- docs/measured-<impl>.md are run, on each library, by
  tests/probe/libs/test_measured_docs.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memcalc.cli import main

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("measured-"))]
BLOCK = re.compile(r"```text\n(.*?)```", flags=re.S)
BOX = re.compile("[\u2500-\u257f]")


def examples() -> list:
    """(page, command, shown output) for every `$ memcalc` line of a text block, its continuation lines joined."""
    found = []
    for page in PAGES:
        for block in BLOCK.findall(page.read_text()):
            for run in re.split(r"^\$ (?=memcalc )", block, flags=re.M)[1:]:
                lines = run.split("\n")
                command = lines.pop(0)
                while command.endswith("\\"):
                    command = command[:-1] + lines.pop(0).strip()
                slow = " | " in command or command.startswith("memcalc measure")
                marks = [pytest.mark.procs] if slow else []
                found.append(pytest.param(page.name, command, "\n".join(lines), marks=marks,
                                          id=f"{page.name}: {command[:90]}"))
    return found


def words(text: str) -> list[str]:
    """The text's words, box-drawing characters left out: what wrapping and a table's width cannot change."""
    return BOX.sub(" ", text).split()


def _run(command: str, tmp_path: Path) -> tuple[str, str, list[tuple[str, str]]]:
    """stdout, stderr, and the (page path, temporary path) pairs that --out was redirected through."""
    args = shlex.split(command)
    moved = []
    if "--out" in args:
        at = args.index("--out") + 1
        moved.append((args[at], str(tmp_path / Path(args[at]).name)))
        args[at] = moved[-1][1]
    if " | " in command:
        shell = command.replace("memcalc ", f"{shlex.quote(sys.executable)} -m memcalc ", 1)
        done = subprocess.run(shell, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env=os.environ | {"COLUMNS": "80"})
        return done.stdout, done.stderr, moved
    result = CliRunner().invoke(_Script, args[1:], prog_name="memcalc", env={"COLUMNS": "80"})
    return result.stdout, result.stderr, moved


class _Script:
    """The console script's `main` (errors rendered as a user sees them), shaped for CliRunner.invoke."""

    name = "memcalc"

    @staticmethod
    def main(args, prog_name, **_):
        main(list(args))


@pytest.mark.parametrize("page, command, shown", examples())
def test_the_page_shows_what_the_command_prints(page, command, shown, tmp_path, monkeypatch):
    from memcalc.cli import render

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(render.console, "width", 80)  # the pages' terminal
    out, err, moved = _run(command, tmp_path)
    for original, temporary in moved:
        out, err = out.replace(temporary, original), err.replace(temporary, original)
    expected = words(shown)
    if expected[-1:] == ["..."]:  # the page shows the start only
        expected = expected[:-1]
        assert any(words(x)[:len(expected)] == expected for x in (err + out, out + err)), f"{page}: {command}"
        return
    assert expected in (words(err + out), words(out + err)), f"{page}: stale example `{command}`"
