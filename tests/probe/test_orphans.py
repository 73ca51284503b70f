"""Workers die with `measure`: a SIGTERM or SIGKILL to the process that spawned them leaves no rank running."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[2]
SPAWN = (
    "import sys; from memcalc.probe.launch import run_spawned; from tests.probe.test_orphans import record_and_wait;"
    " run_spawned(record_and_wait, (sys.argv[1],), t=2, timeout_s=120)"
)


def record_and_wait(tp, directory: str) -> None:
    """A rank that says where it is, then outlives any test unless it is killed."""
    Path(directory, f"rank{tp.rank}.pid").write_text(str(os.getpid()))
    time.sleep(120)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead orphan may wait a moment to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _worker_pids(directory: Path, parent: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        files = sorted(directory.glob("rank*.pid"))
        if len(files) == 2 and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        assert parent.poll() is None, parent.communicate()
        time.sleep(0.1)
    raise AssertionError("the workers never started")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_parent_kills_its_spawned_ranks(tmp_path, sig):
    parent = subprocess.Popen(
        [sys.executable, "-c", SPAWN, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    workers = _worker_pids(tmp_path, parent)
    assert all(_running(pid) for pid in workers)
    parent.send_signal(sig)
    _, err = parent.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
