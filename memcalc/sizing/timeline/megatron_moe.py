"""megatron-core's MoELayer (impl megatron with num_experts) in the step, as ops for the generic walk.

The MLP of `memcalc.sizing.timeline.megatron.layer_ops` becomes MoELayer as megatron-core 0.16 runs it on the CPU
path (memcalc.probe.libs.megatron_step), keeping the ledger's tensors (memcalc.model.impls.megatron.moe_block). Its
forward, its backward op by op, tp-sp, ep and full recomputation: docs/timeline.md, "Megatron's MoELayer".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.megatron_pieces import (
    GLOBAL_MEMORY_BUFFER, activation, backward_only as _backward, linear, named, one as _one, row_parallel, weight,
)
from memcalc.sizing.timeline.tape import ACTIVATIONS, Sizes, Tape
from memcalc.sizing.timeline.walk import Made, Op, Step

# The ledger's rows an expert keeps in a storage of its own (SequentialMLP runs each expert's MLP on its slots).
PER_EXPERT = (*megatron.EXPERT_ACT, megatron.EXPERT_ACT_OUT, ledger.EXPERT_FC2_IN)
_PER_EXPERT = frozenset(x.name for x in PER_EXPERT)
_WGRAD = "the expert weight's bf16 gradient, dW = dY^T X"

# What the all-to-all dispatcher holds as attributes after its forward, to the next forward (tape names; the walk
# gives each layer's its own): the router's outputs, the tokens per expert, and the permutation's indices, which
# index_select and unpermute's scatter_add_ keep for backward too (a ledger row the dispatcher outlives).
HELD = ("moe/dispatcher probs", "moe/dispatcher routing map", "moe/dispatcher tokens per expert",
        megatron.PERMUTE_INDICES.name)


def unmodelled(config: ModelConfig, z: Sizes) -> str | None:
    """The first thing of a MoE layer on this rank (`z`) the walk does not model yet, in words; None when it models
    the layer."""
    missing = [
        (config.num_experts == 1, "a single routed expert (num_experts 1)"),
        (config.moe_tokens == "balanced" and config.moe_router_topk * z.b * z.s_seq % config.ep != 0,
         f"a rank's k*b*s={config.moe_router_topk * z.b * z.s_seq} slots that ep={config.ep} does not divide under the"
         " balanced bound (each rank would receive other than kbs; --moe-tokens worst is walked)"),
        (z.t > 1 and not z.sp, f"t={z.t} without sequence parallelism with experts"),
        (config.moe_token_dispatcher_type != "alltoall",
         f"the {config.moe_token_dispatcher_type} token dispatcher (it walks the all-to-all one)"),
        (config.moe_expert_capacity_factor is not None, "a capacity factor (moe_expert_capacity_factor)"),
        (config.moe_aux_loss, "the load-balancing loss (moe_aux_loss)"),
        (config.mlp == "swiglu" and config.bias_activation_fusion, "the fused SwiGLU in the experts"),
        (bool(config.vpp) and config.pp > 1, "interleaved pipelining with experts (the other chunks' dispatchers)"),
        (config.moe_tokens == "capacity", "moe_tokens capacity (it walks the balanced and the worst bounds)"),
        (config.moe_router_topk == 1 and bool(config.moe_shared_expert_intermediate_size) and config.recompute == "full"
         and z.t == 1 and config.ep > 1, "top-1 routing beside shared experts under recompute full over ep without tp"
         " (the rerun's unpermute and shared-experts sum after the all-to-all back, measured above the walk)"),
    ]
    return next((what for absent, what in missing if absent), None)


def one_expert(config: ModelConfig) -> bool:
    """One expert a rank (E = ep): SequentialMLP runs it on the dispatched slots themselves, and the dispatcher neither
    sorts them by expert nor keeps the per-expert counts."""
    return config.num_experts == config.ep


def expert_slots(config: ModelConfig, z: Sizes) -> tuple[int, ...]:
    """The slots each local expert receives under the knobs' bound: balanced, the kn/ep slots each rank sends here
    shared by the E/ep experts, the first ones one more (the forced balanced route deals slot m = ik + j of token i
    to rank m mod ep's expert (m div ep) mod E/ep: at ep = 1, (ik + j) mod E); worst, every token's k slots on the
    same k experts, n each and none for the others (the forced all-to-one route)."""
    n, k, local = z.b * z.s_seq, config.moe_router_topk, config.num_experts // config.ep
    ranks = z.t * config.ep  # every rank of the tp*ep group routes as this one, and rank 0 holds experts 0..E/ep-1
    if config.moe_tokens == "worst":
        return tuple(ranks * n if e < k else 0 for e in range(local))
    sent = k * n // config.ep  # what each rank sends this one (`unmodelled`: ep divides kn)
    return tuple(ranks * (sent // local + (e < sent % local)) for e in range(local))


def piece(x: SavedTensor, e: int) -> SavedTensor:
    """Expert e's share of a per-expert ledger row: the ledger's record, named for the expert."""
    return replace(x, name=f"{x.name}[{e}]")


def pieces(config: ModelConfig, z: Sizes, kept: tuple[SavedTensor, ...], saved: dict[str, int]) -> tuple[
        tuple[SavedTensor, ...], dict[str, int]]:
    """The layer's saved tensors with each per-expert row split into its experts' pieces (bytes shared as the slots
    are, `expert_slots`), less those the dispatcher holds beyond backward (`held` makes them); and every tensor's
    bytes by name."""
    slots = expert_slots(config, z)
    out: list[SavedTensor] = []
    sizes = {name: nbytes for name, nbytes in saved.items() if name not in _PER_EXPERT}
    for x in kept:
        if x.name in _PER_EXPERT:  # an expert without tokens keeps nothing
            shares = [(piece(x, e), saved[x.name] * r // sum(slots)) for e, r in enumerate(slots) if r]
            out.extend(y for y, _ in shares)
            sizes.update((y.name, nbytes) for y, nbytes in shares)
        elif x.name not in HELD:  # `held`: the dispatcher holds it beyond backward
            out.append(x)
    return tuple(out), sizes


def held(config: ModelConfig, z: Sizes) -> tuple[Made, ...]:
    """What the dispatcher keeps as attributes after the layer's forward (`HELD`): the router's (n, E) probabilities
    and map, the tokens per local expert (one int64 per expert of the tp*ep group; never set with one expert a rank),
    the permutation's indices."""
    n, experts = z.b * z.s_seq, config.num_experts
    return (
        Made(HELD[0], z.act * n * experts, "the dispatcher's self.probs: the router's (n, E) probabilities"),
        Made(HELD[1], n * experts, "the dispatcher's self.routing_map: the router's (n, E) bool map"),
        *(() if one_expert(config) else (Made(HELD[2], 8 * z.t * experts, "the dispatcher's"
          " self.num_global_tokens_per_local_expert, int64: each local expert's tokens from each rank of the tp*ep"
          " group"),)),
        Made(HELD[3], 0, "the dispatcher's self.reversed_local_input_permutation_mapping (the ledger's row)",
             keeps=megatron.PERMUTE_INDICES),
    )


def beside_the_ledger(tape: Tape, config: ModelConfig, z: Sizes) -> None:
    """Before a MoE layer's forward: under SP its shared experts' fc1 all-gathers its input into megatron's global
    memory buffer, (s, b, h), made in the first step and kept (a tracker started before a step first sees it there);
    latent attention's layers make it first, at their largest request (megatron_mla.beside_the_ledger)."""
    if z.sp and config.moe_shared_expert_intermediate_size and GLOBAL_MEMORY_BUFFER not in tape.live:
        tape.add(GLOBAL_MEMORY_BUFFER, ACTIVATIONS, z.full(z.h), "parallel_state's global memory buffer: the shared"
                 " experts' fc1 all-gathers its input into it")


# What MoELayer.forward's locals hold at the experts' output whether or not autograd keeps it (full recomputation's
# first forward keeps nothing): its input, gone when it returns, and routed_experts_compute's sorted tokens and
# probabilities, gone when that returns (over ep before the all-to-all back).
ROUTED_LOCALS = (ledger.EXPERT_IN, megatron.EXPERT_PROBS)
LOCALS = (ledger.MOE_IN, *ROUTED_LOCALS)


def experts_forward(config: ModelConfig, z: Sizes, before: tuple[Made, ...], gone: tuple[str, ...] = (),
                    rerun: bool = False) -> tuple[Op, ...]:
    """The MoE's widest forward moments as ops, in forward order: `before`, what the layer has made by then that lives
    on (every saved tensor but the MLP's dropout mask); `gone`, what of it goes when MoELayer returns. `rerun`: inside
    full recomputation's backward, as backward steps, in the MoE's activations; the dispatcher's attributes are
    replaced there by as many bytes, not made beside them.

    By the experts' concatenated output MoELayer.forward still holds the dispatcher's attributes (`held`), the
    permuted tokens and probabilities (the sort made copies; at t > 1 the all-gathered copies are gone by then, the
    token counts summed over the group not yet), each expert's fc2 output and their concatenation. Without exchanges
    the unsort's concatenation that follows replaces the experts' outputs with as many bytes (MemTracker's peak is
    the first); with them (`_combine`) a copy of the unsort's chunk sizes comes beside it, and at t > 1 the
    reduce-scatter of the unsorted output adds this rank's share beside both concatenations. One expert a rank
    (`one_expert`) runs on the dispatched slots themselves: its fc2's output is the widest moment, sent back unsorted.
    """
    act, local = z.act, config.moe_router_topk * z.b * z.s_seq
    slots = sum(expert_slots(config, z))  # what this rank's experts receive: all-gathered over t, all-to-all over ep
    exchanged, one = z.t > 1 or config.ep > 1, one_expert(config)
    mine = ACTIVATIONS if rerun else ""  # what MoELayer makes: activations in the rerun too
    dispatched = (
        Made("moe/permuted tokens", act * local * z.h, "permute's index_select: MoELayer.forward holds it"),
        *((Made("moe/permuted probs", act * local, "permute's masked_select of the probabilities, held likewise"),)
          if config.ep == 1 else (
            Made("moe/dispatched tokens", act * slots // z.t * z.h, "the all-to-all's output over ep: MoELayer.forward"
                 " holds it beside the permuted tokens, (R/t, h) (at t > 1 all-gathered to R)"),
            Made("moe/dispatched probs", act * slots // z.t, "the probabilities' all-to-all output, which replaces the"
                 " permuted ones"))),
    )
    if one and z.t == 1:  # the last of them is the expert's own input: the ledger's EXPERT_IN and EXPERT_PROBS
        dispatched = dispatched[:1] if config.ep > 1 else ()
    held_by_forward = tuple(replace(x, category=mine) for x in (
        *dispatched,
        *((Made("moe/tokens per expert", 8 * config.num_experts // config.ep, "the experts' token counts summed over"
                " the tp*ep group's ranks, int64"),) if exchanged else ()),
        *((Made("moe/shared experts output", z.seq(z.h), "the shared experts ran first: their output waits for the"
                " routed experts'"),) if config.moe_shared_expert_intermediate_size else ()),
        Made("moe/experts output", act * slots * z.h, "the expert's fc2 output, (R, h)" if one else
             "SequentialMLP's cat of its experts' outputs, (R, h)"),
    ))
    outputs = () if one else (Made("moe/expert outputs", act * slots * z.h, "each expert's fc2 output, SequentialMLP's"
                                   " list, (R, h)", category=mine),)
    fc2_in = piece(ledger.EXPERT_FC2_IN, 0)  # one expert's, a local of its forward at its output (full's first)
    local_in = (Made(fc2_in.name, 0, "the expert's fc2 input, held until it returns", keeps=fc2_in),) if one and gone \
        else ()
    returned = (*(x.name for x in held_by_forward), *gone)
    widest = Step("the expert's output" if one else "the experts' outputs concatenated", (
        *before, *local_in, *(() if rerun else held(config, z)), *held_by_forward, *outputs),
        frees=tuple(x.name for x in (*outputs, *local_in)))
    # at t = 1 one expert's input is MoELayer.forward's: it lives to its end
    routed = tuple(x.name for x in ROUTED_LOCALS if x.name in gone and not (one and z.t == 1))
    walked = rerun or config.recompute != "full"  # full recomputation's first forward: not these bytes
    returns = _combine(config, z, slots, local, returned, routed, mine) if exchanged else (
        *(_postprocess(config, z, slots, mine) if walked else ()), Step("MoELayer's forward returns", frees=returned))
    steps = (("mlp.experts.local_experts.0.linear_fc2" if one else "mlp.experts", (widest,)), ("mlp", returns))
    return tuple(Op(where, forward=() if rerun else x, backward=x if rerun else ()) for where, x in steps)


def _unsorted(z: Sizes, slots: int, category: str) -> Made:
    """sort_chunks_by_idxs's output: the experts' output back in the tokens' order."""
    return Made("moe/unsorted output", z.act * slots * z.h, "sort_chunks_by_idxs back to the tokens' order, (R, h)",
                category=category)


def _postprocess(config: ModelConfig, z: Sizes, slots: int, category: str) -> tuple[Step, ...]:
    """Without exchanges, after the experts' output: the unsort's concatenation replaces it (as many bytes), then
    unpermute's zeroed (n, h) output and, with shared experts, MoELayer.postprocess's sum of it and their output
    (megatron/core/transformer/moe/moe_utils.py unpermute, moe_layer.py postprocess), the permuted tokens still held:
    a moment of its own, above the experts' concatenation at k = 1 with shared experts. Both go before MoELayer
    returns (the sum is its output, which the layer's walk counts from there). Not walked in full recomputation's
    first forward, which keeps nothing for autograd (measured: not these bytes there)."""
    n, shared = z.b * z.s_seq, bool(config.moe_shared_expert_intermediate_size)
    made = (Made("moe/unpermuted output", z.act * n * z.h, "unpermute's zeros, scatter_add_'s output, (n, h)",
                 category=category),
            *((Made("moe/output", z.act * n * z.h, "postprocess: the unpermuted output plus the shared experts'",
                    category=category),) if shared else ()))
    return (Step("the experts' output unsorted", (_unsorted(z, slots, category),), frees=("moe/experts output",)),
            Step("unpermute's output" + (", the shared experts' added" if shared else ""), made,
                 frees=(*(x.name for x in made), "moe/unsorted output")))


def _combine(config: ModelConfig, z: Sizes, slots: int, local: int, returned: tuple[str, ...],
             routed: tuple[str, ...], category: str) -> tuple[Step, ...]:
    """The unsorted output (one expert's own) sent back: reduce-scattered over t (the experts' output and the token
    counts still live), then over ep all-to-all'd back to the tokens' ranks (the experts' output, the token counts,
    `routed` (what of `ROUTED_LOCALS` autograd does not keep) and at t > 1 the unsorted output gone first); then what
    MoELayer held (`returned`) goes."""
    act, h, one = z.act, z.h, one_expert(config)
    unsorted = _unsorted(z, slots, category)
    order = Made("moe/unsort order", 8 * z.t * config.num_experts, "num_global_tokens_per_local_expert.T.ravel():"
                 " the unsort's chunk sizes, a copy (int64)", category=category)
    steps = [] if one else [Step("the experts' output unsorted", (order, unsorted), frees=(order.name,))]
    # one expert's output is sent back as it is: nothing to unsort
    sent, sending = ("the expert's output", "moe/experts output") if one else ("the unsorted output", unsorted.name)
    if z.t > 1:
        steps.append(Step(f"{sent} reduce-scattered over t", (Made(
            "moe/reduce-scattered output", act * slots // z.t * h, "the reduce-scatter's output: this rank's share",
            category=category),)))
    if config.ep > 1:
        steps += [
            Step("the experts' output and the token counts freed", frees=(
                *(() if one else ("moe/experts output",)), "moe/tokens per expert", *routed,
                *((sending,) if z.t > 1 else ()))),
            Step(f"{sent} all-to-all'd back over ep", (Made(
                "moe/all-to-all output", act * local * h, "the all-to-all's output: this rank's tokens' slots",
                category=category),)),
        ]
    return (*steps[:-1], replace(steps[-1], frees=(*steps[-1].frees, *returned, sending,
                                                    "moe/reduce-scattered output", "moe/all-to-all output")))


def _exchanges(config: ModelConfig, z: Sizes, slots: int) -> tuple[tuple[str, int], ...]:
    """The dispatch's collectives in forward order, each with the slots its output holds: the all-to-all over ep (R/t,
    what this rank's experts receive of its tp group's tokens), the all-gather over t (R). The combine's backward
    runs them in this order too; the dispatch's backward the other way, each output back to its input's slots."""
    return (*((("all-to-all", slots // z.t),) if config.ep > 1 else ()), *((("all-gather", slots),) if z.t > 1 else ()))


def moe_ops(ops: list[Op], config: ModelConfig, z: Sizes, grad: str, residual: str) -> str:
    """MoELayer's backward, appended to `ops` in backward order, from its output's gradient `grad` (freed by the
    unpermute unless it is the residual stream's, `residual`) to its input's; returns that gradient's name."""
    act, h, n, k = z.act, z.h, z.b * z.s_seq, config.moe_router_topk
    shared = bool(config.moe_shared_expert_intermediate_size)  # the shared experts read dY after the routed ones
    local = k * n  # the slots of this rank's tokens
    slots = sum(expert_slots(config, z))  # and those this rank's experts receive
    ops.append(_one("mlp", "unpermute: scatter_add_'s backward gathers dY", Made(
        "grad/unpermuted", act * local * h, "scatter_add_'s backward: dY gathered by the permutation"),
        () if grad == residual or shared else (grad,)))  # its indices: the dispatcher holds them (HELD)
    unpermuted = "grad/unpermuted"
    for how, rows in _exchanges(config, z, slots):  # the combine's collectives' backward
        ops.append(_one("mlp", f"dY's {how} (the combine's backward)", Made(
            f"grad/unpermuted {how}", act * rows * h, "the experts' output was sent back: its gradient too"),
            (unpermuted,)))
        unpermuted = f"grad/unpermuted {how}"
    if one_expert(config):  # no sort: the expert's gradients are the dispatched slots' own
        _expert(ops, config, z, 0, slots, unpermuted)
        probs, tokens = "grad/expert probs[0]", "grad/expert input[0]"
    else:
        _experts(ops, config, z, unpermuted, slots)
        probs, tokens = "grad/permuted probs", "grad/sorted tokens"
    hops = _exchanges(config, z, slots)[::-1]  # the dispatch's collectives' backward: each to its input's slots
    for (how, _), rows in zip(hops, (*(x for _, x in hops[1:]), local)):
        ops.append(_backward("mlp", Step(f"{how}'s backward: the probabilities' gradient", (Made(
            f"{probs} {how}", act * rows, "the probabilities were dispatched: their gradient sent back"),),
            frees=(probs,)), Step(f"{how}'s backward: the tokens' gradient", (Made(
                f"{tokens} {how}", act * rows * h, "the tokens were dispatched: their gradient sent back"),),
                frees=(tokens,))))
        probs, tokens = f"{probs} {how}", f"{tokens} {how}"
    _permute(ops, z, n, config.num_experts, tokens, probs)
    _router(ops, config, z, n, "grad/moe routed input" if shared else "grad/moe input")
    if shared:
        _shared(ops, config, z, grad, residual)
    return "grad/moe input"


def _experts(ops: list[Op], config: ModelConfig, z: Sizes, grad: str, slots: int) -> None:
    """SequentialMLP's experts' backward from the unsorted output's gradient `grad`: the unsort's concatenation, each
    expert (the last first), the concatenations of their gradients and the sort's."""
    act, h, experts = z.act, z.h, config.num_experts // config.ep
    ops.append(_one("mlp", "unsort: split's backward concatenates", Made(
        "grad/expert output", act * slots * h, "sort_chunks_by_idxs split the experts' output: its gradient"
        " concatenated"), (grad,)))
    received = expert_slots(config, z)
    for e in reversed(range(experts)):  # the last first; one between two of as many slots: its net change alone
        if 0 < e < experts - 1 and received[e - 1] == received[e] == received[e + 1]:
            ops.append(_between(z, e, received[e]))
        else:
            _expert(ops, config, z, e, received[e], "grad/expert output")
    ops.extend((
        # MemTracker still has the first expert's fc1 active here (and the experts for the sort's probabilities)
        _one("mlp.experts.local_experts.0.linear_fc1", "the experts' probability gradients concatenated", Made(
            "grad/expert probs", act * slots, "SequentialMLP split the probabilities: their gradients concatenated"),
            tuple(f"grad/expert probs[{e}]" for e in range(experts))),
        _one("mlp.experts", "the experts' input gradients concatenated", Made(
            "grad/expert input", act * slots * h, "SequentialMLP split its input: the gradients concatenated"),
            tuple(f"grad/expert input[{e}]" for e in range(experts))),
        _one("mlp.experts", "sort's split backward: the probabilities' gradient", Made(
            "grad/permuted probs", act * slots, "sort_chunks_by_idxs split the probabilities: concatenated again"),
            ("grad/expert probs",)),
        _one("mlp", "sort's split backward: the tokens' gradient", Made(
            "grad/sorted tokens", act * slots * h, "sort_chunks_by_idxs split the tokens: concatenated again"),
            ("grad/expert input",)),
    ))


def _expert(ops: list[Op], config: ModelConfig, z: Sizes, e: int, r: int, grad: str) -> None:
    """Expert e's backward on its r slots of the output gradient `grad` (freed by the last, expert 0): fc2's GEMMs,
    the probability's product, the activation, fc1's GEMMs."""
    where, tag, act, fe = f"mlp.experts.local_experts.{e}", f"expert ...[{e}]", z.act, config.expert_ffn // z.t
    dx2, dw2, dact, product = (named(tag, x) for x in ("fc2 input", "fc2 weight", "act", "probs product"))
    ops.append(_backward(f"{where}.linear_fc2", Step("GEMMs: dX and dW", (
        Made(dx2, act * r * fe, "dX = dY W, fc2's input gradient"),
        Made(dw2, weight(z, "mlp.experts.local_experts.*.linear_fc2"), _WGRAD)),
        frees=(grad,) if e == 0 else (), hands_over=(dw2,)), saves=(piece(ledger.EXPERT_FC2_IN, e),)))
    ops.append(_backward(
        where,
        Step("activation * probs: dY * probs", (Made(dact, act * r * fe, "the product's gradient: dY * probs"),)),
        Step("activation * probs: dY * activation", (Made(product, act * r * fe, "dY * activation, (r, f_e)"),)),
        Step("summed over the columns: the probability's gradient", (Made(
            f"grad/expert probs[{e}]", act * r, "the probability's gradient: dY * activation summed, (r, 1)"),),
            frees=(product, dx2)),
        saves=(piece(megatron.EXPERT_ACT_OUT, e), megatron.EXPERT_PROBS)))
    out = activation(ops, config, z, where, tag, tuple(piece(x, e) for x in megatron.EXPERT_ACT), r, fe, dact)
    dw1 = named(tag, "fc1 weight")
    ops.append(_backward(f"{where}.linear_fc1", Step("GEMMs: dX and dW", (
        Made(named(tag, "input"), act * r * z.h, "dX = dY W, the input's gradient"),
        Made(dw1, weight(z, "mlp.experts.local_experts.*.linear_fc1"), _WGRAD)),
        frees=(out,), hands_over=(dw1,)), saves=(ledger.EXPERT_IN,)))


def _between(z: Sizes, e: int, r: int) -> Op:
    """Expert e's backward when the experts walked just before and after it receive as many slots: the same steps on
    the same sizes, so its moments lie on the line between theirs (one expert's net change apart) and the highest of
    them is one of theirs; walked as what it leaves, its input's and probability's gradients, without a moment (a
    MoE layer of hundreds of experts walks in a fraction of the time). Its saved pieces go as it returns."""
    return _backward(f"mlp.experts.local_experts.{e}", Step("the expert's backward, between its neighbours'", (
        Made(f"grad/expert input[{e}]", z.act * r * z.h, "dX = dY W, the expert's input gradient"),
        Made(f"grad/expert probs[{e}]", z.act * r, "the probability's gradient: dY * activation summed, (r, 1)")),
        moment=False), saves=(*(piece(x, e) for x in PER_EXPERT), megatron.EXPERT_PROBS, ledger.EXPERT_IN))


def _shared(ops: list[Op], config: ModelConfig, z: Sizes, grad: str, residual: str) -> None:
    """SharedExpertMLP's backward, megatron's MLP on every token: its row-parallel fc2 from the MoE output's gradient
    `grad` (under SP all-gathered first; freed unless the residual stream's, `residual`), the activation, its
    column-parallel fc1 (under SP on the gathered MoE input, dX reduce-scattered), and the sum of its dX with the
    routed path's into "grad/moe input" (under tp inside fc1's node, before its weight's gradient is handed over)."""
    width, where, tag = config.moe_shared_expert_intermediate_size // z.t, "mlp.shared_experts", "shared ..."
    dx2, dx = named(tag, "fc2 input"), named(tag, "input")
    ops.append(row_parallel(z, f"{where}.linear_fc2", ledger.SHARED_FC2_IN, grad, residual, width, dx2))
    out = activation(ops, config, z, where, tag, megatron.SHARED_ACT, z.b * z.s, width, dx2)
    summed = Step("the routed and the shared experts' input gradients summed", (Made(
        "grad/moe input", z.seq(z.h), "the MoE input feeds the router, the permute and the shared experts: gradients"
        " summed"),), frees=("grad/moe routed input", dx))
    ops.append(linear(z, f"{where}.linear_fc1", ledger.MOE_IN, out, z.h, dx, then=summed if z.t > 1 else None))
    if z.t == 1:  # the two gradients meet after fc1's node and its weight's gradient
        ops.append(_backward(f"{where}.linear_fc1", summed))


def _permute(ops: list[Op], z: Sizes, n: int, experts: int, tokens: str, probs: str) -> None:
    """The dispatcher's permute, backward: index_select's (the tokens' gradient `tokens`) and masked_select's (the
    probabilities', `probs`)."""
    ops.extend((
        _into_zeros("mlp", "index_select", Made(
            "grad/permute input", z.act * n * z.h, "index_add of the sorted tokens' gradient, out of place"), tokens,
            start="new_zeros", fill="index_add", zeros="grad/permute zeros", shape="(n, h)"),  # its indices: HELD
        _into_zeros("mlp", "masked_select", Made(
            "grad/probs", z.act * n * experts, "masked_scatter of the permuted probabilities' gradient"), probs,
            start="zeros_like", fill="masked_scatter", zeros="grad/probs zeros", shape="(E, n)",
            saves=(megatron.ROUTING_MAP, megatron.PROBS_T)),
    ))


def _into_zeros(where: str, what: str, out: Made, grad: str, *, start: str, fill: str, zeros: str, shape: str,
                saves: tuple[SavedTensor, ...] = ()) -> Op:
    """An indexing op's backward: zeros of its input's `shape` (as many bytes as `out`) made by `start`, then `grad`
    put into them by `fill`, making `out`."""
    return _backward(where, Step(f"{what}'s backward: {start}", (Made(
        zeros, out.bytes, f"{what}'s backward starts from {start}, {shape}"),)),
        Step(f"{what}'s backward: {fill}", (out,), frees=(zeros, grad)), saves=saves)


def _router(ops: list[Op], config: ModelConfig, z: Sizes, n: int, out: str) -> None:
    """TopKRouter's backward: scatter's gather; the scores' backward (`_scores`); the GEMMs, and the sum of the
    router's dX with the permute's (`out`)."""
    act, k = z.act, config.moe_router_topk
    ops.append(_one("mlp.router", "scatter's backward: the chosen probabilities' gradient", Made(
        "grad/topk probs", act * n * k, "scatter's backward gathers the k chosen columns, (n, k)"),
        ("grad/probs",), saves=(ledger.ROUTER_TOPK_INDICES,)))
    ops.extend(_scores(config, z, n, "grad/topk probs", "grad/router logits"))
    ops.append(_backward(
        "mlp.router",
        Step("GEMMs: dX and dW", (
            Made("grad/router input", act * n * z.h, "dX = dY W, the router's input gradient"),
            Made("grad/router weight", weight(z, "mlp.router"), "the router weight's bf16 gradient")),
            frees=("grad/router logits",), returns=True),
        Step("the router's and the permute's input gradients summed", (Made(
            out, act * n * z.h, "the MoE input feeds the router and the permute: gradients summed"),),
            frees=("grad/router input", "grad/permute input"), hands_over=("grad/router weight",)),
        saves=(ledger.MOE_IN,)))


def _scores(config: ModelConfig, z: Sizes, n: int, grad: str, out: str) -> tuple[Op, ...]:
    """topk_routing_with_score_function's backward, from the k chosen probabilities' gradient `grad` to the logits'
    (`out`): the fp32 softmax over the top k's logits with its casts, then top-k's scatter (pre-softmax: top-k's
    first, then the casts and the softmax over all E); or, for the sigmoid router, the renormalisation's division
    (k > 1), top-k's scatter (with the expert bias gather's), the casts and the sigmoid over all E."""
    experts, k = config.num_experts, config.moe_router_topk
    if config.moe_router_score_function == "sigmoid":  # the chosen scores renormalised (k > 1), top-k, the sigmoid
        renormalised = _renormalised(z, n, k, grad) if k > 1 else ()
        return (*renormalised, _topk(z, n, experts, "grad/topk scores" if k > 1 else grad, "grad/all scores",
                                     config.moe_router_enable_expert_bias),
                *_casts(z, n * experts, "grad/all scores", out, "sigmoid", megatron.SIGMOID_SCORES))
    if config.moe_router_pre_softmax:  # softmax over E, cast down, top-k
        return (_topk(z, n, experts, grad, "grad/all probs"),
                *_casts(z, n * experts, "grad/all probs", out, "softmax", megatron.ALL_PROBS))
    # top-k of the logits, cast up, softmax over k
    return (*_casts(z, n * k, grad, "grad/topk logits", "softmax", megatron.TOPK_PROBS),
            _topk(z, n, experts, "grad/topk logits", out))


def _renormalised(z: Sizes, n: int, k: int, grad: str) -> tuple[Op, ...]:
    """The sigmoid router's probabilities, the k chosen scores / (their sum + 1e-20), backward from `grad` to the
    chosen scores' gradient ("grad/topk scores"): DivBackward0 makes the divisor's gradient first, -dY * ((scores /
    d) / d) with its three temporaries live until the expression ends, then the dividend's, dY / d; autograd sums the
    divisor's to its (n, 1) after the node returns; the sum's backward expands it (a view), added to the dividend's
    into a new tensor."""
    chosen, wide = z.act * n * k, "grad/topk divisor (n, k)"
    parts = {"grad/topk scores / d": "scores / d", "grad/topk scores / d^2": "(scores / d) / d", "grad/-dY": "-dY"}
    return (
        _backward(
            "mlp.router",
            Step("the division's backward: the divisor's gradient", (
                *(Made(name, chosen, f"the divisor's gradient, -dY * ((scores / d) / d): {why}")
                  for name, why in parts.items()),
                Made(wide, chosen, "the divisor's gradient before autograd sums it to the divisor's shape")),
                frees=tuple(parts)),
            Step("the division's backward: the dividend's gradient", (Made(
                "grad/topk quotient", chosen, "dY / d, the chosen scores' gradient as the dividend"),)),
            Step("the divisor's gradient summed to its shape", (Made(
                "grad/topk denominator", z.act * n, "autograd sums the divisor's (n, k) gradient to its (n, 1)"),),
                frees=(wide, grad), returns=True),
            saves=(megatron.TOPK_SCORES, megatron.TOPK_DENOMINATOR)),
        _one("mlp.router", "the sum's backward: the divisor's gradient added to the dividend's", Made(
            "grad/topk scores", chosen, "the chosen scores feed the division twice (dividend, and divisor through the"
            " sum): autograd adds the two gradients into a new tensor"),
            ("grad/topk quotient", "grad/topk denominator")),
    )


_SCORE_BACKWARD = {"softmax": "softmax's backward in fp32: S' * (dY - sum(dY * S'))",
                   "sigmoid": "sigmoid's backward in fp32: dY * S(1 - S), read from its output S"}


def _casts(z: Sizes, elements: int, grad: str, out: str, what: str, keeps: SavedTensor) -> tuple[Op, ...]:
    """The scores' cast down, the fp32 softmax or sigmoid (`what`) and the logits' cast up, backward, over
    `elements`; in fp32 the casts are no-ops, and autograd has none to run."""
    if z.act == 4:
        return (_one("mlp.router", what, Made(out, 4 * elements, _SCORE_BACKWARD[what]), (grad,), saves=(keeps,)),)
    return (
        _one("mlp.router", "the cast down's backward", Made(
            f"{grad} fp32", 4 * elements, "the probabilities were cast from fp32: the gradient cast up"), (grad,)),
        _one("mlp.router", what, Made(f"{out} fp32", 4 * elements, _SCORE_BACKWARD[what]), (f"{grad} fp32",),
             saves=(keeps,)),
        _one("mlp.router", "the cast up's backward", Made(
            out, z.act * elements, "the logits were cast to fp32: the gradient cast down"), (f"{out} fp32",)),
    )


def _topk(z: Sizes, n: int, experts: int, grad: str, out: str, biased: bool = False) -> Op:
    """top-k's backward (`biased`: the expert bias's, gather's by the biased top-k's indices, which keeps every
    expert's score): new_zeros, and the k values' gradient scattered (added) into it, (n, E)."""
    what = "gather" if biased else "top-k"
    scattered = Made(out, z.act * n * experts, "the k values' gradient scattered into (n, E)")
    fill = "scatter_add" if biased else "scatter"
    return _into_zeros("mlp.router", what, scattered, grad, start="new_zeros", fill=fill, zeros="grad/topk zeros",
                       shape="(n, E)",
                       saves=(*((megatron.BIASED_CHOICE_SCORES,) if biased else ()), ledger.ROUTER_TOPK_INDICES))
