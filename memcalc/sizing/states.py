"""Model states: the parameters one GPU holds, and the bytes its weights, gradients and Adam keep.

Parameters are counted group by group (`PARAM_GROUPS`), each with why tensor parallelism does or does not split
it; the vocabulary is padded as Megatron-LM pads it. Bytes per parameter follow each stack's layout
(`STATE_LAYOUTS`, rendered in docs/sharding.md). Expert parameters are replicated only over the expert
data-parallel group, t*cp*dp/(ep*etp) ranks, which is what the distributed optimizer shards their states over.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, replace
from math import lcm, prod
from typing import Callable, Iterable

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model.families import layer_family
from memcalc.model.knobs import DTYPE_BYTES, GATED
from memcalc.sizing.pipeline import Stage, stage_rank


def padded_vocab(config: ModelConfig, t: int) -> int:
    """v as Megatron-LM pads it (`_vocab_size_with_padding`): up to a multiple of make_vocab_size_divisible_by
    * t (GEMM tiles); the padded rows are real weights, gradients and logits. Other libraries train v as it is."""
    if config.impl != "megatron":
        return config.vocab_size
    step = config.make_vocab_size_divisible_by * t
    return -(-config.vocab_size // step) * step


def vocab_shard(config: ModelConfig, t: int) -> int:
    """Rows of the padded vocabulary one of t ranks holds: the most any holds (torchtitan's DTensor: uneven)."""
    return -(-padded_vocab(config, t) // t)


def norm_shapes(config: ModelConfig, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """One norm's parameters over `shape`: LayerNorm's weight and bias, OLMo's LayerNorm (layernorm_np) none,
    RMSNorm and Cohere's LayerNorm (layernorm_nb) a weight."""
    return () if config.norm == "layernorm_np" else (shape, shape) if config.norm == "layernorm" else (shape,)


def _norm(config: ModelConfig, width: int | None = None) -> tuple[int, ...]:
    """One norm's parameters over `width` channels (the hidden size unless given), each one's elements."""
    return tuple(map(prod, norm_shapes(config, (config.h if width is None else width,))))


def _column(fan_in: int, width: int, t: int, bias: bool) -> tuple[int, ...]:
    """A column-parallel linear's weight and bias on one rank of t: both split by t."""
    return (fan_in * width // t, *((width // t,) if bias else ()))


def _row(fan_in: int, width: int, t: int, bias: bool) -> tuple[int, ...]:
    """A row-parallel linear's weight, split by t, and its bias, whole."""
    return (fan_in * width // t, *((width,) if bias else ()))


def _layer_norm_params(c: ModelConfig) -> int:
    """A layer's norms: before the attention and the MLP (one read by both with single_norm: GPT-J's, Cohere's,
    Falcon-7B's), and the QK norms, one head's d channels shared by every head, or Cohere's (heads, d) weights, one
    row a head, or OLMo 2's over q_proj's and k_proj's whole outputs (post_norm)."""
    norms = (1 if c.single_norm else 4 if c.sandwich_norm else 2) * sum(_norm(c))  # sandwich: on both outputs too
    if not c.qk_layernorm:
        return norms
    heads = c.a + c.groups if c.norm == "layernorm_nb" or c.post_norm else 2
    return norms + heads * sum(_norm(c, c.head_dim))


def _qkv(c: ModelConfig, t: int) -> int:
    return sum(_latent(c, t)) if c.mla else sum(_linear_qkv(c, t))


def _linear_qkv(c: ModelConfig, t: int) -> tuple[int, ...]:
    width = (c.a + 2 * c.groups) * c.head_dim  # Q heads plus K and V groups, d (h/a unless set) channels each
    return _column(c.h, width, t, c.add_bias_linear or c.add_qkv_bias)


def _latent(c: ModelConfig, t: int) -> tuple[int, ...]:
    """Latent attention as megatron-core's local spec builds it (MLASelfAttention, all without biases), its parameters
    in registration order: q_down (h -> r_q) then q_up (r_q -> a(d_n + d_r)), or q_proj (h -> a(d_n + d_r)) without
    a query latent; kv_down (h -> r_kv + d_r) and kv_up (r_kv -> a(d_n + d_v)), all column-parallel (the down
    projections' outputs gathered); the latent norms whole. (Transformer Engine's spec duplicates the down
    projections instead.)"""
    r_q, r_kv, query_heads = c.q_lora_rank, c.kv_lora_rank, c.a * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    query = _column(c.h, query_heads, t, False) if r_q is None else (
        *_column(c.h, r_q, t, False), *_column(r_q, query_heads, t, False))
    kv = (*_column(c.h, r_kv + c.qk_rope_head_dim, t, False),
          *_column(r_kv, c.a * (c.qk_nope_head_dim + c.v_head_dim), t, False))
    return (*query, *kv, *(_norm(c, r_q) if r_q is not None else ()), *_norm(c, r_kv))


def _linear_proj(c: ModelConfig, t: int) -> tuple[int, ...]:
    width = c.a * (c.v_head_dim if c.mla else c.head_dim)  # a heads of d (latent attention: of d_v)
    return _row(width, c.h, t, c.add_bias_linear)


def mlp_bias(c: ModelConfig) -> bool:
    """Whether the MLP's linears carry biases: add_bias_linear's, or transformers' family's whatever it says
    (Family.mlp_bias: GPT-NeoX's, GPT-J's)."""
    return c.add_bias_linear or c.impl == "hf" and layer_family(c).mlp_bias


def head_bias(c: ModelConfig) -> bool:
    """Whether the output layer carries a bias, v rows (Family.head_bias: GPT-J's lm_head, tied embeddings or not)."""
    return c.impl == "hf" and layer_family(c).head_bias


def _linear_fc1(c: ModelConfig, t: int) -> tuple[int, ...]:
    width = c.ffn * (2 if c.mlp in GATED else 1)  # a gated MLP's fc1 makes both gate and up
    return _column(c.h, width, t, mlp_bias(c))


def _linear_fc2(c: ModelConfig, t: int) -> tuple[int, ...]:
    return _row(c.ffn, c.h, t, mlp_bias(c))


def _expert(c: ModelConfig, t: int) -> tuple[int, ...]:
    """One of the E/ep experts a rank holds: an MLP of width e whose fc1 and fc2 are split by etp (`expert_tp`: t
    where split at all; gpt-oss's carry biases whatever attention_bias says: GptOssExperts always has them)."""
    expert = replace(c, ffn_hidden_size=c.expert_ffn, add_bias_linear=c.add_bias_linear or c.attention_sinks)
    return (*_linear_fc1(expert, _etp(c, t)), *_linear_fc2(expert, _etp(c, t)))


def _etp(c: ModelConfig, t: int) -> int:
    return t if expert_tp(c) > 1 else 1


def _router(c: ModelConfig) -> tuple[int, ...]:
    """The router's (E, h) weight, whole on every rank, and its bias: gpt-oss's (GptOssTopKRouter always has one),
    megatron-core's with add_bias_linear (TopKRouter's)."""
    return (c.num_experts * c.h, *((c.num_experts,) if c.attention_sinks or c.impl == "megatron" and c.add_bias_linear
                                   else ()))


def _shared(c: ModelConfig, t: int) -> tuple[int, ...]:
    """Shared experts: one MLP of width u, split by t as the dense MLP; transformers' Qwen2-MoE gates it with a
    linear h -> 1 (whole; DeepSeek-V3's DeepseekV3MLP has no gate), and its tp plan names neither: whole on every
    rank."""
    if not c.moe_shared_expert_intermediate_size:
        return ()
    shared, hf = replace(c, ffn_hidden_size=c.moe_shared_expert_intermediate_size), c.impl == "hf"
    split = 1 if hf else t
    return (*_linear_fc1(shared, split), *_linear_fc2(shared, split), *((c.h,) if hf and not c.mla else ()))


def _output(c: ModelConfig, t: int) -> int:
    """Untied: its own weight. Tied: none with one stage; a copy on the last stage with several. GPT-J's bias, its
    own either way, split as the weight's rows."""
    weight = vocab_shard(c, t) * c.h if not c.tie_embeddings or c.pp > 1 else 0
    return weight + (vocab_shard(c, t) if head_bias(c) else 0)


@dataclass(frozen=True)
class ParamGroup:
    """Weights that sit together, where they live, and how one rank's share is counted."""

    name: str
    # "layer" (every layer), "dense" (every layer with a dense MLP), "moe" (every MoE layer),
    # "first" (with the embedding) or "last" (with the output layer)
    where: str
    count: Callable[[ModelConfig, int], int]  # parameters one rank holds, given its tensor-parallel size
    why: str
    expert: bool = False  # replicated over the expert data-parallel group only (the distributed optimizer's shards)


PARAM_GROUPS: tuple[ParamGroup, ...] = (
    ParamGroup("attention/qkv", "layer", _qkv, "column-parallel: each rank holds its heads' Q and its groups' K, V"
               " (latent attention: the down and up projections split by t, the latent norms whole)"),
    ParamGroup("attention/proj", "layer", lambda c, t: sum(_linear_proj(c, t)),
               "row-parallel: the weight is split by t, its bias is whole"),
    ParamGroup("attention/sinks", "layer", lambda c, t: c.a // t if c.attention_sinks else 0,
               "gpt-oss's learned sink logit, one a head: each rank its heads'"),
    ParamGroup("mlp/fc1", "dense", lambda c, t: sum(_linear_fc1(c, t)),
               "column-parallel: each rank holds f/t columns (2f/t: SwiGLU's gate and up)"),
    ParamGroup("mlp/fc2", "dense", lambda c, t: sum(_linear_fc2(c, t)),
               "row-parallel: the weight is split by t, its bias is whole"),
    ParamGroup("moe/router", "moe", lambda c, t: sum(_router(c)),
               "whole on every rank: each rank scores its own tokens against all E experts (gpt-oss's router, and"
               " megatron-core's with add_bias_linear, add a bias an expert)"),
    ParamGroup("moe/experts", "moe", lambda c, t: c.num_experts // c.ep * sum(_expert(c, t)),
               "E/ep experts a rank, each fc1 and fc2 split by etp = t (torchtitan at ep > 1: whole)", expert=True),
    ParamGroup("moe/shared_experts", "moe", lambda c, t: sum(_shared(c, t)), "one MLP of width u on every token,"
               " split by t as the dense MLP (transformers' Qwen2-MoE: whole on every rank, as its tp plan names it"
               " not, with an h -> 1 gate)"),
    ParamGroup(
        "layer/norms", "layer", lambda c, t: _layer_norm_params(c),
        "two norms per layer (one with single_norm, four with sandwich_norm), and with qk_layernorm the query's and the"
        " key's over one head's d"
        " channels (shared by every head; Cohere's use_qk_norm weighs each head apart, OLMo 2's norms the whole"
        " projection), whole on every rank"
        " (LayerNorm: weight and bias; RMSNorm: weight)",
    ),
    ParamGroup(
        "embedding/word", "first", lambda c, t: vocab_shard(c, t) * c.h,
        "vocabulary-parallel: each rank holds v/t rows",
    ),
    ParamGroup("embedding/norm", "first", lambda c, t: sum(_norm(c)) if c.alibi else 0,
               "BLOOM's word_embeddings_layernorm on the embedding's output, whole"),
    ParamGroup(
        "embedding/position", "first",
        lambda c, t: c.positions * c.h if c.position_embedding_type == "learned_absolute" else 0,
        "a learned table (one row per position) is whole on every rank; RoPE has no weights",
    ),
    ParamGroup("final_norm", "last", lambda c, t: sum(_norm(c)), "the norm before the output layer, whole"),
    ParamGroup(
        "output/weight", "last", _output,
        "vocabulary-parallel; tied to the embedding it costs nothing with one stage, but pipelining keeps a copy"
        " on the last stage (its gradient is all-reduced with the first stage's)",
    ),
)


def check_expert_states(config: ModelConfig) -> None:
    """ConfigError when experts cannot be laid out: ep*etp must divide t*cp*dp (the expert data-parallel group),
    and with pipelining every chunk of Megatron's layers must hold the same share of MoE layers (freq divides it;
    torchtitan's ranks are counted on their own split)."""
    c = config
    if not c.moe:
        return
    etp = expert_tp(c)
    if (c.t * c.cp * c.dp) % (c.ep * etp):
        raise ConfigError(f"ep*etp={c.ep * etp} does not divide t*cp*dp={c.t * c.cp * c.dp}: the expert data-parallel"
                          " group has t*cp*dp/(ep*etp) ranks")
    chunk = c.L // (c.pp * (c.vpp or 1))
    if c.pp > 1 and c.moe_first_dense_layers:
        raise ConfigError(f"moe_first_dense_layers={c.moe_first_dense_layers} with pp={c.pp}: memcalc counts every"
                          " pipeline chunk as holding the same kinds of layers, which the first stage's dense layers"
                          " break; use pp 1")
    if c.pp > 1 and chunk % c.moe_layer_freq and c.impl != "torchtitan":  # its one chunk a rank: its own share
        raise ConfigError(f"moe_layer_freq={c.moe_layer_freq} does not divide the {chunk} layers of a pipeline chunk"
                          " (L/(pp*vpp)): memcalc counts each chunk a stage keeps as holding layers/freq MoE layers")


def expert_tp(config: ModelConfig) -> int:
    """Expert tensor parallelism: etp = t, but torchtitan's experts at ep > 1, whole on each of its expert-parallel
    ranks (which are its TP ranks: memcalc.model.impls.torchtitan.splits)."""
    return 1 if config.impl == "torchtitan" and config.ep > 1 else config.etp or config.t


def moe_layers_held(config: ModelConfig, stage: Stage) -> int:
    """The MoE layers among the stage's, as its rank holds them (`ModelConfig.rank_chunks`): torchtitan's split need
    not give each stage layers/freq of them."""
    if not config.moe:
        return 0
    return sum(sum(map(config.is_moe_layer, x)) for x in config.rank_chunks(stage_rank(stage.name, config.pp)))


ROUTER_BUFFERS_WHY = ("each MoE layer's TopKRouter keeps expert_bias and local_tokens_per_expert, fp32 (E,) buffers;"
                      " transformers' DeepseekV3TopkRouter keeps e_score_correction_bias, an fp32 (E,) buffer, and its"
                      " (E, h) weight in fp32 whatever the dtype (_keep_in_fp32_modules_strict)")


def router_buffer_bytes(config: ModelConfig, stage: Stage) -> int:
    """What each MoE layer's router holds beside the parameters the weights count, on every rank of the stage's MoE
    layers (not sharded, no gradient, no optimizer state): megatron-core's two fp32 (E,) buffers under
    moe_router_enable_expert_bias; transformers' DeepseekV3TopkRouter's fp32 (E,) correction bias, and its weight's
    2 bytes a value more than a 16-bit model's weights count (its fp32 gradient is the fp32 buffer's already)."""
    e, c = config.num_experts, config
    if c.moe_router_enable_expert_bias:
        per_layer = 2 * 4 * e
    elif c.impl == "hf" and c.mla and c.moe:
        per_layer = 4 * e + (4 - DTYPE_BYTES[c.dtype]) * e * c.h
    else:
        return 0
    return per_layer * moe_layers_held(config, stage)


def group_params(config: ModelConfig, stage: Stage, t: int) -> dict[str, int]:
    """Parameters one rank of `stage` holds, per group (layer groups times the stage's layers of their kind)."""
    check_expert_states(config)
    moe = moe_layers_held(config, stage)
    held = {"layer": stage.layers, "dense": stage.layers - moe, "moe": moe, "first": int(stage.has_embedding),
            "last": int(stage.has_output)}
    return {g.name: held[g.where] * g.count(config, t) if held[g.where] else 0 for g in PARAM_GROUPS
            if g.where != "moe" or config.moe}


Chunk = tuple[list[int], int | None]  # a model chunk's parameters' elements in registration order; the shared one


def megatron_chunks(config: ModelConfig, stage: Stage, t: int) -> tuple[list[Chunk], list[Chunk]]:
    """Each model chunk of a stage (vpp of them, else one) as megatron-core's GPTModel on the local spec registers its
    parameters on one rank of t, its dense buffer's and its experts' (`allreduce` False: a buffer of their own): the
    embedding's word and position tables, each TransformerLayer's input_layernorm, linear_proj, linear_qkv, q and k
    layernorms (latent attention: `_latent`'s), pre_mlp_layernorm, linear_fc1 and linear_fc2 (weight, then bias) or
    a MoELayer's router, shared experts and (the other buffer) SequentialMLP's experts, the final layernorm and the
    output layer; each parameter's elements, and which one is a tied embedding that pipelining gives its own bucket
    (`shared_embedding`: on the first stage's first chunk and the last stage's last). A chunk's layer i is a MoE one
    as the model's layer i is (check_expert_states: every chunk holds the same pattern)."""
    c, chunks, layers = config, config.vpp or 1, range(stage.layers // (config.vpp or 1))
    attention = _latent(c, t) if c.mla else (*_linear_qkv(c, t), *(_norm(c, c.head_dim) * 2 if c.qk_layernorm else ()))
    experts = _expert(c, t) * (c.num_experts // c.ep) if c.moe else ()
    apart = c.ep > 1  # megatron's linears mark expert weights `allreduce` False only under expert parallelism
    mlp = {False: (*_linear_fc1(c, t), *_linear_fc2(c, t)),
           True: (*_router(c), *(() if apart else experts), *_shared(c, t)) if c.moe else ()}
    kinds = {moe: _merged((*_norm(c), *_linear_proj(c, t), *attention, *_norm(c), *mlp[moe])) for moe in mlp}
    layer = [x for i in layers for x in kinds[c.is_moe_layer(i)]]
    first = [vocab_shard(c, t) * c.h, *([c.positions * c.h] if c.position_embedding_type == "learned_absolute" else [])]
    last = [*_norm(c), *([_output(c, t)] if _output(c, t) else [])]
    tied = c.tie_embeddings and c.pp > 1
    dense: list[Chunk] = [(layer, None) for _ in range(chunks)]
    if stage.has_embedding:
        dense[0] = (first + dense[0][0], 0 if tied else None)
    if stage.has_output:
        dense[-1] = (dense[-1][0] + last, len(dense[-1][0]) + len(last) - 1 if tied else None)
    own = _merged(experts) if apart else []
    expert = [x for i in layers if c.is_moe_layer(i) for x in own]
    return dense, [(expert, None) for _ in range(chunks)] if expert else []


def _merged(sizes: Iterable[int]) -> list[int]:
    """`sizes` (in registration order) with each of a multiple of 64 elements folded into the one before it: laid out
    just before it, it leaves no padding, so the buckets and the padding come out the same, in fewer steps (a MoE
    layer's hundreds of experts)."""
    out: list[int] = []
    for n in sizes:
        if out and n % 64 == 0:
            out[-1] += n
        else:
            out.append(n)
    return out


def megatron_buffers(config: ModelConfig, t: int, dense: list[Chunk], experts: list[Chunk]) -> tuple[int, int]:
    """Elements of the chunks' _ParamAndGradBuffers under the distributed optimizer (param_and_grad_buffer.py), and
    the most parameter elements one rank's shards of them hold (its fp32 main parameters and Adam moments): each
    bucket is cut into equal shards (distrib_optimizer.py), the dense ones over dp*cp ranks, the experts' over the
    expert data-parallel group's, and a shard holds its share less the padding in it. A rank of the stage's t*cp*dp
    (parallel_state's order tp-cp-ep-dp-pp) holds dense shard r // t and expert shard r // (etp*ep)."""
    c, etp_ep = config, _etp(config, t) * config.ep
    numel, fill = _filled(dense, c.dp * c.cp)
    if not experts:
        return numel, max(fill)
    expert_numel, expert_fill = _filled(experts, t * c.cp * c.dp // etp_ep)
    return numel + expert_numel, max(fill[r // t] + expert_fill[r // etp_ep] for r in range(t * c.cp * c.dp))


def _filled(chunks: list[Chunk], ranks: int) -> tuple[int, list[int]]:
    """The chunks' buffers' elements, and the parameter elements each of their `ranks` shards holds."""
    numel, holds, padding = 0, 0, [0] * ranks
    for sizes, shared in chunks:
        buckets, gaps = _layout(sizes, shared, lcm(ranks, 128))
        numel += buckets[-1][1]
        holds += sum(last - first for first, last in buckets) // ranks
        starts = [first for first, _ in buckets]
        for a, b in gaps:
            first, last = buckets[bisect_right(starts, a) - 1]
            share = (last - first) // ranks
            for r in range((a - first) // share, (b - 1 - first) // share + 1):
                padding[r] += min(b, first + (r + 1) * share) - max(a, first + r * share)
    return numel, [holds - x for x in padding]


def _layout(sizes: list[int], shared: int | None, divisor: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """One chunk's buckets (start, end) and the padding between its parameters (start, end), as _ParamAndGradBuffer
    lays them out: in reverse, each parameter starting at a multiple of 64 elements, one bucket (bucket_size is None
    without overlap_grad_reduce) but the shared embedding's own, each padded to a multiple of `divisor`."""
    buckets: list[tuple[int, int]] = []
    gaps, start, end = [], 0, 0

    def close(at: int) -> int:
        buckets.append((start, -(-at // divisor) * divisor))
        return buckets[-1][1]

    for i in reversed(range(len(sizes))):
        begin = -(-end // 64) * 64
        if i == shared and end > start:
            begin = start = close(begin)
        gaps.append((end, begin))
        end = begin + sizes[i]
        if i == shared:
            gaps.append((end, close(end)))
            end = start = buckets[-1][1]
    if end > start:
        gaps.append((end, close(end)))
    return buckets, [(a, b) for a, b in gaps if a < b]


def expert_params(params: dict[str, int]) -> int:
    """Of `group_params`' counts, the expert parameters (sharded over the expert data-parallel group)."""
    return sum(params.get(g.name, 0) for g in PARAM_GROUPS if g.expert)


def total_params(config: ModelConfig) -> int:
    """Distinct parameters in the whole model, as published: as one stage, where a tied output layer is
    the embedding, and without the vocabulary's padding (rows that cost memory but are never a token)."""
    whole = {"layer": config.L, "dense": config.L - config.moe_layers, "moe": config.moe_layers, "first": 1,
             "last": 1}
    one_stage = replace(config, pp=1, vpp=None, make_vocab_size_divisible_by=1, ep=1)
    return sum(whole[g.where] * g.count(one_stage, 1) if whole[g.where] else 0 for g in PARAM_GROUPS)


@dataclass(frozen=True)
class Split:
    """Over how many ranks a state is split, and that in words (docs/sharding.md)."""

    over: str
    ranks: Callable[[ModelConfig], int]


@dataclass(frozen=True)
class StateTerm:
    """One kind of per-parameter state, its width, and how its stack's sharding splits it."""

    name: str
    width: Callable[[ModelConfig], int]  # bytes per parameter
    split: Split
    why: str


WHOLE = Split("none: every rank holds it whole", lambda c: 1)
# Megatron-LM's distributed optimizer shards over dp*cp (its optimizer group includes the context ranks).
DISTRIBUTED_OPTIMIZER = Split("dp*cp with distributed_optimizer",
                              lambda c: c.dp * c.cp if c.distributed_optimizer else 1)
# FSDP2's shard group: dp_shard ranks, times cp (torchtitan shards over its dp_shard_cp mesh).
FSDP_SHARDS = Split("dp_shard*cp", lambda c: (c.dp_shard or 1) * c.cp)


def _zero(stage: int) -> Split:
    """ZeRO splits a state over the dp ranks from `stage` on."""
    return Split(f"dp from zero_stage {stage}", lambda c: c.dp if (c.zero_stage or 0) >= stage else 1)


def _width(c: ModelConfig) -> int:
    return DTYPE_BYTES[c.dtype]


_MASTER = "the optimizer updates an fp32 copy: bf16/fp16 weights would round small updates away"
_ADAM_M, _ADAM_V = ("Adam's first moment (running mean of gradients), fp32",
                    "Adam's second moment (running mean of squared gradients), fp32")

# Each stack's per-parameter states (`sharding` picks one): bytes per parameter and what shards them.
STATE_LAYOUTS: dict[str, tuple[StateTerm, ...]] = {"megatron": (
    StateTerm("states/weights", _width, WHOLE, "forward and backward compute with them"),
    StateTerm("states/grads", lambda c: 4, WHOLE,
              "gradients accumulate in fp32 over the micro-batches of a step (Megatron-LM's main_grad buffer)"),
    StateTerm("states/master_weights", lambda c: 0 if c.dtype == "fp32" else 4, DISTRIBUTED_OPTIMIZER, _MASTER),
    StateTerm("states/adam_m", lambda c: 4, DISTRIBUTED_OPTIMIZER, _ADAM_M),
    StateTerm("states/adam_v", lambda c: 4, DISTRIBUTED_OPTIMIZER, _ADAM_V),
), "fsdp2": (
    StateTerm("states/weights", lambda c: 4, FSDP_SHARDS,
              "fully_shard keeps each parameter as an fp32 DTensor sharded on dim 0 (padded to a multiple of the"
              " shards): the optimizer's copy itself;"
              " forward and backward compute with param_dtype copies all-gathered block by block (transients)"),
    StateTerm("states/grads", lambda c: 4, FSDP_SHARDS,
              "each block's reduce-scatter leaves this rank its shard of the gradient, cast to the parameter's"
              " fp32"),
    StateTerm("states/adam_m", lambda c: 4, FSDP_SHARDS, _ADAM_M),
    StateTerm("states/adam_v", lambda c: 4, FSDP_SHARDS, _ADAM_V),
), "zero": (
    # DeepSpeed's layout with bf16, as its estimators (estimate_zero2/3_model_states_mem_needs) count it: bf16 weights
    # and gradients, and per parameter 16 bytes of fp32 state (a gradient partition, master weights, m and v). Stage 1
    # partitions those 16 over dp, stage 2 the bf16 gradients too (2 + 18/dp), stage 3 the weights as well (18/dp,
    # beside the largest module's weights gathered and their gradients, `zero3_largest_layer`, and the persistent
    # parameters' weights whole, which the estimator leaves out).
    StateTerm("states/weights", _width, _zero(3), "bf16 weights, partitioned over dp at stage 3 (each parameter"
              " padded to a multiple of dp; those of stage3_param_persistence_threshold elements or fewer whole"
              " too)"),
    StateTerm("states/grads", lambda c: 0 if (c.zero_stage or 0) >= 3 else _width(c), _zero(2),
              "bf16 gradients, partitioned over dp at stage 2 (at stage 3 only the gathered module's, in"
              " zero3/largest_layer)"),
    StateTerm("states/fp32_grads", lambda c: 4, _zero(1), "the fp32 gradient partition the optimizer reads"),
    StateTerm("states/master_weights", lambda c: 4, _zero(1), _MASTER),
    StateTerm("states/adam_m", lambda c: 4, _zero(1), _ADAM_M),
    StateTerm("states/adam_v", lambda c: 4, _zero(1), _ADAM_V),
)}


def sharding(config: ModelConfig) -> str:
    """How the stack keeps its data-parallel states: "fsdp2" (dp_shard), "zero" (zero_stage), else
    "megatron" (its layout, with or without the distributed optimizer)."""
    if config.dp_shard is not None:
        return "fsdp2"
    return "zero" if config.zero_stage is not None else "megatron"


def describe_sharding(config: ModelConfig) -> str:
    """How the data-parallel states are sharded, in words: "FSDP2 over dp_shard=8 (HSDP, 2 replicas)"."""
    c = config
    if c.dp_shard is not None:
        replicas = f", HSDP over {c.dp_replicate} replicas" if (c.dp_replicate or 1) > 1 else ""
        reshard = "" if c.reshard_after_forward else ", no reshard after forward"
        return f"FSDP2 over dp_shard*cp={c.dp_shard * c.cp}{replicas}{reshard}"
    if c.zero_stage is not None:
        return f"DeepSpeed ZeRO-{c.zero_stage} over dp={c.dp}"
    return f"distributed optimizer over dp*cp={c.dp * c.cp}" if c.distributed_optimizer else "optimizer unsharded"


def state_bytes(config: ModelConfig, params: int, experts: int = 0, no_decay: int = 0,
                per_parameter: tuple[int, int] | None = None) -> dict[str, int]:
    """Bytes of each model state (widths of 0 left out) for `params` parameters, `experts` of them expert
    ones, each split as its stack splits it; Megatron's distributed optimizer shards the experts' over expert_dp.
    ZeRO-1/2 pads each of the Trainer's two groups (`no_decay` parameters in the one without weight decay) as
    `zero_partition` does: the bf16 flat buffers whole, the partitions dp of them. FSDP2, ZeRO-3 and Megatron's
    distributed optimizer pad each parameter: `per_parameter` (memcalc.sizing.totals.per_parameter_shards) gives the
    elements of this rank's padded shards, and of what every rank holds whole: the weights ZeRO-3 keeps beside them,
    Megatron's padded buffers (its weights and gradients, the states no sharding splits)."""
    c = config
    expert_dp = c.t * c.cp * c.dp // (c.ep * (c.etp or c.t))  # whole by check_expert_states
    padded = c.zero_stage in (1, 2)
    part = sum(zero_partition(c.zero_stage, c.dp, [n]) for n in (params - no_decay, no_decay)) if padded else 0
    out = {}
    for term in STATE_LAYOUTS[sharding(c)]:
        width, shards = term.width(c), term.split.ranks(c)
        if width and per_parameter:
            shard, whole = per_parameter
            kept = term.split is WHOLE or term.name == "states/weights"
            out[term.name] = width * ((0 if term.split is WHOLE else shard) + (whole if kept else 0))
        elif width and padded and (shards > 1 or term.name != "states/grads"):  # stage 1's .grad: each weight's own
            out[term.name] = width * part * (c.dp // shards)  # the flat buffers whole, or this rank's partitions
        elif width:
            expert_shards = expert_dp if shards > 1 and sharding(c) == "megatron" else shards
            out[term.name] = width * (-(-(params - experts) // shards) + -(-experts // expert_shards))
    return out


def zero_partition(stage: int, dp: int, group: Iterable[int]) -> int:
    """This rank's share of a parameter group (its parameters' elements) as DeepSpeed partitions it: at stages 1 and
    2 the group's flat buffer padded to a multiple of 2*dp elements (stage_1_and_2.py: nccl_start_alignment_factor 2
    elements, 4 bytes of bf16) and split in dp; at stage 3 each parameter apart, padded to a multiple of dp
    (partition_parameters.py: _padding_size)."""
    if stage == 3:
        return sum(-(-n // dp) for n in group)
    return -(-sum(group) // (2 * dp)) * 2


# transformers' Trainer (get_decay_parameter_names): no weight decay for a parameter whose name has one of these
# (forbidden_name_patterns), nor for an nn.LayerNorm's, which the step walk's inventory names as a norm
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def decays(name: str) -> bool:
    """Whether transformers' Trainer puts the parameter the step walk's inventory names so in its group with weight
    decay: not the norms nor the biases (gpt-oss's router's and experts' too), whatever their dimensions (gpt-oss's
    1-D sinks decay, Cohere's (heads, d) q_norm does not)."""
    return not _NO_DECAY.search(name)


def zero3_largest_layer(config: ModelConfig) -> int:
    """DeepSpeed's ZeRO-3 estimator's transient: the largest module's own weights gathered, with their gradients,
    4 bytes a parameter (bf16 each); the largest module of transformers' Llama is the embedding (or lm_head), an MLP
    projection, or q_proj."""
    c = config
    widest = max(c.vocab_size * c.h, c.ffn * c.h, c.a * c.head_dim * c.h)
    return 2 * DTYPE_BYTES[c.dtype] * widest
