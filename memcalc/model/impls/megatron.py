"""Megatron-core: the seed's layer, as megatron-core's own TransformerLayer keeps it.

Which ledger tensors the layer keeps, given its knobs: the MLP's activation
picks its tensors, eager or flash attention picks the core's, dropout 0 removes
masks, recomputation drops what it will rebuild. The paper's accounting leaves
out the small `paper=False` terms; exact accounting keeps them. With GELU and
multi-head attention this is exactly the seed's sbh(34 + 5as/h) and its TP and
TP+SP forms. GELU's tanh approximation (`gelu_tanh`) keeps what exact GELU keeps,
its input: `F.gelu(approximate="tanh")` saves its input alone (measured), as does
the fused `bias_gelu` (`bias_activation_fusion`; Megatron runs it for
activation_func F.gelu, and it is the tanh approximation). Megatron-LM's
`openai_gelu` writes the formula out under megatron's `jit_fuser`, torch.compile,
whose inductor partitioner saves the input alone too (checked on CPU with torch
2.13; run eagerly, openai_gelu would keep six more f-wide tensors, and the probe
runs torch.compile eagerly, so it measures the F.gelu form).

Measured on megatron-core 0.16.1 (`memcalc measure --impl megatron`), three
places where Megatron keeps other storages than the paper's layer:
- SwiGLU (megatron/core/transformer/mlp.py, MLP.forward). fc1 is one GEMM whose
  2f/t-wide output holds gate and up side by side. Fused
  (`bias_activation_fusion`, `BiasSwiGLUFunction`), only that output is kept:
  no SiLU output. Unfused, `glu()` chunks it: SiLU keeps the gate as a view, which
  keeps the whole output (gate and up), and `x_linear + glu_linear_offset` makes
  a copy of up (even for offset 0) that the product keeps beside SiLU's output.
- Grouped-query attention (transformer/attention.py, get_query_key_value_tensors;
  transformer/dot_product_attention.py, DotProductAttention.forward). With a/g > 1
  heads per group, `query.reshape` copies the query heads out of the fused QKV
  output, and the local core attention `repeat_interleave`s K and V to every
  head before QK^T and weights x V, which keep the copies, (b, a, s, d) each.
  Under selective recomputation the checkpoint keeps that query copy and K, V
  as views of the fused QKV output, whose query columns so stay alive too
  (except with one K/V group per rank, g = t: there the query heads are
  contiguous, no copy is made, and the seed's Q, K, V is exact; the rules see
  knobs, not t, so they model g/t > 1).
- Q, K and V (multi-head) are views of the one fused QKV output: one storage,
  the same bytes as the three ledger rows.
- The softmax is Megatron-LM's default, the fused causal kernel (Apex's
  scaled_upper_triang_masked_softmax), which keeps its fp16/bf16 output. In fp32
  it cannot run, and FusedScaleMaskSoftmax.forward_torch_softmax keeps the (s, s)
  causal mask of its masked_fill_ too. (In fp16/bf16 the kernel also needs
  16 < s <= 4096 and b*a/t a multiple of its batch per block, 8 for s <= 128;
  outside that Megatron keeps an fp32 softmax and the mask: FUSED_SOFTMAX, a rule on
  the sizes, which evaluate and sweep apply; formulas assume the kernel runs.)
"""

from __future__ import annotations

from typing import Any

from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls.base import Implementation, SizeRule, drop_small
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Dim, Kind, Region, SavedTensor

_BASD = (Dim.B, Dim.A, Dim.S, Dim.D)

K_EXPANDED = SavedTensor(
    "attention/k_expanded", "DotProductAttention: key.repeat_interleave(a/g) before QK^T", _BASD,
    Kind.ACTIVATION, Region.TENSOR, "QK^T reads K copied to every head of its group; dQ = dScores K needs the copy",
)
V_EXPANDED = SavedTensor(
    "attention/v_expanded", "DotProductAttention: value.repeat_interleave(a/g) before weights x V", _BASD,
    Kind.ACTIVATION, Region.TENSOR, "weights x V reads V copied to every head; dWeights = dOut V^T needs the copy",
)
QKV_QUERY_COLUMNS = SavedTensor(
    "attention/qkv_q_columns", "checkpointed core attention (keeps K, V as views of the fused QKV output)", _BASD,
    Kind.ACTIVATION, Region.TENSOR,
    "K and V are kept as views of the fused QKV output, which keeps its query columns alive beside the query copy",
)
SWIGLU_UP_COPY = SavedTensor(
    "mlp/up_plus_offset", "MLP glu(): SiLU(gate) * (up + glu_linear_offset)", (Dim.B, Dim.S, Dim.F),
    Kind.ACTIVATION, Region.TENSOR, "`up + offset` is a new tensor (even for offset 0); the product's dSiLU needs it",
)
CAUSAL_MASK = SavedTensor(
    "attention/causal_mask", "FusedScaleMaskSoftmax.forward_torch_softmax: masked_fill_(causal mask)",
    (Dim.S, Dim.S), Kind.MASK, Region.REPLICATED,
    "without the fused softmax kernel (fp32 runs), masked_fill_'s backward zeroes the masked gradient",
    paper=False,
)

SOFTMAX_FP32 = SavedTensor(
    "attention/softmax_fp32", "FusedScaleMaskSoftmax.forward_torch_softmax: softmax of the fp32 scores",
    (Dim.B, Dim.A, Dim.S, Dim.S), Kind.FP32, Region.TENSOR,
    "outside the fused kernel's sizes the softmax runs in fp32 (softmax_in_fp32) and its backward reads that output",
)

TENSORS: tuple[SavedTensor, ...] = (  # megatron's own
    K_EXPANDED, V_EXPANDED, QKV_QUERY_COLUMNS, SWIGLU_UP_COPY, CAUSAL_MASK, SOFTMAX_FP32,
)


def norm_block(norm: ledger.NormTensors, knobs: Any) -> tuple[SavedTensor, ...]:
    """LayerNorm keeps input, mean and rstd; RMSNorm has no mean."""
    if knobs.norm == "layernorm":
        return (norm.input, norm.mean, norm.rstd)
    return (norm.input, norm.rstd)


def core_attention(knobs: Any, fused_softmax: bool = True) -> tuple[SavedTensor, ...]:
    """What softmax(QK^T)V keeps beyond Q, K, V: s^2 terms if eager, statistics if flash.

    `fused_softmax`: whether the sizes let Megatron's fused causal kernel run (FUSED_SOFTMAX).
    """
    if knobs.recompute == "selective":
        return ()  # rebuilt from Q, K, V in backward (Korthikanti et al. 2022)
    if knobs.attention == "flash":
        return (ledger.SOFTMAX_LSE,)  # the dropout mask is regenerated from the RNG seed
    dropout = (ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT) if knobs.has_dropout else ()
    if knobs.dtype == "fp32":  # the fused kernel takes fp16/bf16 only; torch's softmax keeps its mask too
        return (CAUSAL_MASK, ledger.SOFTMAX_OUT, *dropout)
    if not fused_softmax:  # forward_torch_softmax: fp32 softmax, cast back; weights x V keeps the cast
        return (CAUSAL_MASK, SOFTMAX_FP32, *(dropout or (ledger.SOFTMAX_OUT,)))
    return (ledger.SOFTMAX_OUT, *dropout)  # without dropout, weights x V saves the softmax output itself


def query_key_value(knobs: Any) -> tuple[SavedTensor, ...]:
    """Q, K, V as the core keeps them: views of the fused QKV output, or (GQA) copies for every head."""
    if not knobs.gqa or knobs.attention == "flash":
        return (ledger.Q, ledger.K, ledger.V)
    if knobs.recompute == "selective":
        # The checkpoint's inputs, expanded in backward. With one K/V group per rank (g = t) the query
        # heads are contiguous, no copy is made, and Megatron keeps Q, K, V alone; knobs do not see t.
        return (ledger.Q, ledger.K, ledger.V, QKV_QUERY_COLUMNS)
    return (ledger.Q, K_EXPANDED, V_EXPANDED)


def attention_block(knobs: Any, fused_softmax: bool = True) -> tuple[SavedTensor, ...]:
    """QKV input, Q/K/V, the core's terms, the projection input, the output mask."""
    mask = (ledger.ATTN_OUT_DROPOUT_MASK,) if knobs.has_dropout else ()
    core = core_attention(knobs, fused_softmax)
    return (ledger.QKV_IN, *query_key_value(knobs), *core, ledger.PROJ_IN, *mask)


def swiglu(knobs: Any) -> tuple[SavedTensor, ...]:
    """Gate and up (the two halves of fc1's output); unfused, also SiLU's output and a copy of up."""
    if knobs.bias_activation_fusion:
        return (ledger.SWIGLU_GATE, ledger.SWIGLU_UP)  # BiasSwiGLUFunction keeps its input alone
    return (ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT, SWIGLU_UP_COPY)


def mlp_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """fc1 input, the activation's terms, fc2 input, the output mask."""
    if knobs.mlp == "swiglu":
        activation = swiglu(knobs)
    else:
        activation = (ledger.GELU_IN,)  # F.gelu (exact or tanh), openai_gelu, the fused bias_gelu: the input
    mask = (ledger.MLP_DROPOUT_MASK,) if knobs.has_dropout else ()
    return (ledger.FC1_IN, *activation, ledger.FC2_IN, *mask)


def layer_tensors(knobs: Any, accounting: Accounting, fused_softmax: bool = True) -> tuple[SavedTensor, ...]:
    """Every tensor one layer keeps for backward, in forward order."""
    if knobs.recompute == "full":
        return (ledger.LAYER_INPUT,)
    blocks = (
        norm_block(ledger.LN1, knobs) + attention_block(knobs, fused_softmax)
        + norm_block(ledger.LN2, knobs) + mlp_block(knobs)
    )
    return drop_small(blocks, accounting)


def fused_softmax_runs(sizes: dict[Dim, Any], t: Any) -> Any:
    """FusedScaleMaskSoftmax.is_kernel_available for the causal kernel (fusions/fused_softmax.py), on numbers or arrays.

    16 < s <= 4096, s a multiple of 4, and the b * a/t attention batches a multiple of the
    kernel's batch per block: 8 for s <= 128, 4 above (Apex's scaled_masked_softmax.h,
    128 threads per block).
    """
    s, batches = sizes[Dim.S], sizes[Dim.B] * (sizes[Dim.A] // t)
    per_block = 4 + 4 * (s <= 128)
    return (16 < s) & (s <= 4096) & (s % 4 == 0) & (batches % per_block == 0)


FUSED_SOFTMAX = SizeRule(
    "Megatron-LM's fused causal softmax (masked_softmax_fusion) runs only for 16 < s <= 4096, s a multiple of 4,"
    " and b*a/t a multiple of 8 (s <= 128) or 4; outside, FusedScaleMaskSoftmax.forward_torch_softmax keeps an"
    " fp32 softmax and the (s, s) causal mask, as on CUDA",
    applies=lambda knobs: knobs.attention == "eager" and knobs.recompute not in ("selective", "full")
    and knobs.dtype != "fp32",
    runs=fused_softmax_runs,
    outside=lambda knobs, accounting: layer_tensors(knobs, accounting, fused_softmax=False),
)


def check(knobs: Any) -> None:
    """ConfigError for knob values megatron-core's layer does not have."""
    if knobs.bias_activation_fusion and knobs.mlp != "swiglu" and not getattr(knobs, "add_bias_linear", True):
        raise ConfigError(
            f"impl megatron: bias_activation_fusion with {knobs.mlp} fuses fc1's bias; it needs add_bias_linear"
        )
    if knobs.recompute == "op":
        raise ConfigError("impl megatron: recompute op is torchtitan's op-level checkpointing; use selective or full")


IMPLEMENTATION = Implementation(
    name="megatron",
    title="Megatron-core",
    measured_on="megatron-core 0.16.1 TransformerLayer and TransformerBlock (full recompute), local spec, on CPU",
    layer_tensors=layer_tensors,
    tensors=TENSORS,
    check=check,
    size_rule=FUSED_SOFTMAX,
)
