"""`memcalc estimate` runs in loops and sweeps, so its start-up path must stay light:
no sympy, numpy, torch or matplotlib, no dataclass whose methods Python compiles at every
start (`memcalc.records`), and `memcalc --help` imports no subcommand.

One fresh interpreter runs the CLI's entry point several times and reports what it
imported; benchmarks/bench_estimate.py measures the wall time itself.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# pydantic-core validates only a value the plain check is unsure of (memcalc.config.core); rich's emoji table and
# highlighting (its regexes compiled on first use) are off (memcalc.cli.render.console).
HEAVY = ("sympy", "numpy", "torch", "matplotlib", "pydantic_core", "rich._emoji_codes")

PROBE = """
import dataclasses, json, sys
from memcalc.cli import main

def run(*args):
    try:
        main(list(args))
    except SystemExit as exc:
        assert exc.code == 0, (args, exc.code)

def loaded(prefixes):
    return sorted(m for m in sys.modules if m.startswith(prefixes))

report = {}
run("--help")
report["after_help"] = loaded(("memcalc.cli.",))
run("estimate", "--config", "gpt3-175b", "--json")
report["after_json"] = loaded(%(heavy)r)
run("estimate", "--config", "gpt3-175b", "--breakdown", "--exact")
report["after_table"] = loaded(%(heavy)r)
report["compiled_dataclasses"] = sorted(
    f"{name}.{cls.__qualname__}" for name, module in list(sys.modules.items()) if name.startswith("memcalc")
    for cls in vars(module).values()
    if isinstance(cls, type) and cls.__module__ == name and dataclasses.is_dataclass(cls)
    and cls.__init__.__module__ != "memcalc.records"
)
print("REPORT" + json.dumps(report), file=sys.stderr)
""" % {"heavy": HEAVY}


@pytest.fixture(scope="module")
def report(starts_processes) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stderr.rsplit("REPORT", 1)[1])


def test_help_imports_no_subcommand_module(report):
    assert report["after_help"] == []


def test_estimate_json_imports_no_heavy_library(report):
    assert report["after_json"] == []


def test_estimate_tables_import_no_heavy_library(report):
    assert report["after_table"] == []


def test_estimate_loads_records_not_compiled_dataclasses(report):
    """Python 3.11 compiles six methods of every frozen dataclass at import, ~1 ms a class: on estimate's path
    every dataclass is a `memcalc.records.record`, whose methods are shared."""
    assert report["compiled_dataclasses"] == []
