"""The communication ledger: every collective a layer's f, f*, g, g* issue, and the bytes each rank sends.

Built like the activation ledger, beside it. A tensor-parallel block enters and
leaves the column/row-parallel pair through one conjugate pair of operators
(SEED.md section 4), and each operator's forward and backward is a collective
(or nothing):

    f  (enter, tp)      forward -                 backward all-reduce of dX
    f* (leave, tp)      forward all-reduce of Y   backward -
    g  (enter, tp-sp)   forward all-gather of X   backward reduce-scatter of dX
    g* (leave, tp-sp)   forward reduce-scatter    backward all-gather of dY

Under SP, Megatron's column-parallel linear keeps only its input's sequence
shard, so its backward all-gathers the input once more to form dW = X^T dY (the
seed's overlapped re-gather); an implementation that keeps the gathered input
(torchtitan's DTensor plan) skips it. Full recomputation reruns the forward in
backward, collectives included. Every collective moves a (b, s, h) tensor of
the activation dtype.

Bytes one rank sends under the ring algorithm, for a tensor of n bytes:
all-reduce 2(t-1)/t * n, all-gather and reduce-scatter (t-1)/t * n each (a rank
receives as much as it sends).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from fractions import Fraction
from math import prod
from typing import Any

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model.evaluate import check_strategy, dim_sizes
from memcalc.model.impls import implementation, plan
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.model.ledger import Dim
from memcalc.model.strategy import Strategy

_BSH = (Dim.B, Dim.S, Dim.H)


class Op(Enum):
    """A collective, and the share of its tensor one rank sends under the ring algorithm."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    SEND = "send"  # one point-to-point message of an overlapped ring
    RECV = "recv"  # its partner: what arrives (received bytes are not counted as sent)

    def share(self, t: int) -> Fraction:
        """Bytes one of t ranks moves, as a fraction of the tensor (or message) the call names."""
        if self in (Op.SEND, Op.RECV):
            return Fraction(1)
        steps = Fraction(t - 1, t)
        return 2 * steps if self is Op.ALL_REDUCE else steps


@dataclass(frozen=True)
class Collective:
    """One collective of one layer: which operator issues it, when, what it moves, and why."""

    name: str  # block/operator, e.g. "attention/g*"
    operator: str  # the seed's f, f*, g, g*
    op: Op
    phase: str  # "forward" or "backward"
    moves: str
    shape: tuple[Dim, ...]  # the whole tensor, before any split
    why: str
    piece: Fraction = Fraction(1)  # the part of that tensor this call moves (a ring message, a pipelined chunk)


def _enter(block: str, what: str, sequence_parallel: bool) -> tuple[Collective, ...]:
    """The operator in front of a block's column-parallel linear."""
    if sequence_parallel:
        return (
            Collective(f"{block}/g", "g", Op.ALL_GATHER, "forward", f"{what} (sequence shards)", _BSH,
                       "the column-parallel linear needs every token of its input"),
            Collective(f"{block}/g", "g", Op.REDUCE_SCATTER, "backward", f"the gradient of {what}", _BSH,
                       "each rank's partial dX is summed and handed back as its sequence shard"),
        )
    return (
        Collective(f"{block}/f", "f", Op.ALL_REDUCE, "backward", f"the gradient of {what}", _BSH,
                   "each rank computed dX from its own columns: the partial sums are added"),
    )


def _leave(block: str, what: str, sequence_parallel: bool) -> tuple[Collective, ...]:
    """The operator after a block's row-parallel linear."""
    if sequence_parallel:
        return (
            Collective(f"{block}/g*", "g*", Op.REDUCE_SCATTER, "forward", what, _BSH,
                       "the row-parallel partial sums are added and split back into sequence shards"),
            Collective(f"{block}/g*", "g*", Op.ALL_GATHER, "backward", f"the gradient of {what}", _BSH,
                       "the row-parallel linear's backward needs dY for every token"),
        )
    return (
        Collective(f"{block}/f*", "f*", Op.ALL_REDUCE, "forward", what, _BSH,
                   "each rank holds a partial sum of the row-parallel output"),
    )


def _regather(block: str, what: str) -> Collective:
    return Collective(f"{block}/g", "g", Op.ALL_GATHER, "backward", f"{what} again", _BSH,
                      "only the input's sequence shard was kept: dW = X^T dY needs it whole (the seed's re-gather)")


_BLOCKS = (("attention", "the QKV input", "the projection output"), ("mlp", "the fc1 input", "the fc2 output"))


def layer_collectives(
    knobs: Any, strategy: Strategy, overlap: frozenset[str] = frozenset(), t: int = 1, splits: int = 4
) -> tuple[Collective, ...]:
    """Every collective one layer issues per micro-batch, forward then backward, as the implementation runs it.

    `overlap` (tp-sp) names the methods that cut a forward collective into pieces
    (memcalc.model.overlap): ring-ag and ring-rs into t-1 ring hops of one
    sequence chunk, pipelined-rs into `splits` reduce-scatters. Backward is
    unchanged. `t` matters only to the rings (how many hops).
    """
    if not strategy.tensor_parallel:
        return ()
    plan(knobs, strategy)  # refuses a layout the implementation does not run
    if knobs.mla:
        raise ConfigError(f"kv_lora_rank={knobs.kv_lora_rank}: latent attention's collectives (the down projections'"
                          " outputs gathered over t, SP's scatter of the latents) are not modelled yet")
    sp = strategy.sequence_parallel
    regathers = sp and not implementation(knobs).kept_whole
    forward, backward = [], []
    for block, entering, leaving in _BLOCKS:
        for c in (*_enter(block, entering, sp), *_leave(block, leaving, sp)):
            forward += _pieces(c, overlap, t, splits) if c.phase == "forward" else []
    if knobs.recompute == "full":  # backward first reruns the whole forward, collectives and all
        backward = [_rerun(c) for c in forward]
    for block, entering, leaving in reversed(_BLOCKS):  # then meets the MLP first, each block from its output
        leave = [c for c in _leave(block, leaving, sp) if c.phase == "backward"]
        enter = [c for c in _enter(block, entering, sp) if c.phase == "backward"]
        backward += [*leave, *([_regather(block, entering)] if regathers else []), *enter]
    return (*forward, *backward)


def _rerun(c: Collective) -> Collective:
    return replace(c, phase="backward", moves=f"{c.moves} (recomputed forward)",
                   why="full recomputation reruns the layer's forward in backward")


def _pieces(c: Collective, overlap: frozenset[str], t: int, splits: int) -> list[Collective]:
    """A forward collective as the overlap method that takes it issues it: ring hops, chunks, or whole."""
    ring = (c.op is Op.ALL_GATHER and "ring-ag" in overlap) or (c.op is Op.REDUCE_SCATTER and "ring-rs" in overlap)
    if ring:
        hop = Fraction(1, t)
        return [replace(c, op=op, moves=f"{c.moves}: one sequence chunk, a ring hop", piece=hop)
                for _ in range(t - 1) for op in (Op.SEND, Op.RECV)]
    if c.op is Op.REDUCE_SCATTER and "pipelined-rs" in overlap:
        return [replace(c, moves=f"{c.moves}: one of {splits} GEMM blocks", piece=Fraction(1, splits))] * splits
    return [c]


def ring_units(c: Collective) -> int:
    """How many times its tensor's bytes x (t-1)/t a collective sends from each rank: 2 for an all-reduce, else 1."""
    return 2 if c.op is Op.ALL_REDUCE else 1


def sent_bytes(c: Collective, sizes: dict[Dim, int], t: int, width: int) -> int:
    """Bytes one rank moves for `c` (a receive: what arrives); exact, since t divides h (t | a | h)."""
    return int(c.op.share(t) * c.piece * width * prod(sizes[d] for d in c.shape))


@dataclass(frozen=True)
class LayerComm:
    """One strategy's collectives for one layer and one micro-batch, and what a step adds up to."""

    strategy: Strategy
    collectives: tuple[tuple[Collective, int], ...]  # each with the bytes one rank sends
    per_step_bytes: int
    pipeline_bytes: int  # activations and their gradients sent between stages, per step

    @property
    def per_layer_bytes(self) -> int:
        """Bytes one rank sends (what it receives is not counted)."""
        return sum(n for c, n in self.collectives if c.op is not Op.RECV)


def layer_comm(config: ModelConfig, strategy: Strategy, microbatches: int) -> LayerComm:
    """Per-layer collectives and bytes, and the step's total on a middle pipeline stage."""
    check_strategy(config, strategy)
    sizes, width = dim_sizes(config), DTYPE_BYTES[config.dtype]
    rows = tuple((c, sent_bytes(c, sizes, config.t, width)) for c in layer_collectives(config, strategy))
    per_layer = sum(n for c, n in rows if c.op is not Op.RECV)
    shard = config.t if strategy.sequence_parallel else 1
    boundary = 2 * width * sizes[Dim.B] * sizes[Dim.S] * sizes[Dim.H] // shard  # activation out, gradient back
    pipeline = microbatches * boundary if config.pp > 1 else 0
    return LayerComm(strategy, rows, config.L // config.pp * microbatches * per_layer + pipeline, pipeline)


def formula(knobs: Any, strategy: Strategy, width: int) -> tuple[str, str]:
    """Bytes one rank sends per layer, in symbols (text, LaTeX): every collective moves sbh x (t-1)/t."""
    units = sum(ring_units(c) for c in layer_collectives(knobs, strategy)) * width
    if not units:
        return "0", "0"
    return f"{units}sbh(t-1)/t", f"{units} \\frac{{t-1}}{{t}} s b h"
