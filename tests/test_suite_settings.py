"""The suite leaves the checkout as it found it, runs torch on one thread per process, and its slow tests can be left
out by marker."""

from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_hypothesis_keeps_its_database_outside_the_repository():
    from hypothesis.configuration import storage_directory

    where = storage_directory(intent_to_write=False).path
    assert not where.resolve().is_relative_to(ROOT.resolve()), where


def test_the_procs_marker_is_registered(pytestconfig):
    assert any(line.startswith("procs:") for line in pytestconfig.getini("markers"))


def test_torch_runs_one_intra_op_thread_in_each_test_process():
    """conftest's OMP_NUM_THREADS reached torch before its import (imported later, it would be ignored)."""
    import os

    torch = pytest.importorskip("torch")
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == 1
