"""Settings for the whole suite.

hypothesis keeps its example database under the working directory by default
(`.hypothesis/` in the repository root); it goes to the temporary directory
instead, so a test run leaves the checkout as it found it.

Each test process, and each process a test starts, runs torch on one intra-op thread
(OMP_NUM_THREADS, read when torch is imported: set here, before any test module imports
it). The tensors are tiny, and the suite runs on several processes at once: with a
thread per core in each, OpenMP's threads spin waiting for cores the other processes
hold, and a module took four times as long. memcalc's spawned ranks set their own count.
"""

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import configuration

configuration.set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "memcalc-hypothesis")
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def starts_processes() -> None:
    """Asked for by fixtures that start processes, so that every test using them is marked `procs`."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`procs` on each test that starts processes through a fixture: `pytest -m "not procs"` is the fast suite."""
    for item in items:
        if "starts_processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.procs)
