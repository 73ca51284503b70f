"""One training step of the config's transformers causal LM (`hf_step.causal_lm`: Llama's, Mixtral's, Qwen2-MoE's, ...)
under DeepSpeed's own engine (ZeRO 1-3), under MemTracker (`ZeroTracker`): reached through probe.step's STEP_TRAINERS
by `memcalc measure --step` at stages 1 and 2 (at stage 3 MemTracker does not see ds_tensor: the command refuses it).

DeepSpeed 0.19.8 runs on the CPU over torch's fake process group (rank 0 of dp), its comm backend started without
the shm comm op its CPU accelerator would JIT-build (hf_shim.without_shm_comm_op: ZeRO's step never calls it). The
model is built as `memcalc.probe.libs.hf_step` builds it, in the config's dtype (DeepSpeed's "bf16" section on or
off), the Trainer's torch AdamW (fused) over its two parameter groups handed to `deepspeed.initialize` as the client
optimizer, with the sizes the Trainer fills for "auto" (memcalc.sizing.timeline.zero.DEEPSPEED_AUTO). MemTracker
sees neither DeepSpeed's fp32 master partition nor the flat buffers it makes at start-up: the partition is
registered with it (filed as an optimizer state, as the walk files it). DeepSpeed writes to stdout, which --json
keeps for its document: its import and start-up write to stderr.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import hf_shim
from memcalc.probe.libs.hf_step import causal_lm, checkpointed
from memcalc.probe.step import MomentTracker, StepMeasurement, batch, measure_trainer
from memcalc.sizing.timeline.zero import DEEPSPEED_AUTO

torch = require_torch()
import transformers  # noqa: E402
from torch.distributed._tools.mem_tracker import _MemRefType  # noqa: E402
try:
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to the stdout it finds on import
        import deepspeed
except ImportError as err:  # one line, as memcalc.probe.measure.runner says it for a library
    raise ProbeError(f"--zero-stage runs DeepSpeed's own engine, which is not installed ({err}); install the extra"
                     " 'deepspeed' (in a checkout: pip install -e '.[deepspeed]')") from err

# The ZeRO optimizer's methods whose new tensors MemTracker would file by the phase they run in (temporaries in
# backward, activations after it), and what they are to the walk (memcalc.sizing.timeline.zero): what its step makes
# (the flat and fp32 gradient partitions, the norm) temporaries; its reduce buckets and gradient partition (stages 1
# and 2: stage 3 has neither method) gradients.
FILED = {"step": _MemRefType.TEMP, "setup_buckets": _MemRefType.GRAD, "copy_grads_in_partition": _MemRefType.GRAD}


class ZeroTracker(MomentTracker):
    """A MomentTracker that files what DeepSpeed's ZeRO optimizer holds and makes as the walk does, as torch's
    FSDPMemTracker files FSDP2's buffers, and names the walk's moments in DeepSpeed's own code: its step the
    optimizer's (torch's optimizer hooks, which MemTracker reads, see only the client optimizer's step inside it,
    whose states MemTracker files itself), the engine's reduction after loss.backward() returns backward's."""

    def __init__(self) -> None:
        super().__init__()
        self.filing: _MemRefType | None = None  # what the running method of `FILED` makes
        self.phase = ""  # the walk's phase of the DeepSpeed method running, if it names one

    def file(self, engine: Any) -> None:
        """The ZeRO optimizer's fp32 master partition (made before the tracker) as an optimizer state; its methods of
        `FILED`, its step and the engine's reduction wrapped on the instances, so that their own calls go through
        them too."""
        zero = engine.optimizer
        master = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat  # ZeRO-3's
        for x in master:
            self._update_and_maybe_create_winfos(x, _MemRefType.OPT)
        for name, reftype in FILED.items():
            if hasattr(zero, name):
                setattr(zero, name, self._filed(getattr(zero, name), reftype, "optimizer" if name == "step" else ""))
        engine.allreduce_gradients = self._filed(engine.allreduce_gradients, None, "backward")

    def _filed(self, method: Callable, reftype: _MemRefType | None, phase: str) -> Callable:
        @functools.wraps(method)
        def filed(*args, **kwargs):
            outer = self.filing, self.phase
            self.filing, self.phase = reftype or self.filing, phase or self.phase
            try:
                return method(*args, **kwargs)
            finally:
                self.filing, self.phase = outer
        return filed

    def _track(self, reftype: _MemRefType, t: torch.Tensor) -> None:
        super()._track(reftype if self.filing is None or self._in_opt else self.filing, t)

    def where(self) -> str:
        """MomentTracker's, or the phase of the DeepSpeed method running."""
        return self.phase or super().where()


@dataclass(frozen=True)
class ZeroTrainer:
    """DeepSpeed's engine around a model on this rank; `loss` its forward, (tokens, labels) -> the loss."""

    config: ModelConfig
    engine: Any
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def step(self) -> None:
        """Load a batch, forward, engine.backward (its hooks reduce; scale_wrt_gas off, as transformers' Trainer
        calls it), engine.step (it zeroes the gradients)."""
        tokens, labels = batch(self.config, torch.device("cpu"))
        loss = self.loss(tokens, labels)
        self.engine.backward(loss, scale_wrt_gas=False)
        self.engine.step()

    def register(self, tracker: ZeroTracker) -> None:
        """Show the tracker the weights, the client optimizer's states and DeepSpeed's own (`ZeroTracker.file`)."""
        tracker.track_external(self.engine.module, self.engine.optimizer.optimizer)
        tracker.file(self.engine)


def warmed_up_zero(tp: TensorParallelGroup, config: ModelConfig, route: str | None = None) -> ZeroTrainer:
    """Rank 0 of dp (the fake group's world): the family's model under DeepSpeed ZeRO at the config's stage, the
    Trainer's AdamW over its groups (get_decay_parameter_names': norms and biases without decay), stepped once."""
    os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine reads it; torch's group is already made
    deepspeed.utils.groups._WORLD_GROUP = None  # its clone of the world group, made by a run whose group is destroyed
    model, loss = causal_lm(config, route, DTYPES[config.dtype], tp.device)
    checkpointed(model, config)
    decaying, named = set(transformers.Trainer.get_decay_parameter_names(None, model)), list(model.named_parameters())
    decay, rest = [p for n, p in named if n in decaying], [p for n, p in named if n not in decaying]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-4, fused=True)
    zero = {"stage": config.zero_stage, **{knob: auto(config.h) for knob, auto in DEEPSPEED_AUTO.items()}}
    with contextlib.redirect_stdout(sys.stderr), hf_shim.without_shm_comm_op():  # --json is stdout
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": config.b, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "bf16": {"enabled": config.dtype == "bf16"}})
    trainer = ZeroTrainer(config, engine, loss)
    trainer.step()
    return trainer


def measure_hf_zero_step_on_rank(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy,
                                 route: str | None = None) -> StepMeasurement:
    """One step of the model under DeepSpeed ZeRO under MemTracker: the state before it, the peak and its moment."""
    return measure_trainer(warmed_up_zero(tp, config, route), tp, strategy, ZeroTracker())
