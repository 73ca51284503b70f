"""The four ways of starting ranks: failures and hangs come back as one-line ProbeErrors,
the fake group gives real per-rank shapes in one process, torchrun's environment is honoured."""

import multiprocessing
import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from memcalc.errors import ProbeError  # noqa: E402
from memcalc.probe.launch import (  # noqa: E402
    Mode,
    run,
    run_fake,
    run_spawned,
    run_torchrun,
    under_torchrun,
)
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def _whoami(tp) -> tuple:
    return tp.rank, tp.size, tp.mode, str(tp.device)


def _fail_on_rank_1(tp) -> None:
    if tp.rank == 1:
        raise ValueError("bad shard\nsecond line")
    dist.barrier()  # rank 0 waits for a peer that will never come


def _rank_0_hangs(tp) -> None:
    if tp.rank == 0:
        time.sleep(60)
    dist.barrier()


def _rank_1_dies(tp) -> None:
    if tp.rank == 1:
        os._exit(3)
    dist.barrier()


@pytest.mark.procs
def test_spawned_ranks_each_run_fn_with_their_own_rank():
    assert run_spawned(_whoami, (), t=2) == [(0, 2, "gloo", "cpu"), (1, 2, "gloo", "cpu")]


@pytest.mark.procs
def test_a_failing_rank_raises_one_line_naming_the_rank_and_its_error():
    with pytest.raises(ProbeError) as caught:
        run_spawned(_fail_on_rank_1, (), t=2, timeout_s=30)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("rank 1 of t=2 (gloo) failed: ValueError: bad shard second line (at test_launch.py:")
    assert "raise ValueError" in str(caught.value.__cause__)  # the worker's traceback, for debugging
    assert multiprocessing.active_children() == []


@pytest.mark.procs
def test_a_hung_rank_times_out_instead_of_hanging_the_caller():
    started = time.monotonic()
    with pytest.raises(ProbeError, match=r"rank\(s\) 0, 1 of t=2 \(gloo\) did not finish within 2 s"):
        run_spawned(_rank_0_hangs, (), t=2, timeout_s=2)
    assert time.monotonic() - started < 15
    assert multiprocessing.active_children() == []


def _rank_0_fails_as_rank_1_dies(tp) -> None:
    if tp.rank == 1:
        time.sleep(0.3)
        os._exit(3)
    raise RuntimeError("Connection reset by peer")  # what a collective says when its peer is gone


@pytest.mark.procs
def test_a_failure_that_a_peers_silent_death_explains_is_reported_as_that_death():
    """The peer's death is the cause (its failure chained), whichever message reaches the launcher first."""
    with pytest.raises(ProbeError, match=r"rank 1 of t=2 \(gloo\) died without a result \(exit code 3\)") as caught:
        run_spawned(_rank_0_fails_as_rank_1_dies, (), t=2, timeout_s=30)
    assert str(caught.value.__cause__).startswith("rank 0 of t=2 (gloo) failed: RuntimeError: Connection reset")
    assert multiprocessing.active_children() == []


@pytest.mark.procs
def test_a_rank_that_dies_silently_is_reported_with_its_exit_code():
    with pytest.raises(ProbeError, match=r"rank 1 of t=2 \(gloo\) died without a result \(exit code 3\)"):
        run_spawned(_rank_1_dies, (), t=2, timeout_s=30)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"t": 0}, "t=0: tensor parallelism needs at least one rank"),
        ({"t": 2, "backend": "mpi"}, "unknown backend 'mpi'"),
        ({"t": 2, "backend": "nccl"}, "backend nccl runs on GPUs only"),
        ({"t": 2, "device": "cuda"} if not torch.cuda.is_available() else {"t": 99, "device": "cuda"}, "GPUs"),
    ],
)
def test_spawn_rejects_impossible_layouts_before_starting_anything(kwargs, message):
    with pytest.raises(ProbeError, match=message):
        run_spawned(_whoami, (), **kwargs)


def test_spawn_refuses_a_function_workers_cannot_unpickle_before_starting_anything():
    with pytest.raises(ProbeError, match="receive fn and its args by pickle, which failed .*define fn at module level"):
        run_spawned(lambda tp: tp.rank, (), t=2)


def _mlp_shapes(tp, s: int, b: int, h: int) -> dict:
    """Per-rank shapes of the MLP pair under tp-sp (column h->4h, row 4h->h)."""
    column = ColumnParallelLinear(h, 4 * h, tp, sequence_parallel=True)
    row = RowParallelLinear(4 * h, h, tp, sequence_parallel=True)
    x = torch.zeros(s // tp.size, b, h, requires_grad=True)
    hidden = column(x)
    out = row(hidden)
    out.sum().backward()
    return {
        "column.weight": tuple(column.weight.shape),
        "row.weight": tuple(row.weight.shape),
        "hidden": tuple(hidden.shape),
        "out": tuple(out.shape),
        "x.grad": tuple(x.grad.shape),
    }


def test_fake_group_gives_exact_per_rank_shapes_for_t_8_in_one_process():
    shapes = run_fake(_mlp_shapes, (64, 2, 16), t=8)
    assert shapes == {
        "column.weight": (64 // 8, 16),  # 4h/t rows
        "row.weight": (16, 64 // 8),  # 4h/t columns
        "hidden": (64, 2, 64 // 8),  # whole sequence inside the TP region
        "out": (64 // 8, 2, 16),  # sequence shard outside it
        "x.grad": (64 // 8, 2, 16),
    }


def test_fake_group_can_run_twice_and_leaves_no_process_group_behind():
    assert run_fake(_whoami, (), t=8) == (0, 8, "fake", "cpu")
    assert run_fake(_whoami, (), t=4, rank=3) == (3, 4, "fake", "cpu")
    assert not dist.is_initialized()


def test_fake_group_refuses_a_process_that_already_has_a_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ProbeError, match="already belongs to one .backend gloo, world size 1"):
            run_fake(_whoami, (), t=8)
        assert dist.get_world_size() == 1  # the caller's group is untouched
    finally:
        dist.destroy_process_group()


def test_single_runs_fn_on_t_1_without_a_process_group():
    assert run(_whoami, (), mode="single") == [(0, 1, "single", "cpu")]
    assert not dist.is_initialized()


@pytest.mark.procs
@pytest.mark.parametrize(
    ("mode", "t", "expected"),
    [("single", 1, [(0, 1, "single", "cpu")]), ("fake", 4, [(0, 4, "fake", "cpu")]), (Mode.SPAWN, 2, None)],
)
def test_run_dispatches_on_the_mode(mode, t, expected):
    results = run(_whoami, mode=mode, t=t)
    assert results == (expected or [(r, t, "gloo", "cpu") for r in range(t)])


@pytest.mark.parametrize(
    ("mode", "t", "message"),
    [("warp", 2, "unknown launch mode 'warp'; expected one of single, spawn, fake, torchrun"),
     ("single", 2, "mode single runs one rank, but t=2")],
)
def test_run_rejects_a_mode_that_cannot_give_t_ranks(mode, t, message):
    with pytest.raises(ProbeError, match=message):
        run(_whoami, mode=mode, t=t)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_under_torchrun_needs_every_variable_torchrun_sets(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not under_torchrun()
    with pytest.raises(ProbeError, match="needs the environment torchrun sets, but RANK, WORLD_SIZE"):
        run_torchrun(_whoami)
    for name, value in {**TORCHRUN_ENV, "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert under_torchrun()


def test_torchrun_mode_joins_from_the_environment_and_leaves(monkeypatch):
    for name, value in {**TORCHRUN_ENV, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    expected_backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert run_torchrun(_whoami)[:3] == (0, 1, expected_backend)
    assert not dist.is_initialized()
    with pytest.raises(ProbeError, match=r"t=2, but torchrun started WORLD_SIZE=1 ranks"):
        run(_whoami, mode="torchrun", t=2)


def _threads(tp, cores: int) -> tuple[int, bool]:
    """The rank's thread count, and whether it saw the `cores` the test pretends."""
    return torch.get_num_threads(), os.cpu_count() == cores


def _many_cores(n: int) -> int:
    """In the rank, as its job's args are unpickled, before it sets its thread count: os.cpu_count() says n there."""
    os.cpu_count = lambda: n
    return n


class _ManyCores:
    """An arg whose unpickling in the rank pretends a 64-core machine (`_many_cores`): cpu_count/t is then 64, never the
    1 OMP_NUM_THREADS sets, whatever cores this machine has."""

    def __reduce__(self):
        return _many_cores, (64,)


@pytest.mark.procs
def test_spawned_ranks_keep_the_thread_count_omp_num_threads_set():
    """The suite's conftest sets OMP_NUM_THREADS=1 (a user may set it too): a rank keeps it rather than taking
    cpu_count/t cores, which on a many-core machine oversubscribes ranks run side by side."""
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert run_spawned(_threads, (_ManyCores(),), t=1) == [(1, True)]
