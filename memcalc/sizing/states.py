"""Model states: the parameters one GPU holds, and the bytes its weights, gradients and Adam keep.

Parameters are counted from the config's sizes, group by group, each with the
reason it is (or is not) split by tensor parallelism: Megatron-LM's
column-parallel weights (QKV, fc1, the vocabulary-parallel embedding and
output layer) and row-parallel weights (projection, fc2) are split by t; norm
weights, row-parallel biases and a learned position table are whole on every
rank. The vocabulary is padded as Megatron-LM pads it (`padded_vocab`).

Bytes per parameter follow mixed-precision Adam as Megatron-LM lays it out
(its `theoretical_memory_usage.py`): bf16 weights (2), fp32 gradients (4), an
fp32 master copy (4) and two fp32 Adam moments (4 + 4), 18 bytes in all; the
distributed optimizer shards the last 12 over the data-parallel ranks, which in
Megatron-LM's optimizer group include the context-parallel ones: 6 + 12/(dp*cp).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.sizing.pipeline import Stage


def padded_vocab(config: ModelConfig, t: int) -> int:
    """v as Megatron-LM pads it (`_vocab_size_with_padding`): up to a multiple of
    make_vocab_size_divisible_by * t, so each of t shards is whole and a multiple of the divisor
    (128 by default, for GEMM tiles). The padded rows are real weights, gradients and logits."""
    step = config.make_vocab_size_divisible_by * t
    return -(-config.vocab_size // step) * step


def vocab_shard(config: ModelConfig, t: int) -> int:
    """Rows of the padded vocabulary one of t ranks holds."""
    return padded_vocab(config, t) // t


def _norm_params(config: ModelConfig) -> int:
    return 2 * config.h if config.norm == "layernorm" else config.h  # RMSNorm has no bias


def _qkv(c: ModelConfig, t: int) -> int:
    width = (c.a + 2 * c.groups) * (c.h // c.a)  # Q heads plus K and V groups, h/a channels each
    return (c.h * width + (width if c.add_bias_linear or c.add_qkv_bias else 0)) // t


def _proj(c: ModelConfig, t: int) -> int:
    return c.h * c.h // t + (c.h if c.add_bias_linear else 0)  # row-parallel: its bias is whole


def _fc1(c: ModelConfig, t: int) -> int:
    width = c.ffn * (2 if c.mlp == "swiglu" else 1)  # SwiGLU's fc1 makes both gate and up
    return (c.h * width + (width if c.add_bias_linear else 0)) // t


def _fc2(c: ModelConfig, t: int) -> int:
    return c.ffn * c.h // t + (c.h if c.add_bias_linear else 0)


def _output(c: ModelConfig, t: int) -> int:
    """Untied: its own weight. Tied: none with one stage; a copy on the last stage with several."""
    return vocab_shard(c, t) * c.h if not c.tie_embeddings or c.pp > 1 else 0


@dataclass(frozen=True)
class ParamGroup:
    """Weights that sit together, where they live, and how one rank's share is counted."""

    name: str
    where: str  # "layer" (every layer), "first" (with the embedding) or "last" (with the output layer)
    count: Callable[[ModelConfig, int], int]  # parameters one rank holds, given its tensor-parallel size
    why: str


PARAM_GROUPS: tuple[ParamGroup, ...] = (
    ParamGroup("attention/qkv", "layer", _qkv, "column-parallel: each rank holds its heads' Q and its groups' K, V"),
    ParamGroup("attention/proj", "layer", _proj, "row-parallel: the weight is split by t, its bias is whole"),
    ParamGroup("mlp/fc1", "layer", _fc1, "column-parallel: each rank holds f/t columns (2f/t: SwiGLU's gate and up)"),
    ParamGroup("mlp/fc2", "layer", _fc2, "row-parallel: the weight is split by t, its bias is whole"),
    ParamGroup(
        "layer/norms", "layer", lambda c, t: 2 * _norm_params(c),
        "two norms per layer, whole on every rank (LayerNorm: weight and bias; RMSNorm: weight)",
    ),
    ParamGroup(
        "embedding/word", "first", lambda c, t: vocab_shard(c, t) * c.h,
        "vocabulary-parallel: each rank holds v/t rows",
    ),
    ParamGroup(
        "embedding/position", "first",
        lambda c, t: c.positions * c.h if c.position_embedding_type == "learned_absolute" else 0,
        "a learned table (one row per position) is whole on every rank; RoPE has no weights",
    ),
    ParamGroup("final_norm", "last", lambda c, t: _norm_params(c), "the norm before the output layer, whole"),
    ParamGroup(
        "output/weight", "last", _output,
        "vocabulary-parallel; tied to the embedding it costs nothing with one stage, but pipelining keeps a copy"
        " on the last stage (its gradient is all-reduced with the first stage's)",
    ),
)


def group_params(config: ModelConfig, stage: Stage, t: int) -> dict[str, int]:
    """Parameters one rank of `stage` holds, per group (layer groups times the stage's layers)."""
    held = {"layer": stage.layers, "first": int(stage.has_embedding), "last": int(stage.has_output)}
    return {g.name: held[g.where] * g.count(config, t) for g in PARAM_GROUPS}


def total_params(config: ModelConfig) -> int:
    """Distinct parameters in the whole model, as published: as one stage, where a tied output layer is
    the embedding, and without the vocabulary's padding (rows that cost memory but are never a token)."""
    whole = {"layer": config.L, "first": 1, "last": 1}
    one_stage = replace(config, pp=1, vpp=None, make_vocab_size_divisible_by=1)
    return sum(whole[g.where] * g.count(one_stage, 1) for g in PARAM_GROUPS)


@dataclass(frozen=True)
class StateTerm:
    """One kind of per-parameter state, its width, and whether the distributed optimizer shards it."""

    name: str
    width: Callable[[str], int]  # bytes per parameter, given the training dtype
    sharded: bool
    why: str


STATE_TERMS: tuple[StateTerm, ...] = (
    StateTerm("states/weights", lambda dtype: DTYPE_BYTES[dtype], False, "forward and backward compute with them"),
    StateTerm(
        "states/grads", lambda dtype: 4, False,
        "gradients accumulate in fp32 over the micro-batches of a step (Megatron-LM's main_grad buffer)",
    ),
    StateTerm(
        "states/master_weights", lambda dtype: 0 if dtype == "fp32" else 4, True,
        "the optimizer updates an fp32 copy: bf16/fp16 weights would round small updates away",
    ),
    StateTerm("states/adam_m", lambda dtype: 4, True, "Adam's first moment (running mean of gradients), fp32"),
    StateTerm("states/adam_v", lambda dtype: 4, True, "Adam's second moment (running mean of squared gradients), fp32"),
)


def state_bytes(config: ModelConfig, params: int) -> dict[str, int]:
    """Bytes of each model state for `params` parameters on one GPU (terms of width 0 left out)."""
    shards = config.dp * config.cp if config.distributed_optimizer else 1
    out = {}
    for term in STATE_TERMS:
        width = term.width(config.dtype)
        if width:
            out[term.name] = width * (-(-params // shards) if term.sharded else params)
    return out
