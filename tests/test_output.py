"""Files appear whole or not at all: written beside the target, renamed when complete."""

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from memcalc.output import OutputError, atomic_write, check_writable

HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())
NO_SUCH_PID = 2**22 + 1  # above Linux's largest pid_max (and macOS's): no process has it


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


def test_the_temporary_is_named_for_its_target_memcalc_this_host_and_this_process(tmp_path):
    with atomic_write(tmp_path / "rows.csv"):
        (name,) = os.listdir(tmp_path)
    assert re.fullmatch(rf"\.rows\.csv\.memcalc-{re.escape(HOST)}-{os.getpid()}\.[a-z0-9_]+\.part", name), name


@pytest.mark.procs
def test_a_sigkilled_writers_temporary_is_removed_by_the_next_write_to_that_target(tmp_path):
    target = tmp_path / "rows.csv"
    target.write_text("old\n")
    code = (
        "import os, signal, sys; from memcalc.output import atomic_write\n"
        "with atomic_write(sys.argv[1]) as stream:\n"
        "    stream.write(b'half'); stream.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", code, str(target)])
    assert writer.wait(timeout=60) == -signal.SIGKILL
    (leftover,) = [n for n in os.listdir(tmp_path) if n != "rows.csv"]
    assert leftover.startswith(f".rows.csv.memcalc-{HOST}-{writer.pid}.") and target.read_text() == "old\n"
    with atomic_write(target) as stream:
        stream.write(b"new\n")
    assert sorted(os.listdir(tmp_path)) == ["rows.csv"] and target.read_text() == "new\n"


def test_only_dead_writers_temporaries_of_this_target_on_this_host_are_removed(tmp_path):
    def ours(pid, target="rows.csv", host=HOST):
        return f".{target}.memcalc-{host}-{pid}.abc123_x.part"

    dead = ours(NO_SUCH_PID)
    kept = [
        ours(os.getpid()), ours(os.getppid()),  # writers that still run
        ours(NO_SUCH_PID, target="other.csv"), ours(NO_SUCH_PID, host=HOST + "-elsewhere"),  # not this target or host
        ours("abc"), ours("0123"), ours(10**30),  # no process id, or one too large to ask the system about
        f".rows.csv.{NO_SUCH_PID}.abc123_x.part", dead + ".bak", "x" + dead,
        "rows.csv.part", ".rows.csv.abcdefgh",  # not memcalc's naming at all
    ]
    for name in (dead, *kept):
        (tmp_path / name).write_text("someone's bytes\n")
    with atomic_write(tmp_path / "rows.csv") as stream:
        stream.write(b"new\n")
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "rows.csv"])


def test_a_leftover_that_cannot_be_removed_does_not_stop_the_write(tmp_path):
    (tmp_path / f".rows.csv.memcalc-{HOST}-{NO_SUCH_PID}.abc.part").mkdir()  # unlink refuses a directory
    with atomic_write(tmp_path / "rows.csv") as stream:
        stream.write(b"new\n")
    assert (tmp_path / "rows.csv").read_text() == "new\n"


# -- what stands at the path stays what it is (issue 22) ----------------------------------------------


def test_a_symlink_is_written_through_to_its_target_and_stays_a_symlink(tmp_path):
    real = tmp_path / "data" / "rows.csv"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "rows.csv"
    link.symlink_to(real)
    with atomic_write(link) as stream:
        stream.write(b"new\n")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new\n"
    assert sorted(os.listdir(real.parent)) == ["rows.csv"]


def test_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "rows.csv"
    link.symlink_to(tmp_path / "new.csv")
    with atomic_write(link) as stream:
        stream.write(b"new\n")
    assert link.is_symlink() and (tmp_path / "new.csv").read_text() == "new\n"


def test_a_file_keeps_its_permission_bits(tmp_path):
    target = tmp_path / "rows.csv"
    target.write_text("old\n")
    target.chmod(0o600)
    with atomic_write(target) as stream:
        stream.write(b"new\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "new\n"


def test_a_fifo_is_written_in_place_for_its_reader(tmp_path):
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    with atomic_write(fifo) as stream:
        stream.write(b"rows\n")
    reader.join(timeout=30)
    assert received == [b"rows\n"]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["rows.fifo"]


def test_a_full_device_is_one_output_error_and_stays_a_device():
    """/dev/full takes no byte (ENOSPC): exit 1 for the write; it must still be a character device after."""
    with pytest.raises(OutputError, match="cannot write /dev/full: No space left on device") as caught:
        with atomic_write("/dev/full") as stream:
            stream.write(b"x" * 100_000)
    assert caught.value.exit_code == 1
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


def test_a_socket_is_refused_before_writing(tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(OutputError, match="neither a regular file nor a character device or FIFO"):
            check_writable(path)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)


def test_a_directory_where_no_file_can_be_made_is_found_before_any_work():
    with pytest.raises(OutputError, match="cannot write /proc/x.csv"):
        check_writable("/proc/x.csv")


def test_checking_a_path_leaves_nothing_behind(tmp_path):
    check_writable(tmp_path / "rows.csv")
    assert os.listdir(tmp_path) == []


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("make", [lambda p: check_writable(p), lambda p: atomic_write(p).__enter__()],
                         ids=["check_writable", "atomic_write"])
def test_a_sigterm_the_moment_the_temporary_is_made_leaves_no_file(tmp_path, monkeypatch, make):
    """The signal lands between mkstemp's return and the name being kept: it must wait until removal is in force."""
    made = tempfile.mkstemp

    def mkstemp_then_sigterm(*args, **kwargs):
        made_now = made(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return made_now

    def exit_143(*_):
        raise SystemExit(143)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp_then_sigterm)
    previous = signal.signal(signal.SIGTERM, exit_143)
    try:
        with pytest.raises(SystemExit):
            make(tmp_path / "rows.csv")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert os.listdir(tmp_path) == []
