"""One training step of torchtitan's own Llama3 model on one rank (`--impl torchtitan`), described once as ops.

The same step `memcalc.probe.libs.torchtitan_step` trains, as ordered ops for the generic walk
(memcalc.sizing.timeline.walk), keeping the torchtitan ledger's tensors (memcalc.model.impls.torchtitan). A block's
ops, the model's ends, its TP plan, FullAC and SelectiveAC, FSDP2 and where it is exact: docs/timeline.md,
"torchtitan's Llama3Model".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.evaluate import estimate
from memcalc.model.impls import torchtitan as rules
from memcalc.model.knobs import DTYPE_BYTES, Accounting
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import Stage, stage_named, stage_rank, torchtitan_microbatches
from memcalc.sizing.states import moe_layers_held
from memcalc.sizing.timeline import torchtitan_mla
from memcalc.sizing.timeline.ends import model_states, optimizer_step
from memcalc.sizing.timeline.fsdp import OUTPUT, Fsdp, torchtitan_block
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRAD_SEED, PARAMETERS, TEMPORARIES, Sizes, Tape, Timeline
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD, linear, module_returns, swiglu_ops, tied_sum
from memcalc.sizing.timeline.torchtitan_moe import moe_ops, permuted_stream_grad
from memcalc.sizing.timeline.walk import Checkpoint, Made, Op, Step, Walk, kept, kept_name, kept_names
from memcalc.sizing.totals import end_bytes


def torchtitan_timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting) -> Timeline:
    """The moments of one training step of torchtitan's Llama3Model sized by `config`, on its one rank (a pipeline
    stage's rank: memcalc.sizing.timeline.torchtitan_pp)."""
    stage = stage_named(config, None)
    parts, fsdp = model_parts(config, strategy, accounting, stage)
    parts.tape.mark("steady", "", "model states between steps")
    _walk(parts, fsdp, stage)
    return parts.timeline("only")


def model_parts(config: ModelConfig, strategy: Strategy, accounting: Accounting,
                stage: Stage) -> tuple[Parts, Fsdp | None]:
    """The tape with `stage`'s model states on it (under FSDP2 its sharded ones: the Fsdp), and what its segments are
    built from."""
    check_modelled(config, strategy)
    layer = estimate(config, strategy, accounting)
    # under recomputation each block's rerun keeps what a block without it keeps: the walk sizes those
    every = estimate(replace(config, recompute="none"), strategy, accounting) if config.recompute != "none" else layer
    unpadded = replace(config, make_vocab_size_divisible_by=1)  # torchtitan trains the vocabulary as it is
    # under FSDP2 its TP plan runs on DTensor (memcalc.probe.libs.torchtitan_step.data_parallel)
    z = replace(Sizes.of(unpadded, strategy), dtensor=config.dp_shard is not None, cuda=accounting.device == "cuda",
                stage_receives=not stage.has_embedding, stage_sends=not stage.has_output)
    tape = Tape()
    fsdp = Fsdp.torchtitan(unpadded, z.t, z.sp, stage) if config.dp_shard is not None else None
    if fsdp is None:
        model_states(tape, unpadded, stage, z)
    else:
        fsdp.states(tape)
    tape.add("states/rope caches", PARAMETERS, stage.layers * _rope_cache(config, z),
             "each block's RoPE keeps its own table, a buffer")
    if config.moe:
        tape.add("states/moe buffers", PARAMETERS, moe_layers_held(config, stage) * 2 * 4 * config.num_experts,
                 "each MoE keeps two fp32 (E,) buffers: expert_bias_E and tokens_per_expert_E")
    # without FSDP2 a weight's bf16 gradient is added into the fp32 buffer and dropped as autograd hands it over
    hand_over = (lambda where, name, nbytes: tape.drop(name)) if fsdp is None else _keep_grad(tape, fsdp)
    saved = {x.tensor.name: x.bytes for x in (*every.tensors, *every.dense)}  # a MoE layer's, and a dense one's
    return Parts(tape, config, z, layer.strategy, saved, _end_bytes(unpadded, strategy, accounting), hand_over), fsdp


def _rope_cache(config: ModelConfig, z: Sizes) -> int:
    """Bytes of one block's RoPE table: ComplexRoPE's complex64 (s, d/2) (DeepSeek-V3's over each head's d_r RoPE
    channels), or Qwen3's CosSinRoPE's fp32 (s, 2d) (cos and sin, each over d channels)."""
    if config.mla:
        return 8 * config.s * (config.qk_rope_head_dim // 2)
    return 8 * config.s * (z.d if config.qk_layernorm else z.d // 2)


@dataclass(frozen=True)
class Parts:
    """What the model's segments are built from: the tape, the sizes, the bytes the blocks (`saved`) and the ends
    (`end`) keep, and what happens to a weight's gradient autograd hands over."""

    tape: Tape
    config: ModelConfig
    z: Sizes
    strategy: Strategy  # the strategy as the ledger checked it
    saved: dict[str, int]
    end: dict[str, int]
    hand_over: Callable[[str, str, int], None]

    def timeline(self, stage: str) -> Timeline:
        """The step's moments, ended by the optimizer's."""
        optimizer_step(self.tape, self.config)
        return Timeline(self.strategy, self.tape.moments, stage)

    def ends(self, unit: str | None, where: str, ops: tuple[Op, ...]) -> Segment:
        """A segment of the model's ends (or the trainer's ops: `unit` None)."""
        return Segment(unit, where, Walk(self.tape, "", "", self.end, self.hand_over), ops)

    def blocks(self, layers: range) -> list[Segment]:
        """Each block of `layers`, its own segment (its own walk: a checkpoint's rerun is the walk's state)."""
        config, z = self.config, self.z
        return [Segment(f"layers.{i}", f"layers.{i}", Walk(
            self.tape, f"layers.{i}", torchtitan_block(i, config), self.saved, self.hand_over,
            block_checkpoint(i, config, z)), block_ops(i, z, config)) for i in layers]

    def chunk(self, stage: Stage, layers: range, pipelined: bool = False) -> tuple[list[Segment], list[Segment]]:
        """The segments of `stage`'s model chunk (on the first stage the embedding, then its `layers`, on the last
        the final norm and lm_head), and on the last stage the loss's (`pipelined`: the schedule's, after the chunk
        returns)."""
        z, config = self.z, self.config
        first = [self.ends("tok_embeddings", "tok_embeddings", (embedding_ops(z, config.tie_embeddings)[1],))]
        chunk = [*(first if stage.has_embedding else []), *self.blocks(layers)]
        if not stage.has_output:
            return chunk, []
        *norm, lm_head, loss = output_ops(z, config, pipelined)
        return [*chunk, self.ends(OUTPUT, "norm", tuple(norm)), self.ends(OUTPUT, "lm_head", (lm_head,))], [
            self.ends(None, "", (loss,))]


def _walk(parts: Parts, fsdp: Fsdp | None, stage: Stage) -> None:
    """The whole model's step on its one rank: the trainer's forward, loss.backward(), under FSDP2 its hooks."""
    tape = parts.tape
    chunk, loss = parts.chunk(stage, range(parts.config.L))
    segments = [parts.ends(None, "", embedding_ops(parts.z)[:1]), *chunk, *loss]
    for i, segment in enumerate(segments):
        segment.forward(fsdp, segments[i + 1].unit if i + 1 < len(segments) else None)
    order = list(dict.fromkeys(x.unit for x in segments if x.unit is not None))  # the units in forward order
    for segment in reversed(segments):
        i = order.index(segment.unit) if segment.unit is not None else 0
        segment.backward(fsdp, order[i - 1] if i else None)
    if fsdp is not None:  # the final callback: the embedding's post-backward (its input, the ids, needs no gradient)
        _post_backward(fsdp, tape, "tok_embeddings", "")
        tape.drop("fsdp/tok_embeddings reduce-scatter")
        fsdp.finalize_backward(tape)
    tape.drop(GRAD_SEED)  # backward() returns


def check_modelled(config: ModelConfig, strategy: Strategy) -> None:
    """ConfigError naming the first thing the torchtitan step timeline does not model yet."""
    sharded_tp = config.dp_shard is not None and strategy.weight_shards(config.t) > 1
    m = torchtitan_microbatches(config)
    pp_sharded = config.pp > 1 and config.dp_shard is not None
    missing = [
        # measured (FSDPMemTracker op by op; t=2, dp_shard=2, L=1, b=2, s=24, h=64, f=102): on the partial_dtensor
        # backend the stream between blocks is a Replicate DTensor (its plan's "I" has no DTensor placement), and
        # torch's _redistribute_backward leaves a Partial gradient Partial, so lm_head's dX is all-reduced only in
        # tok_embeddings' backward, not at lm_head, w1/w3 or wqkv (the walk's f copies). It reaches w2 and wo Partial,
        # and DTensor's mm for Partial dY against Shard(-1) x all-gathers x (dW whole, (h, f) Partial, reduce-scattered
        # over t at the block's post-backward) and the Shard(1) weight (dX whole, (b*s, f), reduce-scattered to
        # Shard(-1) by each factor of the product's backward, and for wo once before SDPA's). The peak agrees here,
        # but from w1's backward on each moment holds 6,528 B more: w2's dW whole, 2*h*f, where the walk has 2*h*f/t;
        # at f=400, L=2 the peak moves into w2's backward, 89,600 B above the walk's
        (sharded_tp and not strategy.sequence_parallel, "dp_shard with tp (t > 1 without sequence parallel: on DTensor"
                                                        " the stream's gradient stays Partial down to tok_embeddings,"
                                                        " so w2 and wo gather their inputs and weights in backward;"
                                                        " tp-sp, torchtitan's default, is modelled)"),
        (config.reduce_dtype != "fp32", f"reduce_dtype {config.reduce_dtype} (torchtitan reduces in float32 only)"),
        (config.moe and config.ep > 1 and not strategy.sequence_parallel, f"experts at ep={config.ep} under tp without"
         " sequence parallel (its MoE slices the replicated input; tp-sp, torchtitan's default, is modelled)"),
        (config.moe and sharded_tp, "experts under dp_shard with tp (FSDP2 over its MoE sharding plan)"),
        (config.tie_embeddings and config.dp_shard is not None,
         "tie_embeddings with dp_shard (tied, apply_fsdp shards tok_embeddings, norm and lm_head as one unit)"),
        # the pipelined walk (memcalc.sizing.timeline.torchtitan_pp)
        (config.pp > m, f"num_microbatches={m} below pp={config.pp} (torch's Schedule1F1B refuses it)"),
        # pp with dp_shard is measured on a pp x dp_shard mesh (memcalc.probe.libs.torchtitan_pp) at t = 1, ep = 1
        (pp_sharded and (sharded_tp or config.ep > 1 or (config.dp_replicate or 1) > 1),
         "pp with dp_shard beside tp, ep > 1 or dp_replicate (FSDP2 on each stage's chunk is walked at t = 1 and"
         " ep = 1, without HSDP)"),
        (config.cp != 1, f"cp={config.cp}"),
        (config.b * config.s == 1, "b = s = 1 (V is then a view of the fused wqkv output)"),
    ]
    for absent, what in missing:
        if absent:
            raise ConfigError(f"the step timeline for impl torchtitan does not model {what} yet")


def stage_layers(config: ModelConfig, stage: Stage) -> range:
    """The layers `stage`'s chunk holds, as torchtitan's pipeline_llm splits them (all of them without pp)."""
    return config.rank_chunks(stage_rank(stage.name, config.pp))[0]


def block_checkpoint(i: int, config: ModelConfig, z: Sizes) -> Checkpoint | None:
    """torchtitan's FullAC or SelectiveAC around block i (torch.utils.checkpoint, non-reentrant): its input held,
    and under op the op outputs SelectiveAC caches, the ledger's (the block's input aside), and on DTensor under SP
    wo's and w2's reduce-scatter outputs (funcol's reduce_scatter_tensor, on its list of communication ops to save).
    Under FSDP2 its apply_fsdp_to_decoder shards the checkpoint wrapper, whose rerun calls the block inside it, no
    FSDP unit: FSDPMemTracker reads the rerun's tensors as temporaries."""
    if config.recompute == "none":
        return None
    p = f"layers.{i}"
    cached = rules.op_checkpoint(config, config.is_moe_layer(i)) if config.recompute == "op" else ()
    cached = tuple(torchtitan_mla.cached_as(x, z) for x in cached)  # DeepSeek-V3's outputs kept as other terms too
    scattered = (f"{p}/attention out", f"{p}/ffn out") if cached and z.dtensor and z.sp else ()
    return Checkpoint(f"{p}/input", frozenset((*(kept_name(p, x) for x in cached if x != ledger.LAYER_INPUT),
                                               *scattered)),
                      ACTIVATIONS if config.dp_shard is None else TEMPORARIES)


@dataclass(frozen=True)
class Segment:
    """Ops of one FSDP2 unit (or of none) walked together: FSDP2's hooks run at a segment's edges. `where`: the
    module whose hooks they are."""

    unit: str | None
    where: str
    walk: Walk
    ops: tuple[Op, ...]

    def forward(self, fsdp: Fsdp | None, following: str | None) -> None:
        """The unit's pre-forward (gathered, unless still unsharded), the ops, then, at its last segment, its
        post-forward; the model's forward returns after the last unit's (its last all-gather buffer freed)."""
        tape = self.walk.tape
        if fsdp is not None and self.unit is not None:
            fsdp.copy_out(tape, self.unit, "forward", self.where)
        self.walk.forward(self.ops)
        if fsdp is not None and self.unit is not None and following != self.unit:
            fsdp.post_forward(tape, self.unit)
            if self.unit == OUTPUT:
                fsdp.forward_done(tape)

    def backward(self, fsdp: Fsdp | None, prefetch: str | None) -> None:
        """The unit's pre-backward (unsharded again if resharded, the unit before it prefetched), the ops' backward,
        then its post-backward for the parameters that have a gradient (the embedding's runs in the final
        callback). Under a checkpoint the pre-backward is read in the block inside the wrapper (entered in backward
        with it), the post-backward in the wrapper."""
        tape = self.walk.tape
        if fsdp is None or self.unit is None:
            self.walk.backward(self.ops)
            return
        where = self.walk.module if self.walk.checkpoint is not None else self.where
        # at lm_head the unit is still unsharded from forward, and FSDP2 issues the last block's all-gather only at
        # the norm's pre-backward (FSDPMemTracker's readings): nothing happens here
        if self.unit != OUTPUT or self.where != "lm_head":
            fsdp.pre_backward(tape, self.unit, where, prefetch)
        self.walk.backward(self.ops)
        if self.unit != "tok_embeddings":
            _post_backward(fsdp, tape, self.unit, self.where)


def _post_backward(fsdp: Fsdp, tape: Tape, unit: str, where: str) -> None:
    """FSDP2's post-backward of `unit` for the parameters that have a gradient now (norm and lm_head's runs twice:
    after lm_head's backward, with lm_head's alone, and after the norm's, which gathers the unit again)."""
    held = tuple(n.split(" grad ", 1)[1] for n in tape.live if n.startswith(f"fsdp/{unit} grad "))
    fsdp.post_backward(tape, unit, where, held)


def _keep_grad(tape: Tape, fsdp: Fsdp):
    """Under FSDP2 a weight's bf16 gradient is the unsharded parameter's .grad, kept to its unit's reduce-scatter; a
    module of several parameters (GroupedExperts) hands each over under its parameter's name (GROUPED_WEIGHTS). Where
    the .grad is there already (under pp, kept from an earlier micro-batch) autograd adds the gradient into it."""
    def keep(where: str, name: str, nbytes: int) -> None:
        param = where if fsdp.unit_of(where) else f"{where}.{name.rsplit('/', 1)[1]}"
        grad = f"fsdp/{fsdp.unit_of(param)} grad {param}"
        if grad in tape.live:
            tape.drop(name)
        else:
            tape.rename(name, grad)
    return keep


def _end_bytes(config: ModelConfig, strategy: Strategy, accounting: Accounting) -> dict[str, int]:
    """The bytes of what the model's ends keep on this rank: the final norm's (named in
    memcalc.model.impls.torchtitan as the block's norms are) and lm_head's input."""
    out = {x.name: end_bytes(x, config, strategy, accounting) for x in rules.norm_block(rules.FINAL_NORM, accounting)}
    # lm_head keeps its input all-gathered along s (its plan declares it Replicate), as the blocks' linears do
    return out | {ledger.OUTPUT_INPUT.name: DTYPE_BYTES[config.dtype] * config.b * config.s * config.h}


# -- the ops ----------------------------------------------------------------------------------------------------


def norm(where: str, z: Sizes, norm: rules.RMSNormTensors, p: str, out: Made, grad: str, dx: str, x: str,
         frees: tuple[str, ...] = (), stream: str = "", rows: int = 0, width: int = 0) -> Op:
    """nn.RMSNorm: on CUDA torch's fused kernel (`fused_rms_norm`, keeping its input `x` itself), on a CPU torch's
    rms_norm_composite, op by op, and its backward through autograd.

    The composite's forward keeps the fp32 input, the rstd and x * rstd (the ledger's); `frees` go once the output
    is made. Backward ends with dX cast back to bf16 (`dx`). In fp32 the input is x itself, so autograd adds x's two
    gradients into the residual stream's (`stream`, its gradient; `dx` then the sum) as each comes. It normalises
    `rows` rows of `width` channels: by default each token's h (under SP this rank's sequence shard's), Qwen3's head
    norms each head's d.
    """
    tokens, width = rows or z.b * z.s_seq, width or z.h
    if z.cuda:
        return fused_rms_norm(where, z, norm, p, out, grad, dx, x, z.act * tokens * width)
    n, full, row = f"{p}/{where}" if p else where, 4 * tokens * width, 4 * tokens
    fp32, rstd, normed = kept_names(p, norm.input_fp32, norm.rstd, norm.normed_fp32)
    # under a checkpoint (which keeps none of them) x * rstd goes after the weight multiply, the upcast input before
    # the cast back
    times = (Made(f"{n}/weighted", full, "x * rstd * weight, a local"),)
    weighted = (Step("times the weight, in fp32", times, reads_last=(normed, fp32)),)
    # its input is spmd_types' reduce-scatter's (s/t, b, h) output seen as (b, s/t, h), not contiguous (DTensor's
    # reduce-scatter along s makes (b, s/t, h) itself; a pipeline stage's received input is its (b, s/t, h) receive
    # buffer, whose layout every residual sum on the stage keeps: `Sizes.stage_receives`); a head norm's input is
    # the split's contiguous copy
    if z.sp and z.b > 1 and not z.dtensor and not z.stage_receives and not rows:
        weighted = (Step("times the weight, in fp32", times, reads_last=(normed,)),
                    Step("made contiguous", (Made(f"{n}/copy", full, "fp32, a local"),), frees=(f"{n}/weighted",),
                         reads_last=(fp32,)))
    cast = z.act != 4  # in fp32 input.to(float32) is x itself, kept by the norm, and the weighted product the output
    if not cast:
        fp32 = x
    head = (
        *((Step("input.to(float32)", (kept(p, norm.input_fp32),)),) if cast else ()),
        Step("pow(2)", (Made(f"{n}/pow", full, "x^2, a local"),)),
        Step("mean over h", (Made(f"{n}/mean", row, "mean(x^2), a local"),)),
        Step("rsqrt(mean + eps)", (kept(p, norm.rstd),), frees=(f"{n}/pow", f"{n}/mean")),
        Step("x * rstd", (kept(p, norm.normed_fp32),)),
    )
    forward = (*head, *weighted, Step("cast back to bf16: the norm's output", (out,),
                                      frees=(f"{n}/weighted", f"{n}/copy", *frees), reads_last=(rstd,))) if cast else (
        *head, Step("times the weight: the norm's output", (out,), frees=tuple(f for f in frees if f != x),
                    reads_last=(normed, rstd)))
    g = f"grad/{n}"
    # in fp32 dY is the output's gradient itself, the summed product the weight's gradient, and x's summed gradients dX
    dy, dw = (f"{g}/dy", f"{g}/dw fp32") if cast else (grad, f"{g}/dweight")
    weight_grad = (Step("cast to bf16: the weight's gradient", (Made(f"{g}/dweight", z.weight(where), WHY_WGRAD),),
                        frees=(dy, dw, normed), hands_over=(f"{g}/dweight",)),) if cast else (
        Step("", frees=(dy, normed), hands_over=(dw,)),)
    backward = (
        *((Step("the cast's backward: dY up to fp32", (Made(dy, full, "dY in fp32"),), frees=(grad,)),)
          if cast else ()),
        Step("times the weight's backward: dY * weight", (Made(f"{g}/dnormed", full, "the gradient of x * rstd"),)),
        Step("its weight's: dY * (x * rstd)", (Made(f"{g}/dw full", full, "per token, before the sum"),),
             reads_last=(normed,)),
        Step("summed over tokens", (Made(dw, z.weight(where, 4), "the weight's fp32 gradient"),),
             frees=(f"{g}/dw full",)),
        *weight_grad,
        Step("x * rstd's backward: dnormed * rstd", (Made(f"{g}/dx (x * r)", full, "x's first fp32 gradient"),)),
        Step("x * rstd's backward: dnormed * x", (Made(f"{g}/dr full", full, "per element, before the sum"),)),
        Step("summed over h: rstd's gradient", (Made(f"{g}/dr", row, "(b, s, 1) fp32"),),
             frees=(f"{g}/dnormed", f"{g}/dr full")),
        *((Step("x's first gradient added to the residual stream's", (Made(f"{g}/dx (sum)", full, "a new tensor"),),
                frees=(f"{g}/dx (x * r)", stream)),) if stream else ()),
        Step("rsqrt's backward: rstd^3", (Made(f"{g}/r^3", row, "(b, s, 1) fp32"),)),
        Step("rsqrt's backward: -rstd^3 / 2", (Made(f"{g}/-r^3 / 2", row, "(b, s, 1) fp32"),)),
        Step("rsqrt's backward: times dr", (Made(f"{g}/dvariance", row, "(b, s, 1) fp32"),),
             frees=(f"{g}/dr", f"{g}/r^3", f"{g}/-r^3 / 2", rstd)),
        Step("mean's backward: spread over h, divided by h", (Made(f"{g}/dpow", full, "the gradient of x^2"),),
             frees=(f"{g}/dvariance",)),
        Step("pow's backward: x^1", (Made(f"{g}/x^1", full, "pow(x, 1), a copy"),)),
        Step("pow's backward: 2 x", (Made(f"{g}/2x", full, "fp32"),)),
        Step("pow's backward: dpow * 2x", (Made(f"{g}/dx (pow)", full, "x's second fp32 gradient"),),
             frees=(f"{g}/x^1", f"{g}/2x", f"{g}/dpow", fp32)),
        Step("autograd sums x's two fp32 gradients", (Made(f"{g}/dx fp32" if cast else dx, full, "fp32"),),
             frees=(f"{g}/dx (sum)" if stream else f"{g}/dx (x * r)", f"{g}/dx (pow)")),
        *((Step("input.to(float32)'s backward: dX cast back to bf16", (Made(dx, z.act * tokens * width, "the norm's"
                                                                           " dX"),), frees=(f"{g}/dx fp32",)),)
          if cast else ()),
    )
    return Op(where, forward, backward, saves=(*((norm.input_fp32,) if cast else ()), norm.rstd, norm.normed_fp32))


def fused_rms_norm(where: str, z: Sizes, tensors: rules.RMSNormTensors, p: str, out: Made, grad: str, dx: str,
                   x: str, dx_bytes: int) -> Op:
    """nn.RMSNorm on CUDA: torch's _fused_rms_norm, one kernel each way (a non-contiguous input's copy is its own,
    as its workspace). Forward makes the output and the fp32 rstd; it keeps the input `x` (the residual stream's
    tensor itself: the ledger's input term) and rstd; backward makes dX and the weight's gradient beside dY, then
    dY, `x` and rstd go (`dx_bytes`: dX's size, its input's)."""
    n = f"{p}/{where}" if p else where
    rstd, dweight = kept_name(p, tensors.rstd), f"grad/{n}/dweight"
    return Op(where, forward=(
        Step("_fused_rms_norm: the output and rstd", (out, kept(p, tensors.rstd)), reads_last=(rstd,)),
    ), backward=(
        Step("_fused_rms_norm_backward: dX and the weight's gradient", (
            Made(dx, dx_bytes, "the norm's dX"), Made(dweight, z.weight(where), WHY_WGRAD)),
            frees=(grad, x), hands_over=(dweight,)),
    ), saves=(tensors.rstd,))


def gather(where: str, z: Sizes, p: str, out: Made, dx: str, rs: str, frees: tuple[str, ...] = ()) -> tuple[Op, ...]:
    """SP's all-gather along s at a module's entry (its plan declares the input Replicate): the shards into a (t, b,
    s/t, h) buffer, concatenated into (b, s, h) (`out`, which the column-parallel linears keep), then `frees`. In
    backward dX (`dx`, whole) made s-first and reduce-scattered into this rank's shard (`rs`). Under tp without SP
    the paper's f: nothing in forward, dX all-reduced into a copy (`rs`) in backward. None at t = 1."""
    if z.t > 1 and not z.sp:
        return (Op(where, forward=(), backward=(
            Step("f's backward: dX all-reduced into a copy", (Made(rs, z.full(z.h), "(b, s, h), summed"),),
                 frees=(dx,)),)),)
    if not z.sp:
        return ()
    n, g = f"{p}/{where}" if p else where, f"grad/{p}/{where}" if p else f"grad/{where}"
    return (Op(where, forward=_all_gather(f"{n} gathered", out, z, "concatenated along s", frees),
               backward=_reduce_scattered(f"{g} s-first", z, "dX", Made(rs, z.seq(z.h), "this rank's shard of dX"),
                                          (dx,))),)


def _all_gather(buffer: str, out: Made, z: Sizes, what: str, frees: tuple[str, ...]) -> tuple[Step, ...]:
    """SP's all-gather along s: the shards into a (t, b, s/t, h) buffer, concatenated into (b, s, h) (`out`, `what`),
    then the buffer and `frees` go. On DTensor at b = 1 the buffer, (t, 1, s/t, h), is (1, s, h) already: `out`."""
    if z.dtensor and z.b == 1:
        return (Step("the all-gather's output", (out,), frees=frees),)
    return (Step("the all-gather's buffer", (Made(buffer, z.full(z.h), "(t, b, s/t, h)"),)),
            Step(what, (out,), frees=(buffer, *frees)))


def _reduce_scattered(name: str, z: Sizes, what: str, out: Made, frees: tuple[str, ...],
                      label: str = "the reduce-scatter's output", then: tuple[str, ...] = ()) -> tuple[Step, ...]:
    """SP's reduce-scatter along s of `what` into this rank's shard (`out`, made at `label`), then `frees` go, the
    copy, and `then` (the module's own locals). Its input is first made (s, b, h)-contiguous (`name`): a copy, but at
    b = 1, where the permuted view is (on DTensor a copy always: its reduce-scatter along s concatenates the chunks)."""
    copy = () if z.b == 1 and not z.dtensor else (
        Step(f"{what} made s-first for the reduce-scatter", (Made(name, z.full(z.h), "(s, b, h)"),)),)
    return (*copy, Step(label, (out,), frees=(*frees, name, *then)))


def _gathered_dy(g: str, z: Sizes, gathered: str, frees: tuple[str, ...] = ()) -> tuple[Step, ...]:
    """In backward, dY's shard all-gathered along s into the whole (`gathered`), then `frees` go. The shard is first
    made contiguous (f"{g} dY") where the residual stream's gradient is a permuted view (`permuted_stream_grad`)."""
    copy = () if not permuted_stream_grad(z) else (
        Step("dY made contiguous", (Made(f"{g} dY", z.seq(z.h), "this rank's shard"),)),)
    return (*copy, *_all_gather(f"{g} buffer", Made(gathered, z.full(z.h), "(b, s, h)"), z,
                                "concatenated along s: dY whole", (f"{g} dY", *frees)))


def reduce_scatter(where: str, z: Sizes, p: str, partial: str, out: str, gathered: str,
                   frees: tuple[str, ...]) -> tuple[Op, ...]:
    """SP's reduce-scatter of a row-parallel linear's partial sum (`partial`) into this rank's shard (`out`); with it
    `frees` go (the module returns). In backward dY's shard all-gathered whole (`gathered`), the shard itself kept
    for the residual stream. Under tp without SP the paper's f*: the partial sum all-reduced into a copy (`out`), and
    nothing in backward. None at t = 1."""
    if z.t > 1 and not z.sp:
        return (Op(where, forward=(Step("f*: the partial sum all-reduced into a copy", (
            Made(out, z.full(z.h), "(b, s, h), summed"),), frees=(partial,)),), backward=()),)
    if not z.sp:
        return ()
    return (Op(where, forward=_reduce_scattered(f"{p}/{where} s-first", z, "the partial sum", Made(
        out, z.seq(z.h), "this rank's shard, summed"), (partial,), then=frees),
               backward=_gathered_dy(f"grad/{p}/{where}", z, gathered)),)


def block_ops(i: int, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """Llama3TransformerBlock i, op by op (its input "layers.i/input", its output "layers.{i+1}/input"); with experts
    the MoE layer (Qwen3TransformerBlock's: the same attention, its MoE as the feed-forward)."""
    p = f"layers.{i}"
    # on CUDA the residual stream after attention is ffn_norm's kept input (the ledger's ln2/input)
    kept_mid = _stream_after_attention(z)
    x, out, mid = f"{p}/input", f"layers.{i + 1}/input", kept_name(p, kept_mid) if kept_mid else f"{p}/mid"
    gx, gout, gmid = f"grad/{p}/input", f"grad/layers.{i + 1}/input", f"grad/{p}/mid"
    h, q, kv = z.seq(z.h), z.tokens(z.act * z.a_t * z.d), z.tokens(z.act * z.g_t * z.d)
    attention = torchtitan_mla.latent_attention_ops(p, z, config, mid, gx, gmid, h) if config.mla else attention_ops(
        p, z, mid, gmid, gx, h, q, kv, config.qk_layernorm)
    # ffn_norm's dY where its output is gathered (the gather's backward's output), and the gather's own dX
    dy, dx = f"grad/{p}/ffn_norm dy", f"grad/{p}/ffn_norm out"
    if config.is_moe_layer(i):
        shared = bool(config.moe_shared_expert_intermediate_size)
        # the MoE's input: the norm's output, under SP at ep = 1 gathered at the MoE's entry (kept by the shared
        # experts); at ep > 1 each rank routes its own shard (and the shared experts gather it)
        moe_in = kept(p, rules.MOE_SHARED_IN) if shared else Made(f"{p}/moe input", z.full(z.h), "the MoE's input")
        gathered = z.t > 1 and config.ep == 1
        if not gathered:
            moe_in = Made(f"{p}/ffn_norm out", h, "bf16, the MoE's input") if z.sp else moe_in
        normed = Made(f"{p}/ffn_norm out", h, "bf16") if z.sp else moe_in
        ffn = (*(gather("moe", z, p, moe_in, dx, dy) if gathered else ()),
               *moe_ops(p, z, config, moe_in.name, shared_experts_ops(p, z, config) if shared else (), reduce_scatter),
               _second_residual(x, mid, out, f"{p}/ffn out", h, _keeps_input(z)))
    else:
        gathered, normed = z.t > 1, _norm_out(z, p, "ffn_norm", rules.FC1_IN)
        ffn = (*gather("feed_forward", z, p, kept(p, rules.FC1_IN), dx, dy), *feed_forward_ops(p, z, x, mid, out, h))
    return (*attention, *pre_norm("ffn_norm", z, rules.LN2, p, normed, dy if gathered else dx, mid, gout, gmid), *ffn)


def _norm_out(z: Sizes, p: str, norm: str, kept_input: SavedTensor) -> Made:
    """A norm's output: the next module's kept input itself, or under SP the shard its all-gather reads."""
    if z.sp:
        return Made(f"{p}/{norm} out" if p else f"{norm} out", z.seq(z.h), "bf16, this rank's shard")
    return kept(p, kept_input)


def _keeps_input(z: Sizes) -> bool:
    """Whether the norms keep their input, the residual stream's tensor itself: CUDA's fused kernel, and the CPU
    composite in fp32 (its input.to(float32) a no-op)."""
    return z.cuda or z.act == 4


def _stream_after_attention(z: Sizes) -> SavedTensor | None:
    """The ledger's term for the residual stream after attention where ffn_norm keeps it (its input on CUDA, its fp32
    input in fp32 on a CPU); None where it is a local of the block."""
    if z.cuda:
        return rules.LN2.input
    return rules.LN2.input_fp32 if z.act == 4 else None


def pre_norm(where: str, z: Sizes, tensors: rules.RMSNormTensors, p: str, out: Made, grad: str, x: str, stream: str,
             into: str) -> tuple[Op, ...]:
    """A block's norm on the residual stream `x` (`norm`), and in backward its dX and the residual stream's gradient
    `stream` summed into `into` as soon as the norm's returns (autograd does it inside the norm's window): listed
    before the norm, so it runs after it. The forward sum is the branch's last op. On CUDA autograd adds dX into the
    residual stream's gradient, which it holds alone (its input buffer's in-place accumulation, after a fused norm's
    node as after native_layer_norm's; not after the CPU composite's), making nothing. The CPU composite in fp32,
    whose input is the stream's tensor itself, adds x's gradients into the stream's itself (`norm`'s `stream`), with
    no sum of its own."""
    if z.act == 4 and not z.cuda:
        return (norm(where, z, tensors, p, out, grad, into, x, stream=stream),)
    dx = f"grad/{p}/{where} dx"
    summed = Step("the residual stream's gradients summed", (Made(
        into, z.seq(z.h), "the residual stream's gradient: both paths' summed"),), frees=(dx, stream),
        moment=not z.cuda)
    return (Op(where, forward=(), backward=(summed,)), norm(where, z, tensors, p, out, grad, dx, x))


def attention_ops(p: str, z: Sizes, mid: str, gmid: str, gx: str, h: int, q: int, kv: int,
                  qwen3: bool) -> tuple[Op, ...]:
    """attention_norm, wqkv, the split, (`qwen3`: q_norm and k_norm,) RoPE, SDPA, wo and the first residual sum."""
    a, g = "attention", f"grad/{p}/attention"
    qkv = z.tokens(z.act * z.qkv_t)
    full, dy = z.full(z.h), f"{g}/dY whole"  # wo's dY, all-gathered under SP
    wo_out = f"{p}/wo partial" if z.t > 1 else f"{p}/attention out"
    kernel = "flex attention" if z.cuda else "SDPA's flash kernel"
    # SDPA's dQ and dK live until v's node runs: ModTracker leaves the attention kernel in backward by a multi-grad
    # hook on its three inputs (head_norm_ops), which holds the first two gradients until the last one's node starts.
    # That is v's contiguous copy, in the split: after ComplexRoPE's backward, which frees them as it returns, but
    # after the head norms', whose nodes are newer than the split's
    held = (Step("the attention kernel's hook lets dQ and dK go", frees=(f"{g}/dq", f"{g}/dk")),) if qwen3 else ()
    return (
        *pre_norm("attention_norm", z, rules.LN1, p, _norm_out(z, p, "attention_norm", rules.QKV_IN),
                  f"grad/{p}/attention_norm dy" if z.t > 1 else f"grad/{p}/qkv dx", f"{p}/input", gmid, gx),
        *gather(a, z, p, kept(p, rules.QKV_IN), f"grad/{p}/qkv dx", f"grad/{p}/attention_norm dy"),
        linear(f"{a}.qkv_linear.wqkv", rules.QKV_IN,
               Made(kept_name(p, rules.QKV_OUT), qkv, "the fused projection's output"),
               z.weight(f"{a}.qkv_linear.wqkv"), f"grad/{p}/qkv dx", full, p, frees=(f"{g}/dqkv",)),
        Op(f"{a}.qkv_linear",
           forward=(Step("the split: q reshaped (a copy)", (_split_out(p, z, "q", q, qwen3),)),
                    Step("k made contiguous", (_split_out(p, z, "k", kv, qwen3),)),
                    Step("v made contiguous", (kept(p, ledger.V),), frees=(kept_name(p, rules.QKV_OUT),))),
           backward=(*held, Step("the split's backward: dQ, dK, dV concatenated", (
               Made(f"{g}/dqkv", qkv, "the fused output's gradient"),),
               frees=(f"{g}/dq pre-rope", f"{g}/dk pre-rope", f"{g}/dv")))),
        *(head_norm_ops(p, z, q, kv) if qwen3 else ()),
        cos_sin_rope_op(p, z, q, kv) if qwen3 else rope_ops(p, z, q, kv),
        Op(f"{a}.inner_attention",
           # SDPA's flash kernel; on CUDA compiled flex, whose Inductor buffers (the row maxima, backward's delta) are
           # its workspace
           forward=(Step(f"{kernel}: output and log-sum-exp", (kept(p, ledger.PROJ_IN), kept(p, ledger.SOFTMAX_LSE)),
                         reads_last=(kept_name(p, ledger.SOFTMAX_LSE),)),),
           backward=(Step(f"{kernel}'s backward: dQ, dK, dV", (
               Made(f"{g}/dq", q, "bf16"), Made(f"{g}/dk", kv, "bf16"), Made(f"{g}/dv", kv, "bf16")),
               frees=(f"{g}/dout",)),),
           saves=(ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, ledger.PROJ_IN)),
        *module_returns((
            linear(f"{a}.wo", ledger.PROJ_IN, Made(wo_out, full, "wo's output"), z.weight(f"{a}.wo"),
                   f"{g}/dout", q, p, frees=(dy,) if z.sp else ()),
            *reduce_scatter(f"{a}.wo", z, p, wo_out, f"{p}/attention out", dy, (f"{p}/attention_norm out",)),
        ), *kept_names(p, rules.QKV_IN, ledger.Q, ledger.K, ledger.V, ledger.PROJ_IN)),
        first_residual(p, z, mid, h, f"{p}/attention out"),
    )


def first_residual(p: str, z: Sizes, mid: str, h: int, attention_out: str) -> Op:
    """x + the attention's output (`attention_out`, which goes): the residual stream after attention (`mid`), on CUDA
    ffn_norm's kept input."""
    kept_mid = _stream_after_attention(z)
    return Op("", forward=(Step("x + attention", (kept(p, kept_mid, "the residual stream after attention; ffn_norm"
                                                                 " keeps it") if kept_mid else
                                                 Made(mid, h, "the residual stream after attention"),),
                                frees=(attention_out,)),), backward=())


def _split_out(p: str, z: Sizes, x: str, nbytes: int, qwen3: bool) -> Made:
    """q or k as the split makes it (a contiguous copy): before RoPE, or (`qwen3`) before its head norm, which may
    keep it itself (`_kept_by_head_norm`)."""
    held = _kept_by_head_norm(z, x) if qwen3 else None
    if held is not None:
        return kept(p, held)
    return Made(f"{p}/{x} pre-rope", nbytes, f"{x}, before RoPE" if not qwen3 else f"{x}, before {x}_norm")


_HEAD_NORMS = {"q": rules.Q_NORM, "k": rules.K_NORM}


def _kept_by_head_norm(z: Sizes, x: str) -> SavedTensor | None:
    """The ledger's term for q or k (`x`) before its head norm where the norm keeps the split's output itself (CUDA's
    fused kernel its input; the CPU composite in fp32 its fp32 input, the input itself); None where the norm keeps
    an upcast copy."""
    if z.cuda:
        return _HEAD_NORMS[x].input
    return _HEAD_NORMS[x].input_fp32 if z.act == 4 else None


def head_norm_ops(p: str, z: Sizes, q: int, kv: int) -> tuple[Op, ...]:
    """Qwen3's q_norm and k_norm: `norm` over each head's d channels ((b*s*a/t, d) and (b*s*g/t, d) rows); the split's
    q and k go as each returns (but where the norm keeps them: `_kept_by_head_norm`), their outputs are RoPE's inputs.

    In backward k_norm runs first, and its dY outlives it: ModTracker leaves RoPE in backward by a multi-grad hook
    (register_multi_grad_hook, mode "all") on its two inputs, which holds the gradient of the first to arrive (k's, as
    k_norm's node starts) until the other's node starts (q_norm's), where it goes before anything is made."""
    g = f"grad/{p}/attention"
    held = f"{g}/dk normed"

    def head_norm(x: str, nbytes: int, heads: int) -> Op:
        """One head norm, `heads` heads of d a token on this rank."""
        itself = _kept_by_head_norm(z, x)
        pre = kept_name(p, itself) if itself is not None else f"{p}/{x} pre-rope"
        op = norm(f"attention.{x}_norm", z, _HEAD_NORMS[x], p, Made(f"{p}/{x} normed", nbytes, "RoPE's input"),
                  f"{g}/d{x} normed", f"{g}/d{x} pre-rope", pre, frees=() if itself else (pre,),
                  rows=z.tokens(heads), width=z.d)
        # the attention's forward rebinds q (k) to the norm's output: the split's goes as it returns, but where kept
        return module_returns((op,), pre)[0] if itself else op
    k_norm = head_norm("k", kv, z.g_t)
    k_norm = replace(k_norm, backward=tuple(replace(x, frees=tuple(n for n in x.frees if n != held))
                                            for x in k_norm.backward))
    released = Op("attention.q_norm", forward=(), backward=(Step("RoPE's hook lets k's dY go", frees=(held,)),))
    return head_norm("q", q, z.a_t), released, k_norm


def cos_sin_rope_op(p: str, z: Sizes, q: int, kv: int) -> Op:
    """Qwen3's CosSinRoPE on q and k (the head norms' outputs): forward `_cos_sin_forward`, backward
    `_cos_sin_backward`. On CUDA's flex path the table is first gathered at the positions (its cos and sin halves
    kept until q * cos's backward; under a checkpoint they go as RoPE returns, locals of its forward)."""
    forward, backward = _cos_sin_forward(p, z, q, kv), _cos_sin_backward(p, z, q, kv)
    if not z.cuda:
        return Op("attention.rope", forward, backward)
    gather = Step("the table gathered at the positions: cos | sin", (kept(p, rules.ROPE_COS), kept(p, rules.ROPE_SIN)))
    op = Op("attention.rope", (gather, *forward), backward, saves=(rules.ROPE_COS, rules.ROPE_SIN))
    return module_returns((op,), *kept_names(p, rules.ROPE_COS, rules.ROPE_SIN))[0]


def _cos_sin_forward(p: str, z: Sizes, q: int, kv: int) -> tuple[Step, ...]:
    """q and k in fp32, x * cos + rotate_half(x) * sin (-x2 and the cat made and dropped), cast back (Q and K kept);
    the fp32 locals go as it returns. In fp32 .float() and type_as are no-ops, the sums Q and K themselves."""
    cast = z.act != 4
    upcast = tuple(Step(f"{x}.float()", (Made(f"{p}/{x} fp32", 4 * n // z.act, f"{x} in fp32"),))
                   for x, n in (("q", q), ("k", kv))) if cast else ()

    def rotated(x: str, n: int) -> tuple[Step, ...]:
        """x * cos + rotate_half(x) * sin, for q or k: `n` bytes of fp32."""
        r = f"{p}/{x} rope"
        return (Step(f"{x} * cos", (Made(f"{r} cos", n, "fp32"),)),
                Step(f"rotate_half({x}): -x2", (Made(f"{r} -x2", n // 2, "fp32, half the channels"),)),
                Step(f"rotate_half({x}): cat", (Made(f"{r} rotated", n, "fp32"),), frees=(f"{r} -x2",)),
                Step(f"rotate_half({x}) * sin", (Made(f"{r} sin", n, "fp32"),), frees=(f"{r} rotated",)),
                Step(f"{x} * cos + rotate_half({x}) * sin", (
                    Made(f"{r} out", n, "fp32") if cast else kept(p, ledger.Q if x == "q" else ledger.K),),
                    frees=(f"{r} cos", f"{r} sin")))
    fp32 = (f"{p}/q fp32", f"{p}/k fp32", f"{p}/q rope out", f"{p}/k rope out") if cast else ()
    returned = (f"{p}/q normed", f"{p}/k normed", *fp32)
    casts = (Step("xq_out.type_as(query): Q", (kept(p, ledger.Q),)),
             Step("xk_out.type_as(key): K", (kept(p, ledger.K),), frees=returned)) if cast else (
        Step("", frees=returned),)
    return (*upcast, *rotated("q", 4 * q // z.act), *rotated("k", 4 * kv // z.act), *casts)


def _cos_sin_backward(p: str, z: Sizes, q: int, kv: int) -> tuple[Step, ...]:
    """k's chain, then q's (autograd's latest node first): dY up to fp32, the products' gradients, the halves' slices
    back to full width (the second added in place into the first, as the input buffer holds it alone) and cos's;
    then k's cast down to bf16, and q's (the head norms' dY). In fp32 no casts: each sum is the head norm's dY."""
    g, cast = f"grad/{p}/attention", z.act != 4
    fp32 = {"q": 4 * q // z.act, "k": 4 * kv // z.act}

    def total(x: str) -> str:
        """x's fp32 gradient, summed from its rotation's (in fp32 the head norm's dY itself)."""
        return f"{g}/d{x} rope sum" if cast else f"{g}/d{x} normed"

    def chain(x: str, last: bool) -> tuple[Step, ...]:
        """x's gradient through its rotation, into `total(x)`."""
        d, dy, n = f"{g}/d{x} rope", f"{g}/d{x} fp32" if cast else f"{g}/d{x}", fp32[x]
        return (Step(f"rotate_half({x}) * sin's backward: dY * sin", (Made(f"{d} sin", n, "fp32"),)),
                Step("-x2's backward", (Made(f"{d} -x2", n // 2, "fp32, half the channels"),)),
                Step("x2's slice backward: to full width", (Made(total(x), n, "fp32, x's gradient"),),
                     frees=(f"{d} -x2",)),
                Step("x1's slice backward: to full width", (Made(f"{d} x1", n, "fp32"),), frees=(f"{d} sin",)),
                Step("added in place", frees=(f"{d} x1",)),
                Step(f"{x} * cos's backward: dY * cos", (Made(f"{d} cos", n, "fp32"),), returns=last),
                Step("added in place", frees=(f"{d} cos", *((dy,) if cast else ()))))
    if not cast:
        return (*chain("k", False), *chain("q", True))
    return (Step("K's cast's backward: dK up to fp32", (Made(f"{g}/dk fp32", fp32["k"], "fp32"),)),
            Step("Q's cast's backward: dQ up to fp32", (Made(f"{g}/dq fp32", fp32["q"], "fp32"),)),
            *chain("k", False), *chain("q", True),
            Step("k.float()'s backward: to bf16", (Made(f"{g}/dk normed", kv, "bf16"),), frees=(total("k"),)),
            Step("q.float()'s backward: to bf16", (Made(f"{g}/dq normed", q, "bf16"),), frees=(total("q"),)))


def rope_ops(p: str, z: Sizes, q: int, kv: int, outputs: tuple[Made, Made] | None = None, k_grad: str = "",
             table: SavedTensor = rules.ROPE_CACHE) -> Op:
    """ComplexRoPE: q and k in fp32 times the complex64 table, cast back (Q and K kept); in fp32 .float() and type_as
    are no-ops, the complex products Q and K themselves. On CUDA's flex path, given the batch's positions, the table is
    first gathered at them (kept by both products, until q's backward). DeepSeek-V3's (memcalc.sizing.timeline.
    torchtitan_mla) runs on views of the projections' outputs and makes `outputs` (q's and k's); in backward its dQ is
    a view of SDPA's, and k's gradient (`k_grad`, the expand's sum) goes as k's cast's backward returns, where
    Llama3's SDPA's dQ and dK go as RoPE returns. `table`: the ledger's term for the gathered table."""
    g, gathered, cast = f"grad/{p}/attention", kept_name(p, table), z.act != 4
    q_out, k_out = outputs or (kept(p, ledger.Q), kept(p, ledger.K))
    grads = () if k_grad else (f"{g}/dq", f"{g}/dk")
    fp32q, fp32k = 4 * q // z.act, 4 * kv // z.act  # the fp32 copies and their complex64 products
    # the table's conjugate, materialised: the (1, s, 1, d/2) buffer's, or on CUDA the gathered (b, s, 1, d/2) one
    conj = 8 * z.s * (z.d // 2) * (z.b if z.cuda else 1)
    gather = (Step("the table gathered at the positions", (kept(p, table),)),) if z.cuda else ()
    pre = (f"{p}/q pre-rope", f"{p}/k pre-rope") if outputs is None else ()  # DeepSeek-V3's: views

    def conjugate(x: str, nbytes: int, *frees: str, returns: bool = False) -> tuple[Step, ...]:
        """dX (cast up to fp32) times the table's conjugate; in fp32 that is x's gradient before RoPE."""
        into = Made(f"{g}/d{x} rotated", nbytes, "complex64") if cast else Made(
            f"{g}/d{x} pre-rope", nbytes, "complex64, seen as real")
        return (Step(f"the table's conjugate, for {x}", (Made(f"{g}/conj {x}", conj, "complex64"),)),
                Step(f"d{x.upper()} times it", (into,), frees=(f"{g}/conj {x}", *frees), returns=returns))
    if not cast:
        forward = (Step("q times the table: Q", (q_out,)),
                   Step("k times the table: K", (k_out,), frees=pre, reads_last=(gathered,)))
        backward = (*conjugate("k", fp32k), *conjugate("q", fp32q, *grads, returns=True))
    else:
        forward = (Step("q.float()", (Made(f"{p}/q fp32", fp32q, "q in fp32"),)),
                   Step("k.float()", (Made(f"{p}/k fp32", fp32k, "k in fp32"),)),
                   Step("q times the table", (Made(f"{p}/q rotated", fp32q, "complex64"),)),
                   Step("k times the table", (Made(f"{p}/k rotated", fp32k, "complex64"),)),
                   Step("q cast back", (q_out,)),
                   Step("k cast back", (k_out,), frees=(
                       f"{p}/q fp32", f"{p}/k fp32", f"{p}/q rotated", f"{p}/k rotated", *pre),
                       reads_last=(gathered,)))  # the gathered table: a local of its forward
        backward = (
            Step("k's cast's backward: dK up to fp32", (Made(f"{g}/dk fp32", fp32k, "fp32"),), frees=(k_grad,)),
            Step("q's cast's backward: dQ up to fp32", (Made(f"{g}/dq fp32", fp32q, "fp32"),)),
            *conjugate("k", fp32k, f"{g}/dk fp32"),
            *conjugate("q", fp32q, f"{g}/dq fp32", returns=True),
            Step("k.float()'s backward: to bf16", (Made(f"{g}/dk pre-rope", kv, "bf16"),), frees=(f"{g}/dk rotated",)),
            Step("q.float()'s backward: to bf16", (Made(f"{g}/dq pre-rope", q, "bf16"),),
                 frees=(f"{g}/dq rotated", *grads)),
        )
    return Op("attention.rope", (*gather, *forward), backward, saves=(table,) if z.cuda else ())


def feed_forward_ops(p: str, z: Sizes, x: str, mid: str, out: str, h: int) -> tuple[Op, ...]:
    """w1, SiLU, w3, the product, w2 and the second residual sum (the block's output)."""
    m, g, f = "feed_forward", f"grad/{p}/feed_forward", z.tokens(z.act * z.f_t)
    full, dy = z.full(z.h), f"{g}/dY whole"  # w2's dY, all-gathered under SP
    w2_out = kept_name(p, rules.FC2_OUT)  # its partial sum under tp
    ffn_out = f"{p}/ffn out" if z.t > 1 else w2_out
    return (
        *swiglu_ops(p, m, DENSE_SWIGLU, z.weight(f"{m}.w1"), f, full, f"grad/{p}/ffn_norm out"),
        *module_returns((
            linear(f"{m}.w2", ledger.FC2_IN, Made(w2_out, full, "w2's output"), z.weight(f"{m}.w2"), f"{g}/dfc2", f, p,
                   frees=(dy,) if z.sp else ()),
            *reduce_scatter(f"{m}.w2", z, p, w2_out, f"{p}/ffn out", dy, (f"{p}/ffn_norm out",)),
        ), *kept_names(p, rules.FC1_IN, ledger.FC2_IN)),
        _second_residual(x, mid, out, ffn_out, h, _keeps_input(z)),
    )


# A FeedForward's tensors: w1's and w3's input, SiLU's input and output, w3's output, w2's input (the product).
DENSE_SWIGLU = (rules.FC1_IN, ledger.SWIGLU_GATE, ledger.SWIGLU_SILU_OUT, ledger.SWIGLU_UP, ledger.FC2_IN)
SHARED_SWIGLU = (rules.MOE_SHARED_IN, ledger.SHARED_GATE, ledger.SHARED_SILU_OUT, ledger.SHARED_UP,
                 ledger.SHARED_FC2_IN)


def shared_experts_ops(p: str, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """The MoE's shared experts (a FeedForward of width u/t on its input): their output, under SP w2's partial sum
    (the ledger's SHARED_FC2_OUT, which SelectiveAC caches) reduce-scattered into f"{p}/moe/shared out"; in backward
    their input's gradient f"grad/{p}/moe/shared dX"."""
    m, u = "moe.shared_experts", config.moe_shared_expert_intermediate_size // z.t
    f, dy = z.tokens(z.act * u), f"grad/{p}/{m}/dY whole"
    fc2_out, dx = kept_name(p, rules.SHARED_FC2_OUT), f"grad/{p}/moe/shared dX"
    gathered = config.ep > 1 and z.sp  # at ep > 1 the MoE's input is this rank's shard: gathered at their entry
    return module_returns((
        *(gather(m, z, p, kept(p, rules.MOE_SHARED_IN), f"{dx} whole", dx) if gathered else ()),
        *swiglu_ops(p, m, SHARED_SWIGLU, z.weight(f"{m}.w1"), f, z.full(z.h), f"{dx} whole" if gathered else dx),
        linear(f"{m}.w2", ledger.SHARED_FC2_IN, Made(fc2_out, z.full(z.h), "the shared experts' output"),
               z.weight(f"{m}.w2"), f"grad/{p}/{m}/dfc2", f, p, frees=(dy,) if z.sp else ()),
        *(reduce_scatter(f"{m}.w2", z, p, fc2_out, f"{p}/moe/shared out", dy, ()) if z.sp else ()),
    ), *kept_names(p, ledger.SHARED_FC2_IN, *((rules.MOE_SHARED_IN,) if gathered else ())))


def _second_residual(x: str, mid: str, out: str, ffn_out: str, h: int, kept: bool = False) -> Op:
    """h + the feed-forward's output: the block's output; the block's input, h and that output go (where the norms
    keep x and h, `kept`: under a checkpoint h goes, which keeps nothing but x)."""
    kept_inputs = (mid, x) if kept else ()
    return Op("", forward=(Step("h + feed-forward: the block's output", (Made(out, h, "the next block's input"),),
                                frees=tuple(n for n in (ffn_out, mid, x) if n not in kept_inputs),
                                reads_last=kept_inputs),), backward=())


# -- the model's two ends -----------------------------------------------------------------------------------------


def embedding_ops(z: Sizes, tied: bool = False) -> tuple[Op, ...]:
    """The batch, the trainer's count of valid tokens, and tok_embeddings (the first block's input); `tied`
    (enable_weight_tying, its 1B and 3B flavours'), the table's gradient summed with lm_head's, which waited."""
    count = Op("", forward=(
        Step("the token ids", (Made(ledger.EMBEDDING_INPUT_IDS.name, z.tokens(8),
                                    "the micro-batch's token ids (int64), live all step; the embedding keeps them"),)),
        Step("the labels", (Made("batch/labels", z.tokens(8), "the micro-batch's labels (int64), live all step"),)),
        *(flex_inputs(z) if z.cuda else ()),
        Step("labels != IGNORE_INDEX", (Made("loss/valid mask", z.tokens(1), "bool, a local"),)),
        Step("their sum: the valid tokens", (Made("loss/valid tokens", 8, "int64, the loss's divisor: the division's"
                                                  " backward keeps it"),), frees=("loss/valid mask",)),
    ), backward=())
    if z.t > 1:
        return (count, _vocab_parallel_lookup(z, tied))
    lookup = Op("tok_embeddings", forward=(
        Step("the embedding lookup", (Made("layers.0/input", z.tokens(z.act * z.h), "the first block's input"),)),
    ), backward=_table_gradient(z, ("grad/layers.0/input",), tied))
    return (count, lookup)


def _table_gradient(z: Sizes, frees: tuple[str, ...], tied: bool) -> tuple[Step, ...]:
    """tok_embeddings' backward: dY added into the rows the ids picked (this rank's, under tp), then `frees`;
    handed over, or `tied` first summed with lm_head's, which waited in autograd's input buffer."""
    table = z.weight(z.ends.word)
    made = Step("the embedding's gradient", (Made("grad/embedding", table, WHY_WGRAD),), frees=frees,
                hands_over=() if tied else ("grad/embedding",))
    if not tied:
        return (made,)
    return (made, tied_sum(table), Step("", hands_over=("grad/embedding (sum)",)),
            Step("", frees=("grad/embedding", "grad/embedding (lm_head)")))


def flex_inputs(z: Sizes) -> tuple[Step, ...]:
    """CUDA's flex path: the batch's positions (int64 (b, s): one document a row, as the probe draws them) and the
    block mask its trainer makes of them (torchtitan's causal and packed-document mask_mods; create_block_mask's
    eight int32 tensors, (b, 1, n) and (b, 1, n, n) for n = s/128 rounded up), with the buffers the document
    mask_mod holds (b = 1: the document ids and an offsets table of s + 1 rounded up to 128; else each token's
    document end), live all step; the mask_mod's locals go as it returns."""
    n = -(-z.s // 128)
    held = 4 * (z.s + -(-(z.s + 1) // 128) * 128) if z.b == 1 else z.tokens(4)
    return (
        Step("the positions: one row", (Made("batch/arange", 8 * z.s, "int64 (s,)"),)),
        Step("the positions: repeated over the batch", (
            Made("batch/positions", z.tokens(8), "the micro-batch's positions (int64), live all step"),),
            frees=("batch/arange",)),
        Step("the block mask and its mask_mod's buffers", (
            Made("batch/block mask", 16 * z.b * n * (n + 1), "flex attention's BlockMask (int32), live all step"),
            Made("batch/document mask", held, "int32 tensors the document mask_mod holds, live all step")),
            moment=False),
    )


def _vocab_parallel_lookup(z: Sizes, tied: bool) -> Op:
    """torchtitan's Embedding under tp: this rank's rows looked up, the others masked out, the partial sums
    reduce-scattered along s (SP) or all-reduced into a copy; in backward dY (under SP all-gathered) masked and added
    into this rank's rows."""
    n, e, full = z.tokens(1), "embedding", z.full(z.h)
    lookup = (
        Step("ids >= the rank's first row", (Made(f"{e}/ge", n, "bool"),)),
        Step("ids < its last row", (Made(f"{e}/lt", n, "bool"),)),
        Step("the mask: both", (Made(f"{e}/mask", n, "bool"),), frees=(f"{e}/ge", f"{e}/lt")),
        Step("ids - offset", (Made(f"{e}/shifted ids", z.tokens(8), "int64"),)),
        Step("clamped to this rank's rows", (Made(f"{e}/ids", z.tokens(8), "int64; the lookup keeps them"),),
             frees=(f"{e}/shifted ids",)),
        Step("the lookup", (Made(f"{e}/lookup", full, "bf16"),)),
        Step("the mask in bf16", (Made(f"{e}/mask bf16", z.tokens(z.act), "kept by the multiply"),)),
        Step("the lookup times the mask: this rank's partial sum", (Made(f"{e}/partial", full, "bf16"),),
             frees=(f"{e}/lookup", f"{e}/mask")),
    )
    masked = (
        Step("dY times the mask", (Made(f"grad/{e} masked", full, "bf16"),),
             frees=(f"grad/{e} gathered" if z.sp else "grad/layers.0/input", f"{e}/mask bf16")),
        *_table_gradient(z, (f"grad/{e} masked", f"{e}/ids"), tied),
    )
    if not z.sp:
        return Op("tok_embeddings", forward=(*lookup, Step("f*: all-reduced into a copy, the first block's input", (
            Made("layers.0/input", full, "(b, s, h), summed"),), frees=(f"{e}/partial",))), backward=masked)
    first = Made("layers.0/input", z.seq(z.h), "(b, s/t, h)")
    scattered = _reduce_scattered(f"{e}/s-first", z, "the partial sum", first, (f"{e}/partial",),
                                  "the reduce-scatter's output: the first block's input")
    return Op("tok_embeddings", forward=(*lookup, *scattered),
              backward=(*_gathered_dy(f"grad/{e}", z, f"grad/{e} gathered", ("grad/layers.0/input",)), *masked))


def output_ops(z: Sizes, config: ModelConfig, pipelined: bool = False) -> tuple[Op, ...]:
    """The final norm, lm_head, and torchtitan's cross_entropy_loss divided by the valid tokens; `pipelined`, as the
    pipeline schedule computes it: the trainer's count of valid tokens and the schedule's logits outlive the loss."""
    last = f"layers.{config.L}/input"
    logits, fp32, cast = z.tokens(z.act * z.v_t), z.tokens(4 * z.v_t), z.act != 4  # fp32: .float() is a no-op
    pred, count = _freed_by_trainer(pipelined)
    loss = Op("", forward=(
        *((Step("logits.float()", (Made("loss/logits fp32", fp32, "cross_entropy upcasts the flattened logits"),)),)
          if cast else ()),
        Step("log_softmax", (Made("loss/log_softmax", fp32, "fp32; nll_loss's and its own backward keep it"),)),
        Step("nll_loss: the summed loss and its count", (Made("loss/sum", 4, "0-d fp32"),
                                                          Made("loss/total_weight", 4, "0-d fp32, kept")),
             frees=("loss/logits fp32",)),
        Step("divided by the valid tokens", (Made("loss/value", 4, "the loss (0-d fp32), live all step"),)),
        Step("", frees=("loss/sum", *pred)),
        Step("loss.backward() seeds autograd", (Made(GRAD_SEED, 4, "a 0-d ones tensor"),)),
    ), backward=(
        Step("the division's backward", (Made("grad/loss sum", 4, "0-d fp32"),), frees=count),
        Step("nll_loss's backward", (Made("grad/log_softmax", fp32, "-1 at each target, fp32"),),
             frees=("grad/loss sum", "loss/total_weight")),
        Step("log_softmax's backward", (Made("grad/logits fp32" if cast else "grad/logits", fp32, "fp32"),),
             frees=("grad/log_softmax", "loss/log_softmax")),
        *((Step("the upcast's backward: to bf16", (Made("grad/logits", logits, "bf16"),),
                frees=("grad/logits fp32",)),) if cast else ()),
    ))
    if z.t > 1:
        loss = _loss_parallel(z, pipelined)
    return (
        norm("norm", z, rules.FINAL_NORM, "", _norm_out(z, "", "norm", ledger.OUTPUT_INPUT),
             "grad/norm dy" if z.t > 1 else "grad/lm_head dx", f"grad/{last}", last,
             frees=() if z.sp else (last,)),
        *gather("norm", z, "", kept("", ledger.OUTPUT_INPUT), "grad/lm_head dx", "grad/norm dy",
                frees=("norm out",) if _keeps_input(z) else ("norm out", last)),  # the norm keeps its input
        linear("lm_head", ledger.OUTPUT_INPUT, Made("lm_head/logits", logits, "bf16 logits: the trainer's pred"),
               z.weight(z.ends.head), "grad/lm_head dx", z.tokens(z.act * z.h), "", frees=("grad/logits",),
               dw="grad/embedding (lm_head)" if config.tie_embeddings else "", waits=config.tie_embeddings),
        loss,
    )


def _freed_by_trainer(pipelined: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What the trainer's loss frees and the pipeline schedule's (`pipelined`) keeps: the logits, after the loss (the
    trainer's `del pred`), and the count of valid tokens, at the division's backward."""
    return ((), ()) if pipelined else (("lm_head/logits",), ("loss/valid tokens",))


def _loss_parallel(z: Sizes, pipelined: bool = False) -> Op:
    """torchtitan's _LossParallelCrossEntropy (components/loss.py) on this rank's v/t columns: the row maxima, the
    sums of exp and each target's log-probability all-reduced (funcol: new tensors); it keeps the fp32
    log-probabilities; then divided by the valid tokens. Its backward builds the one-hot update and exp(log_probs).
    `pipelined`: as the pipeline schedule computes it (`_freed_by_trainer`)."""
    pred, count = _freed_by_trainer(pipelined)
    n, fp32, l, g = z.tokens(1), z.tokens(4 * z.v_t), "loss", "grad/loss"
    row, ids, cast = z.tokens(4), z.tokens(8), z.act != 4  # fp32: .float() and the cast back are no-ops

    def labels(p: str) -> tuple[Step, ...]:
        """labels != IGNORE_INDEX, the safe labels, this rank's range and the local labels (forward and backward)."""
        return (
            Step("labels != IGNORE_INDEX", (Made(f"{p}/valid", n, "bool"),)),
            Step("0 as a tensor", (Made(f"{p}/zero", 8, "0-d int64"),)),
            Step("where: the safe labels", (Made(f"{p}/safe labels", ids, "int64"),),
                 frees=(f"{p}/valid", f"{p}/zero")),
            Step("labels < the rank's first column", (Made(f"{p}/lt", n, "bool"),)),
            Step("labels >= its last", (Made(f"{p}/ge", n, "bool"),)),
            Step("out of range: either", (Made(f"{p}/out of range", n, "bool"),), frees=(f"{p}/lt", f"{p}/ge")),
            Step("the local labels", (Made(f"{p}/local labels", ids, "int64"),)),
            Step("0 for index_put_", (Made(f"{p}/zero 2", 8, "0-d int64"),), frees=(f"{p}/zero 2",)),
        )
    forward = (
        *((Step("logits.float()", (Made(f"{l}/logits fp32", fp32, "(b*s, v/t)"),)),) if cast else ()),
        Step("each row's local max", (Made(f"{l}/local max", row, "fp32"),)),
        Step("all-reduced: the max", (Made(f"{l}/max", row, "fp32"),), frees=(f"{l}/local max",)),
        Step("logits - max", (Made(f"{l}/shifted", fp32, "fp32"),)),
        Step("exp", (Made(f"{l}/exp", fp32, "fp32, a temporary"),)),
        Step("summed over the columns", (Made(f"{l}/local sum", row, "fp32"),), frees=(f"{l}/exp",)),
        Step("all-reduced: the sum of exp", (Made(f"{l}/sum exp", row, "fp32"),), frees=(f"{l}/local sum",)),
        Step("its log", (Made(f"{l}/log sum", row, "fp32, a temporary"),)),
        Step("shifted - log: the log-probabilities", (Made(f"{l}/log_probs", fp32, "fp32, kept for backward"),),
             frees=(f"{l}/log sum",)),
        *labels(l),
        Step("gathered: each target's log-probability", (Made(f"{l}/local target", row, "fp32"),)),
        Step("0.0 for index_put_", (Made(f"{l}/zero 3", 4, "0-d fp32"),), frees=(f"{l}/zero 3",)),
        Step("all-reduced: the targets' log-probabilities", (Made(f"{l}/target", row, "fp32"),),
             frees=(f"{l}/local target",)),
        Step("negated", (Made(f"{l}/neg", row, "fp32"),)),
        Step("labels != IGNORE_INDEX", (Made(f"{l}/valid 2", n, "bool"),)),
        Step("0 as a tensor", (Made(f"{l}/zero 4", 4, "0-d fp32"),)),
        Step("where: each token's loss", (Made(f"{l}/per token", row, "fp32"),),
             frees=(f"{l}/valid 2", f"{l}/zero 4", f"{l}/neg")),
        Step("summed: the loss", (Made(f"{l}/sum", 4, "0-d fp32"),), frees=(
            f"{l}/logits fp32", f"{l}/shifted", f"{l}/max", f"{l}/sum exp", f"{l}/safe labels", f"{l}/out of range",
            f"{l}/local labels", f"{l}/target", f"{l}/per token")),
        Step("divided by the valid tokens", (Made(f"{l}/value", 4, "the loss (0-d fp32), live all step"),)),
        Step("", frees=(f"{l}/sum", *pred)),
        Step("loss.backward() seeds autograd", (Made(f"{l}/grad seed", 4, "a 0-d ones tensor"),)),
    )
    backward = (
        Step("the division's backward", (Made(f"{g} sum", 4, "0-d fp32"),), frees=count),
        *labels(g),
        Step("zeros like the log-probabilities", (Made(f"{g}/one-hot", fp32, "fp32"),)),
        Step("row indices", (Made(f"{g}/arange", ids, "int64"),)),
        Step("out of range, as fp32", (Made(f"{g}/out of range fp32", row, "fp32"),)),
        Step("- 1: the update at each target", (Made(f"{g}/update", row, "fp32"),),
             frees=(f"{g}/out of range fp32",)),
        Step("labels != IGNORE_INDEX", (Made(f"{g}/valid 2", n, "bool"),)),
        Step("0 as a tensor", (Made(f"{g}/zero 4", 4, "0-d fp32"),)),
        Step("where: dY per row", (Made(f"{g}/dY", row, "fp32"),), frees=(f"{g}/valid 2", f"{g}/zero 4")),
        Step("exp(log_probs)", (Made(f"{g}/exp", fp32, "fp32"),)),
        Step("the one-hot update + exp", (Made(f"{g}/sum", fp32, "fp32"),), frees=(f"{g}/exp",)),
        Step("times dY", (Made(f"{g}/logits fp32" if cast else "grad/logits", fp32, "fp32"),), frees=(
            f"{g}/sum", f"{g}/one-hot", f"{g}/safe labels", f"{g}/out of range", f"{g}/local labels",
            f"{g}/arange", f"{g}/update", f"{g}/dY", f"{g} sum", f"{l}/log_probs")),
        *((Step("cast to bf16", (Made("grad/logits", z.tokens(z.act * z.v_t), "bf16"),),
                frees=(f"{g}/logits fp32",)),) if cast else ()),
    )
    return Op("", forward, backward)
