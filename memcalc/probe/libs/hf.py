"""transformers' own decoder layers, recorded under ledger names (`memcalc measure --impl hf`).

`run_layer` builds the layer memcalc's knobs describe (memcalc.model.impls.hf) from a config object sized from
memcalc's config (nothing is downloaded), feeds it as transformers' own model does, and labels what it keeps with
the rules that name every tensor the layer may keep (memcalc.probe.libs.hf_labels). Which class each family runs,
how it is fed, laid out under tp and checkpointed: docs/probe.md, "transformers' own layers".
"""

from __future__ import annotations

import importlib
import inspect
from functools import partial
from typing import Any, Callable

from memcalc.model.families import FAMILIES, layer_family
from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.evaluate import dim_sizes
from memcalc.model.impls import hf as rules
from memcalc.model.impls import tensors_at
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.collectives import CollectiveLog, LoggedCollective
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import hf_tp
from memcalc.probe.libs.hf_shim import NOTES as NOTES  # measure prints them, and route_note's line for --route
from memcalc.probe.libs.hf_shim import cuda_like_dropout, force_routers
from memcalc.probe.libs.hf_shim import route_note as route_note
from memcalc.probe.libs.hf_labels import MARKERS, attributed, label_rules_for
from memcalc.probe.libs.labels import Labels, merged_rows
from memcalc.probe.measure import INPUT_SEED
from memcalc.probe.recorder import SavedStorage, SavedTensorRecorder, label

torch = require_torch()
import transformers  # noqa: E402  (memcalc[hf]; measure.runner names it when missing)
from torch.utils.checkpoint import checkpoint  # noqa: E402
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask  # noqa: E402


def run_layer(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None, dense: bool = False,
    layer_type: str | None = None, collectives: list[LoggedCollective] | None = None,
) -> tuple[SavedStorage, ...]:
    """Build the layer, record one forward pass under ledger names, run backward once; `route` forces the router,
    `dense` builds a MoE model's dense layer (Qwen2-MoE's layer 0 when moe_layer_freq > 1), `layer_type` the kind of
    gpt-oss's layer 0 ("sliding_attention", its config class's, or "full_attention"); `collectives` gets every
    collective forward and backward issue (memcalc.probe.collectives)."""
    rules.check(config)
    family = layer_family(config).name
    layer, extra = _build(config, family, tp.device, dense, layer_type)
    force_routes(layer, family, route, config.moe_router_topk)  # before the plan, as the step's model (hf_step)
    if tp.size > 1:  # transformers' own plan by its own function (hf_tp); "none" runs at t = 1
        hf_tp.apply(layer, hf_tp.layer_plan(layer, _classes(family)[0]), tp)
    accounting = Accounting(exact=True, device=tp.device.type)
    knobs = Knobs.of(config).dense if dense else Knobs.of(config)
    predicted = tensors_at(knobs, accounting, dim_sizes(config), tp.size)  # at these sizes
    expected = {t.name for t in predicted}
    label_rules = tuple(r for r in label_rules_for(config) if r.tensor.name in expected or r.tensor in MARKERS)
    generator = torch.Generator().manual_seed(INPUT_SEED)  # batch-first (b, s, h), requiring grad as past the embedding
    x = torch.randn(config.b, config.s, config.h, generator=generator).to(DTYPES[config.dtype])
    x = x.to(tp.device).requires_grad_()
    rope = tuple(t for t in predicted if t.model_wide) or None  # the (cos, sin) the model passes its layers
    with cuda_like_dropout(), CollectiveLog() as log:
        with SavedTensorRecorder(layer.parameters(), kept_only=True) as recorder, Labels(layer, label_rules):
            y = layer(x, **extra(x, rope))
            y = y[0] if isinstance(y, tuple) else y  # FalconDecoderLayer returns (output, attention weights)
        log.backward(y, collectives)  # inside the shim: a checkpoint's recompute must drop out alike
    return merged_rows(attributed(recorder.saved, config), rules.IMPLEMENTATION)  # each expert's storages as one row


def force_routes(model: Any, family: str, route: str | None, k: int) -> None:
    """The shim's forced router on each router of `model` for its life (a checkpoint's rerun too), or nothing."""
    if route is not None:  # the family's router class names them
        _, module = _classes(family)
        force_routers(model, (getattr(module, FAMILIES[family].router),), route, k)


# -- building the layer -----------------------------------------------------------------


def _build(config: ModelConfig, family: str, device: torch.device, dense: bool = False, layer_type: str | None = None
           ) -> tuple[Any, Callable[..., dict]]:
    """The layer in training mode, and a function giving its keyword inputs for an input x."""
    _, module = _classes(family)
    hf_config = transformers_config(config, family, layer_type)
    stem = FAMILIES[family].layer.removesuffix("DecoderLayer").removesuffix("Layer").removesuffix("Block")
    rotary_class = getattr(module, f"{stem}RotaryEmbedding", None)  # None: GPT-2's learned positions, BLOOM's ALiBi
    rotary = rotary_class(hf_config) if rotary_class else None
    torch.manual_seed(INPUT_SEED)  # the weights, as the layer initialises them
    layer = getattr(module, FAMILIES[family].layer)(hf_config, layer_idx=_layer_index(config, family, dense))
    layer = layer.to(device=device, dtype=DTYPES[config.dtype]).train()
    _keep_fp32(layer, module)
    _init_experts(layer, hf_config)
    if config.recompute == "full":  # as activation_checkpointing_enable() sets it up (non-reentrant by default)
        enable = transformers.PreTrainedModel._set_gradient_checkpointing
        enable(layer, enable=True, gradient_checkpointing_func=partial(checkpoint, use_reentrant=False))
    inputs = partial(_inputs, hf_config, rotary)
    if family == "falcon":  # FalconDecoderLayer takes alibi (None: RoPE) before the mask
        return layer, lambda x, rope: inputs(x, rope) | {"alibi": None}
    if family == "bloom":
        return layer, lambda x, rope: inputs(x, rope) | {"alibi": _alibi(hf_config, module, x)}
    return layer, inputs


def _layer_index(config: ModelConfig, family: str, dense: bool) -> int:
    """The layer to build: 0 when dense is asked for (a mix's dense layer), else a MoE family's first MoE layer
    (Qwen2-MoE's and Qwen3-MoE's freq - 1; DeepSeek-V3's first past first_k_dense_replace)."""
    first_dense = config.moe_first_dense_layers or 0
    if family == "deepseek_v3" and config.moe and dense and not first_dense:
        raise ProbeError("impl hf: DeepSeek-V3's layers are all MoE without moe_first_dense_layers; set it to measure"
                         " a dense one")
    if dense or FAMILIES[family].router is None:
        return 0
    return first_dense if family == "deepseek_v3" else config.moe_layer_freq - 1


def _keep_fp32(layer: Any, module: Any) -> None:
    """What the model class keeps in fp32 whatever the dtype (`_keep_in_fp32_modules_strict`: DeepSeek-V3's router
    weight and correction bias), put back to fp32 after the layer's cast, as from_pretrained loads it."""
    model = next((v for name, v in vars(module).items() if name.endswith("PreTrainedModel") and name != "PreTrainedModel"),
                 None)  # the family's own (DeepseekV3PreTrainedModel), not transformers' base class it imports
    names = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
        if any(name.endswith(kept) for kept in names):
            tensor.data = tensor.data.float()


def transformers_config(config: ModelConfig, family: str, layer_type: str | None = None) -> Any:
    """The family's config object sized from memcalc's: the fields every class names alike (GPT-2's, BLOOM's and
    GPT-J's through their attribute_map), then its own. The attention implementation is memcalc's knob: "sdpa" for
    flash, "eager" for eager."""
    config_class, _ = _classes(family)
    common = {"hidden_size": config.h, "num_attention_heads": config.a, "num_hidden_layers": config.L,
              "vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_embeddings,
              "attn_implementation": "sdpa" if config.attention == "flash" else "eager"}
    return config_class(**common | _own_fields(config, family, layer_type))


def _own_fields(config: ModelConfig, family: str, layer_type: str | None) -> dict[str, Any]:
    """The fields of the family's class past the common ones, each dropout at memcalc's one probability."""
    gelu, dropout = _gelu(config), config.dropout
    no_ids = {"bos_token_id": None, "eos_token_id": None}  # no token ids past the probe's small vocabulary
    gpt = {"n_inner": config.ffn, "max_position_embeddings": config.s, "activation_function": gelu,
           "attn_pdrop": dropout, "resid_pdrop": dropout, "embd_pdrop": dropout}  # GPT-2's and GPT-J's
    grouped = {"num_key_value_heads": config.groups, "head_dim": config.head_dim, "attention_dropout": dropout}
    if family == "bloom":
        return {"attention_dropout": dropout, "hidden_dropout": dropout}
    if family == "gpt2":  # wpe's rows; GPT2LMHeadModel's lm_head tied to wte unless the config unties it
        return gpt | no_ids | {"max_position_embeddings": config.positions}
    if family == "gptj":  # rotary_dim: the rotated channels of each head
        return gpt | {"rotary_dim": int(config.head_dim * config.rotary_percent)} | no_ids
    if family == "gpt_neox":  # fused QKV with biases (add_bias_linear), partial RoPE
        return {"intermediate_size": config.ffn, "hidden_act": gelu, "max_position_embeddings": config.s,
                "attention_dropout": dropout, "hidden_dropout": dropout, "attention_bias": config.add_bias_linear,
                "use_parallel_residual": config.parallel_residual, "rope_parameters": _rope(config.rotary_percent)}
    if family == "falcon":  # parallel_attn, RoPE; see _falcon_fields
        return _falcon_fields(config) | {"activation": gelu, "hidden_dropout": dropout, "attention_dropout": dropout}
    if family == "starcoder2":  # its class's gelu_pytorch_tanh for memcalc's gelu: torch's kernel keeps its input alone
        return grouped | no_ids | {
            "intermediate_size": config.ffn, "max_position_embeddings": config.s, "residual_dropout": dropout,
            "hidden_act": _gelu(config, "gelu_pytorch_tanh"), "embedding_dropout": dropout,
            "use_bias": config.add_bias_linear, "sliding_window": config.sliding_window}
    if family == "gpt_oss":
        return grouped | _gpt_oss_fields(config, layer_type)
    return _llama_fields(config, family)


def _gelu(config: ModelConfig, plain: str = "gelu") -> str:
    """transformers' activation for memcalc's GELU: gelu_new for its tanh form."""
    return "gelu_new" if config.mlp == "gelu_tanh" else plain


def _rope(share: float) -> dict[str, Any]:
    """rope_parameters rotating `share` of each head's channels, transformers' default RoPE otherwise."""
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": share}


def _falcon_fields(config: ModelConfig) -> dict[str, Any]:
    """FalconConfig's layout: biases on every linear or none, no ALiBi; the first decoder layout (one input_layernorm,
    multi_query for one K/V group, else multi-head) or with fused_qkv new_decoder_architecture (num_kv_heads groups;
    ln_attn and ln_mlp, or one norm with single_norm)."""
    return {"ffn_hidden_size": config.ffn, "max_position_embeddings": config.s, "parallel_attn": True, "alibi": False,
            "multi_query": config.groups == 1 < config.a, "new_decoder_architecture": config.fused_qkv,
            "num_kv_heads": config.groups, "bias": config.add_bias_linear,
            "num_ln_in_parallel_attn": (1 if config.single_norm else 2) if config.fused_qkv else None}


def _gpt_oss_fields(config: ModelConfig, layer_type: str | None) -> dict[str, Any]:
    """GptOssConfig's experts of the expert width with biases, q, k, v and o biases (attention_bias); its YaRN RoPE and
    position limit the class's own (YaRN's scale changes no table's size). Layer 0 is `layer_type`, else the class's
    (sliding) when there is a window, else full."""
    window = config.sliding_window
    first = layer_type or ("sliding_attention" if window is not None else "full_attention")
    return {"intermediate_size": config.expert_ffn, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.moe_router_topk, "sliding_window": window if window is not None else 128,
            "attention_bias": config.add_bias_linear, "layer_types": [first] + ["full_attention"] * (config.L - 1),
            "experts_implementation": str(config.experts_implementation)}


def _llama_fields(config: ModelConfig, family: str) -> dict[str, Any]:
    """A Llama-family class's: GQA, SwiGLU (or the tanh GeGLU), RMSNorm, RoPE; then its family's own."""
    return {"num_key_value_heads": config.groups, "intermediate_size": config.ffn, "attention_dropout": config.dropout,
            "hidden_act": "gelu_pytorch_tanh" if config.mlp == "geglu_tanh" else "silu",
            "max_position_embeddings": config.s} | _moe_fields(config, family) | _family_fields(config, family)


def _family_fields(config: ModelConfig, family: str) -> dict[str, Any]:
    """What one Llama family's class names past Llama's. head_dim is memcalc's kv_channels (h/a unless set):
    Qwen3Config's own default is 128, whatever h/a is; DeepseekV3Config's is the RoPE part's."""
    head = {"head_dim": config.head_dim}
    no_ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}  # none past a small vocabulary
    if family == "deepseek_v3":  # plain RoPE (YaRN scales cos and sin, the same tensors), interleaved (its default)
        dense = {} if config.moe else {"first_k_dense_replace": config.L}  # with experts `_moe_fields` places them
        return {"q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
                "qk_rope_head_dim": config.qk_rope_head_dim, "qk_nope_head_dim": config.qk_nope_head_dim,
                "v_head_dim": config.v_head_dim, "rope_interleave": True} | dense
    if family == "mistral":  # MistralConfig's default window is 4096: None, memcalc's full causal, is said
        return head | {"sliding_window": config.sliding_window}
    if family in ("gemma2", "gemma3_text"):  # soft-capping (the scores' and the logits'), the tanh GeGLU's field
        window = {"sliding_window": config.sliding_window} if config.sliding_window is not None else {}
        return head | window | {"attn_logit_softcapping": config.attn_logit_softcapping,
                                "final_logit_softcapping": config.final_logit_softcapping,
                                "hidden_activation": "gelu_pytorch_tanh"}
    if family == "phi3":  # RoPE on rotary_percent of each head (1 when unset), the residual dropouts, its window
        return head | no_ids | {"resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
                                "rope_parameters": _rope(config.rotary_percent or 1.0),
                                "sliding_window": config.sliding_window}
    if family in ("glm", "glm4"):  # its rotary share, its Q, K, V biases
        return head | no_ids | {"rope_parameters": _rope(config.rotary_percent), "attention_bias": config.add_qkv_bias}
    if family == "cohere":
        return head | no_ids | {"use_qk_norm": config.qk_layernorm}
    return head


def _moe_fields(config: ModelConfig, family: str) -> dict[str, Any]:
    """A MoE class's fields (Mixtral's experts' width is its intermediate_size), the experts' implementation (memcalc's
    knob), no router jitter; the probe's MoE layer is Qwen's freq - 1, DeepSeek's first past first_k_dense_replace."""
    experts = {"num_experts_per_tok": config.moe_router_topk,
               "experts_implementation": str(config.experts_implementation)}
    routed = experts | {"moe_intermediate_size": config.expert_ffn, "norm_topk_prob": not config.moe_router_pre_softmax}
    if family == "mixtral":
        return experts | {"num_local_experts": config.num_experts, "intermediate_size": config.expert_ffn,
                          "router_jitter_noise": 0.0}
    if family in ("qwen2_moe", "qwen3_moe"):  # Qwen3-MoE: Qwen2-MoE's router and experts, no shared expert
        shared = {"shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
                  "qkv_bias": config.add_qkv_bias} if family == "qwen2_moe" else {}
        return routed | shared | {"num_experts": config.num_experts, "decoder_sparse_step": config.moe_layer_freq,
                                  "mlp_only_layers": [], "num_hidden_layers": max(config.L, config.moe_layer_freq)}
    if family == "deepseek_v3" and config.moe:
        first_dense = config.moe_first_dense_layers or 0
        return routed | {"n_routed_experts": config.num_experts, "first_k_dense_replace": first_dense,
                         "n_shared_experts": config.moe_shared_expert_intermediate_size // config.expert_ffn,
                         "n_group": 2 if config.moe_router_topk <= config.num_experts // 2 else 1,  # a real choice
                         "topk_group": 1, "num_hidden_layers": max(config.L, first_dense + 1)}
    return {}


def _alibi(hf_config: Any, module: Any, x: torch.Tensor) -> torch.Tensor:
    """BLOOM's (b * a, 1, s) ALiBi bias as BloomModel builds it without padding: each head's slope times the key
    position, in x's dtype (no gradient: it keeps nothing)."""
    slopes = module._get_alibi_slopes(hf_config.n_head, x.device)
    alibi = slopes[:, None, None] * torch.arange(x.shape[1], device=x.device)
    return alibi.repeat(x.shape[0], 1, 1).to(x.dtype)


def _init_experts(layer: Any, hf_config: Any) -> None:
    """The experts' 3-D weights and the router's are torch.empty (Qwen's and DeepSeek's routers zeros) until the model's
    `_init_weights`, as are gpt-oss's expert biases and attention sinks; give them its normal(0, initializer_range), so
    the real router's choice depends on the data."""
    for name, parameter in layer.named_parameters():
        if name.startswith(("mlp.experts.", "mlp.gate.", "mlp.router.", "self_attn.sinks")):  # gpt-oss: router, sinks
            torch.nn.init.normal_(parameter, std=hf_config.initializer_range)


def _classes(family: str) -> tuple[type, Any]:
    """A family's transformers config class and modeling module (transformers/models/<name>/modeling_<name>.py)."""
    entry = FAMILIES[family]
    module = importlib.import_module(entry.modeling)
    return getattr(transformers, entry.config_class), module


def _inputs(hf_config: Any, rotary: Any, x: torch.Tensor, rope: tuple[SavedTensor, SavedTensor] | None) -> dict:
    """What transformers' model passes its layers: the causal mask, and for Llama (cos, sin) and position ids;
    `rope` names the cos and sin tables where the prediction has them."""
    position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, s), as LlamaModel makes them
    layer_type = getattr(hf_config, "layer_types", None)  # Gemma 2/3's and gpt-oss's: layer 0's kind
    sliding = bool(layer_type) and layer_type[0] == "sliding_attention"
    mask = (create_sliding_window_causal_mask if sliding else create_causal_mask)(  # as the model makes each kind's
        config=hf_config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=position_ids
    )
    if rotary is None:
        return {"attention_mask": mask}
    # Gemma 3's tables differ by layer type: layer 0's
    kind = (layer_type[0],) if layer_type and "layer_type" in inspect.signature(rotary.forward).parameters else ()
    cos, sin = rotary.to(x.device)(x, position_ids, *kind)  # (1, s, d) each, in x's dtype
    if rope is not None:
        label(cos[0], rope[0])
        label(sin[0], rope[1])
    return {"attention_mask": mask, "position_embeddings": (cos, sin), "position_ids": position_ids}
