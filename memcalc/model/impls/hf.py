"""Hugging Face transformers: what its decoder layers keep for backward, op by op.

A config's family (memcalc.model.families.layer_family) picks the layer, and the knobs say what it keeps. Where
transformers' Python keeps more than Megatron's fused kernels, family by family, with the measurements behind it
(memcalc/probe/libs/hf.py): docs/impl-notes/hf.md, rendered into docs/impl-hf.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, NamedTuple

from memcalc.model.families import FAMILIES, check_family, layer_family
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls.base import (Implementation, Refusal, Rerun, SizeCondition, SizeRule, always,
                                      check_grouped_mm, drop_small)
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import BASD, BASS, BSF, BSH, Dim, Kind, Region, RMSNormTensors, SavedTensor, in_pair
from memcalc.model.tp_plan import ATTENTION, MLP, Pair, Rule, Style, TPPlan, pair

_SEQ, _TEN = Region.SEQUENCE, Region.TENSOR
Shape = tuple[Dim, ...]


def _layout(prefix: str, width: Dim = Dim.H, heads: Dim | None = None) -> tuple[str, Shape, Region, Shape]:
    """A norm's name stem (`prefix` as ledger._norm's: "ln1", or "mla/q_norm_"), its rows (one rstd each), their region
    and the normalised shape: per token over `width`, or with `heads` per head, inside the pair TP splits."""
    rows, region = ((Dim.B, heads, Dim.S), _TEN) if heads is not None else ((Dim.B, Dim.S), _SEQ)
    return prefix if "/" in prefix else f"{prefix}/", rows, region, (*rows, width)


_WHY_NORMED = "the weight's gradient is dY times the normalised input"
_WHY_NORMED_FP32 = f"{_WHY_NORMED}, here the fp32 one"


def _rms_norm(prefix: str, module: str, width: Dim = Dim.H, heads: Dim | None = None,
              cls: str = "LlamaRMSNorm") -> RMSNormTensors:
    """What one LlamaRMSNorm over `width` keeps (`cls`: a norm that runs its code first). With `heads` it runs on each
    head's d channels (Qwen3's q_norm and k_norm)."""
    by, (stem, rows, region, shape) = f"{cls} ({module})", _layout(prefix, width, heads)
    return RMSNormTensors(
        input_fp32=SavedTensor(f"{stem}input_fp32", f"{by}: hidden_states.to(float32), kept by pow(2) and by"
                               " x * rsqrt(.)", shape, Kind.FP32, region,
                               "the gradients of pow(2) and of x * rsqrt(.) read the fp32 input"),
        rstd=SavedTensor(f"{stem}rstd_fp32", f"{by}: rsqrt(variance + eps), kept by rsqrt and by x * rsqrt(.)", rows,
                         Kind.FP32, region, ledger.WHY_NORM_RSTD, paper=False),
        normed=SavedTensor(f"{stem}normed", f"{by}: the normalised input cast back, kept by weight * (.)", shape,
                           Kind.ACTIVATION, region, _WHY_NORMED))


def _gemma_norm(prefix: str, module: str, width: Dim = Dim.H, heads: Dim | None = None) -> RMSNormTensors:
    """What one `GemmaRMSNorm` keeps: (1 + w) * (x * rsqrt(mean(x^2) + eps)), all in fp32, cast back after.

    Llama's upcast and rstd; the product by (1 + w.float()) keeps both factors in fp32, and the
    cast back (type_as) keeps nothing. With `heads`, Gemma 3's q_norm or k_norm on each head's d channels."""
    llama, by = _rms_norm(prefix, module, width, heads, "GemmaRMSNorm"), f"GemmaRMSNorm ({module})"
    stem = _layout(prefix, width, heads)[0]
    return RMSNormTensors(
        input_fp32=replace(llama.input_fp32, saved_by=f"{by}: x.float(), kept by pow(2) and by x * rsqrt(.)"),
        rstd=llama.rstd,
        weight_plus_one=SavedTensor(
            f"{stem}weight_plus_one_fp32", f"{by}: 1.0 + weight.float(), kept by output * (.)", (width,),
            Kind.FP32, Region.REPLICATED, "the gradient of the normalised input is dY * (1 + w)", paper=False),
        normed_fp32=SavedTensor(f"{stem}normed_fp32", f"{by}: x * rsqrt(.) in fp32, kept by output * (1 + w)",
                                llama.input_fp32.shape, Kind.FP32, llama.input_fp32.region, _WHY_NORMED_FP32))


def _olmo_norm(prefix: str, module: str) -> ledger.NormTensors:
    """OlmoLayerNorm: F.layer_norm without weight or bias on an fp32 copy of x, which it keeps with its fp32 mean and
    rstd (fp32 on every device: the input is fp32); the cast back keeps nothing."""
    by = f"OlmoLayerNorm ({module})"
    return ledger.NormTensors(
        SavedTensor(f"{prefix}/input_fp32", f"{by}: hidden_states.to(float32), kept by F.layer_norm", BSH, Kind.FP32,
                    _SEQ, "LayerNorm's backward reads its (fp32) input"),
        *(SavedTensor(f"{prefix}/{stat}_fp32", f"{by}: F.layer_norm's {stat}", (Dim.B, Dim.S), Kind.FP32, _SEQ,
                      ledger.WHY_NORM_RSTD, paper=False) for stat in ("mean", "rstd")))


def _olmo2_norm(prefix: str, module: str, width: tuple[Dim, ...] = (Dim.H,)) -> RMSNormTensors:
    """Olmo2RMSNorm: Llama's upcast and rstd, then weight * (.) in fp32 (the weight promoted), which keeps the fp32
    normalised input; the cast back keeps nothing. `width` the normalised channels: h, or a whole projection's
    heads (q_norm over a*d, k_norm over g*d, one rstd a token)."""
    llama, by = _rms_norm(prefix, module, cls="Olmo2RMSNorm"), f"Olmo2RMSNorm ({module})"
    shape, region = (Dim.B, Dim.S, *width), _TEN if Dim.H not in width else _SEQ
    return RMSNormTensors(
        input_fp32=replace(llama.input_fp32, shape=shape, region=region), rstd=llama.rstd,
        normed_fp32=SavedTensor(f"{_layout(prefix)[0]}normed_fp32", f"{by}: x * rsqrt(.) in fp32, kept by"
                                " weight * (.) (promoted to fp32)", shape, Kind.FP32, region, _WHY_NORMED_FP32))


class CohereNormTensors(NamedTuple):
    """What one CohereLayerNorm keeps, in the order its ops make them."""

    centred_pow: SavedTensor
    centred_mul: SavedTensor
    rstd: SavedTensor
    weight_fp32: SavedTensor
    normed_fp32: SavedTensor


def _cohere_norm(prefix: str, module: str, width: Dim = Dim.H, heads: Dim | None = None) -> CohereNormTensors:
    """CohereLayerNorm: w * ((x - mean) * rsqrt(var + eps)), written out on an fp32 copy of x and cast back.

    It computes x - mean twice, once for pow(2) (the variance) and once for the product by rsqrt: each fp32 copy is
    kept by its op. The fp32 copy of x itself is read by mean and sub, which keep nothing; the product by
    weight.to(float32) keeps that fp32 weight (a copy under bf16; under fp32 the parameter itself) and the fp32
    normalised input. With `heads` it runs on each head's d channels (use_qk_norm's q_norm and k_norm, whose weight
    is (heads, d))."""
    by, (stem, rows, region, shape) = f"CohereLayerNorm ({module})", _layout(prefix, width, heads)
    weight = ((heads, width), _TEN) if heads is not None else ((width,), Region.REPLICATED)
    return CohereNormTensors(
        centred_pow=SavedTensor(f"{stem}centred_pow_fp32", f"{by}: x.to(float32) - mean, kept by pow(2)", shape,
                                Kind.FP32, region, "the variance's gradient, through (x - mean)^2, is read at x -"
                                " mean"),
        centred_mul=SavedTensor(
            f"{stem}centred_mul_fp32", f"{by}: x.to(float32) - mean again, kept by (.) * rsqrt(var + eps)", shape,
            Kind.FP32, region, "the gradient of rsqrt(.) in the product is dY * (x - mean), this second copy"),
        rstd=SavedTensor(f"{stem}rstd_fp32", f"{by}: rsqrt(variance + eps), kept by rsqrt and by (x - mean) * (.)",
                         rows, Kind.FP32, region, ledger.WHY_NORM_RSTD, paper=False),
        weight_fp32=SavedTensor(
            f"{stem}weight_fp32", f"{by}: weight.to(float32) (bf16 and fp16 only), kept by weight * (.)", weight[0],
            Kind.FP32, weight[1], "the gradient of the normalised input is dY * w, here the fp32 copy", paper=False),
        normed_fp32=SavedTensor(f"{stem}normed_fp32", f"{by}: (x - mean) * rsqrt(.) in fp32, kept by weight * (.)",
                                shape, Kind.FP32, region, _WHY_NORMED_FP32))


# Cohere's one norm (its output q, k, v, gate and up all read), and use_qk_norm's per-head q_norm and k_norm.
COHERE_LN1 = _cohere_norm("ln1", "input_layernorm")
COHERE_Q_NORM = _cohere_norm("attention/q_norm_", "q_norm, each query head", Dim.D, heads=Dim.A)
COHERE_K_NORM = _cohere_norm("attention/k_norm_", "k_norm, each key head", Dim.D, heads=Dim.G)


def _kept_at(norm: Any, knobs: Any) -> Iterable[SavedTensor]:
    """A norm's tensors at this dtype: under fp32 a CohereLayerNorm's weight.to(float32) is the parameter, no copy."""
    copy = getattr(norm, "weight_fp32", None) if knobs.dtype == "fp32" else None
    return norm if copy is None else tuple(x for x in norm if x is not copy)


# OLMo 2's only norms: on the attention's output and on the MLP's, before each residual add (post_norm).
OLMO2_ATTN_OUT = _olmo2_norm("ln_attn_out", "OLMo 2's post_attention_layernorm, on the attention's output")
OLMO2_MLP_OUT = _olmo2_norm("ln_mlp_out", "OLMo 2's post_feedforward_layernorm, on the MLP's output")
# Olmo2Attention's q_norm and k_norm: Olmo2RMSNorm over q_proj's and k_proj's whole outputs, before the heads' view.
OLMO2_Q_NORM = _olmo2_norm("attention/q_norm_whole_", "q_norm, over q_proj's a*d channels", (Dim.A, Dim.D))
OLMO2_K_NORM = _olmo2_norm("attention/k_norm_whole_", "k_norm, over k_proj's g*d channels", (Dim.G, Dim.D))
OLMO_LN1 = _olmo_norm("ln1", "input_layernorm")
OLMO_LN2 = _olmo_norm("ln2", "post_attention_layernorm")
GEMMA_LN1 = _gemma_norm("ln1", "input_layernorm")
GEMMA_Q_NORM = _gemma_norm("attention/q_norm_", "Gemma 3's q_norm, each query head", Dim.D, heads=Dim.A)
GEMMA_K_NORM = _gemma_norm("attention/k_norm_", "Gemma 3's k_norm, each key head", Dim.D, heads=Dim.G)
GEMMA_LN2 = _gemma_norm("ln2", "the norm before the MLP: post_attention_layernorm, Gemma 2's pre_feedforward_layernorm")
# Gemma 2's sandwich norms: GemmaRMSNorm's code on the attention's output and on the MLP's output.
GEMMA_POST_ATTN = _gemma_norm("ln_post_attn", "Gemma 2's post_attention_layernorm, on the attention's output")
GEMMA_POST_MLP = _gemma_norm("ln_post_mlp", "Gemma 2's post_feedforward_layernorm, on the MLP's output")
SOFTCAP_TANH = in_pair("attention/softcap_tanh", "eager_attention_forward (softcap): torch.tanh(scores / softcap)",
                       BASS, "tanh's derivative, 1 - tanh^2, is read from its output")
# GemmaMLP: gelu_pytorch_tanh(gate_proj(x)) * up_proj(x), torch's tanh GELU kernel keeping its input.
GEGLU_GATE = replace(ledger.SWIGLU_GATE, name="mlp/geglu_gate", saved_by="gelu_pytorch_tanh (torch's tanh GELU kernel)",
                     why="GELU's derivative is evaluated at its input, the gate projection")
GEGLU_UP = replace(ledger.SWIGLU_UP, name="mlp/geglu_up", saved_by="GELU(gate) * up",
                   why="the gradient of GELU(gate) in the product is dY * up")
GEGLU_GELU_OUT = replace(ledger.SWIGLU_SILU_OUT, name="mlp/gelu_out", saved_by="GELU(gate) * up",
                         why="the gradient of up in the product is dY * GELU(gate)")
# The gated MLPs' gate (the activation's input), up and activation output, by memcalc's mlp: LlamaMLP's, GemmaMLP's.
GATED = {"swiglu": (ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT),
         "geglu_tanh": (GEGLU_GATE, GEGLU_UP, GEGLU_GELU_OUT)}
LN1_RMS = _rms_norm("ln1", "input_layernorm")
LN2_RMS = _rms_norm("ln2", "post_attention_layernorm")


def tables_cast(knobs: Any, layer_inputs_cast: bool) -> bool:
    """Whether each layer keeps its own copy of the model's fp32 RoPE tables (OLMo's), cast to the activation dtype
    by FSDP2's mixed precision (`layer_inputs_cast`: dp_shard set), not the model's one fp32 pair."""
    return layer_inputs_cast and knobs.dtype != "fp32" and rope_tables(knobs) == (OLMO_ROPE_COS, OLMO_ROPE_SIN)


# Qwen3Attention (qk_layernorm): Qwen3RMSNorm, LlamaRMSNorm's code, on q_proj(x) and k_proj(x) viewed as (b, s, heads,
# d), before RoPE; its output, transposed, goes on to RoPE and the core.
Q_NORM_RMS = _rms_norm("attention/q_norm_", "Qwen3RMSNorm q_norm, each query head", Dim.D, heads=Dim.A)
K_NORM_RMS = _rms_norm("attention/k_norm_", "Qwen3RMSNorm k_norm, each key head", Dim.D, heads=Dim.G)
# The q_norm and k_norm of a layer with qk_layernorm by memcalc's norm: Qwen3's (LlamaRMSNorm's code, Qwen3's where the
# norm has none of its own), Gemma 3's, OLMo 2's over whole projections, Cohere's per-head CohereLayerNorms.
QK_NORMS = {"rmsnorm": (Q_NORM_RMS, K_NORM_RMS), "rmsnorm_1p": (GEMMA_Q_NORM, GEMMA_K_NORM),
            "rmsnorm_fp32w": (OLMO2_Q_NORM, OLMO2_K_NORM), "layernorm_nb": (COHERE_Q_NORM, COHERE_K_NORM)}

# DeepseekV3Attention (models/deepseek_v3, DeepSeek-V2/V3's MLA): its latent norms are LlamaRMSNorm's code
# (DeepseekV3RMSNorm), each followed by an up projection that keeps the norm's output; RoPE runs on the query's
# and the shared key's RoPE parts with the model's (s, d_r) tables, kept once (the key needs no copy of its own).
MLA_Q_RMS = _rms_norm("mla/q_norm_", "DeepseekV3RMSNorm q_a_layernorm", Dim.QR)
MLA_KV_RMS = _rms_norm("mla/kv_norm_", "DeepseekV3RMSNorm kv_a_layernorm", Dim.KVR)
# In fp32 the kv norm's .to(float32) is a no-op on kv_nope, torch.split(kv_a_proj_with_mqa(x))[0]: the norm keeps
# that view, and with it the projection's whole output (found by tests/probe/test_differential.py).
MLA_KV_NORM_VIEW = replace(
    MLA_KV_RMS.input_fp32, saved_by="DeepseekV3RMSNorm kv_a_layernorm in fp32: its input, a view of"
    " kv_a_proj_with_mqa's output (.to(float32) is a no-op)", shape=(Dim.B, Dim.S, Dim.KVD),
    why="pow(2) and x * rsqrt(.) read the input, a view that keeps the whole output (the latent and the keys' RoPE"
    " part) alive")


def _tables(name: str, width: Dim, cos: tuple[str, str], sin: tuple[str, str],
            stage: str = "model") -> tuple[SavedTensor, ...]:
    """RoPE's (s, width) cos and sin tables, `name` formatted with "cos" and "sin", each with its (saved_by, why)."""
    return tuple(SavedTensor(name.format(table), by, (Dim.S, width), Kind.ACTIVATION, _SEQ, why, paper=False,
                             stage=stage) for table, (by, why) in (("cos", cos), ("sin", sin)))


_WHY_SIN_ROT = "the gradient of rotate_half(q_rot) in rotate_half(q_rot) * sin is dY * sin"


MLA_ROPE_COS, MLA_ROPE_SIN = _tables(
    "mla/rope_{}", Dim.DR, ("apply_rotary_pos_emb(_interleave): q_rot * cos and k_rot * cos", "the gradient of x in"
                            " x * cos is dY * cos (one (1, s, d_r) table from the model's rotary embedding; cos needs"
                            " no gradient, so x is not kept)"),
    ("apply_rotary_pos_emb(_interleave): rotate_half(x) * sin",
     "the gradient of rotate_half(x) in rotate_half(x) * sin is dY * sin"))

# GPTNeoXAttention (and Phi3Attention, partial_rotary_factor < 1): RoPE on the first d_r = d * rotary_pct channels of
# each query and key head (q[..., :d_r] * cos, rotate_half(.) * sin, then concatenated with the rest): the model's
# (1, s, d_r) tables, which every layer keeps. Starcoder2Attention's are whole heads' (rotary_percent 1: d_r = d).
NEOX_ROPE_COS, NEOX_ROPE_SIN = _tables(
    "attention/rope_{}_partial", Dim.DR,
    ("apply_rotary_pos_emb (GPT-NeoX, Phi-3, StarCoder 2): q_rot * cos and k_rot * cos",
     "the gradient of q_rot in q_rot * cos is dY * cos (the (1, s, d_r) table)"),
    ("apply_rotary_pos_emb (GPT-NeoX, Phi-3, StarCoder 2): rotate_half(q_rot) * sin", _WHY_SIN_ROT))
# GPT-NeoX's V is a view of query_key_value's (b, s, a, 3d) output, Phi-3's of qkv_proj's (b, s, (a+2g)d); at b = 1
# eager matmul folds it into a bmm batch without a copy and keeps that whole storage (see REPEAT_KV): Q, K and V's
# heads side by side.
NEOX_QKV_OUT = in_pair("attention/qkv_out", "GPT-NeoX's and Phi-3's eager at b = 1: matmul(weights, v) keeps the fused"
                       " query_key_value (qkv_proj) output, of which v is a view", (Dim.B, Dim.S, Dim.QKV, Dim.D),
                       "the gradient of the attention weights is dOut V^T: V is read from the fused output it views")
# GLM's apply_rotary_pos_emb interleaves the model's (1, s, d_r) tables (cos[..., :d_r/2].repeat_interleave(2)): the
# new (s, d_r) tables are what q_rot * cos and rotate_half(q_rot) * sin keep, once per layer.
GLM_ROPE_COS, GLM_ROPE_SIN = _tables(
    "attention/rope_{}_interleaved", Dim.DR,
    ("GLM apply_rotary_pos_emb: cos[..., :d_r/2].repeat_interleave(2), kept by q_rot * cos",
     "the gradient of q_rot in q_rot * cos is dY * cos (the interleaved table, a tensor of its own)"),
    ("GLM apply_rotary_pos_emb: sin[..., :d_r/2].repeat_interleave(2), kept by rotate_half(q_rot) * sin", _WHY_SIN_ROT),
    stage="layer")
# torch's flash kernel lays its output out as the query is laid out (CPU: measured; CUDA's mha_fwd: empty_like(q), read
# from code). Llama's query is a view of q_proj's (b, s, a, d) output, so o_proj reads the output itself; GLM's is the
# contiguous (b, a, s, d) torch.cat of its rotated and passed channels, so transformers' transpose(1, 2).contiguous()
# copies the output for o_proj, and the kernel keeps the output of its own.
GLM_SDPA_OUT = in_pair("attention/sdpa_out_bhsd",
                       "SDPA flash kernel: its output, laid out as GLM's contiguous (b, a, s, d) query", BASD,
                       "flash attention's backward reads its output (for the softmax's gradient)")
# FalconAttention under multi_query picks its one key and one value head by a list index (fused_qkv[..., [-2], :]),
# under new_decoder_architecture each group's (qkv[:, :, :, [-2]]): indexing keeps the index, a one-element int64
# tensor, for its backward.
FALCON_K_INDEX = SavedTensor(
    "attention/mqa_key_index", "FalconAttention._split_heads (multi_query): fused_qkv[..., [-2], :]'s index", (),
    Kind.INT64, Region.REPLICATED, "indexing's backward scatters the key's gradient back at the index", paper=False)
FALCON_V_INDEX = replace(FALCON_K_INDEX, name="attention/mqa_value_index",
                         saved_by="FalconAttention._split_heads (multi_query): fused_qkv[..., [-1], :]'s index",
                         why="indexing's backward scatters the value's gradient back at the index")
# FalconAttention under new_decoder_architecture (fused_qkv) broadcasts each group's key and value to its a/g heads and
# flattens them: a copy at every head (a view only with one group, or one head a group). RoPE's product is K at every
# head whatever g is, and QK^T keeps it; SDPA keeps V as passed: the flattened copy at a heads, or with one group the
# (b, s, 1, 1, d) index's output it views with stride 0 (the ledger's V at g = 1).
FALCON_K_HEADS = in_pair("attention/k_broadcast", "apply_rotary_pos_emb (new_decoder_architecture): K broadcast to"
                         " every head, rotated; kept by QK^T (eager) or SDPA", BASD,
                         "the gradient of Q in QK^T is dScores K")
FALCON_V_HEADS = in_pair("attention/v_broadcast", "FalconAttention._split_heads (new_decoder_architecture): V broadcast"
                         " to every head of its group and flattened, a copy; kept by SDPA", BASD,
                         "the gradient of the attention weights is dOut V^T")
# GLM-4's sandwich norms: LlamaRMSNorm's code (Glm4RMSNorm) on the attention's output and on the MLP's output.
GLM_POST_ATTN = _rms_norm("ln_post_attn_rms", "GLM-4's post_self_attn_layernorm, on the attention's output")
GLM_POST_MLP = _rms_norm("ln_post_mlp_rms", "GLM-4's post_mlp_layernorm, on the MLP's output")
# GPTJAttention: apply_rotary_pos_emb repeats the model's (1, s, d_r/2) sin and cos tables to d_r interleaved channels
# (repeat_interleave) on each call, once for the keys and once for the queries: four (s, d_r) copies, each kept by
# its product. Its eager core upcasts Q and K to fp32 before QK^T, so matmul keeps fp32 ones.
GPTJ_ROPE = tuple(
    SavedTensor(f"attention/rope_{which[0]}_{table}", f"GPT-J apply_rotary_pos_emb ({which}): repeat_interleave(.),"
                f" kept by {product}", (Dim.S, Dim.DR), Kind.ACTIVATION, _SEQ, f"the gradient of the rotated channels"
                f" in {product} is dY times the table, this call's own interleaved copy", paper=False)
    for which in ("keys", "queries")
    for table, product in (("sin", f"rotate_every_two({which[0]}_rot) * sin"), ("cos", f"{which[0]}_rot * cos")))
GPTJ_Q = replace(ledger.Q, name="attention/q_fp32", kind=Kind.FP32,
                 saved_by="GPT-J eager_attention_forward: query.to(float32), kept by matmul")
GPTJ_K = replace(ledger.K, name="attention/k_fp32", kind=Kind.FP32,
                 saved_by="GPT-J eager_attention_forward: key.to(float32).transpose(2, 3), kept by matmul")
ROPE_COS, ROPE_SIN = _tables(
    "attention/rope_{}", Dim.D, ("apply_rotary_pos_emb: q * cos and k * cos", "the gradient of q in q * cos is dY *"
                                 " cos (one (1, s, d) table from the model's rotary embedding)"),
    ("apply_rotary_pos_emb: rotate_half(q) * sin",
     "the gradient of rotate_half(q) in rotate_half(q) * sin is dY * sin"))
# OlmoRotaryEmbedding returns fp32 tables (no cast to x's dtype), so q * cos runs in fp32 and keeps them fp32;
# apply_rotary_pos_emb casts q and k back after.
OLMO_ROPE_COS = replace(ROPE_COS, name="attention/rope_cos_fp32", kind=Kind.FP32,
                        saved_by="OLMo apply_rotary_pos_emb: q * cos, cos fp32 (OlmoRotaryEmbedding casts nothing)")
OLMO_ROPE_SIN = replace(ROPE_SIN, name="attention/rope_sin_fp32", kind=Kind.FP32,
                        saved_by="OLMo apply_rotary_pos_emb: rotate_half(q) * sin, sin fp32")
# Under FSDP2's mixed precision every sharded decoder layer is called with those fp32 tables cast to the activation
# dtype (MixedPrecisionPolicy casts a layer's floating inputs): each layer's products keep a copy of its own.
OLMO_ROPE_CAST = tuple(
    replace(x, name=f"attention/rope_{table}_cast", stage="layer", saved_by=f"OLMo apply_rotary_pos_emb: {product},"
            f" {table}: the layer's own copy, cast by FSDP2's mixed precision")
    for x, table, product in ((ROPE_COS, "cos", "q * cos"), (ROPE_SIN, "sin", "rotate_half(q) * sin")))
K_EXPANDED = in_pair("attention/k_expanded", "repeat_kv, kept by matmul(q, k^T)", BASD,
                     "eager attention copies each K group to its a/g heads; QK^T's backward reads the copy")
V_EXPANDED = in_pair("attention/v_expanded", "repeat_kv, kept by matmul(weights, v)", BASD,
                     "eager attention copies each V group to its a/g heads; the weights' gradient reads the copy")
SOFTMAX_FP32 = SavedTensor(
    "attention/softmax_fp32", "eager_attention_forward: softmax(dtype=float32)", BASS, Kind.FP32, _TEN,
    "softmax backward needs its output, here the fp32 one")
WEIGHTS = in_pair("attention/weights",
                  "eager_attention_forward: softmax output .to(query.dtype), kept by matmul(weights, v)", BASS,
                  "the gradient of V is weights^T dOut")
# torch's CPU math kernel (aten _scaled_dot_product_attention_math), run when dropout > 0 on a CPU: all of it fp32


def _math(name: str, saved_by: str, shape: Shape, why: str) -> SavedTensor:
    return SavedTensor(f"attention/math_{name}_fp32", f"SDPA math kernel (CPU, dropout > 0): {saved_by}", shape,
                       Kind.FP32, _TEN, why)


SDPA_MATH = MATH_Q, MATH_K, MATH_SOFTMAX, MATH_DROPOUT_MASK, MATH_DROPOUT_OUT, MATH_V = (
    _math("q", "q * sqrt(scale) in fp32, kept by matmul", BASD, "the gradient of K in QK^T is dScores^T Q"),
    _math("k", "k^T * sqrt(scale) in fp32 (a heads under GQA), kept by matmul", BASD,
          "the gradient of Q in QK^T is dScores K"),
    _math("softmax", "_safe_softmax", BASS, "softmax backward needs its output"),
    _math("dropout_mask", "at::dropout's scaled fp32 mask", BASS, ledger.WHY_DROPOUT_MASK),
    _math("dropout_out", "dropped-out weights, kept by matmul", BASS,
          "the gradient of V is (dropped-out weights)^T dOut"),
    _math("v", "v in fp32 (a heads under GQA), kept by matmul", BASD,
          "the gradient of the attention weights is dOut V^T"),
)

# GPT-2 in fp32: v's cast is a no-op, so bmm takes v as a (b, a, s, d) view of c_attn's (b, s, 3h) output; the batch's
# reshape to (b * a, s, d) copies it, except where b = 1 or one head lets it stand as a view: then bmm keeps c_attn's
# whole output, Q's, K's and V's columns (found by the differential test).
GPT2_MATH_V = replace(MATH_V, name="attention/math_v", saved_by="SDPA math kernel (CPU, dropout > 0) in fp32: v, its"
                      " cast a no-op, copied by the batch's reshape, kept by matmul")
GPT2_VIEWED_V = SizeCondition(
    GPT2_MATH_V, "GPT-2 in fp32, SDPA's CPU math kernel: at b = 1 or one head the batch's reshape leaves v a view of"
    " c_attn's output, and matmul keeps that whole output (q, k and v side by side)",
    kept=lambda sizes, t: (sizes[Dim.B] != 1) & (sizes[Dim.A] // t != 1), instead=(ledger.Q, ledger.K, ledger.V))

FLASH_DROPOUT_LSE = replace(
    ledger.SOFTMAX_LSE,
    saved_by="SDPA flash kernel with dropout on CUDA: same as without, the mask is regenerated from its RNG state"
    " (read from torch's code, aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp: mha_fwd; not measured)")

# Where the tp plan gathers the attention (OLMo 2's), o_proj's input is a split copy of the attention's output
# (rowwise_split_input), so the flash kernel's own saved output is a storage of its own, every head's.
SDPA_OUT = in_pair("attention/sdpa_out", "SDPA flash kernel: its output, which o_proj's input (rowwise_split_input"
                   " under tp) no longer shares", BASD,
                   "flash attention's backward reads its output (the rows' dO . O sums)")
# At t = 1 the plan lays out nothing: o_proj's input is the flash kernel's output, one storage.
SPLIT_PROJ_INPUT = SizeCondition(
    SDPA_OUT, "only under tp (t > 1) does transformers' rowwise_split_input copy o_proj's input out of the flash"
    " kernel's output; at t = 1 they are one storage", kept=lambda sizes, t: t != 1)

TANH_OUT = in_pair("mlp/tanh_out", "NewGELUActivation (gelu_new): torch.tanh", BSF,
                   "tanh's derivative, 1 - tanh^2, is read from its output")
HALF_X = in_pair("mlp/half_x", "NewGELUActivation (gelu_new): 0.5 * x, kept by the final product", BSF,
                 "the gradient of (1 + tanh(.)) in 0.5x * (1 + tanh(.)) is dY * 0.5x")
ONE_PLUS_TANH = in_pair("mlp/one_plus_tanh", "NewGELUActivation (gelu_new): 1 + tanh(.), kept by the final product",
                        BSF, "the gradient of 0.5x in 0.5x * (1 + tanh(.)) is dY * (1 + tanh(.))")


# MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock, their routers and both experts_implementation paths:
# docs/impl-notes/hf.md.
_MIXTRAL = "MixtralTopKRouter"
_EXPERTS = "MixtralExperts (eager loop)"
_GROUPED = "MixtralExperts (grouped_mm)"
_BOTH = "MixtralExperts (eager loop and grouped_mm)"


def _per_slot(name: str, saved_by: str, kind: Kind, why: str) -> SavedTensor:
    """One small value for each of the r routed (token, expert) slots, on the experts' ranks."""
    return ledger.small_moe(name, saved_by, (Dim.R,), kind, why, Region.EXPERT)


ROUTER_PROBS = SavedTensor(
    "moe/router_probs_fp32", f"{_MIXTRAL}: softmax(router_logits.float())", (Dim.B, Dim.S, Dim.E), Kind.FP32, _SEQ,
    "softmax backward needs its output; top-k reads the probabilities of the chosen experts from it")
_DEEPSEEK = "DeepseekV3TopkRouter"
_NORM_TOPK = f"{_MIXTRAL} (and {_DEEPSEEK}, norm_topk_prob): top-k values /= their sum"
TOPK_SUM = ledger.small_moe("topk_sum_fp32", _NORM_TOPK, (Dim.B, Dim.S), Kind.FP32,
                            "the in-place division's backward reads its divisor")
TOPK_WEIGHTS = ledger.small_moe("topk_weights_fp32", _NORM_TOPK, (Dim.B, Dim.S, Dim.K), Kind.FP32,
                                "the division's gradient for the divisor reads the normalised weights")
# DeepseekV3TopkRouter (DeepSeek-V3's noaux_tc): fp32 logits from an fp32 copy of the input (its weight is kept fp32,
# _keep_in_fp32_modules_strict), each expert's sigmoid; the e_score_correction_bias picks the experts among the
# topk_group best of n_group groups, and the chosen scores are gathered, renormalised and scaled. The group choice's
# top-ks and mask are saved by ops whose values nobody reads: freed when the router returns, never kept.
ROUTER_IN_FP32 = SavedTensor(
    "moe/router_in_fp32", f"{_DEEPSEEK}: hidden_states.type(float32), kept by F.linear", BSH,
    Kind.FP32, _SEQ, "the router's weight gradient dW = dLogits^T X reads its fp32 input")
ROUTER_SCORES = SavedTensor(
    "moe/router_scores_fp32", f"{_DEEPSEEK}: router_logits.sigmoid()", (Dim.B, Dim.S, Dim.E), Kind.FP32, _SEQ,
    "sigmoid's derivative is read from its output, every expert's score (gather reads the chosen ones' from it)")
TOKEN_SLOTS = _per_slot("token_slots", f"{_EXPERTS}: torch.where(expert_mask[e]), kept by indexing and index_add_",
                        Kind.INDEX_PAIR, "each expert's (token, top-k slot) pairs route the gradient back to the rows"
                        " it gathered")
EXPERT_WEIGHT = _per_slot("expert_weight_fp32", f"{_BOTH}: expert output * its slot's routing weight", Kind.FP32,
                          "the gradient of the expert's output in the product is dY * weight")
EXPERT_WEIGHT_CAST = replace(
    EXPERT_WEIGHT, name="moe/expert_weight", kind=Kind.ACTIVATION,
    saved_by="Qwen2MoeExperts (eager loop and grouped_mm): expert output * its slot's routing weight, cast to the"
    " activation dtype")
EXPERT_OUT = SavedTensor(
    "moe/expert_out", f"{_BOTH}: expert output * its slot's routing weight", (Dim.R, Dim.H), Kind.ACTIVATION,
    Region.EXPERT, "the routing weight's gradient is sum(dY * expert output)")
# grouped_mm: three int64 (r,) permutations of the slots and the experts' int32 offsets, in place of the eager loop's
# (token, slot) pairs and index_add_'s source (its weighted rows, fp32 in Mixtral's block, are gathered back in slot
# order and summed over k: indexing and sum keep no values).
TOKEN_INDICES = _per_slot("token_indices", f"{_GROUPED}: perm // k, each sorted slot's token, kept by"
                          " hidden_states[perm // k]", Kind.INT64,
                          "indexing's backward puts the sorted rows' gradient back at their tokens")
SORTED_SLOTS = _per_slot("sorted_slots", f"{_GROUPED}: torch.sort(expert_ids)'s permutation, kept by"
                         " sample_weights[perm]", Kind.INT64,
                         "indexing's backward scatters the sorted weights' gradient back to their slots")
UNSORTED_SLOTS = _per_slot("unsorted_slots", f"{_GROUPED}: inv_perm, the permutation's inverse, kept by"
                           " weighted_out[inv_perm]", Kind.INT64,
                           "indexing's backward puts each slot's gradient back in expert order")
EXPERT_OFFSETS = ledger.small_moe(
    "expert_offsets", f"{_GROUPED}: cumsum of histc's slots per expert, int32, kept by both torch._grouped_mm",
    (Dim.E,), Kind.INT32, "a grouped matmul's backward cuts dY at the same expert boundaries", Region.REPLICATED)
COMBINE_IN = SavedTensor(
    "moe/combine_in", f"{_EXPERTS}: final_hidden_states.index_add_(token_idx, weighted output)", (Dim.R, Dim.H),
    Kind.ACTIVATION, Region.EXPERT, "index_add_'s derivative keeps its source (expand_as(source))")
SHARED_GATE_SIGMOID = ledger.small_moe(
    "shared_gate_sigmoid", "Qwen2MoeSparseMoeBlock: sigmoid(shared_expert_gate(x))", (Dim.B, Dim.S),
    Kind.ACTIVATION, "sigmoid's derivative and the product's gradient read the gate's value")
SHARED_OUT = SavedTensor(
    "moe/shared_out", "Qwen2MoeSparseMoeBlock: sigmoid(gate) * shared_expert(x)", BSH, Kind.ACTIVATION, _SEQ,
    "the gate's gradient is sum(dY * shared expert output)")
# GptOssDecoderLayer (models/gpt_oss), op by op: docs/impl-notes/hf.md.
GPT_OSS_LN1 = _olmo2_norm("ln1", "gpt-oss's GptOssRMSNorm input_layernorm")
GPT_OSS_LN2 = _olmo2_norm("ln2", "gpt-oss's GptOssRMSNorm post_attention_layernorm")
HALF_ROPE_COS, HALF_ROPE_SIN = _tables(
    "attention/rope_{}_half", Dim.HALF_D,
    ("gpt-oss _apply_rotary_emb: first_half * cos and second_half * cos",
     "the gradient of each half in half * cos is dY * cos (the model's (1, s, d/2) table)"),
    ("gpt-oss _apply_rotary_emb: second_half * sin and first_half * sin", "the gradient of each half in half * sin is"
     " dY * sin"))
SINK_MAX_INDICES = SavedTensor(
    "attention/sink_max_indices", "gpt-oss eager_attention_forward: combined_logits.max(dim=-1, keepdim=True)",
    (Dim.B, Dim.A, Dim.S), Kind.INT64, _TEN, "max's backward puts each row maximum's gradient back at its index",
    paper=False)
SINK_SOFTMAX = in_pair("attention/sink_softmax", "gpt-oss eager_attention_forward: softmax over the scores and the sink"
                       " column, in the activation dtype; matmul(weights, v) keeps probs[..., :-1], a view of it",
                       (Dim.B, Dim.A, Dim.S, Dim.S1),
                       "softmax backward needs its output; the gradient of V reads the same storage")
ROUTER_TOPK_SOFTMAX = ledger.small_moe(
    "router_topk_softmax", "gpt-oss GptOssTopKRouter: softmax(router_top_value), in the activation dtype",
    (Dim.B, Dim.S, Dim.K), Kind.ACTIVATION, "softmax backward needs its output")
SORTED_EXPERT_IDS = _per_slot("sorted_expert_ids", "gpt-oss experts (grouped_mm): torch.sort's expert ids, kept by"
                              " gate_up_proj_bias[ids] and down_proj_bias[ids]", Kind.INT64,
                              "indexing's backward scatters each slot's bias gradient back to its expert")
_GLU = "gpt-oss GptOssExperts._apply_gate"
GLU_GATE_IN = replace(
    ledger.EXPERT_GATE, name="moe/glu_gate_in", saved_by=f"{_GLU}: gate_up[..., ::2], kept by gate.clamp(max=limit)",
    why="clamp's gradient passes where its input lay within the bound: it reads the input, a view of gate_up's output")
GLU_UP_IN = replace(
    ledger.EXPERT_UP, name="moe/glu_up_in", saved_by=f"{_GLU}: gate_up[..., 1::2], kept by up.clamp(-limit, limit)",
    why="clamp's gradient passes where its input lay within the bounds: it reads the input, a view of gate_up's output")


def _glu_term(name: str, saved_by: str, why: str) -> SavedTensor:
    return SavedTensor(f"moe/{name}", f"{_GLU}: {saved_by}", (Dim.R, Dim.FE), Kind.ACTIVATION, Region.EXPERT, why)


GLU_GATE = _glu_term("glu_gate_clamped", "gate.clamp(max=limit), kept by gate * sigmoid(.)",
                     "the gradient of sigmoid(.) in the product is dY * gate")
GLU_SIGMOID = _glu_term("glu_sigmoid", "torch.sigmoid(gate * alpha), kept by sigmoid and by gate * sigmoid(.)",
                        "sigmoid's derivative is read from its output, and the gate's gradient in the product is"
                        " dY * sigmoid(.)")
GLU_UP_PLUS_ONE = _glu_term("glu_up_plus_one", "up + 1, kept by (up + 1) * glu",
                            "the gradient of glu in the product is dY * (up + 1)")
GLU_OUT = _glu_term("glu_out", "gate * sigmoid(gate * alpha), kept by (up + 1) * glu",
                    "the gradient of up + 1 in the product is dY * glu")
CLAMPED_GLU = (GLU_GATE_IN, GLU_UP_IN, GLU_GATE, GLU_SIGMOID, GLU_UP_PLUS_ONE, GLU_OUT)
GPT_OSS_TENSORS = (*GPT_OSS_LN1, *GPT_OSS_LN2, HALF_ROPE_COS, HALF_ROPE_SIN, SINK_MAX_INDICES, SINK_SOFTMAX,
                   ROUTER_TOPK_SOFTMAX, SORTED_EXPERT_IDS, *CLAMPED_GLU)
MOE_TENSORS = (ROUTER_PROBS, TOPK_SUM, TOPK_WEIGHTS, ROUTER_IN_FP32, ROUTER_SCORES, TOKEN_SLOTS, EXPERT_WEIGHT,
               EXPERT_WEIGHT_CAST, EXPERT_OUT, COMBINE_IN, TOKEN_INDICES, SORTED_SLOTS, UNSORTED_SLOTS, EXPERT_OFFSETS,
               SHARED_GATE_SIGMOID, SHARED_OUT)


def is_llama(knobs: Any) -> bool:
    """RMSNorm + a gated MLP is the Llama family (Llama, Mistral, Qwen2, Gemma's (1 + w) RMSNorm and GeGLU);
    LayerNorm + GELU is GPT-2 or GPT-NeoX."""
    return knobs.norm in ("rmsnorm", "rmsnorm_1p", "layernorm_np", "rmsnorm_fp32w", "layernorm_nb")


def _family_is(*names: str) -> Callable[[Any], bool]:
    """Whether the config's family (memcalc.model.families.layer_family) is one of these: its layer."""
    return lambda knobs: layer_family(knobs).name in names


is_cohere = _family_is("cohere")  # CohereDecoderLayer: Llama's attention and SwiGLU side by side on one norm
is_glm = _family_is("glm", "glm4")  # GlmDecoderLayer (Glm4DecoderLayer: sandwich norms): a share of each head rotated
is_neox = _family_is("gpt_neox")  # GPTNeoXLayer: a LayerNorm layer, partial RoPE, Q, K, V views of query_key_value
is_gpt2 = _family_is("gpt2")  # GPT2Block: no RoPE (its learned positions live in the embedding), in sequence
is_phi3 = _family_is("phi3")  # Phi3DecoderLayer: an RMSNorm layer whose q, k and v are one qkv_proj
is_starcoder2 = _family_is("starcoder2")  # Starcoder2DecoderLayer: LayerNorm, whole heads rotated, q, k, v apart
is_gptj = _family_is("gptj")  # GPTJBlock: one LayerNorm read by the attention and the MLP side by side
is_gpt_oss = _family_is("gpt_oss")  # GptOssDecoderLayer: attention sinks, the clamped GLU in its experts
# FalconDecoderLayer (parallel_attn, RoPE on whole heads): the attention and the MLP read its one input_layernorm's
# output (single_norm), or with new_decoder_architecture (fused_qkv) ln_attn's and ln_mlp's.
is_falcon = _family_is("falcon")


def is_falcon_grouped(knobs: Any) -> bool:
    """FalconDecoderLayer with new_decoder_architecture (Falcon-40B/180B): query_key_value laid out per K/V group
    (fused_qkv), K and V broadcast to every head before RoPE."""
    return is_falcon(knobs) and knobs.fused_qkv


def has_fused_v_view(knobs: Any) -> bool:
    """GPT-NeoX's V, Phi-3's and multi-head Falcon's (the first layout) is a strided view of the fused query_key_value
    (qkv_proj) output."""
    return is_neox(knobs) or is_phi3(knobs) or (is_falcon(knobs) and not knobs.gqa and not knobs.fused_qkv)


def resid_dropout(knobs: Any) -> bool:
    """Whether the attention's and the MLP's outputs are dropped out: GPT-2's, GPT-NeoX's and StarCoder 2's, and Phi-3's
    resid_attn_dropout and resid_mlp_dropout (Llama's layer drops out attention weights only)."""
    return knobs.has_dropout and (not is_llama(knobs) or knobs.fused_qkv)


# Gemma3TextModel makes a (cos, sin) pair for each kind of layer in layer_types (its rotary embedding's local base for
# sliding layers, the global one for full layers), each kept by the layers of its kind: under Gemma3TextConfig's
# default pattern every sixth layer is full, so six layers or more keep two pairs (measured at L = 5, 6 and 7).
GEMMA3_FULL_EVERY = 6  # Gemma3TextConfig's sliding_window_pattern


def rope_pairs(knobs: Any, layers: Any) -> Any:
    """The pairs of RoPE tables `layers` layers keep: one, or Gemma 3's two from its first full layer on."""
    gemma3 = knobs.sandwich_norm and knobs.qk_layernorm and knobs.norm == "rmsnorm_1p"
    return 1 + (layers >= GEMMA3_FULL_EVERY) if gemma3 else 1


def rope_tables(knobs: Any) -> tuple[SavedTensor, ...]:
    """The (s, d) cos and sin tables RoPE's products keep: OLMo's fp32, GLM's interleaved, the first d_r channels'
    (rotary_percent), a whole head's, or none (GPT-2's learned positions live in the embedding)."""
    if is_gptj(knobs):
        return GPTJ_ROPE
    if is_gpt_oss(knobs):
        return (HALF_ROPE_COS, HALF_ROPE_SIN)
    if knobs.norm in ("layernorm_np", "rmsnorm_fp32w"):  # OLMo's and OLMo 2's rotary embeddings cast nothing
        return (OLMO_ROPE_COS, OLMO_ROPE_SIN)
    if is_glm(knobs):
        return (GLM_ROPE_COS, GLM_ROPE_SIN)
    if knobs.rotary_percent is not None:
        return (NEOX_ROPE_COS, NEOX_ROPE_SIN)
    return (ROPE_COS, ROPE_SIN) if is_llama(knobs) or is_falcon(knobs) else ()


# The two norms of a Llama-shaped layer by memcalc's norm: LlamaRMSNorm, GemmaRMSNorm, OlmoLayerNorm and gpt-oss's
# GptOssRMSNorm (OLMo 2's rmsnorm_fp32w layer has post-norms only; Cohere's one norm is its own, see `norm_block`).
PRE_NORMS = {"rmsnorm": (LN1_RMS, LN2_RMS), "rmsnorm_1p": (GEMMA_LN1, GEMMA_LN2), "layernorm_np": (OLMO_LN1, OLMO_LN2),
             "rmsnorm_fp32w": (GPT_OSS_LN1, GPT_OSS_LN2)}


def norm_block(which: int, knobs: Any) -> tuple[SavedTensor, ...]:
    """LlamaRMSNorm's fp32 upcast, fp32 rstd and cast-back; GPT-2's nn.LayerNorm keeps input, mean, rstd. GPT-NeoX's
    parallel residual feeds both LayerNorms the layer's input: one storage, kept once (the first norm's). GPT-J's and
    Cohere's and Falcon's one norm (single_norm) is the first; Cohere's is CohereLayerNorm. Falcon-40B's ln_attn and
    ln_mlp read the layer's input as GPT-NeoX's two do."""
    if which == 1 and knobs.single_norm:  # GPT-J, Cohere, Falcon-7B: no second norm
        return ()
    if is_cohere(knobs):
        return tuple(_kept_at(COHERE_LN1, knobs))
    if is_llama(knobs):
        return tuple(PRE_NORMS.get(knobs.norm, PRE_NORMS["rmsnorm"])[which])
    if which == 1 and knobs.parallel_residual:
        return (ledger.LN2.mean, ledger.LN2.rstd)
    return tuple((ledger.LN1, ledger.LN2)[which])


def _sdpa(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """What `scaled_dot_product_attention` keeps; its output is the o_proj input (labelled there).

    Without dropout: torch's flash kernel, CPU and CUDA alike. With dropout the CPU
    runs the math kernel (measured); CUDA's flash kernel drops out inside (read from code).
    """
    out = (SDPA_OUT,) if attention_gathered(knobs) else ()
    if is_falcon_grouped(knobs):  # K and V at every head: see FALCON_V_HEADS (Falcon refuses dropout)
        v = FALCON_V_HEADS if knobs.gqa and knobs.num_query_groups > 1 else ledger.V
        return (ledger.Q, FALCON_K_HEADS, v, ledger.SOFTMAX_LSE)
    if not knobs.has_dropout:
        return (ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, *out)
    if accounting.device == "cpu":
        return (*SDPA_MATH[:-1], GPT2_MATH_V) if is_gpt2(knobs) and knobs.dtype == "fp32" else SDPA_MATH
    return (ledger.Q, ledger.K, ledger.V, FLASH_DROPOUT_LSE, *out)


def attention_gathered(knobs: Any) -> bool:
    """Whether the family's tp plan gathers the attention's projections (`Family.gathered`: Phi-3's, OLMo 2's)."""
    return "attention" in layer_family(knobs).gathered


def _eager(knobs: Any) -> tuple[SavedTensor, ...]:
    """eager_attention_forward: matmul's copies of Q and K^T, the softmax, dropout, matmul's copy of V."""
    # K and V as matmul keeps them: repeat_kv's copies to all a heads under GQA (but see REPEAT_KV)
    key_value = (K_EXPANDED, V_EXPANDED) if knobs.gqa else (ledger.K, ledger.V)
    q, k, v = (ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V) if knobs.mla else (ledger.Q, *key_value)
    if is_gptj(knobs):
        q, k = GPTJ_Q, GPTJ_K
    if is_falcon_grouped(knobs):  # RoPE's product is K at every head: no copy of matmul's own, whatever b and g
        k = FALCON_K_HEADS
    if is_gpt_oss(knobs):  # the sink column joined, the rows' maximum subtracted, softmax in the activation dtype
        softmax: tuple[SavedTensor, ...] = (SINK_MAX_INDICES, SINK_SOFTMAX)
    elif is_gpt2(knobs) or is_falcon(knobs):  # GPT-2's and Falcon's in the activation dtype: the paper's core
        softmax = (ledger.SOFTMAX_OUT,)
    elif knobs.dtype == "fp32" or knobs.has_dropout:  # no separate cast: .to() is a no-op or dropout keeps a mask
        softmax = (SOFTMAX_FP32,)
    else:
        softmax = (SOFTMAX_FP32, WEIGHTS)
    dropout = (ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT) if knobs.has_dropout else ()
    softcap = (SOFTCAP_TANH,) if scores_capped(knobs) else ()
    return (q, k, *softcap, *softmax, *dropout, v)


def scores_capped(knobs: Any) -> bool:
    """Whether eager attention soft-caps its scores: Gemma 2's passes attn_logit_softcapping as its softcap, Gemma 3's
    Gemma3Attention passes none (its config's value changes nothing; found by the hf step walk's measurement)."""
    return knobs.attn_logit_softcapping is not None and layer_family(knobs).name != "gemma3_text"


def repeat_kv_copies(sizes: dict[Any, Any], t: Any) -> Any:
    """Whether eager attention's matmuls keep copies of K and V at a/t heads: unless b = 1 and the rank holds one K/V
    group. Then repeat_kv's expand and reshape are views whose head dimension has stride 0, and matmul folds them into
    a bmm batch of stride 0 without a copy, so it keeps K and V themselves (b, 1, s, d). Numbers or arrays alike."""
    return (sizes[Dim.B] != 1) | (sizes[Dim.G] // t != 1)


def batched(sizes: dict[Any, Any], t: Any) -> Any:
    """Whether GPT-NeoX's (multi-head Falcon's, DeepSeek's) eager matmul copies V, a (b, a, s, d) view of a fused
    output: unless its b and a/t axes merge into a bmm batch as a view, which they do when either is 1 or s = 1 (then
    b's stride is a times a's; found for Falcon and DeepSeek by the differential test)."""
    return (sizes[Dim.B] != 1) & (sizes[Dim.A] // t != 1) & (sizes[Dim.S] != 1)


def fused_batched(sizes: dict[Any, Any], t: Any) -> Any:
    """Whether Phi-3's eager matmul copies V (multi-head), a (b, a, s, d) view of qkv_proj's (b, s, (a+2g)d) output:
    unless b = 1 or one head, since Q's and K's columns lie between a token's heads and the next token's, so b and
    the heads never merge into a bmm batch as a view otherwise. Its plan gathers the attention: every rank has a."""
    return (sizes[Dim.B] != 1) & (sizes[Dim.A] != 1)


def gathered_copies(sizes: dict[Any, Any], t: Any) -> Any:
    """repeat_kv's copies where the tp plan gathers the attention's projections (Phi-3's, OLMo 2's): unless b = 1 with
    one K/V group in the model, since every rank holds all g groups whatever t is."""
    return (sizes[Dim.B] != 1) | (sizes[Dim.G] != 1)


def _copies(knobs: Any) -> Any:
    """The size condition under which eager attention's matmuls keep copies of K and V, for this layer."""
    if not knobs.gqa:
        return fused_batched if is_phi3(knobs) else batched
    return gathered_copies if attention_gathered(knobs) else repeat_kv_copies


def _at_batch_of_one(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """What eager attention keeps where matmul folds a view without copying: K and V at g heads (GQA), the fused
    query_key_value (qkv_proj) output in V's place (GPT-NeoX, Phi-3: its V is a view of it)."""
    fused_v = NEOX_QKV_OUT if has_fused_v_view(knobs) else ledger.V
    swap = {V_EXPANDED.name: fused_v, K_EXPANDED.name: ledger.K} if knobs.gqa else {ledger.V.name: fused_v}
    return tuple(swap.get(x.name, x) for x in keeps(knobs, accounting))


REPEAT_KV = SizeRule(
    "eager attention under GQA keeps repeat_kv's copies of K and V at a/t heads, except when b = 1 and one K/V group"
    " is on the rank: expand and reshape are then views with a zero stride, and matmul keeps K and V themselves;"
    " GPT-NeoX's, multi-head Falcon's and Phi-3's keep a copy of V, a view of the fused query_key_value (qkv_proj)"
    " output, except when b = 1 (NeoX and Falcon: or one head, or one token; Phi-3 under GQA: and one K/V group): then"
    " they keep that whole output; multi-query Falcon's matmul broadcasts its one K/V head as repeat_kv expands it,"
    " and new_decoder_architecture's V is such a copy (its K, rotated at every head, is always whole). Where the tp"
    " plan gathers the attention's projections (Phi-3's, OLMo 2's) every rank holds all g groups, so one K/V group"
    " means g = 1",
    applies=lambda knobs: ((knobs.gqa or has_fused_v_view(knobs)) and knobs.attention == "eager"
                           and knobs.recompute != "full"),
    runs=repeat_kv_copies,
    outside=_at_batch_of_one,
    shown_with={"num_query_groups": 1},
    runs_for=_copies)


def latent_attention(knobs: Any) -> tuple[SavedTensor, ...]:
    """DeepseekV3Attention, eager: x (q_a_proj/q_proj and kv_a_proj_with_mqa read it), each latent's RMSNorm and
    up-projection input, the RoPE tables, the eager core over Q, K (d_n+d_r) and V (d_v), o_proj's input."""
    query = (*MLA_Q_RMS, ledger.MLA_Q_UP_IN) if knobs.q_lora_rank is not None else ()
    kv_norm = (MLA_KV_NORM_VIEW, MLA_KV_RMS.rstd, MLA_KV_RMS.normed) if knobs.dtype == "fp32" else MLA_KV_RMS
    latent = (*kv_norm, ledger.MLA_KV_UP_IN)
    return (ledger.QKV_IN, *query, *latent, MLA_ROPE_COS, MLA_ROPE_SIN, *_eager(knobs), ledger.MLA_PROJ_IN)


def attention_block(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Q/K/V projections' input, RoPE tables (Llama), the core, o_proj's input, GPT-2's resid dropout."""
    if knobs.mla:
        return latent_attention(knobs)
    q, k = QK_NORMS.get(knobs.norm, QK_NORMS["rmsnorm"]) if knobs.qk_layernorm else ((), ())
    qk_norm = (*_kept_at(q, knobs), *_kept_at(k, knobs))
    core = _sdpa(knobs, accounting) if knobs.attention == "flash" else _eager(knobs)
    if is_glm(knobs) and knobs.attention == "flash" and core != SDPA_MATH:
        core += (GLM_SDPA_OUT,)
    resid = (ledger.ATTN_OUT_DROPOUT_MASK,) if resid_dropout(knobs) else ()
    index = (FALCON_K_INDEX, FALCON_V_INDEX) if is_falcon(knobs) and (knobs.gqa or knobs.fused_qkv) else ()
    tables = OLMO_ROPE_CAST if tables_cast(knobs, accounting.layer_inputs_cast) else rope_tables(knobs)
    return (ledger.QKV_IN, *index, *qk_norm, *tables, *core, ledger.PROJ_IN, *resid)


def mlp_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """LlamaMLP (gate, up, SiLU(gate) * up) or GPT2MLP (c_fc, activation, c_proj, dropout)."""
    if knobs.mlp in GATED:
        activation: tuple[SavedTensor, ...] = GATED[knobs.mlp]
    elif knobs.mlp == "gelu_tanh" and not knobs.alibi:  # gelu_new; BLOOM's GeLUFunction keeps its input alone
        activation = (ledger.GELU_IN, HALF_X, TANH_OUT, ONE_PLUS_TANH)
    else:
        activation = (ledger.GELU_IN,)
    dropout = (ledger.MLP_DROPOUT_MASK,) if resid_dropout(knobs) else ()
    fc1_in = () if knobs.single_norm else (ledger.FC1_IN,)  # the attention's input, one storage
    return (*fc1_in, *activation, ledger.FC2_IN, *dropout)


SHARED_MLP = (ledger.SHARED_GATE, ledger.SHARED_UP, ledger.SHARED_SILU_OUT, ledger.SHARED_FC2_IN)  # its SwiGLU


def routing_weights_kind(knobs: Any) -> Kind:
    """The width of the top-k routing weights the experts take: Qwen2-MoE's and Qwen3-MoE's routers (known by their
    shared experts or QK norm) cast them to the activation dtype, Mixtral's and DeepSeek's keep the softmax's fp32."""
    qwen = bool(knobs.moe_shared_expert_intermediate_size or knobs.qk_layernorm) and not knobs.mla
    return Kind.ACTIVATION if qwen else Kind.FP32


def moe_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """The sparse MoE block: the fp32 router, each expert's SwiGLU on its slots, the weighted combine, shared experts.

    One (r, 2e) storage holds each expert's gate and up (`gate_up_proj`, chunked): the ledger's two rows, half
    its bytes each, as Megatron's fc1 output. With latent attention the block is DeepseekV3MoE (a sigmoid router,
    Mixtral's experts, an ungated shared MLP that keeps the block's input); else shared experts mean Qwen2-MoE's
    block (docs/impl-notes/hf.md), and a QK norm Qwen3-MoE's, Qwen2-MoE's router and experts without them.
    """
    if is_gpt_oss(knobs):  # GptOssTopKRouter: the k chosen logits' softmax, in the activation dtype
        return (ledger.MOE_IN, ledger.ROUTER_TOPK_INDICES, ROUTER_TOPK_SOFTMAX,
                *expert_block(knobs, EXPERT_WEIGHT_CAST))
    qwen = routing_weights_kind(knobs) is Kind.ACTIVATION
    norm = () if knobs.moe_router_pre_softmax else (TOPK_SUM, TOPK_WEIGHTS)
    if knobs.mla:  # in fp32 the input's cast is a no-op: F.linear keeps the block's input (MOE_IN, kept below)
        cast = () if knobs.dtype == "fp32" else (ROUTER_IN_FP32,)
        router: tuple[SavedTensor, ...] = (*cast, ROUTER_SCORES, ledger.ROUTER_TOPK_INDICES, *norm)
    else:
        router = (ledger.MOE_IN, ROUTER_PROBS, ledger.ROUTER_TOPK_INDICES, *norm)
    experts = expert_block(knobs, EXPERT_WEIGHT_CAST if qwen else EXPERT_WEIGHT)
    if knobs.mla:
        return (*router, *experts, ledger.MOE_IN, *SHARED_MLP)  # shared_experts(residuals) runs last
    shared = (*SHARED_MLP, SHARED_GATE_SIGMOID, SHARED_OUT) if knobs.moe_shared_expert_intermediate_size else ()
    return (*router, *shared, *experts)


def expert_block(knobs: Any, weight: SavedTensor) -> tuple[SavedTensor, ...]:
    """The experts by experts_implementation: grouped_mm's permutations, offsets and grouped SwiGLU, or the eager
    loop's (token, slot) pairs, SwiGLU and index_add_ source; the same SwiGLU rows and weighted output either way
    (one storage each under grouped_mm, one an expert in the loop). gpt-oss's experts run the clamped GLU in place of
    SwiGLU, and grouped_mm's gather of their biases keeps the sorted expert ids."""
    glu = CLAMPED_GLU if is_gpt_oss(knobs) else (ledger.EXPERT_GATE, ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT)
    swiglu = (ledger.EXPERT_IN, *glu, ledger.EXPERT_FC2_IN)
    if knobs.experts_implementation == "eager":
        return (TOKEN_SLOTS, *swiglu, weight, EXPERT_OUT, COMBINE_IN)
    bias_ids = (SORTED_EXPERT_IDS,) if is_gpt_oss(knobs) else ()  # the experts' biases, gathered per sorted slot
    return (TOKEN_INDICES, SORTED_SLOTS, *bias_ids, EXPERT_OFFSETS, *swiglu, weight, EXPERT_OUT, UNSORTED_SLOTS)


def keeps(knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
    """Every tensor one transformers decoder layer keeps for backward, in forward order (unless fully recomputed:
    torch.utils.checkpoint then keeps the layer's positional input, `Implementation.layer_tensors`)."""
    # the norms on the attention's and the MLP's outputs (`POST_NORMS`), where the layer has them
    post = knobs.post_norm or knobs.sandwich_norm
    post_attn, post_mlp = (tuple(x) for x in POST_NORMS[knobs.norm]) if post else ((), ())
    first, second = ((), ()) if knobs.post_norm else (norm_block(0, knobs), norm_block(1, knobs))  # OLMo 2: none
    blocks = (
        first + attention_block(knobs, accounting) + post_attn + second
        + (moe_block(knobs) if knobs.moe else mlp_block(knobs)) + post_mlp
    )
    return drop_small(blocks, accounting)


# The norms on the attention's and the MLP's outputs by memcalc's norm: Gemma 2/3's GemmaRMSNorm, GLM-4's LlamaRMSNorm
# code, OLMo 2's post-norms (its only ones).
POST_NORMS = {"rmsnorm_1p": (GEMMA_POST_ATTN, GEMMA_POST_MLP), "rmsnorm": (GLM_POST_ATTN, GLM_POST_MLP),
              "rmsnorm_fp32w": (OLMO2_ATTN_OUT, OLMO2_MLP_OUT)}


def check(knobs: Any) -> None:
    """The knob values transformers' layers (memcalc.model.families.FAMILIES) run; ConfigError for the rest: the
    family's own (`check_family`), then `_REFUSED`'s in order."""
    layers = [f for f in FAMILIES.values() if f.runs_as is None]
    if not any(f.norm == knobs.norm and knobs.mlp in f.mlps for f in layers):
        runs = ", ".join(f"{f.norm} + {'/'.join(f.mlps)} ({f.layer})" for f in layers)
        raise ConfigError(f"impl hf: no transformers layer has norm {knobs.norm} with mlp {knobs.mlp}; it runs {runs}")
    check_family(knobs)
    for refused, message in _REFUSED:
        if refused(knobs):
            raise ConfigError(f"impl hf: {message(knobs) if callable(message) else message}")


def _is_mixtral(knobs: Any) -> bool:
    """Without shared experts, latent attention or q/k norms a MoE layer is MixtralDecoderLayer (gpt-oss's aside)."""
    return knobs.moe and not knobs.moe_shared_expert_intermediate_size and not knobs.mla and not knobs.qk_layernorm \
        and not is_gpt_oss(knobs)


# (refused, message) for `check`, in order; a message that names knob values is a function of the knobs.
_REFUSED: tuple[tuple[Callable[[Any], bool], str | Callable[[Any], str]], ...] = (
    # a rotary share in (0, 1]; GPT-NeoX's and Phi-3's fused outputs are measured under eager attention only
    (lambda k: k.rotary_percent is not None and not 0 < k.rotary_percent <= 1,
     lambda k: f"rotary_percent={k.rotary_percent} must be in (0, 1] (a share of each head)"),
    (lambda k: (is_neox(k) or is_phi3(k)) and k.attention == "flash",
     lambda k: f"{layer_family(k).layer} under sdpa is not modelled: SDPA keeps V as the fused"
               f" {'query_key_value' if is_neox(k) else 'qkv_proj'} output it views, and where its"
               " output lies depends on the device's kernel (measured on a CPU only); use attention eager"),
    # Gemma 2's sandwich norms are GemmaRMSNorm's (norm rmsnorm_1p); its soft-capping runs in eager attention only
    # (SDPA's kernels take no softcap)
    *((lambda k, name=name: getattr(k, name) is not None and (not k.sandwich_norm or k.norm != "rmsnorm_1p"),
       f"{name} is Gemma 2's (Gemma2ForCausalLM: set sandwich_norm and norm rmsnorm_1p)")
      for name in ("attn_logit_softcapping", "final_logit_softcapping")),
    (lambda k: k.attn_logit_softcapping is not None and k.attention != "eager",
     "attn_logit_softcapping runs in eager attention only (SDPA takes no softcap); use attention eager"),
    # without soft-capping too: from_pretrained and from_config refuse attn_implementation "sdpa" for its model
    (lambda k: layer_family(k).name == "gemma2" and k.attention != "eager",
     "Gemma2ForCausalLM runs eager attention only (Gemma2PreTrainedModel._supports_sdpa is False: SDPA takes no"
     " softcap); use attention eager"),
    (lambda k: k.recompute not in ("none", "full"),
     lambda k: f"transformers has no {k.recompute} recomputation; use recompute none or full (its gradient"
               " checkpointing)"),
    (lambda k: k.gqa and not is_llama(k) and not is_starcoder2(k)
     and not (is_falcon(k) and (k.num_query_groups == 1 or k.fused_qkv)),
     lambda k: f"{layer_family(k).layer} has no grouped-query attention (FalconDecoderLayer: multi_query,"
               " num_query_groups 1, or new_decoder_architecture's groups with fused_qkv); leave num_query_groups"
               " unset"),
    # FalconDecoderLayer (parallel_attn, no ALiBi) as measured: the first layout (Falcon-7B's) with its one norm,
    # eager; new_decoder_architecture (fused_qkv) eager and sdpa; no dropout
    (lambda k: is_falcon(k) and not k.single_norm and not k.fused_qkv,
     "FalconDecoderLayer's first layout (Falcon-7B's) has one input_layernorm: set single_norm (ln_attn and ln_mlp are"
     " new_decoder_architecture's: set fused_qkv)"),
    (lambda k: is_falcon(k) and k.attention == "flash" and not k.fused_qkv,
     "FalconDecoderLayer's first layout under sdpa is not modelled (memcalc has measured its eager path only); use"
     " attention eager"),
    (lambda k: is_falcon(k) and k.has_dropout,
     lambda k: f"dropout {k.dropout} in FalconDecoderLayer is not modelled (hidden_dropout on the summed output; the"
               " rotary attention drops nothing out); use dropout 0"),
    # ALiBi is BloomBlock's: GPT-2's LayerNorm block with tanh GELU, no RoPE, eager (BloomAttention has one path); a
    # config's h (a knob set alone has no sizes)
    (lambda k: k.alibi and k.ffn_hidden_size is not None and getattr(k, "h", None) is not None
     and k.ffn_hidden_size != 4 * k.h,
     lambda k: f"BloomMLP is 4h wide (4 * {k.h}); ffn_hidden_size={k.ffn_hidden_size} is not BLOOM's"),
    (lambda k: k.alibi and k.attention == "flash",
     "BloomAttention has no sdpa path (baddbmm with the ALiBi bias, an fp32 softmax); use attention eager"),
    (lambda k: k.bias_activation_fusion, "bias_activation_fusion is Megatron's fused kernel; transformers has none"),
    (lambda k: k.moe_expert_capacity_factor is not None,
     "transformers' Mixtral and Qwen MoE blocks drop no tokens; leave moe_expert_capacity_factor unset"),
    (lambda k: k.moe_token_dispatcher_type != "alltoall",
     lambda k: f"moe_token_dispatcher_type {k.moe_token_dispatcher_type} is Megatron's; transformers' MoE blocks loop"
               " over their experts on one rank (leave it alltoall)"),
    (lambda k: k.moe_aux_loss,
     "the load-balancing loss is computed outside the decoder layer, from every layer's router logits; moe_aux_loss is"
     " not modelled for hf"),
    (lambda k: k.moe_router_score_function == "sigmoid" and not k.mla,
     "the sigmoid router is DeepseekV3MoE's, which transformers builds with latent attention (kv_lora_rank); Mixtral's"
     " and Qwen2-MoE's routers use softmax"),
    (lambda k: k.moe_first_dense_layers and not k.mla,
     "moe_first_dense_layers is DeepSeek-V3's first_k_dense_replace (with kv_lora_rank); Mixtral's and Qwen2-MoE's"
     " layers have no such field"),
    # MixtralDecoderLayer: every layer MoE, the top k renormalised
    (lambda k: _is_mixtral(k) and k.moe_router_pre_softmax,
     "MixtralSparseMoeBlock always renormalises the top-k probabilities; moe_router_pre_softmax is Qwen2-MoE's"
     " norm_topk_prob false (a block with shared experts)"),
    (lambda k: _is_mixtral(k) and k.moe_layer_freq != 1,
     lambda k: f"moe_layer_freq={k.moe_layer_freq} is Qwen2-MoE's decoder_sparse_step (a block with shared experts);"
               " every MixtralDecoderLayer is a MoE layer"),
    # attention_sinks and mlp swiglu_clamped are GptOssDecoderLayer's: GptOssRMSNorm (norm rmsnorm_fp32w) before the
    # attention and the MLP, every layer sparse with GptOssTopKRouter's softmax over the k chosen logits, eager
    # attention (its dropout drops the first s columns of the softmax's output out: the paper's mask and output)
    (lambda k: is_gpt_oss(k) and not k.moe, "every GptOssDecoderLayer is sparse: set num_experts"),
    (lambda k: is_gpt_oss(k) and k.attention != "eager",
     "GptOssDecoderLayer runs eager attention only: GptOssPreTrainedModel has _supports_sdpa False (transformers"
     " refuses sdpa), and its flash path needs hub kernels that take the sinks (vllm-flash-attn3), which memcalc has"
     " not measured; use attention eager"),
    (lambda k: is_gpt_oss(k) and (k.moe_router_pre_softmax or k.moe_layer_freq != 1),
     "GptOssTopKRouter softmaxes the k chosen logits (the top k renormalised: leave moe_router_pre_softmax unset) and"
     " every GptOssDecoderLayer is sparse (moe_layer_freq 1)"),
    (lambda k: not is_llama(k) and k.head_dim_set,  # heads of h/a in the LayerNorm layers
     lambda k: f"{layer_family(k).layer} has no kv_channels (head_dim); Llama-family layers (norm rmsnorm, mlp swiglu)"
               " do"),
    # DeepseekV3MoE: a sigmoid router, n_shared_experts shared experts of the experts' width, every layer past
    # first_k_dense_replace sparse; its SDPA path is not modelled (see the error)
    (lambda k: k.mla and k.moe and k.moe_router_score_function != "sigmoid",
     "DeepseekV3TopkRouter scores with sigmoid; set moe_router_score_function sigmoid"),
    (lambda k: k.mla and k.moe and (not k.moe_shared_expert_intermediate_size or k.moe_ffn_hidden_size is None
                                    or k.moe_shared_expert_intermediate_size % k.moe_ffn_hidden_size),
     lambda k: f"DeepseekV3MoE's shared experts are n_shared_experts of moe_intermediate_size:"
               f" moe_shared_expert_intermediate_size={k.moe_shared_expert_intermediate_size} must be a multiple of"
               f" moe_ffn_hidden_size={k.moe_ffn_hidden_size}"),
    (lambda k: k.mla and k.moe and k.moe_layer_freq != 1,
     lambda k: f"moe_layer_freq={k.moe_layer_freq}: transformers' DeepseekV3DecoderLayer is sparse at every layer past"
               " first_k_dense_replace (moe_first_dense_layers)"),
    (lambda k: k.mla and k.attention == "flash",
     "with kv_lora_rank, SDPA gets query/key heads of qk_nope+qk_rope channels and values of v_head_dim, so its flash"
     " kernel does not run (CPU: the fp32 math kernel, CUDA: memory-efficient attention), which memcalc does not"
     " model; use attention eager"),
)


def check_sizes(config: Any) -> None:
    """torch._grouped_mm, transformers' default experts path, takes only whole 16-byte strides (`check_grouped_mm`).
    RoPE rotates channel pairs (`_check_rotary`); some config classes want a | h whatever head_dim
    (`_check_whole_heads`). A MoE family's model has its experts."""
    check_family(config, model=True)
    _check_rotary(config)
    _check_whole_heads(config)
    if config.moe and config.experts_implementation == "grouped_mm":
        check_grouped_mm(config, "hf", "transformers' default experts_implementation",
                         "; use --experts-implementation eager")


# The families whose config class's validate_architecture refuses h % a != 0 even beside head_dim (transformers 5:
# LlamaConfig, Gemma2Config, Gemma3TextConfig, GPTNeoXConfig, DeepseekV2Config); the others take heads of head_dim
# whatever h is.
_A_DIVIDES_H = ("llama", "gemma2", "gemma3_text", "gpt_neox", "deepseek_v2")


def _check_whole_heads(config: Any) -> None:
    """A family whose config class wants a | h (`_A_DIVIDES_H`) refuses heads of kv_channels that do not tile h."""
    family = layer_family(config)
    if family.name in _A_DIVIDES_H and config.h % config.a:
        raise ConfigError(f"impl hf: {family.config_class} wants h divisible by a whatever head_dim: h={config.h} is"
                          f" not divisible by a={config.a} (its validate_architecture)")


def _check_rotary(config: Any) -> None:
    """RoPE rotates channel pairs of d_r = int(d * rotary_percent) channels. GPT-J's rotate_every_two stacks the even
    and the odd ones: an even count, at least 2. The other families rotate halves (rotate_half), and a whole head of
    odd width runs nowhere alike: transformers' RoPE validation refuses it (d > 4), apply_rotary_pos_emb fails (d = 3)
    or the tables round up past the head (d = 1); a share of a head rounds its odd d_r up within it (measured)."""
    if config.mla or not rope_tables(config):
        return
    share = 1 if config.rotary_percent is None else config.rotary_percent
    d_r = int(config.head_dim * share)
    if is_gptj(config) and (d_r < 2 or d_r % 2):
        raise ConfigError(f"impl hf: GPT-J's rotary_dim d_r = int(d * rotary_percent) = int({config.head_dim} *"
                          f" {config.rotary_percent:g}) = {d_r} must be even and at least 2 (its RoPE rotates"
                          " channel pairs)")
    if d_r == config.head_dim and d_r % 2:
        raise ConfigError(f"impl hf: RoPE on whole heads needs an even head width: d = {config.head_dim} is odd"
                          " (transformers' rotate_half rotates channel pairs)")


_TP_SOURCE, _OWN_LIMIT = "transformers 5.24", "memcalc's own limit, not the library's"
NO_SEQUENCE_PARALLEL = Refusal(
    "tp-sp", always, "in any model",
    "transformers has no sequence parallelism: DistributedConfig.enable_sequence_parallel is 'reserved ... not"
    " wired up yet', no model's tp_plan names its \"sequence_parallel\" style, and that style hands the next"
    " \"colwise\" linear a local sequence shard, which colwise wraps as Replicate without gathering it",
    f"{_TP_SOURCE}, transformers/distributed/configuration_utils.py (DistributedConfig) and tensor_parallel.py"
    " (SequenceParallel, registered with use_local_output=True; ColwiseParallel.transform_inputs_pre_forward)")


def _no_tp_plan(when: Callable[[Any], bool], condition: str, family: str) -> Refusal:
    """tp for a family whose config class has no base_model_tp_plan (`family`: its FAMILIES key)."""
    return Refusal(
        "tp", when, condition,
        f"{FAMILIES[family].config_class} has no base_model_tp_plan, so from_pretrained(tp_plan=\"auto\") has"
        " nothing to apply",
        f"{_TP_SOURCE}, transformers/models/{family}/configuration_{family}.py; distributed/mixin.py"
        " _resolve_parallel_plans raises ValueError for tp_size > 1 without a plan")


GPT2_NO_TP_PLAN = _no_tp_plan(is_gpt2, "for GPT-2 (norm layernorm, no RoPE)", "gpt2")
BLOOM_NO_TP_PLAN = _no_tp_plan(lambda knobs: knobs.alibi, "for BLOOM (alibi)", "bloom")
FALCON_NO_TP_PLAN = _no_tp_plan(is_falcon, "for Falcon (norm layernorm with parallel_residual)", "falcon")
NEOX_TP_NOT_MODELLED = Refusal(
    "tp", is_neox, "for GPT-NeoX (norm layernorm with rotary_percent and fused_qkv)",
    "memcalc has not measured GPTNeoXConfig's base_model_tp_plan yet (query_key_value and dense_h_to_4h colwise,"
    " dense and dense_4h_to_h rowwise)", f"{_TP_SOURCE}, GPTNeoXConfig.base_model_tp_plan; {_OWN_LIMIT}")
COHERE_QK_NORM_NO_TP = Refusal(
    "tp", lambda knobs: is_cohere(knobs) and knobs.qk_layernorm, "for Cohere with use_qk_norm (qk_layernorm)",
    "CohereConfig's base_model_tp_plan splits q_proj's and k_proj's heads (colwise) but names no rule for q_norm and"
    " k_norm, whose (heads, head_dim) weights stay whole: their product with a rank's a/t heads does not broadcast,"
    " and the layer's forward raises (RuntimeError in CohereLayerNorm, measured at t = 2)",
    f"{_TP_SOURCE}, CohereConfig.base_model_tp_plan; models/cohere/modeling_cohere.py CohereAttention (its own comment:"
    " 'need to be careful to use n_local_heads')")
GPT_OSS_NO_LAYER_TP_PLAN = Refusal(
    "tp", is_gpt_oss, "for gpt-oss (attention_sinks)",
    "GptOssConfig's base_model_tp_plan names only embed_tokens (embedding_rowwise): no rule shards a decoder layer,"
    " and memcalc has not measured whole layers on every rank",
    f"{_TP_SOURCE}, transformers/models/gpt_oss/configuration_gpt_oss.py (GptOssConfig.base_model_tp_plan); its"
    " base_model_ep_plan shards the experts, which memcalc has not measured either")
LATENT_TP_NOT_MODELLED = Refusal(
    "tp", lambda knobs: knobs.mla, "with latent attention (kv_lora_rank)", "memcalc has not measured DeepSeek-V3's"
    " plan yet: it shards no attention, only the experts, the shared experts and the dense MLP",
    f"{_TP_SOURCE}, DeepseekV3Config.base_model_tp_plan; {_OWN_LIMIT}")


def tp_plan(knobs: Any) -> TPPlan:
    """The family's base_model_tp_plan, as apply_tensor_parallelism applies it (DTensor; from_pretrained(tp_plan=
    "auto")): the Llama family's (a colwise linear's input wrapped as Replicate, no copy), a block the family's plan
    gathers ("colwise_gather_output"), and the MoE plans', which shard only each expert's width ("packed_colwise"
    gate_up_proj, "rowwise" down_proj, "moe_tp_experts" summing the ranks' outputs): no rule names the router, so
    every rank routes every token alike and gathers the same r rows (Region.EXPERT: only F_E is split), nor
    Qwen2-MoE's shared expert (its gate and combine lie outside any pair, whole anyway)."""
    gathered, gptj = layer_family(knobs).gathered, is_gptj(knobs)
    attention = "attn" if gptj else "self_attn"
    qkv = ("qkv_proj",) if knobs.fused_qkv else ("q_proj", "k_proj", "v_proj")
    up, down = ((("gate_up_proj",) if "mlp" in gathered else ("gate_proj", "up_proj")), "down_proj") \
        if knobs.mlp in GATED else (("fc_in",), "fc_out") if gptj else (("c_fc",), "c_proj")  # GPT-J's, StarCoder 2's
    shared = (Rule("mlp.shared_expert", Style.REPLICATED, whole=tuple(x.name for x in SHARED_MLP)),) \
        if knobs.moe_shared_expert_intermediate_size and not knobs.mla else ()
    mlp = (Rule("mlp.experts", Style.EXPERTS), *shared) if knobs.moe else \
        _pair(knobs, MLP, tuple(f"mlp.{m}" for m in up), f"mlp.{down}", gathered)
    return TPPlan((*_pair(knobs, ATTENTION, tuple(f"{attention}.{m}" for m in qkv),
                          f"{attention}.{'out_proj' if gptj else 'o_proj'}", gathered), *mlp))


def _pair(knobs: Any, p: Pair, colwise: tuple[str, ...], rowwise: str, gathered: tuple[str, ...]) -> tuple[Rule, ...]:
    """One pair's rules; where the family's plan gathers the block, every tensor of it is whole (both cores, on
    either device, and the b = 1 fused output) but the rowwise linear's input."""
    if p.name not in gathered:
        return _with_head_norms(knobs, pair(p, colwise, rowwise))
    made = (*(x for d in ("cpu", "cuda") for x in attention_block(knobs, Accounting(device=d))), ledger.K, ledger.V,
            NEOX_QKV_OUT) if p is ATTENTION else mlp_block(knobs)  # and what REPEAT_KV keeps at b = 1
    whole = tuple(dict.fromkeys(x.name for x in made if x.name not in (ledger.PROJ_IN.name, ledger.FC2_IN.name)))
    return tuple(_gathering(r) for r in pair(p, colwise, rowwise, Style.COLWISE_GATHER_OUTPUT, whole))


def _with_head_norms(knobs: Any, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """`rules` with q_norm and k_norm where the layer runs them, in forward order (backward meets their weight
    gradients' all-reduces in reverse): after q_proj and k_proj (Qwen3's), or both after v_proj (Gemma 3's
    Gemma3Attention projects all three first). The plans that name them replicate them, gradients all-reduced."""
    if not knobs.qk_layernorm:
        return rules
    after = {"v_proj": "qk"} if layer_family(knobs).name == "gemma3_text" else {"q_proj": "q", "k_proj": "k"}
    planned = []
    for r in rules:
        planned.append(r)
        prefix, module = r.module.rsplit(".", 1)
        planned += [Rule(f"{prefix}.{x}_norm", Style.REPLICATED_GRAD_ALLREDUCE, r.pair, moves=(Dim.D,))
                    for x in after.get(module, "")]
    return tuple(planned)


def _gathering(r: Rule) -> Rule:
    """`r` with what DTensor gathers at its module (`_GATHERS`)."""
    shape, parts = _GATHERS[r.module.rsplit(".", 1)[1]]
    return replace(r, moves=shape, parts=parts)


# What DTensor gathers at each module of a gathered block (memcalc.model.tp_plan.Rule.gathers), and how many such
# tensors: a colwise module's output, a rowwise module's input (its gradient, in backward).
_HEADS = (Dim.B, Dim.S, Dim.A, Dim.D)
_GATHERS = {"qkv_proj": ((Dim.B, Dim.S, Dim.QKV, Dim.D), 1), "q_proj": (_HEADS, 1),
            "k_proj": ((Dim.B, Dim.S, Dim.G, Dim.D), 1), "v_proj": ((Dim.B, Dim.S, Dim.G, Dim.D), 1),
            "o_proj": (_HEADS, 1), "gate_up_proj": (BSF, 2), "gate_proj": (BSF, 1),
            "up_proj": (BSF, 1), "down_proj": (BSF, 1)}


# lm_head under tp gathers the logits whole on every rank (its tp plan's colwise_gather_output), and ForCausalLMLoss
# keeps their fp32 log_softmax: the same bytes as the loss's fp32 logits, not split by t.
LOSS_LOGITS = replace(ledger.LOSS_LOGITS, saved_by="cross-entropy (transformers' ForCausalLMLoss, on the gathered"
                      " logits)", region=Region.REPLICATED)


IMPLEMENTATION = Implementation(
    name="hf",
    title="Hugging Face transformers",
    measured_on="transformers 5.24.0 (torch 2.13.0, CPU, bf16): LlamaDecoderLayer, Qwen2DecoderLayer,"
    " MistralDecoderLayer and GPT2Block, attn_implementation eager and sdpa; MixtralDecoderLayer and"
    " Qwen2MoeDecoderLayer, their experts by grouped_mm (torch._grouped_mm's CPU kernel) and the eager loop;"
    " DeepseekV3DecoderLayer (dense MLP and DeepseekV3MoE), eager; Qwen3DecoderLayer and Qwen3MoeDecoderLayer"
    " (head_dim, q_norm and k_norm), eager and sdpa; the Llama family and Qwen3 under transformers' own tp_plan"
    " (apply_tensor_parallelism, DTensor) at t = 2 and 4, the MoE layers of Mixtral, Qwen2-MoE and Qwen3-MoE too"
    " (forced routers); GemmaDecoderLayer, Gemma2DecoderLayer (sandwich norms, soft-capping), Gemma3DecoderLayer (and"
    " its q/k norms) and OlmoDecoderLayer, eager and sdpa (Gemma 2: eager), at t = 1 and 2; GPTNeoXLayer (parallel or"
    " sequential residual, partial RoPE), eager, t = 1; Phi3DecoderLayer (fused qkv_proj and gate_up_proj, partial"
    " RoPE), eager, at t = 1 and 2; Olmo2DecoderLayer (post-norms, whole-width q/k norms), eager and sdpa, at t = 1"
    " and 2; Starcoder2DecoderLayer (LayerNorm, RoPE, GQA, residual dropouts), eager and sdpa, at t = 1 and 2;"
    " GPTJBlock (one LayerNorm read side by side, fp32 Q and K, interleaved partial RoPE), eager and sdpa, at t = 1"
    " and 2; GlmDecoderLayer and Glm4DecoderLayer (interleaved partial RoPE, one gate_up_proj gathered under tp,"
    " GLM-4's sandwich norms), eager and sdpa, at t = 1 and 2; FalconDecoderLayer (parallel_attn, multi_query or"
    " multi-head, RoPE), eager, t = 1; FalconDecoderLayer with new_decoder_architecture (grouped query_key_value,"
    " ln_attn and ln_mlp), eager and sdpa, t = 1; BloomBlock (ALiBi, fp32 softmax, BLOOM's GELU), eager, t = 1;"
    " CohereDecoderLayer (one fp32 LayerNorm read side by side, per-head q/k norms), eager and sdpa, at t = 1 and 2"
    " (use_qk_norm: t = 1); GptOssDecoderLayer (attention sinks, sliding and full layers, half-head RoPE tables, its"
    " router and clamped-GLU experts by grouped_mm and the eager loop), eager, t = 1 (the families `memcalc"
    " hf-families` lists, each from a config.json its transformers class wrote)",
    keeps=keeps,
    refuses=(NO_SEQUENCE_PARALLEL, GPT2_NO_TP_PLAN, NEOX_TP_NOT_MODELLED, LATENT_TP_NOT_MODELLED, FALCON_NO_TP_PLAN,
             BLOOM_NO_TP_PLAN, COHERE_QK_NORM_NO_TP, GPT_OSS_NO_LAYER_TP_PLAN),
    tp_plan=tp_plan,
    rerun=Rerun(after_output=True, early_stop=True),  # activation_checkpointing_enable: non-reentrant, early stop
    check=check,
    check_sizes=check_sizes,
    size_rule=REPEAT_KV,
    model_wide_copies=rope_pairs,
    ends=(LOSS_LOGITS,),
    size_conditions=(
        SPLIT_PROJ_INPUT,
        GPT2_VIEWED_V,
        SizeCondition(
            GLM_SDPA_OUT, "GLM's SDPA output, laid out (b, a, s, d), is o_proj's input itself where transpose(1, 2)"
            " leaves it contiguous: one head on the rank, or one token",
            kept=lambda sizes, t: (sizes[Dim.A] // t > 1) & (sizes[Dim.S] > 1),  # found by the differential test
        ),
        SizeCondition(
            ledger.MLA_V, "DeepSeek's eager matmul copies V, a (b, a, s, d_v) view of kv_b_proj's output, unless b = 1,"
            " one head or one token: then b and a merge into a bmm batch as a view and it keeps the whole output",
            kept=batched, instead=(ledger.MLA_KV_UP_OUT,),  # found by the differential test
        ),
    ),
    # FLASH_DROPOUT_LSE is the ledger's LSE, described as read from code
    tensors=(
        *LN1_RMS, *LN2_RMS, *Q_NORM_RMS, *K_NORM_RMS, ROPE_COS, ROPE_SIN, *MLA_Q_RMS, *MLA_KV_RMS, MLA_ROPE_COS,
        MLA_ROPE_SIN, ledger.MLA_KV_UP_OUT, K_EXPANDED, V_EXPANDED, SOFTMAX_FP32, WEIGHTS, *SDPA_MATH, GPT2_MATH_V,
        HALF_X, TANH_OUT, ONE_PLUS_TANH, *MOE_TENSORS, NEOX_ROPE_COS, NEOX_ROPE_SIN, NEOX_QKV_OUT, *GPTJ_ROPE, GPTJ_Q,
        GPTJ_K, *OLMO2_ATTN_OUT, *OLMO2_MLP_OUT, *OLMO2_Q_NORM, *OLMO2_K_NORM, SDPA_OUT, *GEMMA_LN1, *GEMMA_LN2,
        *GEMMA_Q_NORM, *GEMMA_K_NORM, *GEMMA_POST_ATTN, *GEMMA_POST_MLP, SOFTCAP_TANH, GEGLU_GATE, GEGLU_UP,
        GEGLU_GELU_OUT, *OLMO_LN1, *OLMO_LN2, OLMO_ROPE_COS, OLMO_ROPE_SIN, *OLMO_ROPE_CAST, GLM_ROPE_COS, GLM_ROPE_SIN,
        GLM_SDPA_OUT, *GLM_POST_ATTN, *GLM_POST_MLP, FALCON_K_INDEX, FALCON_V_INDEX, *COHERE_LN1, *COHERE_Q_NORM,
        *COHERE_K_NORM, *GPT_OSS_TENSORS, FALCON_K_HEADS, FALCON_V_HEADS,
    ),
    # LlamaConfig's own: RMSNorm, SwiGLU, attention_dropout 0, attn_implementation "sdpa" (memcalc's flash).
    defaults={
        "norm": "rmsnorm", "mlp": "swiglu", "dropout": 0.0, "attention": "flash",
        "add_bias_linear": False, "position_embedding_type": "rope",  # transformers' Llama: no biases, RoPE
    })
