"""The suite leaves the checkout as it found it, and its slow tests can be left out by marker."""

from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_hypothesis_keeps_its_database_outside_the_repository():
    from hypothesis.configuration import storage_directory

    where = storage_directory(intent_to_write=False).path
    assert not where.resolve().is_relative_to(ROOT.resolve()), where


def test_the_procs_marker_is_registered(pytestconfig):
    assert any(line.startswith("procs:") for line in pytestconfig.getini("markers"))
