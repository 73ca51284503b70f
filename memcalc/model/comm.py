"""The communication ledger: every collective a layer's f, f*, g, g* issue, and the bytes each rank sends.

Derived from the implementation's TP plan (memcalc.model.tp_plan), beside the
activation ledger. A tensor-parallel block enters its column/row-parallel pair
at a colwise module and leaves it at a rowwise one, through one conjugate pair
of operators (SEED.md section 4), and each operator's forward and backward is a
collective (or nothing):

    f  (enter, tp)      forward -                 backward all-reduce of dX
    f* (leave, tp)      forward all-reduce of Y   backward -
    g  (enter, tp-sp)   forward all-gather of X   backward reduce-scatter of dX
    g* (leave, tp-sp)   forward reduce-scatter    backward all-gather of dY

Under SP, Megatron's column-parallel linear keeps only its input's sequence
shard, so its backward all-gathers the input once more to form dW = X^T dY (the
seed's overlapped re-gather); a plan whose colwise module keeps the gathered
input (torchtitan's DTensor plan) skips it. Full recomputation reruns the
forward in backward, collectives included. Every collective of a dense layer
moves a (b, s, h) tensor of the activation dtype.

A MoE layer (megatron-core's MoELayer, the all-to-all token dispatcher) keeps
attention's collectives and trades the MLP's for the dispatcher's (`_experts`):
int64 token counts, and the routed slots (r, the ledger's bound) exchanged over
the ep ranks of the expert-parallel group, gathered and reduce-scattered over t.
transformers' experts sum the ranks' partial outputs instead (`_summed_experts`),
and megatron-core's latent attention gives each projection its own collectives,
moving its latent's width (`_latent`); torchtitan's is a pair like any, entered
once at x, which its plan gathers and its colwise up projections keep (its down
projections and latent norms are replicated: their weights' partial gradients
are left to FSDP, as the SP norms' are).

Bytes one rank sends under the ring algorithm, for a tensor of n bytes over a
group of t ranks: all-reduce 2(t-1)/t * n, all-gather and reduce-scatter
(t-1)/t * n each (a rank receives as much as it sends); an all-to-all sends
(t-1)/t of what it hands in, one part to each other rank, when the parts are even.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from fractions import Fraction
from math import prod
from typing import TYPE_CHECKING, Any

from memcalc.errors import ConfigError
from memcalc.model.evaluate import check_strategy, dim_sizes, routers
from memcalc.model.impls import implementation, plan
from memcalc.model.impls.hf import resid_dropout, routing_weights_kind
from memcalc.model.knobs import DTYPE_BYTES, FIXED_BYTES, Knobs
from memcalc.model.ledger import BSH, Dim, Kind
from memcalc.model.strategy import Strategy
from memcalc.model.tp_plan import ATTENTION, MOE, SHARED, Pair, Rule, Style, TPPlan

if TYPE_CHECKING:
    from memcalc.config.schema import ModelConfig


class Op(Enum):
    """A collective, and the share of its tensor one rank sends under the ring algorithm."""

    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"  # each rank keeps 1/n of what it holds and sends the rest, one part to each other rank
    SEND = "send"  # one point-to-point message of an overlapped ring
    RECV = "recv"  # its partner: what arrives (received bytes are not counted as sent)

    def share(self, t: int) -> Fraction:
        """Bytes one of t ranks moves, as a fraction of the tensor (or message) the call names (an all-to-all's:
        the tensor it hands in, evenly split)."""
        if self in (Op.SEND, Op.RECV):
            return Fraction(1)
        steps = Fraction(t - 1, t)
        return 2 * steps if self is Op.ALL_REDUCE else steps


class Group(Enum):
    """The ranks a collective runs over; the value is its size in symbols."""

    TP = "t"  # the tensor-parallel group (= the expert tensor-parallel group: memcalc models etp = t)
    EP = "ep"  # the expert-parallel group
    TP_EP = "t*ep"  # both: megatron's tp_ep group, which shares the token counts

    def size(self, t: int, ep: int) -> int:
        return {Group.TP: t, Group.EP: ep, Group.TP_EP: t * ep}[self]


class Count(Enum):
    """How much of its shape's tensor a call names, before the op's share."""

    WHOLE = "the whole tensor"
    SHARD = "one tensor-parallel rank's 1/t of it"  # the routed slots one rank's own tokens make, before the gather
    EACH = "one from each rank of the group"  # a gathered tensor: every rank's piece of this shape

    def factor(self, t: int, ranks: int) -> Fraction:
        return {Count.WHOLE: Fraction(1), Count.SHARD: Fraction(1, t), Count.EACH: Fraction(ranks)}[self]


@dataclass(frozen=True)
class Collective:
    """One collective of one layer: which operator issues it, when, what it moves, and why."""

    name: str  # block/operator, e.g. "attention/g*"
    operator: str  # the seed's f, f*, g, g* (or "all-to-all", the dispatcher's self-conjugate exchange)
    op: Op
    phase: str  # "forward" or "backward"
    moves: str
    shape: tuple[Dim, ...]  # the whole tensor, before any split
    why: str
    piece: Fraction = Fraction(1)  # the part of that tensor this call moves (a ring message, a pipelined chunk)
    group: Group = Group.TP
    count: Count = Count.WHOLE
    kind: Kind = Kind.ACTIVATION  # what decides its element width: the activation dtype, or int64 token counts


# The seed's operators at a pair's ends, under tp (False) and tp-sp (True): a colwise module's entry f or g, a rowwise
# module's exit f* or g*, and SP's re-gather. Each collective: op, pass, what it moves ({}: the tensor there), why.
_OPERATORS: dict[tuple[str, bool], tuple[str, tuple[tuple[Op, str, str, str], ...]]] = {
    ("enter", False): ("f", ((Op.ALL_REDUCE, "backward", "the gradient of {}",
                              "each rank computed dX from its own columns: the partial sums are added"),)),
    ("enter", True): ("g", ((Op.ALL_GATHER, "forward", "{} (sequence shards)",
                             "the column-parallel linear needs every token of its input"),
                            (Op.REDUCE_SCATTER, "backward", "the gradient of {}",
                             "each rank's partial dX is summed and handed back as its sequence shard"))),
    ("leave", False): ("f*", ((Op.ALL_REDUCE, "forward", "{}",
                               "each rank holds a partial sum of the row-parallel output"),)),
    ("leave", True): ("g*", ((Op.REDUCE_SCATTER, "forward", "{}",
                              "the row-parallel partial sums are added and split back into sequence shards"),
                             (Op.ALL_GATHER, "backward", "the gradient of {}",
                              "the row-parallel linear's backward needs dY for every token"))),
    ("regather", True): ("g", ((Op.ALL_GATHER, "backward", "{} again", "only the input's sequence shard was kept:"
                                " dW = X^T dY needs it whole (the seed's re-gather)"),)),
}


_LEAVES = ("f*", "g*")  # the operators at a pair's exit


def _operator(block: str, end: str, sequence_parallel: bool, what: str,
              shape: tuple[Dim, ...] = BSH) -> tuple[list[Collective], list[Collective]]:
    """The collectives of the operator at one end of a pair (`_OPERATORS`), moving `what` of `shape`: (forward,
    backward)."""
    name, calls = _OPERATORS[end, sequence_parallel]
    made = [Collective(f"{block}/{name}", name, op, phase, moves.format(what), shape, why)
            for op, phase, moves, why in calls]
    return [c for c in made if c.phase == "forward"], [c for c in made if c.phase == "backward"]


def layer_collectives(
    knobs: Any, strategy: Strategy, overlap: frozenset[str] = frozenset(), t: int = 1, splits: int = 4, ep: int = 1
) -> tuple[Collective, ...]:
    """Every collective one layer issues per micro-batch, forward then backward, as the implementation runs it.

    `overlap` (tp-sp) names the methods that cut a forward collective into pieces
    (memcalc.model.overlap): ring-ag and ring-rs into t-1 ring hops of one
    sequence chunk, pipelined-rs into `splits` reduce-scatters. Backward is
    unchanged. `t` matters only to the rings (how many hops). `ep`: a MoE
    layer's expert-parallel size; its all-to-alls run only when ep > 1, and then
    under `none` too.
    """
    if not strategy.tensor_parallel and not (knobs.moe and ep > 1):
        return ()
    plan(knobs, strategy)  # refuses a layout the implementation does not run
    impl = implementation(knobs)
    tp_plan, sp = impl.tp_plan(knobs), strategy.sequence_parallel
    routes_shards = knobs.moe and ep > 1 and not any(r.style is Style.EXPERTS for r in tp_plan.rules)
    if routes_shards and not sp and knobs.t > 1:
        raise ConfigError(f"impl {knobs.impl}: ep={ep} under {strategy.name}: its MoE slices the replicated input"
                          " there, whose collectives are not measured (tp-sp, ep = t is)")
    if knobs.mla and overlap:
        raise ConfigError(f"kv_lora_rank={knobs.kv_lora_rank}: tp_comm_overlap with latent attention is not modelled")
    pairs = tp_plan.pairs() if strategy.tensor_parallel else {}
    shared_style = pairs.pop(SHARED, None)  # MoELayer's shared experts: issued inside its block, not cut by overlap
    shared = _dense(SHARED, tp_plan.ends(SHARED), sp, frozenset(), 1, 1) if shared_style else ([], [])
    # megatron-core's latent attention, whose down projections are column-parallel and gather their outputs, enters
    # at each projection (`_latent`); torchtitan's replicates its down projections and gathers x once at the
    # attention's entry, kept by its colwise up projections: a pair like any
    downs_gathered = any(r.style is Style.COLWISE_GATHER_OUTPUT and r.pair is None for r in tp_plan.rules)
    if routes_shards and knobs.t == 1:  # ep over the FSDP2 ranks: no TP pair runs, the MoE's exchange alone
        blocks = [_routed_shards(knobs, tp_plan)]
    else:
        blocks = [_latent(tp_plan, sp) if knobs.mla and p == ATTENTION and downs_gathered else
                  _routed_shards(knobs, tp_plan) if routes_shards and p == MOE else
                  _dense(p, tp_plan.ends(p), sp, overlap, t, splits) for p in pairs]
    if any(r.style is Style.EXPERTS for r in tp_plan.rules):
        blocks.append(_summed_experts(knobs, ep) if impl.name == "hf" else _experts(knobs, strategy, ep, shared))
    forward = [c for block, _ in blocks for c in block]
    backward = [c for _, block in reversed(blocks) for c in block]  # each block from its output
    rerun = impl.rerun
    if knobs.recompute in rerun.regions and blocks:
        output = [c for c in blocks[-1][0] if c.operator in _LEAVES]  # the last pair's exit
        # the rerun starts as the first node that keeps a saved tensor runs: after the output's gradient crossed the
        # exit it meets first (of a MoE's two reduce-scatters under SP, the shared experts', made last)
        first = [c for c in backward[:1] if c.operator in _LEAVES] if rerun.after_output else []
        # the rerun stops at the last saved tensor: before the exit, unless a norm after it keeps its input, a
        # dropout after it its mask (resid_dropout), or the shared expert Qwen2-MoE's block runs after its experts'
        # output
        stops = rerun.early_stop and not (knobs.post_norm or knobs.sandwich_norm or resid_dropout(knobs)
                                          or (knobs.moe and knobs.moe_shared_expert_intermediate_size))
        again = forward[:len(forward) - len(output)] if stops else forward
        backward = [*first, *(_rerun(c) for c in again), *backward[len(first):]]
    return (*forward, *backward)


def _dense(
    p: Pair, ends: tuple[tuple[Rule, ...], tuple[Rule, ...]], sp: bool, overlap: frozenset[str], t: int, splits: int,
) -> tuple[list[Collective], list[Collective]]:
    """A column/row-parallel pair's collectives from its modules before the rowwise ones and the rowwise ones
    (`ends`): (forward, as the overlap method cuts them; backward, with SP's re-gather where the colwise module keeps
    only its input's shard). A colwise module that wraps its own input has its own f, a norm between them whose
    weight is replicated its weight gradient's all-reduce; a gathered block adds DTensor's all-gathers."""
    entering, leaving = ends
    style = entering[0].style
    # several rowwise modules (a MoE's experts and shared experts): under tp their partial sums are added before one
    # f*, under SP each is reduce-scattered on its own
    enter, entered = _operator(p.name, "enter", sp, p.entering)
    leave, left = (x * (len(leaving) if sp else 1) for x in _operator(p.name, "leave", sp, p.leaving))
    gathered = [_gather(p, r, "forward") for r in entering if r.style is Style.COLWISE_GATHER_OUTPUT]
    split = [_gather(p, r, "backward") for r in leaving if r.style is Style.ROWWISE_SPLIT_INPUT]
    forward = [*enter, *gathered, *leave]
    regather = _operator(p.name, "regather", sp, p.entering)[1] if sp and style is Style.COLWISE else []
    if style is not Style.COLWISE_KEEPS_INPUT:  # each module's own, in reverse: a colwise input's f, a norm's weight
        entered = [c for r in reversed(entering) for c in
                   ([_weight_gradient(p, r)] if r.style is Style.REPLICATED_GRAD_ALLREDUCE else entered)]
    backward = [*left, *split, *regather, *entered]
    return [piece for c in forward for piece in _pieces(c, overlap, t, splits)], backward


# megatron-core's MLASelfAttention, module by module: the input its f or g moves and, for a down projection, its output
# gathered over t (gather_from_tensor_model_parallel_region) and the latent SP scatters back to sequence shards
# (scatter_to_sequence_parallel_region; the keys' RoPE part stays whole).
_LATENT_MODULES: dict[str, tuple[tuple[Dim, ...], ...]] = {
    "self_attention.linear_q_down_proj": (BSH, (Dim.B, Dim.S, Dim.QR), (Dim.B, Dim.S, Dim.QR)),
    "self_attention.linear_kv_down_proj": (BSH, (Dim.B, Dim.S, Dim.KVD), (Dim.B, Dim.S, Dim.KVR)),
    "self_attention.linear_q_up_proj": ((Dim.B, Dim.S, Dim.QR),),
    "self_attention.linear_q_proj": (BSH,),
    "self_attention.linear_kv_up_proj": ((Dim.B, Dim.S, Dim.KVR),),
}


def _latent(tp_plan: TPPlan, sp: bool) -> tuple[list[Collective], list[Collective]]:
    """Latent attention's collectives: each down projection enters through its own f or g on x and gathers its
    output over t (scattering the latent back under SP), each up projection enters through its own f or g on its
    latent (the query's on x without a query latent), linear_proj leaves through f* or g*; backward meets them in
    reverse (forward's gather is a split there, SP's scatter a gather). Every module is a ColumnParallelLinear of its
    own, so each re-gathers its input under SP."""
    downs = [r.module for r in tp_plan.rules if r.style is Style.COLWISE_GATHER_OUTPUT and r.pair is None]
    ups = [r.module for r in tp_plan.ends(ATTENTION)[0]]
    forward: list[Collective] = []
    backward: list[Collective] = []
    for module in (*downs, *ups):
        reads, *gathered = _LATENT_MODULES[module]
        name = module.rsplit(".", 1)[-1]
        enter, entered = _operator(f"attention/{name}", "enter", sp, f"{name}'s input", reads)
        regather = _operator(f"attention/{name}", "regather", sp, f"{name}'s input", reads)[1] if sp else []
        forward += enter
        entered = [*regather, *entered]
        if gathered:
            output, latent = gathered
            forward.append(Collective(f"attention/{name}/gather", "gather", Op.ALL_GATHER, "forward", f"{name}'s output",
                                      output, "the down projection's columns are split over t: every rank needs"
                                      " the whole latent"))
            entered = [*([Collective(f"attention/{name}/scatter", "scatter", Op.ALL_GATHER, "backward",
                                     f"the gradient of {name}'s latent", latent, "SP scattered the gathered latent"
                                     " back to sequence shards: backward gathers its gradient")] if sp else []),
                       *entered]
        backward = entered + backward
    leave, left = _operator(ATTENTION.name, "leave", sp, ATTENTION.leaving)
    return [*forward, *leave], [*left, *backward]


def _weight_gradient(p: Pair, r: Rule) -> Collective:
    """replicated_with_grad_allreduce: a norm's weight, whole on every rank, its gradient all-reduced by a hook."""
    module = r.module.rsplit(".", 1)[-1]
    return Collective(f"{p.name}/{module}", "weight", Op.ALL_REDUCE, "backward", f"the gradient of {module}'s weight",
                      r.moves, "each rank's gradient covers its own heads: the hook sums them")


def _gather(p: Pair, r: Rule, phase: str) -> Collective:
    """DTensor's all-gather in a block the plan gathers: a colwise module's output (Shard(-1) to Replicate) in
    forward, or the gradient of the rowwise module's input, which forward split on the rank, in backward."""
    module = r.module.rsplit(".", 1)[-1]
    moves, why = (f"{module}'s output", "colwise_gather_output: every rank runs the block on the whole output") \
        if phase == "forward" else (f"the gradient of {module}'s input", "rowwise_split_input: forward split the"
                                    " whole input on the rank, so backward gathers its gradient")
    return Collective(f"{p.name}/gather", "gather", Op.ALL_GATHER, phase, moves, r.moves, why, piece=Fraction(r.parts))


# -- a mixture of experts: megatron-core 0.16.1's MoELayer with the all-to-all token dispatcher ---------------------

_R_H, _R = (Dim.R, Dim.H), (Dim.R,)
_BOUND = {"balanced": "balanced routing, r = kbs (where ep divides a router's slots)",
          "capacity": "the capacity bound on r",
          "worst": "the worst-case bound on r"}


def _experts(
    knobs: Any, strategy: Strategy, ep: int, shared: tuple[list[Collective], list[Collective]],
) -> tuple[list[Collective], list[Collective]]:
    """megatron-core's MoELayer with the all-to-all dispatcher, experts over ep ranks and etp = t: its collectives.

    Forward, in megatron's order: the shared experts (a dense MLP's g and g*), the router's aux-loss
    all-reduce of token counts over t, the dispatcher's gather of every rank's token counts over t*ep (none when
    padded to capacity: its preprocess fills every count with the capacity and returns before the gather),
    the all-to-all over ep of this rank's permuted tokens and then of their probabilities, their gather
    over t (a g: etp = t), the reduce-scatter over t of the experts' output (a g*) and the combining
    all-to-all. Backward meets the routed path first (autograd runs the later-made nodes first), each
    collective's conjugate in reverse, the probabilities' before the tokens'; the shared experts last.
    Routed bytes take the ledger's bound on r (moe_tokens); an all-to-all sends (ep-1)/ep of the r/t
    slots a rank hands in, exactly so when routing is balanced.
    """
    if knobs.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(f"moe_token_dispatcher_type={knobs.moe_token_dispatcher_type}: only the alltoall"
                          " dispatcher's collectives are modelled (the allgather one gathers every token of t*ep"
                          " ranks instead)")
    tp, bound = strategy.tensor_parallel, _BOUND[str(knobs.moe_tokens)]
    a2a = [c for c in _all_to_alls(bound) if ep > 1]  # an expert-parallel group of one exchanges nothing
    routed = [
        *([_AUX_COUNTS] if tp and knobs.moe_aux_loss else []),
        *([] if knobs.moe_pad_expert_input_to_capacity else [_COUNTS]),  # padded: every count is the capacity
        *[c for c in a2a if c.name == "moe/dispatch"],
        *(_tp_pair(bound) if tp else []),
        *[c for c in a2a if c.name == "moe/combine"],
    ]
    backward = [b for b in map(_conjugate, reversed(routed)) if b is not None]
    return [*shared[0], *routed], [*backward, *shared[1]]


def _routed_shards(knobs: Any, tp_plan: TPPlan) -> tuple[list[Collective], list[Collective]]:
    """torchtitan's MoE at ep = t under SP, or at t = 1 with ep over the FSDP2 ranks: each rank routes its own
    sequence shard (its own b*s tokens), nothing gathered at the block's entry; spmd_types' all_to_all exchanges the
    token counts (int64) and then the routed slots over ep and returns the experts' output (the routing scores stay
    on the rank: combine scales by them there). Shared experts, a FeedForward of their own, then enter through g and
    leave through g* (at t > 1). Backward meets the shared experts first, then each exchange reversed."""
    bound = _BOUND[str(knobs.moe_tokens)]
    counts = Collective("moe/counts", "all-to-all", Op.ALL_TO_ALL, "forward", "each rank's token count per expert"
                        " (int64)", (Dim.E,), "the exchange's split sizes: how many slots each rank sends to each"
                        " expert", group=Group.EP, kind=Kind.INT64)
    routed = [counts, *(c for c in _all_to_alls(bound) if c.shape == _R_H)]  # the tokens, not the probabilities
    shared = [c for r in tp_plan.ends(MOE)[1] if r.module.startswith("moe.shared_experts") and knobs.t > 1
              for end, moves in (("enter", SHARED.entering), ("leave", SHARED.leaving))
              for half in _operator(SHARED.name, end, True, moves) for c in half]
    backward = [b for b in map(_conjugate, reversed(routed)) if b is not None]
    return [*routed, *(c for c in shared if c.phase == "forward")], \
        [*(c for c in reversed(shared) if c.phase == "backward"), *backward]


def _summed_experts(knobs: Any, ep: int) -> tuple[list[Collective], list[Collective]]:
    """transformers' moe_tp_experts (MoeExpertsParallel): every rank runs each expert on its 1/t of the expert's
    width, on the whole replicated input, and the block's output, the ranks' partial sums, is all-reduced in forward
    (an f*); backward all-reduces the gradients of the experts' two inputs, the routing weights (fp32) and then the
    hidden states (an f each). The router and any shared expert run whole on every rank."""

    if ep > 1:
        raise ConfigError(f"impl {knobs.impl}: ep={ep}: transformers' expert-parallel plan (ep_dispatch_experts) is"
                          " not modelled")
    leave, _ = _operator(MOE.name, "leave", False, MOE.leaving)
    weights = Collective(f"{MOE.name}/f", "f", Op.ALL_REDUCE, "backward", "the gradient of the top-k routing weights",
                         (Dim.B, Dim.S, Dim.K), "each rank's experts computed it from their own columns: the partial"
                         " sums are added", kind=routing_weights_kind(knobs))
    return leave, [weights, *_operator(MOE.name, "enter", False, MOE.entering)[1]]


def block_docs() -> dict[str, str]:
    """What each block of its own models, for the docs: megatron-core's MoE layer (`experts`), transformers' experts
    (`summed_experts`), torchtitan's at ep = t (`routed_shards`) and megatron-core's latent attention (`latent`), each
    its function's docstring in one paragraph."""
    blocks = {"experts": _experts, "summed_experts": _summed_experts, "routed_shards": _routed_shards,
              "latent": _latent}
    return {name: " ".join((f.__doc__ or "").split()) for name, f in blocks.items()}


_COUNTS = Collective("moe/counts", "g", Op.ALL_GATHER, "forward", "each rank's token count per expert (int64)",
                     (Dim.E,), "the dispatcher's split sizes: how many slots each rank sends to each expert",
                     group=Group.TP_EP, count=Count.EACH, kind=Kind.INT64)
_AUX_COUNTS = Collective("router/aux", "f*", Op.ALL_REDUCE, "forward", "the token count per expert (int64)", (Dim.E,),
                         "the load-balancing loss counts the tokens of the whole sequence, not one rank's shard",
                         kind=Kind.INT64)


def _all_to_alls(bound: str) -> tuple[Collective, ...]:
    """The dispatcher's exchanges over ep: this rank's r/t permuted slots and their probabilities, then back."""
    def exchange(name: str, moves: str, shape: tuple[Dim, ...], why: str) -> Collective:
        return Collective(name, "all-to-all", Op.ALL_TO_ALL, "forward", f"{moves} ({bound})", shape, why,
                          group=Group.EP, count=Count.SHARD)
    return (
        exchange("moe/dispatch", "the permuted tokens", _R_H, "each slot goes to the rank that holds its expert"),
        exchange("moe/dispatch", "their routing probabilities", _R, "the experts scale their output by them"),
        exchange("moe/combine", "the experts' output", _R_H, "each slot's result returns to its token's rank"),
    )


def _tp_pair(bound: str) -> tuple[Collective, ...]:
    """dispatch_postprocess's gather over t and combine_preprocess's reduce-scatter (etp = t)."""
    why = "the t ranks share each expert's weights (etp = t): each needs the slots of all t"
    return (
        Collective("moe/g", "g", Op.ALL_GATHER, "forward", f"the dispatched tokens ({bound})", _R_H, why),
        Collective("moe/g", "g", Op.ALL_GATHER, "forward", f"their routing probabilities ({bound})", _R, why),
        Collective("moe/g*", "g*", Op.REDUCE_SCATTER, "forward", f"the experts' output ({bound})", _R_H,
                   "each of the t ranks holds a partial sum of its experts' fc2 output; it is cast to the"
                   " probabilities' dtype first, the activation dtype (the router computes in its input's)"),
    )


def _conjugate(c: Collective) -> Collective | None:
    """A forward collective's backward: an all-to-all's reverse exchange, a g's reduce-scatter, a g*'s gather;
    none for the token counts (integers: no gradient)."""
    if c.kind is not Kind.ACTIVATION:
        return None
    op, why = _BACKWARD[c.op]
    return replace(c, op=op, phase="backward", moves=f"the gradient of {c.moves}", why=why)


# Each forward collective of the dispatcher: its backward's op, and why backward issues it.
_BACKWARD = {
    Op.ALL_TO_ALL: (Op.ALL_TO_ALL, "the forward exchange reversed: each gradient returns to the rank its slot came from"),
    Op.ALL_GATHER: (Op.REDUCE_SCATTER, "each of the t ranks computed a partial gradient of every gathered slot: summed,"
                    " and each rank keeps its own slots'"),
    Op.REDUCE_SCATTER: (Op.ALL_GATHER, "the experts' fc2 backward on each of the t ranks needs the gradient of every"
                        " slot"),
}


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


def sent_bytes(c: Collective, sizes: dict[Dim, int], t: int, width: int, ep: int = 1) -> int:
    """Bytes one rank moves for `c` (a receive: what arrives) over its group of t, ep or t*ep ranks; exact,
    since t divides h (t | a | h) and s (a shard of routed slots, under SP)."""
    ranks = c.group.size(t, ep)
    element = FIXED_BYTES.get(c.kind, width)
    return int(c.op.share(ranks) * c.piece * c.count.factor(t, ranks) * element * prod(sizes[d] for d in c.shape))


@dataclass(frozen=True)
class LayerComm:
    """One strategy's collectives for one layer and one micro-batch, and what a step adds up to."""

    strategy: Strategy
    collectives: tuple[tuple[Collective, int], ...]  # each with the bytes one rank sends (a MoE layer's, in a mix)
    per_step_bytes: int
    pipeline_bytes: int  # activations and their gradients sent between stages, per step
    dense: tuple[tuple[Collective, int], ...] = ()  # a dense layer's, when MoE layers alternate with dense ones
    layers: tuple[int, int] = (0, 0)  # (MoE or only kind, dense) layers on the stage the step counts

    @property
    def per_layer_bytes(self) -> int:
        """Bytes one rank sends (what it receives is not counted)."""
        return _sent(self.collectives)

    @property
    def dense_layer_bytes(self) -> int:
        return _sent(self.dense)


def _sent(rows: tuple[tuple[Collective, int], ...]) -> int:
    return sum(n for c, n in rows if c.op is not Op.RECV)


def layer_comm(config: ModelConfig, strategy: Strategy, microbatches: int) -> LayerComm:
    """Per-layer collectives and bytes, and the step's total on the pipeline stage with the most MoE layers."""
    check_strategy(config, strategy)
    check_even_parts(config, strategy)
    sizes, width = dim_sizes(config, routers(config, strategy)), DTYPE_BYTES[config.dtype]  # r as the ledger's
    t = config.t if strategy.tensor_parallel else 1

    def rows(knobs: Any) -> tuple[tuple[Collective, int], ...]:
        return tuple((c, sent_bytes(c, sizes, t, width, config.ep))
                     for c in layer_collectives(knobs, strategy, ep=config.ep))

    moe_layers, dense_layers = stage_layers(config)
    layer = rows(config)
    dense = rows(Knobs.of(config).dense) if config.moe and dense_layers else ()
    shard = config.t if strategy.sequence_parallel else 1
    boundary = 2 * width * sizes[Dim.B] * sizes[Dim.S] * sizes[Dim.H] // shard  # activation out, gradient back
    pipeline = microbatches * boundary if config.pp > 1 else 0
    per_step = microbatches * (moe_layers * _sent(layer) + dense_layers * _sent(dense)) + pipeline
    return LayerComm(strategy, layer, per_step, pipeline, dense, (moe_layers, dense_layers))


def check_even_parts(config: ModelConfig, strategy: Strategy) -> None:
    """Refuse, in one line, a balanced bound whose all-to-alls send uneven parts: a router's k*(b*s/cp)/routers slots
    that ep does not divide. The forced route deals them round the ep ranks, so a rank keeps one more than it sends
    each other rank, and returns what it received unlike what it sent: not the even (ep-1)/ep share."""
    if not config.moe or config.ep == 1 or config.moe_tokens != "balanced":
        return
    n = routers(config, strategy)
    slots = config.moe_router_topk * (config.b * (config.s // config.cp) // n)
    if slots % config.ep:
        tokens = "b*s" if config.cp == 1 else f"b*s/(cp={config.cp})"  # a context-parallel rank routes its own
        raise ConfigError(f"the communication ledger does not model a router's k*{tokens}/{n}={slots} slots that"
                          f" ep={config.ep} does not divide under the balanced bound (its all-to-alls' parts are"
                          " uneven): choose b*s so that ep divides them")


def stage_layers(config: ModelConfig) -> tuple[int, int]:
    """(MoE layers, dense layers) on the pipeline rank holding the most MoE layers, then the most layers, as the
    implementation splits them (`ModelConfig.rank_chunks`); a dense model's layers count as the first kind."""
    def kinds(layers: list[int]) -> tuple[int, int]:
        moe = sum(map(config.is_moe_layer, layers)) if config.moe else len(layers)
        return moe, len(layers) - moe

    return max(kinds([i for x in config.rank_chunks(r) for i in x]) for r in range(config.pp))


# Each group and count as a factor in symbols (text, LaTeX), under tensor parallelism and without it (t = 1).
_FACTORS = {
    (Group.TP, Count.WHOLE): ("(t-1)/t", "\\frac{t-1}{t}"),
    (Group.EP, Count.SHARD): ("(ep-1)/(ep*t)", "\\frac{ep-1}{ep \\, t}"),
    (Group.EP, Count.WHOLE): ("(ep-1)/ep", "\\frac{ep-1}{ep}"),
    (Group.TP_EP, Count.EACH): ("(t*ep-1)", "(t \\, ep-1)"),
}
_FACTORS_T1 = {(Group.EP, Count.SHARD): ("(ep-1)/ep", "\\frac{ep-1}{ep}"),
               (Group.TP_EP, Count.EACH): ("(ep-1)", "(ep-1)"),
               (Group.EP, Count.WHOLE): _FACTORS[Group.EP, Count.WHOLE]}  # the token counts, at ep over dp_shard


def formula(knobs: Any, strategy: Strategy, width: int, ep: int = 1) -> tuple[str, str]:
    """Bytes one rank sends per layer, in symbols (text, LaTeX): the sum over its collectives of the element
    width, times 2 for an all-reduce, the group's share and the shape (a dense layer: sbh(t-1)/t each)."""
    terms: dict[tuple[tuple[str, str], tuple[Dim, ...]], int] = {}
    factors = _FACTORS if strategy.tensor_parallel else _FACTORS_T1
    for c in layer_collectives(knobs, strategy, ep=ep):
        key = (factors[(c.group, c.count)], c.shape)
        ring_units = 2 if c.op is Op.ALL_REDUCE else 1  # the tensor's bytes x (t-1)/t each rank sends, this often
        terms[key] = terms.get(key, 0) + ring_units * FIXED_BYTES.get(c.kind, width)
    if not terms:
        return "0", "0"
    text = " + ".join(f"{n}{_symbols(shape)}{share}" for ((share, _), shape), n in terms.items())
    latex = " + ".join(f"{n} {frac} {' '.join(_symbols(shape))}" for ((_, frac), shape), n in terms.items())
    return text, latex


def _symbols(shape: tuple[Dim, ...]) -> str:
    """A shape's symbols, the paper's sbh for (b, s, h)."""
    return "sbh" if shape == BSH else "".join(f"({d.value})" if "+" in d.value else d.value for d in shape)
