"""One whole training step of memcalc's own GPT whose attention is megatron-core's MLASelfAttention (`memcalc measure
--step --impl megatron` with kv_lora_rank set).

The model is the probe's GPT (memcalc.probe.step): its embedding, norms, MLP, residual adds, output layer and loss
are the probe's, as for every --step of --impl megatron; each layer's attention is megatron-core 0.16's own
`MLASelfAttention`, built from the spec megatron's GPT decoder block gives a latent-attention layer, with the
TransformerConfig the layer probe sizes from memcalc's config (memcalc.probe.libs.megatron: `transformer_config`,
`layer_spec`, the shim's latent norms and core). Its down projections, latent norms, up projections, RoPE, local
core attention (DotProductAttention: baddbmm, the fused causal softmax or torch's, bmm) and linear_proj run as
written, inside `megatron_shim.cpu_megatron()` for the whole step (its softmax extension and dropout are called
in backward too), under megatron's parallel_state on the probe's group.

It is trained as memcalc's GPT is (Megatron's fp32 gradient buffer, fp32 master weights, fused AdamW), stepped once,
then one step measured by `measure_trainer`. Two things megatron keeps outside any step are not tensors MemTracker
sees, as on CUDA they are not in the ledger: the global memory buffer the core's baddbmm writes into (made in the
warm-up step, reused), and RotaryEmbedding's frequencies (its forward is lru-cached).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.libs import megatron as probe
from memcalc.probe.libs.megatron_shim import cpu_megatron, layer_spec, seed_rng_tracker
from memcalc.probe.step import BATCH_SEED, GPT, StepMeasurement, Trainer, measure_trainer

torch = require_torch()


def measure_megatron_mla_step_on_rank(tp: TensorParallelGroup, config: ModelConfig,
                                      strategy: Strategy) -> StepMeasurement:
    """memcalc's GPT with megatron-core's MLASelfAttention in every layer, a warm-up step, then one step measured
    under MemTracker."""
    with warmed_up(tp, config, strategy) as trainer:
        return measure_trainer(trainer, tp, strategy)


@contextmanager
def warmed_up(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> Iterator[Trainer]:
    """memcalc's GPT with megatron-core's MLASelfAttention in every layer, stepped once; megatron's shim and
    parallel state stay on while the trainer is used (the softmax kernel and the dropout run in backward too)."""
    if config.add_bias_linear:
        raise ProbeError("impl megatron: --step adds no bias after MLASelfAttention's linear_proj (skip_bias_add);"
                         " set add_bias_linear: false, as DeepSeek trains")
    sequence_parallel = strategy.sequence_parallel and tp.size > 1
    with warnings.catch_warnings():
        probe._quiet()
        # megatron's torch softmax calls a torch.nn.Softmax made in forward, gone by backward: MemTracker's module
        # hooks find it dead and say so (what it measures is unchanged)
        warnings.filterwarnings("ignore", "Module is None", UserWarning)
        with cpu_megatron(), probe._model_parallel(tp):
            seed_rng_tracker(BATCH_SEED, tp.rank)  # the core's attention dropout forks the model-parallel state
            torch.manual_seed(BATCH_SEED + tp.rank)
            model = GPT(config, tp, strategy)
            torch.manual_seed(probe.WEIGHT_SEED)
            for layer in model.layers:
                layer.attention = latent_attention(config, tp, sequence_parallel)
            yield Trainer.around(config, model, model)


def latent_attention(config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool) -> Any:
    """megatron-core's MLASelfAttention from the latent layer's spec, called as the probe's layer calls its
    attention: (s, b, h) in, its output out (no bias: see above), with no attention mask (the core's is causal)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    megatron_config = probe.transformer_config(config, tp.size, sequence_parallel)
    spec = layer_spec(megatron_config, 0).submodules.self_attention
    mla = build_module(ModuleSpec(module=_called_as_the_probe_calls(spec.module), params=spec.params,
                                  submodules=spec.submodules), config=megatron_config, layer_number=1)
    return mla.to(tp.device)


def _called_as_the_probe_calls(attention: type) -> type:
    """`attention` (MLASelfAttention) taking the hidden states alone and returning its output alone: its module
    names stay megatron's (attention.linear_kv_down_proj), as MemTracker reports them."""

    class LatentAttention(attention):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            output, _ = super().forward(hidden_states, None)
            return output

    return LatentAttention
