"""docs/measured-<impl>.md show what `memcalc measure --impl <impl>` (and `--step`) prints, on the library itself."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.procs
@pytest.mark.parametrize("module, command, printed", list(_examples()))
def test_the_pasted_measurement_is_what_the_library_gives(module, command, printed):
    if not _installed(module):
        pytest.skip(f"{module} is not installed")
    run = subprocess.run(
        [sys.executable, "-m", "memcalc", *shlex.split(command)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=os.environ | {"COLUMNS": "80"}, cwd=DOCS.parent, timeout=300,
    )
    got = [line.rstrip() for line in run.stdout.splitlines()]  # in the order written, as the page pastes it
    matches = ("match: every tensor agrees to the byte", "match: the peak and every category within 1%")  # --step
    assert run.returncode == 0 and any(line in got for line in matches)
    assert got == printed.splitlines(), f"stale page: run `python scripts/refresh_guide.py` on it ({command})"
