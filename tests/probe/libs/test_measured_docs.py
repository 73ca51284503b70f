"""docs/measured-<impl>.md show what `memcalc measure --impl <impl>` (and `--step`) prints, on the library itself.

Each command runs in-process, through the console script's `main`, its stdout and stderr in one stream as a terminal
shows them: a fresh interpreter per command paid seconds importing torch and the library, and no example pins what a
process does (tests/probe/test_quiet_launch.py and tests/cli/test_measure_cli.py do)."""

import importlib.util
import io
import logging
import re
import shlex
from contextlib import contextmanager, redirect_stderr, redirect_stdout
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
    with redirect_stdout(both), redirect_stderr(both), _logged_to(both), pytest.raises(SystemExit) as exit:
        main(shlex.split(command))
    return exit.value.code, both.getvalue()


@contextmanager
def _logged_to(stream: io.StringIO):
    """Every logging.StreamHandler writes to `stream` for the block, as a fresh process's write to its stderr: torch's
    and transformers' handlers keep the sys.stderr of their first import, in this worker whichever test's capture
    that was, so their lines would land in an earlier page's buffer (or none) as the tests' order has it."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    handlers = {h for x in loggers for h in getattr(x, "handlers", ()) if type(h) is logging.StreamHandler}
    kept = {h: h.setStream(stream) for h in handlers}
    try:
        yield
    finally:
        for handler, was in kept.items():
            handler.setStream(was)


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


def test_a_librarys_log_line_is_printed_whichever_capture_its_handler_was_made_under(monkeypatch):
    logger = logging.getLogger("memcalc-tests-a-library")
    logger.addHandler(logging.StreamHandler(io.StringIO()))  # made while an earlier command's output was captured
    monkeypatch.setattr(logger, "propagate", False)

    def logs_and_exits(args):
        logger.warning("a warning of the library's")
        raise SystemExit(0)

    monkeypatch.setattr(f"{__name__}.main", logs_and_exits)
    try:
        assert _printed("measure") == (0, "a warning of the library's\n")
    finally:
        logger.handlers.clear()
