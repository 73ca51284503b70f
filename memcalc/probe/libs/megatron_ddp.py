"""megatron-core's DistributedDataParallel around its own GPTModel on torch's fake group: the buffers the distributed
optimizer lays out, read from megatron's objects (memcalc.sizing.states.megatron_buffers models them).

Built as Megatron-LM's training builds it (Float16Module around a bf16 or fp16 model, every parameter in its dtype;
DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True), the rest its defaults) on
the local spec (no Transformer Engine). Nothing is run: the buffers exist once DDP is built. Context parallelism is
parallel_state's alone (DDP shards over its dp*cp group): the local spec's attention refuses cp, and no parameter
depends on it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

from memcalc.config.schema import MEGATRON_SPLIT, ModelConfig
from memcalc.probe import require_torch
from memcalc.probe.libs.megatron import _quiet, transformer_config
from memcalc.probe.libs.megatron_shim import cpu_buffers, mla_core_attention

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)


@dataclass(frozen=True)
class Buffer:
    """One _ParamAndGradBuffer: its elements (padding included) and what each data-parallel rank's optimizer shard
    holds of its parameters (the fp32 main parameters' elements, summed over its buckets)."""

    numel: int
    shards: tuple[int, ...]
    expert: bool  # the experts' buffer, sharded over the expert data-parallel group (else over dp*cp)


def ddp_buffers(config: ModelConfig, stage: int = 0) -> tuple[Buffer, ...]:
    """The buffers of the first rank of pipeline stage `stage` (its rank among the pp), each model chunk's, in
    order."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

    c = config
    world = c.t * c.cp * c.dp * c.pp
    with warnings.catch_warnings():
        _quiet()
        with cpu_buffers():
            from megatron.core import parallel_state

            dist.init_process_group("fake", rank=stage * world // c.pp, world_size=world, store=FakeStore())
            try:
                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=c.t, pipeline_model_parallel_size=c.pp, context_parallel_size=c.cp,
                    virtual_pipeline_model_parallel_size=c.vpp, expert_model_parallel_size=c.ep,
                    expert_tensor_parallel_size=c.t, create_gloo_process_groups=False)
                return tuple(x for chunk in range(c.vpp or 1) for x in _chunk_buffers(c, chunk))
            finally:
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()


def _chunk_buffers(config: ModelConfig, chunk: int) -> list[Buffer]:
    """Model chunk `chunk` of this rank's stage: GPTModel, Float16Module, DDP; its buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage, is_vp_first_stage
    from megatron.core.pipeline_parallel.utils import is_vp_last_stage
    from megatron.core.transformer.module import Float16Module
    from megatron.core import parallel_state

    c = config
    core = transformer_config(c, c.t, False)
    core = replace(core, **pipeline_fields(c), pipeline_dtype=core.params_dtype)
    pp_group, vpp = parallel_state.get_pipeline_model_parallel_group(), c.vpp
    spec = get_gpt_decoder_block_spec(core, use_transformer_engine=False, normalization=core.normalization,
                                      vp_stage=chunk if vpp else None)
    for layer in spec.layer_specs if c.mla else ():  # the local core takes no MLA widths: the shim's (no parameters)
        layer.submodules.self_attention.submodules.core_attention = mla_core_attention()
    model = GPTModel(
        core, spec,
        vocab_size=_padded_vocab(c), max_sequence_length=c.positions,
        pre_process=is_pp_first_stage(pp_group) and is_vp_first_stage(chunk, vpp),
        post_process=is_pp_last_stage(pp_group) and is_vp_last_stage(chunk, vpp),
        position_embedding_type=c.position_embedding_type, share_embeddings_and_output_weights=c.tie_embeddings,
        vp_stage=chunk if vpp else None,
    )
    module = Float16Module(core, model) if core.bf16 or core.fp16 else model  # as Megatron-LM's get_model wraps it
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(core, ddp_config, module)
    return [*(_read(x, False) for x in ddp.buffers), *(_read(x, True) for x in ddp.expert_parallel_buffers)]


def pipeline_fields(config: ModelConfig) -> dict[str, Any]:
    """TransformerConfig's pipeline layout for memcalc's: the L layers over pp stages of vpp model chunks each, split
    as Megatron's split knobs say (their names are megatron-core's)."""
    c = config
    return dict(num_layers=c.L, pipeline_model_parallel_size=c.pp, virtual_pipeline_model_parallel_size=c.vpp,
                **{name: getattr(c, name) for name in MEGATRON_SPLIT})


def _padded_vocab(config: ModelConfig) -> int:
    """The vocabulary as Megatron-LM's training pads it before it builds GPTModel (megatron/training's
    _vocab_size_with_padding, not in megatron-core): up to a multiple of make_vocab_size_divisible_by * t."""
    multiple = config.make_vocab_size_divisible_by * config.t
    return -(-config.vocab_size // multiple) * multiple


def fullest(config: ModelConfig, buffers: tuple[Buffer, ...], stage: int = 0) -> int:
    """The most parameter elements any rank of pipeline stage `stage` holds in its shards of `buffers`: each rank's
    place in its dp*cp group and in its expert data-parallel group as megatron's RankGenerator makes them
    (parallel_state's default order, expert tensor parallelism t), each group's ranks in torch's order."""
    from megatron.core.parallel_state import RankGenerator

    c, order = config, "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=c.t, ep=1, dp=c.dp, pp=c.pp, cp=c.cp, order=order, rank_offset=0).get_ranks("dp-cp")
    expert_dp = c.t * c.cp * c.dp // (c.t * c.ep)
    expert = RankGenerator(tp=c.t, ep=c.ep, dp=expert_dp, pp=c.pp, cp=1, order=order, rank_offset=0).get_ranks("dp")
    places = [{rank: i for group in groups for i, rank in enumerate(sorted(group))} for groups in (dense, expert)]
    width = c.t * c.cp * c.dp  # a stage's ranks
    ranks = range(stage * width, (stage + 1) * width)
    return max(sum(x.shards[places[x.expert][rank]] for x in buffers) for rank in ranks)


def _read(buffer: Any, expert: bool) -> Buffer:
    """The buffer's elements and each rank's shard of it, cut by the distributed optimizer's own range map."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    ranks = buffer.data_parallel_world_size
    shards = [0] * ranks
    for bucket in buffer.buckets:
        size = bucket.grad_data.numel() // ranks
        for r in range(ranks):
            start = bucket.offset + r * size
            params = DistributedOptimizer._build_model_gbuf_param_range_map(
                buffer.param_index_map, Range(start, start + size), bucket.offset)
            shards[r] += sum(len(x["param"]) for x in params.values())
    return Buffer(buffer.numel, tuple(shards), expert)
