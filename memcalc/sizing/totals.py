"""Per-GPU totals: the layers' activations, the model's two ends, and the model states, stage by stage.

The transformer layers' activations come from the ledger (`memcalc.model.evaluate`),
times the layer-activations a pipeline stage keeps (`memcalc.sizing.pipeline`). The
tensors outside the layers are described here, once each, after Korthikanti et
al. 2022, section 4.3: the dropout after the embedding keeps a mask of sbh
bytes, the norm before the output layer and the output layer keep 2sbh each,
and the cross-entropy keeps the logits in fp32, 4sbv; with sequence
parallelism the first three are split by t along s, and the logits are split by
t along the vocabulary under either tensor-parallel strategy. Parameters and
their states come from `memcalc.sizing.states`.

Context parallelism (cp) gives each rank s/cp tokens of every sequence. Each
rank keeps only its own tokens' activations: with fused attention (which cp
requires) nothing of size s x s is kept, and the K/V blocks passed around the
ring in forward are passed again in backward, not stored. So every activation
here is the ledger's, evaluated at s/cp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.evaluate import LayerEstimate, estimate
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.ledger import Kind, Region
from memcalc.sizing.pipeline import Stage, stages
from memcalc.sizing.states import group_params, state_bytes, vocab_shard
from memcalc.model.strategy import Strategy

INT64_BYTES = 8
ACTIVATIONS, STATES = "activations", "model states"


@dataclass(frozen=True)
class EndTensor:
    """A tensor kept for backward outside the transformer layers, with the reason it is kept."""

    name: str
    saved_by: str
    shape: tuple[str, ...]  # in the config's sizes: b, s (per context rank), h, v
    kind: Kind | None  # None: int64 token ids
    region: Region | None  # as in the ledger: SP splits SEQUENCE along s, TP splits TENSOR along v; None: whole
    stage: str  # "first" (beside the embedding) or "last" (beside the output layer)
    why: str
    paper: bool = True  # False: a small term the paper leaves out (shown with exact accounting)


_BSH = ("b", "s", "h")

EMBEDDING_INPUT_IDS = EndTensor(
    "embedding/input_ids", "word embedding lookup", ("b", "s"), None, None, "first",
    "the embedding's weight gradient adds dY into the rows the token ids picked", paper=False,
)
EMBEDDING_DROPOUT_MASK = EndTensor(
    "embedding/dropout_mask", "dropout after the embedding", _BSH, Kind.MASK, Region.SEQUENCE, "first",
    ledger.WHY_DROPOUT_MASK,
)
FINAL_NORM_INPUT = EndTensor(
    "final_norm/input", "norm before the output layer", _BSH, Kind.ACTIVATION, Region.SEQUENCE, "last",
    ledger.WHY_NORM_INPUT,
)
FINAL_NORM_MEAN = EndTensor(
    "final_norm/mean", "norm before the output layer", ("b", "s"), Kind.NORM_STATS, Region.SEQUENCE, "last",
    ledger.WHY_NORM_MEAN, paper=False,
)
FINAL_NORM_RSTD = EndTensor(
    "final_norm/rstd", "norm before the output layer", ("b", "s"), Kind.NORM_STATS, Region.SEQUENCE, "last",
    ledger.WHY_NORM_RSTD, paper=False,
)
OUTPUT_INPUT = EndTensor(
    "output/input", "output layer (column-parallel over the vocabulary)", _BSH, Kind.ACTIVATION, Region.SEQUENCE,
    "last", ledger.WHY_GATHERED_INPUT,
)
LOSS_LOGITS = EndTensor(
    "loss/logits_fp32", "cross-entropy (vocabulary-parallel)", ("b", "s", "v"), Kind.FP32, Region.TENSOR, "last",
    "the loss's gradient is softmax(logits) - onehot(target), from the fp32 softmax kept in forward",
)


END_TENSORS: tuple[EndTensor, ...] = (
    EMBEDDING_INPUT_IDS, EMBEDDING_DROPOUT_MASK,
    FINAL_NORM_INPUT, FINAL_NORM_MEAN, FINAL_NORM_RSTD, OUTPUT_INPUT, LOSS_LOGITS,
)


def end_tensors(config: ModelConfig, accounting: Accounting, where: str) -> tuple[EndTensor, ...]:
    """What the embedding side ("first") or the output side ("last") keeps, given the knobs."""
    absent = set()
    if config.dropout == 0:
        absent.add(EMBEDDING_DROPOUT_MASK)  # no dropout, no mask
    if config.norm == "rmsnorm":
        absent.add(FINAL_NORM_MEAN)  # RMSNorm keeps no mean
    return tuple(x for x in END_TENSORS if x.stage == where and x not in absent and (accounting.exact or x.paper))


def tp_size(config: ModelConfig, strategy: Strategy) -> int:
    """The t a strategy splits weights by: config.t under tp and tp-sp, 1 under none."""
    return config.t if Region.TENSOR in strategy.splits else 1


def end_bytes(x: EndTensor, config: ModelConfig, strategy: Strategy, accounting: Accounting) -> int:
    """Bytes one rank keeps of `x` for one micro-batch."""
    sizes = {"b": config.b, "s": config.s // config.cp, "h": config.h, "v": config.vocab_size}
    if x.region is Region.SEQUENCE and x.region in strategy.splits:
        sizes["s"] //= config.t
    elif x.region is Region.TENSOR and x.region in strategy.splits:
        sizes["v"] = vocab_shard(config, config.t)
    width = INT64_BYTES if x.kind is None else element_bytes(x.kind, Knobs.of(config), accounting)
    return width * prod(sizes[d] for d in x.shape)


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


def per_gpu(config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting()) -> PerGpu:
    """Per-GPU memory of `config` under `strategy`, for the first and last pipeline stages (or the only one)."""
    layer = estimate(config, strategy, accounting)
    rebuilt = _rebuilt_layer_bytes(config, strategy, accounting, layer)
    return PerGpu(strategy, layer, tuple(
        _stage_total(config, strategy, accounting, x, layer, rebuilt) for x in stages(config.L, config.pp, config.vpp)
    ))


def _stage_total(
    config: ModelConfig, strategy: Strategy, accounting: Accounting, stage: Stage, layer: LayerEstimate, rebuilt: int
) -> StageTotal:
    terms = [Term("layers", ACTIVATIONS, layer.per_layer_bytes * stage.layer_slots, stage.schedule)]
    if rebuilt:
        terms.append(Term("recompute/rebuilt_layer", ACTIVATIONS, rebuilt, "one layer rebuilt in backward"))
    ends = [(x, stage.embedding_in_flight) for x in end_tensors(config, accounting, "first") if stage.has_embedding]
    ends += [(x, stage.output_in_flight) for x in end_tensors(config, accounting, "last") if stage.has_output]
    for x, in_flight in ends:
        note = f"{in_flight} micro-batch{'es' if in_flight > 1 else ''} in flight"
        terms.append(Term(x.name, ACTIVATIONS, in_flight * end_bytes(x, config, strategy, accounting), note))
    params = group_params(config, stage, tp_size(config, strategy))
    held = sum(params.values())
    terms += [Term(name, STATES, n, f"{held:,} parameters") for name, n in state_bytes(config, held).items()]
    return StageTotal(stage, params, tuple(terms))


def _rebuilt_layer_bytes(config: ModelConfig, strategy: Strategy, accounting: Accounting, layer: LayerEstimate) -> int:
    """Exact accounting only: while backward runs a recomputed layer, what it rebuilt is live too.

    That is the layer's activations without recomputation less what the
    recompute choice keeps anyway; the paper leaves it out.
    """
    if not accounting.exact or config.recompute == "none":
        return 0
    whole = estimate(replace(config, recompute="none"), strategy, accounting)
    return whole.per_layer_bytes - layer.per_layer_bytes
