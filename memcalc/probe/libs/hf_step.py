"""One whole training step of transformers' own `LlamaForCausalLM` under MemTracker (`memcalc measure --step
--impl hf`).

The model is built from memcalc's config as the layer probe builds its layer (nothing is downloaded) and trained as
`memcalc.probe.step` trains memcalc's own GPT, with transformers' own loss. How it is built, laid out under tp, which
family's model it builds, and why `use_cache` is off: docs/probe.md, "transformers' model under `--step`".
"""

from __future__ import annotations

from typing import Any

from memcalc.model.families import FAMILIES, layer_family
from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import hf_tp
from memcalc.probe.libs.hf import routing, transformers_config
from memcalc.probe.libs.hf_shim import cuda_like_dropout
from memcalc.probe.step import BATCH_SEED, StepMeasurement, Trainer, measure_trainer

torch = require_torch()
import transformers  # noqa: E402  (memcalc[hf])


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
    family = layer_family(config).name  # one the step timeline walks (timeline.hf.WALKED refuses the rest before)
    if config.moe and route is None:
        raise ProbeError("impl hf: --step on experts forces the router (--route balanced or all-to-one)")
    hf_config = transformers_config(config, family)
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


def model_loss(model: Any, tokens: torch.Tensor, labels: torch.Tensor, family: str, route: str | None = None,
               k: int = 0) -> torch.Tensor:
    """transformers' own loss, the router forced while forward runs and dropout keeping CUDA's bool mask; the output
    object (and the bf16 logits in it) goes as this returns."""
    with routing(family, route, k), cuda_like_dropout():
        return model(input_ids=tokens, labels=labels).loss
