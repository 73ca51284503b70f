"""Megatron-core: the seed's layer, as Megatron-LM's pre-norm block keeps it.

Which ledger tensors the layer keeps, given its knobs: the MLP's activation
picks its tensors, eager or flash attention picks the core's, dropout 0 removes
masks, recomputation drops what it will rebuild. The paper's accounting leaves
out the small `paper=False` terms; exact accounting keeps them. With GELU and
multi-head attention this is exactly the seed's sbh(34 + 5as/h) and its TP and
TP+SP forms.
"""

from __future__ import annotations

from typing import Any

from memcalc.model import ledger
from memcalc.model.impls.base import Implementation, drop_small
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import SavedTensor


def norm_block(norm: ledger.NormTensors, knobs: Any) -> tuple[SavedTensor, ...]:
    """LayerNorm keeps input, mean and rstd; RMSNorm has no mean."""
    if knobs.norm == "layernorm":
        return (norm.input, norm.mean, norm.rstd)
    return (norm.input, norm.rstd)


def core_attention(knobs: Any) -> tuple[SavedTensor, ...]:
    """What softmax(QK^T)V keeps beyond Q, K, V: s^2 terms if eager, statistics if flash."""
    if knobs.recompute == "selective":
        return ()  # rebuilt from Q, K, V in backward (Korthikanti et al. 2022)
    if knobs.attention == "flash":
        return (ledger.SOFTMAX_LSE,)  # the dropout mask is regenerated from the RNG seed
    if knobs.has_dropout:
        return (ledger.SOFTMAX_OUT, ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT)
    return (ledger.SOFTMAX_OUT,)  # weights x V saves the softmax output itself


def attention_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """QKV input, Q/K/V, the core's terms, the projection input, the output mask."""
    mask = (ledger.ATTN_OUT_DROPOUT_MASK,) if knobs.has_dropout else ()
    return (ledger.QKV_IN, ledger.Q, ledger.K, ledger.V, *core_attention(knobs), ledger.PROJ_IN, *mask)


def mlp_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """fc1 input, the activation's terms, fc2 input, the output mask."""
    if knobs.mlp == "swiglu":
        activation = (ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT)
    else:
        activation = (ledger.GELU_IN,)
    mask = (ledger.MLP_DROPOUT_MASK,) if knobs.has_dropout else ()
    return (ledger.FC1_IN, *activation, ledger.FC2_IN, *mask)


def layer_tensors(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Every tensor one layer keeps for backward, in forward order."""
    if knobs.recompute == "full":
        return (ledger.LAYER_INPUT,)
    blocks = (
        norm_block(ledger.LN1, knobs) + attention_block(knobs)
        + norm_block(ledger.LN2, knobs) + mlp_block(knobs)
    )
    return drop_small(blocks, accounting)


IMPLEMENTATION = Implementation(
    name="megatron",
    title="Megatron-core",
    measured_on="memcalc's own Megatron-style probe layer (megatron-core's TransformerLayer: see docs/impl-megatron.md)",
    layer_tensors=layer_tensors,
)
