"""transformers' sparse MoE blocks (Mixtral's, Qwen2-MoE's, Qwen3-MoE's, DeepSeek-V3's) as ops for the hf step walk
(`--impl hf`).

The experts by experts_implementation (grouped_mm or the eager loop), each path's backward as autograd orders it:
docs/timeline.md, "transformers' MoE blocks".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline import hf_gpt_oss as oss
from memcalc.sizing.timeline.hf_layer import WHY_SAVED, widest
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD, linear
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names

# The block's tensors kept one storage per expert: the ledger's row is E of them (memcalc.probe.libs.hf merges them the
# same way).
EXPERT_TENSORS = (
    rules.TOKEN_SLOTS, ledger.EXPERT_IN, ledger.EXPERT_GATE, ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT,
    ledger.EXPERT_FC2_IN, rules.EXPERT_WEIGHT, rules.EXPERT_WEIGHT_CAST, rules.EXPERT_OUT, rules.COMBINE_IN,
)


@functools.cache
def per_expert(e: int) -> dict[str, SavedTensor]:
    """Expert e's storages of the ledger's rows the loop keeps one per expert, by the row's name (every layer's)."""
    return {x.name: replace(x, name=f"{x.name}[{e}]") for x in EXPERT_TENSORS}


def expert_bytes(saved: dict[str, int], config: ModelConfig) -> dict[str, int]:
    """Each expert's share of the ledger's per-expert rows, by `per_expert` name (the eager loop's only)."""
    if grouped(config):
        return {}
    experts = config.num_experts
    return {per_expert(e)[x.name].name: saved[x.name] // experts for x in EXPERT_TENSORS if x.name in saved
            for e in range(experts)}


def grouped(config: ModelConfig) -> bool:
    """Whether the experts run transformers' default grouped_mm (one storage a row), not the eager loop."""
    return config.experts_implementation == "grouped_mm"


def kept_in_forward(tensors: tuple[SavedTensor, ...], config: ModelConfig) -> Step:
    """A layer's kept tensors as its forward makes them, sized by the ledger and named by each layer's walk; those a
    sparse block's own steps make are `block_forward`'s (hf_layer.layer_forward leaves them out), the eager loop's
    rows among them, one storage per expert (`per_expert`)."""
    loop = not grouped(config)
    return Step("the layer's saved tensors", tuple(Made("", 0, WHY_SAVED, keeps=x) for x in tensors
                                                   if not (loop and x in EXPERT_TENSORS)), moment=False)


STEM = "grad/moe"  # the block's gradients, named for no layer (one block's backward runs at a time)


def weight_of(where: str, gradient: str) -> str:
    """The path of the weight whose gradient (the tape's name) a module hands over: the module's, but for the experts'
    two weights, one module's (MixtralExperts), each by its own path (FSDP2 keeps each as its unsharded .grad)."""
    if not where.endswith(".mlp.experts"):
        return where
    return f"{where}.{'gate_up_proj' if '/gate_up ' in gradient else 'down_proj'}"


def _bf16(config: ModelConfig) -> bool:
    """Whether the experts read routing weights in the activation dtype (Qwen's cast them, as the ledger says; in fp32
    every block's are) and so make no casts, or Mixtral's fp32 ones in a 16-bit model."""
    return config.dtype == "fp32" or rules.EXPERT_WEIGHT_CAST in rules.moe_block(config) or rules.is_gpt_oss(config)


def _width(z: Sizes, config: ModelConfig) -> int:
    """The routing weights' bytes a value, and so their product's: bf16 in Qwen's blocks, fp32 in Mixtral's."""
    return z.act if _bf16(config) else 4


def _slots(config: ModelConfig) -> int:
    """r_e: the slots each expert gets under the balanced bound, kbs/E."""
    return config.moe_router_topk * config.b * config.s // config.num_experts


def block_forward(p: str, z: Sizes, config: ModelConfig, checkpointed: bool) -> tuple[Op, ...]:
    """The block's forward op by op (`checkpointed`: for gradient checkpointing, its forward, which keeps nothing, and
    its rerun in backward, which keeps the ledger's tensors and stops early at the last one the layer saves):
    Qwen2-MoE's shared expert first, the router, the experts (their locals live to their return), then Qwen2-MoE's
    shared expert's gate or DeepSeek-V3's shared experts, summed with the experts' output; the block's locals (the
    router's outputs, its input) live to its return. Without a checkpoint the layer's one forward moment walks the same
    ops, only the widest marking moments (`_widest_forward`); DeepSeek-V3's, never walked op by op (latent attention
    refuses a checkpoint), takes the softmax router's steps, of which its moments hold what it holds too (the logits,
    its GEMM's fp32, and the top-k weights); gpt-oss's experts are hf_gpt_oss's."""
    if checkpointed or rules.is_gpt_oss(config):
        return _block_ops(p, z, config)
    return _in_layer(p, _widest_forward(z, config))


_ANY_LAYER = "<layer>"  # the prefix `_widest_forward` walks the block at, each layer's in its place


@functools.lru_cache(maxsize=2)
def _widest_forward(z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """The block's ops as a layer's forward without a checkpoint walks them (hf_layer.widest), condensed once for
    every layer (the eager loop's thousands of steps a layer took a third of the walk's time): its kept tensors left
    for each layer's walk to name, its locals for `_in_layer`."""
    ops = widest(_block_ops(_ANY_LAYER, z, config), _widest_steps(config))

    def unnamed(x: Made) -> Made:  # the walk names a kept tensor without a name by its prefix, as this one is named
        return replace(x, name="") if x.keeps is not None and x.name == kept_name(_ANY_LAYER, x.keeps) else x
    return _renamed(ops, unnamed, lambda name: name)


def _in_layer(p: str, ops: tuple[Op, ...]) -> tuple[Op, ...]:
    """`_widest_forward`'s ops with layer p's names."""
    return _renamed(ops, lambda x: replace(x, name=x.name.replace(_ANY_LAYER, p)) if x.name else x,
                    lambda name: name.replace(_ANY_LAYER, p))


def _renamed(ops: tuple[Op, ...], made: Callable[[Made], Made], freed: Callable[[str], str]) -> tuple[Op, ...]:
    """The ops with what each forward step makes passed through `made`, the names it frees through `freed` (the
    steps hf_layer.widest leaves make and free only)."""
    def step(x: Step) -> Step:
        return replace(x, makes=tuple(map(made, x.makes)), frees=tuple(map(freed, x.frees)))
    return tuple(replace(op, forward=tuple(map(step, op.forward))) if op.forward else op for op in ops)


def _block_ops(p: str, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """The block's forward op by op (`block_forward`'s), layer p's."""
    m, shared = f"{p}/moe", bool(config.moe_shared_expert_intermediate_size)
    out = f"{m}/experts output" if shared else f"{p}/mlp output"
    done = Op("mlp", (Step("", frees=(f"{m}/router_logits", f"{m}/top_k_weights"),
                           reads_last=kept_names(p, ledger.ROUTER_TOPK_INDICES, ledger.MOE_IN)),), ())
    if rules.is_gpt_oss(config):  # its experts read the kept softmax over the top k
        return (oss.experts_forward(p, out, z, config, _router_logits(m, z, config)), done)
    experts = _grouped_experts_forward if grouped(config) else _loop_experts_forward
    gated = shared and not config.mla
    return (*(_shared_forward(p) if gated else ()), _router_forward(p, z, config), *experts(p, z, config, out),
            *(_shared_gated(p, z, out) if gated else _shared_summed(p, z, out) if shared else ()), done)


# The experts' steps that mark the block's widest forward moments without a checkpoint (hf_layer.widest). grouped_mm's:
SLOT_ORDER = "the rows in slot order"
SLOTS_SUMMED = "summed over each token's k slots"
SUM_CAST = "the sum cast to bf16"
# the eager loop's last expert's (an earlier expert's hold fewer, each expert after it keeping 4 r_e h bytes, as much
# as Mixtral's fp32 product)
WEIGHTED = "the output times its routing weights"
WEIGHTED_CAST = "cast to bf16: index_add_'s source"


def _widest_steps(config: ModelConfig) -> dict[str, str]:
    """The titles of the block's steps that mark its widest moments, each with its moment's words: the experts', and
    the shared experts' sum with theirs."""
    bf16, total = _bf16(config), SHARED_SUM if config.mla else GATED_SUM
    summed = {total: total} if config.moe_shared_expert_intermediate_size else {}
    if grouped(config):
        return {SLOT_ORDER: "the weighted rows put back in slot order",
                SLOTS_SUMMED: "the rows summed over each token's k slots", **({} if bf16 else {SUM_CAST: SUM_CAST}),
                **summed}
    last = {WEIGHTED: "the last expert's weighted output"} if bf16 else {
        WEIGHTED_CAST: "the last expert's weighted output cast to bf16"}
    return last | summed


def _routing_weight(config: ModelConfig) -> SavedTensor:
    """What the experts keep as a slot's routing weight: the ledger's, fp32 or (Qwen's, and every block's in fp32)
    the activation dtype's."""
    cast = rules.EXPERT_WEIGHT_CAST
    return cast if cast in rules.moe_block(config) else rules.EXPERT_WEIGHT


def _router_logits(m: str, z: Sizes, config: ModelConfig) -> Made:
    """The router's (b*s, E) logits, which the block's `_` holds to its return: DeepseekV3TopkRouter's GEMM runs in
    fp32."""
    width = 4 if config.mla else z.act
    return Made(f"{m}/router_logits", width * z.b * z.s * config.num_experts, "F.linear's (b*s, E) logits: the block's"
                " `_` holds them")


def _router_forward(p: str, z: Sizes, config: ModelConfig) -> Op:
    """The router: logits, their fp32 softmax (a local to its return), top-k, the sum and the in-place division (whose
    clone autograd keeps), Qwen's cast to bf16 (in fp32 both casts are no-ops)."""
    m, tokens, k, experts = f"{p}/moe", z.b * z.s, config.moe_router_topk, config.num_experts
    weights, fp32, cast = f"{m}/top_k_weights", z.act == 4, _bf16(config) and z.act != 4
    norm = (
        Step("the top-k values' sum", (kept(p, rules.TOPK_SUM),)),
        Step("the values divided by it, in place: autograd keeps them as they were", (kept(p, rules.TOPK_WEIGHTS),),
             reads_last=kept_names(p, rules.TOPK_SUM, rules.TOPK_WEIGHTS)),
    ) if rules.TOPK_SUM in rules.moe_block(config) else ()
    cast = (Step("the top-k weights cast to bf16", (Made(weights, z.act * tokens * k, "the weights the experts read"),),
                 frees=(f"{m}/top values",)),) if cast else ()
    *routed, last = (
        Step("the router's logits", (_router_logits(m, z, config),)),
        *(() if fp32 else (Step("the logits cast to fp32", (Made(f"{m}/logits fp32", 4 * tokens * experts,
                                                                 "softmax's input"),)),)),
        Step("the fp32 softmax", (kept(p, rules.ROUTER_PROBS),), frees=(f"{m}/logits fp32",)),
        Step("top-k", (Made(f"{m}/top values" if cast else weights, 4 * tokens * k, "the k largest probabilities"),
                       kept(p, ledger.ROUTER_TOPK_INDICES))),
        *norm, *cast)
    return Op("mlp.gate", (*routed, replace(last, reads_last=last.reads_last + kept_names(p, rules.ROUTER_PROBS))), ())


def _grouped_experts_forward(p: str, z: Sizes, config: ModelConfig, out: str) -> tuple[Op, ...]:
    """grouped_mm_experts_forward op by op, its locals to its return (`out`, what it returns)."""
    m, tokens, k, experts = f"{p}/moe", z.b * z.s, config.moe_router_topk, config.num_experts
    r, width, bf16 = k * tokens, _width(z, config), _bf16(config)
    weight = _routing_weight(config)
    summed = out if bf16 else f"{m}/summed fp32"  # Qwen's sum is bf16: its cast a no-op
    held = kept_names(p, rules.SORTED_SLOTS, ledger.EXPERT_IN, weight, rules.EXPERT_OFFSETS, rules.EXPERT_OUT,
                      rules.UNSORTED_SLOTS)
    sorted_ = Op("mlp.experts", (
        Step("sort: the slots by expert", (Made(f"{m}/sorted expert ids", 8 * r, "torch.sort's values"),
                                           kept(p, rules.SORTED_SLOTS))),
        Step("perm // k: each sorted slot's token", (kept(p, rules.TOKEN_INDICES),)),
        Step("the tokens' rows in expert order", (kept(p, ledger.EXPERT_IN),),
             reads_last=kept_names(p, rules.TOKEN_INDICES)),
        Step("the routing weights in expert order", (kept(p, weight),)),
        Step("the sorted ids as fp32", (Made(f"{m}/histc input", 4 * r, "histc takes no integers on the CPU"),)),
        Step("histc: the tokens per expert", (Made(f"{m}/tokens per expert", 4 * experts, "(E,) fp32 counts"),)),
        Step("cumsum: the offsets", (kept(p, rules.EXPERT_OFFSETS),)),
        Step("gate_up_proj's grouped GEMM", (kept(p, ledger.EXPERT_GATE), kept(p, ledger.EXPERT_UP))),
    ), ())
    silu = Op("mlp.experts.act_fn", (Step("SiLU", (kept(p, ledger.EXPERT_SILU_OUT),)),), ())
    combined = Op("mlp.experts", (
        Step("SiLU(gate) * up", (kept(p, ledger.EXPERT_FC2_IN),),
             reads_last=kept_names(p, ledger.EXPERT_GATE, ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT)),
        Step("down_proj's grouped GEMM", (kept(p, rules.EXPERT_OUT),), reads_last=kept_names(p, ledger.EXPERT_FC2_IN)),
        Step("the rows times their routing weights", (Made(f"{m}/weighted", width * r * z.h, "in expert order"),)),
        Step("inv_perm[perm] = arange", (kept(p, rules.UNSORTED_SLOTS), Made(f"{m}/arange", 8 * r, "a temporary")),
             frees=(f"{m}/arange",)),
        Step(SLOT_ORDER, (Made(f"{m}/slot order", width * r * z.h, "weighted_out[inv_perm]"),),
             frees=(f"{m}/weighted",)),
        Step(SLOTS_SUMMED, (Made(summed, width * tokens * z.h, "view(b*s, k, h).sum(1)"),)),
        *(() if bf16 else (Step(SUM_CAST, (Made(out, z.full(z.h), "the experts' output"),)),)),
        Step("", frees=(f"{m}/sorted expert ids", f"{m}/histc input", f"{m}/tokens per expert", f"{m}/slot order",
                        f"{m}/summed fp32"), reads_last=held),
    ), ())
    return (sorted_, silu, combined)


def _loop_experts_forward(p: str, z: Sizes, config: ModelConfig, out: str) -> tuple[Op, ...]:
    """The eager loop op by op (`out`, the index_add_ target it returns): the one-hot mask and the experts hit, then
    each expert's (token, slot) pairs, rows, SwiGLU, down projection and weighted output added in; the loop's
    variables hold an expert's pairs, rows, gate_up output and weighted output until the next expert rebinds them
    (the last expert's to the return)."""
    m, tokens, k, experts, bf16 = f"{p}/moe", z.b * z.s, config.moe_router_topk, config.num_experts, _bf16(config)
    weight = _routing_weight(config)
    made = [{x: kept(p, per_expert(e)[x.name]) for x in EXPERT_TENSORS} for e in range(experts)]  # by ledger row

    def held(e: int) -> tuple[tuple[str, ...], Step]:
        """Expert e's kept tensors the loop's variables hold (pairs, rows, gate_up's two halves), and the step that
        lets its weighted output go: Qwen's is index_add_'s kept source, Mixtral's an fp32 local."""
        if e < 0:
            return (), Step("")
        rows = tuple(made[e][x].name for x in (rules.TOKEN_SLOTS, ledger.EXPERT_IN, ledger.EXPERT_GATE,
                                               ledger.EXPERT_UP))
        return rows, Step("", reads_last=(made[e][rules.COMBINE_IN].name,)) if bf16 else Step("", frees=(
            f"{m}/weighted fp32 {e}",))

    def expert(e: int) -> tuple[Op, ...]:
        mine = made[e]
        before, weighted = held(e - 1)  # the previous expert's, let go as this one's rebind them
        product = mine[rules.COMBINE_IN] if bf16 else Made(f"{m}/weighted fp32 {e}", 4 * _slots(config) * z.h,
                                                           "fp32: the loop's variable holds it")
        cast = () if bf16 else (Step(WEIGHTED_CAST, (mine[rules.COMBINE_IN],)),
                                Step("index_add_", reads_last=(mine[rules.COMBINE_IN].name,)))
        return (
            Op("mlp.experts", (
                Step(f"expert {e}: its (token, slot) pairs", (mine[rules.TOKEN_SLOTS],), reads_last=before[:1]),
                Step("its rows", (mine[ledger.EXPERT_IN],), reads_last=before[1:2]),
                Step("gate_up's GEMM", (mine[ledger.EXPERT_GATE], mine[ledger.EXPERT_UP]), reads_last=before[2:]),
            ), ()),
            Op("mlp.experts.act_fn", (Step("SiLU", (mine[ledger.EXPERT_SILU_OUT],)),), ()),
            Op("mlp.experts", (
                Step("SiLU(gate) * up", (mine[ledger.EXPERT_FC2_IN],), frees=weighted.frees,
                     reads_last=(mine[ledger.EXPERT_SILU_OUT].name, *weighted.reads_last)),
                Step("down_proj's GEMM", (mine[rules.EXPERT_OUT],), reads_last=(mine[ledger.EXPERT_FC2_IN].name,)),
                Step("its routing weights", (mine[weight],)),
                Step(WEIGHTED, (product,), reads_last=(mine[weight].name, mine[rules.EXPERT_OUT].name)),
                *cast,
            ), ()),
        )

    rows, weighted = held(experts - 1)
    return (
        Op("mlp.experts", (
            Step("zeros_like(x): index_add_'s target", (Made(out, z.full(z.h), "the experts' output"),)),
            Step("one_hot(top_k_index, E + 1)", (Made(f"{m}/expert_mask", 8 * tokens * k * (experts + 1),
                                                      "(b*s, k, E + 1) int64, a local to the return"),)),
            Step("the experts hit", (Made(f"{m}/expert_hit", 8 * experts, "nonzero(the mask's sums): (E, 1)"
                                          " int64"),)),
        ), ()),
        *(op for e in range(experts) for op in expert(e)),
        Op("mlp.experts", (Step("", frees=(f"{m}/expert_mask", f"{m}/expert_hit", *weighted.frees),
                                reads_last=(*rows, *weighted.reads_last)),), ()),
    )


def _shared_forward(p: str) -> tuple[Op, ...]:
    """Qwen2MoeMLP on every token, the block's first: down_proj(act_fn(gate_proj(x)) * up_proj(x)), each operand
    gone once read (its output kept by the gated product)."""
    s = "mlp.shared_expert"
    ops = ((f"{s}.gate_proj", "the GEMM", ledger.SHARED_GATE, ()),  # (where, what, made, read last)
           (f"{s}.act_fn", "SiLU", ledger.SHARED_SILU_OUT, (ledger.SHARED_GATE,)),
           (f"{s}.up_proj", "the GEMM", ledger.SHARED_UP, ()),
           (s, "act(gate) * up", ledger.SHARED_FC2_IN, (ledger.SHARED_SILU_OUT, ledger.SHARED_UP)),
           (f"{s}.down_proj", "the GEMM", rules.SHARED_OUT, (ledger.SHARED_FC2_IN,)))
    return tuple(Op(where, (Step(what, (kept(p, x),), reads_last=kept_names(p, *read)),), ())
                 for where, what, x, read in ops)


def _shared_gated(p: str, z: Sizes, experts: str) -> tuple[Op, ...]:
    """sigmoid(shared_expert_gate(x)) * the shared expert's output, added to the experts' (`experts`)."""
    m = f"{p}/moe"
    return (
        Op("mlp.shared_expert_gate", (Step("the GEMM", (Made(f"{m}/shared gate logits", z.act * z.b * z.s,
                                                             "(b*s, 1)"),)),), ()),
        Op("mlp", (
            Step("sigmoid", (kept(p, rules.SHARED_GATE_SIGMOID),), frees=(f"{m}/shared gate logits",)),
            Step("sigmoid(gate(x)) * shared_expert(x)", (Made(f"{m}/shared gated", z.full(z.h), "the gated output"),),
                 reads_last=kept_names(p, rules.SHARED_GATE_SIGMOID, rules.SHARED_OUT)),
            Step(GATED_SUM, (Made(f"{p}/mlp output", z.full(z.h), "the block's output"),),
                 frees=(experts, f"{m}/shared gated")),
        ), ()),
    )


def _shared_summed(p: str, z: Sizes, experts: str) -> tuple[Op]:
    """DeepseekV3MLP's output on the block's input added to the experts' (`experts`), its kept tensors made then: one
    step (latent attention refuses a checkpoint, so nothing walks it op by op)."""
    m, full = f"{p}/moe", z.full(z.h)
    return (Op("mlp", (Step(SHARED_SUM, (
        *(kept(p, x) for x in rules.SHARED_MLP), Made(f"{m}/shared output", full, "shared_experts(residuals)"),
        Made(f"{p}/mlp output", full, "the experts' and the shared experts' outputs summed")),
        frees=(experts, f"{m}/shared output")),), ()),)


GATED_SUM = "the experts' and the gated shared expert's outputs summed"  # Qwen2-MoE's
SHARED_SUM = "the experts' and the shared experts' outputs summed"  # DeepSeek-V3's


@dataclass
class _Sums:
    """Autograd's running sums of one tensor's gradients (the block input's, the routing weights', each expert
    weight's): the first gradient is the sum itself, each later one is added into a new tensor."""

    stem: str
    current: dict[str, str] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, total: str, new: str, nbytes: int, what: str = "", out: str = "") -> tuple[Step, ...]:
        """The step that sums `new` into `total` (none for the first); `what` marks its moment, `out` names it."""
        before = self.current.get(total)
        if before is None:
            self.current[total] = new
            return ()
        self.count[total] = self.count.get(total, 0) + 1
        name = self.current[total] = out or f"{self.stem}/{total} {self.count[total]}"
        return (Step(what or "autograd sums the gradients", (Made(name, nbytes, f"autograd's sum of {total}'s"
                                                                   " gradients so far"),),
                     frees=(before, new), moment=bool(what)),)

    def router(self, g: str, z: Sizes, out: str = "") -> tuple[Step, ...]:
        """The router's dX (`{g}/input`) summed into the block input's gradient, a moment; `out` names the sum."""
        return self.add("block input", f"{g}/input", z.full(z.h), "the router's input gradient summed with the"
                        " block's others", out)


_EXPERTS_INPUT = "experts input"  # DeepSeek's loop: its experts' dX, summed before the shared experts' is added
OUTPUT_GRAD = f"{STEM}/ln2 output"  # the block input's gradient, every path's summed, which ln2's backward reads


def block_backward(z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """The block's ops in forward order, one description for every layer (one block's backward runs at a time);
    `OUTPUT_GRAD` is every path's input gradient summed."""
    sums = _Sums(STEM)
    gated = bool(config.moe_shared_expert_intermediate_size) and not config.mla  # Qwen2-MoE's, its backward last
    # in the order autograd runs them: DeepSeek-V3's shared experts, added last, first
    ran = [*(_shared_gate(z, sums) if gated else ()), *(_shared_expert(z, config, sums, last=False) if config.mla
                                                         else ())]
    if grouped(config):
        ran += _grouped(z, config, sums)
    else:
        for e in reversed(range(config.num_experts)):
            ran += _expert(z, config, e, sums)
        if config.mla:  # the experts' input is a view of the block's: their dX summed apart, then into the shared's
            last = ran[-1]
            ran[-1] = replace(last, backward=(*last.backward, *sums.add(
                "block input", sums.current[_EXPERTS_INPUT], z.full(z.h))))
    router = f"{sums.stem}/router"
    ran += _sigmoid_router(z, config, sums) if config.mla else oss.router_backward(
        router, z, config.moe_router_topk, config.num_experts, sums.router(router, z, OUTPUT_GRAD)) if \
        rules.is_gpt_oss(config) else _router(z, config, sums, final=not gated)
    if gated:
        ran += _shared_expert(z, config, sums, last=True)
    first = ran[-1]  # the routing weights' gradient: live until the block's backward returns
    ran[-1] = replace(first, backward=(*first.backward, Step("", frees=(sums.current["routing weights"],))))
    return tuple(reversed(ran))


def _op(where: str, saves: tuple[SavedTensor, ...], *steps: Step | tuple[Step, ...]) -> Op:
    """An op with only a backward (the block's forward is `block_forward`'s), its steps flattened."""
    flat = tuple(x for s in steps for x in (s if isinstance(s, tuple) else (s,)))
    return Op(where, (), flat, saves)


def _expert(z: Sizes, config: ModelConfig, e: int, sums: _Sums) -> list[Op]:
    """Expert e's ops, as autograd runs them; what autograd makes and frees between two moments is one step."""
    g, f, r, experts = f"{sums.stem}/expert {e}", config.expert_ffn, _slots(config), config.num_experts
    bf16, tokens, k, act, width = _bf16(config), z.b * z.s, config.moe_router_topk, z.act, _width(z, config)
    mine = per_expert(e)
    last = e == 0

    def gemms(proj: str, dy: str, dx: Made, saves: tuple[SavedTensor, ...]) -> Op:
        """proj[e]'s GEMMs, its dW one expert's of the (E, ...) parameter; select's backward puts dW in a zero
        (E, ...) tensor, summed with the experts' before; the last expert's sum is handed to the parameter."""
        sel, whole = f"{g}/{proj} select", z.weight(f"mlp.experts.{proj}_proj")
        made = Step(f"{proj}[e]'s GEMMs and select's backward", (
            Made(f"{g}/{proj} dW", whole // experts, "dW^T = x^T dY"), dx,
            Made(sel, whole, "the expert's dW in a zero (E, ...) tensor")),
            frees=(dy, f"{g}/{proj} dW"), moment=False, returns=True)
        summed = sums.add(f"{proj} weights", sel, whole, f"{proj}'s gradients summed: the sum, its two inputs")
        handed = (Step("", hands_over=(sums.current[f"{proj} weights"],)),) if last else ()
        return _op("mlp.experts", saves, made, summed, *handed)

    combine = _op("mlp.experts", (mine[rules.COMBINE_IN.name],), Step("index_add_'s backward", (
        Made(f"{g}/combine rows", act * r * z.h, "dY's rows at the expert's tokens"),
        *(() if bf16 else (Made(f"{g}/combine rows fp32", 4 * r * z.h, "the cast to bf16's backward"),))),
        frees=() if bf16 else (f"{g}/combine rows",), moment=False))
    product = _op("mlp.experts", tuple(mine[x.name] for x in (rules.EXPERT_OUT, rules.EXPERT_WEIGHT,
                                                               rules.EXPERT_WEIGHT_CAST)),
        Step(f"expert {e}: the routing weight's product, its gradients", (
            Made(f"{g}/combine dY fp32" if not bf16 else f"{g}/combine dY bf16", width * r * z.h, "dY * w"),
            Made(f"{g}/combine dw rows", width * r * z.h, "dY * out, before the sum")), returns=True),
        # autograd's validate_outputs: Mixtral's dY * w cast to the output's bf16, dY * out summed to (r_e, 1)
        *(() if bf16 else (Step("dY * w cast to bf16", (Made(f"{g}/combine dY bf16", act * r * z.h, "down_proj's"
                                                             " output gradient"),),
                                frees=(f"{g}/combine dw rows",), reduced=True),)),
        Step("dY * out summed over h, and index's backward", (
            Made(f"{g}/combine dw", width * r, "one value per slot"),
            Made(f"{g}/weights zeros", width * tokens * k, "a (b*s, k) zero tensor"),
            Made(f"{g}/weights put", width * tokens * k, "the slots' gradients in place")),
            frees=(f"{g}/combine dY fp32", f"{g}/combine rows fp32", f"{g}/combine rows", f"{g}/combine dw rows",
                   f"{g}/weights zeros", f"{g}/combine dw"), moment=False, reduced=True),
        sums.add("routing weights", f"{g}/weights put", width * tokens * k))
    down = gemms("down", f"{g}/combine dY bf16", Made(f"{g}/down dX", act * r * f, "dY W, (r_e, e)"),
                 (mine[ledger.EXPERT_FC2_IN.name],))
    swiglu = _op("mlp.experts", tuple(mine[x.name] for x in (ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT,
                                                              ledger.EXPERT_GATE)),
                 # a moment before the product's node returns (fp32 at long s and small h peaks here); SiLU's node
                 # still holds gate, and with it gate_up's storage, after it: the rest no moment
                 Step("SiLU(gate) * up's backward", (
                     Made(f"{g}/up", act * r * f, "dY * SiLU(gate)"), Made(f"{g}/silu", act * r * f, "dY * up")),
                     returns=True),
                 Step("SiLU's and chunk's backward", (
                     Made(f"{g}/gate", act * r * f, "SiLU's backward, at its kept input"),
                     Made(f"{g}/gate_up dY", act * r * 2 * f, "gate's and up's gradients concatenated")),
                     frees=(f"{g}/down dX", f"{g}/silu", f"{g}/gate", f"{g}/up"), moment=False))
    gate_up = gemms("gate_up", f"{g}/gate_up dY", Made(f"{g}/gate_up dX", act * r * z.h, "dY W, (r_e, h)"),
                    (mine[ledger.EXPERT_IN.name],))
    gather = _op("mlp.experts", (mine[rules.TOKEN_SLOTS.name],), Step("index's backward", (
        Made(f"{g}/input zeros", z.full(z.h), "a (b*s, h) zero tensor"),
        Made(f"{g}/input put", z.full(z.h), "the expert's dX at its tokens")),
        frees=(f"{g}/input zeros", f"{g}/gate_up dX"), returns=True),
        sums.add(_EXPERTS_INPUT if config.mla else "block input", f"{g}/input put", z.full(z.h)))
    return [combine, product, down, swiglu, gate_up, gather]


def _grouped(z: Sizes, config: ModelConfig, sums: _Sums) -> list[Op]:
    """grouped_mm's ops, as autograd runs them."""
    g, f = f"{sums.stem}/experts", config.expert_ffn // z.t
    r = config.moe_router_topk * z.b * z.s
    act, width, bf16, h = z.act, _width(z, config), _bf16(config), z.h
    tp = z.t > 1  # this rank's e/t of each expert, local tensors: the weights' gradients handed over at the end
    # one slot a token, or one token: dY expanded to (b*s, k, h) views as the (k*b*s, h) rows, no copy
    copied = config.moe_router_topk > 1 and z.b * z.s > 1
    combine = _op("mlp.experts", (), *(() if bf16 else (Step("the cast's backward: dY in fp32", (
        Made(f"{g}/dY fp32" if copied else f"{g}/slot rows", z.tokens(4 * h), "the block's dY cast to the sum's"
             " fp32"),)),)),
        *((Step("sum's and view's backward: dY repeated at each token's k slots", (
            Made(f"{g}/slot rows", width * r * h, "the expanded dY made contiguous, (k*b*s, h)"),),
            frees=(f"{g}/dY fp32",)),) if copied else ()))
    unsort = _op("mlp.experts", (rules.UNSORTED_SLOTS,), Step("indexing's backward: the rows back in expert order", (
        Made(f"{g}/rows zeros", width * r * h, "a zero (k*b*s, h) tensor"),
        Made(f"{g}/sorted rows", width * r * h, "index_put's: the rows at the permutation")),
        frees=(f"{g}/slot rows", f"{g}/rows zeros")))
    down_dy = f"{g}/down dY"
    product = _op("mlp.experts", (rules.EXPERT_OUT, rules.EXPERT_WEIGHT, rules.EXPERT_WEIGHT_CAST),  # the ledger's
        Step("the routing weight's product: dY * w", (Made(down_dy if bf16 else f"{g}/down dY fp32", width * r * h,
                                                           "dY * w, down_proj's output gradient"),)),
        Step("the routing weight's product: dY * out", (Made(f"{g}/weights dw rows", width * r * h,
                                                             "dY * out, before the sum over h"),), returns=True),
        # autograd's validate_outputs: dY * w cast to its input's dtype, dY * out summed to the weights' shape
        *(() if bf16 else (Step("dY * w cast to bf16", (Made(down_dy, act * r * h, "down_proj's output gradient"),),
                                frees=(f"{g}/down dY fp32",), reduced=True),)),
        Step("dY * out summed over h", (Made(f"{g}/weights dw", width * r, "one value per slot, (k*b*s, 1)"),),
             frees=(f"{g}/sorted rows", f"{g}/weights dw rows"), reduced=True))
    biased = rules.SORTED_EXPERT_IDS in rules.moe_block(config)  # gpt-oss's: dY lives on for the bias's gradient
    down = _op("mlp.experts", (ledger.EXPERT_FC2_IN,), Step("down_proj's grouped GEMMs: dW, then dX", (
        Made(f"{g}/down dW", z.weight("mlp.experts.down_proj"), WHY_WGRAD),
        Made(f"{g}/down dX", act * r * f, "(k*b*s, e)")),
        frees=() if biased else (down_dy,), hands_over=() if tp else (f"{g}/down dW",)))
    product_swiglu = _op("mlp.experts", (ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT),
                         Step("SiLU(gate) * up's backward: dY * SiLU(gate)", (Made(f"{g}/up", act * r * f, "up's"),)),
                         Step("SiLU(gate) * up's backward: dY * up", (Made(f"{g}/silu", act * r * f, "SiLU's"),),
                              frees=(f"{g}/down dX",)))
    # SiLU's backward: its node still holds gate, and with it gate_up's (r, 2e) storage, whose up half the walk has
    # let go with the product's node: no moment
    silu = _op("mlp.experts.act_fn", (ledger.EXPERT_GATE,), Step("SiLU's backward", (
        Made(f"{g}/gate", act * r * f, "at its kept input"),), frees=(f"{g}/silu",), moment=False))
    chunk = _op("mlp.experts", (), Step("chunk's backward: gate's and up's gradients concatenated", (
        Made(f"{g}/gate_up dY", act * r * 2 * f, "(k*b*s, 2e)"),), frees=(f"{g}/gate", f"{g}/up")))
    gate_up = _op("mlp.experts", (ledger.EXPERT_IN, rules.EXPERT_OFFSETS), Step(
        "gate_up_proj's grouped GEMMs: dW, then dX", (
            Made(f"{g}/gate_up dW", z.weight("mlp.experts.gate_up_proj"), WHY_WGRAD),
            Made(f"{g}/gate_up dX", act * r * h, "(k*b*s, h)")),
        frees=() if biased else (f"{g}/gate_up dY",), hands_over=() if tp else (f"{g}/gate_up dW",)))
    weights = _op("mlp.experts", (rules.SORTED_SLOTS,), Step("indexing's backward: the weights' gradient in slots", (
        Made(f"{g}/weights zeros", width * r, "a zero (k*b*s,) tensor"),
        Made(f"{g}/weights put", width * r, "index_put's: the routing weights' gradient")),
        frees=(f"{g}/weights zeros", f"{g}/weights dw"), moment=False), sums.add("routing weights",
                                                                                 f"{g}/weights put", width * r))
    gather = _op("mlp.experts", (rules.TOKEN_INDICES,), Step("indexing's backward: the rows' dX summed per token", (
        Made(f"{g}/input zeros", z.full(h), "a zero (b*s, h) tensor"), Made(f"{g}/input put", z.full(h),
                                                                            "index_put's, accumulated")),
        frees=(f"{g}/input zeros", f"{g}/gate_up dX"), returns=True),
        sums.add("block input", f"{g}/input put", z.full(h)))
    # under tp the plan's hook made the weights local (to_local) as the experts began: autograd runs those last, the
    # down_proj's first, each handing its DTensor weight the gradient
    local = [_op("mlp.experts", (), Step("", hands_over=(f"{g}/{proj} dW",))) for proj in ("down", "gate_up")]
    ran = [combine, unsort, product, down, oss.bias_backward(g, "down", z, down_dy),
           *oss.glu_backward(g, act, r, f, f"{g}/down dX"), gate_up,
           oss.bias_backward(g, "gate_up", z, f"{g}/gate_up dY"), weights, gather] if biased else \
        [combine, unsort, product, down, product_swiglu, silu, chunk, gate_up, weights, gather]
    return ran + local if tp else ran


def _router(z: Sizes, config: ModelConfig, sums: _Sums, final: bool) -> list[Op]:
    """The router's backward (the division's and top-k's small fp32 gradients come and go: no moment); its dX summed
    into ln2's output gradient when it runs last (`final`)."""
    g, tokens, experts = f"{sums.stem}/router", z.b * z.s, config.num_experts
    topk = _op("mlp.gate", (rules.TOPK_SUM, rules.TOPK_WEIGHTS, ledger.ROUTER_TOPK_INDICES))
    cast = z.act != 4  # softmax(router_logits.float()): in fp32 no cast, nor its backward
    softmax = _op("mlp.gate", (rules.ROUTER_PROBS,), Step("top-k's and softmax's backward", (
        Made(f"{g}/logits fp32" if cast else f"{g}/logits", 4 * tokens * experts, "(b*s, E) fp32"),), moment=False),
        *((Step("the fp32 softmax's backward", (Made(f"{g}/logits", z.act * tokens * experts, "back to bf16"),),
                frees=(f"{g}/logits fp32",), moment=False),) if cast else ()))
    gate = linear("mlp.gate", ledger.MOE_IN if final else None, None, z.weight("mlp.gate"), f"{g}/input",
                  z.full(z.h), "", (f"{g}/logits",), dw=f"{g}/weight")
    return [topk, softmax, replace(gate, backward=(*gate.backward, *sums.router(g, z, OUTPUT_GRAD if final else "")))]


def _sigmoid_router(z: Sizes, config: ModelConfig, sums: _Sums) -> list[Op]:
    """DeepseekV3TopkRouter's backward: the scaling's, the division's and the sum's, gather's scatter into an (b*s, E)
    zero tensor and the sigmoid's, all small fp32 (no moment); then its fp32 GEMMs on the input's fp32 copy (dW, fp32
    as the weight, and dX), dX cast back to bf16 and summed last into ln2's output gradient."""
    g, tokens, experts = f"{sums.stem}/router", z.b * z.s, config.num_experts
    scores = _op("mlp.gate", (rules.TOPK_SUM, rules.TOPK_WEIGHTS, ledger.ROUTER_TOPK_INDICES, rules.ROUTER_SCORES),
                 Step("the top-k weights' and the sigmoid's backward", (Made(f"{g}/logits", 4 * tokens * experts,
                                                                             "(b*s, E) fp32"),),
                      frees=(sums.current["routing weights"],), moment=False))
    cast = z.act != 4  # hidden_states.type(float32): in fp32 a no-op, nor its backward
    gate = linear("mlp.gate", rules.ROUTER_IN_FP32 if cast else ledger.MOE_IN, None, z.weight("mlp.gate", 4),
                  f"{g}/input fp32" if cast else f"{g}/input", z.tokens(4 * z.h), "", (f"{g}/logits",),
                  dw=f"{g}/weight")
    back = (Step("the input's cast to fp32: its backward", (Made(f"{g}/input", z.full(z.h), "dX back to bf16"),),
                 frees=(f"{g}/input fp32",), moment=False),) if cast else ()
    return [scores, replace(gate, backward=(*gate.backward, *back, *sums.router(g, z, OUTPUT_GRAD)))]


# -- shared experts: an MLP of width u on every token, Qwen2-MoE's gated by sigmoid(shared_expert_gate(x)) ---------


def _shared_gate(z: Sizes, sums: _Sums) -> list[Op]:
    """The shared expert's gate, autograd's first ops in the block: its dX starts the block input's gradient."""
    g, tokens = f"{sums.stem}/shared", z.b * z.s
    product = _op("mlp", (rules.SHARED_OUT,), Step("(sigmoid * out)'s backward", (
        Made(f"{g}/gate full", z.full(z.h), "dY * out, before the sum"), Made(f"{g}/out", z.full(z.h), "dY * sigmoid"),
        Made(f"{g}/gate", z.act * tokens, "dY * out summed over h: (b*s, 1)")), frees=(f"{g}/gate full",),
        moment=False))
    sigmoid = _op("mlp", (rules.SHARED_GATE_SIGMOID,), Step("sigmoid's backward", (
        Made(f"{g}/gate logits", z.act * tokens, "from its kept output"),), frees=(f"{g}/gate",), moment=False))
    sums.add("block input", f"{g}/gate dX", z.full(z.h))  # its first gradient: no sum
    return [product, sigmoid, linear("mlp.shared_expert_gate", None, None, z.weight("mlp.shared_expert_gate"),
                                     f"{g}/gate dX", z.full(z.h),
                                     "", (f"{g}/gate logits",), dw=f"{g}/gate weight")]


def _shared_expert(z: Sizes, config: ModelConfig, sums: _Sums, last: bool) -> list[Op]:
    """Qwen2MoeMLP's backward, autograd's `last` in the block (its dY the gated product's), or DeepseekV3MLP's, its
    first (its dY the block's, the residual stream's, which lives on): its dX summed into the block input's
    gradient."""
    g, s, u = f"{sums.stem}/shared", "mlp.shared_expert" if last else "mlp.shared_experts", \
        config.moe_shared_expert_intermediate_size

    def gemms(proj: str, dy: str, saves: tuple[SavedTensor, ...], final: bool) -> Op:
        """up_proj or gate_proj: dW and dX (Qwen2-MoE's: no moment), then dX summed into the block input's
        gradient."""
        dx, weight = f"{g}/{proj} dX", f"{g}/{proj} weight"
        made = (Made(weight, z.weight(f"{s}.{proj}_proj"), WHY_WGRAD), Made(dx, z.full(z.h), "dY W"))
        return _op(f"{s}.{proj}_proj", saves, Step("GEMMs", made, frees=(dy,), moment=not last, returns=True),
                   sums.add("block input", dx, z.full(z.h), f"the shared expert's {proj}_proj dX summed into the"
                            " block's", OUTPUT_GRAD if final and last else ""),
                   Step("", hands_over=(weight,)))
    return [
        linear(f"{s}.down_proj", ledger.SHARED_FC2_IN, None, z.weight(f"{s}.down_proj"), f"{g}/down dX", z.full(u), "",
               (f"{g}/out",) if last else (), dw=f"{g}/down weight"),
        _op("mlp" if last else s, (ledger.SHARED_UP, ledger.SHARED_SILU_OUT), Step("SiLU(gate) * up's backward", (
            Made(f"{g}/up", z.full(u), "dY * SiLU(gate)"), Made(f"{g}/silu", z.full(u), "dY * up")),
            frees=(f"{g}/down dX",), moment=not last)),
        gemms("up", f"{g}/up", (), False),
        _op("mlp" if last else f"{s}.act_fn", (ledger.SHARED_GATE,), Step("SiLU's backward", (
            Made(f"{g}/gate", z.full(u), "at its kept input"),), frees=(f"{g}/silu",), moment=False)),
        gemms("gate", f"{g}/gate", (ledger.MOE_IN,), True),
    ]
