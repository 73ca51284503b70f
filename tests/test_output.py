"""Files appear whole or not at all: written beside the target, renamed when complete."""

import os
import stat

import pytest

from memcalc.output import OutputError, atomic_write


def test_a_completed_write_replaces_the_file_with_the_usual_permissions(tmp_path):
    target = tmp_path / "rows.csv"
    target.write_text("old\n")
    with atomic_write(target) as stream:
        stream.write(b"new\n")
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~_umask()
    assert os.listdir(tmp_path) == ["rows.csv"]


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "rows.csv"
    target.write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target) as stream:
            stream.write(b"half")
            raise KeyboardInterrupt
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["rows.csv"]


def test_until_the_block_ends_the_target_still_holds_the_old_bytes(tmp_path):
    target = tmp_path / "rows.csv"
    target.write_text("old\n")
    with atomic_write(target) as stream:
        stream.write(b"new\n")
        stream.flush()
        assert target.read_text() == "old\n"


def test_a_directory_that_cannot_be_written_is_one_output_error(tmp_path):
    with pytest.raises(OutputError, match="cannot write .*missing/rows.csv: No such file or directory"):
        with atomic_write(tmp_path / "missing" / "rows.csv") as stream:
            stream.write(b"x")


def test_a_full_disk_is_one_output_error_and_removes_the_temporary(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError, match="No space left on device") as caught:
        with atomic_write(tmp_path / "rows.csv") as stream:
            stream.write(b"x")
    assert caught.value.exit_code == 1
    assert os.listdir(tmp_path) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
