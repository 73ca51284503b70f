"""DeepSpeed ZeRO (stages 1-3) in the step of transformers' Llama under the Trainer: its buffers as ops on the hf walk's
tape (memcalc.sizing.timeline.hf calls them where FSDP2's hooks would run: `Zero` answers the same calls as
memcalc.sizing.timeline.fsdp.Fsdp).

Modelled from DeepSpeed 0.19.8's own sources (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py,
partitioned_param_coordinator.py) and measured by memcalc.probe.libs.hf_zero (DeepSpeed's engine on the fake group,
the Trainer's fused torch AdamW over its two groups): at stages 1 and 2 the state between steps and the peak's
total are MemTracker's to the byte (with experts and gradient checkpointing too), not yet the categories at the peak
(MemTracker files the gradient partition as activations) nor its moment (MemTracker names none inside DeepSpeed's
step); at stage 3 MemTracker does not see the partition DeepSpeed keeps on each parameter (ds_tensor, no module's
parameter). bf16 or fp32 (stages 1 and 2) with DeepSpeed's default gradient accumulation dtype (the model's),
contiguous_gradients on, overlap_comm off at stages 1 and 2 and on at stage 3 (DeepSpeed's defaults), and the sizes
the Trainer fills for a config's "auto" (`DEEPSPEED_AUTO`). What the tape holds:

    steady          bf16 weights (stage 3: this rank's partition, and the parameters under the persistence
                    threshold whole); this rank's fp32 partition of master weights, Adam's m and v; at stage 3
                    the reduce bucket and the bf16 gradient partition, allocated once at start-up
    forward, stage 3  each module gathered before it runs and released after; at a block's moment, its widest
                    module and the prefetch bucket's elements ahead of it (a bound: DeepSpeed prefetches the
                    modules its trace names, up to stage3_prefetch_bucket_size elements)
    backward        engine.backward's two 0-d losses (divided, scaled) to its return; the reduce bucket
                    (reduce_bucket_size elements) allocated at the first gradient; stage 1: each weight's gradient
                    kept whole to the end of backward, then reduced bucket by bucket and this rank's partition
                    copied out; stage 2: each gradient copied into the bucket as autograd hands it over, the
                    bucket reduced (the new gradient still live) when it would overflow, a gradient wider than the
                    bucket kept as its .grad and reduced with the next reduction, and this rank's part copied into
                    the gradient partition (grads_in_partition: whole, each gradient that reaches into this rank's
                    partition, allocated at the first reduction into it); stage 3: a gradient wider than the
                    bucket reduced on its own
    optimizer       the gradient norm; group by group (the Trainer's two; stage 3: one) the partition's
                    gradients flattened into a new tensor and cast to fp32 (in fp32 the flat tensor itself), the
                    clip factors, AdamW in place, the group's fp32 gradient freed; the weights gathered back
"""

from __future__ import annotations

import itertools

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.sizing.timeline.fsdp import ROOT, Fsdp, hf_layer, hf_root
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Tape, prod

# transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize: what a DeepSpeed config's "auto" becomes, in
# elements, from the model's hidden size h.
DEEPSPEED_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
# ZeRO's buffers on the tape.
BUCKET, PARTITION, GATHERED = "zero/reduce bucket", "zero/bf16 grad partition", "zero/gathered"
ENGINE_LOSSES, LOSS_GRAD = "zero/engine losses", "zero/loss grad"


class Zero:
    """DeepSpeed ZeRO on one rank of dp: the calls the hf walk makes around each block (those of `Fsdp`), and the
    element counts it works with."""

    def __init__(self, config: ModelConfig) -> None:
        h = config.h
        self.stage, self.dp, self.act = config.zero_stage, config.dp, DTYPE_BYTES[config.dtype]  # act: bf16's bytes
        self.layer, self.root = hf_layer(config, 1, 0).shapes, hf_root(config, 1).shapes
        self.threshold = threshold = DEEPSPEED_AUTO["stage3_param_persistence_threshold"](h)
        # every layer's own (a MoE model's dense layers among sparse ones hold other shapes), in registration order
        root = hf_root(config, 1).params
        named = [root[0], *(x for i in range(config.L) for x in hf_layer(config, 1, i).params), *root[1:]]
        shapes = [shape for _, shape in named]
        # the Trainer's two parameter groups (weights with decay, norms without), each partitioned on its own; stage 3
        # (not measured) flattened whole
        decay, rest = [x for x in named if len(x[1]) > 1], [x for x in named if len(x[1]) == 1]
        self.groups = tuple([prod(shape) for _, shape in group] for group in (decay, rest)) \
            if config.zero_stage < 3 else ([prod(x) for x in shapes],)
        # stages 1 and 2: the parameters that reach into rank 0's partition of their group (params_in_partition)
        self.reaching = frozenset(name for group in (decay, rest) for (name, _), start in zip(
            group, itertools.accumulate((prod(shape) for _, shape in group), initial=0))
            if start < self.partition(sum(prod(shape) for _, shape in group)))
        self.params = sum(prod(x) for x in shapes)  # every parameter of the model
        # stage 3: parameters under the persistence threshold, kept whole
        self.persistent = sum(prod(x) for x in shapes if prod(x) < threshold) if config.zero_stage == 3 else 0
        self.bucket = DEEPSPEED_AUTO["reduce_bucket_size"](h)
        self.prefetch = DEEPSPEED_AUTO["stage3_prefetch_bucket_size"](h)
        self.filled = 0  # elements in the reduce bucket
        self.waiting: list[str] = []  # stage 2: the parameters whose gradients the next reduction reduces

    def partition(self, elements: int) -> int:
        """This rank's share of `elements`, as DeepSpeed pads a partition: ceil(n/dp)."""
        return -(-elements // self.dp)

    @property
    def part(self) -> int:
        """This rank's partition of every group's parameters."""
        return sum(self.partition(sum(group)) for group in self.groups)

    @property
    def in_partition(self) -> int:
        """Stages 1 and 2: the elements of grads_in_partition, each parameter that reaches into rank 0's partition of
        its group whole (stage_1_and_2.py: params_in_partition's numel)."""
        def reaching(group: list[int]) -> int:
            starts = itertools.accumulate(group, initial=0)
            return sum(n for n, start in zip(group, starts) if start < self.partition(sum(group)))
        return sum(reaching(group) for group in self.groups)

    block_of = staticmethod(Fsdp.block_of)

    def states(self, tape: Tape) -> None:
        """bf16 weights (partitioned at stage 3), the fp32 partition of master weights and moments, and at stage 3
        the buffers DeepSpeed allocates once."""
        part = self.part
        if self.stage == 3:
            whole = self.persistent
            tape.add("states/weights", PARAMETERS, self.act * (self.partition(self.params - whole) + whole),
                     "this rank's bf16 partition of each parameter, and those under"
                     " stage3_param_persistence_threshold (10h: the norms) whole")
        else:
            tape.add("states/weights", PARAMETERS, self.act * self.params, "bf16 weights, whole on every rank")
        tape.add("states/master_weights", OPTIMIZER, 4 * part, "this rank's fp32 partition of the weights")
        tape.add("states/adam_m", OPTIMIZER, 4 * part, "AdamW's first moment of the partition, fp32")
        tape.add("states/adam_v", OPTIMIZER, 4 * part, "AdamW's second moment of the partition, fp32")
        tape.add("optimizer/step", OPTIMIZER, 4 * 2, "AdamW's 0-d fp32 step of each of the Trainer's two parameter"
                 " groups (with and without weight decay), each one flat partition")
        if self.stage == 3:
            tape.add(BUCKET, GRADIENTS, self.act * self.bucket, "stage 3's reduce bucket, reduce_bucket_size bf16"
                     " elements, allocated once")
            tape.add(PARTITION, GRADIENTS, self.act * part, "stage 3's grad_partitions_flat_buffer: this rank's bf16"
                     " gradient partition, allocated once")

    def copy_out(self, tape: Tape, block: str, phase: str, where: str) -> None:
        """Stage 3: the block's modules gathered as it runs, in place of the previous block's: its widest partitioned
        module and the prefetch bucket ahead of it (a bound)."""
        if self.stage != 3:
            return
        tape.drop(*[n for n in tape.live if n.startswith(f"{GATHERED} ")])
        shapes = self.root if block == ROOT else self.layer
        widest = max((prod(x) for x in shapes if prod(x) >= self.threshold), default=0)  # all whole: none gathered
        tape.add(f"{GATHERED} {block}", PARAMETERS, self.act * (widest + self.prefetch),
                 f"ZeRO-3: {block}'s widest module gathered whole in bf16, and the prefetch bucket's elements ahead")

    def forward_done(self, tape: Tape, keep: str | None = None) -> None:
        """Forward's gathers are released with their modules. DeepSpeed's engine.backward (runtime/engine.py) divides
        the loss by gradient_accumulation_steps and has the loss scaler scale it (by 1.0 in bf16 and fp32): two new
        0-d fp32 tensors, made before loss.backward() and held to engine.backward's return, its epilogue included."""
        tape.add(ENGINE_LOSSES, ACTIVATIONS, 4 * 2, "engine.backward's loss / gradient_accumulation_steps and"
                 " scale_if_loss's scaled loss, 0-d fp32")

    def post_forward(self, tape: Tape, block: str) -> None:
        """Modules are released after their forward (the next block's gather replaces this one's)."""

    def pre_backward(self, tape: Tape, block: str, where: str, prefetch: str | None) -> None:
        """Stage 3's gathers; before the loss's backward (the root's), the gradient autograd passes it through the
        engine's scaling and division (MulBackward0, DivBackward0): a 0-d fp32 tensor, freed after nll_loss's
        backward (hf's walk frees LOSS_GRAD there)."""
        if block == ROOT:
            tape.add(LOSS_GRAD, TEMPORARIES, 4, "the loss's gradient through engine.backward's scaling and division")
        self.copy_out(tape, block, "backward", where)

    def keep_grad(self, tape: Tape, block: str, name: str, nbytes: int) -> None:
        """A weight's gradient, as autograd hands it over (the reduce bucket allocated at the first, setup_buckets):
        kept whole at stage 1. Stage 2 (reduce_independent_p_g_buckets_and_remove_grads) first reduces what the
        bucket holds if this gradient would overflow it, the gradient still its own .grad, then copies it into the
        bucket; one wider than the bucket stays its own .grad, counted as filling the bucket, and is reduced with the
        next reduction. Stage 3 (not measured): reduced on its own when wider than the bucket."""
        elements = nbytes // self.act
        if BUCKET not in tape.live:
            tape.add(BUCKET, GRADIENTS, self.act * self.bucket, "the reduce bucket, reduce_bucket_size bf16 elements,"
                     " allocated at backward's first gradient")
        if self.stage == 1:
            tape.add(f"zero/grad {name}", GRADIENTS, nbytes, "the weight's bf16 .grad, kept whole to the end of"
                     " backward (stage 1 reduces after it)")
            return
        if self.stage == 3:
            self._keep_grad_stage3(tape, name, nbytes, elements)
            return
        tape.add(f"zero/grad {name}", GRADIENTS, nbytes, "the weight's .grad, until it is copied into the bucket or,"
                 " wider than the bucket, reduced in place")
        if self.filled + elements > self.bucket:
            self._to_partition(tape, name, f"the reduce bucket reduced before {name}'s gradient would overflow it")
        if elements <= self.bucket:
            tape.drop(f"zero/grad {name}")
        self.waiting.append(name)
        self.filled += elements

    def _keep_grad_stage3(self, tape: Tape, name: str, nbytes: int, elements: int) -> None:
        """Stage 3: each gradient copied into the reduce bucket (reduced first if it would overflow), or reduced on
        its own if wider than the bucket."""
        if elements > self.bucket:  # reduced in place on its own .grad, then this rank's part copied out
            tape.add(f"zero/grad {name}", GRADIENTS, nbytes, "a gradient wider than the bucket, reduced on its own")
            self._to_partition(tape, name, f"{name}'s gradient, wider than the bucket, reduced on its own")
            tape.drop(f"zero/grad {name}")
            return
        if self.filled + elements > self.bucket:
            self._to_partition(tape, name, f"the reduce bucket reduced before {name}'s gradient would overflow it")
            self.filled = 0
        self.filled += elements

    def _to_partition(self, tape: Tape, where: str, what: str) -> None:
        """This rank's part of a reduction copied into the bf16 gradient partition: allocated at stage 2 by the first
        reduction holding a parameter that reaches into it (copy_grads_in_partition), at stage 1 at its one
        reduction; at stage 2 the reduced gradients wider than the bucket then freed."""
        if PARTITION not in tape.live and (self.stage == 1 or self.reaching.intersection(self.waiting)):
            tape.add(PARTITION, GRADIENTS, self.act * self.in_partition, "grads_in_partition: each bf16 gradient"
                     " that reaches into this rank's partition, whole, allocated at the first reduction into it")
        tape.mark("backward", where, what)
        if self.stage == 2:
            tape.drop(*[f"zero/grad {n}" for n in self.waiting])
            self.waiting, self.filled = [], 0

    def post_backward(self, tape: Tape, block: str, where: str) -> None:
        """At the end of backward (the root's post-backward): the last bucket reduced, or at stage 1 every gradient
        reduced bucket by bucket and this rank's partition copied out; then the buffers stages 1 and 2 allocate
        per step released, the gradient partition kept for the optimizer."""
        if block != ROOT:
            return
        tape.drop("loss/grad seed")  # loss.backward() has returned: engine.backward's epilogue reduces
        if self.stage == 1:
            self._to_partition(tape, "", "stage 1 reduces every gradient after backward, bucket by bucket")
            tape.drop(*[n for n in tape.live if n.startswith("zero/grad ")])
        else:
            self._to_partition(tape, "", "the last reduce bucket reduced at the end of backward")
        if self.stage != 3:
            tape.drop(BUCKET)
        tape.drop(*[n for n in tape.live if n.startswith(f"{GATHERED} ")], ENGINE_LOSSES)
        self.filled = 0

    def optimizer_step(self, tape: Tape) -> None:
        """The global gradient norm (two 0-d fp32 tensors: it and its unscaled copy), then group by group
        (stage_1_and_2.py step()): the partition's gradients flattened into a new tensor and cast to fp32 beside them
        (in fp32 `.to` returns the flat tensor itself), the flat copy freed (after the last group's, the gradient
        partition its gradients viewed, but at stage 3); unscale_and_clip_grads' 0-d fp32 factors; AdamW on the group
        in place, and its fp32 gradient freed before the next group's is made."""
        tape.add("zero/grad norm", TEMPORARIES, 4 * 2, "the global gradient norm and _global_grad_norm, 0-d fp32")
        for i, group in enumerate(self.groups):
            part, fp32 = self.partition(sum(group)), f"zero/fp32 grad partition {i}"
            tape.add("zero/flat grad partition", TEMPORARIES, self.act * part, f"group {i}'s gradients flattened")
            if self.act == 4:
                tape.rename("zero/flat grad partition", fp32)
            else:
                tape.add(fp32, TEMPORARIES, 4 * part, f"group {i}'s flat partition cast to fp32: the gradient the"
                         " optimizer reads")
            tape.mark("optimizer", "", f"ZeRO's fp32 gradient partition of group {i} made from the flattened"
                      f"{' bf16' if self.act != 4 else ''} one")
            tape.drop("zero/flat grad partition")
            if i == len(self.groups) - 1 and self.stage != 3:
                tape.drop(PARTITION)  # its last views, the last group's gradients, freed
            tape.add("zero/clip", TEMPORARIES, 4 * 4, "unscale_and_clip_grads' 0-d fp32 clip, clamped clip, combined"
                     " scale and its reciprocal")
            tape.mark("optimizer", "", f"group {i}'s gradients unscaled and clipped: four 0-d fp32 factors")
            tape.drop("zero/clip")
            tape.mark("optimizer", "", f"AdamW on group {i}'s fp32 partition, in place")
            tape.drop(fp32)
        tape.drop("zero/grad norm")
