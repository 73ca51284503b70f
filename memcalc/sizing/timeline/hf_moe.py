"""transformers' sparse MoE blocks in the hf step walk (`--impl hf`, t = 1): Mixtral's (MixtralSparseMoeBlock) and
Qwen2-MoE's (Qwen2MoeSparseMoeBlock: the same experts beside a gated shared expert), op by op.

The experts run transformers' eager loop (experts_implementation eager); its default, grouped_mm,
is not walked yet and `check_modelled` refuses it. The block's forward keeps the hf ledger's
tensors (memcalc.model.impls.hf.moe_block); the experts' rows are kept one storage per expert, r = kbs/E slots each under the balanced
bound, which `memcalc measure --step --route balanced` forces (memcalc.probe.libs.hf_shim).
Its widest forward moments are the last expert's weighted output and, with a shared expert,
the block's sum (`block_forward`). Backward, as autograd orders it:

    shared gate (Qwen2-MoE) sigmoid(gate(x)) * out's gradients, sigmoid's, the gate's GEMMs;
                its dX starts the block input's gradient
    combine     index_add_'s backward gathers the expert's dY rows; Mixtral's cast to bf16
                makes them fp32; the routing weight's product gives dY * w and dY * out
                (fp32 in Mixtral, whose weights are fp32), the latter summed to one value per
                slot, which index's backward puts into a (b*s, k) zero tensor
    down_proj   dW^T and dX; down_proj[e]'s backward (select) writes dW into a zero (E, h, e)
                tensor, and autograd sums it with the experts before (a new tensor each time)
    SwiGLU      the product's two gradients, SiLU's, and gate_up's dY concatenated
    gate_up     dW^T and dX; select's zero (E, 2e, h) tensor, summed likewise: the widest moment
                of the experts, the sum, its two inputs and the down_proj sum live together
    gather      hidden_states[token_idx]'s backward puts dX into a zero (b*s, h) tensor, summed
                into the block input's gradient
    router      top-k, the fp32 softmax and F.linear backward: the router's dW (E, h) and dX,
                summed in (Mixtral: into ln2's output gradient)
    shared MLP  (Qwen2-MoE) down_proj, SiLU(gate) * up, up_proj, SiLU, gate_proj; up's and gate's
                dX summed in, the last into ln2's output gradient

Each expert weight's gradient is handed to the parameter (and added into the fp32 buffer)
when the last expert's sum is made. Exact for MixtralForCausalLM and Qwen2MoeForCausalLM
from transformers 5.24 on torch 2.13's CPU kernels with the router forced balanced and E
dividing kbs (tests/probe/libs/test_hf_step.py); the real router gives each expert a
data-dependent count and so other bytes, and the worst-case bound other ones again:
`check_modelled` refuses both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.sizing.timeline.hf_walk import WHY_WGRAD, HfWalk

if TYPE_CHECKING:
    from memcalc.config.schema import ModelConfig

# The block's tensors kept one storage per expert: the ledger's row is E of them (memcalc.probe.libs.hf
# merges them the same way).
EXPERT_TENSORS = (
    rules.TOKEN_SLOTS, ledger.EXPERT_IN, ledger.EXPERT_GATE, ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT,
    ledger.EXPERT_FC2_IN, rules.EXPERT_WEIGHT, rules.EXPERT_WEIGHT_CAST, rules.EXPERT_OUT, rules.COMBINE_IN,
)
_EXPERT_NAMES = frozenset(x.name for x in EXPERT_TENSORS)


def is_per_expert(name: str) -> bool:
    """A ledger row the walk keeps as E storages, one per expert, each freed when its expert's backward runs."""
    return name in _EXPERT_NAMES


def made_after_experts(name: str) -> bool:
    """A kept tensor of the block made after the experts' loop (the shared expert's gate): `block_forward` adds it."""
    return name == rules.SHARED_GATE_SIGMOID.name


def kept(p: str, name: str, e: int) -> str:
    """The tape's name for expert e's share of a ledger row in layer `p`."""
    return f"{p}/{name}[{e}]"


def block_forward(step: HfWalk, p: str, m: str) -> None:
    """The block's widest forward moments, with `{p}/mlp output` (what the block returns) live after them.

    The last expert's weighted output (cast to bf16 in Mixtral's, already bf16 in Qwen2-MoE's): every expert's
    kept tensors made, beside the block's locals (the router's logits, the top-k weights the experts read) and the
    loop's (its routing mask, the experts it hit; in Mixtral's that expert's fp32 product). An earlier expert's
    moments hold the same transients and fewer kept tensors: each expert after it keeps its weighted output
    twice, 4 r_e h bytes, as much as the fp32 product the loop may still hold. With a shared expert, then the
    block's sum: the experts' output, the gated shared expert's and their sum.
    """
    c, z = step.config, step.z
    shared = _shared(c)
    tokens, k = c.b * c.s, c.moe_router_topk
    experts_out = f"{p}/moe/experts output" if shared else f"{p}/mlp output"
    step.add(experts_out, z.full(z.h), "zeros_like(x), the experts' index_add_ target" + (
        ", summed with the gated shared expert's output" if shared else ": the block's output"))
    step.add(f"{p}/moe/router_logits", z.act * tokens * c.num_experts,
             "F.linear's (b*s, E) logits: the router returns them, the block's `_` holds them until it returns")
    step.add(f"{p}/moe/top_k_weights", (z.act if shared else 4) * tokens * k,
             "the top-k weights the experts read, (b*s, k): " + ("cast to bf16" if shared else "fp32"))
    step.add(f"{p}/moe/expert_mask", 8 * tokens * k * (c.num_experts + 1),
             "one_hot(top_k_index, E + 1): a (b*s, k, E + 1) int64 mask, live through the experts' loop")
    step.add(f"{p}/moe/expert_hit", 8 * c.num_experts, "nonzero(the mask's sums): the E experts hit, (E, 1) int64")
    if not shared:  # Qwen2-MoE's weights are bf16 already: the product is the kept bf16 output itself
        step.add(f"{p}/moe/weighted fp32", 4 * _slots(step) * c.h, "expert output * its fp32 routing weight:"
                 " (r_e, h) fp32, cast to bf16 for index_add_; the loop's variable holds it until the loop returns")
    step.tape.mark("forward", f"{m}.mlp.experts", "the last expert's weighted output" + ("" if shared else
                                                                                           " cast to bf16"))
    step.tape.drop(*(f"{p}/moe/{x}" for x in ("expert_mask", "expert_hit", "weighted fp32")))
    if shared:
        name = rules.SHARED_GATE_SIGMOID.name
        step.add(f"{p}/{name}", step.saved[name], "kept for backward (the hf ledger)")
        step.add(f"{p}/moe/shared gated", z.full(z.h), "sigmoid(shared_expert_gate(x)) * shared_expert(x)")
        step.add(f"{p}/mlp output", z.full(z.h), "the experts' and the gated shared expert's outputs summed")
        step.tape.mark("forward", f"{m}.mlp", "the experts' and the gated shared expert's outputs summed")
        step.tape.drop(experts_out, f"{p}/moe/shared gated")
    step.tape.drop(f"{p}/moe/router_logits", f"{p}/moe/top_k_weights")


def _shared(config: ModelConfig) -> bool:
    """Qwen2-MoE's block (a gated shared expert beside the routed ones), else Mixtral's."""
    return bool(config.moe_shared_expert_intermediate_size)


def moe_backward(step: HfWalk, p: str, m: str) -> None:
    """The block's backward: the shared expert's gate (Qwen2-MoE), each expert, the last first, the router, the
    shared expert; ends with ln2's output gradient, every path's input gradient summed as autograd adds them."""
    shared, experts = _shared(step.config), step.config.num_experts
    if shared:
        _shared_gate_backward(step, p, m)
    for i, e in enumerate(reversed(range(experts))):
        _expert_backward(step, p, m, e, i + shared, last=i == experts - 1)
    _router_backward(step, p, m, final=not shared)
    if shared:
        _shared_expert_backward(step, p, m)
    # The routers' output gradient: measured live until the block's backward returns (autograd and the tracker's
    # module hooks let it go then).
    step.tape.drop(f"grad/{p}/routing weights")


def _expert_backward(step: HfWalk, p: str, m: str, e: int, i: int, last: bool) -> None:
    """Expert e's ops, after i gradients reached the block's input: the combine, down_proj, SwiGLU, gate_up, the
    gather."""
    _combine_backward(step, p, m, e, i)
    z, f, g, where = step.z, step.config.expert_ffn, f"grad/{p}/expert {e}", f"{m}.mlp.experts"
    r, experts, first = _slots(step), step.config.num_experts, e == step.config.num_experts - 1
    # down_proj: mm(x, down_proj[e].t()): dW^T = x^T dY, then dX = dY W
    step.add(f"{g}/down dW", z.act * f * z.h, "down_proj[e]'s dW^T = x^T dY, (e, h)")
    step.add(f"{g}/down dX", z.act * r * f, "down_proj[e]'s dX = dY W, (r_e, e)")
    step.tape.drop(kept(p, ledger.EXPERT_FC2_IN.name, e), f"{g}/combine dY bf16")
    _select_backward(step, p, where, g, "down", z.act * experts * z.h * f, first, last, f"{g}/down dW")
    # SiLU(gate) * up, SiLU, then gate's and up's gradients concatenated as gate_up's dY
    step.add(f"{g}/up", z.act * r * f, "SiLU(gate) * up's backward: dY * SiLU(gate)")
    step.add(f"{g}/silu", z.act * r * f, "SiLU(gate) * up's backward: dY * up")
    step.tape.drop(f"{g}/down dX", kept(p, ledger.EXPERT_SILU_OUT.name, e))
    step.add(f"{g}/gate", z.act * r * f, "SiLU's backward, at its kept input")
    step.tape.drop(f"{g}/silu", kept(p, ledger.EXPERT_GATE.name, e), kept(p, ledger.EXPERT_UP.name, e))
    step.add(f"{g}/gate_up dY", z.act * r * 2 * f, "chunk's backward: gate's and up's gradients concatenated")
    step.tape.drop(f"{g}/gate", f"{g}/up")
    # gate_up_proj: dW^T and dX, then select's zero tensor summed with the experts before
    step.add(f"{g}/gate_up dW", z.act * z.h * 2 * f, "gate_up_proj[e]'s dW^T = x^T dY, (h, 2e)")
    step.add(f"{g}/gate_up dX", z.act * r * z.h, "gate_up_proj[e]'s dX = dY W, (r_e, h)")
    step.tape.drop(kept(p, ledger.EXPERT_IN.name, e), f"{g}/gate_up dY")
    _select_backward(step, p, where, g, "gate_up", z.act * experts * 2 * f * z.h, first, last, f"{g}/gate_up dW")
    _gather_backward(step, p, g, e, i)


def _slots(step: HfWalk) -> int:
    """r_e: the slots each expert gets under the balanced bound, kbs/E."""
    c = step.config
    return c.moe_router_topk * c.b * c.s // c.num_experts


def _combine_backward(step: HfWalk, p: str, m: str, e: int, i: int) -> None:
    """index_add_'s (and in Mixtral's block the cast's) backward, the routing weight's product's; the weight's
    gradient put into a (b*s, k) zero tensor (fp32 in Mixtral's block, bf16 in Qwen2-MoE's)."""
    z, g, r, add, drop = step.z, f"grad/{p}/expert {e}", _slots(step), step.add, step.tape.drop
    k, tokens, shared = step.config.moe_router_topk, z.b * z.s, _shared(step.config)
    width = z.act if shared else 4  # the routing weights' dtype, and so the product's
    add(f"{g}/combine rows", z.act * r * z.h, "index_add_'s backward: dY's rows at the expert's tokens")
    if not shared:
        add(f"{g}/combine rows fp32", 4 * r * z.h, "the cast to bf16's backward: the rows cast up to fp32")
    drop(kept(p, rules.COMBINE_IN.name, e), *(() if shared else (f"{g}/combine rows",)))
    if not shared:
        add(f"{g}/combine dY fp32", 4 * r * z.h, "(out * w)'s backward for out: dY * w, fp32")
    add(f"{g}/combine dw rows", width * r * z.h, "(out * w)'s backward for w: dY * out, before the sum")
    if shared:
        add(f"{g}/combine dY bf16", z.act * r * z.h, "(out * w)'s backward for out: dY * w")
    else:
        add(f"{g}/combine dY bf16", z.act * r * z.h, "dY * w cast to the expert output's bf16")
    step.tape.mark("backward", f"{m}.mlp.experts", f"expert {e}: the routing weight's product, its gradients")
    if not shared:
        drop(f"{g}/combine dw rows")
    add(f"{g}/combine dw", width * r, "dY * out summed over h: one value per slot")
    drop(f"{g}/combine dY fp32", f"{g}/combine rows fp32", f"{g}/combine rows", f"{g}/combine dw rows",
         *(kept(p, x.name, e) for x in (rules.EXPERT_OUT, rules.EXPERT_WEIGHT, rules.EXPERT_WEIGHT_CAST)))
    add(f"{g}/weights zeros", width * tokens * k, "index's backward: a (b*s, k) zero tensor")
    add(f"{g}/weights put", width * tokens * k, "index_put with accumulate: the slots' gradients in place of zeros")
    drop(f"{g}/weights zeros", f"{g}/combine dw")
    _accumulate(step, f"grad/{p}/routing weights", f"{g}/weights put", i - _shared(step.config),
                width * tokens * k, "the routing weights' gradient, (b*s, k), summed over the experts")


def _select_backward(step: HfWalk, p: str, where: str, g: str, proj: str, nbytes: int, first: bool, last: bool,
                     dw: str) -> None:
    """proj[e]'s select backward: dW in a zero (E, ...) tensor; from the second expert on summed with the sum
    before, a new tensor; the last expert's sum is handed to the parameter (and into the fp32 buffer)."""
    step.add(f"{g}/{proj} select", nbytes, f"{proj}[e]'s backward: the expert's dW in a zero (E, ...) tensor")
    total = f"grad/{p}/{proj} weights"
    step.tape.drop(dw)
    if first:
        step.tape.rename(f"{g}/{proj} select", total)
    else:
        step.add(f"{total} (sum)", nbytes, f"autograd sums {proj}'s gradients from the experts so far")
        step.tape.mark("backward", where, f"{proj}'s gradients summed: the sum, its two inputs")
        step.tape.drop(total, f"{g}/{proj} select")
        step.tape.rename(f"{total} (sum)", total)
    if last:  # autograd hands the whole gradient to the parameter: added into the fp32 buffer and dropped
        step.tape.drop(total)


def _gather_backward(step: HfWalk, p: str, g: str, e: int, i: int) -> None:
    """hidden_states[token_idx]'s backward: dX put into a zero (b*s, h) tensor, summed with the block input's
    gradients before it (i of them)."""
    z, add = step.z, step.add
    add(f"{g}/input zeros", z.full(z.h), "index's backward: a (b*s, h) zero tensor")
    add(f"{g}/input put", z.full(z.h), "index_put with accumulate: the expert's dX at its tokens")
    step.tape.drop(f"{g}/input zeros", f"{g}/gate_up dX", kept(p, rules.TOKEN_SLOTS.name, e))
    _accumulate(step, f"grad/{p}/block input", f"{g}/input put", i, z.full(z.h),
                "the block input's gradient, summed over its paths as autograd reaches them")


def _accumulate(step: HfWalk, total: str, new: str, i: int, nbytes: int, why: str) -> None:
    """Autograd's sum of one more gradient into `total`, which i gradients made before: a new tensor unless first."""
    if not i:
        step.tape.rename(new, total)
        return
    step.add(f"{total} (sum)", nbytes, why)
    step.tape.drop(total, new)
    step.tape.rename(f"{total} (sum)", total)


def _summed(step: HfWalk, p: str, dx: str, where: str, what: str, final: bool) -> None:
    """One more path's dX added into the block input's gradient, a new tensor: the last is ln2's output
    gradient."""
    out = f"grad/{p}/ln2 output" if final else f"grad/{p}/block input (sum)"
    step.add(out, step.z.full(step.z.h), "autograd sums the block input's gradients, one path at a time")
    step.tape.mark("backward", where, what)
    step.tape.drop(dx, f"grad/{p}/block input")
    if not final:
        step.tape.rename(out, f"grad/{p}/block input")


def _router_backward(step: HfWalk, p: str, m: str, final: bool) -> None:
    """The router's backward: the division, top-k, the fp32 softmax, the cast, F.linear; then dX summed with the
    block input's other gradients (ln2's output gradient in Mixtral's block, whose router runs last).

    The division's and top-k's (b*s, k) and (b*s, 1) fp32 gradients come and go before the softmax's: no moment.
    """
    z, add, drop, mark = step.z, step.add, step.tape.drop, step.tape.mark
    tokens, experts = z.b * z.s, step.config.num_experts
    g, where = f"grad/{p}/router", f"{m}.mlp.gate"
    drop(*(f"{p}/{x.name}" for x in (rules.TOPK_SUM, rules.TOPK_WEIGHTS, ledger.ROUTER_TOPK_INDICES)))
    add(f"{g}/logits fp32", 4 * tokens * experts, "top-k's and softmax's backward: (b*s, E) fp32")
    drop(f"{p}/{rules.ROUTER_PROBS.name}")
    add(f"{g}/logits", z.act * tokens * experts, "the fp32 softmax's backward: (b*s, E) back to bf16")
    drop(f"{g}/logits fp32")
    add(f"{g}/weight", z.act * experts * z.h, "the router's dW = dLogits^T X, (E, h)")
    add(f"{g}/input", z.full(z.h), "the router's dX = dLogits W, (b*s, h)")
    mark("backward", where, "the router's GEMMs: dW and dX")
    drop(*((f"{p}/{ledger.MOE_IN.name}",) if final else ()), f"{g}/logits", f"{g}/weight")  # its last reader
    _summed(step, p, f"{g}/input", where, "the router's input gradient summed with the block's others", final)


# -- Qwen2-MoE's shared expert: an MLP of width u on every token, gated by sigmoid(shared_expert_gate(x)) ---------


def _shared_gate_backward(step: HfWalk, p: str, m: str) -> None:
    """The gate's product, its sigmoid and its (1, h) linear, autograd's first ops in the block: the gate's dX
    starts the block input's gradient."""
    z, add, drop = step.z, step.add, step.tape.drop
    g, tokens = f"grad/{p}/shared", z.b * z.s
    add(f"{g}/gate full", z.full(z.h), "(sigmoid * out)'s backward for the sigmoid: dY * out, before the sum")
    add(f"{g}/out", z.full(z.h), "(sigmoid * out)'s backward for the shared expert's output: dY * sigmoid")
    add(f"{g}/gate", z.act * tokens, "dY * out summed over h: (b*s, 1)")
    drop(f"{g}/gate full", f"{p}/{rules.SHARED_OUT.name}")
    add(f"{g}/gate logits", z.act * tokens, "sigmoid's backward, from its kept output")
    drop(f"{g}/gate", f"{p}/{rules.SHARED_GATE_SIGMOID.name}")
    add(f"{g}/gate weight", z.act * z.h, "shared_expert_gate's dW, (1, h)")
    add(f"grad/{p}/block input", z.full(z.h), "shared_expert_gate's dX: the block input's first gradient")
    step.tape.mark("backward", f"{m}.mlp.shared_expert_gate", "the shared expert gate's GEMMs: dW and dX")
    drop(f"{g}/gate logits", f"{g}/gate weight")


def _shared_expert_backward(step: HfWalk, p: str, m: str) -> None:
    """Qwen2MoeMLP's backward, autograd's last in the block: down_proj, SiLU(gate) * up, up_proj, SiLU, gate_proj;
    up_proj's and gate_proj's dX summed into the block input's gradient, the last into ln2's."""
    z, add, drop, u = step.z, step.add, step.tape.drop, step.config.moe_shared_expert_intermediate_size
    g, s = f"grad/{p}/shared", f"{m}.mlp.shared_expert"
    add(f"{g}/down weight", z.act * z.h * u, WHY_WGRAD)
    add(f"{g}/down dX", z.full(u), "down_proj's dX = dY W, (b*s, u)")
    step.tape.mark("backward", f"{s}.down_proj", "the shared expert's down_proj: dW and dX")
    drop(f"{g}/down weight", f"{p}/{ledger.SHARED_FC2_IN.name}", f"{g}/out")
    add(f"{g}/up", z.full(u), "SiLU(gate) * up's backward: dY * SiLU(gate)")
    add(f"{g}/silu", z.full(u), "SiLU(gate) * up's backward: dY * up")
    drop(f"{p}/{ledger.SHARED_UP.name}", f"{p}/{ledger.SHARED_SILU_OUT.name}", f"{g}/down dX")
    add(f"{g}/up weight", z.act * u * z.h, WHY_WGRAD)
    add(f"{g}/up dX", z.full(z.h), "up_proj's dX = dY W")
    drop(f"{g}/up")
    _summed(step, p, f"{g}/up dX", f"{s}.up_proj", "the shared expert's up_proj dX summed into the block's", False)
    drop(f"{g}/up weight")
    add(f"{g}/gate", z.full(u), "SiLU's backward, at its kept input")
    drop(f"{p}/{ledger.SHARED_GATE.name}", f"{g}/silu")
    add(f"{g}/gate weight", z.act * u * z.h, WHY_WGRAD)
    add(f"{g}/gate dX", z.full(z.h), "gate_proj's dX = dY W")
    drop(f"{p}/{ledger.MOE_IN.name}", f"{g}/gate")  # gate_proj is the block input's last reader
    _summed(step, p, f"{g}/gate dX", f"{s}.gate_proj", "the shared expert's gate_proj dX: ln2's output gradient", True)
    drop(f"{g}/gate weight")
