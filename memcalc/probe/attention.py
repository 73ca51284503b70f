"""Self-attention between the column-parallel QKV linear and the row-parallel output projection.

    x (s, b, h)  [SP: (s/t, b, h)]
      -> QKV (column-parallel)                       (s, b, g/t * (a/g + 2) * d)
      -> q (b, a/t, s, d), k and v (b, g/t, s, d)    each copied into a storage of its own
      -> core: eager or flash                        (s, b, h/t), the projection's input
      -> output projection (row-parallel, f* or g*)  (s, b, h)  [SP: (s/t, b, h)]

What each core keeps, and where this layer departs from Megatron's in layout but not in bytes (q, k, v
copied apart, the grouped flash scores, `FlashAttention` instead of torch's CPU kernel, what the QK norms' views of
the fused QKV output keep alive), is in docs/probe.md, "The layer".
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.model.ledger import Dim
from memcalc.config.schema import ModelConfig
from memcalc.probe import require_torch
from memcalc.probe.checkpoint import checkpoint
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.kernels import fused_causal_softmax, fused_causal_softmax_backward, wide
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear
from memcalc.probe.overlap import NO_OVERLAP, Overlap
from memcalc.probe.norm import Norm
from memcalc.probe.recorder import HeldBy, batch_first, label

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)


class SelfAttention(nn.Module):
    """QKV, core attention (eager or flash, optionally recomputed) and the output projection."""

    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool, dtype: torch.dtype,
        overlap: Overlap = NO_OVERLAP,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.heads_per_group = config.a // config.groups
        self.groups_per_rank = config.groups // tp.size
        self.dropout = config.dropout
        self.flash = config.attention == "flash"
        self.recompute = config.recompute == "selective"
        self.softmax = Softmax.of(config)
        linear = {"tp": tp, "sequence_parallel": sequence_parallel, "dtype": dtype, "overlap": overlap}
        qkv_width = (config.a + 2 * config.groups) * self.head_dim
        qkv_bias = config.add_bias_linear or config.add_qkv_bias
        self.qkv = ColumnParallelLinear(config.h, qkv_width, bias=qkv_bias, seed=1, **linear)
        self.proj = RowParallelLinear(config.a * self.head_dim, config.h, bias=config.add_bias_linear, seed=2, **linear)
        if config.qk_layernorm:  # one weight of d shared by every head (and rank)
            self.q_norm, self.k_norm = (Norm(config.norm, self.head_dim, x, dtype, tp.device, heads=True)
                                        for x in (ledger.Q_NORM, ledger.K_NORM))
        self.qk_norm = config.qk_layernorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        label(batch_first(x), ledger.QKV_IN)
        q, k, v = self._split_heads(self.qkv(x))
        columns = self._query_columns(q)
        if self.qk_norm:
            q, k = self._normed(q, k, v, columns)
            columns = ()  # held beside the key norm's input
        copied = not self.flash and self.heads_per_group > 1 and not self.recompute and not self.qk_norm
        for tensor, saved in ((q, megatron.QUERY_COPY if copied else ledger.Q), (k, ledger.K), (v, ledger.V)):
            if not self._query_views_qkv(x.shape[1]):  # else views of one storage, which _split_heads labelled
                label(tensor, saved)
        context = checkpoint(self._core, q, k, v, *columns) if self.recompute else self._core(q, k, v)
        label(batch_first(context).unflatten(-1, (-1, self.head_dim)), ledger.PROJ_IN)  # (b, s, a/t, d)
        return self.proj(context)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_kept: torch.Tensor) -> torch.Tensor:
        if self.flash:
            return flash_core(q, k, v, self.dropout)
        return eager_core(q, k, v, self.dropout, self.softmax)

    def _query_columns(self, q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What Megatron keeps beside q, k, v under eager GQA, through views of the fused QKV output (its checkpoint's
        K and V, or the key norm's input): the QKV output's query columns (none with one K/V group per rank, where
        megatron's query is a view of them: impls.megatron.CONDITIONS)."""
        if self.flash or self.heads_per_group == 1 or self.groups_per_rank == 1 or not (self.recompute or self.qk_norm):
            return ()
        columns = q.clone()
        label(columns, megatron.QKV_QUERY_COLUMNS)
        return (columns,)

    def _normed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                columns: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (b, heads, s, d) normalised per head; the bytes of megatron's fused QKV output held beside the last
        norm that reads a view of it (the key's with the query heads copied out, else the query's), until that norm's
        backward returns (docs/probe.md, "The layer")."""
        label(q, ledger.Q_NORM.input)
        label(k, ledger.K_NORM.input)
        copied = self.heads_per_group > 1 and self.groups_per_rank > 1
        if not copied:
            q = HeldBy.apply(q, k, v)
        q = _per_head(self.q_norm, q)
        if copied:
            k = HeldBy.apply(k, v, *columns)
        return q, _per_head(self.k_norm, k)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(s, b, g/t * (a/g + 2) * d) -> q (b, a/t, s, d), k and v (b, g/t, s, d), each its own storage."""
        s, b, _ = mixed.shape
        groups = mixed.view(s, b, -1, self.heads_per_group + 2, self.head_dim)  # (s, b, g/t, a/g + 2, d)
        if self._query_views_qkv(b):  # (b, a/t + 2, s, d), one storage: q, k, v views of it, as megatron's
            whole = groups.permute(1, 2, 3, 0, 4).clone(memory_format=torch.contiguous_format).flatten(1, 2)
            label(whole.transpose(1, 2), megatron.QKV_OUT)
            return tuple(whole.split([self.heads_per_group, 1, 1], dim=1))
        parts = groups.split([self.heads_per_group, 1, 1], dim=3)
        # (s, b, g/t, n, d) -> (b, g/t, n, s, d) -> (b, g/t * n, s, d); clone: always a storage of its own
        q, k, v = (p.permute(1, 2, 3, 0, 4).clone(memory_format=torch.contiguous_format) for p in parts)
        return tuple(x.view(b, -1, s, self.head_dim) for x in (q, k, v))

    def _query_views_qkv(self, b: int) -> bool:
        """Whether megatron's eager QK^T keeps its query as a view of the fused QKV output (one K/V group per rank,
        b = 1, nothing copying the query between: impls.megatron.CONDITIONS), so the whole output with it."""
        return (not self.flash and self.heads_per_group > 1 and self.groups_per_rank == 1 and b == 1
                and not self.recompute and not self.qk_norm)


def _per_head(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(b, heads, s, d) through a norm over each head's d channels, run on the (s, b, heads, d) view."""
    return norm(x.permute(2, 0, 1, 3)).permute(1, 2, 0, 3).contiguous()


# -- the core: softmax(q k^T / sqrt(d) + causal mask) v, per K/V group ---------


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views that stack each group's query heads along the rows: (b*g, a/g*s, d), (b*g, s, d), (b*g, s, d)."""
    b, groups, s, d = k.shape
    return q.view(b * groups, -1, d), k.view(b * groups, s, d), v.view(b * groups, s, d)


def _scores(q3: torch.Tensor, k3: torch.Tensor) -> torch.Tensor:
    """Causal, scaled scores (b*g, a/g*s, s): one baddbmm, which keeps q and k only."""
    rows, s, d = q3.shape[1], k3.shape[1], k3.shape[2]
    query_pos = torch.arange(rows, device=q3.device) % s  # row r is query r mod s of some head
    future = torch.arange(s, device=q3.device) > query_pos[:, None]
    mask = torch.zeros(rows, s, dtype=q3.dtype, device=q3.device).masked_fill(future, float("-inf"))
    return torch.baddbmm(mask, q3, k3.transpose(1, 2), alpha=d**-0.5)


@dataclass(frozen=True)
class Softmax:
    """Which softmax the eager core runs: the fused causal kernel (at every size, as the paper counts it, or
    inside megatron's window of sizes), else torch's on scores masked in place, in fp32 or in the scores' dtype."""

    fused_everywhere: bool  # the paper: the fused kernel at every shape
    fusion: bool  # megatron's masked_softmax_fusion: the kernel where its sizes allow
    in_fp32: bool  # megatron's attention_softmax_in_fp32: torch's softmax on the scores cast to fp32

    @classmethod
    def of(cls, config: ModelConfig) -> Softmax:
        return cls(config.impl == "paper", config.masked_softmax_fusion, config.attention_softmax_in_fp32)

    def fused(self, b: int, heads: int, s: int, dtype: torch.dtype) -> bool:
        """Whether the fused kernel runs for this rank's (b, a/t, s, s) scores: it takes fp16 and bf16 only."""
        in_window = self.fusion and bool(megatron.fused_softmax_runs({Dim.B: b, Dim.A: heads, Dim.S: s}, 1))
        return dtype in (torch.bfloat16, torch.float16) and (self.fused_everywhere or in_window)


def eager_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, softmax: Softmax) -> torch.Tensor:
    """Attention op by op, keeping the s x s softmax output (and dropout mask and output)."""
    b, heads, s, d = q.shape
    if k.shape[1] != heads:  # K and V copied to every head, as megatron's DotProductAttention does
        k, v = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))
        label(k, megatron.K_EXPANDED)
        label(v, megatron.V_EXPANDED)
    q3, k3, v3 = _grouped(q, k, v)
    # (b*a/t, s, s), scaled as megatron's baddbmm(alpha=1/sqrt(d)) scales them; held to the end, as
    # DotProductAttention.forward holds its matmul_result
    scores = _scores(q3, k3)
    if softmax.fused(b, heads, s, q.dtype):  # one kernel: keeps its 16-bit output alone
        weights = FusedCausalSoftmax.apply(scores, 1.0)  # megatron's FusedScaleMaskSoftmax: scale None, so 1
    else:
        weights = _torch_softmax(scores, softmax.in_fp32, (b, heads, s, s))
    label(weights.view(b, heads, s, s), ledger.SOFTMAX_OUT)
    if p > 0:
        weights, keep = torch.native_dropout(weights, p, True)  # keeps a 1-byte mask
        label(keep.view(b, heads, s, s), ledger.ATTN_DROPOUT_MASK)
        label(weights.view(b, heads, s, s), ledger.ATTN_DROPOUT_OUT)
    context = torch.bmm(weights, v3)  # (b*g, a/g*s, d); keeps the weights and v
    # (b, a/t, s, d) -> (s, b, a/t, d), copied: the projection's GEMM needs a contiguous input,
    # and F.linear would otherwise make (and keep) a contiguous copy of its own
    return context.view(b, heads, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, heads * d)


def _torch_softmax(scores: torch.Tensor, in_fp32: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """megatron's forward_torch_softmax: the scores (in fp32 a copy, its local until it returns) masked in place
    (keeps the mask), their softmax kept in its dtype and, if that is not the scores', cast back (`shape`: the
    softmax's (b, a/t, s, s))."""
    s = scores.shape[-1]
    x = wide(scores) if in_fp32 else scores
    if s > 1:  # with one query (sq = 1, megatron's KV-cache case) it masks nothing
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        x = x.masked_fill_(future, float("-inf"))
        label(future, megatron.CAUSAL_MASK)
    weights = torch.softmax(x, dim=-1)
    if weights.dtype == scores.dtype:
        return weights
    label(weights.view(shape), megatron.SOFTMAX_FP32)
    return weights.to(scores.dtype)  # cast back beside the fp32 copy; what follows keeps the cast


class FusedCausalSoftmax(torch.autograd.Function):
    """softmax(scale * scores + causal mask) as one fused kernel (Apex's scaled_upper_triang_masked_softmax), each
    direction one op (docs/probe.md, "Fused kernels as one op"), keeping its 16-bit output alone, as the paper counts.

    forward:  scores (b*a/t, s, s) in fp16/bf16 -> probabilities, the same dtype; computed in fp32 inside
    backward: dScores = scale * P * (dP - rowsum(dP * P)), from the output alone
    """

    @staticmethod
    def forward(ctx, scores, scale):
        probs = fused_causal_softmax(scores, scale)
        ctx.save_for_backward(probs)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return fused_causal_softmax_backward(grad, probs, ctx.scale), None


def flash_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Attention that keeps q, k, v, its output and the fp32 log-sum-exp: no s x s tensor."""
    b, heads, s, d = q.shape
    seed = int(torch.randint(2**62, ())) if p > 0 else 0  # drawn from torch's RNG, so a recompute redraws it
    out, lse = FlashAttention.apply(q, k, v, p, seed)  # (s, b, a/t, d), (b, a/t, s)
    label(lse, ledger.SOFTMAX_LSE)
    return out.view(s, b, heads * d)  # a view: the projection keeps this same storage


class FlashAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + causal mask) v as a flash kernel keeps it for backward, each direction one op as the
    kernel is (docs/probe.md, "Fused kernels as one op"; why not torch's CPU kernel: "The layer").

    forward:  q (b, a/t, s, d), k, v (b, g/t, s, d) -> out (s, b, a/t, d), lse (b, a/t, s) fp32
    backward: rebuilds the softmax from q, k and lse, and the dropout mask from the seed
    """

    @staticmethod
    def forward(ctx, q, k, v, p, seed):
        out, lse = _flash_forward(q, k, v, p, seed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.p, ctx.seed = p, seed
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros made for lse's (absent) gradient
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        if grad_out is None:  # only lse was used, and it has no gradient
            return None, None, None, None, None
        return (*_flash_backward(grad_out, *ctx.saved_tensors, ctx.p, ctx.seed), None, None)


@torch.library.custom_op("memcalc::flash_attention", mutates_args=())
def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, heads, s, d = q.shape
    q3, k3, v3 = _grouped(wide(q), wide(k), wide(v))
    scores = _scores(q3, k3)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b*g, a/g*s, 1)
    weights = _dropped(torch.exp(scores - lse), p, seed)
    out = q.new_empty(s, b, heads, d)
    out.copy_(torch.bmm(weights, v3).view(b, heads, s, d).permute(2, 0, 1, 3))
    return out, lse.view(b, heads, s)


@_flash_forward.register_fake
def _(q, k, v, p, seed):
    b, heads, s, d = q.shape
    return q.new_empty(s, b, heads, d), q.new_empty(b, heads, s, dtype=torch.float32)


@torch.library.custom_op("memcalc::flash_attention_backward", mutates_args=())
def _flash_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    p: float, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = q.shape[-1]
    q3, k3, v3 = _grouped(wide(q), wide(k), wide(v))
    # (s, b, a/t, d) -> (b*g, a/g*s, d), the grouped layout, in at least fp32
    grad_o, o = (wide(x.permute(1, 2, 0, 3).reshape(k.shape[0] * k.shape[1], -1, d)) for x in (grad_out, out))
    weights = torch.exp(_scores(q3, k3) - lse.view(*q3.shape[:2], 1))  # the softmax, rebuilt
    dropped = _dropped(weights, p, seed)
    grad_v = dropped.transpose(1, 2) @ grad_o  # sums over the group's heads: (b*g, s, d)
    grad_weights = _dropped(grad_o @ v3.transpose(1, 2), p, seed)
    delta = (grad_o * o).sum(-1, keepdim=True)  # rowsum(dP * P) = rowsum(dO * O)
    grad_scores = weights * (grad_weights - delta) * d**-0.5
    grad_q, grad_k = grad_scores @ k3, grad_scores.transpose(1, 2) @ q3
    return tuple(grad.reshape(x.shape).to(x.dtype) for grad, x in ((grad_q, q), (grad_k, k), (grad_v, v)))


@_flash_backward.register_fake
def _(grad_out, q, k, v, out, lse, p, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _dropped(weights: torch.Tensor, p: float, seed: int) -> torch.Tensor:
    """weights * mask / (1 - p), the mask drawn from `seed` alone, so backward can draw it again."""
    if p == 0:
        return weights
    if weights.is_meta:  # no data and no meta generator: the mask's shape is all there is
        keep = torch.empty(weights.shape, dtype=torch.bool, device="meta")
    else:
        generator = torch.Generator(device=weights.device).manual_seed(seed)
        keep = torch.rand(weights.shape, generator=generator, device=weights.device) >= p
    return weights * keep / (1 - p)
