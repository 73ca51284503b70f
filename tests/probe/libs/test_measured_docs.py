"""docs/measured-<impl>.md show what `memcalc measure --impl <impl>` (and `--step`) prints, on the library itself.

Each command runs in-process, through the console script's `main`, its stdout and stderr in one stream as a terminal
shows them: a fresh interpreter per command paid seconds importing torch and the library, and no example pins what a
process does (tests/probe/test_quiet_launch.py and tests/cli/test_measure_cli.py do)."""

import importlib.util
import io
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from memcalc.cli import main

DOCS = Path(__file__).parents[3] / "docs"
LIBRARIES = {"megatron": "megatron.core", "torchtitan": "torchtitan", "hf": "transformers"}


def _examples():
    for impl, module in LIBRARIES.items():
        text = (DOCS / f"measured-{impl}.md").read_text()
        for command, printed in re.findall(r"```text\n\$ memcalc (.*?)\n(.*?)```", text, flags=re.S):
            yield pytest.param(module, command, printed, id=f"{impl}: {command}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _printed(command: str) -> tuple[int, str]:
    """`memcalc COMMAND`'s exit code, and its stdout and stderr in the order written (output that is not a terminal
    is laid out the same whatever COLUMNS says: memcalc.cli.render)."""
    both = io.StringIO()
    with redirect_stdout(both), redirect_stderr(both), pytest.raises(SystemExit) as exit:
        main(shlex.split(command))
    return exit.value.code, both.getvalue()


@pytest.mark.procs  # some examples spawn gloo ranks
@pytest.mark.parametrize("module, command, printed", list(_examples()))
def test_the_pasted_measurement_is_what_the_library_gives(module, command, printed, monkeypatch):
    if not _installed(module):
        pytest.skip(f"{module} is not installed")
    monkeypatch.chdir(DOCS.parent)  # the pages name tests/data/hf/*.json from the repository's root
    code, output = _printed(command)
    got = [line.rstrip() for line in output.splitlines()]  # in the order written, as the page pastes it
    matches = ("match: every tensor agrees to the byte", "match: the peak and every category within 1%")  # --step
    assert code == 0 and any(line in got for line in matches)
    assert got == printed.splitlines(), f"stale page: run `python scripts/refresh_guide.py` on it ({command})"
