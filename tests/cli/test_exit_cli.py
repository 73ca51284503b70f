"""How a `memcalc` process ends: once its command has run, at once, with its exit code and all its output, and
without Python's teardown (freeing every module's objects one by one). An error, a process that loaded torch and a
program that calls `main` with arguments (as the tests do) end as Python ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

# Exit work registered before memcalc loads runs after memcalc's own (atexit runs last first): only in Python's
# usual end, which then tears the interpreter down.
TORN_DOWN = """
import atexit
import os
import sys

atexit.register(os.write, 2, b"torn down\\n")
from memcalc.cli import main
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MEMCALC_DEBUG"},
    )


@pytest.mark.procs
def test_the_command_line_process_ends_without_tearing_the_interpreter_down():
    proc = _python(TORN_DOWN + "main()", "estimate", "--config", "gpt3-175b")
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.rstrip().endswith("tensor by tensor")  # the last line, flushed before the end


@pytest.mark.procs
def test_an_early_end_keeps_the_exit_code_and_every_line():
    proc = _python(TORN_DOWN + "main()", "estimate", "--config", "gpt3-175b", "--totals", "--gpu", "a100-40gb")
    assert (proc.returncode, proc.stderr) == (3, "")  # nothing fits
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if ": no, " in line] == ["  none", "  tp", "  tp-sp"]
    assert lines[-1].startswith("  tp-sp: the step peaks at")  # the last line, flushed before the end


@pytest.mark.procs
def test_main_called_with_arguments_leaves_the_process_to_end_as_usual():
    code = TORN_DOWN + """
try:
    main(["estimate", "--config", "gpt3-175b", "--json"])
except SystemExit as done:
    assert done.code == 0
sys.exit(5)
"""
    proc = _python(code)
    assert (proc.returncode, proc.stderr) == (5, "torn down\n")


@pytest.mark.procs
def test_an_error_ends_as_usual_with_its_one_line():
    proc = _python(TORN_DOWN + "main()", "estimate", "--config", "no-such.yaml")
    error, *rest = proc.stderr.splitlines()
    assert (proc.returncode, rest) == (2, ["torn down"])
    assert error.startswith("memcalc: error: config file not found: no-such.yaml")


@pytest.mark.procs
def test_a_process_that_loaded_torch_ends_as_usual():
    """`measure` runs torch, whose C++ side has its own work at exit."""
    pytest.importorskip("torch")
    proc = _python(TORN_DOWN + "import torch\nmain()", "estimate", "--config", "gpt3-175b", "--json")
    assert (proc.returncode, proc.stderr) == (0, "torn down\n")


@pytest.mark.procs
def test_measure_collects_garbage_at_pythons_thresholds_as_the_training_it_measures_does():
    code = "import gc\nfrom memcalc.cli import main\ntry:\n    main()\nexcept SystemExit:\n"
    code += "    print(gc.get_threshold())"
    proc = _python(code, "measure", "--config", "tiny", "--dp-shard", "2")  # refused after the reset, before torch
    assert proc.returncode == 0 and "memcalc: error: tiny: dp_shard=2" in proc.stderr
    assert proc.stdout.strip() == "(700, 10, 10)"
