"""One training step of transformers' `LlamaForCausalLM` sharded by torch's own FSDP2, under FSDPMemTracker
(`memcalc measure --step --impl hf --dp-shard N`).

How it is built, laid out and trained: docs/probe.md, "transformers' model under FSDP2 (hf_fsdp)".
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from memcalc.config.schema import ModelConfig
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import hf_tp
from memcalc.probe.libs.hf_step import causal_lm, checkpointed
from memcalc.probe.step import MomentTracker, StepMeasurement, batch, measure_trainer
from memcalc.sizing.timeline import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES

torch = require_torch()
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from transformers.distributed.tensor_parallel import apply_tensor_parallelism  # noqa: E402

# FSDPMemTracker's categories (its _FSDPRefType values) as the timeline's.
FSDP_CATEGORIES = {
    **dict.fromkeys(("Sharded Param", "Unsharded Param", "Buffer", "All Gather"), PARAMETERS),
    **dict.fromkeys(("Sharded Grad", "Unsharded Grad", "Reduce Scatter"), GRADIENTS),
    "OptState": OPTIMIZER, "Activation": ACTIVATIONS, "Inputs": ACTIVATIONS, "Temp": TEMPORARIES,
}


class FsdpMomentTracker(MomentTracker, FSDPMemTracker):
    """FSDPMemTracker, built from the model and its optimizer, that also notes where it first reached its peak
    (MomentTracker's bookkeeping)."""

    def __enter__(self) -> FsdpMomentTracker:
        """FSDPMemTracker registers no module hooks of its own: the moment's are registered here, and MomentTracker's
        release of ModTracker's hooks on leaf inputs."""
        super().__enter__()
        if self._depth == 1:
            enter, leave = (lambda module, *_: self._enter(module)), (lambda module, *_: self._leave(module))

            def forward(module, inputs) -> None:
                enter(module)
                self.note_leaves(module, inputs)

            def backward(module, *_) -> None:
                leave(module)
                self.release(module)
            self._mod_tracker.register_user_hooks(forward, leave, enter, backward)
        return self

    def __exit__(self, *args) -> None:
        if self._depth == 1:
            self._mod_tracker.clear_user_hooks()
        super().__exit__(*args)

    def _fsdp_state_pre_forward(self, fsdp_mod: nn.Module, orig: Callable) -> Callable:
        """FSDPMemTracker's wrapper of a unit's pre-forward, inside `called_again`: a unit called again in one step
        (torchtitan's lm_head, once a loss chunk) is no next iteration."""
        tracked = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def pre_forward(*args, **kwargs):
            with self.called_again(fsdp_mod):
                return tracked(*args, **kwargs)
        return pre_forward

    def _fsdp_param_group_post_backward(self, fsdp_mod: nn.Module, orig: Callable) -> Callable:
        """FSDPMemTracker's wrapper of a unit's post_backward files each unsharded .grad first, in a loop whose
        variable would keep the unit's last .grad alive until post_backward returns; an untracked run frees it as
        soon as post_backward lets it go (under tp a Partial gradient, once FSDP2 has all-reduced it). A parameter
        without a gradient, appended for the loop and gone before post_backward runs, leaves the variable empty."""
        group = fsdp_mod._get_fsdp_state()._fsdp_param_group
        if group is None:
            return super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        def post_backward(*args, **kwargs):
            group.fsdp_params.pop()
            return orig(*args, **kwargs)

        tracked = super()._fsdp_param_group_post_backward(fsdp_mod, post_backward)

        def inner(*args, **kwargs):
            group.fsdp_params.append(_WITHOUT_GRAD)
            return tracked(*args, **kwargs)

        return inner


# A parameter slot whose unsharded parameter has no gradient (FsdpMomentTracker._fsdp_param_group_post_backward).
_WITHOUT_GRAD = SimpleNamespace(_unsharded_param=SimpleNamespace(grad=None))


@dataclass(frozen=True)
class ShardedTrainer:
    """A library's model under fully_shard on this rank, with AdamW over its shards; `loss` its forward,
    (tokens, labels) -> the loss."""

    config: ModelConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    set_to_none: bool = True  # zero_grad's: torchtitan's trainer zeroes the sharded gradients in place

    def step(self) -> None:
        """Load a batch (inside the step, as the trainer's), forward, backward, step, zero_grad; the loss lives to the
        step's end (memcalc.probe.step.Trainer.step). torchtitan zeroes at the step's start: the same memory."""
        tokens, labels = batch(self.config, next(self.model.parameters()).device)
        loss = self.loss(tokens, labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.set_to_none)

    def register(self, tracker: FsdpMomentTracker) -> None:
        """Nothing to show: FSDPMemTracker registers the shards and the optimizer's states as it is entered."""


def warmed_up_sharded(tp: TensorParallelGroup, config: ModelConfig, route: str | None = None) -> ShardedTrainer:
    """Rank 0 of dp_replicate*dp_shard*t (the fake group's world): the family's model (LlamaForCausalLM, ...) built in
    fp32, under tp laid out by transformers' tp_plan over the mesh's last dimension, every decoder layer and then the
    whole model under fully_shard (HSDP over the (dp_replicate, dp_shard) dimensions), AdamW over the shards, stepped
    once (AdamW's moments exist from then on). With experts, its router forced to `route`
    (memcalc.probe.libs.hf_step)."""
    replicas, shards = config.dp_replicate or 1, config.dp_shard
    t = tp.size // (replicas * shards)  # 1 or config.t: memcalc.probe.step._fake_world made the world
    model, loss = causal_lm(config, route, torch.float32, tp.device)
    mesh = init_device_mesh(tp.device.type, (replicas, shards, t), mesh_dim_names=("replicate", "shard", "tp"))
    if t > 1:  # transformers' own plan over the mesh's inner dimension, then FSDP2 (HSDP) over the outer ones
        apply_tensor_parallelism(model, mesh["tp"], hf_tp.model_plan(model, t))
    checkpointed(model, config)
    dp = mesh["replicate", "shard"] if replicas > 1 else mesh["shard"]
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[config.dtype], reduce_dtype=DTYPES[config.reduce_dtype])
    layers = [x for x in model.modules() if type(x).__name__ in model._no_split_modules]  # accelerate's wrap policy
    for unit in (*layers, model):  # every decoder layer, then the whole model
        fully_shard(unit, mesh=dp, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    trainer = ShardedTrainer(config, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), loss)
    trainer.step()
    return trainer


def measure_hf_fsdp_step_on_rank(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                 route: str | None = None) -> StepMeasurement:
    """One step of the sharded Llama under FSDPMemTracker: the state before it, the peak, and where the peak was."""
    return measure_sharded(warmed_up_sharded(tp, config, route), tp, strategy)


def measure_sharded(trainer: ShardedTrainer, tp: TensorParallelGroup, strategy: Strategy) -> StepMeasurement:
    """One step of a warmed-up sharded trainer under FSDPMemTracker."""
    tracker = FsdpMomentTracker(trainer.model, trainer.optimizer)
    return measure_trainer(trainer, tp, strategy, tracker, FSDP_CATEGORIES)

