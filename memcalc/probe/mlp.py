"""The MLP between the column-parallel fc1 and the row-parallel fc2: GELU or SwiGLU.

    GELU:    x -> fc1 (h -> f/t) -> GELU -> fc2 (f/t -> h)
    SwiGLU:  x -> fc1 (h -> 2f/t) -> gate, up -> SiLU(gate) * up -> fc2 (f/t -> h)

What SwiGLU keeps, fused and unfused, and why gate and up are copied apart: docs/probe.md, "The layer".
"""

from __future__ import annotations

from memcalc.model import ledger
from memcalc.model.impls import megatron
from memcalc.config.schema import ModelConfig
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.kernels import swiglu_backward
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear
from memcalc.probe.overlap import NO_OVERLAP, Overlap
from memcalc.probe.recorder import batch_first, label

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)
from torch.nn import functional as F  # noqa: E402


class MLP(nn.Module):
    """(s, b, h) -> (s, b, h), or (s/t, b, h) in and out under SP."""

    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool, dtype: torch.dtype,
        overlap: Overlap = NO_OVERLAP,
    ) -> None:
        super().__init__()
        linear = {"tp": tp, "sequence_parallel": sequence_parallel, "bias": config.add_bias_linear, "dtype": dtype,
                  "overlap": overlap}
        self.swiglu = config.mlp == "swiglu"
        self.fused = config.bias_activation_fusion
        # Under SwiGLU fc1 is Megatron's one GEMM of width 2f: one input kept, one f/g collective.
        self.fc1 = ColumnParallelLinear(config.h, (2 if self.swiglu else 1) * config.ffn, seed=3, **linear)
        if self.swiglu:
            self.fc1.load_shard_of(*(rank_interleaved(x, tp.size) for x in self.fc1.seeded_full_weights(3)))
            for param in self.fc1.parameters():
                param.gated_halves = True  # rank r holds [gate_r; up_r] of the full [gate; up]
        self.fc2 = RowParallelLinear(config.ffn, config.h, seed=5, **linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        label(batch_first(x), ledger.FC1_IN)
        hidden = self._swiglu(x) if self.swiglu else self._gelu(x)  # (s, b, f/t)
        label(batch_first(hidden), ledger.FC2_IN)
        return self.fc2(hidden)

    def _gelu(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.fc1(x)
        label(batch_first(pre), ledger.GELU_IN)
        return F.gelu(pre)  # keeps its input

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        both = self.fc1(x)  # (s, b, 2f/t): [gate; up]
        if self.fused:
            return _FusedSwiGLU.apply(both, torch.is_grad_enabled())  # keeps gate and up only
        gate, up = _apart(both)
        silu = _SiLUKeepingUp.apply(gate, up)  # keeps the gate, and up beside it
        label(batch_first(silu), ledger.SWIGLU_SILU_OUT)
        up_copy = up + GLU_LINEAR_OFFSET
        label(batch_first(up_copy), megatron.SWIGLU_UP_COPY)
        return silu * up_copy  # keeps both factors


def _apart(both: torch.Tensor, in_function: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1's (s, b, 2f/t) output as gate and up, (s, b, f/t) each, copied apart so that each ledger row is one
    storage: Megatron keeps the one fc1 output, the same bytes. `in_function`: labelled inside an autograd
    Function's forward (see `recorder.label`)."""
    gate, up = (half.contiguous() for half in both.chunk(2, dim=-1))
    label(batch_first(gate), ledger.SWIGLU_GATE, in_function)
    label(batch_first(up), ledger.SWIGLU_UP, in_function)
    return gate, up


GLU_LINEAR_OFFSET = 0.0  # megatron's TransformerConfig default


def rank_interleaved(full: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """A seeded [gate; up] fc1 weight (or bias) reordered so rank r's row block is [gate_r; up_r].

    Megatron lays fc1 out this way, so that every t shards the same gate and up matrices.
    """
    if full is None:
        return None
    gate, up = full.chunk(2, dim=0)
    return torch.cat([block for pair in zip(gate.chunk(t), up.chunk(t)) for block in pair])


class _FusedSwiGLU(torch.autograd.Function):
    """SiLU(gate) * up from fc1's whole output, keeping only gate and up, as megatron's BiasSwiGLUFunction keeps
    fc1's output; its backward is one op returning the 2f-wide gradient, as the fused kernel's."""

    @staticmethod
    def forward(ctx, both, recorded):
        gate, up = _apart(both, recorded)
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return swiglu_backward(grad, gate, up), None


class _SiLUKeepingUp(torch.autograd.Function):
    """SiLU(gate), keeping up beside the gate: in Megatron the gate is a view that keeps fc1's
    whole output, up included. Up gets no gradient from here (only from the product)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate)

    @staticmethod
    def backward(ctx, grad):
        gate, _ = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, gate), None  # what SiLU's own backward runs: one op
