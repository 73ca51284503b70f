"""One whole training step of torchtitan's own Llama3 model (with qk_layernorm its Qwen3 model) under MemTracker
(`measure --step --impl torchtitan`).

How the model is built, its loss, and FSDP2: docs/probe.md, "torchtitan's model under `--step`".
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import torchtitan as titan
from memcalc.probe.libs import torchtitan_shim as shim
from memcalc.probe.step import BATCH_SEED, StepMeasurement, Trainer, check_route, measure_trainer

torch = require_torch()

from torchtitan.components.loss import (  # noqa: E402  (memcalc[torchtitan])
    IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss,
)
from torchtitan.tools.utils import set_default_dtype  # noqa: E402


def measure_torchtitan_step_on_rank(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                    route: str | None = None, device: str = "cpu") -> StepMeasurement:
    """Build torchtitan's Llama3Model (under tp laid out by its own plan; with experts its MoE layers, the router
    forced to `route`; on `device` cuda run as CUDA runs it), run a warm-up step, then measure one step under
    MemTracker."""
    with runtime(tp, config.ep, device) as dims:
        return measure_trainer(warmed_up(tp, config, strategy, dims, route, device), tp, strategy)


@contextmanager
def runtime(tp: TensorParallelGroup, ep: int = 1, device: str = "cpu") -> Iterator[Any]:
    """torchtitan's TP runtime over the probe's group (memcalc.probe.libs.torchtitan.tensor_parallel), and for
    `device` cuda its flex attention run on the CPU (the shim's flex_on_cpu): the ParallelDims, or None at t = 1."""
    with shim.flex_on_cpu() if device == "cuda" else nullcontext(), titan.tensor_parallel(tp, ep) as dims:
        yield dims


def warmed_up(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, dims: Any = None,
              route: str | None = None, device: str = "cpu") -> Trainer:
    """torchtitan's Llama3Model with memcalc's trainer, stepped once; under tp (inside `runtime`) laid out by its own
    plan, its loss vocabulary-parallel; on `device` cuda (inside `runtime` for it) as CUDA runs it (the shim's
    fused_norms, and flex attention given the trainer's positions and block mask)."""
    cuda = device == "cuda"
    model = on_meta(config, strategy.sequence_parallel, route, cuda, DTYPES[config.dtype])
    if dims is not None:
        model.parallelize(dims)
    initialised(model, config, tp.device)  # checkpointed as parallelize_llama does it: after the TP plan, on meta
    return Trainer.around(config, model, _forward(model, config, route, cuda))


def on_meta(config: ModelConfig, sequence_parallel: bool, route: str | None, cuda: bool, dtype: torch.dtype) -> Any:
    """Llama3Model built on the meta device in `dtype`, as its trainer builds a model; on CUDA each norm fused (before
    its plan, which wraps each module's forward in its redistributions). Experts without a route: ProbeError."""
    check_route(config, route)
    with torch.device("meta"), set_default_dtype(dtype):
        model = titan.model_config(config, sequence_parallel, config.L, config.vocab_size, cuda).build()
    if cuda:
        shim.fused_norms(model)
    return model


def initialised(model: torch.nn.Module, config: ModelConfig, device: torch.device) -> None:
    """`model` under torchtitan's activation checkpointing for `recompute`, as its parallelize functions apply it,
    then each parameter given its own shard's storage (a view would keep the whole one) and initialised as torchtitan
    initialises it."""
    policy = titan.ac_config(config)
    if policy is not None:
        with shim.cuda_like_op_checkpointing():
            policy.build().apply(model)
    model.to_empty(device=device)
    torch.manual_seed(BATCH_SEED)
    with torch.no_grad(), set_default_dtype(DTYPES[config.dtype]):
        model.init_states(buffer_device=device)


def _forward(model: Any, config: ModelConfig, route: str | None, cuda: bool) -> Callable:
    """The model in training mode (with experts its routers fp32 and forced to `route`, in forward and in a
    checkpoint's rerun alike), and its trainer's forward: the valid tokens counted, the logits made, the summed loss
    divided by the count; the logits go as it returns (its `del pred`). On CUDA first flex attention's inputs: the
    batch's positions (one document a row) and the block mask its trainer makes of them, held until the next step
    (its trainer holds them through this one's backward)."""
    model.train()
    if config.moe:
        shim.route_gates(model, route, config.moe_router_topk, config.ep)
    loss_fn = trainers_loss(model, config)
    held: dict[str, Any] = {}

    def forward(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if cuda:
            held.clear()  # the last step's go first
            held.update(flex_inputs(model, *tokens.shape, tokens.device))
        valid = (labels != IGNORE_INDEX).sum()
        pred = model(tokens, **held)
        loss, _ = loss_fn(pred, labels, valid, **{k: v for k, v in held.items() if k == "positions"})
        return loss

    return forward


def trainers_loss(model: Any, config: ModelConfig) -> Any:
    """torchtitan's loss as its trainer builds it for `loss_chunk_count`: CrossEntropyLoss over the whole logits (0),
    or ChunkedLossWrapper around it, given the model's lm_head, which the model then skips (the trainer's set_lm_head
    and `_skip_lm_head = True`; under pp the last stage's chunk, `model`)."""
    plain = CrossEntropyLoss.Config(global_vocab_size=config.vocab_size)
    if config.loss_chunk_count == 0:
        return plain.build()
    wrapper = ChunkedLossWrapper.Config(num_chunks=config.loss_chunk_count, loss_fn=plain).build()
    wrapper.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return wrapper


def flex_inputs(model: Any, b: int, s: int, device: torch.device) -> dict[str, Any]:
    """Flex attention's inputs for b rows of s tokens, as torchtitan's trainer makes them on CUDA: the positions (one
    document a row) and the block mask made of them."""
    positions = torch.arange(s, device=device).repeat(b, 1)
    return {"positions": positions, "attention_masks": model.get_attention_masks(positions)}


def measure_torchtitan_fsdp_step_on_rank(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                         route: str | None = None, device: str = "cpu") -> StepMeasurement:
    """torchtitan's Llama3Model sharded by its own parallelize_llama over dp_shard ranks (under tp on its 2-D mesh;
    with experts its MoE layers, the router forced to `route`), stepped once, then one step measured by
    FSDPMemTracker (memcalc.probe.libs.hf_fsdp)."""
    from memcalc.probe.libs.fsdp_groups import GroupsMomentTracker
    from memcalc.probe.libs.hf_fsdp import FSDP_CATEGORIES

    with data_parallel(tp, config, strategy) as dims, shim.flex_on_cpu() if device == "cuda" else nullcontext():
        trainer = warmed_up_sharded(tp, config, strategy, dims, route, device)
        tracker = GroupsMomentTracker(trainer.model, trainer.optimizer)
        return measure_trainer(trainer, tp, strategy, tracker, FSDP_CATEGORIES)


@contextmanager
def data_parallel(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> Iterator[Any]:
    """torchtitan's ParallelDims over the fake group's world (pp x dp_replicate x dp_shard x cp x t; this process rank
    0, or under pp a stage's first rank: memcalc.probe.libs.torchtitan_pp),
    its meshes built and current while inside, as in its trainer's train_context; on its "partial_dtensor" backend,
    the one torch 2.13's fully_shard takes (docs/probe.md, "torchtitan's model under `--step`")."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    t = config.t if strategy.tensor_parallel else 1
    replicas = config.dp_replicate or 1
    backend = "partial_dtensor"
    dims = ParallelDims(dp_replicate=replicas, dp_shard=config.dp_shard, cp=config.cp, tp=t, pp=config.pp,
                        ep=config.ep, world_size=tp.size, spmd_backend=backend)
    before = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(backend)  # the runtime's, which torchtitan's loss reads
    try:
        with shim.mesh_device(tp.device.type):
            dims.build_mesh()
        with warnings.catch_warnings(), dist_utils.get_spmd_context(parallel_dims=dims)():
            warnings.filterwarnings("ignore", titan.DEPRECATED_COLLECTIVES, FutureWarning)
            with shim.every_rank_routes_alike() if config.ep > 1 else nullcontext():
                yield dims
    finally:
        dist_utils.set_spmd_backend(before)


def warmed_up_sharded(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, dims: Any,
                      route: str | None = None, device: str = "cpu") -> Any:
    """Rank 0 of the fake group's world (`data_parallel`'s meshes, `dims`): Llama3Model built in fp32 (its trainer's
    training.dtype), laid out by torchtitan's own parallelize_llama, AdamW (fused) over the shards, zeroed in place
    (its trainer's zero_grad(set_to_none=False)), stepped once (docs/probe.md, "torchtitan's model under `--step`");
    on `device` cuda as `warmed_up` runs it."""
    from memcalc.probe.libs.hf_fsdp import ShardedTrainer

    cuda = device == "cuda"  # as `warmed_up` runs it (inside flex_on_cpu)
    model = on_meta(config, strategy.sequence_parallel, route, cuda, torch.float32)
    parallelized(model, config, dims, tp.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    trainer = ShardedTrainer(config, model, optimizer, _forward(model, config, route, cuda), set_to_none=False)
    trainer.step()
    return trainer


def parallelized(model: Any, config: ModelConfig, dims: Any, device: torch.device) -> None:
    """`model` (the whole model, or a pipeline stage's chunk) laid out by torchtitan's own parallelize function over
    `dims` (`parallelize_fn`: TP or expert parallel, activation checkpointing, FSDP2 with the reshard policy
    `reshard_after_forward` picks: "default", which torchtitan turns to "never" when `dims` has pp > 1, or "never"),
    then given its own storage and initialised."""
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig

    precision = {"bf16": "bfloat16", "fp32": "float32"}
    training = TrainingConfig(mixed_precision_param=precision[config.dtype],
                              mixed_precision_reduce=precision[config.reduce_dtype])
    policy = "default" if config.reshard_after_forward else "never"
    layout = ParallelismConfig(spmd_backend=dims.spmd_backend, fsdp_reshard_after_forward=policy)
    with shim.cuda_like_op_checkpointing():
        parallelize_fn(config)(model, parallel_dims=dims, compile_config=CompileConfig(),
                               ac_config=titan.ac_config(config), dump_folder="", training=training,
                               parallelism=layout)
    model.to_empty(device=device)
    torch.manual_seed(BATCH_SEED)
    with torch.no_grad(), warnings.catch_warnings():  # the values do not matter: no warning that CPU meshes' are
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)  # not those of a GPU mesh
        model.init_states(buffer_device=device)


def parallelize_fn(config: ModelConfig) -> Callable:
    """The parallelize function torchtitan's trainer calls: with experts over the FSDP2 ranks (ep > 1) its MoE models'
    (parallelize_deepseekv3 with latent attention, else parallelize_qwen3), which apply expert parallel and shard the
    routed experts over efsdp; parallelize_llama elsewhere (its dense and ep = 1 layouts are theirs too)."""
    if config.ep > 1 and config.mla:
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

        return parallelize_deepseekv3
    if config.ep > 1:
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        return parallelize_qwen3
    from torchtitan.models.llama3.parallelize import parallelize_llama

    return parallelize_llama
