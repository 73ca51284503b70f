"""transformers' CohereForCausalLM for the hf step walk: Llama's attention and SwiGLU MLP side by side on one
CohereLayerNorm, described here as ops.

CohereLayerNorm writes LayerNorm out in fp32 (x - mean twice, each kept), apply_rotary_pos_emb casts q and k to fp32
first, the layer sums its input, the attention's output and the MLP's at its end, and the logits are scaled. What
differs from Llama's walk: docs/timeline.md, "transformers' Cohere".
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.sizing.timeline import hf_layer
from memcalc.sizing.timeline import hf_olmo as olmo
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name

NORMS = (rules.COHERE_LN1,)


def walks(config: ModelConfig) -> bool:
    """Whether the config is Cohere's model (CohereDecoderLayer: parallel, one CohereLayerNorm)."""
    return rules.is_cohere(config)


def layer_norm(where: str, p: str, norm: rules.CohereNormTensors, z: Sizes, dy: str, out: str,
               residual: str | None = None, output: Made | None = None, gone: tuple[str, ...] = (),
               x: str = "") -> tuple[Op, ...]:
    """CohereLayerNorm, one op for each of its autograd nodes (their backward runs in reverse): x.to(float32), its
    mean, x - mean (kept by pow), pow(2), its mean (the variance), x - mean again (kept by the product), + eps, rsqrt
    (kept), the product (normalised, kept), weight.to(float32) (kept; in fp32 the weight itself), weight * (.), the
    cast back; `output`, `gone`: its forward op by op (a checkpoint's walk, the final norm). In fp32 the casts are
    no-ops. x's fp32 gradient gathers the three uses' (x - mean twice, mean) as they come, then is cast back and, with
    a `residual`, summed with the stream's gradient into `out`."""
    n, g = "/".join(s for s in (p, where) if s), "/".join(s for s in ("grad", p, where) if s)
    fp32, wide, row = z.act == 4, z.tokens(4 * z.h), z.tokens(4)
    x32, dx32 = (x, out) if fp32 else (f"{n}/x fp32", f"{g}/dx fp32")
    into_stream = fp32 and residual is not None  # x itself, whose gradient the stream's is already
    c2 = f"{g}/dx (c2)" if into_stream else f"{g}/dc2"  # x's gradient after x - mean's second use
    dy32 = dy if fp32 else f"{g}/dy fp32"
    forward = dict(zip(("cast", "mean", "sub1", "pow", "var", "sub2", "eps", "rsqrt", "normed", "weight", "product",
                        "back"), _forward(n, p, norm, z, output, gone, x32) if output else ((),) * 12))

    def op(name: str, backward: tuple[Step, ...] = (), saves: tuple[ledger.SavedTensor, ...] = ()) -> Op:
        return Op(where, forward[name], backward, saves)

    def made(name: str, nbytes: int, why: str) -> Made:
        return Made(f"{g}/{name}", nbytes, why)

    summed = f"{g}/dx (sum)"
    return (
        op("cast", () if fp32 else (
            Step("x.to(float32)'s backward", (Made(f"{g}/dx" if residual else out, z.full(z.h), "dX cast back"),),
                 frees=(dx32,), moment=False),) + ((Step("the residual's sum", (Made(
                     out, z.full(z.h), "the stream's gradient: the norm's dX and the residual's summed"),),
                     frees=(f"{g}/dx", residual), moment=False),) if residual else ())),
        op("mean", (Step("mean's backward, added to x's gradient", (made("dmean full", wide, "expanded / h"),),
                         moment=False),
                    Step("", (Made(dx32, wide, "x's gradient: its three uses' summed"),),
                         frees=(f"{g}/dmean full", summed, f"{g}/dmean"), moment=False))),
        op("sub1", (Step("x - mean's backward: -dY", (made("-dc1", wide, "negated"),), moment=False),
                    Step("summed over h", (made("dmean (sub1)", row, "(b, s, 1)"),), frees=(f"{g}/-dc1",),
                         moment=False),
                    Step("autograd sums the gradients", (made("dmean", row, "the mean's"), Made(summed, wide, "x's so"
                                                                                                " far")),
                         frees=(f"{g}/dmean (sub1)", f"{g}/dmean (sub2)", f"{g}/dc1", c2), moment=False))),
        op("pow", (Step("pow(2)'s backward: dY * 2 (x - mean)", (made("c1^1", wide, "a temporary"),
                                                                   made("2 c1", wide, "a temporary"),
                                                                   made("dc1", wide, "the centred input's gradient")),
                        frees=(f"{g}/c1^1", f"{g}/2 c1", f"{g}/dpow")),), (norm.centred_pow,)),
        op("var", (Step("mean's backward: the variance's gradient over h", (made("dpow", wide, "expanded / h"),),
                        frees=(f"{g}/dvar",), moment=False),)),
        op("sub2", (Step("x - mean's backward: -dY", (made("-dc2", wide, "negated"),), moment=False),
                    Step("summed over h", (made("dmean (sub2)", row, "(b, s, 1)"),), frees=(f"{g}/-dc2",),
                         moment=False),
                    *((Step("autograd adds it to x's, the stream's", (Made(c2, wide, "x's gradient so far"),),
                            frees=(f"{g}/dc2", residual), moment=False),) if into_stream else ()))),
        op("eps"),
        op("rsqrt", (Step("rsqrt's backward", (made("r^3", row, "a temporary"), made("dvar", row, "dr * -r^3 / 2")),
                          frees=(f"{g}/r^3", f"{g}/dr"), moment=False),), (norm.rstd,)),
        # each product's node: its gradients, then (validate_outputs) the broadcast one summed to its input's shape,
        # dY still held; then dY goes
        op("normed", (Step("(x - mean) * r's backward: its two products", (
            made("dc2", wide, "dY * r"), made("dr full", wide, "dY * (x - mean)")), returns=True),
                      Step("summed to (b, s, 1)", (made("dr", row, "the rstd's gradient"),),
                           frees=(f"{g}/dr full", f"{g}/dn"), reduced=True)), (norm.centred_mul, norm.rstd)),
        op("weight", () if fp32 else (Step("weight.to(float32)'s backward", (made("dweight", z.weight(where),
                                                                                   WHY_WGRAD),),
                                           frees=(f"{g}/dw fp32",), hands_over=(f"{g}/dweight",), moment=False),)),
        op("product", (Step("weight * (.)'s backward: its two products", (
            made("dw full", wide, "dY * normalised"), made("dn", wide, "dY * weight")), returns=True),
                       Step("summed to the weight's shape", (made("dweight" if fp32 else "dw fp32",
                                                                  z.weight(where, 4), WHY_WGRAD),),
                            frees=(f"{g}/dw full", dy32), hands_over=(f"{g}/dweight",) if fp32 else (), reduced=True)),
           (norm.weight_fp32, norm.normed_fp32)),
        op("back", () if fp32 else (Step("the cast back's backward: dY in fp32", (Made(dy32, wide, "dY cast up"),),
                                         frees=(dy,), moment=False),)),
    )


def _forward(n: str, p: str, norm: rules.CohereNormTensors, z: Sizes, output: Made, gone: tuple[str, ...], x32: str
             ) -> tuple[tuple[Step, ...], ...]:
    """CohereLayerNorm's forward, one tuple of steps for each of its ops; `x32`: x.to(float32), in fp32 x itself."""
    fp32, wide, row = z.act == 4, z.tokens(4 * z.h), z.tokens(4)
    y = output if fp32 else Made(f"{n}/y fp32", wide, "weight * (.), a local to the return")
    locals_ = (f"{n}/mean", f"{n}/variance", f"{n}/y fp32")
    return (
        () if fp32 else (Step("x.to(float32)", (Made(x32, wide, "a local until the product rebinds it"),)),),
        (Step("mean over h", (Made(f"{n}/mean", row, "a local to the return"),)),),
        (Step("x - mean", (kept(p, norm.centred_pow),)),),
        (Step("pow(2)", (Made(f"{n}/pow", wide, "a temporary"),), reads_last=(kept_name(p, norm.centred_pow),)),),
        (Step("mean over h: the variance", (Made(f"{n}/variance", row, "a local to the return"),),
              frees=(f"{n}/pow",)),),
        (Step("x - mean again", (kept(p, norm.centred_mul),)),),
        (Step("variance + eps", (Made(f"{n}/variance + eps", row, "rsqrt's input, a temporary"),)),),
        (Step("rsqrt", (kept(p, norm.rstd),), frees=(f"{n}/variance + eps",)),),
        (Step("(x - mean) * rsqrt(.)", (kept(p, norm.normed_fp32),), frees=() if fp32 else (x32,),
              reads_last=(kept_name(p, norm.centred_mul), kept_name(p, norm.rstd))),),
        () if fp32 else (Step("weight.to(float32)", (kept(p, norm.weight_fp32),)),),
        (Step("weight * (.)", (y,), frees=locals_[:2] + gone if fp32 else (),
              reads_last=(kept_name(p, norm.normed_fp32), kept_name(p, norm.weight_fp32))),),
        () if fp32 else (Step("the cast back: the norm's output", (output,), frees=(*locals_, *gone)),),
    )


def layer(i: int, z: Sizes, config: ModelConfig, saved: dict[str, int], tables: tuple[ledger.SavedTensor, ...],
          made: Step) -> tuple[Op, ...]:
    """CohereDecoderLayer i: input_layernorm, whose output the attention and the MLP both read (the MLP's backward
    runs first, the attention's input gradients summed into its), then input + attention + MLP. Under a checkpoint its
    forward runs op by op; without, it is one moment (`made`, every kept tensor at once)."""
    p, g, full, checkpointed = f"layers.{i}", f"grad/layers.{i}", z.full(z.h), config.recompute == "full"
    eager = config.attention == "eager"
    out = f"grad/layers.{i - 1}/output" if i else "grad/embedding output"
    normed = kept_name(p, ledger.QKV_IN)  # the layer's variable: the MLP reads it after the attention returns
    rope, rotated = olmo.recorded(partial(olmo.rope, upcast=True)) if z.act != 4 else (None, [])
    attention = hf_layer.attention(p, z, eager, saved, config.groups != config.a, z.t > 1,
                                tuple(x.name for x in tables) if i == 0 and not checkpointed else (),
                                dropout=config.has_dropout, into=(f"{g}/ln2 output", ""), rope_ops=rope)
    *attention, o_proj = attention
    step = o_proj.forward[-1]
    o_proj = replace(o_proj, forward=(*o_proj.forward[:-1], replace(step, reads_last=tuple(
        x for x in step.reads_last if x != normed))))
    weights = hf_layer.returned_weights(z, eager, config.has_dropout)
    ops = (
        *layer_norm("input_layernorm", p, rules.COHERE_LN1, z, f"{g}/ln1 output", out, f"{g}/output",
                    output=kept(p, ledger.QKV_IN), gone=() if z.act == 4 else (), x=f"{p}/input"),
        *attention, o_proj,
        *hf_layer.mlp(p, z, z.t > 1, rules.GATED["swiglu"]),
        Op("", (Step("input + the attention's output", (Made(f"{p}/partial sum", full, "a temporary"),)),
                Step("+ the MLP's output: the layer's output", (Made(f"layers.{i + 1}/input", full, "the next"
                                                                     " layer's input"),),
                     frees=(f"{p}/partial sum", f"{p}/attn output", f"{p}/mlp output", *((f"{p}/input",) if i else ())),
                     reads_last=(normed, *((kept_name(p, weights),) if weights else ())))), ()),
    )
    if checkpointed:
        return ops
    core = hf_layer.core_forward((*attention, o_proj), rotated)
    return (*hf_layer.layer_forward(i, z, made, core, parallel=True),
            *(replace(x, forward=()) for x in ops))


def logit_scale(z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """CohereForCausalLM's logits * logit_scale: a new (b, s, v) tensor in place of lm_head's, its backward dY * the
    scale in place of dY."""
    if not rules.is_cohere(config):
        return ()
    logits = z.act * z.b * z.s * config.vocab_size
    return (Op("", forward=(
        Step("logits * logit_scale", (Made("lm_head/scaled", logits, "the scaled logits"),), frees=("lm_head/logits",)),
        Step("", (Made("lm_head/logits", logits, "the scaled logits: the output object holds them"),),
             frees=("lm_head/scaled",), moment=False),
    ), backward=(
        Step("(.) * logit_scale's backward", (Made("grad/scaled logits", logits, "dY * scale"),),
             frees=("grad/logits",)),
        Step("", (Made("grad/logits", logits, "lm_head's output gradient"),), frees=("grad/scaled logits",),
             moment=False),
    )),)
