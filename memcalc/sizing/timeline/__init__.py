"""One training step on one rank, over time: what is live at each moment, and the peak.

Why the peak, not the totals, and what it models phase by phase and library by library: docs/timeline.md.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.evaluate import TensorBytes, estimate
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.records import record
from memcalc.sizing.pipeline import Stage, pipeline_stages, stage_named, stage_rank, torchtitan_microbatches
from memcalc.sizing.timeline.hf import hf_timeline
from memcalc.sizing.timeline.torchtitan import torchtitan_timeline
from memcalc.sizing.timeline.torchtitan_pp import pipeline_timeline
from memcalc.sizing.timeline.ends import STEP_TENSORS, Ends, end_saved, model_states, optimizer_step
from memcalc.sizing.timeline import megatron_mla, megatron_moe
from memcalc.sizing.timeline.megatron import INPUT, INPUT_GRAD, OUTPUT, OUTPUT_GRAD, layer_ops
from memcalc.sizing.timeline.walk import Op, Walk
from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, CATEGORIES, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Live, Moment, Moments, Replays, Sizes,
    Tape, Timeline, bulk,
)

__all__ = [
    "ACTIVATIONS", "CATEGORIES", "GRADIENTS", "OPTIMIZER", "PARAMETERS", "STEP_TENSORS", "TEMPORARIES", "Live",
    "Moment", "Timeline", "timeline", "timelines",
]


def timeline(
    config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting(exact=True), stage: str | None = None,
) -> Timeline:
    """The moments of one training step of `config` under `strategy`, on one rank of a pipeline stage (one of
    `memcalc.sizing.pipeline.pipeline_stages`, the first by default): under 1F1B one micro-batch (interleaved, one
    model chunk) beside those the schedule keeps in flight (torchtitan's: every micro-batch walked)."""
    accounting = replace(accounting, exact=True)  # a timeline counts every byte
    _refuse_other_layers(config)
    if config.impl == "hf":  # transformers' LlamaForCausalLM, op by op: its own walk
        return hf_timeline(config, strategy, accounting)
    if config.impl == "torchtitan":  # torchtitan's Llama3Model, described as ops for the generic walk
        if config.pp > 1:  # one stage of its pipeline, torch's Schedule1F1B
            return pipeline_timeline(config, strategy, accounting, stage)
        return torchtitan_timeline(config, strategy, accounting)
    # megatron's layer, or the paper's: Megatron's with the fused softmax at every size, the same walk, its own tensors
    z = Sizes.of(config, strategy)
    missing = megatron_moe.unmodelled(config, z) if config.moe else None
    if missing:
        raise ConfigError(f"the step timeline does not model {missing} yet: it walks megatron-core's MoELayer"
                          " with the all-to-all dispatcher")
    layer = estimate(config, strategy, accounting)
    # under recomputation the layer rerun in backward keeps what it keeps without
    rerun = estimate(replace(config, recompute="none"), strategy, accounting) if config.recompute != "none" else None
    st = stage_named(config, stage)
    saved = tuple(end_saved(config, strategy, accounting, z).items())
    with bulk():  # a MoE walk puts some hundred thousand tensors on the tape
        moments = _moments(config, z, accounting, st, layer.tensors, layer.dense, rerun and rerun.tensors,
                           rerun and rerun.dense, saved)
    return Timeline(layer.strategy, moments, st.name)


@functools.lru_cache(maxsize=2)
def _moments(config: ModelConfig, z: Sizes, accounting: Accounting, st: Stage, tensors: tuple[TensorBytes, ...],
             dense_tensors: tuple[TensorBytes, ...], rerun: tuple[TensorBytes, ...] | None,
             rerun_dense: tuple[TensorBytes, ...] | None, end_bytes: tuple[tuple[str, int], ...]
             ) -> Moments:
    """The step's moments on a rank of these sizes, its layers keeping the ledger's `tensors` (`dense_tensors`, a
    dense layer's among MoE ones; `rerun`, what they keep without recomputation, None without it) and its ends
    `end_bytes`: two strategies that give a rank the same (none and tp-sp at t = 1) walk the same step, once (`fit`
    tries both at every candidate)."""
    kinds = {False: _Kind.of(config, z, accounting, tensors, rerun)}  # by `dense` below
    if dense_tensors:  # dense layers among MoE ones: a dense MLP, each tensor at the dense layer's bytes
        kinds[True] = _Kind.of(config.dense, z, accounting, dense_tensors, rerun_dense)
    tape = Tape()
    model_states(tape, config, st, z)
    tape.mark("steady", "", "model states between steps")
    ends = Ends(config, dict(end_bytes), z, st)
    # one model chunk: the first stage's first (the embedding's), the last stage's last (the output's), a middle one's
    chunks = config.rank_chunks(stage_rank(st.name, config.pp))
    layers = chunks[-1] if st.has_output and not st.has_embedding else chunks[0]
    first, walked = layers.start, len(layers)
    dense = [config.moe and not config.is_moe_layer(i) for i in layers]  # each layer's kind
    # every chunk of a stage holds the same kinds of layers: one chunk a rank where they differ (its first dense
    # layers: memcalc.sizing.states.check_expert_states)
    _others_in_flight(tape, st, walked, sum(sum(kinds[x].saved.values()) for x in dense), ends.embedding_bytes())
    # a weight's gradient handed over by autograd is added into the fp32 buffer at once
    walks = {is_dense: Walk(tape, "", "", kind.sizes, lambda where, name, nbytes: tape.drop(name))
             for is_dense, kind in kinds.items()}
    front, back = (Walk(tape, "", "", ends.saved, walks[False].hand_over) for _ in range(2))  # the model's ends
    front.forward(ends.inputs)
    # every layer of a kind walks the same ops under the same names: the first walked, the others replayed
    replays = Replays(tape)
    names = {x: tuple(walks[x].names(kind.ops) | {*kind.folded, *(y.name for y in kind.kept)})
             for x, kind in kinds.items()}
    for i, is_dense in zip(layers, dense):
        kind, walk = kinds[is_dense], walks[is_dense]
        walk.module = f"layers.{i}"
        if config.mla:
            megatron_mla.beside_the_ledger(tape, config, z, i, first)
        if kind.config.moe:
            megatron_moe.beside_the_ledger(tape, config, z)
        held = replays.run(("forward", is_dense), names[is_dense], walk.module, lambda: kind.forward(walk))
        tape.add(f"layers.{i}/saved", ACTIVATIONS, held, "what the layer keeps for backward (the ledger)")
        tape.rename(OUTPUT, INPUT)
        if kind.config.moe:  # held by the layer's dispatcher beyond the step: one term
            tape.add(f"layers.{i}/moe dispatcher", ACTIVATIONS, sum(tape.live.pop(x).bytes for x in megatron_moe.HELD
                                                                if x in tape.live),
                     "what MoELayer's token dispatcher holds as attributes until the next forward")
    back.forward(ends.outputs)
    back.backward(ends.outputs)
    for i, is_dense in reversed(list(zip(layers, dense))):
        kind, walk = kinds[is_dense], walks[is_dense]
        tape.drop(f"layers.{i}/saved")
        walk.module = f"layers.{i}"
        replays.run(("backward", is_dense), names[is_dense], walk.module, lambda: kind.backward(walk))
        if kind.config.moe and config.recompute == "full":
            # the dispatcher's probabilities, made by the rerun with autograd on, keep its graph to the next forward,
            # and with it the checkpoint's detached input (AccumulateGrad's variable) and that input's .grad, the
            # gradient handed on (the layer below frees its output's gradient by a name no longer live)
            tape.add(f"layers.{i}/rerun input", ACTIVATIONS, kind.saved[ledger.LAYER_INPUT.name],
                     "the rerun's detached input, held by its graph")
            tape.rename(INPUT_GRAD, f"layers.{i}/rerun input grad")
        elif i > first:
            tape.rename(INPUT_GRAD, OUTPUT_GRAD)
    front.backward(ends.inputs)
    tape.drop("pipeline/other micro-batches")  # the cool-down runs their backwards, as this one's
    optimizer_step(tape, config)
    return tape.moments


def _others_in_flight(tape: Tape, st: Stage, walked: int, walked_bytes: int, embedding: int) -> None:
    """What the schedule keeps on the stage beside the walked micro-batch's chunk: the rest of its layer slots
    (`memcalc.sizing.pipeline`), each chunk-micro-batch's layers as the walked chunk's (`walked_bytes`), and the other
    micro-batches' embedding tensors."""
    slots, embeddings = st.layer_slots - walked, max(st.embedding_in_flight - 1, 0)
    tape.add("pipeline/other micro-batches", ACTIVATIONS, slots // walked * walked_bytes + embeddings * embedding,
             f"{st.schedule}: beside this one, {slots} layers' saved tensors"
             + (f" and {embeddings} embeddings'" if embeddings else ""))


@record
class _Kind:
    """One kind of layer as the walk runs it (a MoE layer, or a dense one among MoE layers): what its forward keeps
    (each expert's storages as pieces of the ledger's rows) and every tensor its ops make or keep, by name."""

    config: ModelConfig
    kept: tuple[SavedTensor, ...]
    saved: dict[str, int]
    sizes: dict[str, int]
    ops: tuple[Op, ...]

    @classmethod
    def of(cls, config: ModelConfig, z: Sizes, accounting: Accounting, tensors: tuple[TensorBytes, ...],
           rerun: tuple[TensorBytes, ...] | None) -> _Kind:
        """The layer keeping the ledger's `tensors`; `rerun`: what it keeps without recomputation (None: no
        recomputation)."""
        host = megatron_mla.host_scalars(config, z, accounting) if config.mla else ()  # beside the ledger's, on the CPU
        kept, saved = _rows(config, z, tensors, host)
        # what the layer keeps without recomputation, made again in backward
        host_again = megatron_mla.rerun_host_scalars(config, z, accounting) if config.mla else ()
        again, sizes = _rows(config, z, rerun, host_again) if rerun is not None else (kept, saved)
        sizes = sizes | saved
        ops = layer_ops(config, z, kept, again, sizes)
        _check_modelled(config, (*kept, *again), ops)
        return cls(config, kept, saved, sizes, ops)

    def forward(self, walk: Walk) -> int:
        """The layer's forward, then its saved tensors folded into one term until its backward (a moment's cost grows
        with the tensors live, and every layer's have the same names): their bytes. Its output is the next layer's
        input."""
        walk.forward(self.ops)
        return sum(walk.tape.live.pop(name).bytes for name in self.folded)

    def backward(self, walk: Walk) -> None:
        """The layer's saved tensors one by one again, as its ops free them, and its backward."""
        for x in self.kept:
            walk.tape.add(x.name, ACTIVATIONS, self.saved[x.name], "kept for backward (the ledger)")
        walk.backward(self.ops)

    @property
    def folded(self) -> tuple[str, ...]:
        """What the walk sums after the layer's forward: its input first, then what it made."""
        return (INPUT, *(x.name for x in self.kept if x.name not in (INPUT, ledger.LAYER_INPUT.name)))


def _rows(config: ModelConfig, z: Sizes, tensors: tuple[TensorBytes, ...], host: tuple[SavedTensor, ...]
          ) -> tuple[tuple[SavedTensor, ...], dict[str, int]]:
    """The ledger's `tensors` and the `host` scalars beside them (4 bytes each), with each expert's own storages as
    pieces of the ledger's rows; and every tensor's bytes by name."""
    kept = (*(x.tensor for x in tensors), *host)
    saved = {x.tensor.name: x.bytes for x in tensors} | {x.name: 4 for x in host}
    return megatron_moe.pieces(config, z, kept, saved) if config.moe else (kept, saved)


def timelines(config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting(exact=True)
              ) -> tuple[Timeline, ...]:
    """One timeline per stage that bounds memory (`memcalc.sizing.pipeline.pipeline_stages`)."""
    return tuple(timeline(config, strategy, accounting, x.name) for x in pipeline_stages(config))


# The walk's time grows with the layers a stage walks (a moment keeps its totals and its place in the tape's log):
# 512 take one to four seconds and under 100 MB, and the largest models have under 200 layers in all, so a stage of
# more is refused rather than walked for minutes.
MAX_WALKED_LAYERS = 512
# Megatron's and transformers' MoE walks also take each local expert of a layer one by one (its own slots, its own
# GEMMs): DeepSeek-V3 walks 61 layers of 256, Kimi K2 61 of 384; a stage of more than this many is refused.
MAX_WALKED_EXPERTS = 2**15


def _refuse_other_layers(config: ModelConfig) -> None:
    """ConfigError for layers no walk models yet, whichever library runs them, or more than it walks (torchtitan's
    pipeline walks each micro-batch's layers)."""
    per_stage = -(-config.L // config.pp)
    walked = (f"the step timeline walks a stage's layers one by one, at most {MAX_WALKED_LAYERS}: L/pp ="
              f" {config.L}/{config.pp} is {per_stage}")
    if per_stage > MAX_WALKED_LAYERS:
        raise ConfigError(walked)
    local = config.num_experts // config.ep if config.moe else 0
    if per_stage * local > MAX_WALKED_EXPERTS:
        raise ConfigError(f"the step timeline walks each layer's local experts one by one, at most"
                          f" {MAX_WALKED_EXPERTS} in a stage: {per_stage} layers (L/pp) of {local} (num_experts/ep)")
    m = torchtitan_microbatches(config) if config.impl == "torchtitan" and config.pp > 1 else 1
    if per_stage * m > MAX_WALKED_LAYERS:
        raise ConfigError(f"{walked}, times {m} micro-batches (torchtitan's pipeline is walked micro-batch by"
                          f" micro-batch) {per_stage * m}")


def _check_modelled(config: ModelConfig, kept: tuple[SavedTensor, ...], ops: tuple[Op, ...]) -> None:
    """ConfigError naming the first thing this timeline does not model yet."""
    known = {x.name for op in ops for x in op.saves}  # what the layer's ops free: the tensors the walk knows
    unknown = dict.fromkeys(x.name for x in kept if x.name not in known)
    missing = [
        (config.cp != 1, f"cp={config.cp}"),
        (bool(unknown), f"a layer that keeps {', '.join(unknown)}"),
    ]
    for absent, what in missing:
        if absent:
            raise ConfigError(f"the step timeline does not model {what} yet")
