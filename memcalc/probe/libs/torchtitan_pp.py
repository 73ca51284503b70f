"""One rank of torchtitan's pipeline (its default schedule, 1F1B) stepped under MemTracker, on the fake process group.

torchtitan's Llama3Model is split as its pipeline_llm splits it (its own _generate_llm_fqn_per_model_part and
_split_module), the rank's chunk wrapped in torch's PipelineStage and scheduled by torchtitan's own
_build_pipeline_schedule. How it runs on the fake group, and where it departs from torchtitan's trainer: docs/probe.md,
"torchtitan's pipeline under `--step`".
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import torchtitan as titan
from memcalc.probe.libs import torchtitan_shim as shim
from memcalc.probe.libs.torchtitan_step import data_parallel, flex_inputs, initialised, parallelized, trainers_loss
from memcalc.probe.step import StepMeasurement, Trainer, batch, check_route, measure_trainer
from memcalc.sizing.pipeline import torchtitan_microbatches

torch = require_torch()

from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss  # noqa: E402  (memcalc[torchtitan])
from torchtitan.config.configs import ParallelismConfig  # noqa: E402
from torchtitan.distributed import pipeline_parallel  # noqa: E402
from torchtitan.tools.utils import set_default_dtype  # noqa: E402
from torch.distributed.pipelining import PipelineStage  # noqa: E402


def measure_torchtitan_pp_step_on_rank(group: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                       route: str | None = None, device: str = "cpu") -> StepMeasurement:
    """This rank's pipeline stage of torchtitan's Llama3Model (the group is the pp x t world, under tp each stage's
    chunk laid out by its own plan over its TP ranks; with experts its routers forced to `route`; on `device` cuda run
    as CUDA runs it), stepped once, then one step measured under MemTracker."""
    with pipeline_runtime(group, config, device) as dims:
        return measure_trainer(warmed_up_stage(group, config, strategy, dims, device, route), group, strategy)


@contextmanager
def pipeline_runtime(group: TensorParallelGroup, config: ModelConfig, device: str = "cpu") -> Iterator[Any]:
    """The pipeline's runtime on the fake group (the shim's `pipeline_on_fake_group`), torchtitan's TP runtime over
    its pp x t mesh (the ParallelDims, None at t = 1), and for `device` cuda its flex attention run on the CPU."""
    with shim.pipeline_on_fake_group(), titan.tensor_parallel(group, config.ep, config.pp) as dims, \
            shim.flex_on_cpu() if device == "cuda" else nullcontext():
        yield dims


@dataclass(frozen=True)
class StageTrainer(Trainer):
    """memcalc's trainer (fp32 gradient buffer, AdamW) around one pipeline stage: each step loads the local batch
    (`microbatches` micro-batches of b), counts its valid tokens, and runs the schedule over it."""

    schedule: Any = None
    stage: Any = None
    microbatches: int = 1
    cuda: bool = False  # CUDA's path: each micro-batch's positions and block mask made before the step

    def register(self, tracker: Any) -> None:
        """Also the stage's receive buffers, which torch's PipelineStage makes once, one per micro-batch, and keeps
        between steps: activations, as they hold one."""
        super().register(tracker)
        infos = (*self.stage.args_recv_info.values(), *self.stage.grad_recv_info.values())
        tracker.track_held(*(x.buffer for recv in infos for x in recv if getattr(x, "buffer", None) is not None))

    def step(self) -> None:
        """The schedule's step (`scheduled_step`), then memcalc's AdamW."""
        self.main_grads.zero()
        scheduled_step(self.schedule, self.config, self.microbatches, self.model, self.cuda)
        self.optimizer.step()


def scheduled_step(schedule: Any, config: ModelConfig, m: int, model: Any, cuda: bool) -> None:
    """Every micro-batch's ids and labels (views of the local batch's), their valid tokens counted, on CUDA each
    micro-batch's positions and block mask (its post_dataloading_process), then the schedule's step over them as
    torchtitan's trainer calls it (`_step`)."""
    stage = schedule._stage
    tokens, labels = batch(replace(config, b=config.b * m), stage.device)
    valid = (labels != IGNORE_INDEX).sum()
    # on CUDA one document a row, as the whole model's step has them
    kwargs = [flex_inputs(model, config.b, config.s, tokens.device) if cuda else {} for _ in range(m)]
    losses: list | None = [] if stage.is_last else None
    _step(schedule, [(x,) for x in tokens.tensor_split(m)] if stage.is_first else None, kwargs,
          list(labels.tensor_split(m)) if stage.is_last else None, losses, {"global_valid_tokens": valid})


def _step(schedule: Any, args: list | None, kwargs: list[dict], targets: list | None, losses: list | None,
          loss_kwargs: dict) -> None:
    """What the schedule's step(arg_mbs=..., kwarg_mbs=..., target_mbs=...), which torchtitan's trainer calls, does
    in the torch it is written for (torch 2.13's step has no such parameters: it would hand them to the model)."""
    schedule._stage.has_backward = schedule._has_backward
    schedule._stage.clear_runtime_states()
    schedule._step_microbatches(args, kwargs, targets, losses, return_outputs=False, loss_kwargs=loss_kwargs)


def warmed_up_stage(group: TensorParallelGroup, config: ModelConfig, strategy: Strategy, dims: Any = None,
                    device: str = "cpu", route: str | None = None) -> StageTrainer:
    """This rank's stage (inside `pipeline_runtime`, its `dims`): the chunk pipeline_llm would build there (on the
    meta device, under tp laid out by its own plan as its parallelize_fn lays out a chunk, then its own storage,
    initialised as torchtitan initialises it; on `device` cuda its flex attention and fused norms; with experts each
    router forced to `route`), its PipelineStage on the pipeline's group given the shapes it sends and receives, the
    schedule torchtitan builds, memcalc's trainer around it, stepped once."""
    check_route(config, route)
    mesh = None if dims is None else dims.get_mesh("pp")  # the pipeline's ranks (at t = 1 the whole group)
    rank = group.rank if mesh is None else mesh.get_local_rank()
    chunk = _chunk(config, rank, strategy.sequence_parallel, DTYPES[config.dtype], device == "cuda")
    if device == "cuda":  # the chunk's own norms (a deep copy of the model's), fused before its plan wraps them
        shim.fused_norms(chunk)
    if dims is not None:
        chunk.parallelize(dims)
    initialised(chunk, config, group.device)  # checkpointed as pipeline_llm's parallelize_fn checkpoints a chunk
    chunk.train()
    if config.moe:
        shim.route_gates(chunk, route, config.moe_router_topk, config.ep)
    sequence = config.s // dims.tp if dims is not None and strategy.sequence_parallel else config.s
    loss, schedule = _scheduled(chunk, config, rank, group.device, mesh, sequence)
    return StageTrainer.around(config, chunk, loss, schedule=schedule, stage=schedule._stage,
                               microbatches=torchtitan_microbatches(config), cuda=device == "cuda")


def _parallelism(config: ModelConfig) -> ParallelismConfig:
    """torchtitan's pipeline settings: pp stages, micro-batches of b (its other settings its defaults)."""
    return ParallelismConfig(pipeline_parallel_degree=config.pp, pipeline_parallel_microbatch_size=config.b)


def _chunk(config: ModelConfig, rank: int, sequence_parallel: bool, dtype: Any, flex: bool = False) -> Any:
    """The chunk of Llama3Model (built on the meta device in `dtype`, with flex attention as CUDA runs it) that
    torchtitan's pipeline_llm keeps on stage `rank`: its own _generate_llm_fqn_per_model_part and _split_module."""
    parallelism = _parallelism(config)
    with torch.device("meta"), set_default_dtype(dtype):
        model = titan.model_config(config, sequence_parallel, config.L, config.vocab_size, flex).build()
    names = pipeline_parallel._generate_llm_fqn_per_model_part(
        config.pp, config.L, parallelism.pipeline_parallel_first_stage_less_layers,
        parallelism.pipeline_parallel_last_stage_less_layers)
    return pipeline_parallel._split_module(model, names[rank])


def _scheduled(chunk: Any, config: ModelConfig, rank: int, device: Any, mesh: Any, sequence: int
               ) -> tuple[Any, Any]:
    """torchtitan's loss (on the last stage as its trainer builds it there: `trainers_loss`), and the schedule it
    builds around `chunk`'s PipelineStage on the pipeline's ranks (`mesh`, None for the whole group), given the shapes
    it sends and receives (of `sequence` tokens a row)."""
    last = rank == config.pp - 1
    plain = CrossEntropyLoss.Config(global_vocab_size=config.vocab_size)
    loss = trainers_loss(chunk, config) if last else plain.build()
    stage = PipelineStage(chunk, rank, config.pp, device, *_shapes(config, chunk, rank, sequence),
                          group=None if mesh is None else mesh.get_group())
    schedule = pipeline_parallel._build_pipeline_schedule(
        parallelism=_parallelism(config), local_batch_size=config.b * torchtitan_microbatches(config), stages=[stage],
        loss_fn=loss)
    return loss, schedule


def _shapes(config: ModelConfig, chunk: Any, rank: int, sequence: int) -> tuple[Any, Any]:
    """What the stage receives and sends, per micro-batch (torch's static shapes: the fake group carries no
    metadata), as this rank holds them (torchtitan's TP plan passes plain local tensors): the token ids or the
    previous stage's hidden states (of `sequence` tokens a row: under SP this rank's s/t), and the hidden states or
    this rank's columns of the logits (its lm_head's rows; under the chunked loss, which skips lm_head, the whole
    hidden states)."""
    b, s, h, dtype = config.b, config.s, config.h, DTYPES[config.dtype]
    hidden = torch.empty(b, sequence, h, dtype=dtype, device="meta", requires_grad=True)
    received = torch.empty(b, s, dtype=torch.int64, device="meta") if rank == 0 else hidden
    if rank < config.pp - 1:
        return received, hidden
    width = h if config.loss_chunk_count else chunk.lm_head.weight.shape[0]
    return received, torch.empty(b, s, width, dtype=dtype, device="meta", requires_grad=True)


def measure_torchtitan_pp_fsdp_step_on_rank(group: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                            route: str | None = None, device: str = "cpu") -> StepMeasurement:
    """This rank's pipeline stage of torchtitan's Llama3Model under FSDP2 (the group is the pp x dp_shard world, this
    process the stage's first dp_shard rank): the chunk pipeline_llm builds there, laid out by torchtitan's own
    parallelize_llama as its parallelize_fn lays out each chunk (with experts its routers forced to `route`; on
    `device` cuda run as CUDA runs it), stepped once, then one step measured by
    FSDPMemTracker (memcalc.probe.libs.hf_fsdp). Under pp torchtitan's "default" reshard policy keeps each unit
    unsharded after forward, and torch's schedule keeps the units unsharded and their gradients unreduced through every
    micro-batch's backward (set_requires_gradient_sync(False)), reduce-scattering them once at the step's end
    (perform_reduce_grad): docs/timeline.md, "torchtitan's pipeline"."""
    from memcalc.probe.libs.hf_fsdp import measure_sharded

    with sharded_pipeline_runtime(group, config, strategy, device) as dims:
        trainer = warmed_up_sharded_stage(group, config, strategy, dims, route, device)
        return measure_sharded(trainer, group, strategy)


@contextmanager
def sharded_pipeline_runtime(group: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                             device: str = "cpu") -> Iterator[Any]:
    """The pipeline's runtime on the fake group (the shim's `pipeline_on_fake_group`) and torchtitan's meshes over
    the pp x dp_shard world (torchtitan_step.data_parallel): the ParallelDims; for `device` cuda its flex attention
    run on the CPU."""
    with shim.pipeline_on_fake_group(), data_parallel(group, config, strategy) as dims, \
            shim.flex_on_cpu() if device == "cuda" else nullcontext():
        yield dims


@dataclass(frozen=True)
class ShardedStageTrainer:
    """One pipeline stage's chunk under FSDP2 with AdamW (fused) over its shards: each step runs the schedule
    (`scheduled_step`), steps, and zeroes the sharded gradients in place (its trainer's
    zero_grad(set_to_none=False))."""

    config: ModelConfig
    model: Any
    optimizer: Any
    schedule: Any
    microbatches: int
    cuda: bool = False  # CUDA's path: each micro-batch's positions and block mask made before the step

    def step(self) -> None:
        scheduled_step(self.schedule, self.config, self.microbatches, self.model, self.cuda)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def register(self, tracker: Any) -> None:
        """The stage's receive buffers (StageTrainer.register); FSDPMemTracker registers the shards and states."""
        stage = self.schedule._stage
        infos = (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
        tracker.track_held(*(x.buffer for recv in infos for x in recv if getattr(x, "buffer", None) is not None))


def warmed_up_sharded_stage(group: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                            dims: Any, route: str | None = None, device: str = "cpu") -> ShardedStageTrainer:
    """This rank's stage (inside `sharded_pipeline_runtime`, its `dims`): the chunk (built in fp32, torchtitan's
    training.dtype; on `device` cuda with its flex attention and fused norms) sharded by parallelize_llama over
    `dims`'s dp_shard ranks (with experts each router forced to `route`), in its PipelineStage on the pipeline's
    ranks, stepped once. At t = 1 only: ProbeError under tp."""
    check_route(config, route)
    if strategy.weight_shards(config.t) > 1:
        # its 3-D layout fails there: the stage's received input is a plain tensor, which the chunk's DTensor
        # stream (torchtitan's FSDP2 with TP) will not multiply
        raise ProbeError(f"impl torchtitan: --step with pp and dp_shard runs at t = 1 (t={config.t} given)")
    mesh = dims.get_mesh("pp")
    chunk = _chunk(config, mesh.get_local_rank(), strategy.sequence_parallel, torch.float32, device == "cuda")
    if device == "cuda":  # fused before its plan wraps them, as `warmed_up_stage` fuses them
        shim.fused_norms(chunk)
    parallelized(chunk, config, dims, group.device)
    chunk.train()
    if config.moe:
        shim.route_gates(chunk, route, config.moe_router_topk, config.ep)
    _, schedule = _scheduled(chunk, config, mesh.get_local_rank(), group.device, mesh, config.s)
    optimizer = torch.optim.AdamW(chunk.parameters(), lr=1e-4, fused=True)
    trainer = ShardedStageTrainer(config, chunk, optimizer, schedule, torchtitan_microbatches(config),
                                  device == "cuda")
    trainer.step()
    return trainer
