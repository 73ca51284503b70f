"""One whole training step of transformers' own `LlamaForCausalLM` under MemTracker (`memcalc measure --step
--impl hf`).

The model is built from memcalc's config as the layer probe builds its layer (`memcalc.probe.libs.hf.llama_config`:
L decoder layers, GQA, SwiGLU, RMSNorm, RoPE, the attention implementation the config asks for, tied or untied
embeddings), through `_from_config(dtype=...)` as transformers builds a model in a dtype: the weights in bf16
(or fp16), the rotary embedding's `inv_freq` buffers in fp32 (made by an explicit float arange). Nothing is
downloaded. `use_cache` is off, as transformers' Trainer sets it (`TrainingArguments.use_cache`, False): with
LlamaConfig's default (True) LlamaModel builds a DynamicCache in training too, which keeps every layer's K and V
until the output object goes.

It is trained as `memcalc.probe.step` trains memcalc's own GPT, with the same pieces: Megatron's fp32 gradient
buffer (`MainGrads`), fp32 master weights and fused AdamW (`MixedPrecisionAdamW`), one warm-up step, then one
step measured by `measure_trainer`. The loss is transformers' own: the labels go into the model, whose
`ForCausalLMLoss` upcasts the logits to fp32, shifts the labels by one and takes the mean cross-entropy. As
transformers' Trainer does (`compute_loss` returns the loss alone), only the loss outlives the forward call: the
output object, and with it the bf16 logits, is dropped at once.

Under tp (rank 0 of t through the fake group) the built model is laid out by the plan from_pretrained(tp_plan="auto")
resolves (`memcalc.probe.libs.hf_tp.model_plan`), applied by transformers' apply_tensor_parallelism: every weight
but the norms a DTensor shard. (from_pretrained's own path needs accelerate and a checkpoint; this applies the same
plan with the same function to the model `_from_config` built.) The trainer works on the weights' local shards, and
takes this rank's rows of the embedding's Replicate gradient (`memcalc.probe.step.MainGrads`). A tied model is not
laid out: apply_tensor_parallelism looks lm_head.weight up among named_parameters(), which name a tied weight once.

With norm rmsnorm_1p and mlp geglu_tanh it builds GemmaForCausalLM (GemmaRMSNorm, the tanh GeGLU, the embedding
scaled by sqrt(h)); with sandwich_norm too Gemma2ForCausalLM (every other layer sliding, the scores soft-capped if
attn_logit_softcapping is set, the logits if final_logit_softcapping is); with fused_qkv
Phi3ForCausalLM (one qkv_proj, one gate_up_proj). With qk_layernorm it builds Qwen3ForCausalLM (Llama's layer, each
query and key head RMS-normalised before RoPE); with add_qkv_bias Qwen2ForCausalLM (Llama's layer, q_proj, k_proj
and v_proj with biases; no sliding window, Qwen2Config's default).
A config with experts builds MixtralForCausalLM instead (Qwen2MoeForCausalLM with shared experts,
Qwen3MoeForCausalLM with qk_layernorm): every layer a sparse MoE block whose experts run the config's
experts_implementation (grouped_mm or the eager loop), its router forced to the `route` given
(memcalc.probe.libs.hf_shim.forced_routing), so the tokens each expert gets are known. No auxiliary loss
(output_router_logits False, both models' default). Under recompute full each decoder layer's forward runs inside
transformers' gradient checkpointing, turned on as the Trainer does (`checkpointed`).
"""

from __future__ import annotations

from typing import Any

from memcalc.model.families import FAMILIES
from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import hf_tp
from memcalc.probe.libs.hf import llama_config, model_family, routing
from memcalc.probe.libs.hf_shim import cuda_like_dropout
from memcalc.probe.step import BATCH_SEED, StepMeasurement, Trainer, measure_trainer, own_model

torch = require_torch()
import transformers  # noqa: E402  (memcalc[hf])


# The families whose model --step builds (FAMILIES' first architecture), as memcalc.probe.libs.hf reads the config.
_STEPPED = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "phi3")


def measure_hf_step_on_rank(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None,
) -> StepMeasurement:
    """Build LlamaForCausalLM (MixtralForCausalLM with experts), run a warm-up step, then measure one step under
    MemTracker."""
    return measure_trainer(warmed_up(tp, config, strategy, route), tp, strategy)


def warmed_up(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None) -> Trainer:
    """transformers' LlamaForCausalLM (with experts MixtralForCausalLM or Qwen2MoeForCausalLM, the router forced to
    `route`) in training mode with memcalc's trainer, stepped once."""
    if strategy.sequence_parallel:
        raise ProbeError(f"impl hf runs no sequence parallelism (got {strategy.name})")
    if tp.size > 1 and config.tie_embeddings:
        raise ProbeError("impl hf: transformers' apply_tensor_parallelism cannot lay out tied embeddings (it looks"
                         " lm_head.weight up among named_parameters(), which name a tied weight once); untie them")
    family = stepped_family(config)
    if config.moe and route is None:
        raise ProbeError("impl hf: --step on experts forces the router (--route balanced or all-to-one)")
    hf_config = llama_config(config, family)
    hf_config.use_cache = False  # as transformers' Trainer sets it (TrainingArguments.use_cache: False)
    torch.manual_seed(BATCH_SEED)  # the weights, as the model initialises them
    model = getattr(transformers, FAMILIES[family].architectures[0])._from_config(hf_config, dtype=DTYPES[config.dtype])
    model = model.to(tp.device).train()
    if tp.size > 1:  # the plan from_pretrained(tp_plan="auto") applies, by the function it applies it with
        hf_tp.apply(model, hf_tp.model_plan(model, tp.size), tp)
    checkpointed(model, config)
    k = config.moe_router_topk if config.moe else 0
    return Trainer.around(config, model, lambda tokens, labels: model_loss(model, tokens, labels, family, route, k))


def checkpointed(model: Any, config: ModelConfig) -> None:
    """Under recompute full, transformers' gradient checkpointing as the Trainer's activation_checkpointing=True turns
    it on: activation_checkpointing_enable() with its defaults (gradient_checkpointing_enable, its deprecated alias,
    calls the same), a non-reentrant torch.utils.checkpoint around each decoder layer's forward, early stop on."""
    if config.recompute == "full":
        model.activation_checkpointing_enable()


def stepped_family(config: ModelConfig) -> str:
    """The family whose model --step builds: Llama's for a dense layer, Qwen2's with add_qkv_bias, Qwen3's with
    qk_layernorm, Gemma's with its norm, Phi-3's with fused_qkv, the MoE family's with experts."""
    family = model_family(config) if own_model(config) else "llama"
    if family not in _STEPPED:
        raise ProbeError(f"impl hf: --step builds Llama's, Qwen3's, Gemma's, Gemma 2's, Phi-3's, Mixtral's, Qwen2-MoE's"
                         f" or Qwen3-MoE's model; these knobs are {family}'s")
    return family


def model_loss(model: Any, tokens: torch.Tensor, labels: torch.Tensor, family: str, route: str | None = None,
               k: int = 0) -> torch.Tensor:
    """transformers' own loss, the router forced while forward runs and dropout keeping CUDA's bool mask; the output
    object (and the bf16 logits in it) goes as this returns."""
    with routing(family, route, k), cuda_like_dropout():
        return model(input_ids=tokens, labels=labels).loss
