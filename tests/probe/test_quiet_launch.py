"""A rank that cannot meet the others, or a Ctrl-C while workers start, ends in memcalc's one line (issue 22):
no torch C++ log before it, no forkserver traceback after it, and no process left running."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.procs

REPO = Path(__file__).resolve().parents[2]
MEASURE = [sys.executable, "-m", "memcalc", "measure", "--config", "tiny", "--strategy", "tp", "--t", "2"]


def _environment(**extra: str) -> dict[str, str]:
    drop = ("MEMCALC_DEBUG", "TORCH_CPP_LOG_LEVEL", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_rank_that_cannot_reach_master_addr_prints_only_memcalcs_line():
    port = _closed_port()
    env = _environment(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run([*MEASURE, "--launch", "torchrun", "--timeout", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    where = f"MASTER_ADDR='127.0.0.1' MASTER_PORT={port}"
    assert proc.stderr.startswith(f"memcalc: error: torchrun rank 1 could not meet the others at {where}:")


def _group(pgid: int) -> list[str]:
    """The command lines of group `pgid`'s processes still running (a dead one waiting to be reaped does not count).

    Read from /proc rather than from `ps`, whose columns follow $COLUMNS and can cut a command line short."""
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # it left while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            running.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return running


def _as_from_a_terminal() -> None:
    """SIGINT's default disposition, as a command typed at a terminal has it: a test run in a background job (a
    shell without job control starts those with SIGINT ignored) would pass its ignoring on, and Python keeps an
    ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _forkserver_started(pid: int) -> bool:
    """The forkserver runs and memcalc (`pid`) no longer blocks SIGINT, as it does while it starts the forkserver
    (so that the forkserver inherits the blocking): a Ctrl-C from now on is memcalc's to handle at once."""
    status = Path(f"/proc/{pid}/status").read_text()
    blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
    return any("forkserver" in line for line in _group(pid)) and not blocked & (1 << (signal.SIGINT - 1))


def test_ctrl_c_while_workers_start_is_one_line_exit_130_and_leaves_nothing_running():
    proc = subprocess.Popen([*MEASURE, "--launch", "spawn", "--backend", "gloo"], cwd=REPO, env=_environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_as_from_a_terminal)
    deadline = time.monotonic() + 90
    while not _forkserver_started(proc.pid) and time.monotonic() < deadline:  # it is up, importing torch
        time.sleep(0.05)
    assert _forkserver_started(proc.pid), "the forkserver never started"
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "memcalc: error: interrupted\n")
    deadline = time.monotonic() + 30
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group(proc.pid) == []


# When a Ctrl-C lands: importing torch (numpy's module init swallowed a KeyboardInterrupt there, and the run went on;
# or left torch half-imported: exit 1), starting the forkserver (it was ignored), forking the workers, running them.
DELAYS_S = (0.2, 0.35, 0.5, 0.65, 0.8, 1.2, 2.0, 3.0)


def test_ctrl_c_wherever_it_lands_is_one_line_exit_130_and_leaves_nothing_running():
    """One measure per delay, side by side (under 20 s in all): each ends in memcalc's line and exit 130."""
    procs = {delay: subprocess.Popen([*MEASURE, "--launch", "spawn", "--backend", "gloo"], cwd=REPO,
                                     env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, preexec_fn=_as_from_a_terminal) for delay in DELAYS_S}
    started = time.monotonic()
    for delay, proc in procs.items():
        time.sleep(max(0.0, started + delay - time.monotonic()))
        os.killpg(proc.pid, signal.SIGINT)
    outcomes = {delay: (proc.communicate(timeout=120)[1], proc.returncode) for delay, proc in procs.items()}
    assert outcomes == {delay: ("memcalc: error: interrupted\n", 130) for delay in DELAYS_S}
    deadline = time.monotonic() + 30
    while any(_group(proc.pid) for proc in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {delay: _group(proc.pid) for delay, proc in procs.items()} == {delay: [] for delay in DELAYS_S}
