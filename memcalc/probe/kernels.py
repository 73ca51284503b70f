"""Kernels that are one fused kernel on the GPU, as one op here.

Which kernels, and why one op: docs/probe.md, "Fused kernels as one op".
"""

from __future__ import annotations

from memcalc.probe import require_torch

torch = require_torch()


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32, the precision fused kernels (norms here, flash attention too) compute in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("memcalc::probe_rms_norm", mutates_args=())
def probe_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rstd * weight (x's dtype, x's layout: a norm over each head of a permuted view returns its own
    permutation) and rstd (fp32, x's shape with a 1 for the normalised dim): the forward Apex's and Transformer
    Engine's RMSNorm kernels run, beside `rms_norm_backward`."""
    x_wide = wide(x)
    rstd = torch.rsqrt(x_wide.pow(2).mean(-1, keepdim=True) + eps)
    return (x_wide * rstd).to(x.dtype) * weight, rstd


@probe_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.promote_types(x.dtype, torch.float32))


@torch.library.custom_op("memcalc::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dX (x's dtype and shape, contiguous as CUDA's kernels make it) and dWeight (weight's) of y = x * rstd * w."""
    x_hat = wide(x.contiguous()) * wide(rstd)
    grad_x_hat = wide(grad_y) * wide(weight)
    grad_x = wide(rstd) * (grad_x_hat - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
    grad_weight = (wide(grad_y) * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return grad_x.to(x.dtype, memory_format=torch.contiguous_format), grad_weight.to(weight.dtype)


@rms_norm_backward.register_fake
def _(grad_y, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.custom_op("memcalc::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """d[gate; up] of SiLU(gate) * up, as one tensor of twice the width: BiasSwiGLUFunction's backward."""
    sigmoid = torch.sigmoid(wide(gate))
    grad_gate = wide(grad) * wide(up) * sigmoid * (1 + wide(gate) * (1 - sigmoid))
    grad_up = wide(grad) * wide(gate) * sigmoid
    return torch.cat([grad_gate, grad_up], dim=-1).to(grad.dtype)


@swiglu_backward.register_fake
def _(grad, gate, up):
    return grad.new_empty((*grad.shape[:-1], 2 * grad.shape[-1]))


@torch.library.custom_op("memcalc::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rstd * weight (x's dtype) and rstd (fp32, x's shape with a 1 for the normalised dim), as torch's
    CUDA _fused_rms_norm makes them (from x made contiguous first)."""
    x = x.contiguous()
    rstd = torch.rsqrt(wide(x).pow(2).mean(-1, keepdim=True) + eps)
    return (wide(x) * rstd * wide(weight)).to(x.dtype), rstd


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


class FusedRMSNorm(torch.autograd.Function):
    """torch's _fused_rms_norm as CUDA runs it: one op each way, keeping x and rstd (derivatives.yaml)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return (*rms_norm_backward(grad_y, *ctx.saved_tensors), None)


@torch.library.custom_op("memcalc::fused_causal_softmax", mutates_args=())
def fused_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """Apex's scaled_upper_triang_masked_softmax: (batches, s, s) scores -> softmax(scale * scores, future masked),
    computed in fp32, in the scores' dtype."""
    s = scores.shape[-1]
    future = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax((wide(scores) * scale).masked_fill(future, float("-inf")), dim=-1).to(scores.dtype)


@fused_causal_softmax.register_fake
def _(scores, scale):
    return torch.empty_like(scores)


@torch.library.custom_op("memcalc::fused_causal_softmax_backward", mutates_args=())
def fused_causal_softmax_backward(grad: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """dScores = scale * P * (dP - rowsum(dP * P)), from the output alone, as the kernel computes it."""
    wide_probs, wide_grad = wide(probs), wide(grad)
    return (wide_probs * (wide_grad - (wide_grad * wide_probs).sum(-1, keepdim=True)) * scale).to(grad.dtype)


@fused_causal_softmax_backward.register_fake
def _(grad, probs, scale):
    return torch.empty_like(grad)
