"""Per-GPU totals: the layers' activations, the model's two ends, and the model states, stage by stage.

Activations come from the ledger (layers, and `ledger.END_TENSORS` for embedding, output and loss) times what a
pipeline stage keeps; parameters and states from `memcalc.sizing.states`. Under context parallelism every
activation is the ledger's at s/cp: fused attention (which cp requires) keeps nothing s x s, and the ring's K/V
blocks are passed again in backward, not stored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.evaluate import LayerEstimate, dim_sizes, estimate, rank_shape
from memcalc.model.impls import implementation
from memcalc.model.impls.base import drop_small
from memcalc.model.knobs import Accounting, element_bytes
from memcalc.model.ledger import Dim, SavedTensor
from memcalc.sizing.params import padded_vocab
from memcalc.sizing.pipeline import Stage, pipeline_stages
from memcalc.sizing.states import (
    FSDP_SHARDS, ROUTER_BUFFERS_WHY, decays, expert_params, group_params, megatron_buffers, megatron_chunks,
    moe_layers_held, router_buffer_bytes, state_bytes, zero3_largest_layer,
)
from memcalc.model.strategy import Strategy

ACTIVATIONS, STATES = "activations", "model states"


def end_tensors(config: ModelConfig, accounting: Accounting, stage: str) -> tuple[SavedTensor, ...]:
    """What the embedding side ("first") or the output side ("last") keeps, given the knobs."""
    absent = set()
    if not config.has_dropout:
        absent.add(ledger.EMBEDDING_DROPOUT_MASK)  # no dropout, no mask
    if config.norm == "rmsnorm":
        absent.add(ledger.FINAL_NORM.mean)  # RMSNorm keeps no mean
    if config.final_logit_softcapping is None:
        absent.add(ledger.LOGITS_SOFTCAP_TANH)
    if config.impl == "torchtitan" and config.loss_chunk_count:  # ChunkedLossWrapper: no logits outlive its loop
        absent.add(ledger.LOSS_LOGITS)
    own = {x.name: x for x in implementation(config).ends}  # transformers' loss reads the logits gathered whole
    return drop_small((own.get(x.name, x) for x in ledger.END_TENSORS if x.stage == stage and x not in absent),
                      accounting)


def end_bytes(x: SavedTensor, config: ModelConfig, strategy: Strategy, accounting: Accounting) -> int:
    """Bytes one rank keeps of `x` for one micro-batch: the model's ends have the layer's dimensions, with the
    vocabulary as Megatron-LM pads it (logits span the padded vocabulary)."""
    sizes = dim_sizes(config) | {Dim.V: padded_vocab(config, strategy.weight_shards(config.t))}
    shape = rank_shape(x, strategy, sizes, config.t)
    return element_bytes(x.kind, config, accounting) * prod(shape)


@dataclass(frozen=True)
class Term:
    """One line of a per-GPU total."""

    name: str
    group: str  # ACTIVATIONS or STATES
    bytes: int
    note: str


@dataclass(frozen=True)
class StageTotal:
    """Everything one GPU of a pipeline stage holds at its peak."""

    stage: Stage
    params: dict[str, int]  # parameters it holds, per group
    terms: tuple[Term, ...]

    def bytes(self, count: str = "total") -> int:
        """All terms ("total"), or only ACTIVATIONS or STATES."""
        return sum(x.bytes for x in self.terms if count in ("total", x.group))


@dataclass(frozen=True)
class PerGpu:
    """Per-GPU totals of one strategy: each stage that bounds memory."""

    strategy: Strategy
    layer: LayerEstimate
    stages: tuple[StageTotal, ...]

    def worst(self, count: str = "total") -> StageTotal:
        """The stage that needs the most memory (the first one on a tie)."""
        return max(self.stages, key=lambda x: x.bytes(count))

    def bytes(self, count: str = "total") -> int:
        return self.worst(count).bytes(count)

    def __repr__(self) -> str:
        """One line for a notebook: the generated repr would print every term of every stage."""
        from memcalc.units import human_bytes

        worst = self.worst()
        return (f"<PerGpu {self.strategy.name}: {human_bytes(self.bytes())} on stage {worst.stage.name!r}"
                f" (of {len(self.stages)}), activations {human_bytes(worst.bytes(ACTIVATIONS))},"
                f" model states {human_bytes(worst.bytes(STATES))}>")


def per_gpu(config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting()) -> PerGpu:
    """Per-GPU memory of `config` under `strategy`, for the pipeline stages that bound it (the first and the last;
    under torchtitan's split every rank's: memcalc.sizing.pipeline.pipeline_stages), or the only one."""
    layer = estimate(config, strategy, accounting)
    rebuilt = _rebuilt_layer_bytes(config, strategy, accounting, layer)
    return PerGpu(strategy, layer, tuple(
        _stage_total(config, strategy, accounting, x, layer, rebuilt) for x in pipeline_stages(config)
    ))


def _stage_total(
    config: ModelConfig, strategy: Strategy, accounting: Accounting, stage: Stage, layer: LayerEstimate, rebuilt: int
) -> StageTotal:
    terms = [_layers_term(config, stage, layer)]
    if rebuilt:
        terms.append(Term("recompute/rebuilt_layer", ACTIVATIONS, rebuilt, "one layer rebuilt in backward"))
    ends = [(x, stage.embedding_in_flight) for x in end_tensors(config, accounting, "first") if stage.has_embedding]
    ends += [(x, stage.output_in_flight) for x in end_tensors(config, accounting, "last") if stage.has_output]
    for x, in_flight in ends:
        note = f"{in_flight} micro-batch{'es' if in_flight > 1 else ''} in flight"
        terms.append(Term(x.name, ACTIVATIONS, in_flight * end_bytes(x, config, strategy, accounting), note))
    t = strategy.weight_shards(config.t)
    params = group_params(config, stage, t)
    held, experts = sum(params.values()), expert_params(params)
    note = f"{held:,} parameters" + (f", {experts:,} of them experts'" if experts else "")
    per_parameter = per_parameter_shards(config, t, held, stage)
    no_decay = no_decay_params(config, stage, t) if config.zero_stage in (1, 2) else 0  # only ZeRO-1/2 pads groups
    states = state_bytes(config, held, experts, no_decay, per_parameter)
    terms += [Term(name, STATES, n, note) for name, n in states.items()]
    if router_buffer_bytes(config, stage):
        terms.append(Term("states/router buffers", STATES, router_buffer_bytes(config, stage), ROUTER_BUFFERS_WHY))
    if config.zero_stage == 3:
        terms.append(Term("zero3/largest_layer", STATES, zero3_largest_layer(config),
                          "ZeRO-3 gathers a module's bf16 weights (and makes their gradients) while it runs: the"
                          " largest module's, as DeepSpeed's estimator counts it"))
    return StageTotal(stage, params, tuple(terms))


def no_decay_params(config: ModelConfig, stage: Stage, t: int) -> int:
    """Of `group_params`' counts, the Trainer's group without weight decay (`decays`), over the step walk's inventory
    of the stage's parameters (memcalc.sizing.timeline.fsdp.stage_params: each family's model's, shape by
    shape)."""
    from memcalc.sizing.timeline.fsdp import stage_params  # the timeline package imports this module

    return sum(prod(p.shape) for p in stage_params(config, stage, t) if not decays(p.module))


def per_parameter_shards(config: ModelConfig, t: int, params: int, stage: Stage) -> tuple[int, int] | None:
    """FSDP2 and ZeRO-3 shard each parameter apart, padded: FSDP2 its dim 0 to a multiple of its dp_shard*cp shards
    (_fsdp_param.py), ZeRO-3 its elements to a multiple of dp (partition_parameters.py: _padding_size), keeping the
    parameters of stage3_param_persistence_threshold elements or fewer whole too; Megatron-LM's distributed optimizer
    pads each parameter and bucket of its flat buffers (states.megatron_buffers). The elements of this rank's
    shards (the fullest rank's) and of those kept whole (Megatron's: the buffers), summed over the step walk's
    inventory of the parameters (memcalc.sizing.timeline.fsdp's units, zero.Zero's: each family's its transformers
    model's, shape by shape, as tests/probe/libs/test_hf_fsdp.py checks; states.megatron_chunks: memcalc.sizing.params),
    the stage's own (memcalc.sizing.timeline.fsdp.stage_params), each on one rank of t; None for a stack that shards a
    flat buffer unpadded, or where these `params` are not that inventory."""
    from memcalc.sizing.timeline.fsdp import Fsdp, Unit, stage_params  # the timeline package imports this module
    from memcalc.sizing.timeline.zero import Zero

    c = config
    if c.distributed_optimizer:
        whole, shard = megatron_buffers(c, t, *megatron_chunks(c, stage, t))  # group_params' own inventory
        return shard, whole
    if c.dp_shard is not None and c.impl in ("hf", "torchtitan"):
        fsdp = Fsdp.of(c, t) if c.impl == "hf" else Fsdp.torchtitan(c, t, sp=False)
        fsdp = replace(fsdp, shards=FSDP_SHARDS.ranks(c), units=(Unit(stage.name, stage_params(c, stage, t), False),))
        return (fsdp.shard, 0) if sum(prod(p.shape) for u in fsdp.units for p in u.params) == params else None
    if c.zero_stage == 3:
        zero = Zero(c)
        return (zero.part, zero.persistent) if sum(map(sum, zero.groups)) == params else None
    return None


def _layers_term(config: ModelConfig, stage: Stage, layer: LayerEstimate) -> Term:
    """The stage's layer activations: with MoE and dense layers mixed, each kind at its own bytes; the model-wide
    tensors (RoPE's tables) once for each model chunk's forward kept."""
    chunk = stage.layer_slots // stage.chunks_in_flight  # the layers of one model chunk
    copies = stage.chunks_in_flight * implementation(config).model_wide_copies(config, chunk)
    if not layer.dense_layers:
        return Term("layers", ACTIVATIONS, layer.layers_bytes(stage.layer_slots, 0, copies), stage.schedule)
    # every chunk holds the same share (torchtitan's pipeline may give a stage no layer: none then)
    moe = stage.layer_slots * moe_layers_held(config, stage) // max(stage.layers, 1)
    dense = stage.layer_slots - moe
    return Term("layers", ACTIVATIONS, layer.layers_bytes(moe, dense, copies),
                f"{stage.schedule}; {moe} of them MoE layers, {dense} dense")


def _rebuilt_layer_bytes(config: ModelConfig, strategy: Strategy, accounting: Accounting, layer: LayerEstimate) -> int:
    """Exact accounting only: while backward runs a recomputed layer, what it rebuilt is live too (its
    activations without recomputation, less what the recompute choice keeps anyway); the paper leaves it out."""
    if not accounting.exact or config.recompute == "none":
        return 0
    whole = estimate(replace(config, recompute="none"), strategy, accounting)
    return whole.per_layer_bytes - layer.per_layer_bytes
