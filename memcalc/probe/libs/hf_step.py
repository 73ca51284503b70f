"""One whole training step of transformers' own `LlamaForCausalLM` under MemTracker (`memcalc measure --step
--impl hf`).

The model is built from memcalc's config as the layer probe builds its layer (nothing is downloaded) and trained as
`memcalc.probe.step` trains memcalc's own GPT, with transformers' own loss. How it is built, laid out under tp, which
family's model it builds, and why `use_cache` is off: docs/probe.md, "transformers' model under `--step`".
"""

from __future__ import annotations

from typing import Any, Callable

from memcalc.model.families import FAMILIES, layer_family
from memcalc.config.schema import ModelConfig
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import hf_tp
from memcalc.probe.libs.hf import force_routes, transformers_config
from memcalc.probe.libs.hf_shim import cuda_like_dropout, dropout_in_rerun
from memcalc.probe.step import BATCH_SEED, StepMeasurement, Trainer, check_route, measure_trainer

torch = require_torch()
import transformers  # noqa: E402  (memcalc[hf])


def measure_hf_step_on_rank(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None,
) -> StepMeasurement:
    """Build LlamaForCausalLM (MixtralForCausalLM with experts), run a warm-up step, then measure one step under
    MemTracker."""
    return measure_trainer(warmed_up(tp, config, route), tp, strategy)


def warmed_up(tp: TensorParallelGroup, config: ModelConfig, route: str | None = None) -> Trainer:
    """transformers' LlamaForCausalLM (with experts MixtralForCausalLM or Qwen2MoeForCausalLM, the router forced to
    `route`) in training mode with memcalc's trainer, stepped once."""
    model, loss = causal_lm(config, route, DTYPES[config.dtype], tp.device, tp.size)
    checkpointed(model, config)
    return Trainer.around(config, model, loss)


def causal_lm(config: ModelConfig, route: str | None, dtype: torch.dtype, device: torch.device, t: int = 1
              ) -> tuple[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The family's causal-LM model (one the step timeline walks: timeline.hf.WALKED refuses the rest before) in
    `dtype`, in training mode, `use_cache` off as transformers' Trainer sets it (TrainingArguments.use_cache: False);
    and its loss, (tokens, labels) -> transformers' own, dropout keeping CUDA's bool mask while forward runs; the
    router forced to `route` for the model's life (a gradient checkpoint reruns it inside backward). The output object
    (and the bf16 logits in it) goes as the loss returns. Over t > 1 ranks the built model is saved and loaded for this
    rank as from_pretrained(distributed_config=...) loads a checkpoint (`hf_tp.loaded`), the way users run tp."""
    family = layer_family(config).name
    check_route(config, route)
    hf_config = transformers_config(config, family)
    hf_config.use_cache = False
    if family == "deepseek_v3" and config.moe:  # every group eligible: the group-limited top-k keeps the forced route
        hf_config.topk_group = hf_config.n_group  # (the eager loop's counts kbs/E; the choice itself saves nothing)
    torch.manual_seed(BATCH_SEED)  # the weights, as the model initialises them
    model = getattr(transformers, FAMILIES[family].architectures[0])._from_config(hf_config, dtype=dtype)
    if t > 1:
        model = hf_tp.loaded(model, dtype, t)
    k = config.moe_router_topk if config.moe else 0

    force_routes(model, family, route, k)  # in forward and in a gradient checkpoint's rerun alike

    def loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with cuda_like_dropout():
            return model(input_ids=tokens, labels=labels).loss

    return model.to(device).train(), loss


def checkpointed(model: Any, config: ModelConfig) -> None:
    """Under recompute full, transformers' gradient checkpointing as the Trainer's activation_checkpointing=True turns
    it on: activation_checkpointing_enable() with its defaults (gradient_checkpointing_enable, its deprecated alias,
    calls the same), a non-reentrant torch.utils.checkpoint around each decoder layer's forward, early stop on; its
    rerun drops out through the probe's CUDA-like shim too (`dropout_in_rerun`, the checkpoint's own context_fn)."""
    if config.recompute == "full":
        model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": dropout_in_rerun})
