"""Tensor-parallel communication overlapped with the GEMMs (seed, section 5), run for real.

Under SP the column linear's all-gather (g) and the row linear's reduce-scatter (g*) run in pieces beside their
GEMM, as Megatron with Transformer Engine does (`Method`), in forward only; what each moves and why it cannot
deadlock: docs/probe.md, "Overlapped collectives".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from memcalc.errors import ProbeError
from memcalc.model.overlap import DEFAULT_SPLITS  # Transformer Engine's: more chunks cost more launches than they hide
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)
from torch.nn import functional as F  # noqa: E402


class Method(str, Enum):
    """One way to overlap a TP collective with its GEMM; the value is the name the CLI and the ledger use."""

    RING_AG = "ring-ag"  # the column linear's all-gather of its input, as ring hops
    RING_RS = "ring-rs"  # the row linear's reduce-scatter of its output, as ring hops
    PIPELINED_RS = "pipelined-rs"  # the row linear's reduce-scatter, one per GEMM block

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Overlap:
    """Which overlap methods a layer's linears use (none: plain g and g*), and pipelined-rs's block count;
    ring-rs and pipelined-rs do the same reduce-scatter, so they exclude each other."""

    methods: frozenset[Method] = field(default_factory=frozenset)
    num_splits: int = DEFAULT_SPLITS

    def __post_init__(self) -> None:
        object.__setattr__(self, "methods", frozenset(_method(m) for m in self.methods))
        if {Method.RING_RS, Method.PIPELINED_RS} <= self.methods:
            raise ProbeError("ring-rs and pipelined-rs both overlap the row linear's reduce-scatter; choose one")
        if self.num_splits < 1:
            raise ProbeError(f"num_splits={self.num_splits}: the pipelined reduce-scatter needs at least one chunk")

    @classmethod
    def of(cls, *names: str | Method, num_splits: int = DEFAULT_SPLITS) -> Overlap:
        """Overlap.of("ring-ag", "ring-rs"): the methods by name."""
        return cls(frozenset(names), num_splits)

    def __bool__(self) -> bool:
        return bool(self.methods)

    def __str__(self) -> str:
        names = ",".join(sorted(m.value for m in self.methods)) or "none"
        return f"{names} (num_splits={self.num_splits})" if Method.PIPELINED_RS in self.methods else names

    def gathered_gemm(self) -> GatheredGemm | None:
        """The column linear's forward under SP when it is overlapped, else None (the plain all-gather)."""
        return ring_gathered_gemm if Method.RING_AG in self.methods else None

    def scattered_gemm(self) -> ScatteredGemm | None:
        """The row linear's forward under SP when it is overlapped, else None (the plain g*)."""
        if Method.RING_RS in self.methods:
            return ring_scattered_gemm
        if Method.PIPELINED_RS in self.methods:
            return _PipelinedScatter(self.num_splits)
        return None


NO_OVERLAP = Overlap()


def _method(name: str | Method) -> Method:
    try:
        return Method(name)
    except ValueError:
        choices = ", ".join(m.value for m in Method)
        raise ProbeError(f"unknown overlap method {name!r}; expected one of {choices}") from None


# (x_shard (s/t, b, in), weight (out/t, in), bias, tp) -> (s, b, out/t): g and the column GEMM
GatheredGemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", TensorParallelGroup], torch.Tensor]
# (x (s, b, in/t), weight (out, in/t), tp) -> (s/t, b, out): the row GEMM and g*
ScatteredGemm = Callable[[torch.Tensor, torch.Tensor, TensorParallelGroup], torch.Tensor]


# -- the ring: who passes to whom, and which chunk a rank works on at each step --


def ring_neighbours(tp: TensorParallelGroup) -> tuple[int, int]:
    """(the rank this one sends to, the rank it receives from): chunks travel up the ranks, t-1 wrapping to 0."""
    return (tp.rank + 1) % tp.size, (tp.rank - 1) % tp.size


def gathered_chunk(rank: int, step: int, t: int) -> int:
    """The sequence chunk `rank` holds at `step` of the all-gather ring: its own, then its left neighbours'."""
    return (rank - step) % t


def reduced_chunk(rank: int, step: int, t: int) -> int:
    """The sequence chunk `rank` adds its partial result to at `step` of the reduce-scatter ring: chunk j's
    buffer starts on rank j+1 and moves up a rank a step, so every rank's last chunk is its own."""
    return (rank - 1 - step) % t


def _exchange(send: torch.Tensor, receive: torch.Tensor, tp: TensorParallelGroup) -> list[dist.Work]:
    """Start one hop: `send` to the next rank and `receive` from the previous; wait on what it returns."""
    to, source = ring_neighbours(tp)
    hop = [
        dist.P2POp(dist.isend, send, group=tp.group, group_peer=to),
        dist.P2POp(dist.irecv, receive, group=tp.group, group_peer=source),
    ]
    return dist.batch_isend_irecv(hop)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


# -- the overlapped forwards: plain functions, no autograd (linear.py's g and g* wrap them) --


def ring_gathered_gemm(
    x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallelGroup
) -> torch.Tensor:
    """F.linear(all-gather of x_shard along s, weight, bias), the gather done as t-1 hops beside t GEMMs (two
    chunk buffers live at a time: the one being multiplied and the one arriving)."""
    rows = x_shard.shape[0]  # s/t
    out = x_shard.new_empty(tp.size * rows, *x_shard.shape[1:-1], weight.shape[0])  # (s, b, out/t)
    held = x_shard.contiguous()
    for step in range(tp.size):
        last = step == tp.size - 1
        if not last:  # the next chunk travels while this one is multiplied
            arriving = torch.empty_like(held)
            hop = _exchange(held, arriving, tp)
        chunk = gathered_chunk(tp.rank, step, tp.size)
        out.narrow(0, chunk * rows, rows).copy_(F.linear(held, weight, bias))  # (s/t, b, out/t)
        if not last:
            _wait(hop)
            held = arriving
    return out


def ring_scattered_gemm(x: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Reduce-scatter along s of F.linear(x, weight), as t-1 hops of partial sums beside t chunk GEMMs: each
    step a rank computes one chunk's partial, adds the sum that arrived for it and passes it on; the last is its own."""
    rows = tp.divide(x.shape[0], "sequence length (dim 0)")  # s/t
    hop = arriving = None  # no hop before the first step
    for step in range(tp.size):
        chunk = reduced_chunk(tp.rank, step, tp.size)
        summed = F.linear(x.narrow(0, chunk * rows, rows), weight)  # (s/t, b, out): this rank's partial
        if hop is not None:
            _wait(hop)  # the sum sent last step is out (`sending` kept it alive); this chunk's is in
            summed += arriving  # the partials of the ranks before this one in the ring
        if step < tp.size - 1:
            sending, arriving = summed, torch.empty_like(summed)
            hop = _exchange(sending, arriving, tp)
    return summed


@dataclass(frozen=True)
class _PipelinedScatter:
    """Reduce-scatter along s of F.linear(x, weight) in num_splits blocks of output features: block i's GEMM
    runs while block i-1's reduce-scatter is in flight, and the blocks side by side are this rank's shard."""

    num_splits: int

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        out_features = weight.shape[0]
        if out_features % self.num_splits:
            raise ProbeError(f"out_features={out_features} is not divisible by num_splits={self.num_splits}")
        width = out_features // self.num_splits
        rows = tp.divide(x.shape[0], "sequence length (dim 0)")  # s/t
        out = x.new_empty(rows, *x.shape[1:-1], out_features)  # (s/t, b, out)
        in_flight = []
        for block in range(self.num_splits):
            partial = F.linear(x, weight.narrow(0, block * width, width))  # (s, b, out/num_splits)
            shard = x.new_empty(rows, *x.shape[1:-1], width)  # (s/t, b, out/num_splits)
            work = dist.reduce_scatter_single(shard, partial, group=tp.group, async_op=True)
            in_flight.append((block, shard, partial, work))  # partial stays alive until its work is done
        for block, shard, _, work in in_flight:
            work.wait()
            out.narrow(-1, block * width, width).copy_(shard)
        return out


def check_overlap(overlap: Overlap, sequence_parallel: bool) -> None:
    """Overlap replaces SP's all-gather and reduce-scatter: without SP there is neither to overlap."""
    if overlap and not sequence_parallel:
        raise ProbeError(
            f"overlap {overlap} replaces sequence parallelism's all-gather and reduce-scatter; "
            "it needs sequence_parallel (strategy tp-sp)"
        )
