"""How the probe's t ranks get started: single, spawn, fake or torchrun, behind one entry point, `run`, which
calls fn(tp, *args) with a `TensorParallelGroup` and hands back its result. What each mode needs and how spawned
workers start and meet: docs/probe-launching.md.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import pickle
import signal
import threading
import time
import traceback
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from multiprocessing import connection, forkserver, resource_tracker
from typing import Any, Callable, Iterator, Sequence

from memcalc.errors import ConfigError, ProbeError
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup, single
from memcalc.text import short_repr

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)

RankFn = Callable[..., Any]  # fn(tp: TensorParallelGroup, *args) -> picklable result

DEFAULT_TIMEOUT_S = 300.0
LOCALHOST = "127.0.0.1"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
EXIT_GRACE_S = 5.0  # how long finished workers get to leave their group before being killed
STORE_START_S = 30.0  # the least time the spawn store gets to start, whatever the ranks' timeout


class Mode(str, Enum):
    """Which way the ranks ran, so output can say so."""

    SINGLE = "single"
    SPAWN = "spawn"
    FAKE = "fake"
    TORCHRUN = "torchrun"

    def __str__(self) -> str:
        return self.value


def run(
    fn: RankFn, args: Sequence[Any] = (), *, mode: Mode | str, t: int = 1, backend: str = "gloo", device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run fn(tp, *args) on t ranks in `mode`; the results this process holds, in rank order (spawn: all t;
    torchrun: rank 0's on rank 0, none elsewhere). `backend` is for spawn only (docs/probe-launching.md)."""
    try:
        mode = Mode(mode)
    except ValueError:
        raise ProbeError(f"unknown launch mode {mode!r}; expected one of {', '.join(Mode)}") from None
    if mode is Mode.SPAWN:
        return run_spawned(fn, args, t, backend, device, timeout_s)
    if mode is Mode.FAKE:
        return [run_fake(fn, args, t, device)]
    if mode is Mode.SINGLE:
        if t != 1:
            raise ProbeError(f"mode single runs one rank, but t={t}; use spawn, fake or torchrun")
        return [fn(single(device), *args)]  # t = 1, in this process, without any process group
    world = torchrun_env()["WORLD_SIZE"] if under_torchrun() else t  # without torchrun: run_torchrun says so
    if world != t:
        raise ProbeError(f"t={t}, but torchrun started WORLD_SIZE={world} ranks (under torchrun t = WORLD_SIZE)")
    result = run_torchrun(fn, args, timeout_s)
    return [result] if torchrun_env()["RANK"] == 0 else []


# -- fake: one process posing as one rank of t ---------------------------------


def run_fake(fn: RankFn, args: Sequence[Any], t: int, device: str = "cpu", rank: int = 0) -> Any:
    """fn as rank `rank` of t, in this process, through torch's fake process group: the default group for the
    call only, so a process that already has one (a spawned worker, a torchrun rank) is refused."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        raise ProbeError(
            f"mode fake needs a process without a process group, but this one already belongs to one "
            f"(backend {dist.get_backend()}, world size {dist.get_world_size()})"
        )
    with _joined("fake", rank, t, torch.device(device), store=FakeStore()) as tp:
        return fn(tp, *args)


@contextmanager
def world_of(size: int, group: TensorParallelGroup) -> Iterator[None]:
    """While inside, a default process group of `size` ranks: the launch's where it has that many, else torch's fake
    one, this process rank 0 (a library's layout wider than the probe's group: megatron's t*ep ranks, torchtitan's
    experts over dp_shard); after, the launch's own fake group of the group's size (or none) back."""
    own = not dist.is_initialized() or dist.get_world_size() != size
    if own:
        _join_fake_world(size)
    try:
        yield
    finally:
        if own:
            _join_fake_world(group.size if group.mode == "fake" else None)


def _join_fake_world(size: int | None) -> None:
    """The default process group becomes torch's fake one of `size` ranks, this one rank 0 (None: no group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    if dist.is_initialized():
        dist.destroy_process_group()
    if size is not None:
        dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())


# -- torchrun: this process is one rank of the job -----------------------------


def under_torchrun() -> bool:
    """Whether torchrun (or a launcher that sets the same variables) started this process; if so the variables are
    checked here, the first place every caller passes, so no later int(os.environ["RANK"]) meets RANK=zero."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return False
    torchrun_env()
    return True


def torchrun_env() -> dict[str, int]:
    """RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT as numbers, or ConfigError naming the one that is wrong."""
    lowest = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "MASTER_PORT": 1}
    values = {}
    for name, least in lowest.items():
        text = os.environ.get(name, "")
        if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < least:
            raise ConfigError(
                f"torchrun variable {name}={short_repr(text)} is not a whole number >= {least}"
                " (set by torchrun; unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to run alone)"
            )
        values[name] = int(text)
    if values["RANK"] >= values["WORLD_SIZE"]:
        raise ConfigError(f"torchrun variable RANK={values['RANK']} is not below WORLD_SIZE={values['WORLD_SIZE']}")
    if values["MASTER_PORT"] > 65535:
        raise ConfigError(f"torchrun variable MASTER_PORT={values['MASTER_PORT']} is not a port (1 to 65535)")
    return values


def run_torchrun(fn: RankFn, args: Sequence[Any] = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> Any | None:
    """fn on this torchrun rank, t = WORLD_SIZE (nccl on cuda:LOCAL_RANK, else gloo); rank 0's result, else None."""
    if not under_torchrun():
        missing = ", ".join(name for name in TORCHRUN_ENV if name not in os.environ)
        raise ProbeError(f"mode torchrun needs the environment torchrun sets, but {missing} is not set")
    env = torchrun_env()
    rank, t = env["RANK"], env["WORLD_SIZE"]
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = _rank_device("cuda" if backend == "nccl" else "cpu", env["LOCAL_RANK"])
    with _rendezvous_named(env), _joined(
        backend, rank, t, device, init_method="env://", timeout=timedelta(seconds=timeout_s)
    ) as tp:
        result = fn(tp, *args)
    return result if rank == 0 else None


@contextmanager
def _rendezvous_named(env: dict[str, int]) -> Iterator[None]:
    """torch's DistNetworkError (a busy MASTER_PORT, an unreachable MASTER_ADDR) as one line naming both."""
    try:
        yield
    except dist.DistNetworkError as err:
        where = f"MASTER_ADDR={short_repr(os.environ.get('MASTER_ADDR'))} MASTER_PORT={env['MASTER_PORT']}"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ProbeError(f"torchrun rank {env['RANK']} could not meet the others at {where}: {reason}") from err


# -- spawn: t local worker processes -------------------------------------------


JOIN_ATTEMPTS = 2  # gloo rarely fails to connect ("Connection closed by peer"); a fresh group then works


@dataclass(frozen=True)
class _Job:
    """Everything a spawned worker needs; pickled once, here, so a lambda fails before any process starts."""

    fn: RankFn
    args: tuple
    t: int
    backend: str
    device: str
    timeout_s: float


class _JoinFailed(ProbeError):
    """A rank could not form the process group before fn ran: worth one fresh attempt."""


class _RankFailed(ProbeError):
    """A rank's own report of an exception."""


def run_spawned(
    fn: RankFn, args: Sequence[Any], t: int, backend: str = "gloo", device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """fn on t fresh local processes, one per rank; their results in rank order. A failing or late rank raises a
    one-line ProbeError and every worker is killed; only a failure to form the group is tried again, once."""
    _check_spawn(t, backend, device)
    job = _Job(fn, tuple(args), t, backend, device, timeout_s)
    try:
        pickled = pickle.dumps(job)
    except Exception as err:
        raise ProbeError(
            f"spawned ranks receive fn and its args by pickle, which failed ({err}); define fn at module level"
        ) from err
    for _ in range(JOIN_ATTEMPTS - 1):
        with suppress(_JoinFailed):
            return _spawn_once(job, pickled)
    return _spawn_once(job, pickled)


def _spawn_once(job: _Job, pickled: bytes) -> list[Any]:
    """Start the t workers around a fresh store, collect their results, and stop them all."""
    store = dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False, timeout=_store_timeout(job))
    workers: list[tuple[multiprocessing.Process, connection.Connection]] = []
    results = None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*FORKSERVER_PRELOAD, job.fn.__module__])  # counts only when the server starts
    watched, alive = context.Pipe(duplex=False)  # nothing is ever sent: only this process's end closing counts
    _start_forkserver_deaf_to_sigint()
    try:
        for rank in range(job.t):
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_spawned_rank, args=(rank, pickled, store.port, sender, watched))
            process.daemon = True  # dies with this process, whatever happens
            process.start()
            sender.close()  # keep only the worker's end open, so its death reads as end-of-file
            workers.append((process, receiver))
        results = _collect(workers, job, time.monotonic() + job.timeout_s)
        return results
    finally:
        _stop(workers, grace_s=EXIT_GRACE_S if results is not None else 0.0)
        watched.close()
        alive.close()


def _start_forkserver_deaf_to_sigint() -> None:
    """Start the forkserver (if not running) with SIGINT blocked, which it and every worker it forks inherit:
    only memcalc handles a Ctrl-C (docs/probe-launching.md, "Signals")."""
    resource_tracker.ensure_running()  # first, as ensure_running below would: it unblocks SIGINT when it is done
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _store_timeout(job: _Job) -> timedelta:
    """How long connecting to the local store may take: at least STORE_START_S (`_collect` keeps the ranks'
    deadline; a tiny store timeout would fail to connect, with a C++ log)."""
    return timedelta(seconds=max(job.timeout_s, STORE_START_S))


def _check_spawn(t: int, backend: str, device: str) -> None:
    if t < 1:
        raise ProbeError(f"t={t}: tensor parallelism needs at least one rank")
    if backend not in ("gloo", "nccl"):
        raise ProbeError(f"unknown backend {backend!r}; expected gloo or nccl")
    if device not in ("cpu", "cuda"):
        raise ProbeError(f"unknown device {device!r}; expected cpu or cuda")
    if backend == "nccl" and device != "cuda":
        raise ProbeError("backend nccl runs on GPUs only; use device cuda, or backend gloo on the CPU")
    if device == "cuda" and torch.cuda.device_count() < t:
        raise ProbeError(f"t={t} needs {t} GPUs (one per rank), but torch sees {torch.cuda.device_count()}")


# Imported once in the forkserver rather than in every worker. torch's first backward imports
# symbolic_shapes, and with it sympy: seconds per worker on a small machine.
FORKSERVER_PRELOAD = ["__main__", "torch", "torch.fx.experimental.symbolic_shapes", __name__]


def _spawned_rank(
    rank: int, pickled_job: bytes, store_port: int, sender: connection.Connection, owner: connection.Connection,
) -> None:
    """One worker: join the group, run fn, send home its result or its error, leave (and die with `owner`)."""
    _die_with(owner)
    status = "failed"  # what an error at this point means to the parent; "unjoined" is tried again
    try:
        job: _Job = pickle.loads(pickled_job)  # here, so that a module fn cannot be imported from is reported
        status = "unjoined"
        if "OMP_NUM_THREADS" not in os.environ:  # a user's (or the tests') thread count is kept as torch reads it
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.t))  # t ranks share this machine's cores
        store = dist.TCPStore(LOCALHOST, store_port, is_master=False, timeout=_store_timeout(job))
        device = _rank_device(job.device, rank)
        with _joined(job.backend, rank, job.t, device, store=store, timeout=timedelta(seconds=job.timeout_s)) as tp:
            status = "failed"
            # Sent before leaving the group: after a failure, leaving may wait on peers stuck in a collective.
            sender.send_bytes(_outcome(job.fn, tp, job.args))
    except BaseException as err:  # loading, joining or leaving failed; the parent reads only the first message
        try:
            sender.send_bytes(_failure(err, status))
        except OSError:  # the parent is gone (its end of the pipe closed): nobody to tell, nothing to print
            os._exit(1)


def _die_with(owner: connection.Connection) -> None:
    """Leave at once when the spawning process ends, however it ends (docs/probe-launching.md, "Signals")."""
    def watch() -> None:
        with suppress(EOFError, OSError):
            owner.recv_bytes()
        os._exit(1)

    threading.Thread(target=watch, name="memcalc-owner-watch", daemon=True).start()


def _outcome(fn: RankFn, tp: TensorParallelGroup, args: tuple) -> bytes:
    """The pickled ("ok", result) of fn(tp, *args), or its pickled failure."""
    try:
        return pickle.dumps(("ok", fn(tp, *args)))
    except BaseException as err:
        return _failure(err, "failed")


def _failure(err: BaseException, status: str) -> bytes:
    """(status, the error in one line with where it was raised, its traceback), pickled."""
    where = traceback.extract_tb(err.__traceback__)[-1:]
    at = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno} in {where[0].name})" if where else ""
    line = " ".join(f"{type(err).__name__}: {err}".split())
    return pickle.dumps((status, line + at, traceback.format_exc()))


class _RemoteTraceback(Exception):
    """A worker's traceback, chained under the ProbeError so a debug run can print it."""

    def __str__(self) -> str:
        return self.args[0]


def _collect(workers: list, job: _Job, deadline: float) -> list[Any]:
    """Each worker's result, in rank order; the first failure, death or the deadline raises."""
    results: dict[int, Any] = {}
    while len(results) < job.t:
        waiting = {rank: worker for rank, worker in enumerate(workers) if rank not in results}
        ready = connection.wait([r for _, r in waiting.values()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late = ", ".join(str(rank) for rank in waiting)
            raise ProbeError(
                f"rank(s) {late} of t={job.t} ({job.backend}) did not finish within {job.timeout_s:g} s; "
                "stopped all workers"
            )
        for rank, (process, receiver) in waiting.items():
            if receiver in ready:
                try:
                    results[rank] = _received(rank, process, receiver, job)
                except _RankFailed as failed:
                    _raise_a_silent_death(workers, {rank, *results}, job, failed)
                    raise
    return [results[rank] for rank in range(job.t)]


# A rank's failure is often a peer's death seen from its side (a collective's connection reset by the peer): how long
# the other ranks are given to show a death without a result, which is then reported as the cause.
_PEER_GRACE_S = 2.0


def _raise_a_silent_death(workers: list, done: set[int], job: _Job, failed: ProbeError) -> None:
    """The ProbeError of a rank not `done` that dies without a result within the grace (the failure chained)."""
    others = {rank: worker for rank, worker in enumerate(workers) if rank not in done}
    deadline = time.monotonic() + _PEER_GRACE_S
    while others:
        ready = connection.wait([r for _, r in others.values()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return
        for rank, (process, receiver) in list(others.items()):
            if receiver in ready:
                del others[rank]
                try:
                    receiver.recv_bytes()
                except EOFError:
                    raise _died(rank, process, job) from failed


def _died(rank: int, process: multiprocessing.Process, job: _Job) -> ProbeError:
    process.join(timeout=1.0)
    return ProbeError(f"rank {rank} of t={job.t} ({job.backend}) died without a result (exit code {process.exitcode})")


def _received(rank: int, process: multiprocessing.Process, receiver: connection.Connection, job: _Job) -> Any:
    """One worker's result, or the ProbeError that its failure or silent death amounts to."""
    who = f"rank {rank} of t={job.t} ({job.backend})"
    try:
        status, *payload = pickle.loads(receiver.recv_bytes())
    except EOFError:
        raise _died(rank, process, job) from None
    if status == "ok":
        return payload[0]
    message, remote = payload
    if status == "unjoined":
        raise _JoinFailed(f"{who} could not join the process group: {message}") from _RemoteTraceback(remote)
    raise _RankFailed(f"{who} failed: {message}") from _RemoteTraceback(remote)


def _stop(workers: list, grace_s: float) -> None:
    """Let workers exit within grace_s, then kill whatever is left."""
    deadline = time.monotonic() + grace_s
    for process, receiver in workers:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
        receiver.close()


# -- shared by every mode with a process group ---------------------------------


@contextmanager
def _joined(
    backend: str, rank: int, t: int, device: torch.device, **init: Any
) -> Iterator[TensorParallelGroup]:
    """Membership of a t-rank default process group for the duration of the block."""
    dist.init_process_group(backend, rank=rank, world_size=t, **init)
    try:
        yield TensorParallelGroup(dist.group.WORLD, rank, t, backend, device)
    finally:
        dist.destroy_process_group()
        _forget_sharding_cache()


def _forget_sharding_cache() -> None:
    """Empty DTensor's sharding cache, as torch's own DTensor tests do between cases: its meshes hash by layout, so a
    later run's mesh would get specs naming the destroyed groups ("Could not resolve the process group")."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor ran
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # the Python cache and C++'s fast path's

    _clear_sharding_prop_cache()


def _rank_device(kind: str, index: int) -> torch.device:
    """cpu, or the GPU cuda:index made current (one GPU per rank)."""
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device
