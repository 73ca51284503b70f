"""The pieces Megatron's layer ops are built of (memcalc.sizing.timeline.megatron) that its latent attention and
experts (memcalc.sizing.timeline.megatron_mla, megatron_moe) share: an op known by its backward alone, megatron's
row- and column-parallel linears' backward, a norm's, an MLP's activation's, and the softmax's, fused or torch's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.model.ledger import Dim, SavedTensor
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.walk import Made, Op, Step

Has = Callable[[str], bool]  # whether the layer keeps the saved tensor of that name (the ledger's size rules)
WGRAD = "the weight's bf16 gradient, dW = dY^T X"
# parallel_state's global memory buffer: megatron's linears under SP all-gather their input into it (the local core
# attention writes its scores there too), allocated at the largest request in the first step and kept
GLOBAL_MEMORY_BUFFER = "megatron/global memory buffer"
SOFTMAX = "softmax's backward: S' * (dY - sum(dY * S'))"
# Modules the walk names as the probe's own layer does (memcalc.probe.layer, as the paper), by megatron-core's names
_CORE_NAMES = {"ln1": "input_layernorm", "ln2": "pre_mlp_layernorm", "attention.qkv": "attention.linear_qkv",
               "attention.proj": "attention.linear_proj", "attention.q_norm": "attention.q_layernorm",
               "attention.k_norm": "attention.k_layernorm", "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2",
               "final_norm": "decoder.final_layernorm"}


def weight(z: Sizes, where: str, bias: bool = False) -> int:
    """Bytes of the gradient of the weight (`bias`: of the bias, 0 without one) of the module the walk runs at `where`,
    in the training dtype on this rank, as megatron-core's inventory holds it (memcalc.sizing.params'
    megatron_layer_params, and the output's end); a local expert's (`where` its inventory path, local_experts.*) is
    one of the E/ep the inventory lists as one."""
    module = _CORE_NAMES.get(where, where).removesuffix(".norm")  # MLA's latent norms: the probe's inside the spec
    path = f"self_{module}" if module.startswith("attention.") else module
    return z.weight(path, bias=bias) // (z.config.num_experts // z.config.ep if "*" in path else 1)


def backward_only(where: str, *steps: Step, saves: tuple[SavedTensor, ...] = ()) -> Op:
    """An op whose forward the layer's one forward moment covers: its backward steps and what it keeps."""
    return Op(where, forward=(), backward=steps, saves=saves)


def one(where: str, what: str, made: Made, frees: tuple[str, ...], saves: tuple[SavedTensor, ...] = ()) -> Op:
    """An op whose backward makes one tensor, then frees `frees`."""
    return backward_only(where, Step(what, (made,), frees), saves=saves)


def row_parallel(z: Sizes, where: str, x: SavedTensor, grad: str, residual: str, width: int, dx: str) -> Op:
    """fc2 or the projection (`width` inputs): under SP g* all-gathers dY first; then dW and dX beside dY. dY goes
    unless it is the residual stream's (`residual`), which the residual sum still needs.

    The bias's gradient (a sum over tokens) is made and added into the buffer before the GEMMs: no moment.
    """
    steps: tuple[Step, ...] = ()
    done = () if grad == residual else (grad,)
    if z.sp:
        gathered = f"grad/{where} gathered"
        steps = (Step("all-gather of dY (g*'s backward)", (
            Made(gathered, z.full(z.h), "g*'s backward all-gathers dY along s: (s, b, h)"),), frees=done),)
        done = (gathered,)
    dw = f"grad/{where} weight"
    gemms = Step("GEMMs: dW and dX", (Made(dw, weight(z, where), WGRAD),
                                       Made(dx, z.full(width), "dX = dY W, the input's gradient")),
                 frees=done, hands_over=(dw,))
    return backward_only(where, *steps, gemms, saves=(x,))


def linear(z: Sizes, where: str, x: SavedTensor, grad: str, width: int, dx: str, then: Step | None = None) -> Op:
    """A column-parallel linear of `width` inputs on this rank, on the whole sequence (megatron's
    LinearWithGradAccumulationAndAsyncCommunication; under tp it all-reduces dX in place; under SP it all-gathers
    its input into the global memory buffer, no new tensor, and reduce-scatters dX into a new shard): dX, then dW;
    then dY goes, the weight's gradient is handed over, and the saved input goes (unless an op before it keeps it).
    `then`: a step autograd runs as the node returns, before the weight's gradient is handed over (the sum of its
    input's gradients, when no copy_to_tensor_model_parallel_region node stands between: tp)."""
    dw = f"grad/{where} weight"
    whole = f"{dx} before its reduce-scatter" if z.sp else dx
    gemms = Step("GEMMs: dX and dW", (
        Made(whole, z.full(width), "dX = dY W, the input's gradient on the whole sequence"),
        *((Made(dx, z.seq(width), "the reduce-scatter's output: this rank's shard of dX"),) if z.sp else ()),
        Made(dw, weight(z, where), WGRAD)), frees=(grad, *((whole,) if z.sp else ())),
        hands_over=() if then else (dw,), returns=then is not None)
    steps = (gemms, replace(then, hands_over=(dw,))) if then else (gemms,)
    return backward_only(where, *steps, saves=(x,))


def norm_kernel(z: Sizes, where: str, grad: str, dx: str, dx_bytes: int, dw: str, **step: Any) -> Step:
    """The backward of the norm at `where`, one kernel: dX and its weight's (and LayerNorm's bias's) gradients beside
    dY, which then goes."""
    return Step("the norm: dX, dweight" + (", dbias" if z.config.norm == "layernorm" else ""), (
        Made(dx, dx_bytes, "the norm's dX"),
        Made(dw, weight(z, where) + weight(z, where, bias=True), "the norm's weight (and bias) gradients")),
        frees=(grad,), **step)


def named(tag: str, what: str) -> str:
    """A gradient's tape name in one of the layer's MLPs: `tag` "..." names the dense MLP's f"grad/{what}", "expert
    ...[e]" expert e's f"grad/expert {what}[e]"."""
    return f"grad/{tag.replace('...', what)}"


def activation(ops: list[Op], config: ModelConfig, z: Sizes, where: str, tag: str, keeps: tuple[SavedTensor, ...],
               rows: int, width: int, grad: str, gelu: str = "") -> str:
    """An MLP's GELU or SwiGLU backward on `rows` tokens of `width` from `grad` to fc1's output gradient (under GELU
    named `gelu`, if given); `keeps`: the ledger's records, as memcalc.model.impls.megatron.activation reads them.
    Returns fc1's output gradient's name.

    Fused SwiGLU (BiasSwiGLUFunction): one kernel writes the 2f-wide gradient. Unfused: the product's backward makes
    both factors' gradients, SiLU's backward the gate's, and the split of fc1's output concatenates the two.
    """
    gelu_in, gate, up, silu_out, up_copy = keeps
    out, nbytes = named(tag, "fc1 output"), z.act * rows * width
    if config.mlp != "swiglu":
        ops.append(one(where, "GELU", Made(gelu or out, nbytes, "GELU's backward: dY times GELU'(x)"), (grad,),
                       saves=(gelu_in,)))
        return gelu or out
    if config.bias_activation_fusion:
        ops.append(one(where, "fused SwiGLU", Made(out, 2 * nbytes, "the fused SwiGLU's backward: d[gate; up] at"
                                                   " once"), (grad,), saves=(gate, up)))
        return out
    dup, dsilu, dgate = (named(tag, x) for x in ("up", "silu output", "gate"))
    ops.extend((
        backward_only(where, Step("SiLU(gate) * up: both factors' gradients", (
            Made(dup, nbytes, "the product's backward: d(up) = dY * SiLU(gate)"),
            Made(dsilu, nbytes, "the product's backward: d(SiLU) = dY * up")), frees=(grad,)),
            saves=(silu_out, up_copy)),
        one(where, "SiLU", Made(dgate, nbytes, "SiLU's backward: d(gate) = d(SiLU) * SiLU'(gate)"), (dsilu,),
            saves=(gate, up)),
        one(where, "d(gate) and d(up) concatenated into fc1's output gradient", Made(
            out, 2 * nbytes, "gate and up were split from fc1's output: their gradients concatenated"), (dgate, dup)),
    ))
    return out


def fused_softmax(config: ModelConfig, z: Sizes) -> bool:
    """Whether Megatron's fused causal softmax kernel runs on this rank's scores (memcalc.model.impls.megatron's
    FUSED_SOFTMAX window); the paper's layer runs it at every size."""
    window = megatron.fused_softmax_runs({Dim.B: z.b, Dim.A: z.a_t, Dim.S: z.s}, 1)
    return config.impl == "paper" or (megatron.fused_softmax_kernel(config) and bool(window))


def softmax(ops: list[Op], config: ModelConfig, z: Sizes, grad: str, has: Has, dropout_at: str = "attention",
            softmax_at: str = "attention", scale: tuple[SavedTensor, ...] = (), masks_a_view: bool = False) -> None:
    """From the softmax output's (or with dropout, its dropout's) gradient `grad` to the scores' ("grad/scores"):
    attention dropout's backward (at `dropout_at`), then Megatron's fused kernel's, which keeps its 16-bit output (and
    `scale`), or torch's (`_torch_softmax`), at `softmax_at`; `masks_a_view`: megatron-core's DotProductAttention,
    whose torch softmax may mask a view of baddbmm's output in place (`masks_in_place`)."""
    bass = z.b * z.a_t * z.s * z.s
    if has(ledger.ATTN_DROPOUT_MASK.name):
        ops.append(one(dropout_at, "attention dropout", Made(
            "grad/softmax output", z.act * bass, "attention dropout's backward: dY times the mask"), (grad,),
            saves=(ledger.ATTN_DROPOUT_MASK,)))
        grad = "grad/softmax output"
    if fused_softmax(config, z):
        ops.append(one(softmax_at, "softmax", Made("grad/scores", z.act * bass, SOFTMAX), (grad,),
                       saves=(ledger.SOFTMAX_OUT, *scale)))
    else:
        _torch_softmax(ops, z, softmax_at, grad, has, masks_a_view and masks_in_place(config, z, has))


def masks_in_place(config: ModelConfig, z: Sizes, has: Has) -> bool:
    """Whether megatron-core's torch softmax masks its input in place, a view of baddbmm's output
    (attention_mask_func's masked_fill_): outside the fused kernel, with a causal mask (s > 1) and no fp32 cast
    before it."""
    causal = has(megatron.CAUSAL_MASK.name) and not has(megatron.SOFTMAX_FP32.name)
    return causal and not fused_softmax(config, z)


def _torch_softmax(ops: list[Op], z: Sizes, where: str, grad: str, has: Has, in_place: bool) -> None:
    """Megatron's forward_torch_softmax backward (outside the fused kernel's sizes, or in fp32), in backward order:
    the gradient cast up to fp32, softmax's backward, masked_fill's (a new tensor; with one query, s = 1, Megatron
    masks nothing; `in_place`, on a view of the scores: `_masked_view`), the cast back down."""
    bass = z.b * z.a_t * z.s * z.s
    sixteen_bit = has(megatron.SOFTMAX_FP32.name)  # an fp32 softmax of 16-bit scores, its output cast back
    width = 4 if sixteen_bit else z.act
    if sixteen_bit:
        ops.append(one(where, "the softmax output's cast", Made(
            "grad/softmax fp32 output", 4 * bass, "the cast's backward: dY up to fp32"), (grad,)))
        grad = "grad/softmax fp32 output"
    scores = "grad/wide scores" if sixteen_bit else "grad/scores"  # the (fp32) scores' gradient
    masked = "grad/masked scores" if has(megatron.CAUSAL_MASK.name) else scores
    ops.append(one(where, "softmax", Made(masked, width * bass, SOFTMAX), (grad,),
                    saves=(megatron.SOFTMAX_FP32 if sixteen_bit else ledger.SOFTMAX_OUT,)))
    if in_place:
        ops.append(_masked_view(where, width * bass, masked, scores))
    elif masked != scores:
        ops.append(one(where, "the causal mask", Made(
            scores, width * bass, "masked_fill's backward: the masked gradient zeroed"), (masked,),
            saves=(megatron.CAUSAL_MASK,)))
    if sixteen_bit:
        ops.append(one(where, "the scores' cast", Made(
            "grad/scores", z.act * bass, "the scores' cast to fp32: its backward casts back"), (scores,)))


def _masked_view(where: str, nbytes: int, masked: str, scores: str) -> Op:
    """attention_mask_func's masked_fill_ on a view of baddbmm's output, backward: the view's node puts dY into zeros
    of the base's shape; CopySlices copies that into a new base-shaped gradient and runs masked_fill's backward on a
    clone of its slice (a new tensor), copied back: four scores-sized tensors live at once, dY gone."""
    zeros = f"{scores} (the view's)"
    return backward_only(where, Step("the causal mask's view: dY into zeros of the scores' shape", (
        Made(zeros, nbytes, "as_strided's backward: new_zeros of the base, dY copied in"),), frees=(masked,)),
        Step("the causal mask: CopySlices, masked_fill's backward on a clone of the slice", (
            Made(scores, nbytes, "CopySlices: the base's gradient, a new tensor"),
            Made(f"{scores} (the slice's clone)", nbytes, "CopySlices clones the slice for masked_fill's backward"),
            Made(f"{scores} (masked)", nbytes, "masked_fill's backward: the masked gradient zeroed, copied back")),
            frees=(zeros, f"{scores} (the slice's clone)", f"{scores} (masked)")),
        saves=(megatron.CAUSAL_MASK,))
