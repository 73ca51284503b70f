"""The MLP between the column-parallel fc1 and the row-parallel fc2: GELU or SwiGLU.

    GELU:    x -> fc1 (h -> f/t) -> GELU -> fc2 (f/t -> h)
    SwiGLU:  x -> gate (h -> f/t), up (h -> f/t) -> SiLU(gate) * up -> fc2 (f/t -> h)

SwiGLU's gate and up are two column-parallel linears reading the same input
(which is kept once). Megatron fuses them into one GEMM and chunks its output;
then gate and up are halves of one storage, the same bytes as two.
"""

from __future__ import annotations

from memcalc.model import ledger
from memcalc.config.schema import ModelConfig
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear
from memcalc.probe.recorder import batch_first, label

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)
from torch.nn import functional as F  # noqa: E402


class MLP(nn.Module):
    """(s, b, h) -> (s, b, h), or (s/t, b, h) in and out under SP."""

    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        linear = {
            "tp": tp, "sequence_parallel": sequence_parallel, "bias": config.add_bias_linear, "dtype": dtype,
            "device": tp.device,
        }
        self.swiglu = config.mlp == "swiglu"
        self.fc1 = ColumnParallelLinear(config.h, config.ffn, seed=3, **linear)  # the gate, under SwiGLU
        self.up = ColumnParallelLinear(config.h, config.ffn, seed=4, **linear) if self.swiglu else None
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
        gate, up = self.fc1(x), self.up(x)
        label(batch_first(gate), ledger.SWIGLU_GATE)
        label(batch_first(up), ledger.SWIGLU_UP)
        silu = F.silu(gate)  # keeps its input, the gate
        label(batch_first(silu), ledger.SWIGLU_SILU_OUT)
        return silu * up  # keeps both factors
