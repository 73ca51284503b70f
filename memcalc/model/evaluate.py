"""Numbers from the ledger: bytes per tensor, per layer and per model, per GPU.

A tensor's bytes are its element width times its per-rank dimensions, in exact integers and never through sympy;
the same code runs element-wise on numpy arrays for sweeps. `memcalc.model.formula` is its symbolic twin, and a
test checks the two agree.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import TYPE_CHECKING, Any

from memcalc.model.impls import implementation, plan, tensors_at
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.rules import check_sequence_split
from memcalc.model.ledger import Dim, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.records import record
from memcalc.units import minimum

if TYPE_CHECKING:
    from memcalc.config.schema import ModelConfig


def dim_sizes(config: ModelConfig, routers: Any = 1) -> dict[Dim, Any]:
    """The value of every ledger dimension for this config, on one context-parallel rank (s/cp tokens).
    `routers`: the ranks that split a tensor-parallel group's tokens before a MoE router (t under SP), each dropping
    its own tokens to its own capacity."""
    sizes = {
        Dim.B: config.b, Dim.S: config.s // config.cp, Dim.H: config.h, Dim.A: config.a,
        Dim.G: config.groups, Dim.D: config.head_dim, Dim.F: config.ffn, Dim.V: config.vocab_size,
        Dim.QKV: config.a + 2 * config.groups, Dim.S1: config.s // config.cp + 1, Dim.HALF_D: config.head_dim // 2,
    } | mla_sizes(config) | rotary_sizes(config)
    if config.num_experts is None:
        return sizes
    return sizes | {
        Dim.E: config.num_experts, Dim.EL: config.num_experts // config.ep, Dim.K: config.moe_router_topk,
        Dim.FE: config.expert_ffn,
        Dim.U: config.moe_shared_expert_intermediate_size or 0,
        Dim.R: routed_slots(config, config.moe_tokens, routers),
        Dim.RS: routed_slots(config, "own", routers),  # r_s: the slots its own tokens keep, whatever the route
    }


def routers(config: ModelConfig, strategy: Strategy) -> int:
    """The ranks that split a tensor-parallel group's tokens before a MoE router (`dim_sizes`): t under SP, and
    under TP where the library's plan splits the MoE's tokens over the TP ranks (torchtitan at ep = t: its `splits`)."""
    split = strategy.sequence_parallel or strategy.tensor_parallel and bool(implementation(config).splits(config))
    return config.t if split else 1


def rotary_sizes(config: Any) -> dict[Dim, Any]:
    """Partial RoPE: d_r = int(d * rotary_percent) channels of each head (transformers' rotary_ndims), rounded up to
    even: the rotary embedding's tables are cat(freqs, freqs), one frequency per pair (GLM rotates as many channels
    as they are wide; GPT-NeoX fails on an odd share)."""
    if config.rotary_percent is None or config.kv_lora_rank is not None:
        return {}
    d_r = _whole(config.head_dim * config.rotary_percent)
    return {Dim.DR: d_r + d_r % 2}


def mla_sizes(config: Any) -> dict[Dim, Any]:
    """Latent attention's widths (none without kv_lora_rank); an unset query latent is width 0, never used."""
    if config.kv_lora_rank is None:
        return {}
    return {
        Dim.QR: config.q_lora_rank or 0, Dim.KVR: config.kv_lora_rank, Dim.DR: config.qk_rope_head_dim,
        Dim.KVD: config.kv_lora_rank + config.qk_rope_head_dim,
        Dim.QK: config.qk_nope_head_dim + config.qk_rope_head_dim, Dim.DV: config.v_head_dim,
        Dim.NV: config.qk_nope_head_dim + config.v_head_dim,
    }


def routed_slots(config: ModelConfig, bound: str, routers: Any = 1) -> Any:
    """r: the token-expert slots one rank's experts receive in one MoE layer, under `bound` (numbers or arrays).

    With etp = t the slots of the t ranks sharing experts arrive on each, so r does not depend on t. balanced: each of
    the `routers` of each ep rank deals its k*b*s/routers slots round the ep ranks (the forced balanced route: slot m
    to rank m mod ep), so a rank receives ep*routers*ceil(k*b*s/(routers*ep)): k*b*s where ep divides a router's
    slots, more where not (the first ranks get one more from each); own: k*b*s, the slots this rank's own tokens
    keep, whatever the route; worst: every token of the ep ranks sends all k slots here, ep*b*s*min(k, E/ep). A
    capacity factor caps each bound at every expert full (`capacity_slots`), which is r itself when padded to capacity
    (capacity: the worst, so capped).
    """
    c, tokens = config, config.b * (config.s // config.cp)
    k = c.moe_router_topk
    worst = c.ep * tokens * minimum(k, c.num_experts // c.ep)
    bounds = {"own": k * tokens, "balanced": -(-(k * (tokens // routers)) // c.ep) * c.ep * routers, "worst": worst,
              "capacity": worst}  # capacity: capped below
    if c.moe_expert_capacity_factor is None:
        return bounds[bound]
    full = capacity_slots(config, routers)
    if c.moe_pad_expert_input_to_capacity:
        return full
    return minimum(full, bounds[bound])


def capacity_slots(config: ModelConfig, routers: Any = 1) -> Any:
    """The slots one rank's experts receive when every expert is full: each of the `routers` ranks that split a
    tensor-parallel group's b*s/cp tokens keeps ceil(k*(b*s/cp/routers)/E * c) slots an expert (Megatron's
    get_capacity on the tokens one router sees), at most one a token (topk_routing_with_capacity masks no token
    where the capacity exceeds them), and this rank's E/ep experts take them from the ep groups."""
    c, local = config, config.b * (config.s // config.cp) // routers
    per_expert = -(-((c.moe_router_topk * local / c.num_experts) * c.moe_expert_capacity_factor) // 1)
    return minimum(_whole(per_expert), local) * c.num_experts * routers


def _whole(x: Any) -> Any:
    """A float, or an array of them, as int (truncated toward zero)."""
    return x.astype("int64") if hasattr(x, "astype") else int(x)


def rank_shape(tensor: SavedTensor, strategy: Strategy, sizes: dict[Dim, Any], t: Any) -> tuple[Any, ...]:
    """The tensor's shape on one rank: its split dimension divided by t, rounded up (the vocabulary is padded
    to a multiple of t; every other split dimension is one by the config's rules)."""
    split = strategy.split_dim(tensor)
    return tuple(-(-sizes[d] // t) if d is split else sizes[d] for d in tensor.shape)


@record
class TensorBytes:
    """One saved tensor as one rank holds it."""

    tensor: SavedTensor
    shape: tuple[int, ...]
    element_bytes: int

    @property
    def bytes(self) -> int:
        return self.element_bytes * prod(self.shape)


@record
class LayerEstimate:
    """What one rank keeps for one layer under one strategy, and for all L layers."""

    strategy: Strategy
    layers: int
    tensors: tuple[TensorBytes, ...]  # a MoE layer's when the model has experts
    dense: tuple[TensorBytes, ...] = ()  # a dense layer's, when MoE layers alternate with dense ones
    dense_layers: int = 0  # how many of the L layers are dense (moe_layer_freq > 1)
    model_wide_copies: int = 1  # how many copies of the model-wide tensors the L layers keep (Gemma 3's RoPE: 2)

    @property
    def per_layer_bytes(self) -> int:
        """One layer's bytes: the MoE layer's when the model has experts (the larger of the two)."""
        return sum(t.bytes for t in self.tensors)

    @property
    def dense_layer_bytes(self) -> int:
        return sum(t.bytes for t in self.dense)

    @property
    def model_wide_bytes(self) -> int:
        """What every layer keeps of the model's one copy (RoPE's tables): in each layer's bytes, once in a model's."""
        return sum(t.bytes for t in self.tensors if t.tensor.model_wide)

    @property
    def total_bytes(self) -> int:
        """All L layers: MoE layers and dense layers each at their own bytes, the model-wide tensors once (a copy
        for each kind of layer that reads its own)."""
        return self.layers_bytes(self.layers - self.dense_layers, self.dense_layers, self.model_wide_copies)

    def layers_bytes(self, layers: int, dense: int, copies: int) -> int:
        """`layers` layers' bytes (MoE ones where the model mixes them) and `dense` dense layers', with `copies` of
        the model-wide tensors: one for each model chunk's forward kept (a pipeline stage's chunk-micro-batches)."""
        shared = self.model_wide_bytes
        return (self.per_layer_bytes - shared) * layers + (self.dense_layer_bytes - shared) * dense + shared * copies

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
    given, strategy = strategy, check_strategy(config, strategy)
    knobs = Knobs.of(config)
    accounting = replace(accounting, layer_inputs_cast=config.layer_inputs_cast)
    sizes = dim_sizes(config, routers(config, strategy))

    def kept_bytes(layer_knobs: Knobs) -> tuple[TensorBytes, ...]:
        # a dense layer among MoE ones under its own MLP's TP plan too (torchtitan keeps w1's input gathered under SP)
        laid = strategy if layer_knobs is knobs else plan(layer_knobs, given)
        kept = laid.kept(tensors_at(layer_knobs, accounting, sizes, laid.weight_shards(config.t)))
        return tuple(
            TensorBytes(x, rank_shape(x, laid, sizes, config.t), element_bytes(x.kind, knobs, accounting))
            for x in kept
        )

    dense_layers = config.L - config.moe_layers if knobs.moe else 0
    dense = kept_bytes(knobs.dense) if dense_layers else ()
    copies = implementation(knobs).model_wide_copies(knobs, config.L)
    return LayerEstimate(strategy, config.L, kept_bytes(knobs), dense, dense_layers, copies)
