"""One training step of memcalc's GPT with megatron-core's MoELayer or MLASelfAttention in its layers, under MemTracker.

The model, what runs inside the shim, and what megatron keeps outside any step: docs/probe.md, "megatron-core's modules
under `--step`".
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.libs.megatron import WEIGHT_SEED, check_expert_biases, inside_megatron, transformer_config
from memcalc.probe.libs.megatron_shim import layer_spec, seed_rng_tracker
from memcalc.probe.step import BATCH_SEED, GPT, StepMeasurement, Trainer, measure_trainer

torch = require_torch()
from torch import nn  # noqa: E402  (after the install check above)


def measure_megatron_step_on_rank(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None,
) -> StepMeasurement:
    """Build the GPT with megatron-core's modules on this rank, run a warm-up step, then measure one step."""
    with inside_megatron(tp, config, route):
        return measure_trainer(warmed_up(tp, config, strategy), tp, strategy)


def warmed_up(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> Trainer:
    """The GPT with MoELayer MLPs and MLASelfAttention where the knobs ask, stepped once (`inside_megatron`)."""
    if config.mla and config.add_bias_linear:
        raise ProbeError("impl megatron: --step adds no bias after MLASelfAttention's linear_proj (skip_bias_add);"
                         " set add_bias_linear: false, as DeepSeek trains")
    check_expert_biases(config)
    megatron_config = transformer_config(config, tp.size, strategy.sequence_parallel and tp.size > 1)
    torch.manual_seed(WEIGHT_SEED)
    seed_rng_tracker(WEIGHT_SEED, tp.rank)  # the core's attention dropout forks the model-parallel state
    mlps = partial(_moe_layer, config, megatron_config, tp.device)
    model = GPT(config, tp, strategy, mlps)
    if config.mla:
        for layer in model.layers:
            layer.attention = latent_attention(megatron_config, tp.device)
    torch.manual_seed(BATCH_SEED + tp.rank)  # dropout masks
    return Trainer.around(config, model, model)


def _moe_layer(config: ModelConfig, megatron_config: Any, device: torch.device, i: int) -> nn.Module | None:
    """Layer i's MLP: the MoELayer its spec gives a MoE layer; None for a dense one (the probe's own MLP)."""
    if not config.is_moe_layer(i):
        return None
    return _output_only(layer_spec(megatron_config, i).submodules.mlp, megatron_config, i + 1, device)


def latent_attention(megatron_config: Any, device: torch.device) -> nn.Module:
    """megatron-core's MLASelfAttention from the latent layer's spec, with no attention mask (the core's is causal).
    Its module names stay megatron's (attention.linear_kv_down_proj), as MemTracker reports them."""
    spec = layer_spec(megatron_config, 0).submodules.self_attention
    return _output_only(spec, megatron_config, 1, device, None)


def _output_only(spec: Any, megatron_config: Any, layer_number: int, device: torch.device, *args: Any) -> nn.Module:
    """The spec's module, called as the probe's layer calls its attention and its MLP: (s, b, h) in (then `args`), its
    output alone out (the probe's layer adds it; the bias is None without biases)."""
    from megatron.core.transformer.spec_utils import build_module

    class OutputOnly(spec.module):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            output, bias = super().forward(hidden_states, *args)
            assert bias is None, "no biases here (megatron.check_expert_biases, warmed_up)"
            return output

    return build_module(replace(spec, module=OutputOnly), config=megatron_config, layer_number=layer_number).to(device)
