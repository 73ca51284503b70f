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
from memcalc.model.evaluate import dim_sizes, estimate
from memcalc.model.impls import torchtitan as rules
from memcalc.model.knobs import DTYPE_BYTES, Accounting
from memcalc.model.rules import CHUNKED_LOSS
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import Stage, stage_named, stage_rank, torchtitan_microbatches
from memcalc.sizing.states import moe_layers_held
from memcalc.sizing.timeline import torchtitan_mla
from memcalc.sizing.timeline.ends import model_states, optimizer_step
from memcalc.sizing.timeline.fsdp import OUTPUT, Fsdp, torchtitan_block
from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, GRAD_SEED, GRADIENTS, PARAMETERS, TEMPORARIES, Sizes, Tape, Timeline,
)
from memcalc.sizing.timeline.torch_ops import WHY_WGRAD, linear, module_returns, swiglu_ops, tied_sum
from memcalc.sizing.timeline.torchtitan_moe import exchanged, moe_ops
from memcalc.sizing.timeline.torchtitan_ops import (
    attention_kernel, first_residual, gather, gathered_dy, keeps_input, norm, norm_out, pre_norm, reduce_scatter,
    reduce_scattered, rope_ops, stream_after_attention,
)
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
        # under the chunked loss each chunk's backward hands lm_head's gradient over before the table's is made
        tied = config.tie_embeddings and not config.loss_chunk_count
        first = [self.ends("tok_embeddings", "tok_embeddings", (embedding_ops(z, tied)[1],))]
        chunk = [*(first if stage.has_embedding else []), *self.blocks(layers)]
        if not stage.has_output:
            return chunk, []
        if config.loss_chunk_count:
            return [*chunk, self.ends(OUTPUT, "norm", final_norm_ops(z, config))], [LossChunks(
                None, "", Walk(self.tape, "", "", self.end, self.hand_over), *chunked_loss(z, config, pipelined))]
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
    # FSDP2 prefetches in backward by the post-forward order, which the final callback of each loss chunk's backward
    # clears: under the chunked loss each unit is gathered at its own pre-backward
    prefetched = not parts.config.loss_chunk_count
    for segment in reversed(segments):
        i = order.index(segment.unit) if segment.unit is not None else 0
        segment.backward(fsdp, order[i - 1] if i and prefetched else None)
    if fsdp is not None:  # the final callback: the embedding's post-backward (its input, the ids, needs no gradient)
        # ModTracker queues the callback that ends tok_embeddings's backward in the first backward pass after its
        # forward: under the chunked loss a loss chunk's, so MemTracker still reads the final callback inside it
        _post_backward(fsdp, tape, "tok_embeddings", "" if prefetched else "tok_embeddings")
        tape.drop("fsdp/tok_embeddings reduce-scatter")
        fsdp.finalize_backward(tape)
    tape.drop(GRAD_SEED)  # backward() returns


def check_modelled(config: ModelConfig, strategy: Strategy) -> None:
    """ConfigError for a sequence torchtitan's chunked loss refuses (`rules.CHUNKED_LOSS`), else naming the first
    thing the torchtitan step timeline does not model yet."""
    CHUNKED_LOSS.check(config)
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
        (config.moe and config.ep == config.t > 1 and not strategy.sequence_parallel, f"experts at ep={config.ep} under"
         " tp without sequence parallel (its MoE slices the replicated input; tp-sp, torchtitan's default, is"
         " modelled)"),
        (config.moe and sharded_tp, "experts under dp_shard with tp (FSDP2 over its MoE sharding plan)"),
        (config.tie_embeddings and config.dp_shard is not None,
         "tie_embeddings with dp_shard (tied, apply_fsdp shards tok_embeddings, norm and lm_head as one unit)"),
        # the pipelined walk (memcalc.sizing.timeline.torchtitan_pp)
        (config.pp > m, f"num_microbatches={m} below pp={config.pp} (torch's Schedule1F1B refuses it)"),
        # pp with dp_shard is measured on a pp x dp_shard mesh (memcalc.probe.libs.torchtitan_pp) at t = 1, ep = 1
        (pp_sharded and (sharded_tp or config.ep > 1 or (config.dp_replicate or 1) > 1),
         "pp with dp_shard beside tp, ep > 1 or dp_replicate (FSDP2 on each stage's chunk is walked at t = 1 and"
         " ep = 1, without HSDP)"),
        # ChunkedLossWrapper's FSDP2 hooks beside the schedule's unsynced gradients: not walked yet
        (config.loss_chunk_count and pp_sharded,
         f"torchtitan's chunked loss (loss_chunks={config.loss_chunk_count}) with pp and dp_shard (loss_chunks 0, its"
         " plain CrossEntropyLoss, is walked there)"),
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
    wo's and w2's reduce-scatter outputs (funcol's reduce_scatter_tensor, on its list of communication ops to save),
    and at ep > 1 the MoE's all-to-all outputs (funcol's all_to_all_single, on that list too). Under FSDP2 its
    apply_fsdp_to_decoder shards the checkpoint wrapper, whose rerun calls the block inside it, no FSDP unit:
    FSDPMemTracker reads the rerun's tensors as temporaries."""
    if config.recompute == "none":
        return None
    p = f"layers.{i}"
    at = (dim_sizes(config), z.t)  # the sizes, at which a weight of the router gate's shape shifts its count
    cached = rules.op_checkpoint(config, config.is_moe_layer(i), at) if config.recompute == "op" else ()
    cached = tuple(torchtitan_mla.cached_as(x, z) for x in cached)  # DeepSeek-V3's outputs kept as other terms too
    scattered = (f"{p}/attention out", f"{p}/ffn out") if cached and z.dtensor and z.sp else ()
    all_to_alls = exchanged(p) if cached and z.dtensor and config.ep > 1 and config.is_moe_layer(i) else ()
    return Checkpoint(f"{p}/input", frozenset((*(kept_name(p, x) for x in cached if x != ledger.LAYER_INPUT),
                                               *scattered, *all_to_alls)),
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
            fsdp.pre_forward(tape, self.unit, self.where, following)
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
        # the norm's pre-backward (FSDPMemTracker's readings): nothing happens here, unless prefetched explicitly
        if self.unit != OUTPUT or self.where != "lm_head" or fsdp.explicit:
            fsdp.pre_backward(tape, self.unit, where, prefetch)
        self.walk.backward(self.ops)
        if self.unit != "tok_embeddings":
            _post_backward(fsdp, tape, self.unit, self.where)


@dataclass(frozen=True)
class LossChunks:
    """torchtitan's ChunkedLossWrapper (`chunked_loss`: its `start`, each chunk's ops, its `end`) as a segment of the
    trainer's ops: inside the trainer's forward each chunk's forward and backward (loss.backward() on it, its seed gone
    as it returns); nothing in the model's backward, where its autograd node hands the accumulated gradient to the
    final norm."""

    unit: None
    where: str
    walk: Walk
    start: Op
    chunks: tuple[tuple[Op, ...], ...]
    end: Op

    @property
    def ops(self) -> tuple[Op, ...]:
        """Every op it walks, in order (`Walk.names` reads them)."""
        return (self.start, *(x for chunk in self.chunks for x in chunk), self.end)

    def forward(self, fsdp: Fsdp | None, following: str | None) -> None:
        """Under FSDP2 lm_head's unit is resharded as the model's forward returns (lm_head did not run: the root's
        post-forward completes the unit's, _force_complete_incomplete_states); the wrapper unshards it for the loop
        (`Fsdp.unshard`), keeps it unsharded after each chunk's backward (`_chunk_post_backward`), and reshards it
        after the loop."""
        start, chunks, end = self.start, self.chunks, self.end
        tape = self.walk.tape
        tape.drop(f"fsdp/{OUTPUT} unsharded")
        self.walk.forward((start,))
        if fsdp is not None:
            fsdp.unshard(tape, OUTPUT)
        for i, (*loss, written) in enumerate(chunks):
            self.walk.forward(tuple(loss))
            self.walk.backward(tuple(loss))
            if fsdp is not None:
                _chunk_post_backward(fsdp, tape, i == len(chunks) - 1)
            tape.drop(GRAD_SEED)
            self.walk.forward((written,))
        tape.drop(f"fsdp/{OUTPUT} unsharded")  # lm_head.reshard()
        self.walk.forward((end,))

    def backward(self, fsdp: Fsdp | None, prefetch: str | None) -> None:
        """Nothing: the chunks' backward ran in forward."""


def _chunk_post_backward(fsdp: Fsdp, tape: Tape, last: bool) -> None:
    """FSDP2's post-backward of lm_head's unit after a loss chunk's backward, reshard_after_backward off: before the
    last chunk without gradient sync, lm_head's gradient accumulated unreduced (`Fsdp.accumulate_unsynced`); at the
    last, that .grad added into the accumulated one, then reduce-scattered, whose buffer the backward's final callback
    waits on; that callback reshards every other unit still unsharded (_root_post_backward_final_callback)."""
    grads = [n for n in tape.live if n.startswith(f"fsdp/{OUTPUT} grad ")]
    for name in grads:
        tape.live[name] = tape.live[name]._replace(category=GRADIENTS)
    if not last:
        fsdp.accumulate_unsynced(tape, OUTPUT, "lm_head")
    else:
        for name in grads:
            accumulated = name.replace(" grad ", " accumulated ", 1)
            if accumulated in tape.live:
                tape.drop(name)
                tape.rename(accumulated, name)
        held = tuple(n.split(" grad ", 1)[1] for n in grads)
        fsdp.reduce_scatter(tape, OUTPUT, "lm_head", grads, held, reshard=False)
        tape.drop(f"fsdp/{OUTPUT} reduce-scatter")
    # the final callback reshards the units this backward did not reach (reshard_after_forward off kept them)
    tape.drop(*[n for n in tape.live if n.startswith("fsdp/") and n.endswith(" unsharded") and OUTPUT not in n])


def _post_backward(fsdp: Fsdp, tape: Tape, unit: str, where: str) -> None:
    """FSDP2's post-backward of `unit` for the parameters that have a gradient now (norm and lm_head's runs twice:
    after lm_head's backward, with lm_head's alone, and after the norm's, which gathers the unit again)."""
    for group in reversed(fsdp.groups(unit)):  # autograd runs the last group's hook first
        held = tuple(n.split(" grad ", 1)[1] for n in tape.live if n.startswith(f"fsdp/{group} grad "))
        fsdp.post_backward(tape, group, where, held)


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


# -- the blocks -------------------------------------------------------------------------------------------------


def block_ops(i: int, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """Llama3TransformerBlock i, op by op (its input "layers.i/input", its output "layers.{i+1}/input"); with experts
    the MoE layer (Qwen3TransformerBlock's: the same attention, its MoE as the feed-forward); with kv_lora_rank
    DeepSeek-V3's latent attention (memcalc.sizing.timeline.torchtitan_mla) in the attention's place."""
    p = f"layers.{i}"
    # on CUDA the residual stream after attention is ffn_norm's kept input (the ledger's ln2/input)
    kept_mid = stream_after_attention(z)
    x, out, mid = f"{p}/input", f"layers.{i + 1}/input", kept_name(p, kept_mid) if kept_mid else f"{p}/mid"
    gx, gout, gmid = f"grad/{p}/input", f"grad/layers.{i + 1}/input", f"grad/{p}/mid"
    h, q, kv = z.seq(z.h), z.tokens(z.act * z.a_t * z.d), z.tokens(z.act * z.g_t * z.d)
    if config.mla:
        attention = torchtitan_mla.latent_attention_ops(p, z, config, mid, gmid, gx, h)
    else:
        attention = attention_ops(p, z, mid, gmid, gx, h, q, kv, config.qk_layernorm)
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
               _second_residual(x, mid, out, f"{p}/ffn out", h, keeps_input(z)))
    else:
        gathered, normed = z.t > 1, norm_out(z, p, "ffn_norm", rules.FC1_IN)
        ffn = (*gather("feed_forward", z, p, kept(p, rules.FC1_IN), dx, dy), *feed_forward_ops(p, z, x, mid, out, h))
    return (*attention, *pre_norm("ffn_norm", z, rules.LN2, p, normed, dy if gathered else dx, mid, gout, gmid), *ffn)


def attention_ops(p: str, z: Sizes, mid: str, gmid: str, gx: str, h: int, q: int, kv: int,
                  qwen3: bool) -> tuple[Op, ...]:
    """attention_norm, wqkv, the split, (`qwen3`: q_norm and k_norm,) RoPE, SDPA, wo and the first residual sum."""
    a, g = "attention", f"grad/{p}/attention"
    qkv = z.tokens(z.act * z.qkv_t)
    full, dy = z.full(z.h), f"{g}/dY whole"  # wo's dY, all-gathered under SP
    wo_out = kept_name(p, rules.WO_OUT)  # its partial sum under tp, which SelectiveAC caches where wqkv is forced
    # SDPA's dQ and dK live until v's node runs: ModTracker leaves the attention kernel in backward by a multi-grad
    # hook on its three inputs (head_norm_ops), which holds the first two gradients until the last one's node starts.
    # That is v's contiguous copy, in the split: after ComplexRoPE's backward, which frees them as it returns, but
    # after the head norms', whose nodes are newer than the split's
    held = (Step("the attention kernel's hook lets dQ and dK go", frees=(f"{g}/dq", f"{g}/dk")),) if qwen3 else ()
    return (
        *pre_norm("attention_norm", z, rules.LN1, p, norm_out(z, p, "attention_norm", rules.QKV_IN),
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
        attention_kernel(p, z, (q, kv, kv), (ledger.Q, ledger.K, ledger.V), ledger.PROJ_IN),
        *module_returns((
            linear(f"{a}.wo", ledger.PROJ_IN, Made(wo_out, full, "wo's output"), z.weight(f"{a}.wo"),
                   f"{g}/dout", q, p, frees=(dy,) if z.sp else ()),
            *reduce_scatter(f"{a}.wo", z, p, wo_out, f"{p}/attention out", dy, (f"{p}/attention_norm out",)),
        ), *kept_names(p, rules.QKV_IN, ledger.Q, ledger.K, ledger.V, ledger.PROJ_IN)),
        first_residual(p, z, mid, h, f"{p}/attention out" if z.t > 1 else wo_out),
    )


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
        _second_residual(x, mid, out, ffn_out, h, keeps_input(z)),
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
    scattered = reduce_scattered(f"{e}/s-first", z, "the partial sum", first, (f"{e}/partial",),
                                  "the reduce-scatter's output: the first block's input")
    return Op("tok_embeddings", forward=(*lookup, *scattered),
              backward=(*gathered_dy(f"grad/{e}", z, f"grad/{e} gathered", ("grad/layers.0/input",)), *masked))


def output_ops(z: Sizes, config: ModelConfig, pipelined: bool = False) -> tuple[Op, ...]:
    """The final norm, lm_head, and torchtitan's cross_entropy_loss divided by the valid tokens; `pipelined`, as the
    pipeline schedule computes it: the trainer's count of valid tokens and the schedule's logits outlive the loss."""
    logits = z.tokens(z.act * z.v_t)
    head = linear("lm_head", ledger.OUTPUT_INPUT, Made("lm_head/logits", logits, "bf16 logits: the trainer's pred"),
                  z.weight(z.ends.head), "grad/lm_head dx", z.tokens(z.act * z.h), "", frees=("grad/logits",),
                  dw="grad/embedding (lm_head)" if config.tie_embeddings else "", waits=config.tie_embeddings)
    return (*final_norm_ops(z, config), head, cross_entropy(z, *_freed_by_trainer(pipelined)))


def final_norm_ops(z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """The final norm, under tp its output gathered whole (lm_head's input is Replicate): the output layer's input,
    `ledger.OUTPUT_INPUT`, whose gradient is "grad/lm_head dx"."""
    last = f"layers.{config.L}/input"
    return (
        norm("norm", z, rules.FINAL_NORM, "", norm_out(z, "", "norm", ledger.OUTPUT_INPUT),
             "grad/norm dy" if z.t > 1 else "grad/lm_head dx", f"grad/{last}", last,
             frees=() if z.sp else (last,)),
        *gather("norm", z, "", kept("", ledger.OUTPUT_INPUT), "grad/lm_head dx", "grad/norm dy",
                frees=("norm out",) if keeps_input(z) else ("norm out", last)),  # the norm keeps its input
    )


def cross_entropy(z: Sizes, pred: tuple[str, ...], count: tuple[str, ...], value: str = "loss/value",
                  then: tuple[Step, ...] = ()) -> Op:
    """torchtitan's cross_entropy_loss over (b, s) tokens' logits, divided by the valid tokens into `value` (0-d fp32);
    after the division `pred` goes, and in the division's backward `count` (`_freed_by_trainer`); `then`, what the
    caller does before loss.backward() seeds autograd; under tp vocabulary-parallel (`_loss_parallel`)."""
    if z.t > 1:
        return _loss_parallel(z, pred, count, value, then)
    logits, fp32, cast = z.tokens(z.act * z.v_t), z.tokens(4 * z.v_t), z.act != 4  # fp32: .float() is a no-op
    return Op("", forward=(
        *((Step("logits.float()", (Made("loss/logits fp32", fp32, "cross_entropy upcasts the flattened logits"),)),)
          if cast else ()),
        Step("log_softmax", (Made("loss/log_softmax", fp32, "fp32; nll_loss's and its own backward keep it"),)),
        Step("nll_loss: the summed loss and its count", (Made("loss/sum", 4, "0-d fp32"),
                                                          Made("loss/total_weight", 4, "0-d fp32, kept")),
             frees=("loss/logits fp32",)),
        Step("divided by the valid tokens", (Made(value, 4, _value_why(value)),)),
        Step("", frees=("loss/sum", *pred)),
        *then,
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


def chunked_loss(z: Sizes, config: ModelConfig, pipelined: bool) -> tuple[Op, tuple[tuple[Op, ...], ...], Op]:
    """torchtitan's ChunkedLossWrapper (components/loss.py) on the final norm's output, the trainer's pred (the
    hidden states, whole under tp): their and the labels' loss_chunks chunks along s, the fp32 GradAccumulator and
    the 0-d sum of the loss; then each chunk's ops, walked forward and backward in turn (`LossChunks`): lm_head,
    `cross_entropy` over its tokens, the sum, and its gradient written into the buffer in fp32; at the end the buffer
    cast to the training dtype, the final norm's dY, and the wrapper's and trainer's locals gone (`pipelined`: the
    schedule keeps the stage's output and the trainer its count of valid tokens)."""
    trainers = () if pipelined else (ledger.OUTPUT_INPUT.name, "loss/valid tokens")  # its pred: the norm's output
    n = config.loss_chunk_count
    part = replace(z, s=z.s // n, s_seq=z.s // n)  # one chunk's tokens, replicated over the TP ranks
    copied = z.b > 1 and n > 1  # a chunk of a (b, s, ...) tensor along s is a view only with one row, or one chunk
    hidden = tuple(f"loss/hidden chunk {i}" for i in range(n)) if copied else ()
    labels = tuple(f"loss/label chunk {i}" for i in range(n)) if copied else ()
    positions = tuple(f"loss/positions chunk {i}" for i in range(n)) if copied and z.cuda else ()
    fp32 = z.act == 4  # the buffer is then the accumulated gradient itself: .to(float32) is a no-op
    buffer = "grad/lm_head dx" if fp32 else "loss/gradient buffer"
    start = Op("", forward=(
        *((Step("the hidden states' chunks: contiguous copies", tuple(
            Made(x, part.tokens(z.act * z.h), "lm_head's input, a leaf detached from the model") for x in hidden)),)
          if hidden else ()),
        *(Step(f"the {what} chunks", tuple(Made(x, part.tokens(8), "int64, contiguous") for x in names))
          for what, names in (("labels'", labels), ("positions'", positions)) if names),
        Step("GradAccumulator's buffer", (Made(buffer, z.tokens(4 * z.h), "zeros: each chunk's dX in fp32"),)),
        Step("the loss's running sum", (Made(_total(0, n), 4, "0-d fp32"),)),
    ), backward=())
    chunks = tuple(_loss_chunk(z, part, i, n) for i in range(n))
    end = Op("", forward=(
        *(() if fp32 else (Step("the accumulated gradient cast to the training dtype", (
            Made("grad/lm_head dx", z.tokens(z.act * z.h), "the final norm's dY, kept by the wrapper's autograd node"
                 " for the model's backward"),)),)),
        Step("", frees=(*hidden, *labels, *positions, *(() if fp32 else (buffer,)), f"lm_head/logits {n - 1}",
                        f"loss/chunk {n - 1}", *trainers)),
        Step("loss.backward() seeds autograd", (Made(GRAD_SEED, 4, "a 0-d ones tensor"),)),
    ), backward=())
    return start, chunks, end


def _loss_chunk(z: Sizes, part: Sizes, i: int, n: int) -> tuple[Op, ...]:
    """Chunk i of n (`chunked_loss`): lm_head's GEMM (the last chunk's logits go as it returns), the loss, its running
    sum; in backward dW and the chunk's dX; then, in forward again, that dX in fp32 written into the buffer."""
    head = linear("lm_head", None, Made(f"lm_head/logits {i}", part.tokens(z.act * z.v_t), "bf16: this chunk's"),
                  z.weight(z.ends.head), "grad/lm_head chunk dx", part.tokens(z.act * z.h), "", frees=("grad/logits",))
    returned = (Op("", forward=(Step("", frees=(f"lm_head/logits {i - 1}",)),), backward=()),) if i else ()
    total = Step("the running sum: + the chunk's loss", (Made(_total(i + 1, n), 4, "0-d fp32"),),
                 frees=(_total(i, n),))
    loss = cross_entropy(part, (f"loss/chunk {i - 1}",) if i else (), (), f"loss/chunk {i}", (total,))
    fp32 = (Step("the chunk's dX in fp32", (Made("loss/chunk dx fp32", part.tokens(4 * z.h), "written into the"
                                                 " buffer"),)),) if z.act != 4 else ()  # in fp32 dX itself
    written = Op("", forward=(*fp32, Step("", frees=("loss/chunk dx fp32", "grad/lm_head chunk dx"))), backward=())
    return head, *returned, loss, written


def _total(i: int, n: int) -> str:
    """The running sum of the loss after i of n chunks; after the last, the loss the wrapper returns (a view of it)."""
    return "loss/value" if i == n else f"loss/total {i}"


def _value_why(value: str) -> str:
    """Why a loss's 0-d value exists: the step's loss, or one chunk's (`chunked_loss`)."""
    return "the loss (0-d fp32), live all step" if value == "loss/value" else "this chunk's loss (0-d fp32)"


def _freed_by_trainer(pipelined: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What the trainer's loss frees and the pipeline schedule's (`pipelined`) keeps: the logits, after the loss (the
    trainer's `del pred`), and the count of valid tokens, at the division's backward."""
    return ((), ()) if pipelined else (("lm_head/logits",), ("loss/valid tokens",))


def _loss_parallel(z: Sizes, pred: tuple[str, ...], count: tuple[str, ...], value: str,
                   then: tuple[Step, ...]) -> Op:
    """torchtitan's _LossParallelCrossEntropy (components/loss.py) on this rank's v/t columns: the row maxima, the
    sums of exp and each target's log-probability all-reduced (funcol: new tensors); it keeps the fp32
    log-probabilities; then divided by the valid tokens into `value`. Its backward builds the one-hot update and
    exp(log_probs). `pred`, `count`, `then`: as `cross_entropy`'s."""
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
        Step("divided by the valid tokens", (Made(value, 4, _value_why(value)),)),
        Step("", frees=(f"{l}/sum", *pred)),
        *then,
        Step("loss.backward() seeds autograd", (Made(GRAD_SEED, 4, "a 0-d ones tensor"),)),
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
