"""The layer's two norms, LayerNorm and RMSNorm, labelling what they keep for backward.

LayerNorm is torch's own kernel; RMSNorm keeps what the fused kernels Megatron uses keep (its input and rstd), its
statistics at the width the device's LayerNorm kernel keeps them. Why, per device: docs/probe.md, "The layer".
"""

from __future__ import annotations

from functools import lru_cache

from memcalc.model.ledger import NormTensors
from memcalc.probe import require_torch
from memcalc.probe.kernels import probe_rms_norm, rms_norm_backward
from memcalc.probe.recorder import batch_first, label

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)

EPS = 1e-5


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim of (s, b, h), labelled as `names`.

    `heads`: over each head's d channels of (s, b, heads, d) (a QK norm): the statistics are labelled per head,
    (b, heads, s), and the input is left to whoever made it (a view of a fused QKV output, or a copy).
    `sequence_parallel`: each rank normalises its own sequence shard, so the whole weights get partial gradients:
    marked, as linear.py marks a row-parallel bias (and Megatron its norms).
    """

    def __init__(
        self, kind: str, h: int, names: NormTensors, dtype: torch.dtype, device: torch.device, heads: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.kind, self.names, self.heads = kind, names, heads
        self.weight = nn.Parameter(torch.ones(h, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(h, dtype=dtype, device=device)) if kind == "layernorm" else None
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.heads:
            label(batch_first(x), self.names.input)
        if self.kind == "layernorm":
            y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], self.weight, self.bias, EPS)
            label(self._stats(mean), self.names.mean)
        else:
            y, rstd = _RMSNorm.apply(x, self.weight)
        label(self._stats(rstd), self.names.rstd)
        return y

    def _stats(self, x: torch.Tensor) -> torch.Tensor:
        """(s, b, 1) statistics as (b, s); per head, (s, b, heads, 1) as (b, heads, s)."""
        return x.squeeze(-1).permute(1, 2, 0) if self.heads else batch_first(x.squeeze(-1))


class _RMSNorm(torch.autograd.Function):
    """y = x / rms(x) * weight, keeping x and rstd = 1/rms(x) (s, b, 1), or (s, b, heads, 1), for backward; one op
    each way, as the fused kernel (a layer's rerun inside backward would otherwise peak at its fp32 temporaries)."""

    @staticmethod
    def forward(ctx, x, weight):
        y, rstd = probe_rms_norm(x, weight, EPS)  # one op, as the fused kernel: no fp32 temporaries seen
        rstd = rstd.to(_stats_dtype(x.device.type, x.dtype))  # (s, b, 1)
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)  # no zeros made for rstd's (absent) gradient
        return y, rstd

    @staticmethod
    def backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        return rms_norm_backward(grad_y, x, weight, rstd)  # one op, as the fused kernel


@lru_cache(maxsize=None)
def _stats_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's LayerNorm kernel keeps its statistics in, for `dtype` on `device_type`."""
    probe = torch.zeros(1, 2, dtype=dtype, device=device_type)
    return torch.native_layer_norm(probe, (2,), None, None, EPS)[2].dtype
