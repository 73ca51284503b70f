"""Which ledger tensors a layer keeps, given its knobs: blocks, then the layer.

Each knob touches only the terms it changes: the MLP's activation picks its
tensors, eager or flash attention picks the core's, dropout 0 removes masks,
recomputation drops what it will rebuild. The paper's accounting leaves out the
small `paper=False` terms; exact accounting keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.model import ledger
from memcalc.model.ledger import Kind, SavedTensor

if TYPE_CHECKING:
    from memcalc.config.schema import ModelKnobs

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Knobs:
    """The choices that decide which tensors a layer saves and at what width."""

    mlp: str = "gelu"
    attention: str = "eager"
    norm: str = "layernorm"
    dropout: bool = True  # any dropout at all: masks are saved only when p > 0
    recompute: str = "none"
    dtype: str = "bf16"
    ffn_set: bool = False  # formulas write f for the MLP width instead of 4h
    gqa: bool = False  # formulas write g for the K/V groups instead of a

    @classmethod
    def of(cls, config: ModelKnobs) -> Knobs:
        """The knobs a validated config (or knob set, without sizes) chooses."""
        return cls(
            mlp=config.mlp, attention=config.attention, norm=config.norm,
            dropout=config.dropout > 0, recompute=config.recompute, dtype=config.dtype,
            ffn_set=config.ffn_hidden_size is not None,
            gqa=config.num_query_groups not in (None, getattr(config, "a", None)),
        )


@dataclass(frozen=True)
class Accounting:
    """How strictly to count: the paper's terms only, or every saved byte.

    `device` matters only for exact accounting: LayerNorm statistics are fp32
    on CUDA but kept in the activation dtype on CPU.
    """

    exact: bool = False
    device: str = "cuda"


def element_bytes(kind: Kind, knobs: Knobs, accounting: Accounting) -> int:
    """Bytes per element of a tensor of this kind."""
    if kind is Kind.MASK:
        return 1
    if kind is Kind.FP32 or (kind is Kind.NORM_STATS and accounting.device == "cuda"):
        return 4
    return DTYPE_BYTES[knobs.dtype]


def norm_block(norm: ledger.NormTensors, knobs: Knobs) -> tuple[SavedTensor, ...]:
    """LayerNorm keeps input, mean and rstd; RMSNorm has no mean."""
    if knobs.norm == "layernorm":
        return (norm.input, norm.mean, norm.rstd)
    return (norm.input, norm.rstd)


def core_attention(knobs: Knobs) -> tuple[SavedTensor, ...]:
    """What softmax(QK^T)V keeps beyond Q, K, V: s^2 terms if eager, statistics if flash."""
    if knobs.recompute == "selective":
        return ()  # rebuilt from Q, K, V in backward (Korthikanti et al. 2022)
    if knobs.attention == "flash":
        return (ledger.SOFTMAX_LSE,)  # the dropout mask is regenerated from the RNG seed
    if knobs.dropout:
        return (ledger.SOFTMAX_OUT, ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT)
    return (ledger.SOFTMAX_OUT,)  # weights x V saves the softmax output itself


def attention_block(knobs: Knobs) -> tuple[SavedTensor, ...]:
    """QKV input, Q/K/V, the core's terms, the projection input, the output mask."""
    mask = (ledger.ATTN_OUT_DROPOUT_MASK,) if knobs.dropout else ()
    return (ledger.QKV_IN, ledger.Q, ledger.K, ledger.V, *core_attention(knobs), ledger.PROJ_IN, *mask)


def mlp_block(knobs: Knobs) -> tuple[SavedTensor, ...]:
    """fc1 input, the activation's terms, fc2 input, the output mask."""
    if knobs.mlp == "swiglu":
        activation = (ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT)
    else:
        activation = (ledger.GELU_IN,)
    mask = (ledger.MLP_DROPOUT_MASK,) if knobs.dropout else ()
    return (ledger.FC1_IN, *activation, ledger.FC2_IN, *mask)


def layer_tensors(knobs: Knobs, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Every tensor one layer keeps for backward, in forward order."""
    if knobs.recompute == "full":
        return (ledger.LAYER_INPUT,)
    blocks = (
        norm_block(ledger.LN1, knobs) + attention_block(knobs)
        + norm_block(ledger.LN2, knobs) + mlp_block(knobs)
    )
    return tuple(t for t in blocks if accounting.exact or t.paper)
