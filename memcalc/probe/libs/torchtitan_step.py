"""One whole training step of torchtitan's own Llama3 model under MemTracker (`measure --step --impl torchtitan`).

How the model is built, its loss, and FSDP2: docs/probe.md, "torchtitan's model under `--step`".
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import torchtitan as titan
from memcalc.probe.step import BATCH_SEED, StepMeasurement, Trainer, measure_trainer

torch = require_torch()

from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss  # noqa: E402  (memcalc[torchtitan])
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
    """torchtitan's TP runtime over the probe's group (memcalc.probe.libs.torchtitan; its experts over `ep` of the
    TP ranks), its collectives' deprecation warnings and the CPU's refusal of the MoE router's autocast(float32) (the
    shim runs it) silenced, and for `device` cuda its flex attention run on the CPU (the shim's flex_on_cpu): the
    ParallelDims, or None at t = 1."""
    from memcalc.probe.libs import torchtitan_shim as shim

    with warnings.catch_warnings(), shim.flex_on_cpu() if device == "cuda" else nullcontext():
        warnings.filterwarnings("ignore", titan.DEPRECATED_COLLECTIVES, FutureWarning)
        warnings.filterwarnings("ignore", titan.CPU_AUTOCAST_FP32, UserWarning)
        with titan.tensor_parallel(tp, ep) as dims:
            yield dims


def warmed_up(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, dims: Any = None,
              route: str | None = None, device: str = "cpu") -> Trainer:
    """torchtitan's Llama3Model in training mode with memcalc's trainer, stepped once; under tp (inside `runtime`)
    laid out by its own plan (set_llama3_sharding_config, Module.parallelize), its loss vocabulary-parallel. With
    experts its MoE layers' routers run in fp32 as under CUDA's autocast, forced to `route` (the shim's
    route_gates, as the layer probe runs them). On `device` cuda (inside `runtime` for it) as CUDA runs it: its
    flex attention given the trainer's positions and block mask, its norms torch's fused kernel (the shim's
    fused_norms)."""
    from memcalc.probe.libs import torchtitan_shim as shim

    _check_buildable(config, route)
    cuda = device == "cuda"
    with torch.device("meta"), set_default_dtype(DTYPES[config.dtype]):  # as its trainer builds a model
        model = titan.model_config(config, strategy.sequence_parallel, config.L, config.vocab_size, cuda).build()
    if cuda:  # before its plan, which wraps each module's forward in its redistributions
        shim.fused_norms(model)
    if dims is not None:
        model.parallelize(dims)
    checkpoint(model, config)
    model.to_empty(device=tp.device)  # each parameter its own shard's storage (a view would keep the whole one)
    torch.manual_seed(BATCH_SEED)  # the weights, as torchtitan initialises them
    with torch.no_grad(), set_default_dtype(DTYPES[config.dtype]):
        model.init_states(buffer_device=tp.device)
    model.train()
    if config.moe:  # its routers fp32 and forced, in forward and in a checkpoint's rerun alike
        shim.route_gates(model, route, config.moe_router_topk)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=config.vocab_size))
    held: list[Any] | None = [] if cuda else None
    return Trainer.around(config, model, lambda tokens, labels: _loss(model, loss_fn, tokens, labels, held))


def _check_buildable(config: ModelConfig, route: str | None) -> None:
    """ProbeError for what the step cannot build: tied embeddings (Llama3 unties them), experts without a route."""
    if config.tie_embeddings:
        raise ProbeError("impl torchtitan: Llama3 unties its embedding and output layer; set tie_embeddings false")
    if config.moe and route is None:
        raise ProbeError("impl torchtitan: --step on experts forces the router (--route balanced or all-to-one)")


def ac_config(config: ModelConfig) -> Any:
    """torchtitan's activation checkpointing config object for `recompute` (its trainer's activation_checkpoint):
    full, FullAC's; op, SelectiveAC's; none, None."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    policies = {"full": FullAC.Config, "op": SelectiveAC.Config, "none": lambda: None}
    if config.recompute not in policies:
        raise ProbeError(f"impl torchtitan: recompute {config.recompute} is not torchtitan's; use none, op or full")
    return policies[config.recompute]()


def checkpoint(model: Any, config: ModelConfig) -> None:
    """torchtitan's activation checkpointing applied as parallelize_llama applies it (after the TP plan, on the meta
    device): its config object built and applied to every block (SelectiveAC also saves the CPU flash kernel's
    outputs, as it saves its CUDA twins': the shim)."""
    from memcalc.probe.libs import torchtitan_shim as shim

    policy = ac_config(config)
    if policy is not None:
        with shim.cuda_like_op_checkpointing():
            policy.build().apply(model)


def _loss(model: Any, loss_fn: Any, tokens: torch.Tensor, labels: torch.Tensor,
          held: list[Any] | None = None) -> torch.Tensor:
    """torchtitan's trainer's forward: the valid tokens counted, the logits made, the summed loss divided by the
    count; the logits go as this returns (its `del pred`). With `held`, flex attention's inputs first."""
    kwargs = {} if held is None else _flex_inputs(model, tokens, held)
    valid = (labels != IGNORE_INDEX).sum()
    pred = model(tokens, **kwargs)
    loss, _ = loss_fn(pred, labels, valid)
    return loss


def _flex_inputs(model: Any, tokens: torch.Tensor, held: list[Any]) -> dict[str, Any]:
    """The batch's positions (one document a row) and the block mask its trainer makes of them for flex attention,
    in `held` until the next step (its trainer holds them through this one's backward)."""
    held.clear()
    positions = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0], 1)
    held += [positions, model.get_attention_masks(positions)]
    return {"positions": held[0], "attention_masks": held[1]}


def measure_torchtitan_fsdp_step_on_rank(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                         route: str | None = None, device: str = "cpu") -> StepMeasurement:
    """torchtitan's Llama3Model sharded by its own parallelize_llama over dp_shard ranks (under tp on its 2-D mesh;
    with experts its MoE layers, the router forced to `route`), stepped once, then one step measured by
    FSDPMemTracker (memcalc.probe.libs.hf_fsdp)."""
    from memcalc.probe.libs import torchtitan_shim as shim
    from memcalc.probe.libs.hf_fsdp import measure_sharded

    with data_parallel(tp, config, strategy) as dims, shim.flex_on_cpu() if device == "cuda" else nullcontext():
        return measure_sharded(warmed_up_sharded(tp, config, strategy, dims, route, device), tp, strategy)


@contextmanager
def data_parallel(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> Iterator[Any]:
    """torchtitan's ParallelDims over the fake group's world (dp_replicate x dp_shard x t, this process rank 0), its
    meshes built and current while inside, as in its trainer's train_context (get_spmd_context).

    Its SPMD backend is "partial_dtensor" (DTensor for the TP dimension, FSDP2 over the 1-D fsdp mesh): under its
    default "spmd_types", parallelize_llama hands fully_shard a DataParallelMeshDims, and torch 2.13's fully_shard
    takes only DTensor parameters with one, not the plain tensors spmd_types annotates ("all parameters must be
    DTensors on the full SPMD mesh"). So under tp the plan's collectives are DTensor's redistributions, not
    spmd_types'."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims

    from memcalc.probe.libs import torchtitan_shim as shim

    t = config.t if strategy.tensor_parallel else 1
    replicas = config.dp_replicate or 1
    if tp.size != replicas * config.dp_shard * t:
        raise ProbeError(f"the fake group has {tp.size} ranks, not dp_replicate*dp_shard*t={replicas}*"
                         f"{config.dp_shard}*{t}")
    backend = "partial_dtensor"
    dims = ParallelDims(dp_replicate=replicas, dp_shard=config.dp_shard, cp=1, tp=t, pp=1, ep=1,
                        world_size=tp.size, spmd_backend=backend)
    before = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(backend)  # the runtime's, which torchtitan's loss reads
    try:
        with shim.mesh_device(tp.device.type):
            dims.build_mesh()
        with warnings.catch_warnings(), dist_utils.get_spmd_context(parallel_dims=dims)():
            warnings.filterwarnings("ignore", titan.DEPRECATED_COLLECTIVES, FutureWarning)
            yield dims
    finally:
        dist_utils.set_spmd_backend(before)


def warmed_up_sharded(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, dims: Any,
                      route: str | None = None, device: str = "cpu") -> Any:
    """Rank 0 of the fake group's world (`data_parallel`'s meshes, `dims`): Llama3Model built on the meta device in
    fp32 (its trainer's training.dtype), laid out by torchtitan's own parallelize_llama (under tp its TP plan over the
    mesh's tp dimension, each parameter a DTensor of this rank's shard; its activation checkpointing config for
    `recompute` applied to each block; then apply_fsdp_to_decoder over the fsdp dimension, as HSDP over
    (dp_replicate, fsdp) with dp_replicate: tok_embeddings, each block, [norm, lm_head], the model; bf16 parameters,
    fp32 reduce, its TrainingConfig's; its reshard policy "default", or "never" without reshard_after_forward),
    materialised and initialised, AdamW (fused) over the shards, zeroed in place (its trainer's
    zero_grad(set_to_none=False)), stepped once. With experts (one FSDP2 unit per block at ep = 1) its routers run
    in fp32, forced to `route`, as `warmed_up`'s; on `device` cuda its flex attention and fused norms as there."""
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from memcalc.probe.libs import torchtitan_shim as shim
    from memcalc.probe.libs.hf_fsdp import ShardedTrainer

    _check_buildable(config, route)
    backend = dims.spmd_backend
    cuda = device == "cuda"  # as `warmed_up` runs it (inside flex_on_cpu)
    with torch.device("meta"):
        model = titan.model_config(config, strategy.sequence_parallel, config.L, config.vocab_size, cuda).build()
    if cuda:
        shim.fused_norms(model)
    precision = {"bf16": "bfloat16", "fp32": "float32"}
    training = TrainingConfig(mixed_precision_param=precision[config.dtype],
                              mixed_precision_reduce=precision[config.reduce_dtype])
    parallelism = ParallelismConfig(spmd_backend=backend,
                                    fsdp_reshard_after_forward="default" if config.reshard_after_forward else "never")
    with shim.cuda_like_op_checkpointing():
        parallelize_llama(model, parallel_dims=dims, compile_config=CompileConfig(), ac_config=ac_config(config),
                          dump_folder="", training=training, parallelism=parallelism)
    model.to_empty(device=tp.device)
    torch.manual_seed(BATCH_SEED)
    with torch.no_grad(), warnings.catch_warnings():  # the values do not matter: no warning that CPU meshes' are
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)  # not those of a GPU mesh
        model.init_states(buffer_device=tp.device)
    model.train()
    if config.moe:
        shim.route_gates(model, route, config.moe_router_topk)
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=config.vocab_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    held: list[Any] | None = [] if cuda else None
    trainer = ShardedTrainer(config, model, optimizer,
                             lambda tokens, labels: _loss(model, loss_fn, tokens, labels, held), set_to_none=False)
    trainer.step()
    return trainer
