"""Column- and row-parallel linears, the pair that tensor parallelism splits (seed, sections 3-4).

The pair under TP and SP, the overlapped schedule, and how weights are drawn: docs/probe.md, "The column/row-parallel
pair".
"""

from __future__ import annotations

import math

from memcalc.errors import ProbeError
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.mappings import (
    all_gather_seq,
    f_enter_tp,
    f_star_leave_tp,
    g_star_scatter_seq,
    reduce_scatter_seq,
)
from memcalc.probe.overlap import NO_OVERLAP, GatheredGemm, Overlap, ScatteredGemm, check_overlap

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)
from torch.nn import functional as F  # noqa: E402


def _gather_then_gemm(x_shard, weight, bias, tp):
    """g's all-gather, then the whole GEMM: (s/t, b, in) -> (s, b, out/t)."""
    x_full = all_gather_seq(x_shard, tp)  # (s, b, in), dropped when forward returns
    return F.linear(x_full, weight, bias)


class _GatheredInputLinear(torch.autograd.Function):
    """g fused into a column-parallel GEMM under SP: forward all-gather along s, backward
    reduce-scatter along s, saving only the input's sequence shard (no (s, b, h) tensor).

    `gemm` schedules the forward: the all-gather then the GEMM, or an overlapped ring.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, bias, tp, gemm: GatheredGemm):
        ctx.save_for_backward(x_shard, weight)  # the caller's shard itself, not the gathered input
        ctx.tp = tp
        ctx.has_bias = bias is not None
        return gemm(x_shard, weight, bias, tp)  # (s, b, out/t)

    @staticmethod
    def backward(ctx, grad_out):  # (s, b, out/t)
        x_shard, weight = ctx.saved_tensors
        x_full = all_gather_seq(x_shard, ctx.tp)  # gathered again: forward kept only the shard
        grad_x = reduce_scatter_seq(grad_out @ weight, ctx.tp)  # partial dX (s, b, in) -> (s/t, b, in)
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])  # (s*b, out/t)
        grad_weight = grad_rows.t() @ x_full.reshape(-1, x_full.shape[-1])  # (out/t, in)
        grad_bias = grad_rows.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None, None


class _ScatteredOutputLinear(torch.autograd.Function):
    """g* fused into a row-parallel GEMM under SP, for an overlapped forward: forward the GEMM and a
    reduce-scatter along s as `gemm` schedules them, backward all-gather along s and the GEMM's grads.

    It keeps what F.linear followed by g* keeps: the input and the weight. The bias is added outside.
    """

    @staticmethod
    def forward(ctx, x, weight, tp, gemm: ScatteredGemm):
        ctx.save_for_backward(x, weight)
        ctx.tp = tp
        return gemm(x, weight, tp)  # (s, b, in/t) -> (s/t, b, out)

    @staticmethod
    def backward(ctx, grad_out):  # (s/t, b, out)
        x, weight = ctx.saved_tensors
        grad_full = all_gather_seq(grad_out, ctx.tp)  # (s, b, out): g*'s backward
        grad_x = grad_full @ weight  # (s, b, in/t)
        grad_rows = grad_full.reshape(-1, grad_full.shape[-1])  # (s*b, out)
        grad_weight = grad_rows.t() @ x.reshape(-1, x.shape[-1])  # (out, in/t)
        return grad_x, grad_weight, None, None


class _ParallelLinear(nn.Module):
    """What both halves share: a weight block, an optional bias, seeded init and shard loading."""

    shard_dim: int  # the full weight's dim cut by rank: 0 rows (column-parallel), 1 columns (row-parallel)
    bias_is_split: bool  # column: each rank owns its outputs' bias; row: the whole bias, added after the sum

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallelGroup, sequence_parallel: bool, bias: bool = True,
        dtype: torch.dtype | None = None, seed: int = 0, overlap: Overlap = NO_OVERLAP,
    ) -> None:
        super().__init__()
        check_overlap(overlap, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.sequence_parallel, self.overlap = tp, sequence_parallel, overlap
        factory = {"dtype": dtype, "device": tp.device}
        shape = [out_features, in_features]
        shape[self.shard_dim] = tp.divide(shape[self.shard_dim], ("out_features", "in_features")[self.shard_dim])
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        self.bias = None
        if bias:
            bias_features = tp.divide(out_features, "out_features") if self.bias_is_split else out_features
            self.bias = nn.Parameter(torch.empty(bias_features, **factory))
            # A whole bias added to a sequence shard gets a partial gradient; Megatron marks such
            # parameters so that their gradients are summed across ranks before an optimizer step.
            self.bias.sequence_parallel = sequence_parallel and not self.bias_is_split
        self.load_shard_of(*self.seeded_full_weights(seed))

    def seeded_full_weights(self, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """nn.Linear's uniform(+-1/sqrt(in)) init of the whole unsharded layer, drawn from `seed`; empty on device
        "meta", so a full-size layer never exists on the CPU (a GPT-3 175B fc1 alone is 4.8 GB in fp32)."""
        device = "meta" if self.weight.is_meta else "cpu"
        weight = torch.empty(self.out_features, self.in_features, device=device)
        bias = torch.empty(self.out_features, device=device)
        if device != "meta":
            generator = torch.Generator().manual_seed(seed)
            bound = 1 / math.sqrt(self.in_features)
            weight.uniform_(-bound, bound, generator=generator)
            bias.uniform_(-bound, bound, generator=generator)
        return weight, bias if self.bias is not None else None

    @torch.no_grad()
    def load_shard_of(self, full_weight: torch.Tensor, full_bias: torch.Tensor | None = None) -> None:
        """Copy in this rank's block of a full (out_features, in_features) weight, and of its bias."""
        expected = (self.out_features, self.in_features)
        if tuple(full_weight.shape) != expected:
            raise ProbeError(f"full weight has shape {tuple(full_weight.shape)}, expected {expected}")
        self.weight.copy_(self.tp.block(full_weight, self.shard_dim, "weight"))
        if full_bias is not None:
            if self.bias is None:
                raise ProbeError("a bias was given to a linear built with bias=False")
            self.bias.copy_(self.tp.block(full_bias, 0, "bias") if self.bias_is_split else full_bias)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b, W's rows and b split by rank: (s, b, in), or (s/t, b, in) under SP -> (s, b, out/t)."""

    shard_dim = 0
    bias_is_split = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.tp.size > 1:
            gemm = self.overlap.gathered_gemm() or _gather_then_gemm
            return _GatheredInputLinear.apply(x, self.weight, self.bias, self.tp, gemm)
        return F.linear(f_enter_tp(x, self.tp), self.weight, self.bias)  # autograd saves x itself and W


class RowParallelLinear(_ParallelLinear):
    """y = (sum over ranks of x_r W_r^T) + b: (s, b, in/t) -> (s, b, out), or (s/t, b, out) under SP.

    The bias is whole on every rank and added after the reduction. Under SP each rank adds it to its own sequence shard
    only, so its gradient here is a partial sum over that shard, and the bias is marked `sequence_parallel`.
    """

    shard_dim = 1
    bias_is_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        overlapped = self.overlap.scattered_gemm() if self.sequence_parallel and self.tp.size > 1 else None
        if overlapped is not None:
            y = _ScatteredOutputLinear.apply(x, self.weight, self.tp, overlapped)  # (s/t, b, out)
            return y if self.bias is None else y + self.bias
        partial = F.linear(x, self.weight)  # (s, b, out): this rank's share of the sum
        leave = g_star_scatter_seq if self.sequence_parallel else f_star_leave_tp
        y = leave(partial, self.tp)  # (s, b, out), or (s/t, b, out) under SP
        return y if self.bias is None else y + self.bias
