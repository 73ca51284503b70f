"""Where transformers' decoder layers make each tensor the ledger names: the label rules
`memcalc.probe.libs.hf.run_layer` records a layer under, family by family, and the storages that hold several
ledger rows.

How rules name what a library's own code makes: docs/probe.md, "Naming a library's tensors"; which class each family
runs and how tensors made inside one torch op are reached: "transformers' own layers".
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatchcase
from functools import partial
from typing import Any, Callable

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.families import layer_family
from memcalc.model.impls import hf as rules
from memcalc.model.ledger import Kind, Region, SavedTensor
from memcalc.probe.libs.labels import SDPA, Rule, head_columns, sdpa_inputs, split_rows, statistics
from memcalc.probe.recorder import SavedStorage

# A storage holding three ledger tensors side by side; never reported under this name.
_QKV_OUT = SavedTensor("attention/c_attn_out", "GPT2Attention.c_attn", (), Kind.ACTIVATION, Region.TENSOR,
                       "split into q, k, v")
_QKV_PARTS = (ledger.Q, ledger.K, ledger.V)  # each h columns wide (GPT-2 has no GQA)
# An expert's gate_up_proj output, (r_e, 2e): its gate and up halves.
_GATE_UP = SavedTensor("moe/expert_gate_up", "MixtralExperts gate_up_proj", (), Kind.ACTIVATION, Region.EXPERT,
                       "chunked into gate and up")
# Phi-3's and GLM's gate_up_proj output, (b, s, 2f): chunked into the gate (SiLU keeps it) and up (the product keeps
# it).
_DENSE_GATE_UP = SavedTensor("mlp/gate_up", "Phi3MLP's or GlmMLP's gate_up_proj", (), Kind.ACTIVATION, Region.TENSOR,
                             "chunked into gate and up")
# gpt-oss's expert gate_up output, (r_e, 2e): its interleaved gate ([..., ::2]) and up ([..., 1::2]) columns.
_GLU_GATE_UP = SavedTensor("moe/glu_gate_up", "GptOssExperts gate_up_proj", (), Kind.ACTIVATION, Region.EXPERT,
                           "sliced into gate and up")
_HALVES = {_GATE_UP.name: (ledger.EXPERT_GATE, ledger.EXPERT_UP),
           _DENSE_GATE_UP.name: (ledger.SWIGLU_GATE, ledger.SWIGLU_UP),
           _GLU_GATE_UP.name: (rules.GLU_GATE_IN, rules.GLU_UP_IN)}
MARKERS = (_QKV_OUT, _GATE_UP, _DENSE_GATE_UP, _GLU_GATE_UP)


def _kept(node: str, saved: str, newest: int = 0, then: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
    """A rule's view: the tensor saved as `saved` by the `newest`-th newest (0: the last made) autograd node named
    `node` (fnmatch) that a call's result's graph reaches; `then` turns it into the ledger's axes."""

    def view(result: Any) -> Any:
        nodes = [n for n in _graph(result.grad_fn) if fnmatchcase(type(n).__name__, node)]
        nodes.sort(key=lambda n: n._sequence_nr(), reverse=True)
        if len(nodes) <= newest:
            return None
        tensor = getattr(nodes[newest], saved)
        return then(tensor) if then else tensor

    return view


def _graph(root: Any) -> list[Any]:
    """Every autograd node reachable from `root`."""
    seen, stack = {}, [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


def _batch(b: int) -> Callable[[Any], Any]:
    """(b * n, ...) as (b, n, ...): a bmm's (b * heads, s, d) batch, a Conv1D's flattened (b * s, h) input."""
    return lambda x: x.unflatten(0, (b, -1))


def _heads_t(b: int) -> Callable[[Any], Any]:
    """(b * heads, d, s), a transposed K, as (b, heads, s, d)."""
    return lambda x: x.unflatten(0, (b, -1)).transpose(-1, -2)


def _stored(axes: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`axes`, then each dimension broadcast with stride 0 as the one entry it stores (repeat_kv's expand, which
    matmul keeps as it is when b = 1 and one K/V group is on the rank: memcalc.model.impls.hf.REPEAT_KV)."""

    def view(x: Any) -> Any:
        x = axes(x)
        for dim, (size, stride) in enumerate(zip(x.shape, x.stride())):
            if stride == 0 and size > 1:
                x = x.narrow(dim, 0, 1)
        return x

    return view


def _whole(x: Any) -> Any:
    """The tensor a view was made from, or x itself."""
    return x if x._base is None else x._base


def _copy(axes: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`axes`, for a tensor that fills a storage of its own; None for a view into a larger one."""
    return lambda x: axes(x) if _fills_storage(x) else None


def _in_larger(x: Any) -> Any:
    """x, if it views a larger storage (one it shares), else None. (A saved tensor's `_base` is not kept under
    saved-tensor hooks: the storage's size tells.)"""
    return None if _fills_storage(x) else x


def _fills_storage(x: Any) -> bool:
    return x.untyped_storage().nbytes() == x.numel() * x.element_size()


def label_rules_for(config: ModelConfig) -> tuple[Rule, ...]:
    """Where each tensor the layer may keep is made in transformers' code."""
    if config.recompute == "full":
        return (Rule("", "forward", ledger.LAYER_INPUT, arg=0),)
    return _LAYER_RULES.get(layer_family(config).name, _llama_rules)(config)


def _llama_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """A Llama-family layer: its norms, attention (latent with kv_lora_rank) and MLP, GLM's or dense or sparse."""
    attention = _latent_attention_rules(config) if config.mla else _llama_attention_rules(config)
    first, second = _llama_norm_rules(config)
    if rules.is_glm(config):
        return (*first, *attention, *_glm_rules(), *second)
    mlp = _gated_mlp("mlp", *(_GEGLU if config.mlp == "geglu_tanh" else _SWIGLU))
    return (*first, *attention, *second, *mlp, *_moe_rules(config))


def _gpt_oss_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """GptOssDecoderLayer: GptOssRMSNorm (Olmo2RMSNorm's code) before the attention and the MLP; Llama's projections
    and eager matmuls, the sinks' max and softmax; GptOssTopKRouter's input, top-k and softmax over the chosen
    logits; the experts' clamped GLU."""
    flat = _batch(config.b)
    return (
        *_norm_rules("rmsnorm_fp32w", "input_layernorm", rules.GPT_OSS_LN1),
        *_llama_attention_rules(config),
        Rule("self_attn", "max", rules.SINK_MAX_INDICES, view=_kept("MaxBackward0", "_saved_indices", then=statistics)),
        Rule("self_attn", "softmax", rules.SINK_SOFTMAX),
        *_norm_rules("rmsnorm_fp32w", "post_attention_layernorm", rules.GPT_OSS_LN2),
        Rule("mlp.router", "linear", ledger.MOE_IN, arg=0, view=flat),
        Rule("mlp.router", "topk", ledger.ROUTER_TOPK_INDICES,
             view=_kept("TopkBackward0", "_saved_indices", then=flat)),
        Rule("mlp.router", "softmax", rules.ROUTER_TOPK_SOFTMAX, view=flat),
        *_clamped_glu_expert_rules("mlp.experts"),
    )


def _clamped_glu_expert_rules(experts: str) -> tuple[Rule, ...]:
    """GptOssExperts on either path: the eager loop's `@` (matmul) per expert (gate_up, then down) or grouped_mm's two
    grouped matmuls, whose outputs get their biases added (the loop's `+`, grouped_mm's in-place add_); _apply_gate's two
    clamps read views of gate_up's output, and its four products (gate * alpha, gate * sigmoid, (up + 1) * glu, then
    the routing weight's) come in the same order on both paths. grouped_mm indexes seven times: the sorted slots'
    tokens, their weights, gate_up's biases by expert id, _apply_gate's two slices, down's biases, and the rows put back
    in slot order (inv_perm)."""
    return (
        *_expert_paths(experts, "matmul", unsorted=6),
        Rule(experts, "clamp", _GLU_GATE_UP, nth=0, every=2, arg=0, view=_whole),
        Rule(experts, "clamp", rules.GLU_GATE, nth=0, every=2),
        Rule(experts, "sigmoid", rules.GLU_SIGMOID, nth=None),
        Rule(experts, "mul", rules.GLU_OUT, nth=1, every=4),
        Rule(experts, "mul", rules.GLU_UP_PLUS_ONE, nth=2, every=4, arg=0),
        Rule(experts, "mul", rules.EXPERT_OUT, nth=3, every=4, arg=0),
        Rule(experts, "mul", rules.EXPERT_WEIGHT_CAST, nth=3, every=4, arg=1, view=statistics),
        Rule(experts, "__getitem__", rules.SORTED_EXPERT_IDS, nth=2, arg=1),
    )


def _glm_rules() -> tuple[Rule, ...]:
    """GLM's interleaved RoPE tables ((1, 1, s, d_r) each), GlmMLP's one gate_up_proj output chunked into gate and
    up, and GLM-4's sandwich norms (post_self_attn_layernorm, post_mlp_layernorm)."""
    table = lambda x: x[0, 0]  # noqa: E731
    return (
        Rule("self_attn", "repeat_interleave", rules.GLM_ROPE_COS, nth=0, view=table),
        Rule("self_attn", "repeat_interleave", rules.GLM_ROPE_SIN, nth=1, view=table),
        Rule("self_attn", SDPA, rules.GLM_SDPA_OUT),
        Rule("mlp.gate_up_proj", "linear", ledger.FC1_IN, arg=0),
        Rule("mlp.gate_up_proj", "forward", _DENSE_GATE_UP),  # under tp the gathered output (colwise_gather_output)
        Rule("mlp.activation_fn", "silu", ledger.SWIGLU_SILU_OUT),
        Rule("mlp.down_proj", "linear", ledger.FC2_IN, arg=0),
        *_norm_rules("rmsnorm", "post_self_attn_layernorm", rules.GLM_POST_ATTN),
        *_norm_rules("rmsnorm", "post_mlp_layernorm", rules.GLM_POST_MLP),
    )


_LAYER_NORM = (("layer_norm", 0, "input", None), ("layer_norm", 0, "mean", "mean"), ("layer_norm", 0, "rstd", "rstd"))
# What each norm's code keeps, by memcalc's norm kind: (function, nth, the norm's field, view), the view "axes" a
# per-head norm's (b, s, heads, ...) as the ledger's axes, "stats" (b, s, 1) statistics as (b, s).
_NORM_CODE = {
    # LlamaRMSNorm: hidden_states.to(torch.float32), rsqrt's output, hidden_states.to(input_dtype)
    "rmsnorm": (("to", 0, "input_fp32", "axes"), ("rsqrt", 0, "rstd", "stats, axes"), ("to", 1, "normed", "axes")),
    # Olmo2RMSNorm: x * rsqrt(.), the first product, which the fp32 weight * (.) keeps; a token's one statistic also
    # where its q and k norms span the whole (b, s, heads * d)
    "rmsnorm_fp32w": (("to", 0, "input_fp32", "axes"), ("rsqrt", 0, "rstd", "stats"),
                      ("mul", 0, "normed_fp32", "axes")),
    # GemmaRMSNorm: x.float(), 1.0 + weight.float() (the second add, after + eps), the fp32 product x * rsqrt(.)
    "rmsnorm_1p": (("float", 0, "input_fp32", None), ("rsqrt", 0, "rstd", "stats"), ("add", 1, "weight_plus_one", None),
                   ("mul", 0, "normed_fp32", None)),
    # CohereLayerNorm: the two x - mean (pow(2)'s, then the product's), weight.to(float32) (the second .to, after
    # x's), and (x - mean) * rsqrt(.), which weight * (.) keeps
    "layernorm_nb": (("sub", 0, "centred_pow", "axes"), ("sub", 1, "centred_mul", "axes"),
                     ("rsqrt", 0, "rstd", "stats, axes"), ("to", 1, "weight_fp32", None),
                     ("mul", 0, "normed_fp32", "axes")),
    "layernorm": _LAYER_NORM, "layernorm_np": _LAYER_NORM,  # torch's layer_norm (OLMo's weightless one too)
}
# A Llama-family layer's norms by kind: (module, tensors) before its attention and after it
_LLAMA_NORMS = {
    "rmsnorm": ((("input_layernorm", rules.LN1_RMS),), (("post_attention_layernorm", rules.LN2_RMS),)),
    "rmsnorm_1p": ((("input_layernorm", rules.GEMMA_LN1),), (("post_attention_layernorm", rules.GEMMA_LN2),)),
    # OLMo 2: no norm before the attention or the MLP, one after each
    "rmsnorm_fp32w": ((), (("post_attention_layernorm", rules.OLMO2_ATTN_OUT),
                           ("post_feedforward_layernorm", rules.OLMO2_MLP_OUT))),
    # Cohere: one norm, read by the attention and the MLP
    "layernorm_nb": ((("input_layernorm", rules.COHERE_LN1),), ()),
    "layernorm_np": ((("input_layernorm", rules.OLMO_LN1),), (("post_attention_layernorm", rules.OLMO_LN2),)),
}
# Gemma 2's sandwich: post_attention_layernorm on the attention's output, pre_feedforward_layernorm before the MLP,
# post_feedforward_layernorm after it
_GEMMA2_AFTER = (("post_attention_layernorm", rules.GEMMA_POST_ATTN), ("pre_feedforward_layernorm", rules.GEMMA_LN2),
                 ("post_feedforward_layernorm", rules.GEMMA_POST_MLP))


def _norm_rules(kind: str, module: str, norm: Any, axes: Callable[[Any], Any] | None = None) -> tuple[Rule, ...]:
    """What a norm of `kind` in `module` keeps (_NORM_CODE): `norm`'s tensors, a LayerNorm's input its argument."""
    views = {None: None, "axes": axes, "stats": statistics,
             "stats, axes": (lambda x: axes(statistics(x))) if axes else statistics,
             "mean": _kept("NativeLayerNormBackward0", "_saved_result1", then=statistics),
             "rstd": _kept("NativeLayerNormBackward0", "_saved_result2", then=statistics)}
    return tuple(Rule(module, function, getattr(norm, field), nth=nth, arg=0 if field == "input" else None,
                      view=views[view]) for function, nth, field, view in _NORM_CODE[kind])


def _llama_norm_rules(config: ModelConfig) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
    """A Llama-family layer's norms before and after its attention (_LLAMA_NORMS), Gemma 2's sandwich after it."""
    before, after = _LLAMA_NORMS[config.norm]
    if config.norm == "rmsnorm_1p" and config.sandwich_norm:
        after = _GEMMA2_AFTER
    return tuple(tuple(r for module, norm in norms for r in _norm_rules(config.norm, module, norm))
                 for norms in (before, after))


def _qk_norm_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """q_norm and k_norm: Qwen3's and Cohere's on (b, s, heads, d), OLMo 2's over q_proj's and k_proj's whole
    (b, s, heads * d) outputs, Gemma 3's on each head of the transposed (b, heads, s, d) q and k."""
    kind = config.norm if config.norm in rules.QK_NORMS else "rmsnorm"
    axes = {"rmsnorm_fp32w": head_columns(config.head_dim), "rmsnorm_1p": None}.get(kind, _per_head)
    q, k = rules.QK_NORMS[kind]
    return (*_norm_rules(kind, "self_attn.q_norm", q, axes), *_norm_rules(kind, "self_attn.k_norm", k, axes))


def _per_head(x: Any) -> Any:
    """(b, s, heads, ...) as (b, heads, s, ...)."""
    return x.transpose(1, 2)


def _core_rules(
    attention: str, config: ModelConfig, qkv: tuple[SavedTensor, ...] = _QKV_PARTS, copies_only: bool = False,
) -> tuple[Rule, ...]:
    """Eager, SDPA (flash kernel) and SDPA's CPU math kernel: the tensors inside `attention` (SDPA's q, k and v,
    its arguments, by `sdpa_inputs`); `qkv` names the eager core's Q, K and V (latent attention's own); with
    `copies_only`, only where matmul made them copies of their own (GPT-2's views of c_attn's output: `_gpt2_rules`)."""
    b = config.b
    q, k, v = qkv
    own = _copy if copies_only else (lambda axes: axes)
    # what the newest bmm keeps of its first and of its second operand
    first, second = partial(_kept, "BmmBackward0", "_saved_self"), partial(_kept, "BmmBackward0", "_saved_mat2")
    return (
        # eager: matmul copies q, k^T (k after repeat_kv) and v into contiguous storages and keeps those
        Rule(attention, "matmul", q, nth=0, view=first(then=own(_batch(b)))),
        Rule(attention, "matmul", k, nth=0, view=second(then=own(_stored(_heads_t(b))))),
        Rule(attention, "matmul", rules.K_EXPANDED, nth=0, view=second(then=_heads_t(b))),
        Rule(attention, "matmul", v, nth=1, view=second(then=own(_stored(_batch(b))))),
        Rule(attention, "matmul", rules.V_EXPANDED, nth=1, view=second(then=_batch(b))),
        Rule(attention, "tanh", rules.SOFTCAP_TANH),  # Gemma 2's soft-capping
        Rule(attention, "softmax", ledger.SOFTMAX_OUT),
        Rule(attention, "softmax", rules.SOFTMAX_FP32),
        # Llama's cast of the fp32 softmax back to bf16; OLMo's and Cohere's apply_rotary_pos_emb cast q and k back
        # before it (GPT-J's core casts q and k to fp32 before it)
        Rule(attention, "to", rules.WEIGHTS,
             nth=2 if config.norm in ("layernorm_np", "rmsnorm_fp32w", "layernorm_nb") or rules.is_gptj(config)
             else 0),
        Rule(attention, "native_dropout", ledger.ATTN_DROPOUT_OUT),  # the shim's dropout
        _dropout_mask(attention, ledger.ATTN_DROPOUT_MASK),
        # SDPA, flash kernel: the log-sum-exp (and q, k, v as passed)
        Rule(attention, SDPA, ledger.SOFTMAX_LSE, view=_kept("ScaledDotProduct*Backward0", "_saved_logsumexp")),
        Rule(attention, SDPA, rules.SDPA_OUT),  # OLMo 2 under tp: o_proj's input is a split copy of it
        # SDPA, CPU math kernel (dropout): fp32 copies, two bmm, the softmax, dropout's mask
        Rule(attention, SDPA, rules.MATH_Q, view=first(newest=1, then=_batch(b))),
        Rule(attention, SDPA, rules.MATH_K, view=second(newest=1, then=_heads_t(b))),
        Rule(attention, SDPA, rules.MATH_SOFTMAX, view=_kept("SafeSoftmaxBackward0", "_saved_result")),
        Rule(attention, SDPA, rules.MATH_DROPOUT_MASK, view=_kept("MulBackward0", "_saved_other")),
        Rule(attention, SDPA, rules.MATH_DROPOUT_OUT, view=first(then=_batch(b))),
        Rule(attention, SDPA, rules.GPT2_MATH_V if copies_only and config.dtype == "fp32" else rules.MATH_V,
             view=second(then=own(_batch(b)))),
    )


def _llama_attention_rules(config: ModelConfig) -> tuple[Rule, ...]:
    return (
        Rule("self_attn.q_proj", "linear", ledger.QKV_IN, arg=0),
        *_qk_norm_rules(config),
        *_core_rules("self_attn", config),
        *sdpa_inputs("self_attn"),
        Rule("self_attn.o_proj", "linear", ledger.PROJ_IN, arg=0, view=head_columns(config.head_dim)),
    )


def _gated_mlp(mlp: str, act: str, names: tuple[SavedTensor, ...], view: Callable[[Any], Any] | None = None
               ) -> tuple[Rule, ...]:
    """A gated MLP in `mlp` (LlamaMLP's code; the shared experts' too): `names` are gate_proj's input and output,
    up_proj's output, act_fn's output (its torch function `act`) and down_proj's input; `view` gives each the
    ledger's axes."""
    fc1_in, gate, up, act_out, fc2_in = names
    return (
        Rule(f"{mlp}.gate_proj", "linear", fc1_in, arg=0, view=view),
        Rule(f"{mlp}.gate_proj", "linear", gate, view=view),
        Rule(f"{mlp}.up_proj", "linear", up, view=view),
        Rule(f"{mlp}.act_fn", act, act_out, view=view),
        Rule(f"{mlp}.down_proj", "linear", fc2_in, arg=0, view=view),
    )


# LlamaMLP's act_fn and what it keeps: SiLU's, or Gemma's tanh GeGLU's (mlp geglu_tanh)
_SWIGLU = ("silu", (ledger.FC1_IN, ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT, ledger.FC2_IN))
_GEGLU = ("gelu", (ledger.FC1_IN, rules.GEGLU_GATE, rules.GEGLU_UP, rules.GEGLU_GELU_OUT, ledger.FC2_IN))
# The shared MLP's (Qwen2-MoE's on flattened tokens, DeepSeek-V3's on (b, s, h)); DeepSeek's reads the block's input
# itself, the router an fp32 copy, so there the block's input is the shared MLP's
_SHARED = (ledger.MOE_IN, ledger.SHARED_GATE, ledger.SHARED_UP, ledger.SHARED_SILU_OUT, ledger.SHARED_FC2_IN)

# transformers' GELU modules, each as mlp.act: torch's kernel keeps its input; gelu_new, written out, keeps four
_GELU = (
    Rule("mlp.act", "gelu", ledger.GELU_IN, arg=0),  # torch's GELU kernel
    Rule("mlp.act", "pow", ledger.GELU_IN, arg=0),  # gelu_new: torch.pow(x, 3.0)
    Rule("mlp.act", "mul", rules.HALF_X, nth=0),  # gelu_new: 0.5 * x (a scalar product reads as mul)
    Rule("mlp.act", "tanh", rules.TANH_OUT),
    Rule("mlp.act", "add", rules.ONE_PLUS_TANH, nth=1),  # gelu_new: 1.0 + tanh(.), after x + 0.044715 x^3
)


def _gelu_mlp(fc1: str | None, fc2: str, *, dropout: str | None, function: str = "linear", arg: int = 0,
              view: Callable[[Any], Any] | None = None) -> tuple[Rule, ...]:
    """A GELU MLP (`fc1` and `fc2` under mlp): fc1's input (None: the attention's too, one norm read side by side),
    transformers' GELU modules (`_GELU`), fc2's input, the mask of the dropout in `dropout` (None: none)."""
    first = (Rule(f"mlp.{fc1}", function, ledger.FC1_IN, arg=arg, view=view),) if fc1 else ()
    last = (_dropout_mask(dropout, ledger.MLP_DROPOUT_MASK),) if dropout else ()
    return (*first, *_GELU, Rule(f"mlp.{fc2}", function, ledger.FC2_IN, arg=arg, view=view), *last)


def _gpt2_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """GPT2Block: its Conv1Ds are addmm on (b * s, h) tokens."""
    flat = _batch(config.b)
    return (
        *_norm_rules("layernorm", "ln_1", ledger.LN1),
        Rule("attn.c_attn", "addmm", ledger.QKV_IN, arg=1, view=flat),
        *_core_rules("attn", config, copies_only=True),
        # q, k, v are views of c_attn's output (b * s, 3h): its whole storage, split by `attributed`. Under SDPA
        # always; under eager where bmm takes them as they are (b = 1 or a = 1: the (b, a) batch flattens as a view)
        Rule("attn", SDPA, _QKV_OUT, arg=0, view=lambda q: q._base),
        Rule("attn", "matmul", _QKV_OUT, nth=0, view=_kept("BmmBackward0", "_saved_self", then=_in_larger)),
        Rule("attn.c_proj", "addmm", ledger.PROJ_IN, arg=1, view=lambda x: head_columns(config.head_dim)(flat(x))),
        _dropout_mask("attn.resid_dropout", ledger.ATTN_OUT_DROPOUT_MASK),
        *_norm_rules("layernorm", "ln_2", ledger.LN2),
        *_gelu_mlp("c_fc", "c_proj", dropout="mlp.dropout", function="addmm", arg=1, view=flat),
    )


def _neox_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """GPTNeoXLayer: the eager core (at b = 1 V is kept as the fused output it views), dropouts after the attention
    and the MLP."""
    return (
        *_norm_rules("layernorm", "input_layernorm", ledger.LN1),
        *_fused_attention(config, "attention", "query_key_value", "dense", "post_attention_dropout"),
        *_norm_rules("layernorm", "post_attention_layernorm", ledger.LN2),
        *_gelu_mlp("dense_h_to_4h", "dense_4h_to_h", dropout="post_mlp_dropout"),
    )


def _bloom_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """BloomBlock: baddbmm's Q and K^T and bmm's V (copies, or at b = 1 views of the fused output, whose storage is
    split into Q, K and V by `attributed`); the fp32 softmax and its cast; dropout_add's masks; BloomMLP's
    GeLUFunction keeps its input, dense_h_to_4h's output."""
    b, attention = config.b, "self_attention"
    scores, context = _kept("BaddbmmBackward0", "_saved_batch1"), _kept("BmmBackward0", "_saved_mat2")
    key = _kept("BaddbmmBackward0", "_saved_batch2")
    dropout = f"{attention}.attention_dropout"
    return (
        *_norm_rules("layernorm", "input_layernorm", ledger.LN1),
        Rule(f"{attention}.query_key_value", "linear", ledger.QKV_IN, arg=0),
        Rule(attention, "baddbmm", ledger.Q, view=lambda r: _copy(_batch(b))(scores(r))),
        Rule(attention, "baddbmm", ledger.K, view=lambda r: _copy(_heads_t(b))(key(r))),
        Rule(attention, "baddbmm", _QKV_OUT, view=lambda r: _in_larger(scores(r))),
        Rule(attention, "softmax", rules.SOFTMAX_FP32),
        Rule(attention, "to", rules.WEIGHTS),
        Rule(dropout, "native_dropout", ledger.ATTN_DROPOUT_OUT),
        _dropout_mask(dropout, ledger.ATTN_DROPOUT_MASK),
        Rule(attention, "bmm", ledger.V, view=lambda r: _copy(_batch(b))(context(r))),
        Rule(attention, "bmm", _QKV_OUT, view=lambda r: _in_larger(context(r))),
        Rule(f"{attention}.dense", "linear", ledger.PROJ_IN, arg=0, view=head_columns(config.head_dim)),
        _dropout_mask(attention, ledger.ATTN_OUT_DROPOUT_MASK),
        *_norm_rules("layernorm", "post_attention_layernorm", ledger.LN2),
        Rule("mlp.dense_h_to_4h", "linear", ledger.FC1_IN, arg=0),
        Rule("mlp.dense_h_to_4h", "linear", ledger.GELU_IN),
        Rule("mlp.dense_4h_to_h", "linear", ledger.FC2_IN, arg=0),
        _dropout_mask("mlp", ledger.MLP_DROPOUT_MASK),
    )


def _falcon_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """FalconDecoderLayer: one norm, read by the attention and the MLP, or ln_attn and ln_mlp; multi_query's or
    new_decoder_architecture's two list indices, the eager core (as NeoX's: at b = 1 multi-head V is the fused output
    it views) or SDPA (new_decoder_architecture: K rotated at every head, V broadcast to them or, with one group, the
    index output its stride-0 view reads). FalconLinear is `input @ weight.T`: a module's input is its linear's."""
    attention = "self_attention"
    index = lambda x: x.grad_fn._saved_indices[-1][0]  # noqa: E731  (the (1,) index of [..., [-2], :], as ())
    key = rules.FALCON_K_HEADS if config.fused_qkv else ledger.K  # new_decoder_architecture: rotated at every head
    norms = _norm_rules("layernorm", "input_layernorm", ledger.LN1) if config.single_norm else (
        *_norm_rules("layernorm", "ln_attn", ledger.LN1), *_norm_rules("layernorm", "ln_mlp", ledger.LN2),
        Rule("mlp.dense_h_to_4h", "forward", ledger.FC1_IN, arg=0))
    return (
        *norms,
        Rule(f"{attention}.query_key_value", "forward", ledger.QKV_IN, arg=0),
        Rule(attention, "__getitem__", rules.FALCON_K_INDEX, nth=1, view=index),
        Rule(attention, "__getitem__", rules.FALCON_V_INDEX, nth=2, view=index),
        *_core_rules(attention, config, qkv=(ledger.Q, key, ledger.V)),
        *sdpa_inputs(attention),
        Rule(attention, SDPA, rules.FALCON_K_HEADS, arg=1),
        Rule(attention, SDPA, ledger.V, arg=2, view=_stored(lambda v: v)),
        Rule(attention, SDPA, rules.FALCON_V_HEADS, arg=2),
        _fused_v(attention, config),
        Rule(f"{attention}.dense", "forward", ledger.PROJ_IN, arg=0, view=head_columns(config.head_dim)),
        *_gelu_mlp(None, "dense_4h_to_h", dropout=None, function="forward"),
    )


def _gptj_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """GPTJBlock: one LayerNorm (ln_1), which q_proj and fc_in both read; the four interleaved RoPE tables (keys' sin
    and cos, then the queries'), the eager core over fp32 Q and K."""
    tables = tuple(Rule("attn", "repeat_interleave", table, nth=n, view=lambda x: x[0, :, 0])
                   for n, table in enumerate(rules.GPTJ_ROPE))
    return (
        *_norm_rules("layernorm", "ln_1", ledger.LN1),
        Rule("attn.q_proj", "linear", ledger.QKV_IN, arg=0), *tables,
        *_core_rules("attn", config, (rules.GPTJ_Q, rules.GPTJ_K, ledger.V)), *sdpa_inputs("attn"),
        Rule("attn.out_proj", "linear", ledger.PROJ_IN, arg=0, view=head_columns(config.head_dim)),
        _dropout_mask("attn.resid_dropout", ledger.ATTN_OUT_DROPOUT_MASK),
        *_gelu_mlp(None, "fc_out", dropout="mlp.dropout"),
    )


def _starcoder2_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """Starcoder2DecoderLayer: Llama's projections and core, then F.dropout of o_proj's output in the same module
    (residual_dropout): under eager the second dropout there (the first drops the attention weights out), under SDPA
    the first (the kernel drops out inside); Starcoder2MLP's F.dropout of its output in its own forward."""
    return (
        *_norm_rules("layernorm", "input_layernorm", ledger.LN1),
        *_llama_attention_rules(config),
        _dropout_mask("self_attn", ledger.ATTN_OUT_DROPOUT_MASK, nth=1 if config.attention == "eager" else 0),
        *_norm_rules("layernorm", "post_attention_layernorm", ledger.LN2),
        *_gelu_mlp("c_fc", "c_proj", dropout="mlp"),
    )


def _phi3_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """Phi3DecoderLayer: the eager core (V, a view of qkv_proj's output, kept whole where matmul takes it as it is),
    the dropouts of the attention's and the MLP's outputs; Phi3MLP's (b, s, 2f) gate_up_proj output that gate and up
    are halves of (SiLU keeps gate, the product up)."""
    first, second = _llama_norm_rules(config)
    return (
        *first,
        *_fused_attention(config, "self_attn", "qkv_proj", "o_proj", "resid_attn_dropout"),
        *second,
        Rule("mlp.gate_up_proj", "linear", ledger.FC1_IN, arg=0),
        Rule("mlp.activation_fn", "silu", _DENSE_GATE_UP, arg=0, view=_whole),
        Rule("mlp.activation_fn", "silu", ledger.SWIGLU_SILU_OUT),
        Rule("mlp.down_proj", "linear", ledger.FC2_IN, arg=0),
        _dropout_mask("resid_mlp_dropout", ledger.MLP_DROPOUT_MASK),
    )


_LAYER_RULES = {"gpt2": _gpt2_rules, "gpt_neox": _neox_rules, "bloom": _bloom_rules, "falcon": _falcon_rules,
                "gptj": _gptj_rules, "starcoder2": _starcoder2_rules, "phi3": _phi3_rules, "gpt_oss": _gpt_oss_rules}


def _fused_attention(config: ModelConfig, attention: str, qkv: str, proj: str, dropout: str) -> tuple[Rule, ...]:
    """NeoX's or Phi-3's attention over one fused qkv output, then the dropout of the attention's output."""
    return (
        Rule(f"{attention}.{qkv}", "linear", ledger.QKV_IN, arg=0),
        *_core_rules(attention, config),
        _fused_v(attention, config),
        Rule(f"{attention}.{proj}", "linear", ledger.PROJ_IN, arg=0, view=head_columns(config.head_dim)),
        _dropout_mask(dropout, ledger.ATTN_OUT_DROPOUT_MASK),
    )


def _fused_v(attention: str, config: ModelConfig) -> Rule:
    """V as the fused qkv output it views (b, s, heads, d), where matmul keeps it without a copy (REPEAT_KV)."""
    d = config.head_dim
    return Rule(attention, "matmul", rules.NEOX_QKV_OUT, nth=1, arg=1,
                view=lambda v: v._base.view(config.b, config.s, -1, d))


def _dropout_mask(module: str, mask: SavedTensor, nth: int = 0) -> Rule:
    """The bool mask the `nth` (CUDA-like) dropout in `module` keeps."""
    return Rule(module, "native_dropout", mask, nth=nth, view=_kept("NativeDropoutBackward0", "_saved_result1"))


def _latent_attention_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """DeepseekV3Attention: x (kv_a_proj_with_mqa reads it, as q_a_proj or q_proj does), the latent RMSNorms, the
    up projections' inputs, the eager core over Q, K of d_n + d_r and V of d_v, o_proj's input (b, s, a*d_v)."""
    return (
        Rule("self_attn.kv_a_proj_with_mqa", "linear", ledger.QKV_IN, arg=0),
        *_norm_rules("rmsnorm", "self_attn.q_a_layernorm", rules.MLA_Q_RMS),
        Rule("self_attn.q_b_proj", "linear", ledger.MLA_Q_UP_IN, arg=0),
        *(replace(r, view=_whole) if r.tensor is rules.MLA_KV_RMS.input_fp32 else r
          for r in _norm_rules("rmsnorm", "self_attn.kv_a_layernorm", rules.MLA_KV_RMS)),  # a view of kv_a's output
        Rule("self_attn.kv_b_proj", "linear", ledger.MLA_KV_UP_IN, arg=0, view=lambda x: x.flatten(1, 2)),  # (b, 1, s, r)
        *_core_rules("self_attn", config, (ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V)),
        Rule("self_attn", "matmul", ledger.MLA_KV_UP_OUT, nth=1, arg=1,  # where matmul keeps V as a view of it
             view=lambda v: v._base.view(config.b, config.s, config.a, -1)),
        Rule("self_attn.o_proj", "linear", ledger.MLA_PROJ_IN, arg=0, view=lambda x: x.unflatten(-1, (config.a, -1))),
    )


def _moe_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """The sparse MoE block: its router (mlp.gate), the experts (grouped_mm or the eager loop),
    and Qwen2-MoE's gated shared expert. Views give (b*s, ...) tensors the ledger's (b, s, ...) axes."""
    flat = _batch(config.b)
    per_token = lambda x: statistics(flat(x))  # noqa: E731  (a (b*s, 1) statistic as (b, s))
    experts = "mlp.experts"
    if config.mla:  # DeepseekV3TopkRouter: F.linear on an fp32 copy of x, the sigmoid, gather by the chosen
        # indices, and the in-place renormalisation (its divisor is sum + 1e-20)
        return (
            Rule("mlp.gate", "linear", rules.ROUTER_IN_FP32, arg=0, view=flat),
            Rule("mlp.gate", "sigmoid", rules.ROUTER_SCORES, view=flat),
            Rule("mlp.gate", "gather", ledger.ROUTER_TOPK_INDICES, arg=2, view=flat),
            Rule("mlp.gate", "div_", rules.TOPK_SUM, view=_kept("DivBackward0", "_saved_other", then=per_token)),
            Rule("mlp.gate", "div_", rules.TOPK_WEIGHTS, view=_kept("DivBackward0", "_saved_self", then=flat)),
            *_expert_rules(experts), *_gated_mlp("mlp.shared_experts", "silu", _SHARED),
        )
    return (
        Rule("mlp.gate", "linear", ledger.MOE_IN, arg=0, view=flat),
        Rule("mlp.gate", "softmax", rules.ROUTER_PROBS, view=flat),
        Rule("mlp.gate", "topk", ledger.ROUTER_TOPK_INDICES, view=_kept("TopkBackward0", "_saved_indices", then=flat)),
        Rule("mlp.gate", "sum", rules.TOPK_SUM, view=per_token),
        Rule("mlp.gate", "div_", rules.TOPK_WEIGHTS, view=_kept("DivBackward0", "_saved_self", then=flat)),
        *_expert_rules(experts), *_gated_mlp("mlp.shared_expert", "silu", _SHARED, flat),
        Rule("mlp.shared_expert.down_proj", "linear", rules.SHARED_OUT, view=flat),
        Rule("mlp", "sigmoid", rules.SHARED_GATE_SIGMOID, view=per_token),
    )


def _expert_rules(experts: str) -> tuple[Rule, ...]:
    """The experts (MixtralExperts' code, DeepseekV3Experts' too): the eager loop's two linears and two products an
    expert, or grouped_mm's three indexings, offsets, two grouped matmuls and two products. SiLU(gate) * up is the
    first product, the routing weight's the second, on either path."""
    return (
        *_expert_paths(experts, "linear", unsorted=2),
        Rule(experts, "linear", _GATE_UP, nth=0, every=2),
        Rule(f"{experts}.act_fn", "silu", ledger.EXPERT_SILU_OUT),
        Rule(experts, "linear", rules.EXPERT_OUT, nth=1, every=2),
        Rule(experts, "mul", rules.EXPERT_WEIGHT, nth=1, every=2, arg=1, view=statistics),
        Rule(experts, "mul", rules.EXPERT_WEIGHT_CAST, nth=1, every=2, arg=1, view=statistics),
        Rule(experts, "_grouped_mm", _GATE_UP, nth=0),
        Rule(experts, "_grouped_mm", rules.EXPERT_OUT, nth=1),
    )


def _expert_paths(experts: str, loop: str, unsorted: int) -> tuple[Rule, ...]:
    """What both experts' classes (Mixtral's, gpt-oss's) keep alike on either path: the eager loop's (token, slot)
    pairs, the inputs of its two `loop` calls an expert and index_add_'s source; grouped_mm's sorted tokens and
    weights, the rows put back in slot order (its `unsorted`-th indexing), the offsets, its two matmuls' inputs
    (torch.nn.functional.grouped_mm's call, as the torch function mode sees it: _grouped_mm)."""
    return (
        Rule(experts, "where", rules.TOKEN_SLOTS, nth=None),  # (token_pos, token_idx): views of one (r_e, 2) storage
        Rule(experts, loop, ledger.EXPERT_IN, nth=0, every=2, arg=0),
        Rule(experts, loop, ledger.EXPERT_FC2_IN, nth=1, every=2, arg=0),
        Rule(experts, "index_add_", rules.COMBINE_IN, nth=None, arg=3),
        Rule(experts, "__getitem__", rules.TOKEN_INDICES, nth=0, arg=1),
        Rule(experts, "__getitem__", rules.SORTED_SLOTS, nth=1, arg=1),
        Rule(experts, "__getitem__", rules.UNSORTED_SLOTS, nth=unsorted, arg=1),
        Rule(experts, "cumsum", rules.EXPERT_OFFSETS),
        Rule(experts, "_grouped_mm", ledger.EXPERT_IN, nth=0, arg=0),
        Rule(experts, "_grouped_mm", ledger.EXPERT_FC2_IN, nth=1, arg=0),
    )


# -- one storage, several ledger rows; several storages, one ledger row ---------------------------


def attributed(saved: tuple[SavedStorage, ...], config: ModelConfig) -> tuple[SavedStorage, ...]:
    """The storages as ledger rows: GPT-2's c_attn output split into Q, K and V, a third of its bytes each, and
    each expert's (and GLM's MLP's) gate_up output into its gate and up, half each."""
    per_head = (config.b, config.a, config.s, config.h // config.a)
    return split_rows(saved, {_QKV_OUT.name: tuple((x, 1, per_head) for x in _QKV_PARTS)}, _HALVES)
