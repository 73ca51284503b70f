"""One transformer layer on one tensor-parallel rank, built to save what the ledger says.

Megatron's pre-norm block, sequence-first, every knob of `memcalc estimate` a constructor choice; every tensor it makes
that the ledger lists is labelled with the ledger's name (`recorder.label`), so a recorded run reads as the ledger does.
Its diagram, and where it departs from Megatron's code in layout but not in bytes: docs/probe.md, "The layer".
"""

from __future__ import annotations

from memcalc.model import ledger
from memcalc.config.schema import ModelConfig
from memcalc.model.ledger import SavedTensor
from memcalc.probe import require_torch
from memcalc.probe.attention import SelfAttention
from memcalc.probe.checkpoint import checkpoint
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.mlp import MLP
from memcalc.probe.norm import Norm
from memcalc.probe.overlap import NO_OVERLAP, Overlap
from memcalc.probe.recorder import batch_first, label

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class TransformerLayer(nn.Module):
    """The block for `config` on rank `tp.rank` of `tp.size`; SP if `sequence_parallel`.

    `overlap` (SP only) runs the linears' all-gathers and reduce-scatters as pieces
    beside their GEMMs (memcalc.probe.overlap); the same function, other messages.
    `mlp`: another MLP, (s, b, h) -> (s, b, h), in place of the probe's own (the step's megatron-core MoELayer,
    memcalc.probe.libs.megatron_step).
    """

    def __init__(
        self, config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool, overlap: Overlap = NO_OVERLAP,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        dtype = DTYPES[config.dtype]
        self.ln1 = Norm(config.norm, config.h, ledger.LN1, dtype, tp.device, sequence_parallel=sequence_parallel)
        self.attention = SelfAttention(config, tp, sequence_parallel, dtype, overlap)
        self.ln2 = Norm(config.norm, config.h, ledger.LN2, dtype, tp.device, sequence_parallel=sequence_parallel)
        self.mlp = MLP(config, tp, sequence_parallel, dtype, overlap) if mlp is None else mlp
        self.dropout = config.dropout
        self.full_recompute = config.recompute == "full"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(s, b, h) -> (s, b, h), or (s/t, b, h) in and out under SP."""
        if self.full_recompute:
            label(batch_first(x), ledger.LAYER_INPUT)
            return checkpoint(self._block, x)  # keeps x alone; the block reruns in backward
        return self._block(x)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        x = _dropout_add(self.attention(self.ln1(x)), x, self.dropout, ledger.ATTN_OUT_DROPOUT_MASK)
        return _dropout_add(self.mlp(self.ln2(x)), x, self.dropout, ledger.MLP_DROPOUT_MASK)


def _dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, mask: SavedTensor) -> torch.Tensor:
    """residual + dropout(x): the dropout keeps its 1-byte mask, the add keeps nothing."""
    if p > 0:
        x, keep = torch.native_dropout(x, p, True)
        label(batch_first(keep), mask)
    return residual + x
