"""transformers' decoder families, each declared once: how memcalc reads its config.json (a table of `Row`s) and which
of transformers' decoder layers its rules were measured on (`FAMILIES`; `UNREAD`: model types refused, with what they
lack). A config names its family (the `family` knob); `layer_family` is the family whose layer runs it (a config that
names none given its default here), and `check_family` refuses knobs that are not that layer's. One floor below the
config: the config.json reader (`memcalc.config.hf`), the hf ledger and the probe read the table from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from memcalc.errors import ConfigError
from memcalc.model.knobs import Mlp
from memcalc.text import short_repr

# transformers' GELU activations (ACT2CLS names) and memcalc's MLP choice for each: the tanh
# approximation is its own choice, since a library may keep other tensors for it than for exact GELU.
_GELUS = {
    "gelu": Mlp.GELU, "gelu_python": Mlp.GELU, "quick_gelu": Mlp.GELU,
    "gelu_new": Mlp.GELU_TANH, "gelu_pytorch_tanh": Mlp.GELU_TANH, "gelu_fast": Mlp.GELU_TANH,
}


def _checked(ok: Callable[[Any], bool], says: str, then: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Any]:
    """A reader of config.json's value (or of a row's values, combined): `then` of it where `ok` holds, else
    ConfigError `says`, with the value's short repr in place of its {} (one place words every refusal's value)."""

    def convert(value: Any) -> Any:
        if not ok(value):
            raise ConfigError(says.replace("{}", short_repr(value)))
        return then(value)

    return convert


def _number(value: Any) -> bool:
    """An int or a float (config.json's true and false are bools, which Python counts as ints: not numbers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Llama-style MLPs are gated: SiLU(gate) * up is SwiGLU.
_gated = _checked(lambda act: act in ("silu", "swish"),
                  "hidden_act {} in a gated MLP is not modelled (memcalc knows SwiGLU: silu)", lambda act: "swiglu")
# Gemma's gated MLP: GemmaConfig turns the legacy "gelu" into gelu_pytorch_tanh, torch's tanh GELU kernel.
_gemma_gated = _checked(lambda act: act in ("gelu", "gelu_pytorch_tanh"), "hidden_act {} in Gemma's gated MLP is not"
                        " modelled (memcalc knows gelu_pytorch_tanh, and gelu, which GemmaConfig reads as it)",
                        lambda act: "geglu_tanh")


def _only(name: str, modelled: tuple[Any, ...], why: str) -> Callable[[Any], Any]:
    """config.json's `name` at a value other than `modelled` asks for what memcalc has not measured (`why`)."""
    return _checked(lambda value: value in modelled, f"{name}={{}} is not modelled ({why})")


# GPT-2 and GPT-NeoX MLPs are fc1 -> activation -> fc2.
_plain = _checked(lambda act: isinstance(act, str) and act in _GELUS,
                  f"activation {{}} is not modelled (memcalc knows the GELU variants: {', '.join(_GELUS)})",
                  _GELUS.__getitem__)


def _kernel_gelu(act: Any) -> Mlp:
    """StarCoder 2's MLP: its gelu_pytorch_tanh is torch's GELU kernel (approximate="tanh"), which keeps its input
    alone, as exact GELU's kernel does: memcalc's gelu (and the probe runs gelu_pytorch_tanh for it)."""
    return Mlp.GELU if act == "gelu_pytorch_tanh" else _plain(act)


# Llama's attention_bias and mlp_bias: memcalc's add_bias_linear puts biases on every linear or on none.
_both_or_neither = _checked(lambda values: all(v == values[0] for v in values[1:]), "attention_bias and mlp_bias"
                            " differ ({}); memcalc's add_bias_linear is all or none", lambda values: values[0])
# GPT-2's and GPT-NeoX's several dropouts: memcalc has one probability, so it keeps the largest.
_largest_dropout = _checked(lambda values: all(map(_number, values)), "dropout probabilities must be numbers, got {}",
                            max)


def _flag(name: str) -> Callable[[Any], bool]:
    """A true-or-false field of config.json's."""
    return _checked(lambda value: isinstance(value, bool), f"{name} must be true or false, got {{}}")


def _rotary_fraction(values: list[Any]) -> float:
    """GPT-NeoX's share of each head that RoPE rotates: rope_parameters' partial_rotary_factor (what
    GPTNeoXConfig saves), else an older file's rotary_pct, else the class's 0.25 (the row's default, each absent
    one's)."""
    rope, pct = values
    return _fraction(rope.get("partial_rotary_factor", pct) if isinstance(rope, dict) else pct)


_fraction = _checked(lambda fraction: _number(fraction) and 0 < fraction <= 1, "the rotary fraction"
                     " (partial_rotary_factor, rotary_pct) must be in (0, 1], got {}")


@dataclass(frozen=True)
class Row:
    """One memcalc field and where config.json keeps it."""

    target: str | None  # None: read and shown only (`note`)
    sources: tuple[str, ...]
    convert: Callable[[Any], Any] = lambda v: v
    default: Any = ...  # when absent: ... required; None: memcalc's default; else the transformers class default
    combine: Callable[[list[Any]], Any] | None = None  # combine every source (absent ones at default); else the first
    note: str = ""  # target None: a field read, checked and shown, that changes nothing memcalc counts, and why


def _kept_nothing(source: str, convert: Callable[[Any], Any], note: str) -> Row:
    """A config.json field shown in the describe line, checked by `convert`, that changes no count (`note` says why)."""
    return Row(None, (source,), convert, default=None, note=note)


def _sizes(h: str = "hidden_size", a: str = "num_attention_heads",
           layers: str = "num_hidden_layers") -> tuple[Row, ...]:
    return (Row("h", (h,)), Row("a", (a,)), Row("L", (layers,)), Row("vocab_size", ("vocab_size",)))


def _norm_row(source: str, norm: str) -> Row:
    """The family's one norm, whatever its epsilon (config.json's `source`) says."""
    return Row("norm", (source,), lambda eps: norm, default=norm)


def _tied(default: bool) -> Row:
    return Row("tie_embeddings", ("tie_word_embeddings",), default=default)


def _like(rows: tuple[Row, ...], *changed: Row, drop: tuple[str, ...] = ()) -> tuple[Row, ...]:
    """Another family's `rows`, each of `changed` in place of the row of its target, those of `drop` left out."""
    new = {row.target: row for row in changed}
    return tuple(new.get(row.target, row) for row in rows if row.target not in drop)


def _positive_whole(name: str, null: str = "") -> Callable[[Any], int]:
    """A count of config.json's (`null`: " or null" where a null means none)."""
    return _checked(lambda value: type(value) is int and value >= 1, f"{name} must be a positive whole number{null},"
                    " got {}")


def _head_dim_row(default: Any = None) -> Row:
    """The Llama family's head_dim, memcalc's kv_channels (absent: h/a; Qwen3Config's own default is 128). DeepSeek's
    head_dim is its RoPE part, read as qk_rope_head_dim instead."""
    return Row("kv_channels", ("head_dim",), _positive_whole("head_dim"), default=default)


def _window(default: int | None) -> Row:
    """sliding_window: each query sees the last W keys (W a positive whole number; null: full causal attention)."""
    return Row("sliding_window", ("sliding_window",), _positive_whole("sliding_window", " or null"), default=default)


_LLAMA = (
    *_sizes(),
    Row("num_query_groups", ("num_key_value_heads",), default=None),  # absent: multi-head (Llama 1)
    Row("ffn_hidden_size", ("intermediate_size",)),
    Row("mlp", ("hidden_act",), _gated, default="swiglu"),
    _norm_row("rms_norm_eps", "rmsnorm"),
    Row("s", ("max_position_embeddings",), default=None),
    Row("dropout", ("attention_dropout",), default=0.0),
    _tied(False),
    Row("add_bias_linear", (), default=False),  # its biases hard-coded (none), or attention_bias's alone
)
_LLAMA_HEADS = (*_LLAMA, _head_dim_row())
# LlamaConfig's attention_bias and mlp_bias, the only layer that reads both (modeling_llama.py: LlamaAttention,
# LlamaMLP); Mistral's, Mixtral's and Qwen2's hard-code their biases and read neither
_LLAMA_BIASES = Row("add_bias_linear", ("attention_bias", "mlp_bias"), default=False, combine=_both_or_neither)
# attention_bias alone, on the attention's projections (q, k, v and o_proj; DeepSeek's q_a_proj, kv_a_proj_with_mqa
# and o_proj), read by Qwen3's, Gemma's, OLMo's, Cohere's and DeepSeek-V3's attention, their MLPs never biased: no
# knob counts that (add_bias_linear biases the MLP too)
_UNBIASED_ATTENTION = _kept_nothing("attention_bias", _only("attention_bias", (False,), "biases on the attention's"
                                    " projections alone: memcalc's add_bias_linear biases the MLP too"),
                                    "false: no biases")


def _positive_number(name: str, null: bool = False) -> Callable[[Any], Any]:
    """A positive number of config.json's (`null`: or null, for none)."""
    return _checked(lambda value: (null and value is None) or (_number(value) and value > 0),
                    f"{name} must be a positive number, got {{}}")


_KINDS_OF_LAYER = ("sliding_attention", "full_attention")


# Gemma 2/3's and gpt-oss's layer_types: each layer's attention, a sliding window or full causal.
_layer_types = _checked(lambda value: isinstance(value, list) and all(kind in _KINDS_OF_LAYER for kind in value),
                        f"layer_types must list {' or '.join(_KINDS_OF_LAYER)} for each layer, got {{}}")
# Sliding and full layers are counted alike, L times one layer, exactly: memcalc counts a window shorter than the
# sequence under transformers' eager attention only (check_sliding_window), whose mask is added to the whole (s, s)
# scores, so each kind keeps the same tensors (tests/probe/libs/test_hf_gpt_oss.py measures both).
_LAYER_TYPES = _kept_nothing("layer_types", _layer_types, "sliding and full layers keep alike under eager attention")


# Gemma2Config: Gemma's layer with sandwich norms (a GemmaRMSNorm on the attention's and on the MLP's output too),
# attention scores and the logits soft-capped (attn_logit_softcapping, final_logit_softcapping; absent: none, as
# null: save_pretrained always writes both), every other layer's attention a sliding window (eager keeps full
# attention's bytes); its activation field is hidden_activation. The query scale keeps nothing.
_GEMMA2_ONLY = (
    Row("mlp", ("hidden_activation",), _gemma_gated, default="geglu_tanh"),
    Row("attn_logit_softcapping", ("attn_logit_softcapping",), _positive_number("attn_logit_softcapping", null=True),
        default=None),
    _window(4096),
    Row("final_logit_softcapping", ("final_logit_softcapping",), _positive_number("final_logit_softcapping", null=True),
        default=None),
    _kept_nothing("query_pre_attn_scalar", lambda v: v, "a scale: keeps nothing"),
    _LAYER_TYPES,
)
# OlmoConfig: a Llama layer whose two norms are OlmoLayerNorm, LayerNorm without weight or bias run in fp32.
_OLMO = (*_like(_LLAMA, Row("norm", (), default="layernorm_np")), _head_dim_row(), _UNBIASED_ATTENTION,
         _kept_nothing("clip_qkv", _only("clip_qkv", (None,), "OLMo's in-place clamp of Q, K and V"),
                       "no clamp of Q, K and V"))
# GemmaConfig: a Llama layer whose norms scale by (1 + w) in fp32 (GemmaRMSNorm) and whose gated MLP is tanh GeGLU;
# heads of head_dim (256 by default), embeddings tied; the embedding's scaling by sqrt(h) lies outside the layers.
_GEMMA = (*_like(_LLAMA, Row("mlp", ("hidden_act",), _gemma_gated, default="geglu_tanh"),
                 _norm_row("rms_norm_eps", "rmsnorm_1p"), _tied(True)), _head_dim_row(256), _UNBIASED_ATTENTION)
# Qwen3Config: a Llama layer whose heads are head_dim wide (128 by default, whatever h/a is) and whose queries and
# keys are RMS-normalised per head (q_norm, k_norm) before RoPE; no sliding window.
# Qwen's use_sliding_window: sliding-window layers mask differently (and leave SDPA's causal kernel).
_FULL_CAUSAL = _kept_nothing("use_sliding_window", _checked(lambda value: value is False, "use_sliding_window={} is not"
                             " modelled (memcalc models full causal attention in every layer)"),
                             "full causal attention in every layer")
_QWEN2 = (*_LLAMA_HEADS, _FULL_CAUSAL)
_QWEN3 = (*_LLAMA, _head_dim_row(128), _FULL_CAUSAL, _UNBIASED_ATTENTION)
# DeepseekV2Config / DeepseekV3Config: a Llama layer whose attention is multi-head latent attention.
_DEEPSEEK = (
    *_LLAMA, _UNBIASED_ATTENTION,
    Row("q_lora_rank", ("q_lora_rank",), default=None),  # null: the query is projected from x (DeepSeek-V2-Lite)
    *(Row(name, (name,)) for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")),
)
# DeepSeek-V2 read dense: its layers from first_k_dense_replace (DeepseekV2Config's default 0) on are DeepseekV2Moe,
# whatever n_routed_experts (refused above 1) says
_DEEPSEEK_V2 = (*_DEEPSEEK, Row(
    None, ("first_k_dense_replace", "num_hidden_layers"), _checked(
        lambda v: all(type(x) is int for x in v) and v[0] >= v[1], "first_k_dense_replace and num_hidden_layers {}"
        " make DeepSeek-V2's later layers sparse (DeepseekV2Moe), which memcalc does not read"),
    default=0, combine=list, note="every layer dense"))


def _shared_width(values: list[Any]) -> int | None:
    """DeepSeek's n_shared_experts shared experts of moe_intermediate_size are one MLP of their summed width (the
    DeepseekV3MLP transformers builds); absent ones at DeepseekV3Config's defaults, 1 and 2048."""
    count, width = (d if v is ... else v for v, d in zip(values, (1, 2048)))
    if type(count) is not int or type(width) is not int or count < 0 or width < 1:
        raise ConfigError(f"n_shared_experts and moe_intermediate_size must be whole numbers, got {short_repr(values)}")
    return count * width or None


def _deepseek_v3_only(field_name: str, value: str) -> Callable[[Any], Any]:
    """A DeepSeek router setting transformers' DeepseekV3TopkRouter hard-codes: refused when config.json asks for
    another (DeepSeek-V2's softmax and greedy top-k are not what transformers' V3 layer runs)."""
    return _checked(lambda given: given == value, f"{field_name}={{}} is not modelled: transformers'"
                    f" DeepseekV3TopkRouter always runs {field_name}={value}")


def _aux_loss(values: list[Any]) -> bool:
    """transformers adds the load-balancing loss when output_router_logits is on (with a coefficient not 0)."""
    output_router_logits, coefficient = values
    return bool(output_router_logits) and coefficient != 0


def _pre_softmax(norm_topk_prob: Any) -> bool:
    """norm_topk_prob false: the top-k probabilities are used as the softmax over all experts gave them."""
    return not _flag("norm_topk_prob")(norm_topk_prob)


# Every MoE family's experts run by transformers' use_experts_implementation; absent: memcalc's default, grouped_mm.
# Its kernels' others (batched_mm, deepgemm, sonicmoe) keep what memcalc has not measured.
_EXPERTS_IMPLEMENTATION = Row("experts_implementation", ("experts_implementation",), _only(
    "experts_implementation", ("grouped_mm", "eager"), "memcalc models transformers' grouped_mm, its default, and"
    " eager"), default=None)
_AUX_LOSS = Row("moe_aux_loss", ("output_router_logits", "router_aux_loss_coef"), default=None, combine=_aux_loss)


def _routed(experts: str, topk: int, width: int | None = None) -> tuple[Row, ...]:
    """A MoE family's routed experts: how many (config.json's `experts` field), how many a token picks (its class's
    default `topk`) and, where they have their own width, moe_intermediate_size (the class's default `width`)."""
    rows = (Row("num_experts", (experts,)), Row("moe_router_topk", ("num_experts_per_tok",), default=topk))
    return rows if width is None else (*rows, Row("moe_ffn_hidden_size", ("moe_intermediate_size",), default=width))


# MixtralConfig: every layer a sparse MoE block of num_local_experts experts as wide as intermediate_size.
_MIXTRAL = (
    *_LLAMA_HEADS,
    *_routed("num_local_experts", 2),  # MixtralConfig's default
    _EXPERTS_IMPLEMENTATION, _AUX_LOSS,
)
# Qwen2MoeConfig: experts of moe_intermediate_size beside a gated shared expert, every decoder_sparse_step-th
# layer sparse (the others a dense MLP of intermediate_size); its class defaults are Qwen1.5-MoE-A2.7B's.
_QWEN2_MOE = (
    *_LLAMA_HEADS,
    *_routed("num_experts", 4, 1408),
    Row("moe_shared_expert_intermediate_size", ("shared_expert_intermediate_size",), default=5632),
    Row("moe_router_pre_softmax", ("norm_topk_prob",), _pre_softmax, default=True),  # norm_topk_prob false
    Row("moe_layer_freq", ("decoder_sparse_step",), default=None),
    Row("add_qkv_bias", ("qkv_bias",), default=True),
    _EXPERTS_IMPLEMENTATION, _AUX_LOSS,
)
# Qwen3MoeConfig: Qwen3's attention; every decoder_sparse_step-th layer Qwen2-MoE's router and experts of
# moe_intermediate_size without a shared expert (the others a dense MLP of intermediate_size); its class defaults are
# Qwen3-30B-A3B's but for norm_topk_prob (false in the class, true in that model's config.json).
_QWEN3_MOE = (
    *_LLAMA, _head_dim_row(), _FULL_CAUSAL, _UNBIASED_ATTENTION,
    *_routed("num_local_experts", 8, 768),  # Qwen3MoeConfig's attribute; older config.json files say num_experts
    Row("moe_router_pre_softmax", ("norm_topk_prob",), _pre_softmax, default=True),  # norm_topk_prob false
    Row("moe_layer_freq", ("decoder_sparse_step",), default=None),
    _kept_nothing("mlp_only_layers", lambda v: v, "no layer made dense by index"),  # _check_sparse_layers refuses any
    _EXPERTS_IMPLEMENTATION, _AUX_LOSS,
)
# Gemma3TextConfig: Gemma 2's layer with a GemmaRMSNorm on each query and key head (q_norm, k_norm) and no
# soft-capping by default; five sliding-window layers to a global one (layer_types), each kind its own RoPE base.
_GEMMA3 = (
    *_like(_GEMMA, drop=("mlp",)), *_GEMMA2_ONLY,
    _kept_nothing("use_bidirectional_attention", _only("use_bidirectional_attention", (False, None), "memcalc counts"
                                                       " causal decoder layers"), "causal attention"),
    _kept_nothing("rope_local_base_freq", lambda v: v, "a RoPE base: the same tables"),
)
_NOTHING_KEPT = "changes nothing kept"
# DeepseekV3Config's MoE: n_routed_experts experts of moe_intermediate_size beside n_shared_experts shared ones of the
# same width, the first first_k_dense_replace layers dense (intermediate_size wide); a sigmoid router whose
# e_score_correction_bias picks the experts (noaux_tc) among topk_group of n_group groups, the picked scores
# renormalised (norm_topk_prob) and scaled by routed_scaling_factor. The groups, the bias and the scale keep nothing
# (transient top-ks whose values are discarded, an add, a product by a number), so they are shown, not counted.
_DEEPSEEK_V3 = (
    *_DEEPSEEK,
    *_routed("n_routed_experts", 8, 2048),
    Row("moe_shared_expert_intermediate_size", ("n_shared_experts", "moe_intermediate_size"), default=...,
        combine=_shared_width),
    Row("moe_first_dense_layers", ("first_k_dense_replace",), lambda k: k or None, default=3),
    Row("moe_layer_freq", ("moe_layer_freq",), default=None),
    Row("moe_router_pre_softmax", ("norm_topk_prob",), _pre_softmax, default=False),
    Row("moe_router_score_function", ("scoring_func",), _deepseek_v3_only("scoring_func", "sigmoid"),
        default="sigmoid"),
    _EXPERTS_IMPLEMENTATION,
    _kept_nothing("topk_method", _deepseek_v3_only("topk_method", "noaux_tc"), _NOTHING_KEPT),
    *(_kept_nothing(name, _positive_number(name), _NOTHING_KEPT)
      for name in ("n_group", "topk_group", "routed_scaling_factor")),
    _kept_nothing("aux_loss_alpha", lambda v: v, "not counted: transformers computes no DeepSeek balance loss"),
    _kept_nothing("num_nextn_predict_layers", lambda v: v,
                  "not counted: the multi-token prediction module, which transformers does not build"),
)
_GPT2 = (
    *_sizes("n_embd", "n_head", "n_layer"),
    Row("ffn_hidden_size", ("n_inner",), default=None),  # null or absent: 4h
    Row("mlp", ("activation_function",), _plain, default=_plain("gelu_new")),  # GPT2Config's default
    _norm_row("layer_norm_epsilon", "layernorm"),
    Row("s", ("n_positions",)),
    Row("max_position_embeddings", ("n_positions",)),
    Row("dropout", ("resid_pdrop", "embd_pdrop", "attn_pdrop"), default=0.1, combine=_largest_dropout),
    _tied(True),
)
# GPTNeoXConfig: Llama's fields without K/V groups (multi-head only), with a GELU MLP, a LayerNorm, two dropouts and
# attention_bias's biases on every linear; a share of each head rotated (rotary_pct), the attention and the MLP side by
# side (use_parallel_residual) or in sequence.
_GPT_NEOX = (
    *_like(_LLAMA, Row("mlp", ("hidden_act",), _plain, default="gelu"), _norm_row("layer_norm_eps", "layernorm"),
           Row("dropout", ("attention_dropout", "hidden_dropout"), default=0.0, combine=_largest_dropout),
           Row("add_bias_linear", ("attention_bias",), default=True), drop=("num_query_groups",)),
    Row("parallel_residual", ("use_parallel_residual",), _flag("use_parallel_residual"), default=True),
    Row("rotary_percent", ("rope_parameters", "rotary_pct"), default=0.25, combine=_rotary_fraction),
)


# Starcoder2Config: a LayerNorm layer with RoPE on whole heads (its rotary embedding takes no partial factor), separate
# q, k and v (with GQA), biases on every linear (use_bias), the attention's and the MLP's outputs dropped out
# (residual_dropout), an MLP c_fc -> hidden_act -> c_proj, and each query attending to the last sliding_window keys.
_STARCODER2 = (
    *_like(_LLAMA, Row("num_query_groups", ("num_key_value_heads",), default=2),  # Starcoder2Config's default
           Row("mlp", ("hidden_act",), _kernel_gelu, default=Mlp.GELU),  # gelu_pytorch_tanh, Starcoder2Config's
           _norm_row("norm_epsilon", "layernorm"),
           Row("dropout", ("attention_dropout", "residual_dropout", "embedding_dropout"), default=0.0,
               combine=_largest_dropout),
           _tied(True),
           Row("add_bias_linear", ("use_bias",), _flag("use_bias"), default=True)),
    _window(None),
    _head_dim_row(),  # Starcoder2Attention: getattr(config, "head_dim", None) or h/a
)


def _rotary_dim_share(values: list[Any]) -> float:
    """GPT-J's rotary_dim (absent: GPTJConfig's 64) as a share of each head's n_embd / n_head channels."""
    rotary_dim, h, a = (64 if values[0] is None else values[0], *values[1:])
    if type(h) is not int or type(a) is not int or h < a or a < 1:
        raise ConfigError(f"n_embd and n_head must be whole numbers, n_embd >= n_head, got {short_repr(values[1:])}")
    if type(rotary_dim) is not int or rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"rotary_dim must be a positive even whole number, got {short_repr(rotary_dim)}")
    return _fraction(rotary_dim / (h // a))


# GPTJConfig: one LayerNorm (ln_1) whose output both the attention and the MLP read, added to the residual together;
# q, k, v and out_proj without biases, fc_in and fc_out with them (biases keep nothing: memcalc's add_bias_linear is
# left unset); RoPE interleaved on the first rotary_dim channels of each head. GPT-2's fields, GPTJConfig's defaults.
_GPTJ = (
    *_like(_GPT2, Row("dropout", ("resid_pdrop", "embd_pdrop", "attn_pdrop"), default=0.0, combine=_largest_dropout),
           _tied(False)),
    Row("rotary_percent", ("rotary_dim", "n_embd", "n_head"), default=None, combine=_rotary_dim_share),
)


# MistralConfig: Llama's layer, each query attending to the last sliding_window keys (the class's default, 4096, when
# config.json has none; null: full causal attention, Mistral v0.2 on).
_MISTRAL = (*_LLAMA_HEADS, _window(4096))


def _whole_heads_or_share(values: list[Any]) -> float | None:
    """Phi-3's share of each head that RoPE rotates: rope_parameters' partial_rotary_factor (what Phi3Config saves),
    else an older file's top-level partial_rotary_factor (Phi-4-mini's 0.75, which the class moves into
    rope_parameters); 1, the class's default, is whole heads (memcalc's unset rotary_percent)."""
    rope, top = values
    given = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    fraction = _fraction(next((v for v in (given, top) if v is not None), 1.0))
    return None if fraction == 1 else fraction


# Phi3Config (Phi-3, Phi-3.5, Phi-4): a Llama layer whose q, k and v are one qkv_proj and gate and up one gate_up_proj,
# whose attention's and MLP's outputs are dropped out (resid_pdrop), and whose RoPE may rotate part of each head.
_PHI3 = (
    *_like(_LLAMA, drop=("dropout",)),
    _head_dim_row(),
    Row("dropout", ("attention_dropout", "resid_pdrop", "embd_pdrop"), default=0.0, combine=_largest_dropout),
    Row("rotary_percent", ("rope_parameters", "partial_rotary_factor"), default=None, combine=_whole_heads_or_share),
    _window(None),  # Phi3Config's default: none
    _kept_nothing("original_max_position_embeddings", lambda v: v, "LongRoPE's scaling: the same cos and sin tables"),
)


# Olmo2Config: a Llama layer without input norms, an Olmo2RMSNorm (its weight times the fp32 normalised input) on the
# attention's and on the MLP's outputs, and on q_proj's and k_proj's whole outputs (q_norm, k_norm); the MLP has no
# biases whatever attention_bias says.
_OLMO2 = (
    *_like(_LLAMA, _norm_row("rms_norm_eps", "rmsnorm_fp32w")),
    _head_dim_row(),
    _UNBIASED_ATTENTION,
)


def _glm_rotary(rope: Any) -> float:
    """GLM's share of each head that RoPE rotates: rope_parameters' partial_rotary_factor (GlmConfig sets 0.5 when the
    file has none)."""
    return _fraction(rope.get("partial_rotary_factor", 0.5) if isinstance(rope, dict) else rope)


# GlmConfig: a Llama layer (LlamaRMSNorm's code) whose gate and up are one gate_up_proj (its tp_plan gathers that
# output), whose Q, K and V carry biases (attention_bias, o_proj none) and whose RoPE turns the first half of each
# head (partial_rotary_factor, 0.5 unless said), its tables interleaved; heads of head_dim (128 by default).
# Glm4Config: the same layer with sandwich norms (post_self_attn_layernorm and post_mlp_layernorm).
_GLM = (
    *_LLAMA, _head_dim_row(128),
    Row("add_qkv_bias", ("attention_bias",), _flag("attention_bias"), default=True),
    Row("rotary_percent", ("rope_parameters",), _glm_rotary, default=0.5),
)


def _refused_if(name: str, refused: bool, what: str) -> Callable[[Any], Any]:
    """A Falcon switch whose `refused` value asks for a layer memcalc has not measured (`what`)."""
    return _checked(lambda value: _flag(name)(value) != refused, f"{name}={str(refused).lower()} is not modelled"
                    f" ({what})")


def _new_layout(value: Any) -> bool:
    """FalconConfig's new_decoder_architecture (absent: the class's False)."""
    return value is not None and _flag("new_decoder_architecture")(value)


def _falcon_groups(values: list[Any]) -> int | None:
    """FalconConfig's K/V groups: new_decoder_architecture's num_kv_heads (absent: every head, multi-head; one group
    a head reads as memcalc's multi-head None), else one for multi_query (the class's default) or multi-head."""
    new, multi_query, groups, heads = values
    if _new_layout(new):
        return None if groups in (None, heads) else groups
    return 1 if multi_query is None or _flag("multi_query")(multi_query) else None


def _falcon_single_norm(values: list[Any]) -> bool:
    """One input_layernorm read by attention and MLP: Falcon-7B's first layout always, new_decoder_architecture's with
    num_ln_in_parallel_attn 1 (Falcon2-11B's); its ln_attn and ln_mlp otherwise (absent: 2, Falcon-40B/180B's)."""
    new, norms = values
    if norms not in (None, 1, 2):
        raise ConfigError(f"num_ln_in_parallel_attn must be 1 or 2, got {short_repr(norms)}")
    if norms == 2 and not _new_layout(new):
        raise ConfigError("num_ln_in_parallel_attn=2 without new_decoder_architecture is not a layer transformers runs"
                          " (FalconDecoderLayer builds ln_attn and ln_mlp, then its forward reads input_layernorm:"
                          " AttributeError)")
    return not _new_layout(new) or norms == 1


# FalconConfig: a LayerNorm (with bias) layer whose attention and MLP both read one input_layernorm's output
# (parallel_attn), RoPE on whole heads; one key and one value head for all queries (multi_query, the class's default;
# false: multi-head, num_kv_heads = a); GELU MLP of ffn_hidden_size (absent: 4h); biases on every linear or none (bias).
# new_decoder_architecture (Falcon-40B/180B) is the grouped query_key_value (fused_qkv: per group a/g query heads, one
# key, one value) of num_kv_heads groups, multi_query ignored, with ln_attn and ln_mlp (single_norm unless
# num_ln_in_parallel_attn is 1). Without ALiBi the attention drops nothing out, so hidden_dropout (on the summed
# output) is memcalc's dropout.
_FALCON = (
    *_sizes(),
    Row("ffn_hidden_size", ("ffn_hidden_size",), default=None),
    Row("mlp", ("activation",), _plain, default="gelu"),
    _norm_row("layer_norm_epsilon", "layernorm"),
    Row("s", ("max_position_embeddings",), default=None),
    Row("dropout", ("hidden_dropout",), default=0.0, combine=_largest_dropout),
    _tied(True),
    Row("add_bias_linear", ("bias",), _flag("bias"), default=False),
    Row("num_query_groups", ("new_decoder_architecture", "multi_query", "num_kv_heads", "num_attention_heads"),
        default=None, combine=_falcon_groups),
    Row("parallel_residual", ("parallel_attn",),
        _refused_if("parallel_attn", False, "Falcon's sequential block: attention, dropout_add, then its MLP"),
        default=True),
    _kept_nothing("alibi", _refused_if("alibi", True, "ALiBi: FalconAttention adds its bias to fp32 scores and"
                                       " drops the probabilities out, which memcalc has not measured"),
                  "RoPE, no ALiBi"),
    Row("fused_qkv", ("new_decoder_architecture",), _flag("new_decoder_architecture"), default=False),
    Row("single_norm", ("new_decoder_architecture", "num_ln_in_parallel_attn"), default=None,
        combine=_falcon_single_norm),
    _kept_nothing("attention_dropout", lambda v: v, "without ALiBi no dropout on the attention"),
)


def _bloom_dropout(values: list[Any]) -> float:
    """BLOOM's attention_dropout (on the probabilities) and hidden_dropout (after the attention and the MLP): memcalc's
    one dropout keeps all their masks or none, so both must be zero or both set (the larger is kept)."""
    largest = _largest_dropout(values)
    if (values[0] > 0) != (values[1] > 0):
        raise ConfigError(f"attention_dropout={values[0]} with hidden_dropout={values[1]}: memcalc's one dropout keeps"
                          " every mask or none; set both to zero, or both above it")
    return largest


# BloomConfig: GPT-2's sequential LayerNorm block (biases everywhere, an MLP of 4h) with ALiBi in place of positions,
# Llama's fp32 softmax, and a tanh GELU that keeps its input alone; no position limit (s is yours to give).
_BLOOM = (
    Row("h", ("hidden_size", "n_embed")), Row("a", ("n_head",)), Row("L", ("n_layer",)),
    Row("vocab_size", ("vocab_size",)),
    _norm_row("layer_norm_epsilon", "layernorm"),
    Row("dropout", ("attention_dropout", "hidden_dropout"), default=0.0, combine=_bloom_dropout),
    _tied(True),
    _kept_nothing("apply_residual_connection_post_layernorm",
                  _flag("apply_residual_connection_post_layernorm"), "which tensor the residual adds"),
    _kept_nothing("slow_but_exact", _refused_if("slow_but_exact", True, "BLOOM's sliced dense layers under"
                                                " pretraining_tp, which memcalc has not measured"), "no slicing"),
)


# CohereConfig (Command R, Command R+): Llama's attention (GQA, RoPE on whole heads, its tables interleaved) and
# SwiGLU, side by side on one CohereLayerNorm (LayerNorm without bias, in fp32) whose output both read, summed into the
# residual together; use_qk_norm (Command R+) adds a CohereLayerNorm on each query and key head; embeddings tied.
_COHERE = (
    *_like(_LLAMA, _norm_row("layer_norm_eps", "layernorm_nb"), _tied(True)),
    _head_dim_row(),
    Row("qk_layernorm", ("use_qk_norm",), _flag("use_qk_norm"), default=False),
    _UNBIASED_ATTENTION,
    # Cohere's logit_scale: a number the logits are multiplied by (null: none)
    _kept_nothing("logit_scale", _checked(lambda v: v is None or _number(v), "logit_scale must be a number or null,"
                                          " got {}"),
                  "outside the decoder layers: the logits times a number keep nothing"),
)


def _dequantized_mxfp4(value: Any) -> Any:
    """The published gpt-oss checkpoints' MXFP4 experts: transformers trains them only dequantized to bf16
    (Mxfp4HfQuantizer.is_trainable is False: "please consider dequantizing the model first"), the layer memcalc
    counts. Another quantization keeps what memcalc has not measured."""
    method = value.get("quant_method") if isinstance(value, dict) else value
    if method != "mxfp4":
        raise ConfigError(f"quantization_config with quant_method {short_repr(method)} is not modelled (memcalc counts"
                          " gpt-oss's MXFP4 checkpoints as trained: dequantized to bf16)")
    return method


# GptOssConfig: a layer of GQA heads of head_dim whose norms are GptOssRMSNorm (Olmo2RMSNorm's code: the weight times
# the fp32 normalised input), whose attention carries biases on q, k, v and o (attention_bias) and a learned sink logit
# per head, every other layer a sliding window (layer_types), RoPE with YaRN scaling (cos and sin scaled: the same
# tables); every layer's MLP sparse: GptOssTopKRouter (a linear with bias, top-k, a softmax over the k chosen logits)
# and GptOssExperts, num_local_experts experts of intermediate_size with biases and the clamped GLU (swiglu_limit,
# swiglu_alpha: a bound and a gain, keeping nothing of their own). hidden_act is unused (the experts' GLU is their own).
# transformers runs it eager: GptOssPreTrainedModel has _supports_sdpa False, and its flash path needs hub kernels.
_GPT_OSS = (
    *_sizes(),
    Row("num_query_groups", ("num_key_value_heads",), default=8),  # GptOssConfig's defaults, gpt-oss-120b's
    _head_dim_row(64),
    Row("ffn_hidden_size", ("intermediate_size",), default=2880),
    Row("num_experts", ("num_local_experts",), default=128),
    Row("moe_router_topk", ("num_experts_per_tok",), default=4),
    _norm_row("rms_norm_eps", "rmsnorm_fp32w"),
    Row("s", ("max_position_embeddings",), default=None),
    Row("dropout", ("attention_dropout",), default=0.0),
    _tied(False),
    Row("add_bias_linear", ("attention_bias",), _flag("attention_bias"), default=True),
    _window(128),
    _LAYER_TYPES, _EXPERTS_IMPLEMENTATION, _AUX_LOSS,
    _kept_nothing("swiglu_limit", _positive_number("swiglu_limit"), "the GLU's clamp bound: the same tensors"),
    _kept_nothing("swiglu_alpha", _positive_number("swiglu_alpha"), "the sigmoid's gain: a scale"),
    _kept_nothing("rope_parameters", lambda v: v, "YaRN scales cos and sin: the same tables"),
    _kept_nothing("hidden_act", lambda v: v, "unused: GptOssExperts runs its own clamped GLU"),
    _kept_nothing("quantization_config", _dequantized_mxfp4, "trained dequantized to bf16 (MXFP4 does not train)"),
)


def _rotates(k: Any) -> bool:
    """GPT-NeoX's, GLM's and GPT-J's layers rotate a share of each head: rotary_percent set."""
    return k.rotary_percent is not None


@dataclass(frozen=True)
class Family:
    """One transformers decoder family, declared once: how memcalc reads its config.json and which of
    transformers' decoder layers its rules were measured on.

    `name` is config.json's model_type (and transformers' models/<name> package); `config_class` the class whose
    `save_pretrained` writes that config.json, and whose `attribute_map` (copied here, checked against the class by
    tests/config/test_hf_families.py) renames a field before it is read, as the class's own __init__ does. `when`
    is what its layer needs beyond `fixed` values (`check_family`: a layer has only the knobs its table fixes or reads);
    `runs_as` the family whose layer this one's config runs (DeepSeek-V2's is DeepSeek-V3's)."""

    name: str
    config_class: str
    layer: str
    architectures: tuple[str, ...]
    rows: tuple[Row, ...]
    fixed: dict[str, Any] = field(default_factory=dict)
    mlps: tuple[str, ...] = ("swiglu",)
    when: Callable[[Any], bool] = lambda k: True
    runs_as: str | None = None
    router: str | None = None  # a MoE family's router class (the probe's --route forces it)
    attribute_map: dict[str, str] = field(default_factory=dict)
    package: str | None = None  # transformers/models/<package>, where it is not the model_type (Gemma 3's text model)
    # the blocks whose fused outputs the config class's base_model_tp_plan gathers ("colwise_gather_output"): under tp
    # every rank runs them whole, and only the next linear's input ("rowwise_split_input") is split
    gathered: tuple[str, ...] = ()
    # parameters its model has whatever the knobs say: the MLP's linears' biases (GPTNeoXMLP's, GPTJMLP's: their
    # config's attention_bias, or none, is the attention's alone), lm_head's bias (GPT-J's, tied embeddings or not)
    mlp_bias: bool = False
    head_bias: bool = False

    @cached_property  # read on every layer_family call
    def norm(self) -> str:
        """The norm its layer runs: its table's (whatever config.json's epsilon says)."""
        return next(row.default for row in self.rows if row.target == "norm")

    @property
    def modeling(self) -> str:
        """The module that defines the family's decoder layer."""
        package = self.package or self.name
        return f"transformers.models.{package}.modeling_{package}"

    def reads(self) -> tuple[str, ...]:
        """The config.json fields memcalc reads for this family, in the table's order."""
        return tuple(dict.fromkeys(name for row in self.rows for name in row.sources))


_ROPE = {"position_embedding_type": "rope"}
_EXPERTS = {"num_experts": "num_local_experts"}  # Mixtral's, Qwen3-MoE's and gpt-oss's attribute_map
_GPT2_NAMES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
               "num_hidden_layers": "n_layer"}  # GPT-2's and GPT-J's attribute_map
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", "LlamaDecoderLayer", ("LlamaForCausalLM",), _like(_LLAMA_HEADS, _LLAMA_BIASES),
               _ROPE),
        Family("mistral", "MistralConfig", "MistralDecoderLayer", ("MistralForCausalLM",), _MISTRAL, _ROPE),
        Family("qwen2", "Qwen2Config", "Qwen2DecoderLayer", ("Qwen2ForCausalLM",), _QWEN2,
               _ROPE | {"add_qkv_bias": True}),  # Q, K, V carry biases
        Family("qwen3", "Qwen3Config", "Qwen3DecoderLayer", ("Qwen3ForCausalLM",), _QWEN3,
               _ROPE | {"qk_layernorm": True}),
        Family("mixtral", "MixtralConfig", "MixtralDecoderLayer", ("MixtralForCausalLM",), _MIXTRAL, _ROPE,
               when=lambda k: k.moe, router="MixtralTopKRouter", attribute_map=_EXPERTS),
        Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeDecoderLayer", ("Qwen2MoeForCausalLM",), _QWEN2_MOE, _ROPE,
               when=lambda k: k.moe and bool(k.moe_shared_expert_intermediate_size), router="Qwen2MoeTopKRouter"),
        Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeDecoderLayer", ("Qwen3MoeForCausalLM",), _QWEN3_MOE,
               _ROPE | {"qk_layernorm": True}, when=lambda k: k.moe, router="Qwen3MoeTopKRouter",
               attribute_map=_EXPERTS),
        Family("gemma", "GemmaConfig", "GemmaDecoderLayer", ("GemmaForCausalLM",), _GEMMA, _ROPE, mlps=("geglu_tanh",)),
        # Gemma 2's, BLOOM's and gpt-oss's classes support no sdpa: unasked, transformers falls back to eager
        Family("gemma2", "Gemma2Config", "Gemma2DecoderLayer", ("Gemma2ForCausalLM",),
               (*_like(_GEMMA, drop=("mlp",)), *_GEMMA2_ONLY), _ROPE | {"sandwich_norm": True, "attention": "eager"},
               mlps=("geglu_tanh",)),
        Family("gemma3_text", "Gemma3TextConfig", "Gemma3DecoderLayer", ("Gemma3ForCausalLM",), _GEMMA3,
               _ROPE | {"sandwich_norm": True, "qk_layernorm": True}, mlps=("geglu_tanh",), package="gemma3"),
        Family("olmo", "OlmoConfig", "OlmoDecoderLayer", ("OlmoForCausalLM",), _OLMO, _ROPE),
        Family("gpt2", "GPT2Config", "GPT2Block", ("GPT2LMHeadModel",), _GPT2,
               {"position_embedding_type": "learned_absolute", "add_bias_linear": True}, mlps=("gelu", "gelu_tanh"),
               attribute_map=_GPT2_NAMES),
        Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXLayer", ("GPTNeoXForCausalLM",), _GPT_NEOX,
               _ROPE | {"fused_qkv": True}, mlps=("gelu", "gelu_tanh"), when=_rotates, mlp_bias=True),
        Family("deepseek_v2", "DeepseekV2Config", "DeepseekV2DecoderLayer", ("DeepseekV2ForCausalLM",), _DEEPSEEK_V2,
               _ROPE, runs_as="deepseek_v3", attribute_map={"num_experts": "n_routed_experts"}),
        Family("deepseek_v3", "DeepseekV3Config", "DeepseekV3DecoderLayer", ("DeepseekV3ForCausalLM",),
               _DEEPSEEK_V3, _ROPE, when=lambda k: k.mla, router="DeepseekV3TopkRouter",
               attribute_map={"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}),
        Family("phi3", "Phi3Config", "Phi3DecoderLayer", ("Phi3ForCausalLM",), _PHI3, _ROPE | {"fused_qkv": True},
               gathered=("attention", "mlp")),
        Family("olmo2", "Olmo2Config", "Olmo2DecoderLayer", ("Olmo2ForCausalLM",), _OLMO2,
               _ROPE | {"post_norm": True, "qk_layernorm": True}, gathered=("attention",)),
        Family("falcon", "FalconConfig", "FalconDecoderLayer", ("FalconForCausalLM",), _FALCON, _ROPE,
               mlps=("gelu", "gelu_tanh"), when=lambda k: k.parallel_residual),
        Family("bloom", "BloomConfig", "BloomBlock", ("BloomForCausalLM",), _BLOOM,
               {"position_embedding_type": "alibi", "alibi": True, "mlp": "gelu_tanh", "add_bias_linear": True,
                "attention": "eager"},
               mlps=("gelu_tanh",),
               attribute_map={"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"}),
        Family("glm", "GlmConfig", "GlmDecoderLayer", ("GlmForCausalLM",), _GLM, _ROPE, when=_rotates,
               gathered=("mlp",)),
        Family("glm4", "Glm4Config", "Glm4DecoderLayer", ("Glm4ForCausalLM",), _GLM, _ROPE | {"sandwich_norm": True},
               when=_rotates, gathered=("mlp",)),
        Family("starcoder2", "Starcoder2Config", "Starcoder2DecoderLayer", ("Starcoder2ForCausalLM",), _STARCODER2,
               _ROPE | {"rotary_percent": 1.0}, mlps=("gelu", "gelu_tanh")),
        Family("gptj", "GPTJConfig", "GPTJBlock", ("GPTJForCausalLM",), _GPTJ,
               _ROPE | {"parallel_residual": True, "single_norm": True}, mlps=("gelu", "gelu_tanh"), when=_rotates,
               attribute_map=_GPT2_NAMES, mlp_bias=True, head_bias=True),
        Family("cohere", "CohereConfig", "CohereDecoderLayer", ("CohereForCausalLM",), _COHERE,
               _ROPE | {"parallel_residual": True, "single_norm": True}),
        Family("gpt_oss", "GptOssConfig", "GptOssDecoderLayer", ("GptOssForCausalLM",), _GPT_OSS,
               _ROPE | {"mlp": "swiglu_clamped", "attention_sinks": True, "attention": "eager"},
               mlps=("swiglu_clamped",), router="GptOssTopKRouter", attribute_map=_EXPERTS),
    )
}
# model_types transformers builds whose layers memcalc has no rules for, and what they lack: refused by name.
UNREAD: dict[str, str] = {
    "mamba": "state-space layers (Mamba's selective scan), no attention",
    "mamba2": "state-space layers (Mamba-2's SSD scan), no attention",
    "falcon_mamba": "state-space layers (Mamba's selective scan), no attention",
    "jamba": "a hybrid of attention and Mamba state-space layers, with MoE",
    "bamba": "a hybrid of attention and Mamba-2 state-space layers",
    "zamba": "a hybrid of Mamba state-space layers and shared attention blocks",
    "zamba2": "a hybrid of Mamba-2 state-space layers and shared attention blocks",
    "falcon_h1": "a hybrid of attention and Mamba-2 state-space heads in parallel",
    "nemotron_h": "a hybrid of attention, Mamba-2 and MLP layers",
    "granitemoehybrid": "a hybrid of attention and Mamba-2 state-space layers, with MoE",
    "recurrent_gemma": "recurrent (RG-LRU) layers between local attention",
    "rwkv": "RWKV's recurrent time-mixing, no attention",
    "cohere2": "two kinds of layer, sliding-window attention with RoPE and global attention without it (memcalc counts"
               " one layer kind L times)",
}


# The family a config that names none runs under --impl hf: the first of these whose layer has its norm and MLP (the
# seed's LayerNorm and GELU are GPT-2's). Any other family's layer runs only where the config names it.
UNNAMED = ("llama", "gpt2")
# The knobs that pick a transformers layer beside its norm and MLP (and add_qkv_bias, a config's Qwen2 biases).
_PICKS = ("num_experts", "moe_shared_expert_intermediate_size", "kv_lora_rank", "rotary_percent", "qk_layernorm",
          "sandwich_norm", "parallel_residual", "post_norm", "fused_qkv", "alibi", "single_norm", "attention_sinks",
          "add_qkv_bias")


def _named(knobs: Any) -> Family:
    """The family the knobs name; where they name none, the first of `UNNAMED` with their norm and MLP, else Llama's."""
    return FAMILIES[knobs.family or next((n for n in UNNAMED if _runs_norm_and_mlp(FAMILIES[n], knobs)), "llama")]


def layer_family(knobs: Any) -> Family:
    """The family whose transformers layer runs these knobs: the one they name, or the one whose layer it runs."""
    family = _named(knobs)
    return FAMILIES[family.runs_as] if family.runs_as else family


def _runs_norm_and_mlp(family: Family, knobs: Any) -> bool:
    return family.norm == knobs.norm and knobs.mlp in family.mlps


def check_name(knobs: Any) -> None:
    """ConfigError for a family memcalc does not read."""
    if knobs.family is not None and knobs.family not in FAMILIES:
        raise ConfigError(f"field 'family': {short_repr(knobs.family)} is not a transformers family memcalc reads"
                          f" ({', '.join(FAMILIES)})")


def check_family(knobs: Any, model: bool = False) -> None:
    """ConfigError (--impl hf) for knobs the family's layer does not run, in one line, never another layer guessed in
    its place: a knob its table neither fixes nor reads left at its default, a fixed one at its value, `when` true. A
    knob set without experts may be a MoE `model`'s dense layer (`Knobs.dense`), its config checked whole."""
    named, family = _named(knobs), layer_family(knobs)
    read = {row.target for row in named.rows} | named.fixed.keys()
    needs = [f"needs {n} {v}" for n, v in named.fixed.items() if n in ("mlp", *_PICKS) and getattr(knobs, n, v) != v]
    has = [f"has no {n}" for n in _PICKS if n not in read and getattr(knobs, n, None) not in (None, False)]
    dense_layer = not model and family.router is not None and not knobs.moe
    if not _runs_norm_and_mlp(family, knobs) or needs or has or not (dense_layer or family.when(knobs)):
        who = f"family {knobs.family}" if knobs.family else "a config that names no family"
        given = ", ".join(f"{n} {v}" for n in ("norm", "mlp", *_PICKS)
                          if (v := getattr(knobs, n, None)) not in (None, False))
        raise ConfigError(f"impl hf: {who} runs transformers' {family.layer}, which"
                          f" {', '.join(needs + has) or 'does not run these knobs'} ({given}); name the family whose"
                          " layer it is (family, --family: `memcalc hf-families` lists them)")
