"""Numbers from the ledger: bytes per tensor, per layer and per model, per GPU.

This path never touches sympy: a tensor's bytes are its element width times the
product of its per-rank dimensions, computed in exact integers. The same code
works element-wise on numpy arrays, which is how sweeps evaluate many
configurations at once. `memcalc.model.formula` builds the symbolic twin from the
same ledger, and a test checks the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from memcalc.config.schema import ModelConfig, check_sequence_split
from memcalc.model.impls import plan, tensors_at
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.ledger import Dim, SavedTensor
from memcalc.model.strategy import Strategy


def dim_sizes(config: ModelConfig) -> dict[Dim, Any]:
    """The value of every ledger dimension for this config, on one context-parallel rank.

    Context parallelism gives each rank s/cp of the tokens (check_layout makes
    2cp divide s), so that is the sequence every saved tensor spans.
    """
    return {
        Dim.B: config.b, Dim.S: config.s // config.cp, Dim.H: config.h, Dim.A: config.a,
        Dim.G: config.groups, Dim.D: config.h // config.a, Dim.F: config.ffn, Dim.V: config.vocab_size,
        Dim.QKV: config.a + 2 * config.groups,
    }


def rank_shape(tensor: SavedTensor, strategy: Strategy, sizes: dict[Dim, Any], t: Any) -> tuple[Any, ...]:
    """The tensor's shape on one rank: its split dimension (if any) divided by t.

    Every split dimension is a multiple of t (the config's rules) except the
    vocabulary, which is padded up to one: hence the division rounds up.
    """
    split = strategy.split_dim(tensor)
    return tuple(-(-sizes[d] // t) if d is split else sizes[d] for d in tensor.shape)


@dataclass(frozen=True)
class TensorBytes:
    """One saved tensor as one rank holds it."""

    tensor: SavedTensor
    shape: tuple[int, ...]
    element_bytes: int

    @property
    def bytes(self) -> int:
        return self.element_bytes * prod(self.shape)


@dataclass(frozen=True)
class LayerEstimate:
    """What one rank keeps for one layer under one strategy, and for all L layers."""

    strategy: Strategy
    layers: int
    tensors: tuple[TensorBytes, ...]

    @property
    def per_layer_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return self.per_layer_bytes * self.layers

    def __repr__(self) -> str:
        """One line for a notebook: the generated repr would print every tensor of the ledger."""
        from memcalc.units import human_bytes

        return (f"<LayerEstimate {self.strategy.name}: {human_bytes(self.per_layer_bytes)} per layer,"
                f" {human_bytes(self.total_bytes)} for {self.layers} layers, {len(self.tensors)} tensors>")


def check_strategy(config: ModelConfig, strategy: Strategy) -> Strategy:
    """The strategy as the config's implementation runs it; refuse what it cannot lay out (SP needs t | s)."""
    planned = plan(config, strategy)
    if strategy.sequence_parallel:
        check_sequence_split(config)
    return planned


def estimate(config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting()) -> LayerEstimate:
    """Per-rank activation bytes of `config` under `strategy`, tensor by tensor."""
    strategy = check_strategy(config, strategy)
    knobs = Knobs.of(config)
    sizes = dim_sizes(config)
    kept = tensors_at(knobs, accounting, sizes, strategy.weight_shards(config.t))
    tensors = tuple(
        TensorBytes(x, rank_shape(x, strategy, sizes, config.t), element_bytes(x.kind, knobs, accounting))
        for x in kept
    )
    return LayerEstimate(strategy, config.L, tensors)
