"""Megatron's transformer layer (impl megatron and paper) in the step, described once as ordered ops.

Its ops in order, what the forward moment holds and full recomputation: docs/timeline.md, "Megatron's layer".
"""

from __future__ import annotations

from dataclasses import replace
from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.model.ledger import NormTensors, SavedTensor
from memcalc.sizing.timeline import megatron_mla, megatron_moe, walk
from memcalc.sizing.timeline.megatron_pieces import (
    WGRAD, Has, activation, backward_only, norm_kernel, one, row_parallel, softmax, weight,
)
from memcalc.sizing.timeline.tape import ACTIVATIONS, TEMPORARIES, Sizes
from memcalc.sizing.timeline.walk import Made, Op, Step

INPUT = ledger.LN1.input.name  # the layer's input, the previous block's output
OUTPUT = "layer/output"  # the layer's output, made in forward (the next layer's INPUT)
OUTPUT_GRAD = "grad/layer output"  # the gradient the layer's backward starts from
INPUT_GRAD = "grad/layer input"  # and the one it ends with (the previous layer's OUTPUT_GRAD)

# What the layer's block makes outside its submodules (memcalc.probe.layer._block): the residual adds and their
# dropout. MemTracker files what the block makes in full recomputation's rerun as temporaries (the rerun calls the
# block, not the layer module), what a submodule's forward makes as activations.
_MADE_BY_THE_BLOCK = {x.name for x in (ledger.LN2.input, ledger.ATTN_OUT_DROPOUT_MASK, ledger.MLP_DROPOUT_MASK)}


def layer_ops(
    config: ModelConfig, z: Sizes, kept: tuple[SavedTensor, ...], rerun: tuple[SavedTensor, ...],
    saved: dict[str, int],
) -> tuple[Op, ...]:
    """One layer, in forward order: `kept` is what the ledger says its forward keeps, `rerun` what the layer keeps
    without recomputation (made again in backward under recomputation), `saved` the bytes of both by name (which
    tensors exist decides the ops: the dropout masks, the softmax's, grouped-query attention's copies)."""
    has = saved.__contains__
    full = config.recompute == "full"
    backward: list[Op] = []  # built in backward order, each op taking the gradient the one before it made
    grad = _dropout(backward, z, ledger.MLP_DROPOUT_MASK, "the MLP", OUTPUT_GRAD, has)
    if config.moe:
        grad = megatron_moe.moe_ops(backward, config, z, grad, OUTPUT_GRAD)
    else:
        backward.append(row_parallel(z, "mlp.fc2", ledger.FC2_IN, grad, OUTPUT_GRAD, z.f_t, "grad/fc2 input"))
        grad = activation(backward, config, z, "mlp", "...", megatron.DENSE_ACT, z.b * z.s, z.f_t, "grad/fc2 input",
                          "grad/gelu input")
        grad = column_parallel(backward, z, "mlp.fc1", ledger.FC1_IN, grad, "grad/fc1 input")
    mid = "grad/ln2 input"  # the residual stream's gradient between the two halves
    backward.append(_norm(z, "ln2", ledger.LN2, grad, () if full else (OUTPUT_GRAD,), mid))
    grad = _dropout(backward, z, ledger.ATTN_OUT_DROPOUT_MASK, "attention", mid, has)
    if config.mla:  # megatron-core's MLASelfAttention, built on this module's pieces (imported here: no cycle)
        grad = megatron_mla.attention(backward, config, z, grad, mid, has)
    else:
        backward.append(row_parallel(z, "attention.proj", ledger.PROJ_IN, grad, mid, z.h_t, "grad/proj input"))
        _attention(backward, config, z, "grad/proj input", has)
        grad = column_parallel(backward, z, "attention.qkv", ledger.QKV_IN, "grad/qkv output", "grad/qkv input")
    backward.append(_norm(z, "ln1", ledger.LN1, grad, (mid,), INPUT_GRAD))
    if config.moe:  # the experts' widest forward moment first, then the layer's end
        # full's forward keeps nothing: the block's residual and MoELayer's locals, gone by the layer's end
        gone = (ledger.LN2.input, *megatron_moe.LOCALS) if full else ()
        made = gone or _made_here(kept)
        later = tuple(x for x in made if x.name == ledger.MLP_DROPOUT_MASK.name)
        before = tuple(walk.kept("", x) for x in made if x not in later)
        moments = megatron_moe.experts_forward(config, z, before, tuple(x.name for x in gone))
        backward.extend((_layer(z, later, full), *reversed(moments)))
    else:
        backward.append(_layer(z, _made_here(kept), full))
    if full:  # the checkpoint's backward runs outside the modules' backward hooks: MemTracker reads the layer's
        backward = [*_rerun_layer(config, z, rerun, has),
                    *(replace(x, where="", shadow="") if x.backward else x for x in backward)]
    return tuple(reversed(backward))


def _made_here(kept: tuple[SavedTensor, ...]) -> tuple[SavedTensor, ...]:
    """What the layer's forward makes of what it keeps: all but its input, live already."""
    return tuple(x for x in kept if x.name not in (INPUT, ledger.LAYER_INPUT.name))


def _layer(z: Sizes, made: tuple[SavedTensor, ...], full: bool) -> Op:
    """The layer's forward as one moment: the saved tensors it makes (`made`) and its output. Under full
    recomputation it is a checkpoint: it keeps the layer's input, and when it returns its rerun's output and the
    output's gradient (held while the rerun's backward runs) go."""
    tensors = tuple(walk.kept("", x) for x in made)
    output = Made(OUTPUT, z.seq(z.h), "the layer's output, the next block's input")
    returns = (Step("the checkpoint returns", frees=("layer/recomputed output", OUTPUT_GRAD)),) if full else ()
    return Op("", forward=(Step("the layer's saved tensors", (*tensors, output)),), backward=returns,
              saves=(ledger.LAYER_INPUT,) if full else ())


def _rerun_layer(config: ModelConfig, z: Sizes, rerun: tuple[SavedTensor, ...], has: Has) -> tuple[Op, ...]:
    """Full recomputation: the checkpoint runs the layer's forward again, to its last residual add, inside backward,
    making again what the layer keeps without recomputation (the input is the checkpoint's), filed as MemTracker files
    it; with experts, their widest moments first, else fc2's forward, whose transients can outweigh the rerun's end."""
    again = tuple(
        Made(x.name, 0, "kept by the layer's rerun under full recomputation", keeps=x,
             category="" if x.name in _MADE_BY_THE_BLOCK else ACTIVATIONS)
        for x in rerun if x.name != INPUT
    )
    later = tuple(x for x in again if x.name == ledger.MLP_DROPOUT_MASK.name)  # the block's, after the MLP
    before = tuple(x for x in again if x not in later)
    core: tuple[Op, ...] = ()
    if config.attention == "eager" and not config.mla:
        core, before = _eager_core_rerun(z, before, has)
    mlp = Made("layer/recomputed MLP output", z.seq(z.h), "the MLP's output (a submodule's forward's)",
               category=ACTIVATIONS)
    first, made = ((megatron_moe.experts_forward(config, z, before, rerun=True), (mlp,)) if config.moe
                   else ((_fc2_rerun(config, z, before, mlp),), ()))
    output = Made("layer/recomputed output", z.seq(z.h),
                  "the rerun's output: the checkpoint holds it while autograd runs the layer's backward")
    first = (*core, *first)
    to = "full recomputation: the layer's forward again, to"
    if not has(ledger.MLP_DROPOUT_MASK.name):  # the MLP's output is the last residual add's other operand
        return (*first, backward_only("", Step(f"{to} its last residual add", (*later, output, *made),
                                               frees=(mlp.name,))))
    # with dropout the MLP's output goes once the dropout's (the block's, a temporary) is made: a moment before the
    # residual add makes as many bytes again, so that MemTracker reads a tie there first
    dropped = Made("layer/recomputed MLP dropout", z.seq(z.h), "the MLP's dropout, the last residual add's other"
                   " operand", category=TEMPORARIES)
    return (*first, backward_only(
        "", Step(f"{to} the MLP's dropout", (*later, *made, dropped), frees=(mlp.name,)),
        Step("the rerun's last residual add", (output,), frees=(dropped.name,))))


def _eager_core_rerun(z: Sizes, made: tuple[Made, ...], has: Has) -> tuple[tuple[Op, ...], tuple[Made, ...]]:
    """The rerun to the eager core's end (memcalc.probe.attention.eager_core, as megatron-core's DotProductAttention),
    read in the attention where it is widest: at the fp32 softmax's cast back (forward_torch_softmax still holds the
    scores' fp32 copy), at the dropout (which frees that cast) and at the projection's input (the bmm's output made
    contiguous: a copy unless s = 1 or b*a/t = 1). Beside what the rerun keeps, the core's frame holds the scores
    (megatron's matmul_result), and the attention's, until it returns, the K and V that grouped-query attention
    expands. `made`: what the rerun makes to fc2, of which it makes those to the projection's input. Returns its op
    and the rest."""
    end = 1 + next(i for i, x in enumerate(made) if x.name == ledger.PROJ_IN.name)
    core, rest = made[:end], made[end:]
    bass, heads = z.b * z.a_t * z.s * z.s, z.act * z.b * z.s * z.d
    fp32, out, proj_in = megatron.SOFTMAX_FP32.name, ledger.SOFTMAX_OUT.name, ledger.PROJ_IN.name
    dropped = (ledger.ATTN_DROPOUT_MASK.name, ledger.ATTN_DROPOUT_OUT.name)
    wide = has(fp32)  # torch's softmax in fp32 of 16-bit scores, cast back

    def made_as(*names: str) -> tuple[Made, ...]:
        return tuple(x for x in core if x.name in names)

    def local(name: str, nbytes: int, why: str) -> Made:
        return Made(f"attention/recomputed {name}", nbytes, why, category=ACTIVATIONS)

    grouped = has(megatron.K_EXPANDED.name) and not has(megatron.QKV_OUT.name)  # else views of the kept QKV output
    kv = tuple(local(x.name.rpartition("/")[2], heads * z.g_t, "what grouped-query attention expands, a local")
               for x in (ledger.K, ledger.V) if grouped and not has(x.name))  # (with QK norms V is kept)
    scores = local("scores", z.act * bass, "baddbmm's output, held by the core to its end (matmul_result)")
    copy = local("scores fp32", 4 * bass, "the scores' fp32 copy, forward_torch_softmax's local until it returns")
    cast = made_as(out) or (local("softmax cast", z.act * bass, "the softmax cast back, dropout's input alone"),)
    context = local("context", heads * z.a_t, "the bmm's output, (b*a/t, s, d), copied contiguous")
    copied = z.s > 1 and z.b * z.a_t > 1  # else (s, b, a/t, d) permuted from (b, a/t, s, d) is contiguous already
    steps = (
        Step("the scores and their softmax", (
            *(x for x in core if x.name not in (fp32, out, *dropped, proj_in)), *kv, scores,
            *((copy, *made_as(fp32)) if wide else made_as(out))), moment=False),
        *((Step("the softmax cast back", cast, frees=(copy.name,)),) if wide else ()),
        *((Step("attention dropout", made_as(*dropped), frees=tuple(x.name for x in cast if wide and not x.keeps)),)
          if has(ledger.ATTN_DROPOUT_MASK.name) else ()),
        Step("weights x V, made contiguous: the projection's input", (*(context,) * copied, *made_as(proj_in)),
             frees=(context.name,) * copied + (scores.name,)),
        Step("", frees=tuple(x.name for x in kv)),  # as the attention returns
    )
    return (backward_only("attention", *steps),), rest


def _fc2_rerun(config: ModelConfig, z: Sizes, before: tuple[Made, ...], mlp: Made) -> Op:
    """The rerun to fc2's output (memcalc.probe.linear.RowParallelLinear's forward), read in fc2 as its forward runs:
    what the rerun made before it (`before`), and its GEMM's share of the sum on the whole sequence, f*'s all-reduced
    copy (g*'s reduce-scatter under SP) and the bias added to it, each a new tensor; the first two go as fc2 returns,
    its output (`mlp`) stays. At t = 1 the sum is the GEMM's output itself; without a bias the output is the sum."""
    bias, split = config.add_bias_linear, z.t > 1
    partial = Made("layer/recomputed fc2 partial", z.full(z.h), "fc2's GEMM: this rank's share of the sum",
                   category=ACTIVATIONS)
    summed = Made("layer/recomputed fc2 sum", z.seq(z.h), "f*'s all-reduce into a copy (g*'s reduce-scatter under"
                  " SP): the sum, before the bias", category=ACTIVATIONS)
    passing = (partial,) * (bias or split) + (summed,) * (bias and split)
    return backward_only("mlp.fc2", Step("full recomputation: the layer's forward again, to fc2's output",
                                         (*before, *passing, mlp), frees=tuple(x.name for x in passing)))


# -- the pieces every layer is built from ---------------------------------------------------------------------


def _dropout(ops: list[Op], z: Sizes, mask: SavedTensor, what: str, grad: str, has: Has) -> str:
    """Dropout before a residual add: dY times the mask, a new tensor beside dY (which the residual path still
    needs); none without dropout. Returns the branch's gradient."""
    if not has(mask.name):
        return grad
    branch = f"grad/{what} dropout"
    ops.append(one("", f"dropout after {what}", Made(branch, z.seq(z.h), "dropout's backward: dY times the mask, a"
                                                      " new tensor"), (), saves=(mask,)))
    return branch


def column_parallel(ops: list[Op], z: Sizes, where: str, x: SavedTensor, grad: str, dx: str,
                    tied: Made | None = None) -> str:
    """QKV, fc1 or the output layer: dX, dW and the bias's gradient (if it has a bias) beside dY, then the
    saved input goes; under SP the input is all-gathered again and dX reduce-scattered; under TP without SP, f's
    backward all-reduces dX into a copy (the input of an autograd op is never changed). `tied`: the gradient of a weight
    shared with the embedding, which autograd keeps (not handed over) until the other use's is added. Returns dX's
    name."""
    bias = weight(z, where, bias=True)
    bias_grad = Made(f"grad/{where} bias", bias, "the bias's gradient, dY summed over tokens")
    weights = (tied or Made(f"grad/{where} weight", weight(z, where), WGRAD), *((bias_grad,) if bias else ()))
    handed = tuple(x.name for x in weights if x is not tied)
    dw = "dW and the bias's gradient" if bias else "dW"
    if z.sp:  # memcalc.probe.linear._GatheredInputLinear
        gathered, partial = f"grad/{where} input gathered", f"grad/{where} partial dX"
        ops.append(backward_only(
            where,
            Step("re-gathered input, partial dX and its reduce-scatter", (
                Made(gathered, z.full(z.h), "forward kept only the input's shard: backward all-gathers it"),
                Made(partial, z.full(z.h), "dX = dY W on the whole sequence, this rank's partial sum"),
                Made(dx, z.seq(z.h), "the reduce-scatter's output: this rank's shard of dX")), frees=(partial,)),
            Step(f"{dw} beside the re-gathered input", weights, frees=(gathered, grad),
                 hands_over=handed),
            saves=(x,)))
        return dx
    gemms = Step(f"GEMMs: dX and {dw}", (Made(dx, z.full(z.h), "dX = dY W, the input's gradient"), *weights),
                 frees=(grad,), hands_over=handed, returns=True)
    reduced = f"{dx} (all-reduced)" if z.t > 1 else dx
    reduce = (Step("all-reduce of dX (f's backward)", (
        Made(reduced, z.full(z.h), "f's backward all-reduces dX into a copy"),), frees=(dx,)),) if z.t > 1 else ()
    ops.append(backward_only(where, gemms, *reduce, saves=(x,)))
    return reduced


def _norm(z: Sizes, where: str, norm: NormTensors, grad: str, residual: tuple[str, ...], out: str) -> Op:
    """The norm's backward, one kernel: dX and its weight's (and LayerNorm's bias's) gradients beside dY; then its
    saved tensors go, and the residual stream's two gradients are summed into a new tensor (autograd does it inside
    the norm's backward window: MemTracker files it under the norm). `residual`: the residual stream's gradient,
    freed by the sum (none when a checkpoint holds it)."""
    dx, dw = f"grad/{where} input (norm)", f"grad/{where} weights"
    return backward_only(
        where,
        norm_kernel(z, where, grad, dx, z.seq(z.h), dw, returns=True),
        Step("the residual stream's gradients summed", (
            Made(out, z.seq(z.h), "the residual stream's gradient: the two paths' gradients summed"),),
            frees=(*residual, dx), hands_over=(dw,)),
        saves=tuple(norm))


# -- attention ----------------------------------------------------------------------------------------------------


def _attention(ops: list[Op], config: ModelConfig, z: Sizes, dcontext: str, has: Has) -> None:
    """The core's backward from the projection's input gradient `dcontext` to the QKV output's.

    Under selective recomputation a checkpoint (memcalc.probe.checkpoint) wraps the core: it keeps q, k and v (and
    under GQA the QKV output's query columns) and holds dY; at the start of its backward it reruns the core, which
    makes again what the core keeps, and when it returns its inputs, its rerun's output and dY go.
    """
    selective = config.recompute == "selective"
    # what QK^T keeps of the query beside q: the core's copy, or the fused QKV output it views (impls.megatron)
    query = tuple(x for x in (megatron.QUERY_COPY, megatron.QKV_OUT) if has(x.name))
    core: list[Op] = []
    frees = () if selective else (dcontext,)  # what the core's backward frees first: dY, unless the checkpoint holds it
    k, v = (_flash(core, z, frees, selective) if config.attention == "flash"
            else _eager(core, config, z, frees, has, (*query, ledger.Q)))
    if selective:
        checkpoint = (ledger.Q, ledger.K, ledger.V, megatron.QKV_QUERY_COLUMNS)
        held = {x.name for x in (*checkpoint, *query)}  # the rerun's query: a view of the checkpoint's q
        again = {x.name: x for op in core for x in op.saves if x.name not in held}.values()
        what = "the flash kernel's" if config.attention == "flash" else "the attention core's"
        ops.append(backward_only("attention", Step(f"selective recomputation: {what} forward again", (
            *(walk.kept("", x, "made again by selective recomputation's rerun of the core") for x in again),
            Made("attention/recomputed output", z.full(z.h_t),
                 "the rerun's output: the checkpoint holds it while autograd runs the core's backward")))))
    ops.extend(core)
    if selective:
        ops.append(backward_only("attention", Step("the checkpoint returns", frees=(
            "attention/recomputed output", dcontext)), saves=checkpoint))
    q = "grad/q"
    if config.qk_layernorm:
        q, k = _head_norms(ops, z, q, k)
    ops.append(one("attention", "dQ, dK, dV concatenated into the QKV output's gradient", Made(
        "grad/qkv output", z.full(z.qkv_t), "q, k and v were split from one QKV output: their gradients concatenated"),
        (q, k, v)))


def _head_norms(ops: list[Op], z: Sizes, dq: str, dk: str) -> tuple[str, str]:
    """qk_layernorm's backward, the key's norm first (autograd runs the later node first): each one kernel, dX and
    the d-wide weight's (and bias's) gradients beside dY. The norms read views of the fused QKV output
    (memcalc.model.impls.megatron), which goes with the last of them: with the query heads copied out of it (a/g > 1,
    g/t > 1) the key's (V and the query columns with it), else the query's (K's input and V). Returns dX's names."""
    copied = z.a_t > z.g_t > 1
    fused = backward_only("attention", saves=(ledger.V, megatron.QKV_QUERY_COLUMNS) if copied else (
        ledger.K_NORM.input, ledger.V))
    dx = {which: f"grad/{which} norm input" for which in "qk"}
    for which, norm, grad, heads in (("k", ledger.K_NORM, dk, z.g_t), ("q", ledger.Q_NORM, dq, z.a_t)):
        where, dw = f"attention.{which}_norm", f"grad/{which} norm weights"
        ops.append(backward_only(where, norm_kernel(z, where, grad, dx[which], z.act * z.b * heads * z.s * z.d, dw,
                                                    hands_over=(dw,)), saves=tuple(norm)))
        if (which == "k") == copied:
            ops.append(fused)
    return dx["q"], dx["k"]


def _flash(ops: list[Op], z: Sizes, frees: tuple[str, ...], selective: bool) -> tuple[str, str]:
    """A flash kernel's backward: dQ, dK and dV alone (it rebuilds the softmax inside). The kernel keeps its output,
    which is the projection's input (under selective recomputation the first run's output is the projection's
    alone). Returns dK's and dV's names."""
    basd, bgsd = z.act * z.b * z.a_t * z.s * z.d, z.act * z.b * z.g_t * z.s * z.d
    ops.append(backward_only("attention", Step("flash attention: dQ, dK, dV", (
        Made("grad/q", basd, "the flash kernel's backward: dQ"),
        Made("grad/k", bgsd, "the flash kernel's backward: dK, per K/V group"),
        Made("grad/v", bgsd, "the flash kernel's backward: dV, per K/V group")), frees=frees),
        saves=(ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, *(() if selective else (ledger.PROJ_IN,)))))
    return "grad/k", "grad/v"


def _eager(ops: list[Op], config: ModelConfig, z: Sizes, frees: tuple[str, ...], has: Has,
           query: tuple[SavedTensor, ...]) -> tuple[str, str]:
    """softmax(QK^T / sqrt(d)) V backward, op by op (memcalc.probe.attention.eager_core), in backward order; `frees`:
    what weights x V's backward frees (dY, unless a checkpoint holds it); `query`: what QK^T keeps of the query
    (those the layer keeps go). Returns dK's and dV's names."""
    bass = z.b * z.a_t * z.s * z.s  # (b, a/t, s, s) elements
    basd = z.act * z.b * z.a_t * z.s * z.d  # (b, a/t, s, d) bytes
    expanded = has(megatron.K_EXPANDED.name)  # K and V copied to every head (grouped-query attention)
    k, v = (megatron.K_EXPANDED, megatron.V_EXPANDED) if expanded else (ledger.K, ledger.V)
    ops.append(backward_only("attention", Step("weights x V: dV and dWeights", (
        Made("grad/v", basd, "weights x V's backward: dV = weights^T dY"),
        Made("grad/attention weights", z.act * bass, "weights x V's backward: dWeights = dY V^T")), frees=frees),
        saves=(v, ledger.ATTN_DROPOUT_OUT if has(ledger.ATTN_DROPOUT_MASK.name) else ledger.SOFTMAX_OUT)))
    softmax(ops, config, z, "grad/attention weights", has)
    ops.append(backward_only("attention", Step("QK^T: dQ and dK", (
        Made("grad/q", basd, "QK^T's backward: dQ = dScores K, then scaled (a new tensor)"),
        Made("grad/k unscaled", basd, "QK^T's backward: dK = dScores^T Q"),
        Made("grad/k", basd, "dK scaled by 1/sqrt(d), a new tensor")), frees=("grad/scores", "grad/k unscaled")),
        saves=(*query, k)))
    if not expanded:
        return "grad/k", "grad/v"
    bgsd = z.act * z.b * z.g_t * z.s * z.d
    ops.append(backward_only("attention", *(  # repeat_interleave's backward
        Step(f"d{x.upper()} summed over each group's heads", (Made(f"grad/{x} grouped", bgsd, (
            f"repeat_interleave's backward: d{x.upper()} summed over each group's heads")),), frees=(f"grad/{x}",))
        for x in ("k", "v"))))
    return "grad/k grouped", "grad/v grouped"
