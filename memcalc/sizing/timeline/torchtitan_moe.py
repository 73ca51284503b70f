"""torchtitan's MoE feed-forward (models/common/moe.py, ep = 1) as ops for its step walk (`--impl torchtitan`), at t = 1
and under its own MoE sharding plan (tp, tp-sp).

Its Qwen3 MoE decoder layer keeps the torchtitan ledger's tensors (memcalc.model.impls.torchtitan.moe_block), one
storage each for all experts. Forward and backward op by op, checkpointing, and two measured facts the walk follows
without a reason from the source: docs/timeline.md, "torchtitan's MoE".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.evaluate import routed_slots
from memcalc.model.impls import torchtitan as rules
from memcalc.sizing.params import GROUPED_WEIGHTS
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD, linear, module_returns, swiglu_ops
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names


def permuted_stream_grad(z: Sizes) -> bool:
    """Whether the residual stream's gradient is the (b, s/t, h) view of an (s/t, b, h) reduce-scatter output, not
    contiguous, so that whatever needs it contiguous copies it (SP's all-gather of dY, the MoE's local_map at ep > 1).
    It is contiguous at b = 1, where the view is; on DTensor, whose shard is (b, s/t, h) itself; on CUDA, where it is
    the fused norm's contiguous dX, summed into in place; and on a pipeline stage that sends its output, where it is
    its receive buffer's layout (`Sizes.stage_sends`)."""
    return not (z.b == 1 or z.dtensor or z.cuda or z.stage_sends)


@dataclass(frozen=True)
class Slots:
    """What one rank's MoE works on: at ep = 1 every token (under TP each expert e/t wide); at ep = t its own s/t
    tokens, its E/ep experts whole, receiving r/t of the slots over the all-to-all (memcalc.model.impls.torchtitan
    .splits)."""

    tokens: int  # the tokens it routes
    sent: int  # their token-expert slots, k a token
    received: int  # the slots its experts receive
    experts: int  # the experts it holds
    width: int  # each one's width on this rank

    @classmethod
    def of(cls, z: Sizes, config: ModelConfig) -> Slots:
        k, e = config.moe_router_topk, config.num_experts
        if config.ep == 1:
            tokens = z.b * z.s
            return cls(tokens, k * tokens, k * tokens, e, config.expert_ffn // z.t)
        tokens = z.b * z.s // z.t
        return cls(tokens, k * tokens, routed_slots(config, config.moe_tokens, z.t) // z.t, e // config.ep,
                   config.expert_ffn)


# GroupedExperts' three (E, ...) parameters, one module's: each weight's gradient is named by its parameter, so that
# FSDP2's walk keeps each as that parameter's unsharded .grad (memcalc.sizing.timeline.torchtitan._keep_grad)
EXPERT_SWIGLU = (ledger.EXPERT_IN, ledger.EXPERT_GATE, ledger.EXPERT_SILU_OUT, ledger.EXPERT_UP, ledger.EXPERT_FC2_IN)


def moe_ops(p: str, z: Sizes, config: ModelConfig, x: str, shared: tuple[Op, ...],
            reduce_scatter: Callable[..., tuple[Op, ...]]) -> tuple[Op, ...]:
    """The MoE on ffn_norm's output `x` (under SP gathered at its entry), its output f"{p}/ffn out"; in backward its
    input's gradient is f"grad/{p}/ffn_norm out". `shared`: the shared experts' ops (memcalc.sizing.timeline
    .torchtitan.shared_experts_ops: output f"{p}/moe/shared out" under SP, else the ledger's SHARED_FC2_OUT, input
    gradient f"grad/{p}/moe/shared dX"), which keep `x`; without them `x` goes as the MoE returns. `reduce_scatter`: the
    block's (memcalc.sizing.timeline.torchtitan.reduce_scatter: SP's, or tp's f*), under TP: where each partial sum
    goes under its TP plan is docs/timeline.md's, "torchtitan's MoE"."""
    n, split = f"{p}/moe", config.ep == 1  # the experts split in width (at t = 1: whole)
    all_reduced, scattered = split and z.t > 1 and not z.sp, split and z.sp
    final = f"{n}/partial" if all_reduced else f"{p}/ffn out"
    routed = f"{n}/routed out" if shared else final
    combined = f"{n}/routed partial" if scattered else routed
    shared_out = f"{n}/shared out" if z.sp else kept_name(p, rules.SHARED_FC2_OUT)
    summed = Op("moe", forward=(Step("the routed and the shared experts' outputs summed", (
        Made(final, z.seq(z.h), "the MoE's output"),), frees=(routed, shared_out)),), backward=())
    # MoE.forward returns: its locals go (under a checkpoint also the router's scores and ids, and the input; under
    # SP the norm's shard it gathered); under tp its input, which its sharding wrapper holds, after the f*
    kept_in = x == kept_name(p, rules.MOE_SHARED_IN)  # the shared experts keep the MoE's input (at ep > 1 they
    held = Step("", frees=() if kept_in else (x,), reads_last=(x,) if kept_in else ())  # gather it themselves)
    returned = Op("moe", forward=(Step("", frees=(f"{n}/routing map", f"{n}/counts", f"{n}/router/topk scores",
                                                  *((f"{p}/ffn_norm out",) if scattered else ())),
                                       reads_last=kept_names(p, rules.MOE_ROUTER_SCORES, ledger.ROUTER_TOPK_INDICES)),
                                  *(() if all_reduced else (held,))), backward=())
    dy = f"grad/{n}/dY whole"
    return (*_router(p, z, config, bool(shared)), *_dispatch(p, z, config, bool(shared)), *_experts(p, z, config),
            *_combine(p, z, config, combined, dy if scattered else ""),
            *(reduce_scatter("moe.routed_experts", z, p, combined, routed, dy, ()) if scattered else ()),
            *shared, *((summed,) if shared else ()), returned,
            *((*reduce_scatter("moe", z, p, final, f"{p}/ffn out", "", ()), Op("moe", forward=(held,), backward=()))
              if all_reduced else ()))

def _router(p: str, z: Sizes, config: ModelConfig, shared: bool) -> tuple[Op, ...]:
    """TokenChoiceTopKRouter: the fp32 gate, the forced lead, softmax, the bias, top-k and route_norm."""
    n, g, tokens = f"{p}/moe/router", f"grad/{p}/moe/router", Slots.of(z, config).tokens
    e, k = config.num_experts, config.moe_router_topk
    scores, slots = 4 * tokens * e, 4 * tokens * k
    gate = Op("moe.router.gate", forward=(
        Step("autocast: the gate's weight cast to fp32", (kept(p, rules.MOE_ROUTER_WEIGHT),)),
        Step("autocast: its input cast to fp32", (kept(p, rules.MOE_ROUTER_IN),)),
        # the gate returns: the cast input goes, the hook's restored autocast drops its cached fp32 weight
        Step("the fp32 logits", (Made(f"{n}/logits", scores, "(b*s, E) fp32"),),
             reads_last=kept_names(p, rules.MOE_ROUTER_WEIGHT, rules.MOE_ROUTER_IN)),
    ), backward=(
        Step("the gate's fp32 GEMMs: dW and dX", (
            Made(f"{g}/weight fp32", z.weight("moe.router.gate", 4), "dW = dLogits^T X"),
            Made(f"{g}/input fp32", 4 * tokens * z.h, "dX = dLogits W")),
             frees=(f"{g}/logits",), returns=True),
        Step("the input cast's backward: dX to bf16", (Made(f"{g}/input", z.act * tokens * z.h, "bf16"),)),
        Step("summed with the dispatch's: ffn_norm's output gradient", (
            Made(f"grad/{p}/ffn_norm out", z.act * tokens * z.h, "both paths' summed"),),
            frees=(f"{g}/input", _dispatched(p, shared), f"{g}/input fp32"), moment=False),
        Step("the weight cast's backward: dW to bf16", (Made(f"{g}/weight", z.weight("moe.router.gate"), WHY_WGRAD),)),
        # the slots' score gradient (the sorted scores' index_put) goes only now, with the router's backward done
        Step("", frees=(f"{g}/weight fp32", f"grad/{p}/moe/scores"), hands_over=(f"{g}/weight",)),
    ), saves=(rules.MOE_ROUTER_WEIGHT, rules.MOE_ROUTER_IN))
    lead = Op("moe.router", forward=(
        Step("the forced route: slot indices", (Made(f"{n}/slots", 8 * tokens * k, "the shim's arange, int64"),)),
        Step("the forced route: each slot's expert", (Made(f"{n}/chosen", 8 * tokens * k, "int64"),)),
        Step("the forced route: zeros", (Made(f"{n}/lead", scores, "(b*s, E) fp32, the lead scattered in"),)),
        Step("", frees=(f"{n}/slots", f"{n}/chosen")),
        Step("the logits plus the lead", (Made(f"{n}/led", scores, "(b*s, E) fp32"),),
             frees=(f"{n}/lead", f"{n}/logits")),
    ), backward=())
    norm = rules.MOE_TOPK_SUM in rules.moe_block(config)  # route_norm
    softmax = Op("moe.router", forward=(
        Step(config.moe_router_score_function, (kept(p, rules.MOE_ROUTER_SCORES),), frees=(f"{n}/led",)),
        Step("+ expert_bias_E: the scores for choice", (Made(f"{n}/for choice", scores, "fp32"),)),
    ), backward=(
        Step(f"{config.moe_router_score_function}'s backward", (Made(f"{g}/logits", scores, "fp32"),),
             frees=(f"{g}/scores",)),
    ), saves=(rules.MOE_ROUTER_SCORES,))
    topk = Op("moe.router", forward=(
        Step("top-k", (Made(kept_name(p, rules.MOE_TOPK_VALUES), slots, "fp32, unused (SelectiveAC caches it)"),
                       kept(p, ledger.ROUTER_TOPK_INDICES))),
        Step("the chosen scores gathered", (kept(p, rules.MOE_TOPK_SCORES) if norm else
                                            Made(f"{n}/chosen scores", slots, "fp32"),)),
    ), backward=(
        *((Step("the numerator's two gradients summed", (Made(f"{g}/d chosen", slots, "fp32"),),
                frees=(f"{g}/d numerator", f"{g}/d divisor")),) if norm else ()),
        Step("gather's backward: zeros", (Made(f"{g}/scores zeros", scores, "(b, s, E) fp32"),)),
        Step("scatter_add into them", (Made(f"{g}/scores", scores, "fp32"),),
             frees=(f"{g}/scores zeros", f"{g}/d chosen")),
    ), saves=(ledger.ROUTER_TOPK_INDICES,))
    route_norm = Op("moe.router", forward=(
        Step("their sum", (Made(f"{n}/sum", 4 * tokens, "fp32"),)),
        Step("+ 1e-20: the divisor", (kept(p, rules.MOE_TOPK_SUM),), frees=(f"{n}/sum",)),
        Step("route_norm: divided", (Made(f"{n}/normed", slots, "fp32"),),
             reads_last=kept_names(p, rules.MOE_TOPK_SCORES)),
    ), backward=(
        # div's backward op by op (dY / sum, then -dY * y / sum / sum, summed to (b, s, 1)): small fp32 rows
        Step("the division's backward", (Made(f"{g}/d numerator", slots, "fp32"),
                                         Made(f"{g}/d divisor", 4 * tokens, "fp32")),
             frees=(f"{g}/scaled",), moment=False),
    ), saves=(rules.MOE_TOPK_SCORES, rules.MOE_TOPK_SUM))
    scale = Op("moe.router", forward=(
        Step("times route_scale", (Made(f"{n}/topk scores", slots, "fp32, what the experts read"),),
             frees=(f"{n}/normed", f"{n}/chosen scores", kept_name(p, rules.MOE_TOPK_VALUES), f"{n}/for choice"),
             reads_last=kept_names(p, rules.MOE_TOPK_SUM)),  # the router returns
    ), backward=(
        Step("route_scale's backward", (Made(f"{g}/scaled" if norm else f"{g}/d chosen", slots, "fp32"),)),
    ))
    return (gate, lead, softmax, topk, *((route_norm,) if norm else ()), scale)


def _dispatched(p: str, shared: bool) -> str:
    """The gradient the dispatch hands the router's: its index_put's, with shared experts summed with theirs."""
    return f"grad/{p}/moe/input sum" if shared else f"grad/{p}/moe/input put"


def _dispatch(p: str, z: Sizes, config: ModelConfig, shared: bool) -> tuple[Op, ...]:
    """MoE's routing map and counts, then the local dispatcher's reorder: argsort, the sorted scores, token indices,
    the sorted rows."""
    n, e, sizes = f"{p}/moe", config.num_experts, Slots.of(z, config)
    tokens, r, local = sizes.tokens, sizes.sent, config.ep == 1
    counts = Op("moe", forward=(
        Step("the routing map", (Made(f"{n}/routing map", tokens * e, "(b, s, E) bool"),)),
        Step("each expert's count", (Made(f"{n}/counts", 8 * e, "(E,) int64"),)),
    ), backward=())
    scores = Op("moe.routed_experts", forward=(
        Step("argsort of the slots' experts", (Made(f"{n}/sort values", 8 * r, "int64, unused"),
                                               kept(p, rules.MOE_SORTED_SLOTS))),
        Step("", frees=(f"{n}/sort values",)),
        Step("the scores in expert order", (kept(p, rules.MOE_SORTED_SCORES),)),
    ), backward=(
        Step("the sorted scores' backward: zeros", (Made(f"grad/{n}/scores zeros", 4 * r, "(b*s*k,) fp32"),)),
        Step("index_put: each slot's gradient", (Made(f"grad/{n}/scores", 4 * r, "fp32"),),
             frees=(f"grad/{n}/scores zeros", f"grad/{n}/sorted scores"), returns=True),
        *((Step("the dispatch's dX summed with the shared experts'", (
            Made(_dispatched(p, shared), z.act * tokens * z.h, "bf16"),),
            frees=(f"grad/{n}/input put", f"grad/{n}/shared dX")),) if shared else ()),
    ), saves=(rules.MOE_SORTED_SLOTS,))
    rows = Op("moe.routed_experts", forward=(
        Step("slot // k: each row's token", (kept(p, rules.MOE_TOKEN_INDICES),),
             reads_last=kept_names(p, rules.MOE_SORTED_SLOTS)),
        Step("x[indices]: the rows in expert order", (kept(p, ledger.EXPERT_IN) if local else
                                                      Made(f"{n}/rows", z.act * r * z.h, "(k*b*s/t, h) bf16"),)),
    ), backward=(
        Step("index's backward: zeros", (Made(f"grad/{n}/input zeros", z.act * tokens * z.h, "(b*s, h) bf16"),)),
        Step("index_put: each row's dX at its token", (Made(f"grad/{n}/input put", z.act * tokens * z.h, "bf16"),),
             frees=(f"grad/{n}/input zeros", f"grad/{n}/experts input" if local else f"grad/{n}/rows")),
    ), saves=(rules.MOE_TOKEN_INDICES,))
    return (counts, scores, rows, *(() if local else _exchange(p, z, config, sizes)))


def _exchange(p: str, z: Sizes, config: ModelConfig, sizes: Slots) -> tuple[Op, ...]:
    """AllToAllTokenDispatcher (ep > 1): the counts and the rows all-to-all'd, then _permute's rank- to expert-major
    reorder (docs/timeline.md, "torchtitan's MoE"); in backward the index's gradient put back, the all-to-all
    reversed."""
    n, g, e, ep = f"{p}/moe", f"grad/{p}/moe", config.num_experts, config.ep
    r = 8 * sizes.received  # an int64 (r/t,) index
    received, rows = z.act * sizes.received * z.h, z.act * sizes.sent * z.h

    def index(name: str, what: str, frees: tuple[str, ...] = ()) -> Step:
        return Step(what, (Made(f"{n}/{name}", r, "(r/t,) int64"),), frees=frees)

    return (Op("moe.routed_experts", forward=(
        *_all_to_all(z, f"{n}/received counts", 8 * e, "the counts' all-to-all", "each rank's counts for these"
                     " experts", "(ep, E/ep) int64", joined="stacked"),
        Step("the input splits", (Made(f"{n}/input splits", 8 * ep, "(ep,) int64"),)),
        Step("the output splits", (Made(f"{n}/output splits", 8 * ep, "(ep,) int64"),),
             frees=(f"{n}/input splits", f"{n}/output splits")),  # .tolist(): the splits are Python's
        *_all_to_all(z, f"{n}/received", received, "the rows' all-to-all", "the rows received",
                     "(r/t, h) bf16, rank-major"),
        Step("_permute: cumsum of the counts", (Made(f"{n}/cumsum", 8 * e, "(E,) int64"),)),
        Step("each segment's start", (Made(f"{n}/starts", 8 * e, "(E,) int64"),), frees=(f"{n}/cumsum",)),
        Step("the lengths expert-major", (Made(f"{n}/lengths", 8 * e, "(E,) int64"),)),
        Step("the starts expert-major", (Made(f"{n}/starts t", 8 * e, "(E,) int64"),), frees=(f"{n}/starts",)),
        Step("arange(E)", (Made(f"{n}/segments", 8 * e, "(E,) int64"),)),
        index("repeats", "repeat_interleave: the repeats"),
        index("segment ids", "each slot's segment", frees=(f"{n}/segments", f"{n}/repeats")),
        Step("the output starts: cumsum", (Made(f"{n}/cumsum 2", 8 * e, "(E,) int64"),)),
        Step("less the lengths", (Made(f"{n}/output starts", 8 * e, "(E,) int64"),), frees=(f"{n}/cumsum 2",)),
        index("input at", "each slot's input start"),
        index("arange", "arange(r/t)"),
        index("sum", "the two summed", frees=(f"{n}/input at", f"{n}/arange")),
        index("output at", "each slot's output start"),
        Step("less it: each received slot's row", (kept(p, rules.MOE_PERMUTED_INDICES),),
             frees=(f"{n}/sum", f"{n}/output at")),
        Step("the counts per local expert", (Made(f"{n}/local counts", 8 * sizes.experts, "(E/ep,) int64"),)),
        Step("the rows expert-major: the experts' input", (kept(p, ledger.EXPERT_IN),), frees=(
            f"{n}/rows", f"{n}/received", f"{n}/received counts", f"{n}/lengths", f"{n}/starts t",
            f"{n}/segment ids", f"{n}/output starts")),  # dispatch returns
    ), backward=(
        Step("the reorder's backward: zeros", (Made(f"{g}/received zeros", received, "(r/t, h) bf16"),)),
        Step("index_put: each row's gradient", (Made(f"{g}/received", received, "bf16"),),
             frees=(f"{g}/received zeros", f"{g}/experts input"), returns=True),
        *_all_to_all(z, f"{g}/rows", rows, "the all-to-all's backward", "the sent rows' gradient",
                     "(k*b*s/t, h) bf16", frees=(f"{g}/received",)),
    ), saves=(rules.MOE_PERMUTED_INDICES,)),)


def exchanged(p: str) -> tuple[str, ...]:
    """The outputs of block `p`'s all-to-alls at ep > 1 (the counts', the rows' out and back): on DTensor funcol's
    all_to_all_single makes them, which torchtitan's SelectiveAC caches (its list of communication ops to save)."""
    return f"{p}/moe/received counts", f"{p}/moe/received", f"{p}/moe/returned"


def _all_to_all(z: Sizes, out: str, nbytes: int, what: str, made: str, why: str, frees: tuple[str, ...] = (),
                joined: str = "concatenated") -> tuple[Step, ...]:
    """An all-to-all's output `out` (`made`, in words): on spmd_types (the TP plan's runtime) torch.distributed's
    all_to_all into chunks, one a rank, then `joined`; on DTensor (partial_dtensor, under FSDP2) funcol's
    all_to_all_single makes it at once. `frees`: what goes once it is made."""
    if z.dtensor:
        return (Step(f"{what}: {made}", (Made(out, nbytes, why),), frees=frees),)
    return (Step(f"{what}: its output chunks", (Made(f"{out} chunks", nbytes, "ep chunks"),)),
            Step(f"{joined}: {made}", (Made(out, nbytes, why),), frees=(f"{out} chunks", *frees)))


def _experts(p: str, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """GroupedExperts: the offsets, then SwiGLU on torch._grouped_mm for every expert at once (each e/t wide under
    TP at ep = 1)."""
    m, sizes = "moe.routed_experts.inner_experts", Slots.of(z, config)
    r, f = sizes.received, sizes.width
    rows_f, rows_h = z.act * r * f, z.act * r * z.h
    w1, *swiglu = swiglu_ops(p, m, EXPERT_SWIGLU, z.weight(f"{m}.w1_EFD"), rows_f, rows_h,
                             f"grad/{p}/moe/experts input", GROUPED_WEIGHTS)
    offsets = Step("cumsum of the counts: the offsets", (kept(p, rules.MOE_OFFSETS),))
    w2 = linear(m, ledger.EXPERT_FC2_IN, Made(f"{p}/moe/experts/output", rows_h, "(r, h) bf16"),
                z.weight(f"{m}.w2_EDF"), f"grad/{p}/{m}/dfc2", rows_f, p, frees=(f"grad/{p}/moe/experts/output",),
                dw=f"grad/{p}/{m}/{GROUPED_WEIGHTS['w2']}", label="w2's grouped ")
    return (replace(w1, forward=(offsets, *w1.forward), saves=(rules.MOE_OFFSETS, *w1.saves)), *swiglu,
            *module_returns((w2,), *kept_names(p, ledger.EXPERT_FC2_IN, rules.MOE_OFFSETS)))  # inner_experts returns


def _returned(p: str, z: Sizes, sizes: Slots) -> Op:
    """AllToAllTokenDispatcher's combine (ep > 1) before the local one: the experts' rows put back rank-major
    (_unpermute), then all-to-all to the ranks whose tokens they are; in backward the all-to-all reversed and the
    rows gathered expert-major, w2's gradient."""
    n, g = f"{p}/moe", f"grad/{p}/moe"
    received, rows = z.act * sizes.received * z.h, z.act * sizes.sent * z.h
    return Op("moe.routed_experts", forward=(
        Step("_unpermute: the rows rank-major", (Made(f"{n}/unpermuted", received, "(r/t, h) bf16"),)),
        *_all_to_all(z, f"{n}/returned", rows, "the all-to-all back", "this rank's slots' outputs",
                     "(k*b*s/t, h) bf16", frees=(f"{n}/unpermuted",)),
    ), backward=(
        *_all_to_all(z, f"{g}/returned", received, "the all-to-all's backward", "the received rows' gradient",
                     "(r/t, h) bf16", frees=(f"{g}/experts/returned",)),
        Step("_unpermute's backward: the rows expert-major", (Made(f"{g}/experts/output", received, "bf16"),),
             frees=(f"{g}/returned",)),
    ))


def _combine(p: str, z: Sizes, config: ModelConfig, out: str, dy: str) -> tuple[Op, ...]:
    """The local dispatcher's combine: the output upcast, times its score, cast back, scatter-added to its token
    (`out`); routed_experts returns. In backward its gradient `dy` (under SP all-gathered whole) goes once read. At
    ep > 1 it combines the rows the all-to-all returned (`_returned`)."""
    n, g, sizes = f"{p}/moe", f"grad/{p}/moe", Slots.of(z, config)
    local = config.ep == 1
    r, source = sizes.sent, f"{n}/experts/output" if local else f"{n}/returned"
    full, rows32, rows = z.act * sizes.tokens * z.h, 4 * r * z.h, z.act * r * z.h
    return (
        *(() if local else (_returned(p, z, sizes),)),
        Op("moe.routed_experts", forward=(
            Step("zeros_like(x): scatter_add's target", (Made(f"{n}/zeros", full, "(b*s, h) bf16"),)),
            Step("the output upcast", (kept(p, rules.MOE_EXPERT_OUT),)),
            Step("times the score", (Made(f"{n}/weighted fp32", rows32, "fp32"),),
                 reads_last=kept_names(p, rules.MOE_EXPERT_OUT)),
            Step("cast back", (Made(f"{n}/weighted", rows, "bf16"),),
                 frees=(f"{n}/weighted fp32", *(() if local else (source,)))),
            Step("deterministic_scatter_add: the routed output", (Made(out, full, "(b*s, h) bf16"),),
                 frees=(f"{n}/zeros", f"{n}/weighted")),
            Step("", frees=(f"{n}/experts/output", f"{n}/local counts"),  # routed_experts returns: its locals go
                 reads_last=kept_names(p, rules.MOE_SORTED_SCORES, rules.MOE_TOKEN_INDICES, ledger.EXPERT_IN,
                                       *(() if local else (rules.MOE_PERMUTED_INDICES,)))),  # (in the metadata)
        ), backward=(
            Step("scatter_add's backward: dY at each row's token", (Made(f"{g}/rows", rows, "bf16"),),
                 frees=(dy,) if dy else () if local else (f"{g}/dY copy",)),
            Step("the cast's backward: to fp32", (Made(f"{g}/rows fp32", rows32, "fp32"),), frees=(f"{g}/rows",)),
            Step("the product's backward: dY * score", (Made(f"{g}/dx fp32", rows32, "fp32"),)),
            Step("the product's backward: dY * output", (Made(f"{g}/dscore rows", rows32, "fp32"),),
                 reads_last=kept_names(p, rules.MOE_EXPERT_OUT, rules.MOE_SORTED_SCORES)),
            Step("summed over h: each slot's score gradient", (Made(f"{g}/sorted scores", 4 * r, "fp32"),),
                 frees=(f"{g}/rows fp32", f"{g}/dscore rows"), returns=True),
            Step("the upcast's backward: to bf16", (Made(f"{g}/experts/output" if local else f"{g}/experts/returned",
                                                          rows, "bf16"),), frees=(f"{g}/dx fp32",)),
        ), saves=(rules.MOE_EXPERT_OUT, rules.MOE_SORTED_SCORES)),
        # at ep > 1 routed_experts' local_map hands its body dY contiguous, before any node of it unpacks what it
        # saved: the residual stream's gradient is copied where it is a permuted view (`permuted_stream_grad`)
        *(() if local or not permuted_stream_grad(z) else (Op("moe.routed_experts", forward=(), backward=(
            Step("dY made contiguous at routed_experts' boundary", (Made(f"{g}/dY copy", full, "bf16"),)),)),)),
    )
