"""Model states: the parameters one GPU holds, and the bytes its weights, gradients and Adam keep.

Parameters are counted group by group (memcalc.sizing.params.PARAM_GROUPS), summed over each implementation's
inventory of them. Bytes per parameter follow each stack's layout
(`STATE_LAYOUTS`, rendered in docs/sharding.md). Expert parameters are replicated only over the expert
data-parallel group, t*cp*dp/(ep*etp) ranks, which is what the distributed optimizer shards their states over.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, replace
from functools import lru_cache
from math import lcm, prod
from typing import Callable, Iterable

from memcalc.config.schema import ModelConfig, megatron_chunk_layers
from memcalc.errors import ConfigError
from memcalc.model.impls.torchtitan import efsdp
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.sizing.params import PARAM_GROUPS, PARTS, Param, etp, expert_tp, part
from memcalc.sizing.pipeline import Stage, stage_rank


def check_expert_states(config: ModelConfig) -> None:
    """ConfigError when experts cannot be laid out: ep*etp must divide t*cp*dp (the expert data-parallel group),
    and with pipelining every chunk of Megatron's layers must hold the same share of MoE layers (freq divides each,
    `megatron_chunk_layers`); first dense layers are each stage's own under Megatron's 1F1B (one chunk a rank:
    memcalc.sizing.pipeline's `layers_changed`) and torchtitan's split, not under the interleaved schedule nor
    transformers' pipeline."""
    c = config
    if not c.moe:
        return
    etp = expert_tp(c)
    if (c.t * c.cp * c.dp) % (c.ep * etp):
        raise ConfigError(f"ep*etp={c.ep * etp} does not divide t*cp*dp={c.t * c.cp * c.dp}: the expert data-parallel"
                          " group has t*cp*dp/(ep*etp) ranks")
    if c.moe_first_dense_layers and c.vpp is not None:
        raise ConfigError(f"moe_first_dense_layers={c.moe_first_dense_layers} with vpp={c.vpp}: memcalc counts every"
                          " interleaved model chunk a stage keeps as holding the same kinds of layers, which the first"
                          " chunk's dense layers break; leave vpp out (1F1B sizes each stage's own layers)")
    if c.pp > 1 and c.moe_first_dense_layers and c.impl == "hf":
        raise ConfigError(f"moe_first_dense_layers={c.moe_first_dense_layers} with pp={c.pp}: under impl hf memcalc"
                          " counts every pipeline chunk as holding the same kinds of layers, which the first stage's"
                          " dense layers break; use pp 1 (impl megatron and torchtitan size each stage's own layers)")
    if c.pp == 1 or c.impl == "torchtitan":  # its one chunk a rank: its own share
        return
    chunk = next((n for n in megatron_chunk_layers(c) if n % c.moe_layer_freq), None)
    if chunk is not None:
        raise ConfigError(f"moe_layer_freq={c.moe_layer_freq} does not divide the {chunk} layers of a pipeline chunk"
                          " (L/(pp*vpp), or the uneven split's): memcalc counts each chunk a stage keeps as holding"
                          " layers/freq MoE layers")


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
    """Parameters one rank of `stage` holds, per group (MoE ones only with experts): the implementation's inventory
    (memcalc.sizing.params.part), one layer of each kind times the stage's layers of that kind."""
    check_expert_states(config)
    moe = moe_layers_held(config, stage)
    held = list(zip((int(stage.has_embedding), stage.layers - moe, moe, int(stage.has_output)), _part_sums(config, t)))
    return {g.name: sum(n * sums.get(g.name, 0) for n, sums in held) for g in PARAM_GROUPS
            if g.where != "moe" or config.moe}


@lru_cache(maxsize=256)
def _part_sums(config: ModelConfig, t: int) -> tuple[dict[str, int], ...]:
    """Elements per group of each of the model's `PARTS` on a rank of t (none without experts for its MoE layer),
    kept: a config's counts are asked for per stage, per strategy and per term."""
    sums: tuple[dict[str, int], ...] = tuple({} for _ in PARTS)
    for which, out in zip(PARTS, sums):
        for p in part(config, t, which) if which != "moe" or config.moe else ():
            out[p.group.name] = out.get(p.group.name, 0) + prod(p.shape)
    return sums


Chunk = tuple[list[int], int | None]  # a model chunk's parameters' elements in registration order; the shared one


def megatron_chunks(config: ModelConfig, stage: Stage, t: int) -> tuple[list[Chunk], list[Chunk]]:
    """Each model chunk of a stage (vpp of them, else one) as megatron-core's GPTModel registers its parameters on one
    rank of t (memcalc.sizing.params' megatron inventory), its dense buffer's and its experts' (`allreduce` False
    under expert parallelism: a buffer of their own): each parameter's elements, and which one is a tied embedding
    that pipelining gives its own bucket (`shared_embedding`: on the first stage's first chunk and the last stage's
    last). Each chunk holds the layers `ModelConfig.rank_chunks` places on the stage's rank, each of its own kind
    (the first stage's first dense layers dense); a chunk without MoE layers has no expert buffer."""
    c, chunks = config, config.rank_chunks(stage_rank(stage.name, config.pp))
    apart = c.ep > 1  # megatron's linears mark expert weights `allreduce` False only under expert parallelism
    kinds = {moe: part(c, t, "moe" if moe else "dense") for moe in ((False, True) if c.moe else (False,))}

    def merged(layers: Iterable[int], keep: Callable[[Param], bool]) -> list[int]:
        return [x for i in layers for x in _merged(kinds[c.is_moe_layer(i)], keep)]

    first, last = ([prod(p.shape) for p in part(c, t, x)] for x in ("first", "last"))
    tied = c.tie_embeddings and c.pp > 1
    dense: list[Chunk] = [(merged(x, lambda p: not apart or not p.group.expert), None) for x in chunks]
    if stage.has_embedding:
        dense[0] = (first + dense[0][0], 0 if tied else None)
    if stage.has_output:
        dense[-1] = (dense[-1][0] + last, len(dense[-1][0]) + len(last) - 1 if tied else None)
    experts = [merged(filter(c.is_moe_layer, x), lambda p: apart and p.group.expert) for x in chunks]
    return dense, [(x, None) for x in experts if x]


def _merged(params: tuple[Param, ...], keep: Callable[[Param], bool]) -> list[int]:
    """The elements of those of `params` (in registration order) that `keep` picks, SequentialMLP's experts expert by
    expert (their leading dimension), each of a multiple of 64 elements folded into the one before it: laid out just
    before it, it leaves no padding, so the buckets and the padding come out the same, in fewer steps (a MoE layer's
    hundreds of experts)."""
    experts = [p for p in params if p.group.expert]
    out: list[int] = []
    for p in params:
        if not keep(p) or p.group.expert and p is not experts[0]:
            continue
        for n in [prod(x.shape[1:]) for x in experts] * p.shape[0] if p.group.expert else [prod(p.shape)]:
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
    c, etp_ep = config, etp(config, t) * config.ep
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
    one_stage = replace(config, pp=1, vpp=None, make_vocab_size_divisible_by=1, ep=1)
    held = (1, config.L - config.moe_layers, config.moe_layers, 1)
    return sum(n * sum(sums.values()) for n, sums in zip(held, _part_sums(one_stage, 1)))


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
        titan_ep = c.impl == "torchtitan" and c.moe and c.ep > 1
        experts = f", the experts' over dp_shard*cp/ep={efsdp(c)}" if titan_ep else ""
        return f"FSDP2 over dp_shard*cp={c.dp_shard * c.cp}{experts}{replicas}{reshard}"
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
    4 bytes a parameter (bf16 each), over transformers' inventory (memcalc.sizing.params), module by module as
    model_to_params sums a module's own parameters: the embedding or lm_head, a projection with its bias, or a MoE
    block's experts (one module's two or four weights)."""
    kinds = ("first", "last", *(("dense",) if config.moe_layers < config.L else ()), *(("moe",) if config.moe else ()))
    own: dict[str, int] = {}
    for p in (p for which in kinds for p in part(config, 1, which)):
        head, _, name = p.module.rpartition(".")
        module = head if name in ("bias", "sinks") or head.endswith(".experts") else p.module  # a parent's parameter
        own[module] = own.get(module, 0) + prod(p.shape)
    return 2 * DTYPE_BYTES[config.dtype] * max(own.values())
