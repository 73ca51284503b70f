"""transformers' OlmoForCausalLM for the hf step walk: Llama's model with two differences, described here as ops.

OlmoLayerNorm (input_layernorm, post_attention_layernorm, the final norm) is F.layer_norm without weight or bias on
x.to(float32), cast back; OlmoRotaryEmbedding returns its cos and sin tables in fp32 (no cast to x's dtype), so
apply_rotary_pos_emb's products run in fp32 and its outputs are cast back (OLMo 2's, whose Olmo2RotaryEmbedding casts
nothing either; Cohere's, which casts q and k up first: memcalc.sizing.timeline.hf_cohere). What differs from Llama's walk: docs/timeline.md, "transformers' OLMo".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.sizing.timeline.hf_layer import RopeOps, _rope_backward, _rope_forward
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_names

NORMS = (rules.OLMO_LN1, rules.OLMO_LN2)


def walks(config: ModelConfig) -> bool:
    """Whether the config is OLMo's model (its LayerNorm without parameters, norm layernorm_np)."""
    return config.norm == "layernorm_np"


def fp32_rope(config: ModelConfig) -> bool:
    """Whether the layers' RoPE reads the model's fp32 tables (OLMo's and OLMo 2's: `rope` walks their RoPE), not
    copies cast for each layer (`cast`)."""
    return rules.rope_tables(config) == (rules.OLMO_ROPE_COS, rules.OLMO_ROPE_SIN) and not cast(config)


def cast(config: ModelConfig) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy casts the model's fp32 tables to bf16 at each sharded layer's pre-forward
    (the ledger's OLMO_ROPE_CAST, kept by that layer's RoPE, which is then Llama's; the model's tables its locals)."""
    return rules.tables_cast(config, config.layer_inputs_cast)


def cast_inputs() -> Op:
    """FSDP2's pre-forward of a sharded layer, before its all-gather: the tables it is called with cast to bf16, one
    `.to` each, the layer's own copies (freed by its RoPE's backward, hf_layer's `first`)."""
    return Op("", tuple(Step(f"FSDP2 casts the layer's input {table} to param_dtype",
                             (Made("", 0, "the model's fp32 table cast for this layer (MixedPrecisionPolicy)",
                                   keeps=x),)) for table, x in zip(("cos", "sin"), rules.OLMO_ROPE_CAST)), ())


def cast_names(p: str, config: ModelConfig) -> tuple[str, ...]:
    """Layer `p`'s own cast tables (`cast_inputs`), which its RoPE's backward frees; none unless `cast`."""
    return kept_names(p, *rules.OLMO_ROPE_CAST) if cast(config) else ()


def layer_norm(where: str, p: str, norm: ledger.NormTensors, z: Sizes, dy: str, out: str,
               residual: str | None = None, output: Made | None = None, gone: tuple[str, ...] = (),
               x: str = "") -> tuple[Op, ...]:
    """OlmoLayerNorm: x.to(float32) (kept; in fp32 x itself), native_layer_norm's fp32 output, mean and rstd (those
    kept), the output cast back; `output`, `gone`: its forward op by op (a checkpoint's walk, the final norm), `x` its
    input. Backward: dY cast up, native_layer_norm_backward's dX (no weight, no bias), cast back; with a `residual`
    summed with the stream's gradient into `out`."""
    g, fp32 = "/".join(n for n in ("grad", p, where) if n), z.act == 4
    wide, dx = z.tokens(4 * z.h), f"{g}/dx" if residual else out
    dy32, dx32 = (dy, dx) if fp32 else (f"{g}/dy fp32", f"{g}/dx fp32")
    forward = _forward("/".join(n for n in (p, where) if n), p, norm, z, output, gone, x) if output else ()
    backward = (
        *(() if fp32 else (Step("the cast back's backward: dY in fp32", (Made(dy32, wide, "dY cast up"),),
                                frees=(dy,), moment=False),)),
        Step("native_layer_norm_backward: dX", (Made(dx32, wide, "the norm's dX, fp32"),), frees=(dy32,),
             returns=True),
        *(() if fp32 else (Step("x.to(float32)'s backward", (Made(dx, z.full(z.h), "dX cast back"),),
                                frees=(dx32,), moment=False),)),
        *((Step("the residual's sum", (Made(out, z.full(z.h), "the residual stream's gradient: the norm's dX and the"
                                            " residual's summed"),), frees=(dx, residual), moment=False),)
          if residual else ()),
    )
    return (Op(where, forward, backward, saves=tuple(norm)),)


def _forward(n: str, p: str, norm: ledger.NormTensors, z: Sizes, output: Made, gone: tuple[str, ...], x: str
             ) -> tuple[Step, ...]:
    """OlmoLayerNorm's forward op by op; in fp32 x.to(float32) is x itself and the layer_norm's output the norm's."""
    fp32 = z.act == 4
    upcast = Made(x, 0, "x.to(float32) in fp32: x itself", keeps=norm.input, alias=True) if fp32 else \
        kept(p, norm.input)
    normed = output if fp32 else Made(f"{n}/output fp32", z.tokens(4 * z.h), "native_layer_norm's output, a"
                                      " temporary")
    stats = (kept(p, norm.mean), kept(p, norm.rstd))
    return (
        Step("x.to(float32)", (upcast,)),
        Step("native_layer_norm: output, mean, rstd", (normed, *stats), frees=gone if fp32 else (),
             reads_last=kept_names(p, *norm)),
        *(() if fp32 else (Step("the cast back", (output,), frees=(normed.name, *gone)),)),
    )


def recorded(builder: RopeOps) -> tuple[RopeOps, list[Op]]:
    """`builder` (hf_layer.RopeOps) and the list it appends the ops it builds to: the layer's forward without a
    checkpoint marks a moment at each of their steps (hf_layer.core_forward's `rope`)."""
    built: list[Op] = []

    def build(*args: Any) -> tuple[Op, ...]:
        ops = builder(*args)
        built.extend(ops)
        return ops

    return build, built


def rope(p: str, heads: dict[str, tuple[int, Made]], passthrough: bool, tables: tuple[str, ...],
         upcast: bool = False) -> tuple[Op, ...]:
    """apply_rotary_pos_emb on OLMo's fp32 tables (hf_layer.RopeOps; in fp32 Llama's own): q * cos and
    rotate_half(q) * sin promote to fp32, and so does their sum; k's likewise; then q's sum is cast back, and k's;
    the fp32 sums, its locals, go as it returns, and the projections' outputs as the attention rebinds them.
    `upcast`: Cohere's, which casts q and k to fp32 first (its locals to its return), so rotate_half runs in fp32
    too. In backward dY is cast up first; its fp32 copy goes with the last product's node (the products' gradients,
    cast back to bf16 as autograd validates them, mark no moment; upcast, fp32 to x.float()'s: `_upcast_backward`)."""
    (_, (_, q_out)), (_, (_, k_out)) = heads.items()
    ops = []
    for name, (w, _) in heads.items():
        x, g = f"{p}/{name}", f"grad/{p}/{name}"
        llama = _rope_forward(p, name, 2 * w if upcast else w, Made("", 0, ""), False)
        casts = tuple(Step(f"{n}.float()", (Made(f"{p}/{n} fp32", 2 * heads[n][0], "a local to its return"),))
                      for n in heads if upcast and name == "q")
        forward = (*casts, Step(f"{name} * cos, in fp32", (Made(f"{x} cos", 2 * w, "a temporary"),)), *llama[1:3],
                   Step("rotate_half(x) * sin, in fp32", (Made(f"{x} sin", 2 * w, "a temporary"),),
                        frees=(f"{x} rotated",)),
                   Step("RoPE's sum, in fp32", (Made(f"{x} embed fp32", 2 * w, "cast back once k's is made too"),),
                        frees=(f"{x} cos", f"{x} sin")))
        cast_back = (Step("the cast back's backward: dY in fp32", (Made(f"{g} dsum fp32", 2 * w, "dY cast up"),),
                          frees=(f"{g} heads",), moment=False),)
        backward = (*(() if upcast else cast_back),
                    *_rope_backward(f"grad/{p}", name, 2 * w if upcast else w, tables if name == "q" else (),
                                    moment=upcast, grad="pre-rope fp32" if upcast else "pre-rope"),
                    Step("", frees=(f"{g} dsum fp32",)))
        ops.append(Op("self_attn", forward, backward))
    back = (Step("q_embed.to(q_type)", (q_out,)),  # the fp32 sums, its locals, go as it returns
            Step("k_embed.to(k_type)", (k_out,), frees=tuple(f"{p}/{x}" for x in (
                "q embed fp32", "k embed fp32", "q fp32", "k fp32", "q pre-rope", "k pre-rope"))))
    q, k = ops[0], replace(ops[1], forward=(*ops[1].forward, *back))
    return _upcast_backward(p, heads, q, k) if upcast else (q, k)


def _upcast_backward(p: str, heads: dict[str, tuple[int, Made]], q: Op, k: Op) -> tuple[Op, Op]:
    """Cohere's RoPE backward in the order autograd runs it (measured): both sums' casts back (k's, then q's), k's
    products, q's (in fp32: dY cast up, so x.float()'s gradient too), then k.float()'s and q.float()'s backward, each
    casting its gradient back (found by the step differential: the fp32 products peak with many query heads a rank)."""
    casts = tuple(Step(f"{n}_embed.to({n}_type)'s backward: dY in fp32", (Made(
        f"grad/{p}/{n} dsum fp32", 2 * heads[n][0], "dY cast up"),), frees=(f"grad/{p}/{n} heads",), moment=False)
        for n in ("k", "q"))
    floats = tuple(Step(f"{n}.float()'s backward", (Made(f"grad/{p}/{n} pre-rope", heads[n][0], "x's gradient cast"
                                                         " back"),), frees=(f"grad/{p}/{n} pre-rope fp32",),
                        moment=False) for n in ("k", "q"))
    return replace(q, backward=(*q.backward, *floats)), replace(k, backward=(*casts, *k.backward))
