"""Hugging Face transformers: what its decoder layers keep for backward, op by op.

Two layer families, told apart by the knobs (memcalc's config has no model family):

    rmsnorm + swiglu            LlamaDecoderLayer (Qwen2's and Mistral's are the same layer;
                                Qwen2 adds a QKV bias, which keeps nothing more), RoPE
    layernorm + gelu/gelu_tanh  GPT2Block (learned positions live in the embedding, outside the layer)

Where transformers' Python differs from Megatron's fused kernels it keeps more:

- `LlamaRMSNorm` upcasts: `x.to(float32)` is kept by `pow(2)` and `x * rsqrt(.)`,
  the fp32 rstd by the same product, the normalised input cast back by `weight * (.)`.
  The bf16 input itself is not kept.
- RoPE: `q * cos + rotate_half(q) * sin` keeps cos and sin (s, d), once per layer.
- Eager attention runs `torch.matmul` on head-strided views, so matmul keeps its
  own contiguous copies of Q, K^T and V (one storage each, the ledger's shapes).
  Llama's softmax runs in fp32 (`dtype=torch.float32`) and keeps its fp32 output;
  with dropout 0 the weights x V matmul keeps the bf16 cast of it as well.
  `repeat_kv` expands K and V to all a heads under GQA, and matmul keeps those copies.
- SDPA (memcalc's "flash") keeps Q, K, V as passed (K/V at g heads: transformers
  passes `enable_gqa`), the output (the o_proj input, one storage) and an fp32
  log-sum-exp. (GPT-2's Q, K, V are views of the one c_attn output: SDPA keeps that
  (b, s, 3h) storage, the three ledger tensors side by side.) With dropout on a CPU,
  torch's flash kernel refuses and its math kernel runs in fp32: a per-device rule
  (`SDPA_MATH`); on CUDA the flash kernel takes dropout and keeps the same tensors
  (read from torch's code). Not counted on CUDA: the fused kernel's RNG state, a few
  int64 bytes (flash_api.cpp: mha_fwd returns a (2,) and a () uint64 tensor).
- GPT-2's `gelu_new` is written out in Python: it keeps its input, tanh's output,
  0.5 * x and 1 + tanh(.), four f-wide tensors; `gelu` (torch's kernel) keeps its input.
  memcalc's `gelu_tanh` is `gelu_new`, GPT2Config's default. A config.json naming
  another tanh GELU reads as `gelu_tanh` too, and is counted as `gelu_new` although
  transformers keeps otherwise: `gelu_pytorch_tanh` (torch's kernel) its input alone,
  `gelu_fast` (written out another way) seven f-wide tensors.
- Dropout: Llama has attention dropout only; GPT-2 adds resid and MLP dropouts.
- Recompute "full" is transformers' gradient checkpointing (torch.utils.checkpoint,
  non-reentrant by default): only the layer's input is kept.

Measured with memcalc's probe (memcalc/probe/libs/hf.py) on the CPU, where dropout
is made CUDA-like (a bool mask; memcalc/probe/libs/hf_shim.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls.base import Implementation, drop_small
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Dim, Kind, Region, SavedTensor

_BSH = (Dim.B, Dim.S, Dim.H)
_BSF = (Dim.B, Dim.S, Dim.F)
_BASS = (Dim.B, Dim.A, Dim.S, Dim.S)
_BASD = (Dim.B, Dim.A, Dim.S, Dim.D)
_SEQ, _TEN = Region.SEQUENCE, Region.TENSOR


class RMSNormTensors(NamedTuple):
    """What one `LlamaRMSNorm` keeps."""

    input_fp32: SavedTensor
    rstd: SavedTensor
    normed: SavedTensor


def _rms_norm(prefix: str, module: str) -> RMSNormTensors:
    by = f"LlamaRMSNorm ({module})"
    return RMSNormTensors(
        SavedTensor(
            f"{prefix}/input_fp32", f"{by}: hidden_states.to(float32), kept by pow(2) and by x * rsqrt(.)", _BSH,
            Kind.FP32, _SEQ, "the gradients of pow(2) and of x * rsqrt(.) read the fp32 input",
        ),
        SavedTensor(
            f"{prefix}/rstd_fp32", f"{by}: rsqrt(variance + eps), kept by rsqrt and by x * rsqrt(.)", (Dim.B, Dim.S),
            Kind.FP32, _SEQ, ledger.WHY_NORM_RSTD, paper=False,
        ),
        SavedTensor(
            f"{prefix}/normed", f"{by}: the normalised input cast back, kept by weight * (.)", _BSH,
            Kind.ACTIVATION, _SEQ, "the weight's gradient is dY times the normalised input",
        ),
    )


LN1_RMS = _rms_norm("ln1", "input_layernorm")
LN2_RMS = _rms_norm("ln2", "post_attention_layernorm")

ROPE_COS = SavedTensor(
    "attention/rope_cos", "apply_rotary_pos_emb: q * cos and k * cos", (Dim.S, Dim.D), Kind.ACTIVATION, _SEQ,
    "the gradient of q in q * cos is dY * cos (one (1, s, d) table from the model's rotary embedding)", paper=False,
)
ROPE_SIN = SavedTensor(
    "attention/rope_sin", "apply_rotary_pos_emb: rotate_half(q) * sin", (Dim.S, Dim.D), Kind.ACTIVATION, _SEQ,
    "the gradient of rotate_half(q) in rotate_half(q) * sin is dY * sin", paper=False,
)
K_EXPANDED = SavedTensor(
    "attention/k_expanded", "repeat_kv, kept by matmul(q, k^T)", _BASD, Kind.ACTIVATION, _TEN,
    "eager attention copies each K group to its a/g heads; QK^T's backward reads the copy",
)
V_EXPANDED = SavedTensor(
    "attention/v_expanded", "repeat_kv, kept by matmul(weights, v)", _BASD, Kind.ACTIVATION, _TEN,
    "eager attention copies each V group to its a/g heads; the weights' gradient reads the copy",
)
SOFTMAX_FP32 = SavedTensor(
    "attention/softmax_fp32", "eager_attention_forward: softmax(dtype=float32)", _BASS, Kind.FP32, _TEN,
    "softmax backward needs its output, here the fp32 one",
)
WEIGHTS = SavedTensor(
    "attention/weights", "eager_attention_forward: softmax output .to(query.dtype), kept by matmul(weights, v)",
    _BASS, Kind.ACTIVATION, _TEN, "the gradient of V is weights^T dOut",
)
# torch's CPU math kernel (aten _scaled_dot_product_attention_math), run when dropout > 0 on a CPU
_MATH = "SDPA math kernel (CPU, dropout > 0)"
MATH_Q = SavedTensor(
    "attention/math_q_fp32", f"{_MATH}: q * sqrt(scale) in fp32, kept by matmul", _BASD, Kind.FP32, _TEN,
    "the gradient of K in QK^T is dScores^T Q",
)
MATH_K = SavedTensor(
    "attention/math_k_fp32", f"{_MATH}: k^T * sqrt(scale) in fp32 (a heads under GQA), kept by matmul", _BASD,
    Kind.FP32, _TEN, "the gradient of Q in QK^T is dScores K",
)
MATH_SOFTMAX = SavedTensor(
    "attention/math_softmax_fp32", f"{_MATH}: _safe_softmax", _BASS, Kind.FP32, _TEN,
    "softmax backward needs its output",
)
MATH_DROPOUT_MASK = SavedTensor(
    "attention/math_dropout_mask_fp32", f"{_MATH}: at::dropout's scaled fp32 mask", _BASS, Kind.FP32, _TEN,
    ledger.WHY_DROPOUT_MASK,
)
MATH_DROPOUT_OUT = SavedTensor(
    "attention/math_dropout_out_fp32", f"{_MATH}: dropped-out weights, kept by matmul", _BASS, Kind.FP32, _TEN,
    "the gradient of V is (dropped-out weights)^T dOut",
)
MATH_V = SavedTensor(
    "attention/math_v_fp32", f"{_MATH}: v in fp32 (a heads under GQA), kept by matmul", _BASD, Kind.FP32, _TEN,
    "the gradient of the attention weights is dOut V^T",
)

SDPA_MATH = (MATH_Q, MATH_K, MATH_SOFTMAX, MATH_DROPOUT_MASK, MATH_DROPOUT_OUT, MATH_V)

FLASH_DROPOUT_LSE = replace(
    ledger.SOFTMAX_LSE,
    saved_by="SDPA flash kernel with dropout on CUDA: same as without, the mask is regenerated from its RNG state"
    " (read from torch's code, aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp: mha_fwd; not measured)",
)

TANH_OUT = SavedTensor(
    "mlp/tanh_out", "NewGELUActivation (gelu_new): torch.tanh", _BSF, Kind.ACTIVATION, _TEN,
    "tanh's derivative, 1 - tanh^2, is read from its output",
)
HALF_X = SavedTensor(
    "mlp/half_x", "NewGELUActivation (gelu_new): 0.5 * x, kept by the final product", _BSF, Kind.ACTIVATION, _TEN,
    "the gradient of (1 + tanh(.)) in 0.5x * (1 + tanh(.)) is dY * 0.5x",
)
ONE_PLUS_TANH = SavedTensor(
    "mlp/one_plus_tanh", "NewGELUActivation (gelu_new): 1 + tanh(.), kept by the final product", _BSF,
    Kind.ACTIVATION, _TEN, "the gradient of 0.5x in 0.5x * (1 + tanh(.)) is dY * (1 + tanh(.))",
)


def is_llama(knobs: Any) -> bool:
    """RMSNorm + SwiGLU is the Llama family (Llama, Mistral, Qwen2); LayerNorm + GELU is GPT-2."""
    return knobs.norm == "rmsnorm"


def norm_block(which: int, knobs: Any) -> tuple[SavedTensor, ...]:
    """LlamaRMSNorm's fp32 upcast, fp32 rstd and cast-back; GPT-2's nn.LayerNorm keeps input, mean, rstd."""
    if is_llama(knobs):
        return tuple((LN1_RMS, LN2_RMS)[which])
    return tuple((ledger.LN1, ledger.LN2)[which])


def _sdpa(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """What `scaled_dot_product_attention` keeps; its output is the o_proj input (labelled there).

    Without dropout: torch's flash kernel, CPU and CUDA alike. With dropout the CPU
    runs the math kernel (measured); CUDA's flash kernel drops out inside (read from code).
    """
    if not knobs.has_dropout:
        return (ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE)
    if accounting.device == "cpu":
        return SDPA_MATH
    return (ledger.Q, ledger.K, ledger.V, FLASH_DROPOUT_LSE)


def _eager(knobs: Any) -> tuple[SavedTensor, ...]:
    """eager_attention_forward: matmul's copies of Q and K^T, the softmax, dropout, matmul's copy of V."""
    k, v = (K_EXPANDED, V_EXPANDED) if knobs.gqa else (ledger.K, ledger.V)
    if not is_llama(knobs):  # GPT-2's softmax runs in the activation dtype: the paper's core
        softmax: tuple[SavedTensor, ...] = (ledger.SOFTMAX_OUT,)
    elif knobs.dtype == "fp32" or knobs.has_dropout:  # no separate cast: .to() is a no-op or dropout keeps a mask
        softmax = (SOFTMAX_FP32,)
    else:
        softmax = (SOFTMAX_FP32, WEIGHTS)
    dropout = (ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT) if knobs.has_dropout else ()
    return (ledger.Q, k, *softmax, *dropout, v)


def attention_block(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Q/K/V projections' input, RoPE tables (Llama), the core, o_proj's input, GPT-2's resid dropout."""
    rope = (ROPE_COS, ROPE_SIN) if is_llama(knobs) else ()
    core = _sdpa(knobs, accounting) if knobs.attention == "flash" else _eager(knobs)
    resid = (ledger.ATTN_OUT_DROPOUT_MASK,) if knobs.has_dropout and not is_llama(knobs) else ()
    return (ledger.QKV_IN, *rope, *core, ledger.PROJ_IN, *resid)


def mlp_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """LlamaMLP (gate, up, SiLU(gate) * up) or GPT2MLP (c_fc, activation, c_proj, dropout)."""
    if knobs.mlp == "swiglu":
        activation = (ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT)
    elif knobs.mlp == "gelu_tanh":
        activation = (ledger.GELU_IN, HALF_X, TANH_OUT, ONE_PLUS_TANH)
    else:
        activation = (ledger.GELU_IN,)
    dropout = (ledger.MLP_DROPOUT_MASK,) if knobs.has_dropout and not is_llama(knobs) else ()
    return (ledger.FC1_IN, *activation, ledger.FC2_IN, *dropout)


def layer_tensors(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Every tensor one transformers decoder layer keeps for backward, in forward order."""
    if knobs.recompute == "full":
        return (ledger.LAYER_INPUT,)  # torch.utils.checkpoint keeps the layer's positional input
    blocks = (
        norm_block(0, knobs) + attention_block(knobs, accounting) + norm_block(1, knobs) + mlp_block(knobs)
    )
    return drop_small(blocks, accounting)


_LAYERS = {("rmsnorm", "swiglu"): "LlamaDecoderLayer", ("layernorm", "gelu"): "GPT2Block",
           ("layernorm", "gelu_tanh"): "GPT2Block"}


def check(knobs: Any) -> None:
    """The knob values transformers' four layers run; ConfigError for the rest."""
    if (knobs.norm, knobs.mlp) not in _LAYERS:
        runs = ", ".join(f"{n} + {m} ({layer})" for (n, m), layer in _LAYERS.items())
        raise ConfigError(f"impl hf: no transformers layer has norm {knobs.norm} with mlp {knobs.mlp}; it runs {runs}")
    if knobs.recompute not in ("none", "full"):
        raise ConfigError(f"impl hf: transformers has no {knobs.recompute} recomputation; use recompute none or full"
                          " (its gradient checkpointing)")
    if knobs.gqa and not is_llama(knobs):
        raise ConfigError("impl hf: GPT2Block has no grouped-query attention; leave num_query_groups unset")
    if knobs.bias_activation_fusion:
        raise ConfigError("impl hf: bias_activation_fusion is Megatron's fused kernel; transformers has none")


IMPLEMENTATION = Implementation(
    name="hf",
    title="Hugging Face transformers",
    measured_on="transformers 5.24.0 (torch 2.13.0, CPU, bf16): LlamaDecoderLayer, Qwen2DecoderLayer,"
    " MistralDecoderLayer and GPT2Block, attn_implementation eager and sdpa",
    layer_tensors=layer_tensors,
    strategies=("none",),
    check=check,
    tensors=(
        *LN1_RMS, *LN2_RMS, ROPE_COS, ROPE_SIN, K_EXPANDED, V_EXPANDED, SOFTMAX_FP32, WEIGHTS, *SDPA_MATH,
        HALF_X, TANH_OUT, ONE_PLUS_TANH,  # FLASH_DROPOUT_LSE is the ledger's LSE, described as read from code
    ),
    # LlamaConfig's own: RMSNorm, SwiGLU, attention_dropout 0, attn_implementation "sdpa" (memcalc's flash).
    defaults={"norm": "rmsnorm", "mlp": "swiglu", "dropout": 0.0, "attention": "flash"},
)
