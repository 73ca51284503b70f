"""One Megatron-style transformer layer in the step: its saved tensors in forward, and its backward op by op."""

from __future__ import annotations


from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.ops import (
    Release, column_parallel_backward, dropout_backward, norm_backward, residual_sum, row_parallel_backward,
)
from memcalc.sizing.timeline.tape import ACTIVATIONS, TEMPORARIES, Sizes, Tape

# The layer tensors this module knows when each is freed; a layer that keeps another one is not modelled yet.
LAYER_NAMES = frozenset(x.name for x in (
    *ledger.LN1, *ledger.LN2, ledger.LAYER_INPUT, ledger.QKV_IN, ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_OUT,
    ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT, ledger.PROJ_IN, ledger.ATTN_OUT_DROPOUT_MASK,
    ledger.FC1_IN, ledger.GELU_IN, ledger.FC2_IN, ledger.MLP_DROPOUT_MASK, megatron.CAUSAL_MASK, megatron.SOFTMAX_FP32,
    ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT, megatron.SWIGLU_UP_COPY, megatron.K_EXPANDED,
    megatron.V_EXPANDED, ledger.SOFTMAX_LSE, megatron.QKV_QUERY_COLUMNS,
))


# -- what a timeline is ------------------------------------------------------------------------------


def _gelu_backward(tape: Tape, z: Sizes, p: str, grad: str, release: Release, _fused: bool) -> tuple[str, int]:
    """GELU's backward: one (s, b, f/t) tensor; returns its name and fc1's output width."""
    tape.add(f"grad/{p}/gelu input", TEMPORARIES, z.full(z.f_t), "GELU's backward: dY times GELU'(x)")
    tape.mark("backward", f"{p}.mlp", "GELU")
    release(ledger.GELU_IN)
    tape.drop(grad)
    return f"grad/{p}/gelu input", z.f_t


def _swiglu_backward(tape: Tape, z: Sizes, p: str, grad: str, release: Release, fused: bool) -> tuple[str, int]:
    """SwiGLU's backward to fc1's (s, b, 2f/t) output gradient; returns its name and fc1's output width.

    Fused (BiasSwiGLUFunction): one kernel writes the 2f-wide gradient. Unfused: the product's backward makes
    both factors' gradients, SiLU's backward the gate's, and the split of fc1's output concatenates the two.
    """
    where, full, out = f"{p}.mlp", z.full(z.f_t), f"grad/{p}/fc1 output"
    if fused:
        tape.add(out, TEMPORARIES, 2 * full, "the fused SwiGLU's backward: d[gate; up] in one tensor")
        tape.mark("backward", where, "fused SwiGLU")
        release(ledger.SWIGLU_GATE, ledger.SWIGLU_UP)
        tape.drop(grad)
        return out, 2 * z.f_t
    tape.add(f"grad/{p}/up", TEMPORARIES, full, "the product's backward: d(up) = dY * SiLU(gate)")
    tape.add(f"grad/{p}/silu output", TEMPORARIES, full, "the product's backward: d(SiLU) = dY * up")
    tape.mark("backward", where, "SiLU(gate) * up: both factors' gradients")
    release(ledger.SWIGLU_SILU_OUT, megatron.SWIGLU_UP_COPY)
    tape.drop(grad)
    tape.add(f"grad/{p}/gate", TEMPORARIES, full, "SiLU's backward: d(gate) = d(SiLU) * SiLU'(gate)")
    tape.mark("backward", where, "SiLU")
    release(ledger.SWIGLU_GATE, ledger.SWIGLU_UP)
    tape.drop(f"grad/{p}/silu output")
    tape.add(out, TEMPORARIES, 2 * full, "gate and up were split from fc1's output: their gradients concatenated")
    tape.mark("backward", where, "d(gate) and d(up) concatenated into fc1's output gradient")
    tape.drop(f"grad/{p}/gate", f"grad/{p}/up")
    return out, 2 * z.f_t


_WHY_SAVED = "kept for backward (the ledger); freed when the op that keeps it has run backward"
# What the layer's block makes outside its submodules (memcalc.probe.layer._block): the residual adds and their dropout.
_MADE_BY_THE_BLOCK = frozenset(x.name for x in (ledger.LN2.input, ledger.ATTN_OUT_DROPOUT_MASK, ledger.MLP_DROPOUT_MASK))
_WHY_RERUN = "kept by the layer's rerun under full recomputation; freed when the op that keeps it has run backward"


def layer_forward(tape: Tape, i: int, saved: dict[str, int], z: Sizes) -> None:
    """The layer's saved tensors (all but its input, live already) as one term, and its output."""
    own = sum(n for name, n in saved.items() if name not in (ledger.LN1.input.name, ledger.LAYER_INPUT.name))
    tape.add(f"layers.{i}/saved", ACTIVATIONS, own, "what the layer keeps for backward (the ledger), but its input")
    tape.add(f"layers.{i + 1}/ln1/input", ACTIVATIONS, z.seq(z.h), "the layer's output, the next block's input")
    tape.mark("forward", f"layers.{i}", "the layer's saved tensors")


def layer_backward(
    tape: Tape, i: int, saved: dict[str, int], z: Sizes, config: ModelConfig, first: int,
    rerun_core: dict[str, int] | None = None,
) -> None:
    """The layer's backward, op by op, as autograd runs memcalc's own layer (memcalc.probe.layer); `first` is the
    stage's first layer, whose input gradient leaves the stage. `rerun_core`: under selective recomputation of
    eager attention, what the layer without recomputation keeps (the core's part is made again).

    Under full recomputation `saved` is what the layer's rerun keeps (the layer without recomputation):
    the checkpoint first runs the layer's forward again, inside backward. MemTracker files what a submodule's
    forward makes as activations, rerun or not, and what the block itself makes (the residual adds, their
    dropout) as temporaries: the rerun calls the block, not the layer module. So does this walk.
    """
    p = f"layers.{i}"
    rerun = config.recompute == "full"
    tape.drop(f"{p}/saved")
    for name, n in saved.items():
        if name != ledger.LN1.input.name:
            category = TEMPORARIES if rerun and name in _MADE_BY_THE_BLOCK else ACTIVATIONS
            tape.add(f"{p}/{name}", category, n, _WHY_RERUN if rerun else _WHY_SAVED)
    if rerun:  # the checkpoint keeps the layer's input (its one saved tensor) until its backward returns
        tape.rename(f"{p}/{ledger.LN1.input.name}", f"{p}/input (the checkpoint's)")
        tape.add(f"{p}/recomputed output", TEMPORARIES, z.seq(z.h),
                 "the rerun's output: the checkpoint holds it while autograd runs the layer's backward")
        # the MLP branch's output (after its dropout, made by the block itself), added into the residual last
        branch = TEMPORARIES if ledger.MLP_DROPOUT_MASK.name in saved else ACTIVATIONS
        tape.add(f"{p}/recomputed MLP branch", branch, z.seq(z.h), "the last residual add's other operand")
        tape.mark("backward", p, "full recomputation: the layer's forward again, to its last residual add")
        tape.drop(f"{p}/recomputed MLP branch")
    grad = f"grad/{p}/output"

    def release(*tensors: SavedTensor) -> None:
        tape.drop(*(f"{p}/{x.name}" for x in tensors))

    bias = config.add_bias_linear
    # MLP half: dropout, fc2 (row-parallel), GELU, fc1 (column-parallel), ln2, the residual sum.
    branch = dropout_backward(tape, z, p, grad, ledger.MLP_DROPOUT_MASK, saved, release, "the MLP")
    dx = f"grad/{p}/fc2 input"
    row_parallel_backward(tape, z, f"{p}.mlp.fc2", branch, grad, z.h * z.f_t, z.full(z.f_t), dx)
    release(ledger.FC2_IN)
    activation = _swiglu_backward if config.mlp == "swiglu" else _gelu_backward
    d_fc1_out, fc1_width = activation(tape, z, p, dx, release, config.bias_activation_fusion)
    dx = f"grad/{p}/fc1 input"
    column_parallel_backward(
        tape, z, f"{p}.mlp.fc1", d_fc1_out, fc1_width * z.h, fc1_width if bias else 0, dx,
        f"{p}/{ledger.FC1_IN.name}",
    )
    after_norm = f"grad/{p}/ln2 input (norm)"
    norm_backward(tape, z, f"{p}.ln2", dx, ledger.LN2, p, after_norm)
    mid = f"grad/{p}/ln2 input"
    held = tape.live[grad]
    residual_sum(tape, z, f"{p}.ln2", grad, after_norm, mid)
    if rerun:  # the checkpoint's backward holds the output's gradient until the rerun's backward is over
        tape.add(f"{grad} (held by the checkpoint)", held.category, held.bytes, held.why)
    # Attention half: dropout, the projection (row-parallel), the core, QKV (column-parallel), ln1, the sum.
    branch = dropout_backward(tape, z, p, mid, ledger.ATTN_OUT_DROPOUT_MASK, saved, release, "attention")
    dx = f"grad/{p}/proj input"
    row_parallel_backward(tape, z, f"{p}.attention.proj", branch, mid, z.h * z.h_t, z.full(z.h_t), dx)
    recomputed = config.recompute == "selective"
    if config.attention == "eager" or recomputed:  # else the flash kernel keeps its output, the projection's input
        release(ledger.PROJ_IN)
    if config.attention == "flash":
        dqkv = _flash_backward(tape, z, p, dx, release, recomputed)
    else:
        dqkv = _core_attention_backward(tape, z, p, dx, saved | _rerun_core(tape, z, p, rerun_core), release)
    dx = f"grad/{p}/qkv input"
    qkv_bias = z.qkv_t if config.add_bias_linear or config.add_qkv_bias else 0
    column_parallel_backward(
        tape, z, f"{p}.attention.qkv", dqkv, z.qkv_t * z.h, qkv_bias, dx, f"{p}/{ledger.QKV_IN.name}",
    )
    after_norm = f"grad/{p}/ln1 input (norm)"
    norm_backward(tape, z, f"{p}.ln1", dx, ledger.LN1, p, after_norm)
    out = f"grad/{p}/ln1 input"
    residual_sum(tape, z, f"{p}.ln1", mid, after_norm, out)
    tape.drop(f"{p}/recomputed output", f"{grad} (held by the checkpoint)", f"{p}/input (the checkpoint's)")
    name = f"grad/layers.{i - 1}/output" if i > first else f"grad/layers.{i}/ln1/input"
    tape.rename(out, name)


def _core_attention_backward(
    tape: Tape, z: Sizes, p: str, dcontext: str, saved: dict[str, int], free: Release,
) -> str:
    """softmax(QK^T / sqrt(d)) V backward, op by op (memcalc.probe.attention.eager_core); returns dQKV's name."""
    where = f"{p}.attention"
    bass = z.act * z.b * z.a_t * z.s * z.s  # (b, a/t, s, s)
    basd = z.act * z.b * z.a_t * z.s * z.d  # (b, a/t, s, d)
    g = f"grad/{p}"
    expanded = megatron.K_EXPANDED.name in saved  # K and V copied to every head (grouped-query attention)
    k, v = (megatron.K_EXPANDED, megatron.V_EXPANDED) if expanded else (ledger.K, ledger.V)
    checkpointed = f"{p}/attention/recomputed context" in tape.live
    held = (ledger.Q, ledger.K, ledger.V) if checkpointed else ()  # the checkpoint's inputs, kept until it returns

    def release(*tensors: SavedTensor) -> None:
        free(*(x for x in tensors if x not in held))

    tape.add(f"{g}/v", TEMPORARIES, basd, "weights x V's backward: dV = weights^T dY")
    tape.add(f"{g}/attention weights", TEMPORARIES, bass, "weights x V's backward: dWeights = dY V^T")
    tape.mark("backward", where, "weights x V: dV and dWeights")
    if ledger.ATTN_DROPOUT_OUT.name in saved:
        release(v, ledger.ATTN_DROPOUT_OUT)
    elif megatron.SOFTMAX_FP32.name in saved:
        release(v, ledger.SOFTMAX_OUT)  # the fp32 softmax's 16-bit cast: weights x V alone keeps it
    else:
        release(v)  # the softmax output: the softmax keeps it too
    if not checkpointed:  # else the checkpoint's backward holds dY until it returns
        tape.drop(dcontext)
    weights = f"{g}/attention weights"
    if ledger.ATTN_DROPOUT_MASK.name in saved:
        tape.add(f"{g}/softmax output", TEMPORARIES, bass, "attention dropout's backward: dY times the mask")
        tape.mark("backward", where, "attention dropout")
        release(ledger.ATTN_DROPOUT_MASK)
        tape.drop(weights)
        weights = f"{g}/softmax output"
    fused = megatron.CAUSAL_MASK.name not in saved
    if not fused:
        _unfused_softmax_backward(tape, z, where, g, weights, saved, release)
    else:
        tape.add(f"{g}/scores", TEMPORARIES, bass, "softmax's backward: S' * (dY - sum(dY * S'))")
        tape.mark("backward", where, "softmax")
        release(ledger.SOFTMAX_OUT)
        tape.drop(weights)
    tape.add(f"{g}/q", TEMPORARIES, basd, "QK^T's backward: dQ = dScores K, then scaled (a new tensor)")
    tape.add(f"{g}/k unscaled", TEMPORARIES, basd, "QK^T's backward: dK = dScores^T Q")
    tape.add(f"{g}/k", TEMPORARIES, basd, "dK scaled by 1/sqrt(d), a new tensor")
    tape.mark("backward", where, "QK^T: dQ and dK")
    release(ledger.Q, k)
    tape.drop(f"{g}/scores", f"{g}/k unscaled")
    if expanded:
        _sum_over_groups(tape, z, where, g)
    if checkpointed:  # the checkpoint returns: its rerun's output, dY and its extra input go
        tape.drop(f"{p}/attention/recomputed context", dcontext)
        free(*held, megatron.QKV_QUERY_COLUMNS)
    return _concatenated_qkv(tape, z, where, g)


# What the attention core keeps when selective recomputation reruns it (eager attention).
_CORE = (
    ledger.SOFTMAX_OUT, ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT, megatron.CAUSAL_MASK, megatron.SOFTMAX_FP32,
    megatron.K_EXPANDED, megatron.V_EXPANDED,
)


def _rerun_core(tape: Tape, z: Sizes, p: str, rerun: dict[str, int] | None) -> dict[str, int]:
    """Selective recomputation of eager attention: the checkpoint reruns the core inside backward, so its
    tensors (those of the layer without recomputation) are made again, as temporaries, with its output."""
    if rerun is None:
        return {}
    core = {name: n for name, n in rerun.items() if name in {x.name for x in _CORE}}
    for name, n in core.items():
        tape.add(f"{p}/{name}", TEMPORARIES, n, "made again by selective recomputation's rerun of the core")
    tape.add(f"{p}/attention/recomputed context", TEMPORARIES, z.full(z.h_t),
             "the rerun's output: the checkpoint holds it while autograd runs the core's backward")
    tape.mark("backward", f"{p}.attention", "selective recomputation: the attention core's forward again")
    return core


def _concatenated_qkv(tape: Tape, z: Sizes, where: str, g: str) -> str:
    """q, k and v were split from one QKV output: their gradients concatenated into one; returns its name."""
    dqkv = f"{g}/qkv output"
    tape.add(dqkv, TEMPORARIES, z.full(z.qkv_t),
             "q, k and v were split from one QKV output: their gradients concatenated")
    tape.mark("backward", where, "dQ, dK, dV concatenated into the QKV output's gradient")
    tape.drop(f"{g}/q", f"{g}/k", f"{g}/v")
    return dqkv


def _flash_backward(tape: Tape, z: Sizes, p: str, dcontext: str, release: Release, recomputed: bool) -> str:
    """A flash kernel's backward: dQ, dK and dV alone (it rebuilds the softmax inside); returns dQKV's name.

    The kernel keeps its output, which is the projection's input: freed only now. Under selective
    recomputation the checkpoint first reruns the kernel's forward: its output and log-sum-exp again
    (the first run's output was the projection's alone).
    """
    where, g = f"{p}.attention", f"grad/{p}"
    basd = z.act * z.b * z.a_t * z.s * z.d
    bgsd = z.act * z.b * z.g_t * z.s * z.d
    if recomputed:
        tape.add(f"{p}/attention/recomputed output", TEMPORARIES, basd, "the checkpoint reruns the kernel: its output")
        tape.add(f"{p}/attention/recomputed lse", TEMPORARIES, 4 * z.b * z.a_t * z.s, "and its fp32 log-sum-exp")
        tape.mark("backward", where, "selective recomputation: the flash kernel's forward again")
    tape.add(f"{g}/q", TEMPORARIES, basd, "the flash kernel's backward: dQ")
    tape.add(f"{g}/k", TEMPORARIES, bgsd, "the flash kernel's backward: dK, per K/V group")
    tape.add(f"{g}/v", TEMPORARIES, bgsd, "the flash kernel's backward: dV, per K/V group")
    tape.mark("backward", where, "flash attention: dQ, dK, dV")
    release(ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, ledger.PROJ_IN)
    tape.drop(dcontext, f"{p}/attention/recomputed output", f"{p}/attention/recomputed lse")
    return _concatenated_qkv(tape, z, where, g)


def _sum_over_groups(tape: Tape, z: Sizes, where: str, g: str) -> None:
    """K and V were copied to every head of their group (repeat_interleave): their gradients, (b, a/t, s, d),
    are summed over each group's heads into new (b, g/t, s, d) tensors, K's first."""
    for x in ("k", "v"):
        grouped = f"{g}/{x} grouped"
        tape.add(grouped, TEMPORARIES, z.act * z.b * z.g_t * z.s * z.d,
                 f"repeat_interleave's backward: d{x.upper()} summed over each group's heads")
        tape.mark("backward", where, f"d{x.upper()} summed over each group's heads")
        tape.drop(f"{g}/{x}")
        tape.rename(grouped, f"{g}/{x}")


def _unfused_softmax_backward(
    tape: Tape, z: Sizes, where: str, g: str, grad: str, saved: dict[str, int], release: Release,
) -> None:
    """Megatron's forward_torch_softmax backward (outside the fused kernel's sizes, or in fp32): the gradient
    cast up to fp32, softmax's backward in fp32, masked_fill's (a new tensor), the cast back down."""
    bass = z.b * z.a_t * z.s * z.s
    sixteen_bit = megatron.SOFTMAX_FP32.name in saved
    if sixteen_bit:
        tape.add(f"{g}/softmax fp32 output", TEMPORARIES, 4 * bass, "the cast's backward: dY up to fp32")
        tape.mark("backward", where, "the softmax output's cast")
        tape.drop(grad)
        grad = f"{g}/softmax fp32 output"
    width = 4 if sixteen_bit else z.act
    tape.add(f"{g}/masked scores", TEMPORARIES, width * bass, "softmax's backward: S' * (dY - sum(dY * S'))")
    tape.mark("backward", where, "softmax")
    release(megatron.SOFTMAX_FP32 if sixteen_bit else ledger.SOFTMAX_OUT)
    tape.drop(grad)
    tape.add(f"{g}/wide scores", TEMPORARIES, width * bass, "masked_fill's backward: the masked gradient zeroed")
    tape.mark("backward", where, "the causal mask")
    release(megatron.CAUSAL_MASK)
    tape.drop(f"{g}/masked scores")
    if sixteen_bit:
        tape.add(f"{g}/scores", TEMPORARIES, z.act * bass, "the scores' cast to fp32: its backward casts back")
        tape.mark("backward", where, "the scores' cast")
        tape.drop(f"{g}/wide scores")
    else:
        tape.rename(f"{g}/wide scores", f"{g}/scores")
