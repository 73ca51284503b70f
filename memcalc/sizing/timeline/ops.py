"""The backward of the ops every layer and both ends are built from: linears (column- and row-parallel,
with the collectives of TP and SP), norms, dropout and the residual sum; each as autograd runs
memcalc's own layer (memcalc.probe), allocation by allocation."""

from __future__ import annotations

from typing import Callable

from memcalc.model import ledger
from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.tape import TEMPORARIES, Sizes, Tape

Release = Callable[..., None]  # frees this layer's saved tensors, given their ledger entries


def dropout_backward(
    tape: Tape, z: Sizes, p: str, grad: str, mask: SavedTensor, saved: dict[str, int], release: Release,
    what: str,
) -> str:
    """dY times the mask, a new tensor beside dY (which the residual path still needs); none without dropout."""
    if mask.name not in saved:
        return grad
    branch = f"grad/{p}/{what} dropout"
    tape.add(branch, TEMPORARIES, z.seq(z.h), "dropout's backward: dY times the mask, a new tensor")
    tape.mark("backward", p, f"dropout after {what}")
    release(mask)
    return branch


def row_parallel_backward(
    tape: Tape, z: Sizes, where: str, grad: str, keep: str, weight: int, dx_bytes: int, dx: str,
) -> None:
    """fc2 or the projection: under SP g* all-gathers dY first; then dW and dX beside dY.

    The bias's gradient (a sum over tokens) is made and added into the buffer before the GEMMs.
    """
    if z.sp:
        gathered = f"grad/{where} gathered"
        tape.add(gathered, TEMPORARIES, z.full(z.h), "g*'s backward all-gathers dY along s: (s, b, h)")
        tape.mark("backward", where, "all-gather of dY (g*'s backward)")
        if grad != keep:
            tape.drop(grad)
        grad = gathered
    tape.add(f"grad/{where} weight", TEMPORARIES, z.act * weight, "the weight's bf16 gradient, dW = dY^T X")
    tape.add(dx, TEMPORARIES, dx_bytes, "dX = dY W, the input's gradient")
    tape.mark("backward", where, "GEMMs: dW and dX")
    tape.drop(f"grad/{where} weight")
    if grad != keep:
        tape.drop(grad)


def column_parallel_backward(
    tape: Tape, z: Sizes, where: str, grad: str, weight: int, bias: int, dx: str, saved_input: str,
) -> None:
    """QKV or fc1: dX, dW and the bias's gradient beside dY, then the saved input goes; under SP the input is
    all-gathered again and dX reduce-scattered; under TP without SP, f's backward all-reduces dX into a copy."""
    if z.sp:
        gathered_linear_backward(tape, z, where, grad, f"grad/{where} weight", z.act * weight,
                                  "the weight's bf16 gradient, dW = dY^T X", dx, bias)
        tape.drop(f"grad/{where} weight", saved_input)
        return
    tape.add(dx, TEMPORARIES, z.full(z.h), "dX = dY W, the input's gradient")
    tape.add(f"grad/{where} weight", TEMPORARIES, z.act * weight, "the weight's bf16 gradient, dW = dY^T X")
    tape.add(f"grad/{where} bias", TEMPORARIES, z.act * bias, "the bias's gradient, dY summed over tokens")
    tape.mark("backward", where, "GEMMs: dX, dW and the bias's gradient")
    tape.drop(grad, f"grad/{where} weight", f"grad/{where} bias", saved_input)
    enter_tp_backward(tape, z, where, dx)


def gathered_linear_backward(
    tape: Tape, z: Sizes, where: str, grad: str, weight_name: str, weight_bytes: int, weight_why: str, dx: str,
    bias: int = 0,
) -> None:
    """A column-parallel GEMM under SP (memcalc.probe.linear._GatheredInputLinear): gather X again,
    dX as a partial (s, b, h) reduce-scattered to (s/t, b, h), then dW and the bias's gradient."""
    gathered = f"grad/{where} input gathered"
    partial = f"grad/{where} partial dX"
    tape.add(gathered, TEMPORARIES, z.full(z.h), "forward kept only the input's shard: backward all-gathers it")
    tape.add(partial, TEMPORARIES, z.full(z.h), "dX = dY W on the whole sequence, this rank's partial sum")
    tape.add(dx, TEMPORARIES, z.seq(z.h), "the reduce-scatter's output: this rank's shard of dX")
    tape.mark("backward", where, "re-gathered input, partial dX and its reduce-scatter")
    tape.drop(partial)
    tape.add(weight_name, TEMPORARIES, weight_bytes, weight_why)
    tape.add(f"grad/{where} bias", TEMPORARIES, z.act * bias, "the bias's gradient, dY summed over tokens")
    tape.mark("backward", where, "dW and the bias's gradient beside the re-gathered input")
    tape.drop(gathered, grad, f"grad/{where} bias")


def enter_tp_backward(tape: Tape, z: Sizes, where: str, dx: str) -> None:
    """f's backward under TP: all-reduce dX into a new tensor (the input of an autograd op is never changed)."""
    if z.t == 1:
        return
    reduced = f"{dx} (all-reduced)"
    tape.add(reduced, TEMPORARIES, z.full(z.h), "f's backward all-reduces dX into a copy")
    tape.mark("backward", where, "all-reduce of dX (f's backward)")
    tape.drop(dx)
    tape.rename(reduced, dx)


def norm_backward(
    tape: Tape, z: Sizes, where: str, grad: str, norm: ledger.NormTensors, p: str | None, dx: str,
) -> None:
    """The norm's backward, one kernel: dX and its weight's (and LayerNorm's bias's) gradients beside dY; then its
    saved tensors go."""
    tape.add(dx, TEMPORARIES, z.seq(z.h), "the norm's dX")
    tape.add(f"grad/{where} weights", TEMPORARIES, z.norm_vectors * z.act * z.h,
             "the norm's weight (and bias) gradients")
    tape.mark("backward", where, "the norm: dX, dweight" + (", dbias" if z.norm_vectors == 2 else ""))
    tape.drop(*(f"{p}/{x.name}" if p else x.name for x in norm))
    tape.drop(grad)


def residual_sum(tape: Tape, z: Sizes, where: str, residual: str, branch: str, out: str) -> None:
    """The residual stream's two gradients summed into a new tensor, as soon as the branch's returns.

    Autograd does it inside the norm's backward window (MemTracker files it under the norm).
    """
    tape.add(out, TEMPORARIES, z.seq(z.h), "the residual stream's gradient: the two paths' gradients summed")
    tape.mark("backward", where, "the residual stream's gradients summed")
    tape.drop(residual, branch, f"grad/{where} weights")
