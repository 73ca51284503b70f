"""transformers' GptOssDecoderLayer's own ops for the hf step walk (`--impl hf`): RoPE on two halves (chunk, cat),
the eager core with attention sinks, GptOssTopKRouter and GptOssExperts' clamped GLU under grouped_mm; the rest is
Llama's walk (hf_layer) and Mixtral's grouped_mm experts (hf_moe). Each op: docs/timeline.md, "transformers' gpt-oss".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline import torch_ops
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import WHY_BGRAD, WHY_WGRAD
from memcalc.sizing.timeline.walk import Made, Op, Step, kept

TABLES = (rules.HALF_ROPE_COS, rules.HALF_ROPE_SIN)  # GptOssRotaryEmbedding's (1, s, d/2), kept by every layer


def eager_forward(p: str, z: Sizes, saved: dict[str, int], dropout: bool
                  ) -> tuple[tuple[Op, ...], frozenset[SavedTensor]]:
    """eager_attention_forward's widest forward moments: the rows' maximum subtracted from the scores joined to the
    sink column (the masked scores, a local the dropout rebinds, the joined logits, the maxima and their difference
    beside each other), the softmax over them, `dropout`'s output and mask (the masked scores rebound), then o_proj's
    input made (b, s, a, d) beside bmm's output; each with the
    attention's locals (RoPE's k and v_proj's output, where repeat_kv's copies are what matmul keeps). Of one K/V
    group (b > 1) repeat_kv's expand and reshape are views, and matmul copies V only as weights x V runs: made then."""
    sc, q = z.b * z.a_t * z.s * z.s, z.full(z.a_t * z.d)
    repeated = rules.K_EXPANDED.name in saved
    copied = (rules.V_EXPANDED,) if repeated and z.g_t == 1 else ()
    locals_ = tuple(Made(f"{p}/{n} heads", z.full(z.g_t * z.d), "a local of the attention") for n in ("k", "v")
                    ) if repeated else ()
    logits = z.act * (sc + z.b * z.a_t * z.s)
    joined = (Made(f"{p}/logits", logits, "torch.cat of the scores and the sinks, rebound by the subtraction"),
              Made(f"{p}/maxima", z.act * z.b * z.a_t * z.s, "max(dim=-1).values, (b, a, s, 1): a temporary"))
    shifted = Made(f"{p}/logits shifted", logits, "combined_logits minus the rows' maxima, a local to the core's return")
    context = () if z.s == 1 or z.a_t == 1 else (Made(f"{p}/context", q, "bmm's (b, a, s, d) output"),)
    masked, dropped = (f"{p}/scores masked",), (ledger.ATTN_DROPOUT_OUT, ledger.ATTN_DROPOUT_MASK) if dropout else ()
    return (Op("self_attn", (
        Step("the rows' maxima subtracted from the scores and the sink", (
            *locals_, Made(f"{p}/scores masked", z.act * sc, "the scores plus the mask, a local the dropout rebinds"),
            *joined, shifted), frees=tuple(x.name for x in joined)),
        Step("the softmax over them", (kept(p, rules.SINK_SOFTMAX),), frees=() if dropout else masked),
        *((Step("native_dropout: its output and bool mask", tuple(kept(p, x) for x in dropped), frees=masked),)
          if dropout else ()),
        Step("weights x V, made (b, s, a, d)", (*(kept(p, x) for x in copied), kept(p, ledger.PROJ_IN), *context),
             frees=tuple(x.name for x in (*context, shifted, *locals_))),
    ), ()),), frozenset((rules.SINK_SOFTMAX, *dropped, *copied))


def glu_backward(g: str, act: int, r: int, f: int, dy: str) -> tuple[Op, ...]:
    """GptOssExperts._apply_gate's backward in autograd's order, on the k*b*s sorted rows of e channels: the product's
    two gradients, gate * sigmoid(gate * alpha)'s (gate's two summed), each clamp's (a 0-d zero, its bounds' bool masks,
    torch.where), then each strided half placed in a zero (r, 2e) tensor and the two summed: gate_up's output gradient.
    `dy`: down_proj's dX."""
    x, mask, zero = act * r * f, r * f, f"{g}/clamp zero"

    def clamp(half: str, bounds: tuple[str, ...], grad: str, saves: tuple[SavedTensor, ...]) -> Op:
        masks = tuple(Made(f"{g}/{half} {bound} mask", mask, f"{half} {bound} its bound, bool") for bound in bounds)
        return Op("mlp.experts", (), (Step(f"{half}'s clamp's backward: dY where {half} lay within its bounds", (
            Made(zero, act, "scalar_tensor(0), a 0-d tensor"), *masks,
            Made(f"{g}/{half} clamped", x, f"{half}'s gradient")), frees=(zero, *(m.name for m in masks), grad)),),
            saves)

    return (
        Op("mlp.experts", (), (
            Step("(up + 1) * glu's backward: dY * glu", (Made(f"{g}/up plus one", x, "up + 1's gradient"),)),
            Step("(up + 1) * glu's backward: dY * (up + 1)", (Made(f"{g}/glu", x, "glu's gradient"),), frees=(dy,)),
        ), (rules.GLU_UP_PLUS_ONE, rules.GLU_OUT)),
        Op("mlp.experts", (), (
            Step("gate * sigmoid(.)'s backward: dY * sigmoid(.)", (Made(f"{g}/gate product", x, "gate's first"),)),
            Step("gate * sigmoid(.)'s backward: dY * gate", (Made(f"{g}/sigmoid", x, "sigmoid(.)'s gradient"),),
                 frees=(f"{g}/glu",)),
        ), (rules.GLU_GATE, rules.GLU_SIGMOID)),
        Op("mlp.experts", (), (Step("sigmoid's backward, from its kept output", (
            Made(f"{g}/gate alpha", x, "gate * alpha's gradient"),), frees=(f"{g}/sigmoid",)),), (rules.GLU_SIGMOID,)),
        Op("mlp.experts", (), (
            Step("(gate * alpha)'s backward", (Made(f"{g}/gate scaled", x, "gate's second gradient"),),
                 frees=(f"{g}/gate alpha",)),
            Step("autograd sums gate's two gradients", (Made(f"{g}/gate", x, "the clamped gate's gradient"),),
                 frees=(f"{g}/gate product", f"{g}/gate scaled")),
        )),
        clamp("up", ("over min", "under max"), f"{g}/up plus one", ()),
        # both halves are views of gate_up's (r, 2e) output, which goes once both clamps' nodes have run
        clamp("gate", ("under max",), f"{g}/gate", (rules.GLU_GATE_IN, rules.GLU_UP_IN)),
        Op("mlp.experts", (), (
            Step("gate's slice's backward: a zero (r, 2e) tensor, its even columns dY", (
                Made(f"{g}/gate placed", 2 * x, "(k*b*s, 2e)"),), frees=(f"{g}/gate clamped",)),
            Step("up's slice's backward: its odd columns", (Made(f"{g}/up placed", 2 * x, "(k*b*s, 2e)"),),
                 frees=(f"{g}/up clamped",)),
            Step("autograd sums the halves' gradients: gate_up's output gradient", (
                Made(f"{g}/gate_up dY", 2 * x, "(k*b*s, 2e)"),), frees=(f"{g}/gate placed", f"{g}/up placed")),
        )),
    )


def bias_backward(g: str, proj: str, z: Sizes, dy: str) -> Op:
    """{proj}_bias[sorted ids]'s backward: the rows' gradient (`dy`, which the in-place bias add passes on beside the
    GEMM's) accumulated into a zero (E, width) tensor at each row's expert, handed over; dY goes after it."""
    nbytes = z.weight(f"mlp.experts.{proj}_proj_bias")
    return Op("mlp.experts", (), (
        Step(f"{proj}_bias's gradient: index_put into a zero (E, width) tensor", (
            Made(f"{g}/{proj} bias zeros", nbytes, "a zero (E, width) tensor"),
            Made(f"{g}/{proj} bias", nbytes, "index_put's, accumulated: the bias's gradient")),
            frees=(f"{g}/{proj} bias zeros", dy), hands_over=(f"{g}/{proj} bias",)),), (rules.SORTED_EXPERT_IDS,))


def router_backward(g: str, z: Sizes, k: int, experts: int, summed: tuple[Step, ...]) -> tuple[Op, ...]:
    """GptOssTopKRouter's backward in autograd's order: the top-k softmax's (in the activation dtype), top-k's scatter
    into a zero (b*s, E) tensor, then F.linear's GEMMs and its bias's sum; its dX summed into the block input's gradient
    (`summed`, the steps that sum it, hf_moe's) before autograd hands the weight's and the bias's gradients over."""
    tokens, act = z.b * z.s, z.act
    logits = act * tokens * experts
    return (
        Op("mlp.router", (), (Step("the top-k softmax's backward", (
            Made(f"{g}/top values", act * tokens * k, "the k chosen logits' gradient"),)),), (rules.ROUTER_TOPK_SOFTMAX,)),
        Op("mlp.router", (), (Step("top-k's backward: scattered into a zero (b*s, E) tensor", (
            Made(f"{g}/logits zeros", logits, "a zero (b*s, E) tensor"), Made(f"{g}/logits", logits, "scatter's")),
            frees=(f"{g}/logits zeros", f"{g}/top values")),), (ledger.ROUTER_TOPK_INDICES,)),
        Op("mlp.router", (), (
            Step("GEMMs: dX and dW", (Made(f"{g}/input", z.full(z.h), "dY W"), Made(
                f"{g}/weight", z.weight("mlp.router"), WHY_WGRAD)), returns=True, moment=False),
            Step("the bias's gradient: dY summed over the tokens", (Made(
                f"{g}/bias", z.weight("mlp.router.bias"), WHY_BGRAD),), frees=(f"{g}/logits",), reduced=True,
                moment=False),
            *summed,
            Step("", hands_over=(f"{g}/bias", f"{g}/weight")),
        ), (ledger.MOE_IN,)),
    )


def rope(g: str, z: Sizes, first: tuple[str, ...]) -> tuple[Op, ...]:
    """_apply_rotary_emb's backward for q, then k (forward order; k's runs first): each half's two products' gradients
    (-dY's for the subtracted one), each half's summed, chunk's concatenation; q's frees the model's tables the layer
    is the `first` to read (layers.0's). The walk takes the layer's forward as one moment: no forward steps."""
    def backward(name: str, width: int, tables: tuple[str, ...]) -> tuple[Step, ...]:
        x, half = f"{g}/{name}", width // 2
        products = tuple(Made(f"{x} {n}", half, why) for n, why in (
            ("x1 sin", "dY2 * sin: x1's gradient in x2 * cos + x1 * sin"), ("x2 cos", "dY2 * cos"),
            ("-dY1", "first = x1 * cos - x2 * sin: -dY1"), ("x2 sin", "-dY1 * sin")))
        return (
            Step("RoPE's backward: each half's products", products, frees=(f"{x} -dY1",)),
            Step("x2's two gradients summed", (Made(f"{x} x2", half, "x2's gradient"),),
                 frees=(f"{x} x2 cos", f"{x} x2 sin"), moment=False),
            Step("x1 * cos's backward, x1's two gradients summed", (Made(f"{x} x1 cos", half, "dY1 * cos"),
                                                                     Made(f"{x} x1", half, "x1's gradient")),
                 frees=(f"{x} x1 sin", f"{x} x1 cos"), moment=False),
            Step("chunk's backward: the halves' gradients concatenated", (Made(f"{x} pre-rope", width, "(b, heads, s,"
                                                                                " d)"),),
                 frees=(f"{x} x1", f"{x} x2", f"{x} heads", *tables), moment=False),
        )
    return tuple(Op("self_attn", (), backward(name, z.full(w * z.d), first if name == "q" else ()))
                 for name, w in (("q", z.a_t), ("k", z.g_t)))


def eager_core(p: str, z: Sizes, saved: dict[str, int], gqa: bool, dropout: bool) -> tuple[Op, ...]:
    """eager_attention_forward with the sinks, its backward in forward order of its ops: repeat_kv's sums over each
    group's heads (`gqa`), QK^T's, the scale's and cat's (the logits' two gradients summed; the sinks' summed to (a,)),
    max's scatter, the subtraction's, the softmax's (in the activation dtype), slice's, `dropout`'s (its bool mask)
    and weights x V's. K and V as matmul keeps them: repeat_kv's copies, or (the ledger's REPEAT_KV) the heads
    themselves."""
    g, a = f"grad/{p}", z.b * z.a_t * z.s
    scores, logits = z.act * a * z.s, z.act * a * (z.s + 1)
    expanded = rules.K_EXPANDED.name in saved
    k, v = (rules.K_EXPANDED, rules.V_EXPANDED) if expanded else (ledger.K, ledger.V)
    sums, qk, context = torch_ops.core_backward(g, z, gqa, f"{g}/weights", scores)
    return (
        Op("self_attn", (), sums),
        Op("self_attn", (), (qk,), (ledger.Q, k)),
        Op("self_attn", (), (
            Step("autograd sums the logits' two gradients", (Made(f"{g}/logits", logits, "the softmax's and max's"),),
                 frees=(f"{g}/shifted", f"{g}/max scattered")),
            Step("cat's backward: the sinks' gradient summed over the batch and the queries", (
                Made(f"{g}/sinks", z.weight("self_attn.sinks"), "(a,)"),), hands_over=(f"{g}/sinks",), moment=False),
            Step("the scale's backward", (Made(f"{g}/scaled scores", scores, "the mask's add passes it on"),),
                 frees=(f"{g}/logits",)),
        )),
        Op("self_attn", (), (Step("max's backward: scattered into a zero (b, a, s, s + 1) tensor", (
            Made(f"{g}/max zeros", logits, "a zero tensor"), Made(f"{g}/max scattered", logits, "scatter's")),
            frees=(f"{g}/max zeros", f"{g}/maxima")),), (rules.SINK_MAX_INDICES,)),
        Op("self_attn", (), (Step("the subtraction's backward: -dY summed to the rows' maxima", (
            Made(f"{g}/-dY", logits, "neg"), Made(f"{g}/maxima", z.act * a, "(b, a, s, 1)")), frees=(f"{g}/-dY",)),)),
        Op("self_attn", (), (Step("the softmax's backward", (Made(f"{g}/shifted", logits, "from its kept output"),),
                                  frees=(f"{g}/probs",)),), (rules.SINK_SOFTMAX,)),
        Op("self_attn", (), (Step("the slice's backward: dWeights in a zero (b, a, s, s + 1) tensor", (
            Made(f"{g}/probs", logits, "the sink column's gradient zero"),),
            frees=(f"{g}/dropped" if dropout else f"{g}/weights",)),)),
        *((replace(torch_ops.dropout("self_attn", p, ledger.ATTN_DROPOUT_MASK, kept(p, ledger.ATTN_DROPOUT_OUT),
                                     f"{g}/dropped", scores, frees=(f"{g}/weights",)), forward=()),)
          if dropout else ()),
        Op("self_attn", (), context, (ledger.ATTN_DROPOUT_OUT if dropout else rules.SINK_SOFTMAX, v)),
    )


def experts_forward(p: str, out: str, z: Sizes, config: ModelConfig, logits: Made) -> Op:
    """GptOssExperts under grouped_mm, its widest forward moments: (up + 1) * glu made, _apply_gate's clamped up and
    the rows' gate_up biases beside it; then the weighted rows put back in slot order (down_proj's output and the
    inverse permutation, kept, made by then), beside the rows' down biases, held to the return; then the sum over
    each token's k slots, `out`. The router's `logits` (the block's `_`) live throughout."""
    m, r, f, act = f"{p}/moe", config.moe_router_topk * z.b * z.s, config.expert_ffn, z.act
    counts = (Made(f"{m}/histc input", 4 * r, "the sorted ids as fp32 (histc takes no integers on the CPU)"),
              Made(f"{m}/tokens per expert", 4 * config.num_experts, "histc's (E,) fp32 counts"))
    return Op("mlp.experts", forward=(
        Step("(up + 1) * glu: the gated rows", (
            logits, *counts, Made(f"{m}/gate_up biases", act * r * 2 * f, "gate_up_proj_bias[sorted ids], a local"),
            Made(f"{m}/up clamped", act * r * f, "up.clamp(-limit, limit), a local of _apply_gate"),
            kept(p, ledger.EXPERT_FC2_IN)), frees=(f"{m}/gate_up biases", f"{m}/up clamped")),
        Step("the weighted rows put back in slot order", (
            kept(p, rules.EXPERT_OUT), kept(p, rules.UNSORTED_SLOTS),
            Made(f"{m}/down biases", act * r * z.h, "down_proj_bias[sorted ids], a local"),
            Made(f"{m}/weighted", act * r * z.h, "down_proj's rows * their routing weights, in expert order"),
            Made(f"{m}/slot order", act * r * z.h, "weighted_out[inv_perm]: the rows in slot order")),
            frees=(f"{m}/weighted",)),
        Step("the rows summed over each token's k slots", (Made(out, z.full(z.h), "view(b*s, k, h).sum(1)"),),
             frees=(f"{m}/slot order", f"{m}/down biases", *(x.name for x in counts))),
    ), backward=())
