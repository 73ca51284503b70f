"""transformers' LlamaDecoderLayer (Qwen3's with qk_layernorm) described once as ops, for the hf step walk.

Its forward moment, its ops in backward order and gradient checkpointing: docs/timeline.md, "transformers' decoder
layer".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.model.ledger import RMSNormTensors, SavedTensor
from memcalc.sizing.timeline import hf_gpt_oss as oss
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline import torch_ops
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD, linear
from memcalc.sizing.timeline.walk import Made, Op, Step, kept, kept_name, kept_names

WHY_SAVED = "kept for backward (the hf ledger); freed when the op that keeps it has run backward"


def rms_norm(where: str, p: str, norm: RMSNormTensors, z: Sizes, dy: str | None, out: str, residual: str | None = None,
             width: int = 0, heads: int = 1, output: Made | None = None, gone: tuple[str, ...] = (), x: str = ""
             ) -> tuple[Op, ...]:
    """LlamaRMSNorm's backward as autograd runs its eager ops, widest at pow's (five fp32 (b, s, h) tensors); with a
    `residual` the norm's dX and the stream's gradient summed into `out`. `width`, `heads`:
    Qwen3's q_norm and k_norm, per head; `dy` None: the residual stream's too (Gemma 2's sandwich norms); `output`,
    `gone`: the forward op by op, for a checkpoint's walk, `x` the norm's input (in fp32 its upcast is x itself, which
    the norm then keeps). GemmaRMSNorm (`norm.weight_plus_one`) and Olmo2RMSNorm (`norm.normed_fp32` alone: its weight
    times the fp32 x * r) multiply in fp32 and cast back last (`_gemma_weight`)."""
    width = width or z.h
    # the gradients' name stem: "grad/layers.0/mlp.up_proj", at the model's end "grad/model.norm"
    g, fp32, row = "/".join(x for x in ("grad", p, where) if x), z.tokens(4 * width), z.tokens(4 * heads)
    act = z.full(width)
    dx = out if residual is None else f"{g}/dx"
    walked = _gemma_norm_forward if norm.weight_plus_one else _norm_forward
    upcast = Made(x, 0, "x.to(float32) in fp32: x itself", keeps=norm.input_fp32, alias=True) if act == fp32 else \
        kept(p, norm.input_fp32)
    forward = walked(f"{p}/{where}", p, norm, fp32, row, upcast, output, gone) if output else ()
    # fp32: x.to(float32) is x, whose gradients autograd sums as they come (`_summed_into_x`)
    cast = Op(where, forward, () if act == fp32 else (
        Step("x.to(float32)'s backward", (Made(f"{g}/dx fp32", fp32, "autograd sums x's two fp32 gradients"),
                                          Made(dx, act, "x.to(float32)'s backward: cast back to bf16")),
             frees=(f"{g}/dx (x * r)", f"{g}/dx (pow)", f"{g}/dx fp32"), moment=False),
        *((Step("the residual's sum", (Made(out, act, "the residual stream's gradient: the norm's dX and the"
                                            " residual's summed"),), frees=(dx, residual), moment=False),)
          if residual else ())))
    summed, first = _summed_into_x(g, act, residual) if act == fp32 else ((), "")
    power = Op(where, forward=(), backward=(
        Step("mean's backward", (Made(f"{g}/dpow", fp32, "dvariance spread over h and divided by h"),),
             frees=(f"{g}/dvariance",), moment=False),
        Step("RMSNorm's backward at its widest: five fp32 (b, s, h) temporaries", (
            Made(f"{g}/x^1", fp32, "pow(2)'s backward: x^1"), Made(f"{g}/2x", fp32, "pow(2)'s backward: 2 * x^1"),
            Made(f"{g}/dx (pow)", fp32, "pow(2)'s backward: dpow * 2x")), frees=(f"{g}/x^1", f"{g}/2x", f"{g}/dpow")),
        *((Step("pow's gradient added to x's", (Made(out, act, "x's gradient: the norm's dX (and the residual's)"),),
                frees=(first, f"{g}/dx (pow)"),
                moment=False),) if act == fp32 else ()),
    ), saves=(norm.input_fp32,))
    upcast = Step("y.to(bf16)'s backward", (Made(f"{g}/dy fp32", fp32, "the gradient cast up to fp32"),),
                  frees=(f"{g}/dY w",), moment=False)
    cast_up = act != fp32 and not norm.normed_fp32  # fp32: y is x * r itself, and dY w its gradient
    rstd = Op(where, forward=(), backward=(
        *((upcast,) if cast_up else ()),
        Step("x * r's backward", (Made(f"{g}/dx (x * r)", fp32, "dy * r"), Made(f"{g}/dr full", fp32, "dy * x"),
                                  Made(f"{g}/dr", row, "the rstd's gradient, (b, s, 1) fp32")),
             frees=(f"{g}/dy fp32" if cast_up or norm.normed_fp32 else f"{g}/dY w", f"{g}/dr full"),
             moment=False),
        *summed,
        Step("rsqrt's backward", (Made(f"{g}/r^3", row, "(b, s, 1) fp32"), Made(f"{g}/-r^3 / 2", row, "(b, s, 1) fp32"),
                                  Made(f"{g}/dvariance", row, "dr * -r^3 / 2")),
             frees=(f"{g}/r^3", f"{g}/-r^3 / 2", f"{g}/dr"), moment=False),
    ), saves=(norm.rstd,))
    if norm.normed_fp32:
        return (cast, power, rstd, *_gemma_weight(where, g, norm, z, dy, fp32))
    weight = Op(where, forward=(), backward=(
        # a moment in fp32: under a checkpoint y (the rerun's) is still live here, gone at the sum below, and with
        # dY and both products this can be the step's peak (Phi-3's post_attention_layernorm at b=3 s=3 h=4: measured)
        Step("weight * y's backward: its two products", (Made(f"{g}/dY w", act, "dY * weight"),
                                                         Made(f"{g}/dY y", act, "dY * y")), returns=True,
             moment=act == fp32),
        # summed to the weight's shape after the node returned (under a checkpoint y, the rerun's, is gone by then);
        # a moment in fp32, where a tiny model with tied weights peaks here (no fp32 copy of the logits above it)
        # dY, the node's input, goes before AccumulateGrad takes the weight's gradient (ZeRO's hook reads it there)
        Step("weight * y's backward", (Made(f"{g}/dweight", z.weight(where), WHY_WGRAD),),
             frees=(f"{g}/dY y", *((dy,) if dy else ())), hands_over=(f"{g}/dweight",), reduced=True,
             moment=act == fp32),
    ), saves=(norm.normed,))
    return (cast, power, rstd, weight)


def _summed_into_x(g: str, act: int, residual: str | None) -> tuple[tuple[Step, ...], str]:
    """In fp32 the norm's input x is the residual stream's tensor itself, whose gradients autograd sums as they come,
    each sum a new tensor made once the node that gives the gradient has freed its own locals (measured: no moment):
    the residual's with x * r's (a step), then pow's. Returns that step, if any, and the name of x's gradient before
    pow's is added."""
    if residual is None:
        return (), f"{g}/dx (x * r)"
    return (Step("x * r's gradient added to the residual's", (Made(
        f"{g}/dx (sum)", act, "x's gradient so far: the residual stream's and x * r's"),),
        frees=(f"{g}/dx (x * r)", residual), moment=False),), f"{g}/dx (sum)"


def _norm_forward(n: str, p: str, norm: RMSNormTensors, fp32: int, row: int, upcast: Made, output: Made,
                  gone: tuple[str, ...]) -> tuple[Step, ...]:
    """LlamaRMSNorm's forward op by op: the upcast, the variance (a local to the return), rsqrt, x * rstd. `fp32`: an
    fp32 copy's bytes, `row`: the statistics'; `upcast`: x.to(float32), in fp32 an alias of x, as the cast back is of
    x * rstd. Olmo2RMSNorm (`norm.normed_fp32`) keeps x * rstd in fp32 and casts back its weight's fp32 product (in
    fp32 the output)."""
    read = (kept_name(p, norm.input_fp32), kept_name(p, norm.rstd))
    gone = (f"{n}/variance", *gone)
    statistics = (
        Step("x.to(float32)", (upcast,)),
        Step("pow(2)", (Made(f"{n}/pow", fp32, "x^2, a temporary"),)),
        Step("mean over h: the variance", (Made(f"{n}/variance", row, "a local until the norm returns"),),
             frees=(f"{n}/pow",)),
        Step("variance + eps", (Made(f"{n}/variance + eps", row, "rsqrt's input, a temporary"),)),
        Step("rsqrt", (kept(p, norm.rstd),), frees=(f"{n}/variance + eps",)),
    )
    if norm.normed_fp32:
        normed = kept_name(p, norm.normed_fp32)
        product = Made(f"{n}/product fp32", fp32, "weight * (.) in fp32, a temporary")
        return (*statistics, Step("x * rstd", (kept(p, norm.normed_fp32),), reads_last=read),
                *((Step("weight * (.): the norm's output", (output,), frees=gone, reads_last=(normed,)),)
                  if upcast.alias else (Step("weight * (.), in fp32", (product,)),  # x * rstd a local to the return
                                        Step("the cast back: the norm's output", (output,),
                                             frees=(product.name, *gone), reads_last=(normed,)))))
    normalised = (Step("x * rstd", (kept(p, norm.normed),), reads_last=read),) if upcast.alias else (
        Step("x * rstd", (Made(f"{n}/normalised fp32", fp32, "a local until the norm returns"),), reads_last=read),
        Step("the cast back to bf16", (kept(p, norm.normed),)))
    weighted = Step("weight * y: the norm's output", (output,), frees=(f"{n}/normalised fp32", *gone),
                    reads_last=(kept_name(p, norm.normed),))
    return (*statistics, *normalised, weighted)


def _gemma_norm_forward(n: str, p: str, norm: RMSNormTensors, fp32: int, row: int, upcast: Made, output: Made,
                        gone: tuple[str, ...]) -> tuple[Step, ...]:
    """GemmaRMSNorm's forward op by op (its `_norm` returns after x * rstd: the fp32 input and the rstd go unless
    saved). `fp32`: an fp32 copy's bytes, `row`: the statistics'; `upcast`: x.float(), in fp32 an alias of x, as
    weight.float() is the weight and type_as(x) the product."""
    channels = fp32 // row  # the channels each statistic covers: the weight's
    alias = upcast.alias  # in fp32 weight.float() is the weight and type_as(x) the product: no steps
    product = output if alias else Made(f"{n}/product fp32", fp32, "a local until the norm returns")
    return (
        Step("x.float()", (upcast,)),
        Step("pow(2)", (Made(f"{n}/pow", fp32, "x^2, a temporary"),)),
        Step("mean over h", (Made(f"{n}/variance", row, "a temporary"),), frees=(f"{n}/pow",)),
        Step("mean + eps", (Made(f"{n}/variance + eps", row, "rsqrt's input, a temporary"),),
             frees=(f"{n}/variance",)),
        Step("rsqrt", (kept(p, norm.rstd),), frees=(f"{n}/variance + eps",)),
        Step("x * rstd", (kept(p, norm.normed_fp32),),
             reads_last=(kept_name(p, norm.input_fp32), kept_name(p, norm.rstd))),
        *(() if alias else (Step("weight.float()", (Made(f"{n}/weight fp32", 4 * channels, "the weight's (h,) fp32"
                                                         " copy, a temporary"),)),)),
        Step("1.0 + weight", (kept(p, norm.weight_plus_one),), frees=() if alias else (f"{n}/weight fp32",)),
        Step("the product, in fp32" + (": the norm's output" if alias else ""), (product,), frees=gone if alias else (),
             reads_last=(kept_name(p, norm.normed_fp32), kept_name(p, norm.weight_plus_one))),
        *(() if alias else (Step("type_as(x): the norm's output", (output,), frees=(f"{n}/product fp32", *gone)),)),
    )


def _gemma_weight(where: str, g: str, norm: RMSNormTensors, z: Sizes, dy: str | None, fp32: int) -> tuple[Op, Op]:
    """GemmaRMSNorm's last two ops: (x * r) * (1.0 + weight.float()) in fp32, keeping both factors, then type_as(x)
    (in fp32 a no-op: the product's backward reads dY itself). Olmo2RMSNorm's weight * (x * r) keeps the fp32 factor
    alone, its weight's gradient cast to the weight's dtype as autograd validates the node's outputs."""
    cast = z.act != 4
    dy_fp32 = f"{g}/dY fp32" if cast else dy
    product = Op(where, forward=(), backward=(
        Step("(x * r) * (1 + w)'s backward: its two fp32 gradients", (
            Made(f"{g}/dw+1 full", fp32, "dY * (x * r), fp32"),
            Made(f"{g}/dy fp32", fp32, "dY * (1 + w): the normalised input's gradient, fp32")), returns=True),
        Step("(1 + w)'s gradient summed over the tokens (dY in fp32 still live)",
             (Made(f"{g}/dw+1", z.weight(where, 4), "(h,) fp32"),),
             frees=(f"{g}/dw+1 full", *((dy_fp32,) if dy_fp32 else ())),
             reduced=True),
        Step("weight.float()'s backward", (Made(f"{g}/dweight", z.weight(where), WHY_WGRAD),),
             frees=(f"{g}/dw+1",), hands_over=(f"{g}/dweight",), reduced=not norm.weight_plus_one, moment=False),
    ), saves=tuple(x for x in (norm.weight_plus_one, norm.normed_fp32) if x))
    up = Op(where, forward=(), backward=(
        Step("type_as(x)'s backward", (Made(f"{g}/dY fp32", fp32, "the gradient cast up to fp32"),),
             frees=(dy,) if dy else (),
             moment=False),) if cast else ())
    return (product, up)


def widest(ops: tuple[Op, ...], moments: dict[str, str], each: frozenset[str] = frozenset()) -> tuple[Op, ...]:
    """Ops described op by op (for a checkpoint's walk) as a forward without one walks them, at its widest moments
    only: the last step of each name in `moments` marks one, in that moment's words (a sparse block's,
    hf_moe.block_forward; the final norm's; the attention's core, `core_forward`), and each step of a name in `each`,
    in its own (RoPE's in fp32). The steps between two moments are one: what they free of older tensors
    goes first, what they make and do not free again is made at the moment, in its op (a MoE layer has thousands of
    steps); backward is the ops' own. A name no step has is an error: its moment would go unmarked."""
    last = {step.what: (i, j) for i, op in enumerate(ops) for j, step in enumerate(op.forward)}
    if missing := moments.keys() - last.keys():
        raise AssertionError(f"no step to mark the moment of: {', '.join(sorted(missing))}")
    marked = {last[what]: words for what, words in moments.items()} | {
        (i, j): step.what for i, op in enumerate(ops) for j, step in enumerate(op.forward) if step.what in each}
    forward: list[list[Step]] = [[] for _ in ops]
    made: dict[str, Made] = {}  # made since the last moment and live
    older: list[str] = []  # freed since the last moment, made before it
    kept_as: set[str] = set()  # the tensors an alias makes saved ones (`_kept_itself`)
    holder = 0
    for i, op in enumerate(ops):
        for j, step in enumerate(op.forward):
            holder = i
            for x in step.makes:
                if x.alias:
                    _kept_itself(x, made, kept_as)
                else:
                    made[x.name or x.keeps.name] = x
            if (i, j) in marked:
                frees = tuple(x for x in step.frees if x not in kept_as)
                forward[i] += [Step("", frees=tuple(older)), Step(marked[i, j], tuple(made.values()), frees)]
                made, older = {}, []
                continue
            for name in step.frees:
                if name in kept_as:
                    continue
                if name in made and not made[name].alias:
                    del made[name]
                else:
                    older.append(name)
    forward[holder] += [Step("", tuple(made.values()), tuple(older), moment=False)]
    return tuple(replace(op, forward=tuple(steps)) for op, steps in zip(ops, forward))


def widest_forward(ops: tuple[Op, ...], moments: dict[str, str], each: frozenset[str] = frozenset()
                   ) -> tuple[Op, ...]:
    """`widest`'s forward alone, at those of `moments` (the steps that may be a walk's widest) its steps have: a layer's
    forward without a checkpoint walks it before the ops, whose backward is their own."""
    steps = {step.what for op in ops for step in op.forward}
    marked = {what: words for what, words in moments.items() if what in steps}
    return tuple(replace(op, backward=(), saves=()) for op in widest(ops, marked, each))


def _kept_itself(x: Made, made: dict[str, Made], kept_as: set[str]) -> None:
    """The alias `x` (in fp32 a norm's no-op upcast) as `widest` holds it, in `made`: it makes its tensor the saved
    one, which none of the steps that free the tensor frees (`kept_as`): without a checkpoint autograd keeps it; where
    the tensor was made since the last moment (a projection's output) it is made as the saved one at the moment."""
    kept_as.add(x.name)
    if x.name in made and not made[x.name].alias:
        del made[x.name]
        made[x.keeps.name] = Made("", 0, x.why, keeps=x.keeps)
    else:
        made[x.name] = x


DOWN_PROJ = "mlp.down_proj"  # LlamaMLP's rowwise projection under tp
# the MLP's post-norm's widest forward step, by its words op by op, and its moment's words: Olmo2RMSNorm's cast back
POST_NORM_MOMENTS = {
    "the cast back: the norm's output": "Olmo2RMSNorm at its widest: weight * (x * r) in fp32 cast back"}


def unnormed(kept_as: SavedTensor, x: str) -> tuple[Op]:
    """OLMo 2's layer has no norm before the attention or the MLP: their projections keep the residual stream `x`
    itself (`kept_as`, an alias), and autograd sums their dX into the stream's gradient as they come (`attention`'s
    and `mlp`'s `into`)."""
    stream = Made(x, 0, "the residual stream, read unnormalised", keeps=kept_as, alias=True)
    return (Op("", (Step("", (stream,)),), ()),)


def layer_forward(i: int, z: Sizes, kept: Step, core: tuple[Op, ...], mlp: tuple[Op, ...] = (),
                  dropped: bool = False, later: frozenset[SavedTensor] = frozenset(), kept_inputs: bool = False,
                  parallel: bool = False, down_proj: str = DOWN_PROJ, post_norm: tuple[Op, ...] = ()
                  ) -> tuple[Op, ...]:
    """Layer i's forward, one moment at its second residual sum: its kept tensors (`kept`, every layer's one step),
    the residual stream, and a sparse block's own moments (`mlp`, which makes the MLP's output); with the attention's
    own moments (`core`: its ops op by op at their widest, core_forward; DeepSeek's, hf_mla, and gpt-oss's core
    alone), the tensors kept up to o_proj's input are made before it, but the core's `later` ones and those its steps
    make, which are not made again. Under tp a dense MLP's down_proj (RowwiseParallel) all-reduces its GEMM's partial
    sum into a new tensor: a moment before the sum, as many bytes as it (the partial goes as the sum is made), which
    MemTracker reads first. `kept_inputs`: the layer's input and the stream are kept themselves (nn.LayerNorm's
    inputs; in fp32 the norms' x.to(float32), a no-op; OLMo 2's projections, `unnormed`). `parallel`: the attention
    and the MLP read one norm's output (Cohere's), summed with the input at the end, o_proj's output live to then.
    `down_proj`: the MLP's rowwise projection (StarCoder 2's c_proj). The kept tensors a sparse block's own steps make
    (hf_moe.block_forward) are made there, not before it. `post_norm`: the post_feedforward_layernorm op by op
    (Gemma 2's, OLMo 2's), its kept tensors made after down_proj (whose output goes as the norm returns); OLMo 2's in
    bf16 wider than the layer's end at its cast back (`POST_NORM_MOMENTS`: the fp32 weight * (x * r), its bf16 copy
    and the variance beside down_proj's output, the step's peak where the layer's unsharded parameters are live in
    forward, FSDP2, and h is small)."""
    p, full = f"layers.{i}", z.full(z.h)
    alias = (Step("", frees=(f"{p}/input",)),) if kept_inputs else ()
    at = next(j for j, x in enumerate(kept.makes) if x.keeps in (ledger.PROJ_IN, ledger.MLA_PROJ_IN))
    own = {x.keeps.name for op in core for step in op.forward for x in step.makes if x.keeps}  # the core's
    before = tuple(x for x in kept.makes[:at] if x.keeps not in later and x.keeps.name not in own)
    after = tuple(x for x in (*(x for x in kept.makes[:at] if x.keeps in later), *kept.makes[at:])
                  if x.keeps.name not in own)
    core = (Op("", (replace(kept, makes=before), *alias), ()), *core)
    kept = replace(kept, makes=after)
    # the block's own steps' (by name: a MoE block makes thousands)
    mine = {x.keeps.name for op in (*mlp, *post_norm) for step in op.forward for x in step.makes if x.keeps}
    kept = replace(kept, makes=tuple(x for x in kept.makes if x.keeps is None or x.keeps.name not in mine))
    attended = (f"{p}/attn output", f"{p}/attn proj")  # o_proj's output, where the attention's walk made it
    stream = (Step("", frees=attended),) if kept_inputs else (Step("the residual stream", (Made(
        f"{p}/mid", full, "the residual stream after attention: ln2's input and the MLP's residual"),), frees=attended,
        moment=False),
    ) if not parallel else ()
    # under tp, an MLP's dropout (StarCoder 2's) keeps its mask after down_proj's all-reduce
    masked = tuple(x for x in kept.makes if x.keeps == ledger.MLP_DROPOUT_MASK) if z.t > 1 and not mlp else ()
    made = Op("", (replace(kept, makes=tuple(x for x in kept.makes if x not in masked)), *stream), ())
    output = () if mlp else (Made(f"{p}/mlp output", full, "down_proj's output, summed into the residual stream"),)
    if dropped:  # Phi-3's resid_mlp_dropout: the layer's variable holds down_proj's output to the sum too
        output += (Made(f"{p}/mlp proj", full, "down_proj's output, resid_mlp_dropout's input"),)
    down = (Op(down_proj, forward=(rowwise(Step("", output), f"{p}/mlp partial", True),), backward=()),) \
        if output and z.t > 1 else ()
    norm_input = () if down else (Op("", (Step("", output),), ()),)  # down_proj's output, made by its all-reduce
    closing = widest_forward((*norm_input, *post_norm), POST_NORM_MOMENTS) if post_norm else ()
    partial = (Made(f"{p}/partial sum", full, "the input plus the attention's output"),) if parallel else ()
    # in fp32 the post-norm's no-op upcast is the tensor it keeps: under tp down_proj's all-reduced output, made
    # before the norm's ops, which the layer's return then does not free (its backward does)
    saved = {x.name for op in post_norm for step in op.forward for x in step.makes if x.alias}
    out = Op("", forward=(Step("the layer's saved tensors, at its second residual sum", (
        *masked, *(() if down or post_norm else output), *partial,
        Made(f"layers.{i + 1}/input", full, "the layer's output, the next layer's input")),
        # the caller rebinds its hidden_states; the first layer's input is inputs_embeds too
        frees=tuple(x for x in (f"{p}/mid", f"{p}/mlp output", f"{p}/mlp proj", *(x.name for x in partial),
                                f"{p}/attn output", *((f"{p}/input",) if i else ()), f"{p}/mlp normed")
                    if x not in saved)),), backward=())
    return (*core, made, *mlp, *down, *closing, out)


def residuals(i: int, z: Sizes, weights: SavedTensor | None) -> tuple[Op, Op]:
    """Layer i's two residual sums; as the layer returns its locals go: the stream, the MLP's output (or its norm),
    the attention `weights` eager returns (`hidden_states, _ = self.self_attn(...)` holds them), the input the caller
    rebinds."""
    p, full = f"layers.{i}", z.full(z.h)
    mid = Op("", (Step("x + attention", (Made(f"{p}/mid", full, "the residual stream after attention: ln2's input and"
                                              " the MLP's residual"),),
                       frees=(f"{p}/attn output", f"{p}/attn normed", f"{p}/attn proj")),), ())
    out = Op("", (Step("the layer's output", (Made(f"layers.{i + 1}/input", full, "the next layer's input"),),
                       frees=(f"{p}/mid", f"{p}/mlp output", f"{p}/mlp normed", f"{p}/mlp proj",
                              *((f"{p}/input",) if i else ())),
                       reads_last=(kept_name(p, weights),) if weights else ()),), ())
    return mid, out


def returned_weights(z: Sizes, eager: bool, dropout: bool) -> SavedTensor | None:
    """The attention weights eager attention returns: the dropped-out ones, in fp32 the softmax itself (its cast a
    no-op), else its cast back; SDPA returns none."""
    if not eager:
        return None
    return ledger.ATTN_DROPOUT_OUT if dropout else rules.SOFTMAX_FP32 if z.act == 4 else rules.WEIGHTS


def attention(p: str, z: Sizes, eager: bool, saved: dict[str, int], gqa: bool, tp: bool, first: tuple[str, ...],
              qk_norm: str = "", dropout: bool = False, softcap: bool = False, dy: str | None = None,
              fused: bool = False, made_as: str = "attn output", into: tuple[str, str] = ("", ""),
              rope_ops: RopeOps | None = None, sinks: bool = False) -> tuple[Op, ...]:
    """q, k, v (their dX summed as they come; `qk_norm`, the layer's norm: Qwen3's q_norm and k_norm, OLMo 2's over
    the whole projection; `fused`: Phi-3's one qkv_proj), RoPE (`_rope_ops`, or the `rope_ops` builder: the fp32 RoPE
    of OLMo, OLMo 2 and Cohere, hf_olmo.rope; `first`, the model's tables the layer is the first to read, gone in its
    backward), the core (eager with `dropout` or Gemma 2's `softcap`, or SDPA), o_proj (`dy` its output's gradient;
    None: the residual stream's, which lives on; `made_as` its output's name); the heads go as the module returns.
    The projections' biases' gradients (Qwen2's q, k, v; StarCoder 2's) where the inventory has biases. `into`: the
    input's gradient autograd holds already (OLMo 2's unnormed residual stream's, Cohere's parallel MLP's), which
    q's, k's and v's dX join as they come, and the name of the sum ("": the norm's dY). `sinks`: gpt-oss's attention
    (memcalc.sizing.timeline.hf_gpt_oss: its RoPE on halves, its core with the sinks)."""
    g, q, kv, full = f"grad/{p}", z.a_t * z.d, z.g_t * z.d, z.full(z.h)
    # the projections' outputs and RoPE's, each the core's saved tensor or a local of the attention
    q_copied, k_copied, v_copied = _bmm_copies(z, saved, fused)
    made = {"q": Made(f"{p}/q pre-rope", z.full(q), "q_proj's output, a local"),
            "k": Made(f"{p}/k pre-rope", z.full(kv), "k_proj's output, a local"),
            "v": _kept_or_local(p, ledger.V, saved, "v heads", z.full(kv), eager and v_copied)}
    rotated = {"q": _kept_or_local(p, ledger.Q, saved, "q heads", z.full(q), eager and q_copied),
               "k": _kept_or_local(p, ledger.K, saved, "k heads", z.full(kv), eager and k_copied)}
    norms = _qk_norms(qk_norm, z)
    ran: list[Op] = []  # in the order autograd runs them
    late: list[Op] = []  # Gemma 3's q_norm and k_norm, run once all three projections have
    summed = into[0]
    for name, width in () if fused else (("v", kv), ("k", kv), ("q", q)):  # fused: `_fused_qkv`
        heads = f"{g}/v heads" if name == "v" else f"{g}/{name} pre-rope"
        projected = made[name]
        if name in norms:  # the projection's output is the norm's input, RoPE's the norm's output
            projected = Made(f"{p}/{name} proj", z.full(width), f"{name}_proj's output, {name}_norm's input")
            norm = rms_norm(f"self_attn.{name}_norm", p, norms[name][0], z, heads, f"{g}/{name} normed", width=width,
                            heads=norms[name][1], output=made[name], gone=(projected.name,), x=projected.name)
            (late if qk_norm == "rmsnorm_1p" else ran).extend(reversed(norm))
            heads = f"{g}/{name} normed"
        copy = width != z.d and z.s != 1  # one head: (b, 1, s, d) transposed is (b, s, 1, d) already, no copy
        tokens, dx = f"{g}/{name} tokens" if copy else heads, f"{g}/{name}_proj input"
        out = (into[1] or f"{g}/ln1 output") if name == "q" else f"{dx} + {summed}"
        m = f"self_attn.{name}_proj"
        lin = linear(m, ledger.QKV_IN, projected, z.weight(m), dx, full, p, (tokens,), sums=(summed, out, full)
                     if summed else None, reduced=tp, bias=z.weight(m, bias=True))
        ran.append(replace(lin, backward=(
            *((Step("transpose's backward", (Made(tokens, z.full(width), f"{name}'s gradient made (b, s, heads * d)"
                                                  " again, contiguous for the GEMM"),), frees=(heads,), moment=False),)
              if copy else ()), *lin.backward)))
        summed = out if summed else dx
    ran[:0] = late
    if fused:  # q, k and v are views of qkv_proj's output, which V's view keeps whole at b = 1
        made["v"] = _kept_or_local(p, rules.NEOX_QKV_OUT, saved, "qkv", z.full(q + 2 * kv))
    math = rules.MATH_Q.name in saved  # SDPA with dropout on a CPU: the math kernel (the ledger's SDPA_MATH)
    rope_built = oss.rope(g, z, first) if sinks else rope_ops(
        p, {"q": (z.full(q), rotated["q"]), "k": (z.full(kv), rotated["k"])}, fused, first) if rope_ops else _rope_ops(
        p, z, {"q": q, "k": kv}, rotated, saved, fused, first)
    core = oss.eager_core(p, z, saved, gqa, dropout) if sinks else \
        eager_core(p, z, saved, gqa, dropout, softcap, fused) if eager else \
        sdpa_math(p, z, gqa, f"{g}/o_proj input", made["v"].name, q_folds=rules.GLM_ROPE_COS.name not in saved) \
        if math else sdpa(p, z, saved, f"{g}/o_proj input")
    copied = eager or math or rules.GLM_SDPA_OUT.name in saved  # o_proj's input no kernel's output
    o_proj = linear("self_attn.o_proj", ledger.PROJ_IN if copied else None, None, z.weight("self_attn.o_proj"),
                    f"{g}/o_proj input", z.full(q), p, (dy,) if dy else (),
                    bias=z.weight("self_attn.o_proj", bias=True))
    gone = (made["v"], *rotated.values(), kept(p, ledger.QKV_IN), kept(p, ledger.PROJ_IN))  # at the module's return
    o_proj = replace(o_proj, forward=(rowwise(Step("the GEMM", (Made(f"{p}/{made_as}", full, "o_proj's output"),),
                                                   frees=tuple(x.name for x in gone if x.keeps is None),
                                                   reads_last=tuple(x.name for x in gone if x.keeps is not None)),
                                              f"{p}/attn partial", tp),))
    return (*(_fused_qkv(p, z, q, kv, tp, made["v"]) if fused else reversed(ran)), *rope_built, *core, o_proj)


def rowwise(gemm: Step, partial: str, tp: bool) -> Step:
    """A projection's GEMM (`gemm`, which makes its output) op by op (a checkpoint's forward and rerun), under tp
    transformers' RowwiseParallel: the GEMM makes this rank's partial sum, which transform_output_post_forward
    (transformers/distributed/tensor_parallel.py) wraps as a Partial DTensor and redistributes to Replicate, an
    all-reduce into a new tensor, the output; the partial goes as the hook returns. Both live at one moment, which
    MemTracker reads (Cohere's rerun peaks there)."""
    if not tp:
        return gemm
    made = Made(partial, gemm.makes[0].bytes, "the GEMM's output: this rank's partial sum, a local of the forward")
    return replace(gemm, what="the GEMM, its partial sum all-reduced", makes=(made, *gemm.makes),
                   frees=(*gemm.frees, partial))


def _qk_norms(norm: str, z: Sizes) -> dict[str, tuple[RMSNormTensors, int]]:
    """The q_norm and k_norm of a layer whose norm is `norm` ("" without), each with the statistics it keeps a token:
    one a head, or OLMo 2's one over the whole projection (the ledger's rules.QK_NORMS)."""
    if not norm:
        return {}
    q, k = rules.QK_NORMS[norm]
    whole = norm == "rmsnorm_fp32w"
    return {"q": (q, 1 if whole else z.a_t), "k": (k, 1 if whole else z.g_t)}


def _kept_or_local(p: str, tensor: SavedTensor, saved: dict[str, int], name: str, nbytes: int, copied: bool = False
                   ) -> Made:
    """A tensor the core keeps when the ledger says so, else (or when eager's matmul keeps a contiguous copy of it,
    `copied`) a local of the attention."""
    if tensor.name in saved and not copied:
        return kept(p, tensor)
    return Made(f"{p}/{name}", nbytes, "a local of the attention")


def _bmm_copies(z: Sizes, saved: dict[str, int], fused: bool = False) -> tuple[bool, bool, bool]:
    """Whether eager's matmul copies Q, K and V to run bmm (the copy is then what it keeps): a (b, heads, s, d) view
    of a (b, s, heads, d) tensor folds into (b * heads, s, d) only when b, s or heads is 1; repeat_kv's copies are
    contiguous, but of one K/V group on the rank it makes a view with a zero stride, which folds only at b = 1 (the
    ledger's REPEAT_KV: at b > 1 these copies are what it keeps as K and V expanded). Phi-3's (`fused`) Q and K are
    RoPE's concatenations, contiguous; its V a view of qkv_proj's output, folding only at b = 1 or one head."""
    strided, expanded = z.b > 1 and z.s > 1, rules.K_EXPANDED.name in saved
    views = expanded and z.g_t == 1
    if fused:
        return False, views, views or (not expanded and z.b > 1 and z.a_t > 1)
    plain = strided and z.g_t > 1 and not expanded
    if rules.GLM_ROPE_COS.name in saved:  # GLM's Q and K: RoPE's concatenations, contiguous (b, heads, s, d)
        return False, views, plain or views
    return strided and z.a_t > 1, plain or views, plain or views


def _fused_qkv(p: str, z: Sizes, q: int, kv: int, tp: bool, qkv: Made) -> tuple[Op, ...]:
    """Phi-3's qkv_proj: one GEMM that q, k and v slice and view as heads; in backward each slice's gradient is placed
    in a zero (b, s, (a + 2g) d) tensor, summed in autograd's buffer as they come."""
    g, width = f"grad/{p}", q + 2 * kv
    views = []
    for name, w in (("v", kv), ("k", kv), ("q", q)):
        heads = f"{g}/v heads" if name == "v" else f"{g}/{name} pre-rope"
        copy = w != z.d and z.s != 1  # one head: (b, 1, s, d) transposed is (b, s, 1, d) already, no copy
        views.append((name, f"{g}/{name} tokens" if copy else heads, heads, w, copy))
    view = Op("self_attn", (), tuple(
        Step("the head view's backward", (Made(tokens, z.full(w), f"{name}'s gradient made (b, s, heads * d)"),),
             frees=(heads,), moment=False) for name, tokens, heads, w, copy in views if copy))
    slices, summed = [], ""
    for name, tokens, _, _, _ in views:
        out = f"{summed}+{name}" if summed else f"{g}/qkv {name}"
        slices.append(Step("the slice's backward", (Made(f"{g}/qkv {name}", z.full(width), f"{name}'s gradient placed"
                                                         " in a zero (b, s, (a + 2g) d) tensor"),), frees=(tokens,),
                           moment=False))
        if summed:
            slices.append(Step("autograd sums the slices' gradients", (Made(out, z.full(width), "summed"),),
                               frees=(summed, f"{g}/qkv {name}"), moment=False))
        summed = out
    lin = linear("self_attn.qkv_proj", ledger.QKV_IN, qkv, z.weight("self_attn.qkv_proj"), f"{g}/ln1 output",
                 z.full(z.h), p, (summed,), reduced=tp)
    return (lin, Op("self_attn", (), tuple(slices)), view)


# apply_rotary_pos_emb as ops, q's then k's, built apart from `_rope_ops` (OLMo's and Cohere's fp32 RoPE, hf_olmo.rope):
# (p, {"q": (bytes, output), "k": ...}, passthrough, the tables q's backward frees)
RopeOps = Callable[[str, dict[str, tuple[int, Made]], bool, tuple[str, ...]], tuple[Op, ...]]


def _rope_forward(p: str, name: str, width: int, out: Made, last: bool, passthrough: bool = False, rot: int = 0
                  ) -> tuple[Step, ...]:
    """apply_rotary_pos_emb for q or k (`out` its result); after k's (`last`) the projections' outputs go, rebound to
    RoPE's. `passthrough`: Phi-3's, whose sum is concatenated with the empty unrotated rest: a copy, `out`. `rot`:
    GLM's rotated share's bytes, whose sum lives on, concatenated after k's (`_rope_ops`)."""
    x = f"{p}/{name}"
    if passthrough:
        summed = Made(f"{x} embed", width, "the rotated part, a temporary")
        return (*_rope_forward(p, name, width, summed, last)[:-1],
                Step("RoPE's sum", (summed,), frees=(f"{x} cos", f"{x} sin")),
                Step("the rotated part and the rest concatenated", (out,), frees=(summed.name,)))
    if rot:
        out, last = Made(f"{x} embed", rot, "RoPE's sum, a local of apply_rotary_pos_emb"), False
    rot = product = rot or width
    return (
        Step(f"{name} * cos", (Made(f"{x} cos", product, "a temporary"),)),
        Step("rotate_half: the negated half", (Made(f"{x} neg", rot // 2, "-x2, a temporary"),)),
        Step("rotate_half: the halves concatenated", (Made(f"{x} rotated", rot, "a temporary"),),
             frees=(f"{x} neg",)),
        Step("rotate_half(x) * sin", (Made(f"{x} sin", product, "a temporary"),), frees=(f"{x} rotated",)),
        Step("RoPE's sum", (out,), frees=(f"{x} cos", f"{x} sin",
                                          *((f"{p}/q pre-rope", f"{p}/k pre-rope") if last else ()))),
    )


def _rope_ops(p: str, z: Sizes, widths: dict[str, int], rotated: dict[str, Made], saved: dict[str, int], fused: bool,
              first: tuple[str, ...]) -> tuple[Op, Op]:
    """RoPE on q, then on k (`widths` their channels, `rotated` what each becomes); q's backward frees the model's
    tables the layer is the `first` to read. GLM's (its own (s, d_r) tables, interleaved from the model's, which its
    products keep) rotate the first d_r channels of each head, each sum then concatenated with the rest (in backward
    the Llama walk's steps, net: no moment inside). OLMo's and OLMo 2's fp32 tables: hf_olmo.rope."""
    g, glm = f"grad/{p}", rules.GLM_ROPE_COS.name in saved
    share = saved[rules.GLM_ROPE_COS.name] // (z.act * z.s) if glm else z.d  # d_r: the interleaved table's width
    own = (rules.GLM_ROPE_COS, rules.GLM_ROPE_SIN) if glm else ()
    ops = [Op("self_attn", (
        *(Step(f"{x.name}: the model's table interleaved", (kept(p, x),)) for x in (own if name == "q" else ())),
        *_rope_forward(p, name, z.full(w), rotated[name], name == "k" and not fused, fused,
                       glm and z.full(w // z.d * share))),
        _rope_backward(g, name, z.full(w), first if name == "q" else ()),
        saves=own)
        for name, w in widths.items()]  # forward order: q's, then k's
    if glm:  # each sum rebound to its concatenation
        ops[1] = replace(ops[1], forward=(*ops[1].forward, *(
            Step(f"{name}'s sum concatenated with the passed channels", (rotated[name],), frees=(f"{p}/{name} embed",))
            for name in widths), Step("", frees=(f"{p}/q embed", f"{p}/k embed", f"{p}/q pre-rope", f"{p}/k pre-rope"),
                                      reads_last=kept_names(p, *own))))
    return ops[0], ops[1]


def _rope_backward(g: str, name: str, width: int, tables: tuple[str, ...], moment: bool = False,
                   grad: str = "pre-rope") -> tuple[Step, ...]:
    """apply_rotary_pos_emb's backward for q or k; the last to run it (layers.0, q) frees the model's `tables` (cos,
    sin), each after its product's backward. `moment`: its high, both halves' gradients placed, is marked (Cohere's,
    in fp32, peaks there with many query heads a rank); `grad`: what x's gradient is called (Cohere's fp32 one is
    cast back after)."""
    x, (cos, sin) = f"{g}/{name}", (tables[:1], tables[1:])
    return (
        Step("rotate_half(x) * sin's backward", (Made(f"{x} rotated", width, "dY * sin"), Made(
            f"{x} neg", width // 2, "the negated half's gradient, negated back"), Made(
            f"{x} slice 1", width, "a half's gradient placed in a zero tensor")), frees=(f"{x} neg", *sin),
             moment=False),
        Step("rotate_half's backward: the other half placed", (Made(f"{x} slice 2", width, "placed likewise"),),
             moment=moment),
        Step("rotate_half's backward: the halves' gradients summed", (Made(f"{x} rotate_half", width, "a"
                                                                            " temporary"),),
             frees=(f"{x} slice 1", f"{x} slice 2", f"{x} rotated"), moment=False),
        Step("x * cos's backward", (Made(f"{x} cos", width, "dY * cos"), Made(f"{x} {grad}", width,
                                                                                "x's two gradients summed")),
             frees=(f"{x} cos", f"{x} rotate_half", f"{x} heads", f"{x} dY fp32", *cos),
             moment=False),
    )


def eager_core(p: str, z: Sizes, saved: dict[str, int], gqa: bool, dropout: bool = False, softcap: bool = False,
               fused: bool = False) -> tuple[Op, ...]:
    """eager_attention_forward; `dropout`: native_dropout keeps its bool mask (the probe's shim runs CUDA's op on a
    CPU, memcalc.probe.libs.hf_shim); repeat_kv's sums over each group's heads (GQA) end its backward."""
    g, q = f"grad/{p}", z.full(z.a_t * z.d)
    scores = z.b * z.a_t * z.s * z.s
    expanded = rules.K_EXPANDED.name in saved  # repeat_kv's copies (memcalc.model.impls.hf.REPEAT_KV)
    v, k = (rules.V_EXPANDED, rules.K_EXPANDED) if expanded else (ledger.V, ledger.K)
    v = rules.NEOX_QKV_OUT if rules.NEOX_QKV_OUT.name in saved else v  # Phi-3's V, a view of the whole qkv output
    weights = f"{g}/dropped" if dropout else f"{g}/weights"
    sums, qk_backward, context_backward = torch_ops.core_backward(g, z, gqa, weights, z.act * scores)
    scale = Step("the scale's backward", (Made(f"{g}/scaled scores", z.act * scores, "the mask's passes dY on"),),
                 frees=(f"{g}/scores",), moment=False)
    tanh = kept_name(p, rules.SOFTCAP_TANH)
    capped = (Op("self_attn", (  # each a new (b, a, s, s) tensor, the last one's gone
        Step("(.) / softcap", (Made(f"{p}/scores divided", z.act * scores, "a temporary"),),
             frees=(f"{p}/scores scaled",)),
        Step("tanh", (kept(p, rules.SOFTCAP_TANH),), frees=(f"{p}/scores divided",)),
        Step("(.) * softcap", (Made(f"{p}/scores capped", z.act * scores, "a temporary"),), reads_last=(tanh,)),
    ), (*_softcap_backward(g, z.act * scores), scale), saves=(rules.SOFTCAP_TANH,)),)
    sc, x, cast = z.act * scores, f"{p}/scores", z.act != 4  # fp32: softmax's casts are no-ops
    # dropout's input: the softmax cast back (a local it rebinds), in fp32 the softmax itself
    cast_back = Made(f"{p}/weights", sc, "the softmax cast back, dropout's input") if dropout else \
        kept(p, rules.WEIGHTS)
    dropped = (torch_ops.dropout("self_attn", p, ledger.ATTN_DROPOUT_MASK, kept(p, ledger.ATTN_DROPOUT_OUT),
                                 f"{g}/weights", sc, gone=(cast_back.name,) if cast else (), frees=(weights,),
                                 reads=() if cast else (kept_name(p, rules.SOFTMAX_FP32),)),) if dropout else ()
    q_copied, k_copied, v_copied = _bmm_copies(z, saved, fused)
    repeated = expanded and not v_copied  # repeat_kv's copies, kept to the core's return; else matmul's, to bmm's
    copies = tuple(Step(f"repeat_kv({n})", (kept(p, t),)) for n, t in (("k", k), ("v", v))) if repeated else ()
    qk = ((ledger.Q,) if q_copied else ()) + ((k,) if k_copied else ())
    return (
        Op("self_attn", copies, sums),
        Op("self_attn", (
            *(Step("made contiguous for bmm", (kept(p, t),)) for t in qk),
            Step("QK^T", (Made(x, sc, "bmm's output"),), reads_last=tuple(kept_name(p, t) for t in qk)),
            Step("times the scale", (Made(f"{x} scaled", sc, "a temporary"),), frees=(x,)),
        ), (qk_backward,), saves=(ledger.Q, k)),
        *(capped if softcap else ()),
        Op("self_attn", (
            Step("plus the mask", (Made(f"{x} masked", sc, "a local, rebound by the softmax"),),
                 frees=(f"{x} scaled", f"{x} capped")),
            *((Step("the cast to fp32", (Made(f"{x} fp32", 2 * sc, "softmax's input, a temporary"),)),
               Step("the fp32 softmax", (kept(p, rules.SOFTMAX_FP32),), frees=(f"{x} fp32",)),
               Step("the cast back: the attention weights", (cast_back,), frees=(f"{x} masked",),
                    reads_last=(kept_name(p, rules.SOFTMAX_FP32),))) if cast else
              (Step("the fp32 softmax: the attention weights", (kept(p, rules.SOFTMAX_FP32),),
                    frees=(f"{x} masked",)),)),
        ), (
            *((Step("the cast to bf16's backward", (Made(f"{g}/softmax fp32", 4 * scores, "the gradient up to fp32"),),
                    frees=(f"{g}/weights",), moment=False),) if cast else ()),
            Step("the fp32 softmax's backward", (Made(f"{g}/scores fp32" if cast else f"{g}/scores", 4 * scores,
                                                      "softmax's backward"),),
                 frees=(f"{g}/softmax fp32" if cast else f"{g}/weights",), returns=True),
            *((Step("the cast to fp32's backward", (Made(f"{g}/scores", z.act * scores, "back to bf16"),),
                    frees=(f"{g}/scores fp32",), moment=False),) if cast else ()),
            *(() if softcap else (scale,)),
        ), saves=(rules.SOFTMAX_FP32,)),
        *dropped,
        Op("self_attn", (
            *((Step("V made contiguous for bmm", (kept(p, v),)),) if v_copied else ()),
            *context(p, z, q, (kept_name(p, v),) if v_copied else (),
                      tuple(kept_name(p, t) for t in (k, v)) if repeated else ()),
        ), context_backward, saves=(ledger.ATTN_DROPOUT_OUT if dropout else rules.WEIGHTS, v)),
    )


def context(p: str, z: Sizes, q: int, read: tuple[str, ...], gone: tuple[str, ...]) -> tuple[Step, ...]:
    """weights x V (`read` last there), then transpose(1, 2).contiguous(): a copy but for one token or one head a rank
    ((b, a, 1, d) transposed is contiguous already); `gone` goes as the core returns."""
    if z.s == 1 or z.a_t == 1:
        return (Step("weights x V: o_proj's input", (kept(p, ledger.PROJ_IN),), reads_last=(*read, *gone)),)
    return (Step("weights x V", (Made(f"{p}/context", q, "bmm's output, (b, a, s, d)"),), reads_last=read),
            Step("the context made (b, s, a, d)", (kept(p, ledger.PROJ_IN),), frees=(f"{p}/context",),
                 reads_last=gone))


def _softcap_backward(g: str, scores: int) -> tuple[Step, ...]:
    """Gemma 2's soft-capping undone, each a new (b, a, s, s) gradient in place of the last; the scale's backward
    takes the last as "scores"."""
    names = (f"{g}/scores", f"{g}/capped", f"{g}/tanh")
    return tuple(Step(f"{what}'s backward", (Made(new, scores, f"{what}'s gradient"),), frees=(old,), moment=False)
                 for what, old, new in zip(("(.) * softcap", "tanh", "(.) / softcap"), names, (*names[1:], names[0])))


def sdpa(p: str, z: Sizes, saved: dict[str, int], dy: str) -> tuple[Op, ...]:
    """SDPA's flash kernel, one kernel each way (`dy` its output's gradient); with dropout on CUDA too, which
    regenerates its mask in backward from the RNG state mha_fwd allocates with or without dropout (torch's
    flash_api.cpp: read from code, not measured). GLM's output, laid out as its (b, a, s, d) query, is copied
    (b, s, a, d) for o_proj (the ledger's GLM_SDPA_OUT). It keeps q, k and v, its output and the log-sum-exp, which
    F.scaled_dot_product_attention does not return."""
    g, kv = f"grad/{p}", z.full(z.g_t * z.d)
    out = rules.GLM_SDPA_OUT if rules.GLM_SDPA_OUT.name in saved else ledger.PROJ_IN
    copied = (Step("the output made (b, s, a, d)", (kept(p, ledger.PROJ_IN),), reads_last=(kept_name(p, out),)),) \
        if out != ledger.PROJ_IN else ()
    return (Op("self_attn", (Step("SDPA's flash kernel: its output and log-sum-exp", (
        kept(p, out), kept(p, ledger.SOFTMAX_LSE)), reads_last=(kept_name(p, ledger.SOFTMAX_LSE),)), *copied), (
        Step("the SDPA kernel's backward: dQ, dK, dV", (
        Made(f"{g}/q heads", z.full(z.a_t * z.d), "dQ"), Made(f"{g}/k heads", kv, "dK, at g heads"),
        Made(f"{g}/v heads", kv, "dV, at g heads")), frees=(dy,)),),
        saves=(ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, out)),)


def sdpa_math(p: str, z: Sizes, gqa: bool, dy: str, v: str, kept_v: tuple[SavedTensor, ...] = (rules.MATH_V,),
              q_folds: bool = True) -> tuple[Op, ...]:
    """SDPA with dropout on a CPU: torch's math kernel (aten _scaled_dot_product_attention_math), its ops recorded by
    autograd one by one, all in fp32 (q, k and v cast up, q and k^T scaled, K and V repeated to every head under GQA
    with enable_gqa, bmm, the causal mask added, _safe_softmax, dropout's scaled mask, bmm), its output cast back. Its
    backward runs those ops' backward in autograd's order: the dropout branch, then k's scale, the repeats' sums (v's,
    then k's), q's scale, the three casts down (v's, k's, q's; in fp32 every cast is a no-op). `dy`: the output's
    gradient (o_proj's dX); `v`: the tensor v is; `kept_v`: what bmm keeps of v (GPT-2's in fp32: the ledger's
    GPT2_MATH_V, or c_attn's whole output); `q_folds`: whether q is laid out (b, s, a, d), Llama's (GLM's is RoPE's
    contiguous concatenation). Its forward op by op (`math_forward`) is the first op's."""
    g, (heads, groups, folded), fp32 = f"grad/{p}", _math_sizes(z), z.act == 4
    scores = 4 * z.b * z.a_t * z.s * z.s

    def grad(n: str, expanded: bool, scaled: str = "") -> str:  # in fp32 the cast's backward is the gradient itself
        return f"{g}/math d{n}{scaled} expanded" if expanded else f"{g}/{n} heads" if fp32 else f"{g}/math d{n}{scaled}"

    out = dy if fp32 else f"{g}/math out"
    dropped = Op("self_attn", (), (
        *(() if fp32 else (Step("the output's cast to bf16: its backward", (Made(out, heads, "dO in fp32"),),
                                frees=(dy,), moment=not folded),)),
        *((Step("dO made contiguous to fold (b, a) for bmm", (Made(f"{g}/math out folded", heads, "a copy"),),
                frees=(out,)),) if folded else ()),
        Step("dropped x V: dV and the dropped weights' gradient", (
            Made(grad("v", gqa), heads, "dV = dropped^T dO, at a heads"),
            Made(f"{g}/math dropped", scores, "dDropped = dO V^T, fp32 (b, a, s, s)")),
            frees=(f"{g}/math out folded" if folded else out,)),
    ), saves=(rules.MATH_DROPOUT_OUT, *kept_v))
    mask = Op("self_attn", (), (
        Step("dropout's backward: dY * mask", (Made(f"{g}/math softmax", scores, "the softmax's gradient"),),
             frees=(f"{g}/math dropped",)),), saves=(rules.MATH_DROPOUT_MASK, rules.MATH_SOFTMAX))
    softmax = Op("self_attn", (), (
        Step("_safe_softmax's backward", (Made(f"{g}/math scores", scores, "the scores' gradient (the mask's add"
                                               " passes it on)"),), frees=(f"{g}/math softmax",)),),
                 saves=(rules.MATH_SOFTMAX,))
    scaled = Op("self_attn", (), (
        Step("QK^T: dK^T and dQ", (Made(f"{g}/math dk^T", heads, "dK^T = Q^T dScores"),
                                   Made(f"{g}/math dq", heads, "dQ = dScores K")), frees=(f"{g}/math scores",),
             returns=True),
        Step("k^T * scale's backward", (Made(grad("k", gqa), heads, "dK^T * scale, transposed back"),),
             frees=(f"{g}/math dk^T",)),
        *(Step(f"repeating {n}'s backward: summed over each group's heads", (
            Made(grad(n, False), groups, f"d{n} at g heads, fp32"),), frees=(grad(n, True),))
          for n in (("v", "k") if gqa else ())),
        Step("q * scale's backward", (Made(grad("q", False, " scaled"), heads, "dQ * scale"),),
             frees=(f"{g}/math dq",)),
        *(Step(f"{n}'s cast to fp32: its backward", (Made(f"{g}/{n} heads", z.full(w * z.d), f"d{n} cast back"),),
               frees=(grad(n, False, scaled),)) for n, w, scaled in (("v", z.g_t, ""), ("k", z.g_t, ""),
                                                                      ("q", z.a_t, " scaled")) if not fp32),
    ), saves=(rules.MATH_Q, rules.MATH_K))
    return (replace(scaled, forward=math_forward(p, z, gqa, v, kept_v, q_folds)), softmax, mask, dropped)


def math_forward(p: str, z: Sizes, gqa: bool, v: str, kept_v: tuple[SavedTensor, ...], q_folds: bool = True
                 ) -> tuple[Step, ...]:
    """The math kernel's forward for a walk op by op (GPT-2's; Llama's under a checkpoint): what it keeps that no C++
    local holds to its return (k^T scaled, the softmax, dropout's mask; matmul's copies of q scaled and v to fold
    (b, a)) goes at once under a checkpoint, marking no moment; then its widest moment as it returns its output (its
    locals, `math_locals`, and the saved tensors they are; in fp32 v's cast is `v` itself, kept as its MATH_V unless
    repeated or copied; GPT-2's `kept_v`, a copy or c_attn's output, is not the kernel's local); then its output made
    (b, s, a, d), a copy unless one head or one token."""
    folded, fp32, own = _math_sizes(z)[2], z.act == 4, rules.MATH_V in kept_v
    copied = folded and not gqa if own else rules.GPT2_MATH_V in kept_v
    gone = (rules.MATH_K, rules.MATH_SOFTMAX, rules.MATH_DROPOUT_MASK, *((rules.MATH_Q,) if folded and q_folds else ()),
            *(kept_v if copied else ()))
    aliased = own and fp32 and not gqa and not folded
    held = tuple(kept(p, x) for x in (rules.MATH_Q, rules.MATH_DROPOUT_OUT, *((rules.MATH_V,) if own and not aliased
                                                                              else ())) if x not in gone)
    same = (Made(v, 0, "v.to(float32) in fp32: v itself", keeps=rules.MATH_V, alias=True),) if aliased else ()
    locals_ = math_locals(p, z, gqa, q_folds)
    out = locals_[-1] if fp32 else Made(f"{p}/math output", z.full(z.a_t * z.d), "the output cast back to bf16")
    return (
        Step("what the math kernel keeps but no local of it holds", tuple(kept(p, x) for x in gone),
             reads_last=kept_names(p, *gone), moment=False),
        Step(MATH_WIDEST, (*held, *same, *locals_, *(() if fp32 else (out,))),
             frees=tuple(x.name for x in locals_ if x is not out), reads_last=tuple(x.name for x in held)),
        Step("the context made (b, s, a, d)", (kept(p, ledger.PROJ_IN),), frees=(out.name,),
             moment=z.a_t > 1 and z.s > 1),
    )


def _math_sizes(z: Sizes) -> tuple[int, int, bool]:
    """The math kernel's fp32 (b, a, s, d) and (b, g, s, d) bytes, and whether bmm copies a (b, a, s, d) view of a
    (b, s, a, d) tensor (q, multi-head k and v, dO) to fold (b, a) into one batch: unless b, a or s is 1."""
    return 4 * z.b * z.a_t * z.s * z.d, 4 * z.b * z.g_t * z.s * z.d, z.b > 1 and z.a_t > 1 and z.s > 1


MATH_WIDEST = "SDPA's math kernel at its widest, as it returns its output"


def math_locals(p: str, z: Sizes, gqa: bool, q_folds: bool = True) -> tuple[Made, ...]:
    """The math kernel's C++ locals at its widest, bmm's output last (in fp32 the kernel's output; the ledger's
    SDPA_MATH aside). In fp32 q's, k's and v's casts and the dropped-out weights' are no-ops: no locals. `q_folds`: as
    `sdpa_math`'s."""
    heads, groups, folded = _math_sizes(z)
    cast = z.act != 4
    return (
        *((Made(f"{p}/math q", heads, "q.to(float32), a local"),
           Made(f"{p}/math k", groups, "k.to(float32), a local")) if cast else ()),
        *((Made(f"{p}/math v", groups, "v.to(float32), a local (matmul copies it to fold (b, a))"),)
          if (gqa or folded) and cast else ()),  # else the kept MATH_V
        *((Made(f"{p}/math q scaled", heads, "q * sqrt(scale), a local (matmul copies it to fold (b, a))"),)
          if folded and q_folds else ()),  # else the kept MATH_Q
        *((Made(f"{p}/math mask", 4 * z.s * z.s, "the causal (s, s) fp32 mask, from a bool tril"),)
          if z.s > 1 else ()),  # one token attends without a mask (is_causal false)
        *((Made(f"{p}/math k expanded", heads, "K repeated to every head (enable_gqa), a local"),) if gqa else ()),
        *((Made(f"{p}/math weights", z.act * z.b * z.a_t * z.s * z.s, "the dropped-out weights cast to bf16,"
                " returned beside the output and dropped"),) if cast else ()),
        Made(f"{p}/math context", heads, "bmm's fp32 output"),
    )


def mlp(p: str, z: Sizes, tp: bool, gated: tuple[SavedTensor, SavedTensor, SavedTensor], dy: str | None = None,
        fused: bool = False, made_as: str = "mlp output", into: tuple[str, str] = ("", "")) -> tuple[Op, ...]:
    """LlamaMLP; down_proj's dY is the layer's output gradient, which ln2's residual sum still needs. `gated`: what the
    activation and the product keep (GemmaMLP's tanh GELU keeps as SiLU does); `dy`: down_proj's output gradient when
    it is not the layer's (Gemma 2's post_feedforward_layernorm's dX, Phi-3's resid_mlp_dropout's); `fused`: Phi-3's
    one gate_up_proj, chunked; `made_as`: down_proj's output's name; `into`: as `attention`'s, up's dX and gate's."""
    g, f = f"grad/{p}", z.f_t
    gate_in, up, act_out = gated
    full = z.full(z.h)
    halves = kept_names(p, gate_in, up) if fused else ()  # one storage, gone as the MLP returns
    activation = Step("the activation", (kept(p, act_out),), reads_last=() if fused else kept_names(p, gate_in))
    silu = Op("mlp.activation_fn" if fused else "mlp.act_fn", (activation,), (
        Step("SiLU's backward, at its kept input", (Made(f"{g}/gate", z.full(f), "dSiLU"),), frees=(f"{g}/silu",),
             moment=False),), saves=(gate_in,))
    product = Op("mlp", (Step("act(gate) * up", (kept(p, ledger.FC2_IN),),
                              reads_last=kept_names(p, act_out, *(() if fused else (up,)))),), (
        Step("SiLU(gate) * up: its two gradients", (
        Made(f"{g}/up", z.full(f), "dY * SiLU(gate)"), Made(f"{g}/silu", z.full(f), "dY * up")),
        frees=(f"{g}/down_proj input",)),), saves=(up, act_out))
    down = replace(linear("mlp.down_proj", ledger.FC2_IN, None, z.weight("mlp.down_proj"), f"{g}/down_proj input",
                          z.full(f), p, (dy,) if dy else ()),
                   forward=(rowwise(Step("the GEMM", (Made(f"{p}/{made_as}", z.full(z.h), "down_proj's output"),),
                                         reads_last=(*kept_names(p, ledger.FC2_IN, ledger.FC1_IN), *halves)),
                                    f"{p}/mlp partial", tp),))
    if fused:
        chunk = Op("mlp", (), (Step("chunk's backward: the two gradients concatenated", (
            Made(f"{g}/gate_up", z.full(2 * f), "(b, s, 2f), gate's and up's"),), frees=(f"{g}/gate", f"{g}/up"),
            moment=False),))
        gate_up = linear("mlp.gate_up_proj", ledger.FC1_IN, None, z.weight("mlp.gate_up_proj"), f"{g}/ln2 output",
                         full, p, (f"{g}/gate_up",), reduced=tp)
        return (replace(gate_up, forward=(Step("the GEMM: gate and up, chunked", (kept(p, gate_in), kept(p, up))),)),
                chunk, silu, product, down)
    residual, out = into
    summed = f"{g}/up + stream" if residual else f"{g}/up_proj input"
    gate = linear("mlp.gate_proj", ledger.FC1_IN, kept(p, gate_in), z.weight("mlp.gate_proj"), f"{g}/gate_proj input",
                  full, p, (f"{g}/gate",), sums=(summed, out or f"{g}/ln2 output", full), reduced=tp)
    up_proj = linear("mlp.up_proj", ledger.FC1_IN, kept(p, up), z.weight("mlp.up_proj"), f"{g}/up_proj input", full,
                     p, (f"{g}/up",), sums=(residual, summed, full) if residual else None, reduced=tp)
    return gate, silu, up_proj, product, down



# the core's widest forward step in each attention walked op by op, by its words, and its moment's words
CORE_MOMENTS = {"the fp32 softmax": "the fp32 softmax", "the fp32 softmax: the attention weights": "the fp32 softmax",
                MATH_WIDEST: MATH_WIDEST}


def core_forward(attention: tuple[Op, ...], rope: Sequence[Op] = ()) -> tuple[Op, ...]:
    """The attention's ops (op by op, o_proj last) as a layer's forward without a checkpoint walks them (`widest`):
    a moment at the core's widest step (eager's fp32 softmax, wider than the layer's end where s^2 >> h; the math
    kernel's as it returns its output) and at each step of `rope`'s ops (OLMo's and Cohere's fp32 RoPE, whose
    products and sums are wider than the layer's end where heads are wide), the tensors kept by then made there, the
    rest after the last (all of it after the last step with SDPA's flash kernel: the layer's end is wider)."""
    return widest_forward(attention, CORE_MOMENTS, frozenset(step.what for op in rope for step in op.forward))
