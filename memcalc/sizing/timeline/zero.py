"""DeepSpeed ZeRO (stages 1-3) in the step of transformers' Llama under the Trainer: its buffers as ops on the hf walk's
tape (memcalc.sizing.timeline.hf calls them where FSDP2's hooks would run: `Zero` answers the same calls as
memcalc.sizing.timeline.fsdp.Fsdp).

Modelled from DeepSpeed 0.19.8's own sources (deepspeed/runtime/zero/stage_1_and_2.py, stage3.py,
partitioned_param_coordinator.py) and measured by memcalc.probe.libs.hf_zero (DeepSpeed's engine on the fake group,
the Trainer's fused torch AdamW over its two groups): at stages 1 and 2 the state between steps and the peak, category
by category, and its moment are MemTracker's to the byte (with experts and gradient checkpointing too); at stage 3
MemTracker does not see the partition DeepSpeed keeps on each parameter (ds_tensor, no module's parameter). bf16 or
fp32 (stages 1 and 2) with DeepSpeed's default gradient accumulation dtype (the model's), contiguous_gradients on,
overlap_comm off at stages 1 and 2 and on at stage 3 (DeepSpeed's defaults), and the sizes the Trainer fills for a
config's "auto" (`DEEPSPEED_AUTO`). What the tape holds:

    steady          bf16 weights (stages 1 and 2: each group's flat buffer, padded to 2*dp elements; stage 3:
                    this rank's partition, and the parameters up to the persistence threshold whole); this
                    rank's fp32 partition of master weights, Adam's m and v; at stage 3 the reduce bucket and
                    the gradient partition (the model's dtype), allocated once at start-up
    forward, stage 3  each module gathered before it runs and released after; at a block's moment, its widest
                    module and the prefetch bucket's elements ahead of it (a bound: DeepSpeed prefetches the
                    modules its trace names, up to stage3_prefetch_bucket_size elements)
    backward        engine.backward's scaled copy of the loss, to its end, and the loss's gradient through it,
                    to nll_loss's backward; the reduce bucket (reduce_bucket_size elements) allocated at the first
                    gradient; stage 1: each weight's gradient kept whole to the end of backward, then each in
                    bit16_groups' order put through the bucket as stage 2 puts it (reduce_gradients: one that fits
                    copied in and freed, the bucket reduced before it overflows; another rank's gradient wider
                    than the bucket left in its .grad to backward's end); stages 2 and 3: each gradient copied
                    into the reduce bucket as autograd hands it over, the bucket reduced first (the new gradient
                    still live) when the gradient would overflow it and this rank's part copied into the gradient
                    partition (grads_in_partition: whole, each gradient that reaches into this rank's partition;
                    stage 2: allocated at the first reduction of one); a gradient wider than the bucket stays in
                    its .grad, the bucket's one gradient, until the next reduction; the last bucket reduced after
                    loss.backward() returns; stages 1 and 2: a reduction's slices bound for several ranks
                    flattened into one copy for the all-reduce
    optimizer       stages 1 and 2: each gradient of the partition cast to float64 for its norm, one at a time;
                    the gradient norm; group by group (the Trainer's two; stage 3: one) the partition's
                    gradients flattened into a new tensor (one gradient: a view of it) and cast to fp32 (in fp32
                    the flat tensor itself), the clip factors, AdamW in place, the group's fp32 gradient freed;
                    the weights gathered back
"""

from __future__ import annotations

import itertools

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.sizing.pipeline import stages
from memcalc.sizing.states import decays, zero_partition
from memcalc.sizing.timeline.fsdp import ROOT, hf_layer, hf_root, stage_params
from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, GRAD_SEED, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Tape, prod,
)

# transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize: what a DeepSpeed config's "auto" becomes, in
# elements, from the model's hidden size h.
DEEPSPEED_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
# ZeRO's buffers on the tape.
BUCKET, PARTITION, GATHERED = "zero/reduce bucket", "zero/bf16 grad partition", "zero/gathered"
SCALED_LOSS = "zero/scaled loss"
GRAD_NORM = "zero/gradient norm"  # not "zero/grad ...": the words for stage 1's whole gradients (timeline.words)
LOSS_GRAD = "zero/loss grad"


class Zero:
    """DeepSpeed ZeRO on one rank of dp: the calls the hf walk makes around each block (those of `Fsdp`), and the
    element counts it works with."""

    def __init__(self, config: ModelConfig) -> None:
        h = config.h
        self.stage, self.dp, self.act = config.zero_stage, config.dp, DTYPE_BYTES[config.dtype]  # act: bf16's bytes
        self.layer, self.root = hf_layer(config, 1, 0).params, hf_root(config, 1).params
        self.threshold = DEEPSPEED_AUTO["stage3_param_persistence_threshold"](h)
        # every layer's own (a MoE model's dense layers among sparse ones hold other shapes), in registration order
        params = stage_params(config, stages(config.L, 1, None)[0], 1)
        # the Trainer's two parameter groups (with weight decay, and the norms and biases without), each partitioned
        # on its own; stage 3 (not measured) flattened whole
        groups = ([x for x in params if decays(x.module)], [x for x in params if not decays(x.module)]) \
            if config.zero_stage < 3 else (params,)
        self.groups = tuple([prod(p.shape) for p in group] for group in groups)
        # each parameter's place in its group's flat buffer, in bit16_groups' order: (a rank's partition of the group,
        # start, elements)
        self.spans = {name: (self.partition(sizes), start, n) for sizes, group in zip(self.groups, groups)
                      for (name, *_), n, start in zip(group, sizes, itertools.accumulate(sizes, initial=0))}
        self.after_backward = False  # the engine's reductions after loss.backward() returns: MemTracker's activations
        # stages 1 and 2: the parameters that reach into rank 0's partition of their group, with their elements:
        # grads_in_partition holds each whole (stage_1_and_2.py: params_in_partition)
        self.mine = {name: n for sizes, group in zip(self.groups, groups)
                     for (name, *_), n, _ in zip(group, sizes, self._slices(sizes))}
        # stage 3 (one group): parameters of the persistence threshold or fewer elements, kept whole
        # (mark_persistent_parameters)
        self.persistent = sum(n for n in self.groups[0] if n <= self.threshold) if config.zero_stage == 3 else 0
        self.bucket = DEEPSPEED_AUTO["reduce_bucket_size"](h)
        self.prefetch = DEEPSPEED_AUTO["stage3_prefetch_bucket_size"](h)
        self.filled = 0  # elements in the reduce bucket
        self.wide: list[str] = []  # a gradient wider than the bucket, alone in it until the next reduction
        self.in_bucket: list[str] = []  # the weights whose gradients the next reduction reduces

    def partition(self, group: list[int]) -> int:
        """This rank's share of a group of parameters' elements, padded as DeepSpeed pads it (states.zero_partition)."""
        return zero_partition(self.stage, self.dp, group)

    @property
    def part(self) -> int:
        """This rank's partition of every group's parameters."""
        return sum(self.partition(group) for group in self.groups)

    @property
    def in_partition(self) -> int:
        """Stages 1 and 2: the elements of grads_in_partition, each parameter of `mine` whole."""
        return sum(self.mine.values())

    def _slices(self, sizes: list[int]) -> list[int]:
        """Stages 1 and 2: rank 0's part of each of a group's parameters (`sizes`, in order) that reaches into its
        partition of the group: averaged_gradients' views of grads_in_partition (get_flat_partition)."""
        end = self.partition(sizes)
        return [min(n, end - start) for n, start in zip(sizes, itertools.accumulate(sizes, initial=0)) if start < end]

    def states(self, tape: Tape) -> None:
        """bf16 weights (partitioned at stage 3), the fp32 partition of master weights and moments, and at stage 3
        the buffers DeepSpeed allocates once."""
        part = self.part
        if self.stage == 3:
            tape.add("states/weights", PARAMETERS, self.act * (part + self.persistent), "this rank's bf16 partition of"
                     " each parameter, and those of stage3_param_persistence_threshold (10h: the norms) elements or"
                     " fewer whole too")
        else:
            tape.add("states/weights", PARAMETERS, self.act * self.dp * part, "bf16 weights, whole on every rank:"
                     " each group's flat buffer, padded to dp partitions")
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
        sizes = [prod(x.shape) for x in (self.root if block == ROOT else self.layer)]
        widest = max((n for n in sizes if n > self.threshold), default=0)  # all whole: none gathered
        tape.add(f"{GATHERED} {block}", PARAMETERS, self.act * (widest + self.prefetch),
                 f"ZeRO-3: {block}'s widest module gathered whole in bf16, and the prefetch bucket's elements ahead")

    def forward_done(self, tape: Tape, keep: str | None = None) -> None:
        """engine.backward scales the loss (the Trainer turns its division by the accumulation steps off; the loss
        scaler multiplies by 1.0 in bf16 and fp32): a new 0-d fp32 tensor, to the end of engine.backward. Forward's
        gathers are released with their modules."""
        tape.add(SCALED_LOSS, ACTIVATIONS, 4, "engine.backward's loss times the loss scaler's scale, 0-d fp32")

    def post_forward(self, tape: Tape, block: str) -> None:
        """Modules are released after their forward (the next block's gather replaces this one's)."""

    def pre_backward(self, tape: Tape, block: str, where: str, prefetch: str | None) -> None:
        """Stage 3's gathers; before the loss's backward (the root's), the gradient autograd passes it through the
        engine's scaling (MulBackward0): a 0-d fp32 tensor, freed after nll_loss's backward (hf's walk frees LOSS_GRAD
        there)."""
        if block == ROOT:
            tape.add(LOSS_GRAD, TEMPORARIES, 4, "the loss's gradient through engine.backward's scaling")
        self.copy_out(tape, block, "backward", where)

    def keep_grad(self, tape: Tape, where: str, name: str, nbytes: int) -> None:
        """A weight's gradient, as autograd hands it over (the reduce bucket allocated at the first: setup_buckets, at
        every stage): kept whole at stage 1; at stages 2 and 3 the bucket reduced first if the gradient would overflow
        it, then the gradient copied into the bucket, or, wider than the bucket, left in its .grad as the bucket's one
        gradient until the next reduction. `where`: the module handing it over (MixtralExperts hands over two weights),
        MemTracker's place during the reduction."""
        if BUCKET not in tape.live:
            tape.add(BUCKET, GRADIENTS, self.act * self.bucket, "the reduce bucket, reduce_bucket_size elements,"
                     " allocated at backward's first gradient")
        if self.stage == 1:
            tape.add(f"zero/grad {name}", GRADIENTS, nbytes, "the weight's .grad, kept whole to the end of"
                     " backward (stage 1 reduces after it)")
            return
        grad = f"grad/{name}"
        tape.add(grad, GRADIENTS, nbytes, "the weight's .grad, as autograd hands it over")
        self._into_bucket(tape, where, grad, name, nbytes // self.act)

    def _into_bucket(self, tape: Tape, where: str, grad: str, name: str, elements: int) -> None:
        """reduce_independent_p_g_buckets_and_remove_grads on a weight's gradient (`grad` on the tape): the bucket
        reduced first if the gradient would overflow it, then the gradient copied into it (its .grad a view of the
        bucket), or, wider than the bucket, left in its .grad as the bucket's one gradient."""
        if self.filled and self.filled + elements > self.bucket:
            self._reduce(tape, where, f"the reduce bucket reduced before {name}'s gradient would overflow it")
        self.filled += elements
        self.in_bucket.append(name)
        if elements > self.bucket:
            self.wide.append(grad)
        else:
            tape.drop(grad)  # copied into the bucket, its .grad a view of it

    def _reduce(self, tape: Tape, where: str, what: str) -> None:
        """The bucket reduced into the gradient partition; a gradient wider than the bucket (alone in it) goes with
        it: its .grad moved into the partition, or at stages 2 and 3 cleared (reduce_ipg_grads: stage 1 leaves
        another rank's in its .grad to the end of backward)."""
        reaching = any(name in self.mine for name in self.in_bucket)
        copy = self._flat_copy() if self.stage < 3 else 0
        if copy:
            tape.add("zero/flat slices", ACTIVATIONS if self.after_backward else TEMPORARIES, self.act * copy,
                     "allreduce_and_scatter's flattened copy of the bucket's slices bound for several ranks")
            tape.mark("backward", where, f"{what}: its slices for several ranks flattened for the all-reduce")
            tape.drop("zero/flat slices")
        if not copy or (reaching and PARTITION not in tape.live):  # else the moment after the copy is the one before
            self._to_partition(tape, where, what, reaching)
        if reaching or self.stage > 1:
            tape.drop(*self.wide)
        self.filled, self.wide, self.in_bucket = 0, [], []

    def _flat_copy(self) -> int:
        """Stages 1 and 2, average_tensor: the bucket's gradients cut at the ranks' partitions, in the bucket's order
        (a slice for the rank of the one before it merged into it), all-reduced by allreduce_and_scatter in chunks
        closed past reduce_bucket_size elements, each flattened (torch's flatten: a copy of several tensors, a view of
        one): the widest copy's elements."""
        slices, rank_before = [], None
        for name in self.in_bucket:
            part, start, n = self.spans[name]
            for rank in range(start // part, (start + n - 1) // part + 1):
                size = min(start + n, (rank + 1) * part) - max(start, rank * part)
                if rank == rank_before:
                    slices[-1] += size
                else:
                    slices.append(size)
                rank_before = rank
        widest, chunk = 0, []
        for i, size in enumerate(slices):
            chunk.append(size)
            if sum(chunk) > self.bucket or i == len(slices) - 1:
                widest = max(widest, sum(chunk) if len(chunk) > 1 else 0)
                chunk = []
        return widest

    def _to_partition(self, tape: Tape, where: str, what: str, reaching: bool = True) -> None:
        """This rank's part of a reduction copied into the gradient partition, allocated at the first reduction
        of a gradient `reaching` into it (copy_grads_in_partition: a reduction of others' only clears them)."""
        if reaching and PARTITION not in tape.live:
            tape.add(PARTITION, GRADIENTS, self.act * self.in_partition, "grads_in_partition: each gradient"
                     " that reaches into this rank's partition, whole, allocated at the first reduction into it")
        tape.mark("backward", where, what)

    def post_backward(self, tape: Tape, block: str, where: str) -> None:
        """At the end of backward (the root's post-backward), after loss.backward() returns (its seed gone): at stage 1
        every gradient put through the bucket in bit16_groups' order (reduce_gradients, as stage 2's hook puts each);
        the last bucket reduced; then the buffers stages 1 and 2 allocate per step released, the gradient partition
        kept for the optimizer, and engine.backward's scaled loss with it as it returns."""
        if block != ROOT:
            return
        tape.drop(GRAD_SEED)  # loss.backward() has returned: engine.backward's epilogue reduces
        self.after_backward = True
        if self.stage == 1:  # reduce_gradients: every gradient through the bucket, in bit16_groups' order
            for name, (*_, elements) in self.spans.items():
                if (grad := f"zero/grad {name}") in tape.live:
                    self._into_bucket(tape, where, grad, name, elements)
        self._reduce(tape, "", "the last reduce bucket reduced at the end of backward")
        tape.drop(*[n for n in tape.live if n.startswith("zero/grad ")])
        if self.stage != 3:
            tape.drop(BUCKET)
        tape.drop(SCALED_LOSS, *[n for n in tape.live if n.startswith(f"{GATHERED} ")])

    def optimizer_step(self, tape: Tape) -> None:
        """Stages 1 and 2: the gradient norm group by group (`_norms`); the global gradient norm (two 0-d fp32
        tensors: it and its unscaled copy), then group by group (stage_1_and_2.py step()): the partition's gradients
        flattened into a new tensor (torch's flatten of one tensor, a view of it: none) and cast to fp32 beside them
        (in fp32 `.to` returns the flat tensor itself), the flat copy freed (after the last group's, the gradient
        partition its gradients viewed, but at stage 3, or while an fp32 view of it is the optimizer's gradient);
        unscale_and_clip_grads' 0-d fp32 factors; AdamW on the group in place, and its fp32 gradient freed before the
        next group's is made."""
        if self.stage < 3:
            self._norms(tape)
        tape.add(GRAD_NORM, TEMPORARIES, 4 * 2, "the global gradient norm and _global_grad_norm, 0-d fp32")
        for i, group in enumerate(self.groups):
            part, fp32 = self.partition(group), f"zero/fp32 grad partition {i}"
            viewed = self.stage < 3 and len(self._slices(group)) == 1  # rank 0 of dp > 1: never the aligned flatten
            if not viewed:
                tape.add("zero/flat grad partition", TEMPORARIES, self.act * part, f"group {i}'s gradients flattened")
            if self.act != 4:
                tape.add(fp32, TEMPORARIES, 4 * part, f"group {i}'s flat partition cast to fp32: the gradient the"
                         " optimizer reads")
            elif not viewed:  # viewed: the optimizer's gradient is a view of grads_in_partition
                tape.rename("zero/flat grad partition", fp32)
            bf16 = " bf16" if self.act != 4 else ""
            made = f"made from the flattened{bf16} one"
            if viewed:
                made = "cast from its one bf16 gradient" if bf16 else "a view of its one gradient"
            tape.mark("optimizer", "", f"ZeRO's fp32 gradient partition of group {i} {made}")
            tape.drop("zero/flat grad partition")
            last = i == len(self.groups) - 1 and self.stage != 3
            if last and fp32 in tape.live:
                tape.drop(PARTITION)  # its last views, the last group's gradients, freed
            tape.add("zero/clip", TEMPORARIES, 4 * 4, "unscale_and_clip_grads' 0-d fp32 clip, clamped clip, combined"
                     " scale and its reciprocal")
            tape.mark("optimizer", "", f"group {i}'s gradients unscaled and clipped: four 0-d fp32 factors")
            tape.drop("zero/clip")
            tape.mark("optimizer", "", f"AdamW on group {i}'s fp32 partition, in place")
            tape.drop(fp32)
            if last:
                tape.drop(PARTITION)  # an fp32 view of it was the last group's gradient
        tape.drop(GRAD_NORM)

    def _norms(self, tape: Tape) -> None:
        """get_grad_norm_direct, group by group: each gradient of the partition (`_slices`) cast to float64
        (get_norm_dtype) for its norm, a 0-d float64 kept per gradient, each group's norm left a 0-d fp32; marked at
        each group's widest cast with the norms before it."""
        for i, group in enumerate(self.groups):
            slices = self._slices(group)
            j = max(range(len(slices)), key=lambda k: slices[k] + k)  # the cast with the most bytes beside it
            tape.add("zero/norms", TEMPORARIES, 4 * i + 8 * j, "the earlier groups' 0-d fp32 norms and this group's"
                     " earlier gradients' 0-d float64 norms")
            tape.add("zero/norm cast", TEMPORARIES, 8 * slices[j] + 8, f"group {i}'s gradient cast to float64 for its"
                     " norm, and the norm")
            tape.mark("optimizer", "", f"group {i}'s widest gradient in the partition cast to float64 for its norm")
            tape.drop("zero/norms", "zero/norm cast")
