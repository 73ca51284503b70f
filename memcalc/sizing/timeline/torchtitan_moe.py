"""torchtitan's MoE feed-forward (models/common/moe.py, ep = 1) as ops for its step walk (`--impl torchtitan`), at t = 1
and under its own MoE sharding plan (tp, tp-sp).

Its Qwen3 MoE decoder layer keeps the torchtitan ledger's tensors (memcalc.model.impls.torchtitan.moe_block), one
storage each for all experts. Forward and backward op by op, checkpointing, and two measured facts the walk follows
without a reason from the source: docs/timeline.md, "torchtitan's MoE".
"""

from __future__ import annotations

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import torchtitan as rules
from memcalc.sizing.timeline.hf_layer import WHY_WGRAD
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names

# GroupedExperts' three (E, ...) parameters, one module's: each weight's gradient is named by its parameter, so that
# FSDP2's walk keeps each as that parameter's unsharded .grad (memcalc.sizing.timeline.torchtitan._keep_grad)
GROUPED_WEIGHTS = {"w1": "w1_EFD", "w2": "w2_EDF", "w3": "w3_EFD"}


def moe_ops(p: str, z: Sizes, config: ModelConfig, x: str, shared: tuple[Op, ...] = ()) -> tuple[Op, ...]:
    """The MoE on ffn_norm's output `x` (under SP gathered at its entry), its output f"{p}/ffn out"; in backward its
    input's gradient is f"grad/{p}/ffn_norm out". `shared`: the shared experts' ops (memcalc.sizing.timeline
    .torchtitan.shared_experts_ops: output f"{p}/moe/shared out" under SP, else the ledger's SHARED_FC2_OUT, input
    gradient f"grad/{p}/moe/shared dX"), which keep `x`; without them `x` goes as the MoE returns.

    Under its TP plan at ep = 1 (set_moe_sharding_config) every rank runs every token through its e/t-wide share of
    each expert: the routed output a partial sum, under SP reduce-scattered as routed_experts returns (and the shared
    experts' as their w2 does), under tp summed with the shared experts' and all-reduced as the MoE returns."""
    n, all_reduced = f"{p}/moe", z.t > 1 and not z.sp
    final = f"{n}/partial" if all_reduced else f"{p}/ffn out"
    routed = f"{n}/routed out" if shared else final
    combined = f"{n}/routed partial" if z.sp else routed
    shared_out = f"{n}/shared out" if z.sp else kept_name(p, rules.SHARED_FC2_OUT)
    summed = Op("moe", forward=(Step("the routed and the shared experts' outputs summed", (
        Made(final, z.seq(z.h), "the MoE's output"),), frees=(routed, shared_out)),), backward=())
    # MoE.forward returns: its locals go (under a checkpoint also the router's scores and ids, and the input; under
    # SP the norm's shard it gathered); under tp its input, which its sharding wrapper holds, after the f*
    held = Step("", frees=() if shared else (x,), reads_last=kept_names(p, rules.MOE_SHARED_IN) if shared else ())
    returned = Op("moe", forward=(Step("", frees=(f"{n}/routing map", f"{n}/counts", f"{n}/router/topk scores",
                                                  *((f"{p}/ffn_norm out",) if z.sp else ())),
                                       reads_last=kept_names(p, rules.MOE_ROUTER_SCORES, ledger.ROUTER_TOPK_INDICES)),
                                  *(() if all_reduced else (held,))), backward=())
    from memcalc.sizing.timeline.torchtitan import reduce_scatter  # the block's module, which imports this one

    dy = f"grad/{n}/dY whole"
    return (*_router(p, z, config, bool(shared)), *_dispatch(p, z, config, bool(shared)), *_experts(p, z, config),
            *_combine(p, z, config, combined, dy if z.sp else ""),
            *(reduce_scatter("moe.routed_experts", z, p, combined, routed, dy, ()) if z.sp else ()),
            *shared, *((summed,) if shared else ()), returned,
            *((*reduce_scatter("moe", z, p, final, f"{p}/ffn out", "", ()), Op("moe", forward=(held,), backward=()))
              if all_reduced else ()))

def _router(p: str, z: Sizes, config: ModelConfig, shared: bool) -> tuple[Op, ...]:
    """TokenChoiceTopKRouter: the fp32 gate, the forced lead, softmax, the bias, top-k and route_norm."""
    n, g, tokens = f"{p}/moe/router", f"grad/{p}/moe/router", z.b * z.s
    e, k = config.num_experts, config.moe_router_topk
    scores, slots = 4 * tokens * e, 4 * tokens * k
    gate = Op("moe.router.gate", forward=(
        Step("autocast: the gate's weight cast to fp32", (kept(p, rules.MOE_ROUTER_WEIGHT),)),
        Step("autocast: its input cast to fp32", (kept(p, rules.MOE_ROUTER_IN),)),
        # the gate returns: the cast input goes, the hook's restored autocast drops its cached fp32 weight
        Step("the fp32 logits", (Made(f"{n}/logits", scores, "(b*s, E) fp32"),),
             reads_last=kept_names(p, rules.MOE_ROUTER_WEIGHT, rules.MOE_ROUTER_IN)),
    ), backward=(
        Step("the gate's fp32 GEMMs: dW and dX", (Made(f"{g}/weight fp32", 4 * e * z.h, "dW = dLogits^T X"),
                                                 Made(f"{g}/input fp32", 4 * tokens * z.h, "dX = dLogits W")),
             frees=(f"{g}/logits",), returns=True),
        Step("the input cast's backward: dX to bf16", (Made(f"{g}/input", z.act * tokens * z.h, "bf16"),)),
        Step("summed with the dispatch's: ffn_norm's output gradient", (
            Made(f"grad/{p}/ffn_norm out", z.act * tokens * z.h, "both paths' summed"),),
            frees=(f"{g}/input", _dispatched(p, shared), f"{g}/input fp32"), moment=False),
        Step("the weight cast's backward: dW to bf16", (Made(f"{g}/weight", z.act * e * z.h, WHY_WGRAD),)),
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
    n, tokens, e, k = f"{p}/moe", z.b * z.s, config.num_experts, config.moe_router_topk
    r = tokens * k
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
        Step("x[indices]: the rows in expert order", (kept(p, ledger.EXPERT_IN),)),
    ), backward=(
        Step("index's backward: zeros", (Made(f"grad/{n}/input zeros", z.act * tokens * z.h, "(b*s, h) bf16"),)),
        Step("index_put: each row's dX at its token", (Made(f"grad/{n}/input put", z.act * tokens * z.h, "bf16"),),
             frees=(f"grad/{n}/input zeros", f"grad/{n}/experts input")),
    ), saves=(rules.MOE_TOKEN_INDICES,))
    return (counts, scores, rows)


def _experts(p: str, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """GroupedExperts: the offsets, then SwiGLU on torch._grouped_mm for every expert at once (each e/t wide under
    TP at ep = 1)."""
    n, g, e, f = f"{p}/moe/experts", f"grad/{p}/moe/experts", config.num_experts, config.expert_ffn // z.t
    r = z.b * z.s * config.moe_router_topk
    rows_f, rows_h, weight = z.act * r * f, z.act * r * z.h, z.act * e * f * z.h

    def gemms(w: str, dy: str, dx: str, dx_bytes: int, frees: tuple[str, ...] = ()) -> Step:
        return Step(f"{w}'s grouped GEMMs: dW and dX", (Made(f"{g}/{GROUPED_WEIGHTS[w]}", weight, WHY_WGRAD),
                                                         Made(dx, dx_bytes, "dX = dY W, per expert")),
                    frees=frees, returns=True)

    return (
        Op("moe.routed_experts.inner_experts", forward=(
            Step("cumsum of the counts: the offsets", (kept(p, rules.MOE_OFFSETS),)),
            Step("w1's grouped GEMM", (kept(p, ledger.EXPERT_GATE),)),
        ), backward=(
            gemms("w1", f"{g}/gate", f"{g}/dx1", rows_h, frees=(f"{g}/gate",)),
            Step("w1's and w3's dX summed", (Made(f"grad/{p}/moe/experts input", rows_h, "bf16"),),
                 frees=(f"{g}/dx1", f"{g}/dx3"), hands_over=(f"{g}/{GROUPED_WEIGHTS['w1']}",)),
        ), saves=(rules.MOE_OFFSETS, ledger.EXPERT_IN)),
        Op("moe.routed_experts.inner_experts", forward=(
            Step("SiLU", (kept(p, ledger.EXPERT_SILU_OUT),), reads_last=kept_names(p, ledger.EXPERT_GATE)),
        ), backward=(
            Step("SiLU's backward", (Made(f"{g}/gate", rows_f, "bf16"),), frees=(f"{g}/silu",)),
        ), saves=(ledger.EXPERT_GATE,)),
        Op("moe.routed_experts.inner_experts", forward=(
            Step("w3's grouped GEMM", (kept(p, ledger.EXPERT_UP),)),
        ), backward=(
            gemms("w3", f"{g}/up", f"{g}/dx3", rows_h, frees=(f"{g}/up",)),
            Step("", hands_over=(f"{g}/{GROUPED_WEIGHTS['w3']}",)),
        )),
        Op("moe.routed_experts.inner_experts", forward=(
            Step("SiLU(w1 x) * w3 x", (kept(p, ledger.EXPERT_FC2_IN),),
                 reads_last=kept_names(p, ledger.EXPERT_SILU_OUT, ledger.EXPERT_UP)),
        ), backward=(
            Step("the product's backward: dY * up", (Made(f"{g}/silu", rows_f, "bf16"),)),
            Step("the product's backward: dY * SiLU", (Made(f"{g}/up", rows_f, "bf16"),), frees=(f"{g}/dh",)),
        ), saves=(ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT)),
        Op("moe.routed_experts.inner_experts", forward=(
            Step("w2's grouped GEMM", (Made(f"{n}/output", rows_h, "(r, h) bf16"),),  # inner_experts returns
                 reads_last=kept_names(p, ledger.EXPERT_FC2_IN, rules.MOE_OFFSETS)),
        ), backward=(
            gemms("w2", f"{g}/output", f"{g}/dh", rows_f, frees=(f"{g}/output",)),
            Step("", hands_over=(f"{g}/{GROUPED_WEIGHTS['w2']}",)),
        ), saves=(ledger.EXPERT_FC2_IN,)),
    )


def _combine(p: str, z: Sizes, config: ModelConfig, out: str, dy: str) -> tuple[Op, ...]:
    """The local dispatcher's combine: the output upcast, times its score, cast back, scatter-added to its token
    (`out`); routed_experts returns. In backward its gradient `dy` (under SP all-gathered whole) goes once read."""
    n, g = f"{p}/moe", f"grad/{p}/moe"
    tokens = z.b * z.s
    r = tokens * config.moe_router_topk
    full, rows32, rows = z.act * tokens * z.h, 4 * r * z.h, z.act * r * z.h
    return (
        Op("moe.routed_experts", forward=(
            Step("zeros_like(x): scatter_add's target", (Made(f"{n}/zeros", full, "(b*s, h) bf16"),)),
            Step("the output upcast", (kept(p, rules.MOE_EXPERT_OUT),)),
            Step("times the score", (Made(f"{n}/weighted fp32", rows32, "fp32"),),
                 reads_last=kept_names(p, rules.MOE_EXPERT_OUT)),
            Step("cast back", (Made(f"{n}/weighted", rows, "bf16"),), frees=(f"{n}/weighted fp32",)),
            Step("deterministic_scatter_add: the routed output", (Made(out, z.full(z.h), "(b*s, h) bf16"),),
                 frees=(f"{n}/zeros", f"{n}/weighted")),
            Step("", frees=(f"{n}/experts/output",),  # routed_experts returns: its locals go
                 reads_last=kept_names(p, rules.MOE_SORTED_SCORES, rules.MOE_TOKEN_INDICES, ledger.EXPERT_IN)),
        ), backward=(
            Step("scatter_add's backward: dY at each row's token", (Made(f"{g}/rows", rows, "bf16"),),
                 frees=(dy,) if dy else ()),
            Step("the cast's backward: to fp32", (Made(f"{g}/rows fp32", rows32, "fp32"),), frees=(f"{g}/rows",)),
            Step("the product's backward: dY * score", (Made(f"{g}/dx fp32", rows32, "fp32"),)),
            Step("the product's backward: dY * output", (Made(f"{g}/dscore rows", rows32, "fp32"),),
                 reads_last=kept_names(p, rules.MOE_EXPERT_OUT, rules.MOE_SORTED_SCORES)),
            Step("summed over h: each slot's score gradient", (Made(f"{g}/sorted scores", 4 * r, "fp32"),),
                 frees=(f"{g}/rows fp32", f"{g}/dscore rows"), returns=True),
            Step("the upcast's backward: to bf16", (Made(f"{g}/experts/output", rows, "bf16"),),
                 frees=(f"{g}/dx fp32",)),
        ), saves=(rules.MOE_EXPERT_OUT, rules.MOE_SORTED_SCORES)),
    )
