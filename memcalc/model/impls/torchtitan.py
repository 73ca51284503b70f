"""torchtitan: what its Llama3 TransformerBlock (with qk_layernorm its Qwen3's, with kv_lora_rank its DeepSeek-V3's)
keeps for backward, under its own TP plan.

Where the block keeps other tensors than the paper's Megatron layer (inputs kept all-gathered, the norm per device,
RoPE's table, gathered on CUDA), its MoE, and what FullAC and SelectiveAC keep, each read from torchtitan's and
torch's sources: docs/impl-notes/torchtitan.md, rendered into docs/impl-torchtitan.md.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import chain
from math import prod
from typing import Any, Callable

from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls.base import Implementation, Refusal, Rerun, SizeCondition, check_grouped_mm, drop_small
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import BSH, Dim, Kind, Region, RMSNormTensors, SavedTensor, in_pair, small_moe
from memcalc.model.tp_plan import ATTENTION, MLP, MOE, Rule, Style, TPPlan

_SEQ = Region.SEQUENCE
_FUSED = "aten::_fused_rms_norm (CUDA kernel; read from torch's derivatives.yaml)"
_COMPOSITE = "rms_norm_composite (CPU; torch's layer_norm.cpp)"
_WHY_GATHERED = (
    "dW = X^T dY needs the input; torchtitan gathers it to the full sequence at the module's entry"
    " and the linear keeps that gathered tensor"
)


def _rmsnorm(prefix: str, before: str, rows: tuple[Dim, ...] = (Dim.B, Dim.S), width: Dim = Dim.H,
             region: Region = _SEQ) -> RMSNormTensors:
    """The tensors of the nn.RMSNorm in front of `before`, one row of `width` channels per `rows` entry: CUDA's fused
    kernel keeps `input` and `rstd`, CPU's composite `input_fp32`, `rstd` and `normed_fp32`. `prefix` is a block
    ("ln1": ln1/input) or a block and a stem ("attention/q_norm_": attention/q_norm_input), as ledger._norm's."""
    by = f"nn.RMSNorm before {before}: torch.rms_norm ->"
    stem = prefix if "/" in prefix else f"{prefix}/"
    shape = (*rows, width)
    return RMSNormTensors(
        input=SavedTensor(f"{stem}input", f"{by} {_FUSED}", shape, Kind.ACTIVATION, region, ledger.WHY_NORM_INPUT),
        rstd=SavedTensor(
            f"{stem}rstd_fp32", f"{by} _fused_rms_norm's rstd (CUDA) or the composite's rsqrt (CPU)",
            rows, Kind.FP32, region, ledger.WHY_NORM_RSTD + ", in fp32 (opmath) for a bf16 input", paper=False,
        ),
        input_fp32=SavedTensor(
            f"{stem}input_fp32", f"{by} {_COMPOSITE}: input.to(float32) (in fp32 the input itself), kept by pow and"
            " x * rstd", shape, Kind.FP32, region,
            "d(x * rstd) and d(mean(x^2)) need x; the composite keeps its fp32 upcast, not x",
        ),
        normed_fp32=SavedTensor(
            f"{stem}normed_fp32", f"{by} {_COMPOSITE}: x * rstd, kept by the multiply with the weight", shape,
            Kind.FP32, region, "the weight's gradient is sum(dY * x * rstd): the fp32 normalised input",
        ),
    )


LN1 = _rmsnorm("ln1", "attention")
LN2 = _rmsnorm("ln2", "the feed-forward")
FINAL_NORM = _rmsnorm("final_norm", "lm_head")  # the model's end (memcalc.sizing.timeline.torchtitan)
# Qwen3's GQAttention (qk_norm): an nn.RMSNorm on each query and key head's d channels, between FusedQKVLinear's
# contiguous q and k and RoPE; its plan (set_qwen3_sharding_config) keeps them on the heads TP splits (S(2)).
Q_NORM = _rmsnorm("attention/q_norm_", "RoPE, on each query head", (Dim.B, Dim.S, Dim.A), Dim.D, Region.TENSOR)
K_NORM = _rmsnorm("attention/k_norm_", "RoPE, on each key head", (Dim.B, Dim.S, Dim.G), Dim.D, Region.TENSOR)

QKV_IN = SavedTensor(
    "attention/qkv_in", "FusedQKVLinear.wqkv (column-parallel) input, gathered at GQAttention's entry", BSH,
    Kind.ACTIVATION, _SEQ, _WHY_GATHERED,
)
FC1_IN = SavedTensor(
    "mlp/fc1_in", "FeedForward.w1 and .w3 (column-parallel): one input, gathered at FeedForward's entry", BSH,
    Kind.ACTIVATION, _SEQ, _WHY_GATHERED + "; w1 and w3 share it",
)
QKV_OUT = in_pair("attention/qkv_out", "SelectiveAC: MUST_SAVE of the wqkv matmul (the first matmul of the block)",
                  (Dim.B, Dim.S, Dim.QKV, Dim.D),
                  "op-level checkpointing keeps this GEMM's output so the recompute in backward need not redo it")
FC2_OUT = SavedTensor(
    "mlp/fc2_out", "SelectiveAC: MUST_SAVE of the w2 matmul, before its reduce-scatter (or all-reduce)", BSH,
    Kind.ACTIVATION, _SEQ,
    "op-level checkpointing keeps this GEMM's output: partial sums over the whole sequence on every rank",
)
ROPE_CACHE = SavedTensor(
    "attention/rope_cache",
    "ComplexRoPE given the trainer's positions (CUDA's flex path): its complex64 table gathered at them, (b, s, d/2),"
    " counted as fp32 pairs", (Dim.B, Dim.S, Dim.D), Kind.FP32, Region.REPLICATED,
    "q's and k's complex products read the table for their gradients: gathered per token, it is a tensor of its own,"
    " not a view of the buffer", paper=False,
)
_WHY_COS_SIN = ("q's and k's products with the table read it for their gradients: gathered per token, it is a tensor"
                " of its own, (b, s, 2d) fp32 (cos | sin), not a view of the buffer; each product keeps its half")
ROPE_COS = SavedTensor(
    "attention/rope_cos", "CosSinRoPE (Qwen3) given the trainer's positions (CUDA's flex path): the cos half of its"
    " table gathered at them, kept by query.float() * cos and key.float() * cos", (Dim.B, Dim.S, Dim.D), Kind.FP32,
    Region.REPLICATED, _WHY_COS_SIN, paper=False,
)
ROPE_SIN = replace(ROPE_COS, name="attention/rope_sin", saved_by="CosSinRoPE (Qwen3) given the trainer's positions:"
                   " the sin half of its gathered table, kept by rotate_half(query.float()) * sin and the key's")
WO_OUT = replace(FC2_OUT, name="attention/wo_out", saved_by="SelectiveAC: MUST_SAVE of the wo matmul (DeepSeek-V3's"
                 " fifth, with a query latent), before its reduce-scatter (or all-reduce)")
SHARED_FC2_OUT = replace(
    FC2_OUT, name="moe/shared_fc2_out", saved_by="SelectiveAC: MUST_SAVE of the shared experts' w2 matmul (the fifth)",
    why="op-level checkpointing keeps this GEMM's output so the recompute in backward need not redo it",
)
MOE_TOPK_VALUES = small_moe(
    "topk_values_fp32", "SelectiveAC: MUST_SAVE of the router's torch.topk (on its list, beside the ids)",
    (Dim.B, Dim.S, Dim.K), Kind.FP32, "op-level checkpointing keeps top-k's outputs so that the recompute routes each"
    " token as forward did; the values are unused, the scores are gathered from the softmax")


# -- DeepSeek-V3's Attention (multi-head latent attention; torchtitan/models/deepseek_v3/model.py) -----------------
# set_deepseek_v3_sharding_config gathers x at the attention's entry, which wq (or wq_a) and wkv_a both keep; the
# down projections wq_a and wkv_a and the latents' norms have replicated weights, so every rank makes the latents
# whole; wq, wq_b and wkv_b are colwise (heads split), wo rowwise. V is a d_v-wide split of wkv_b's output, never
# copied: the attention core keeps that whole output in V's place.
_LATENT = Region.REPLICATED
MLA_IN = replace(QKV_IN, name="mla/qkv_in", saved_by="Attention's wq (or wq_a) and wkv_a (replicated): one input,"
                 " gathered at its entry", why=_WHY_GATHERED + "; both down projections read it")
MLA_Q_NORM = _rmsnorm("mla/q_norm_", "wq_b, on wq_a's query latent", width=Dim.QR, region=_LATENT)
_KV_NORM = _rmsnorm("mla/kv_norm_", "wkv_b, on the latent split from wkv_a's output", width=Dim.KVR, region=_LATENT)
MLA_KV_DOWN_VIEW = replace(
    _KV_NORM.input, shape=(Dim.B, Dim.S, Dim.KVD),
    saved_by=f"{_KV_NORM.input.saved_by}, on torch.split(wkv_a's output)[0]: a view of the whole output",
    why="the fused norm's backward reads its input as passed, a view that keeps wkv_a's whole output (the latent and"
    " the keys' RoPE part) alive",
)
MLA_KV_NORM = replace(_KV_NORM, input=MLA_KV_DOWN_VIEW)
MLA_Q_UP_IN = replace(ledger.MLA_Q_UP_IN, saved_by="wq_b (colwise), on q_norm's output", region=_LATENT)
MLA_KV_UP_IN = replace(ledger.MLA_KV_UP_IN, saved_by="wkv_b (colwise), on kv_norm's output", region=_LATENT)
MLA_ROPE_CACHE = replace(
    ROPE_CACHE, name="mla/rope_cache", shape=(Dim.B, Dim.S, Dim.DR),
    saved_by="ComplexRoPE on q_pe and k_pe given the trainer's positions (CUDA's flex path): its complex64 table"
    " gathered at them, (b, s, d_r/2), counted as fp32 pairs",
)
_WHY_OP = "op-level checkpointing keeps this GEMM's output so the recompute in backward need not redo it"
MLA_WQ_OUT = in_pair("mla/wq_out", "SelectiveAC: MUST_SAVE of wq's matmul (the first of the block)",
                     (Dim.B, Dim.S, Dim.A, Dim.QK), _WHY_OP)
MLA_WQ_A_OUT = SavedTensor("mla/wq_a_out", "SelectiveAC: MUST_SAVE of wq_a's matmul (the first of the block), the"
                           " query latent", (Dim.B, Dim.S, Dim.QR), Kind.ACTIVATION, _LATENT, _WHY_OP)
MLA_WKV_A_OUT = replace(MLA_WQ_A_OUT, name="mla/wkv_a_out", shape=(Dim.B, Dim.S, Dim.KVD),
                        saved_by="SelectiveAC: MUST_SAVE of wkv_a's matmul (the third, with a query latent)")
MLA_WKV_B_OUT = replace(MLA_WQ_OUT, name="mla/wkv_b_out", shape=(Dim.B, Dim.S, Dim.A, Dim.NV),
                        saved_by="SelectiveAC: MUST_SAVE of wkv_b's matmul (the third, without a query latent)")
MLA_TENSORS = (MLA_IN, *MLA_Q_NORM, *MLA_KV_NORM, MLA_Q_UP_IN, MLA_KV_UP_IN, MLA_ROPE_CACHE, MLA_WQ_OUT,
               MLA_WQ_A_OUT, MLA_WKV_A_OUT, MLA_WKV_B_OUT)


def tp_plan(knobs: Any) -> TPPlan:
    """Llama3's plan (set_llama3_sharding_config): norms sequence-parallel, wqkv, w1 and w3 colwise, wo and w2 rowwise.
    Each block's entry gathers its input (in_dst_shardings Replicate), which the colwise linears keep; SelectiveAC
    keeps w2's output before its reduce-scatter. With experts, Qwen3's MoE in the feed-forward's place
    (set_moe_sharding_config): at ep = 1 its entry gathers its input too, of which the router and the shared experts
    keep what they keep (`MOE_GATHERED`), and the experts' output (and the shared experts') leaves through a g* of
    its own; at ep > 1 each rank routes its own shard (`splits`)."""
    keeps = Style.COLWISE_KEEPS_INPUT
    shared = (Rule("moe.shared_experts.w2", Style.ROWWISE, MOE, (SHARED_FC2_OUT.name,)),) \
        if knobs.moe_shared_expert_intermediate_size else ()
    ffn = (Rule("moe", keeps, MOE, MOE_GATHERED), Rule("moe.experts", Style.ROWWISE, MOE), *shared) if knobs.moe else (
        Rule("feed_forward.w1", keeps, MLP, (FC1_IN.name,)), Rule("feed_forward.w3", keeps, MLP),
        Rule("feed_forward.w2", Style.ROWWISE, MLP, (FC2_OUT.name,)))
    return TPPlan((Rule("attention_norm", Style.SEQUENCE), *_attention_pair(knobs), Rule("ffn_norm", Style.SEQUENCE),
                   *ffn))


def _attention_pair(knobs: Any) -> tuple[Rule, ...]:
    """Llama3's wqkv and wo; DeepSeek-V3's (set_deepseek_v3_sharding_config) wq (or, with a query latent, wq_b) and
    wkv_b colwise, wo rowwise, the first keeping the input gathered at the attention's entry (`MLA_IN`); its down
    projections and their norms are replicated, no rule of the plan's. Where SelectiveAC saves wo's output
    (DeepSeek-V3's fifth matmul with a query latent; Llama3's where wqkv is forced, `_forced`), it is the output
    before its reduce-scatter: the whole sequence's."""
    keeps, wo = Style.COLWISE_KEEPS_INPUT, Rule("attention.wo", Style.ROWWISE, ATTENTION, (WO_OUT.name,))
    if not knobs.mla:
        return Rule("attention.qkv_linear.wqkv", keeps, ATTENTION, (QKV_IN.name,)), wo
    query = "attention.wq_b" if knobs.q_lora_rank is not None else "attention.wq"
    return Rule(query, keeps, ATTENTION, (MLA_IN.name,)), Rule("attention.wkv_b", keeps, ATTENTION), wo

# -- The MoE block (torchtitan/models/common/moe.py: MoE), as its Qwen3 and DeepSeek-V3 decoder layers run it ------
# TokenChoiceTopKRouter computes its gate under autocast(float32), so on CUDA the gate casts its weight and input
# to fp32 and everything the router makes is fp32; softmax or sigmoid scores every expert, top-k picks, gather
# reads the chosen scores, route_norm divides them by their sum. The dispatcher (EP=1: the local reorder) argsorts
# the k*b*s slots by expert and gathers each slot's token; GroupedExperts runs SwiGLU for all experts at once with
# torch._grouped_mm, cutting the sorted rows at cumulative offsets; combine scales each row in fp32 by its score
# and scatter-adds it back to its token. Shared experts are a FeedForward on the block's normalised input.
_ROUTER = "TokenChoiceTopKRouter"
_DISPATCH = "LocalTokenDispatcher (EP=1)"
_GROUPED = "GroupedExperts (torch._grouped_mm)"
_MOE = (Dim.B, Dim.S)
MOE_ROUTER_WEIGHT = small_moe(
    "router_weight_fp32", f"{_ROUTER}: gate under autocast(float32), its weight cast to fp32", (Dim.E, Dim.H),
    Kind.FP32, "the gate's input gradient dX = dLogits W reads the weight it multiplied: autocast's fp32 copy, once"
    " per layer and micro-batch", Region.REPLICATED)
MOE_ROUTER_IN = SavedTensor(
    "moe/router_in_fp32", f"{_ROUTER}: gate under autocast(float32), its input cast to fp32", BSH, Kind.FP32,
    _SEQ, "the gate's weight gradient dW = dLogits^T X reads its fp32 input",
)
MOE_ROUTER_SCORES = SavedTensor(
    "moe/router_scores_fp32", f"{_ROUTER}: softmax or sigmoid of the fp32 logits", (*_MOE, Dim.E), Kind.FP32,
    _SEQ, "softmax's and sigmoid's derivatives are read from their output, every expert's score",
)
MOE_TOPK_SCORES = small_moe(
    "topk_weights_fp32", f"{_ROUTER} (route_norm): the gathered top-k scores / their sum", (*_MOE, Dim.K), Kind.FP32,
    "the division's gradient for the divisor reads the numerator")
MOE_TOPK_SUM = small_moe(
    "topk_sum_fp32", f"{_ROUTER} (route_norm): the top-k scores' sum + 1e-20, the divisor", _MOE, Kind.FP32,
    "the division's gradients read its divisor")
MOE_SORTED_SLOTS = small_moe(
    "sorted_slots", f"{_DISPATCH}: argsort of the expert ids, kept by indexing the scores with it", (Dim.RS,),
    Kind.INT64, "indexing's backward scatters the sorted scores' gradient back to their slots", Region.EXPERT)
MOE_TOKEN_INDICES = small_moe(
    "token_indices", f"{_DISPATCH}: sorted slots // k, kept by x[indices] and combine's scatter_add", (Dim.RS,),
    Kind.INT64, "gathering rows and scatter-adding them route their gradients by the same indices", Region.EXPERT)
MOE_SORTED_SCORES = small_moe(
    "sorted_scores_fp32", f"{_DISPATCH}: the top-k scores in expert order, kept by combine's multiply", (Dim.RS,),
    Kind.FP32, "the expert output's gradient in the product is dY * score", Region.EXPERT)
MOE_OFFSETS = small_moe(
    "expert_offsets", f"{_GROUPED}: cumsum of the tokens per local expert, kept by each grouped matmul", (Dim.EL,),
    Kind.INT32, "a grouped matmul's backward cuts dY at the same expert boundaries", Region.REPLICATED)
MOE_EXPERT_OUT = SavedTensor(
    "moe/expert_out_fp32", f"{_DISPATCH}: combine's routed_output.to(float32) * score", (Dim.RS, Dim.H), Kind.FP32,
    Region.EXPERT, "the score's gradient is sum(dY * expert output): the fp32 copy the multiply read",
)
MOE_PERMUTED_INDICES = small_moe(
    "permuted_indices", "AllToAllTokenDispatcher (EP>1): _permute's row of each received slot, rank- to expert-major",
    (Dim.R,), Kind.INT64, "the rows' index backward puts each gradient back at the row it came from", Region.EXPERT)
MOE_SHARED_IN = replace(
    ledger.MOE_IN, saved_by="shared experts' w1 and w3 (FeedForward), on the normalised input",
    why="the shared experts' dW = X^T dY needs their input (the gate keeps an fp32 copy of its own)",
)
# What the router keeps of the MoE's input, which set_moe_sharding_config gathers at the MoE's entry under SP (at
# ep = 1; with ep > 1 each TP rank routes its own s/t tokens, `splits`), and the shared experts' input (gathered)
MOE_ROUTED = (MOE_ROUTER_IN, MOE_ROUTER_SCORES, ledger.ROUTER_TOPK_INDICES, MOE_TOPK_SCORES, MOE_TOPK_SUM,
              MOE_TOPK_VALUES)
MOE_GATHERED = tuple(x.name for x in (MOE_SHARED_IN, *MOE_ROUTED))
MOE_TENSORS = (MOE_ROUTER_WEIGHT, MOE_ROUTER_IN, MOE_ROUTER_SCORES, MOE_TOPK_SCORES, MOE_TOPK_SUM, MOE_SORTED_SLOTS,
               MOE_TOKEN_INDICES, MOE_SORTED_SCORES, MOE_PERMUTED_INDICES, MOE_OFFSETS, MOE_EXPERT_OUT, MOE_SHARED_IN)


def norm_block(norm: RMSNormTensors, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """CUDA's fused rms_norm keeps the input and rstd; the CPU composite an fp32 upcast, rstd, the normalised input."""
    if accounting.device == "cuda":
        return (norm.input, norm.rstd)
    return (norm.input_fp32, norm.rstd, norm.normed_fp32)


def attention_block(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """The gathered wqkv input, (Qwen3's, qk_layernorm: the q and k norms,) (on CUDA RoPE's gathered table,) Q and K
    after RoPE, V, the kernel's log-sum-exp, its output (wo's input). torch.compile'd flex attention keeps what SDPA's
    flash kernel keeps: its row maxima are made but not saved (AOTAutograd saves what flex_attention_backward reads:
    q, k, v, out, lse, the block mask's). Qwen3's CosSinRoPE multiplies in fp32 by its table, keeping only that: the
    norms' outputs are upcast (.float()) before the products, which keep their other factor, the table."""
    norms = norm_block(Q_NORM, accounting) + norm_block(K_NORM, accounting) if knobs.qk_layernorm else ()
    table = (ROPE_COS, ROPE_SIN) if knobs.qk_layernorm else (ROPE_CACHE,)
    rope = table if accounting.device == "cuda" else ()
    return (QKV_IN, *norms, *rope, ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, ledger.PROJ_IN)


def latent_attention_block(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """DeepSeek-V3's Attention: the gathered x, (with a query latent: q_norm's and wq_b's input,) kv_norm's and wkv_b's
    input, (on CUDA RoPE's gathered table,) Q and K (torch.cat's copies, RoPE on their d_r parts), wkv_b's whole
    output in V's place (the comment above `MLA_IN`), the kernel's log-sum-exp, its output (wo's input). Only the
    table is kept of RoPE: its products upcast q_pe and k_pe (.float()), and the table needs no gradient. CPU's
    composite kv_norm keeps its fp32 copy of the latent, CUDA's fused one the latent as passed, a view of wkv_a's
    output."""
    query = (*norm_block(MLA_Q_NORM, accounting), MLA_Q_UP_IN) if knobs.q_lora_rank is not None else ()
    rope = (MLA_ROPE_CACHE,) if accounting.device == "cuda" else ()
    return (MLA_IN, *query, *norm_block(MLA_KV_NORM, accounting), MLA_KV_UP_IN, *rope, ledger.MLA_Q, ledger.MLA_K,
            ledger.MLA_KV_UP_OUT, ledger.SOFTMAX_LSE, ledger.MLA_PROJ_IN)


def op_checkpoint(knobs: Any, moe: bool | None = None, at: tuple[dict[Dim, Any], int] | None = None,
                  ) -> tuple[SavedTensor, ...]:
    """SelectiveAC's saved op outputs, and the block's input: the output of every other matmul, the first, third, ...
    of the block's in forward order (`_matmuls`; the others are recomputed), the attention kernel's, and in a MoE
    layer (`moe`, default knobs.moe) the router's topk. Llama3's block saves wqkv's, w1's and w2's outputs and
    recomputes wo and w3; DeepSeek-V3's latent attention has four or five matmuls, which shifts the feed-forward's.
    `at` (the sizes by Dim, the weights' split t): the set at those sizes, where a matmul of the router gate's shape
    shifts the count (`_saved`); without it the set where none has, each such shift a size condition
    (`_shift_conditions`)."""
    moe = knobs.moe if moe is None else moe
    before, after, ffn = _matmuls(_kind(knobs), moe)
    block = (*before, *after, *ffn)
    marks = _saved(_forced(block, moe, *at) if at is not None else _forced(block, False, {}, 1))
    saved = tuple(x for (x, _), kept in zip(block, marks) if kept)
    kernel = (ledger.SOFTMAX_LSE, ledger.MLA_PROJ_IN if knobs.mla else ledger.PROJ_IN)
    router = (MOE_TOPK_VALUES, ledger.ROUTER_TOPK_INDICES) if moe else ()
    return (ledger.LAYER_INPUT, *_among(before, saved), *kernel, *_among(after, saved), *router, *_among(ffn, saved))


def _among(matmuls: tuple[Matmul, ...], saved: tuple[SavedTensor | None, ...]) -> tuple[SavedTensor, ...]:
    """The outputs of `matmuls` that SelectiveAC saves (`saved`), in order."""
    return tuple(x for x, _ in matmuls if x is not None and x in saved)


# A weight on a rank as aten.mm's second operand, (in, out), from the sizes by Dim and the weights' split t.
Shape = Callable[[dict[Dim, Any], Any], tuple[Any, Any]]
# A matmul of the block as SelectiveAC meets it: its output (None for wq_b's, which memcalc does not name), its weight.
Matmul = tuple[SavedTensor | None, Shape]


def _whole(inner: Dim, outer: Dim) -> Shape:
    """A replicated weight's (in, out): whole on every rank."""
    return lambda z, t: (z[inner], z[outer])


def _colwise(inner: Dim, *outer: Dim) -> Shape:
    """A colwise weight's (in, out): its out, the product of `outer`, split over t."""
    return lambda z, t: (z[inner], prod((z[d] for d in outer), start=1) // t)


def _rowwise(*inner: Dim) -> Shape:
    """A rowwise weight's (in, out): its in, the product of `inner`, split over t; out h."""
    return lambda z, t: (prod((z[d] for d in inner), start=1) // t, z[Dim.H])


def _kind(knobs: Any) -> tuple[bool, bool, bool]:
    """What decides a block's matmuls: latent attention (kv_lora_rank), its query latent, shared experts."""
    mla = bool(knobs.mla)
    return mla, mla and knobs.q_lora_rank is not None, bool(knobs.moe_shared_expert_intermediate_size)


def _matmuls(kind: tuple[bool, bool, bool], moe: bool) -> tuple[tuple[Matmul, ...], ...]:
    """The block's matmuls (of `_kind`) in forward order, those before the attention kernel, those after it, the
    feed-forward's: as SelectiveAC counts them, torch._grouped_mm not on its list; so a MoE layer's are its shared
    experts' alone. The MoE's router gate, whose own shape SelectiveAC forces to recompute (`_forced`), never counts."""
    mla, query_latent, shared = kind
    if moe:
        ffn = _feed_forward((ledger.SHARED_GATE, ledger.SHARED_UP, SHARED_FC2_OUT), Dim.U) if shared else ()
    else:
        ffn = _feed_forward((ledger.SWIGLU_GATE, ledger.SWIGLU_UP, FC2_OUT), Dim.F)
    wo = (WO_OUT, _rowwise(Dim.A, Dim.DV) if mla else _rowwise(Dim.A, Dim.D))
    return _attention(mla, query_latent), (wo,), ffn


def _attention(mla: bool, query_latent: bool) -> tuple[Matmul, ...]:
    """The attention's matmuls before its kernel: Llama3's wqkv (h, (a + 2g)d/t); DeepSeek-V3's wq (h, a(d_n + d_r)/t)
    or wq_a (h, r_q) and wq_b (r_q, a(d_n + d_r)/t), then wkv_a (h, r_kv + d_r) and wkv_b (r_kv, a(d_n + d_v)/t)."""
    if not mla:
        return ((QKV_OUT, _colwise(Dim.H, Dim.QKV, Dim.D)),)
    query = ((MLA_WQ_A_OUT, _whole(Dim.H, Dim.QR)), (None, _colwise(Dim.QR, Dim.A, Dim.QK))) if query_latent else \
        ((MLA_WQ_OUT, _colwise(Dim.H, Dim.A, Dim.QK)),)
    return (*query, (MLA_WKV_A_OUT, _whole(Dim.H, Dim.KVD)), (MLA_WKV_B_OUT, _colwise(Dim.KVR, Dim.A, Dim.NV)))


def _feed_forward(outputs: tuple[SavedTensor, ...], width: Dim) -> tuple[Matmul, ...]:
    """A FeedForward's w1, w3 (colwise, (h, f/t)) and w2 (rowwise, (f/t, h)), in its forward's order; `outputs`
    theirs, `width` its f."""
    w1, w3, w2 = outputs
    return (w1, _colwise(Dim.H, width)), (w3, _colwise(Dim.H, width)), (w2, _rowwise(width))


def _forced(matmuls: tuple[Matmul, ...], moe: bool, sizes: dict[Dim, Any], t: Any) -> tuple[Any, ...]:
    """Whether SelectiveAC forces each matmul to recompute (numbers or arrays). In a MoE block it collects its router
    gate's weight shape, (h, E) (force_recompute_mm_shapes_by_fqns, per block: a dense block has none), and forces
    every mm whose second operand on the rank has it: the shared experts' w1 and w3 at u/t = E, say."""
    if not moe:
        return (False,) * len(matmuls)
    shapes = (weight(sizes, t) for _, weight in matmuls)
    return tuple((inner == sizes[Dim.H]) & (outer == sizes[Dim.E]) for inner, outer in shapes)


def _saved(forced: tuple[Any, ...]) -> tuple[Any, ...]:
    """Whether SelectiveAC saves each matmul's output (numbers or arrays): a forced one (`_forced`) is recomputed and
    left out of its count; of the others it saves the first, third, ... So a forced matmul shifts which of the later
    ones it saves."""
    counted, marks = 0, []
    for one in forced:
        free = one == 0  # counted
        marks.append((counted % 2 == 0) & free)
        counted = counted + free
    return tuple(marks)


def _shift_conditions() -> tuple[SizeCondition, ...]:
    """SelectiveAC's shifted count in a MoE block (`_forced`) as size conditions, for each kind of block (`_kind`):
    each matmul output it saves where nothing is forced is kept where it still saves it, else the next matmul's
    output in its place, itself kept only where SelectiveAC saves it (of two neighbours, at most one is saved)."""
    kinds = ((False, False), (True, False), (True, True))  # Llama3's attention, DeepSeek-V3's without and with r_q
    return tuple(condition for mla, query_latent in kinds for shared in (False, True)
                 for condition in _count_conditions((mla, query_latent, shared)))


def _count_conditions(kind: tuple[bool, bool, bool]) -> tuple[SizeCondition, ...]:
    """`_shift_conditions` for one kind of MoE block: one for each matmul output memcalc names."""
    block = tuple(chain(*_matmuls(kind, True)))
    following = (*(x for x, _ in block[1:]), None)
    mla, query_latent, shared = kind
    block_name = ("DeepSeek-V3's block" + ("" if query_latent else " without a query latent")) if mla else \
        "Qwen3's MoE block"
    what = (f"in {block_name} {'with' if shared else 'without'} shared experts SelectiveAC saves every other"
            " matmul's output, but forces one whose weight on a rank is the router gate's (h, E) to recompute,"
            " uncounted: the count of those after it shifts")
    return tuple(SizeCondition(
        output, what,
        kept=lambda sizes, t, i=i: _saved(_forced(block, True, sizes, t))[i],
        instead=(following[i],) if i % 2 == 0 and following[i] is not None else (),
        applies=lambda k: k.recompute == "op" and bool(k.moe) and _kind(k) == kind,
    ) for i, (output, _) in enumerate(block) if output is not None)


def moe_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """The router (fp32 under autocast), the dispatcher's sorted slots, the grouped SwiGLU, the fp32 combine, then
    the shared experts: each expert's tensors are the dense MLP's rows for r slots, as one grouped storage each."""
    norm = () if knobs.moe_router_pre_softmax else (MOE_TOPK_SCORES, MOE_TOPK_SUM)  # route_norm
    router = (MOE_ROUTER_WEIGHT, MOE_ROUTER_IN, MOE_ROUTER_SCORES, ledger.ROUTER_TOPK_INDICES, *norm)
    experts = (MOE_SORTED_SLOTS, MOE_SORTED_SCORES, MOE_TOKEN_INDICES, MOE_PERMUTED_INDICES, ledger.EXPERT_IN,
               MOE_OFFSETS, ledger.EXPERT_GATE, ledger.EXPERT_SILU_OUT, ledger.EXPERT_UP, ledger.EXPERT_FC2_IN,
               MOE_EXPERT_OUT)
    shared = (MOE_SHARED_IN, ledger.SHARED_GATE, ledger.SHARED_SILU_OUT, ledger.SHARED_UP, ledger.SHARED_FC2_IN)
    return (*router, *experts, *(shared if knobs.moe_shared_expert_intermediate_size else ()))


def keeps(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Every tensor one block (Llama3's, or with experts Qwen3's MoE block; with kv_lora_rank DeepSeek-V3's latent
    attention in its attention's place) keeps for backward, in forward order (unless fully recomputed)."""
    if knobs.recompute == "op":
        return drop_small(op_checkpoint(knobs), accounting)
    # a FeedForward: the gathered w1/w3 input, SiLU's input, both factors of the product, w2's input
    mlp = moe_block(knobs) if knobs.moe else (FC1_IN, ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT,
                                              ledger.FC2_IN)
    attention = latent_attention_block if knobs.mla else attention_block
    blocks = norm_block(LN1, accounting) + attention(knobs, accounting) + norm_block(LN2, accounting) + mlp
    return drop_small(blocks, accounting)


# Knob values torchtitan's Llama3 block does not have, each with the reason.
_REFUSED = (
    ("norm", ("layernorm",), "Llama3 normalises with nn.RMSNorm; use norm rmsnorm"),
    ("mlp", ("gelu", "gelu_tanh"), "Llama3's FeedForward is SwiGLU; use mlp swiglu"),
    ("attention", ("eager",), "torchtitan's attention is a fused kernel (flex, SDPA or varlen); use attention flash"),
    ("recompute", ("selective",), "torchtitan's selective checkpointing is op-level: use recompute op (or none, full)"),
    ("dtype", ("fp16",), "its mixed_precision_param is bfloat16 or float32; use dtype bf16 or fp32"),
)


def check(knobs: Any) -> None:
    """ConfigError for knob values torchtitan's Llama3 block cannot run."""
    for name, values, reason in _REFUSED:
        if getattr(knobs, name) in values:
            raise ConfigError(f"impl torchtitan: {name} {getattr(knobs, name)} is not in torchtitan's Llama3: {reason}")
    if knobs.dropout > 0:
        raise ConfigError(f"impl torchtitan: dropout {knobs.dropout}, but Llama3 has no dropout; use dropout 0")
    if knobs.bias_activation_fusion:
        raise ConfigError("impl torchtitan: bias_activation_fusion is Megatron's fused kernel; Llama3 has no biases")
    if knobs.moe:
        check_moe(knobs)
    if knobs.mla:
        check_mla(knobs)
    if knobs.head_dim_set and not knobs.qk_layernorm:
        raise ConfigError(f"impl torchtitan: kv_channels {knobs.kv_channels} (heads not h/a wide) is its Qwen3 model's"
                          " head_dim, whose attention has q_norm and k_norm; set qk_layernorm (Qwen3), or leave"
                          " kv_channels unset (Llama3)")


# Knob values of DeepSeek-V3's latent attention memcalc has not measured on torchtitan's block, each with the reason.
_MLA_REFUSED = (("dtype", ("fp32",), "measured in bf16 only; use dtype bf16"),)


def check_mla(knobs: Any) -> None:
    """ConfigError for knob values of the latent attention (kv_lora_rank) that memcalc has not measured."""
    for name, values, reason in _MLA_REFUSED:
        if getattr(knobs, name) in values:
            raise ConfigError(f"impl torchtitan with kv_lora_rank (DeepSeek-V3's latent attention): {name}"
                              f" {getattr(knobs, name)}: {reason}")


# MoE knob values torchtitan's MoE block does not have (or memcalc has not measured), each with the reason.
_MOE_REFUSED = (
    (lambda k: k.moe_expert_capacity_factor is not None, "moe_expert_capacity_factor: its local dispatcher drops no"
     " tokens; leave it unset"),
    (lambda k: k.moe_token_dispatcher_type != "alltoall", "moe_token_dispatcher_type allgather is Megatron's; leave"
     " it alltoall"),
    (lambda k: k.moe_aux_loss, "moe_aux_loss: its MoE balances load without an auxiliary loss (expert_bias_E)"),
    (lambda k: k.dtype != "bf16", "GroupedExperts computes in bf16 whatever the dtype; use dtype bf16"),
)


def check_moe(knobs: Any) -> None:
    """ConfigError for MoE knobs the measured MoE block (bf16; ep 1, or ep = t over the TP ranks) does not run."""
    for refused, reason in _MOE_REFUSED:
        if refused(knobs):
            raise ConfigError(f"impl torchtitan with experts: {reason}")
    c = knobs  # a config: its layout too (a knob set alone has no ep)
    if _ep(c) > 1 and not (_ep_over_tp(c) or _ep_over_dp_shard(c)):
        raise ConfigError(f"impl torchtitan with experts: ep={c.ep} is measured as ep = t over the TP ranks, without"
                          f" dp_shard, t dividing s (its MoE splits the sequence over them), or at t = 1 over the"
                          f" FSDP2 ranks, ep dividing dp_shard, without pp, cp or dp_replicate; not at t={c.t},"
                          f" dp_shard={c.dp_shard}, s={c.s}, pp={c.pp}, cp={c.cp}, dp_replicate={c.dp_replicate}; use"
                          " ep 1, ep = t under tp or tp-sp, or t 1 with dp_shard a multiple of ep")


def _ep(config: Any) -> int:
    return getattr(config, "ep", 1)


def _ep_over_tp(c: Any) -> bool:
    """ep = t: torchtitan borrows the expert-parallel ranks from the TP ranks alone (no dp_shard)."""
    return c.ep == c.t and c.dp_shard is None and c.s % c.t == 0


def _ep_over_dp_shard(c: Any) -> bool:
    """ep over FSDP2's ranks at t = 1 (DeepSeek-V3's and Qwen3-MoE's training layout): each rank routes its own b*s
    tokens; its experts are sharded over efsdp = dp_shard/ep (`efsdp`). Measured without pp, cp or HSDP."""
    return c.t == 1 and c.dp_shard is not None and c.dp_shard % c.ep == 0 and c.pp == 1 and c.cp == 1 \
        and (c.dp_replicate or 1) == 1


def efsdp(config: Any) -> int:
    """The ranks FSDP2 shards the routed experts over: parallel_dims' efsdp = dp_shard*cp*tp/ep under ep > 1 (ep
    borrowed from dp_shard at t = 1, `_ep_over_dp_shard`), its fsdp mesh's dp_shard*cp at ep = 1."""
    return (config.dp_shard or 1) * config.cp // _ep(config)


def splits(config: Any) -> tuple[tuple[str, Dim], ...]:
    """With ep > 1 (ep = t) the MoE spreads its tokens over the TP ranks (set_moe_sharding_config, enable_ep): each
    routes its own s/t tokens (r_s/t slots), its E/ep experts whole, receiving r/t of the slots over the all-to-all.
    At t = 1 (ep over dp_shard) nothing splits: each rank routes its own b*s tokens and receives r slots."""
    if _ep(config) == 1:
        return ()
    slots = (MOE_SORTED_SLOTS, MOE_TOKEN_INDICES, MOE_SORTED_SCORES, MOE_EXPERT_OUT)
    received = (MOE_PERMUTED_INDICES, ledger.EXPERT_IN, ledger.EXPERT_GATE, ledger.EXPERT_SILU_OUT, ledger.EXPERT_UP,
                ledger.EXPERT_FC2_IN)
    return (*((x.name, Dim.S) for x in MOE_ROUTED), *((x.name, Dim.RS) for x in slots),
            *((x.name, Dim.R) for x in received))


EP_WITHOUT_TP = Refusal(
    "none", lambda config: _ep(config) > 1 and getattr(config, "dp_shard", None) is None,
    "with ep > 1 and no dp_shard",
    "torchtitan takes its expert-parallel ranks from dp_shard*cp*tp: without FSDP2 they are the TP ranks",
    "torchtitan 0.3.0, torchtitan/distributed/parallel_dims.py (efsdp = dp_shard*cp*tp/ep)",
)


def check_sizes(config: Any) -> None:
    """torch._grouped_mm's whole 16-byte strides (`check_grouped_mm`) for each rank's expert width: e/t under TP at
    ep = 1, whole under ep = t. Under SelectiveAC, no shift of its count onto wq_b (`_check_unnamed_saved`). RoPE on
    heads of even width (`_check_rope`)."""
    _check_rope(config)
    if config.moe:
        check_grouped_mm(config, "torchtitan", "its GroupedExperts", t=config.t if _ep(config) == 1 else 1)
    f, shards = config.expert_ffn // config.t, efsdp(config)
    if expert_dim1(config) and (f % shards or config.h % shards):
        raise ConfigError(f"impl torchtitan: dp_shard*cp={(config.dp_shard or 1) * config.cp} ranks above"
                          f" num_experts={config.num_experts}: its apply_fsdp_to_decoder shards the experts on dim 1"
                          f" (f_e/t={f}, h={config.h}) over dp_shard*cp/ep={shards} ranks, which FSDP2 refuses uneven"
                          " (NotImplementedError); pick dp_shard*cp/ep dividing both")
    _check_unnamed_saved(config)


def _check_unnamed_saved(config: Any) -> None:
    """A forced matmul (`_forced`) that shifts SelectiveAC's count onto wq_b, whose output memcalc does not name: a
    query latent r_q = E wide (wq_a's weight the gate's (h, E)), whole (the none layout) or with wq_b's split over t."""
    if not (config.moe and config.recompute == "op" and config.mla and config.q_lora_rank is not None):
        return
    from memcalc.model.evaluate import dim_sizes  # evaluate imports the implementations
    block = tuple(chain(*_matmuls(_kind(config), True)))
    for t in {1, config.t}:
        marks = _saved(_forced(block, True, dim_sizes(config), t))
        if any(mark for (output, _), mark in zip(block, marks) if output is None):
            raise ConfigError(f"impl torchtitan, recompute op: wq_a's weight (h, r_q) = ({config.h},"
                              f" {config.q_lora_rank}) is the router gate's (h, E), which SelectiveAC recomputes,"
                              " leaving it out of its count: it then saves wq_b's output, which memcalc has not"
                              " measured; use recompute none or full")


def _check_rope(config: Any) -> None:
    """RoPE on heads of even width: Qwen3's CosSinRoPE and Llama3's ComplexRoPE rotate channel pairs, DeepSeek-V3's
    ComplexRoPE those of each head's RoPE part (d_r wide)."""
    if config.mla:
        if config.qk_rope_head_dim % 2:
            raise ConfigError(f"impl torchtitan: DeepSeek-V3's ComplexRoPE reshapes each head's RoPE part into channel"
                              f" pairs: qk_rope_head_dim = {config.qk_rope_head_dim} is odd (a RuntimeError); use an"
                              " even qk_rope_head_dim")
        return
    d = config.head_dim
    if d % 2 and config.qk_layernorm:
        raise ConfigError(f"impl torchtitan: Qwen3's CosSinRoPE rotates channel pairs, its table 2*(d//2) = {d - 1}"
                          f" wide: d = {d} is odd (a RuntimeError); use an even kv_channels")
    if d % 2:
        raise ConfigError(f"impl torchtitan: Llama3's ComplexRoPE reshapes each head into channel pairs: d = {d} is"
                          " odd (a RuntimeError); use an even h/a")


def expert_dim1(config: Any) -> bool:
    """Whether torchtitan's apply_fsdp_to_decoder shards the experts on dim 1: at ep = 1 when its data-parallel mesh
    (dp_replicate x fsdp, its ParallelDims' fsdp = dp_shard*cp) has more ranks than there are experts."""
    return bool(config.moe) and (config.dp_replicate or 1) * (config.dp_shard or 1) * config.cp > config.num_experts


# Found by the differential test (tests/probe/test_differential.py) at b = s = 1.
V_IN_QKV_OUT = in_pair("attention/v_qkv_view", "SDPA: V, passed as a view of the fused wqkv output",
                       (Dim.B, Dim.S, Dim.QKV, Dim.D),
                       "the kernel keeps V as passed; a view keeps its base, the whole fused output, alive")


def _copied(sizes: dict[Any, Any], t: Any) -> Any:
    """Whether FusedQKVLinear's .contiguous() on a (b, s, heads, d) view of its fused output copies: unless b = s = 1
    with one K/V group per rank (g = t), where the view is contiguous already."""
    return (sizes[Dim.B] * sizes[Dim.S] > 1) | (sizes[Dim.G] // t > 1)


def _qwen3(knobs: Any) -> bool:
    """torchtitan's Qwen3 block (qk_layernorm)."""
    return bool(knobs.qk_layernorm)


def _qwen3_fp32(knobs: Any) -> bool:
    """Qwen3's norms in fp32, where the composite's upcast input.to(float32) is the input itself."""
    return bool(knobs.qk_layernorm) and knobs.dtype == "fp32"


CONDITIONS = (
    SizeCondition(
        ledger.V, "FusedQKVLinear splits the (b, s, g, a/g + 2, d) wqkv output and calls .contiguous() on V's"
        " (b, s, g, d) view, which copies unless the view is already contiguous: at b = s = 1 with one K/V group per"
        " rank (g = t) it is, so SDPA keeps the view, and with it the whole fused output",
        kept=_copied, instead=(V_IN_QKV_OUT,),
    ),
    *(SizeCondition(
        norm_input, "Qwen3's q and k are FusedQKVLinear's .contiguous() copies of their (b, s, heads, d) views, except"
        " at b = s = 1 with one K/V group per rank (g = t), where the views are contiguous already: the norm then"
        " keeps a view of the whole fused output, which V's view keeps too", kept=_copied, applies=applies,
    ) for norm_input, applies in ((Q_NORM.input, _qwen3), (K_NORM.input, _qwen3), (Q_NORM.input_fp32, _qwen3_fp32),
                                  (K_NORM.input_fp32, _qwen3_fp32))),
    SizeCondition(
        MOE_PERMUTED_INDICES, "AllToAllTokenDispatcher reorders the slots it receives only with experts on other"
        " ranks (ep > 1, fewer than E here); at ep = 1 it dispatches locally",
        kept=lambda sizes, t: sizes.get(Dim.EL, 0) < sizes.get(Dim.E, 0),
    ),
    *_shift_conditions(),
)

IMPLEMENTATION = Implementation(
    name="torchtitan",
    title="torchtitan",
    measured_on="torchtitan 0.3.0 (torch 2.13.0, CPU, bf16): Llama3TransformerBlock with fused wqkv and SDPA,"
    " its own TP plan (set_llama3_sharding_config + Module.parallelize, spmd_types backend), FullAC and SelectiveAC;"
    " with experts, Qwen3TransformerBlock's MoE (router, local dispatcher, GroupedExperts on torch._grouped_mm,"
    " shared experts) at ep 1 without recomputation, under FullAC and SelectiveAC, its router forced balanced and"
    " all-to-one; under its MoE sharding plan (set_moe_sharding_config) at tp and tp-sp, ep 1 and ep = t (the"
    " all-to-all dispatcher over the TP ranks), and at t = 1 with ep over the FSDP2 ranks (ep dividing dp_shard);"
    " with qk_layernorm its Qwen3TransformerBlock (q_norm and k_norm on each head, heads of kv_channels, CosSinRoPE)"
    " under set_qwen3_sharding_config at t = 1, tp and tp-sp, dense and with experts; with kv_lora_rank its"
    " DeepSeekV3TransformerBlock (latent attention, with and without a query latent, d_v = d_n + d_r for the CPU's"
    " flash kernel) under set_deepseek_v3_sharding_config at t = 1, tp and tp-sp, without recomputation, FullAC and"
    " SelectiveAC, with its FeedForward and its MoE",
    keeps=keeps,
    tp_plan=tp_plan,
    rerun=Rerun(frozenset({"op", "full"}), after_output=True),  # SelectiveAC caches no collective of spmd_types
    tensors=(*LN1, *LN2, *Q_NORM, *K_NORM, *MLA_TENSORS, QKV_IN, FC1_IN, QKV_OUT, FC2_OUT, WO_OUT, ROPE_CACHE,
             ROPE_COS, ROPE_SIN, V_IN_QKV_OUT, *MOE_TENSORS, SHARED_FC2_OUT, MOE_TOPK_VALUES),
    size_conditions=CONDITIONS,
    check=check,
    check_sizes=check_sizes,
    refuses=(EP_WITHOUT_TP,),
    splits=splits,
    # Llama3's block, and the trainer's default activation_checkpoint (SelectiveAC); attention: flex, a fused kernel.
    defaults={"norm": "rmsnorm", "mlp": "swiglu", "dropout": 0.0, "attention": "flash", "recompute": "op",
              "add_bias_linear": False, "position_embedding_type": "rope",  # Llama3: no biases, RoPE
              "tie_embeddings": False},  # its Decoder's enable_weight_tying (True in its 1B and 3B flavours)
)
