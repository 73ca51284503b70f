"""Pipeline stages: which layers and model ends a GPU holds, and how many micro-batches it keeps in flight
(Megatron-LM's 1F1B and interleaved 1F1B: its warm-up forwards plus one). The first and the last stage bound every
GPU where every rank's layers are alike (else `layers_changed`); the counts are derived in docs/guide-fit-totals.md
(section 1, `layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.config.schema import ModelConfig, torchtitan_split
from memcalc.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds at its memory peak."""

    name: str  # "only" (no pipelining), "first" or "last"
    layers: int  # transformer layers whose weights this stage holds
    layer_slots: int  # layer-activations kept at the peak: layers times micro-batches in flight
    embedding_in_flight: int  # micro-batches whose embedding activations are kept (0: no embedding here)
    output_in_flight: int  # micro-batches whose output-layer and loss activations are kept (0: none here)
    schedule: str  # how the counts arise, for people
    chunks_in_flight: int  # model-chunk forwards kept (layer_slots / layers a chunk): each made its own RoPE tables

    @property
    def has_embedding(self) -> bool:
        return self.embedding_in_flight > 0

    @property
    def has_output(self) -> bool:
        return self.output_in_flight > 0


def stages(L: int, pp: int, vpp: int | None, microbatches: int | None = None,
           held: tuple[int, int] | None = None) -> tuple[Stage, ...]:
    """The stages that bound per-GPU memory: the only one, or the first and the last, for a validated layout;
    `microbatches` caps what a stage keeps when the step is shorter than the warm-up; `held`: the layers the first
    and the last rank hold where Megatron's split is uneven (`ModelConfig.rank_chunks`), else L/pp each."""
    m = microbatches
    if pp == 1:
        return (Stage("only", L, L, 1, 1, "no pipelining: one micro-batch at a time", 1),)
    chunks = vpp or 1
    ends = [n // chunks for n in held or (L // pp, L // pp)]  # the layers of one model chunk of each
    first, last = in_flight(pp, vpp, 0, m), in_flight(pp, vpp, pp - 1, m)
    short = m is not None and all_warmup(pp, vpp, 0, m)
    embedding = first if vpp is None else (m if short else 2 * pp)
    output = 1  # the last rank's output chunk is never all warm-up: p | m, so m*vpp > (vpp - 1)p
    why = f" (a step of only {m}: all forwards before any backward)" if short else ""
    if vpp is None:
        says = (f"1F1B keeps {first} micro-batch{'es' if first > 1 else ''} of {ends[0]} layers{why}",
                f"1F1B keeps 1 micro-batch of {ends[1]} layers")
    else:
        says = (f"interleaved 1F1B keeps {first} chunk-micro-batches of {ends[0]} layers, {embedding} of them the"
                f" embedding's chunk{why}", f"interleaved 1F1B keeps {last} chunk-micro-batches of {ends[1]}"
                f" layers, {output} of them the output layer's chunk")
    return (Stage("first", ends[0] * chunks, ends[0] * first, embedding, 0, says[0], first),
            Stage("last", ends[1] * chunks, ends[1] * last, 0, output, says[1], last))


def torchtitan_stages(L: int, pp: int, microbatches: int) -> tuple[Stage, ...]:
    """Every rank's stage of torchtitan's pipeline (its layers: `torchtitan_split`): its default schedule, torch's
    Schedule1F1B, keeps min(m, pp - r) micro-batches in flight on rank r. With pp > 2 a middle stage can hold the
    most."""
    found = []
    for r, layers in enumerate(torchtitan_split(L, pp)):
        kept = min(microbatches, pp - r)
        name = "first" if r == 0 else "last" if r == pp - 1 else f"rank {r}"
        found.append(Stage(name, layers, layers * kept, kept if r == 0 else 0, int(r == pp - 1),
                           f"torch's 1F1B keeps {kept} micro-batch{'es' if kept > 1 else ''} of {layers}"
                           f" layer{'s' if layers != 1 else ''}", kept))
    return tuple(found)


def torchtitan_microbatches(config: ModelConfig) -> int:
    """The micro-batches a step of torchtitan's pipeline runs: the config's, else pp, the fewest torch's
    Schedule1F1B takes."""
    return config.microbatches or config.pp


def pipeline_stages(config: ModelConfig) -> tuple[Stage, ...]:
    """The stages whose step timelines bound per-GPU memory: under torchtitan's pipeline every rank's
    (`torchtitan_stages`), else `stages`, with beside them each middle rank whose layers differ in number or kinds
    from the rank's before it (`layers_changed`)."""
    c = config
    if c.impl == "torchtitan" and c.pp > 1:
        return torchtitan_stages(c.L, c.pp, torchtitan_microbatches(c))
    held = (_held(c, 0), _held(c, c.pp - 1))
    first, *last = stages(c.L, c.pp, c.vpp, c.microbatches, held)
    return (first, *(middle_stage(c, r) for r in range(1, c.pp - 1) if layers_changed(c, r)), *last)


def _held(config: ModelConfig, rank: int) -> int:
    """The layers pipeline rank `rank` holds (`ModelConfig.rank_chunks`)."""
    return sum(map(len, config.rank_chunks(rank)))


def layers_changed(config: ModelConfig, rank: int) -> bool:
    """Whether pipeline rank `rank`'s model chunks (`ModelConfig.rank_chunks`) hold other numbers or kinds of layers,
    dense or MoE, than the rank's before it: DeepSeek-V3's first dense layers on the first rank, MoE ones from the
    next on; under Megatron's uneven split a first stage of num_layers_in_first_pipeline_stage layers, the next of
    its share of the rest. Of ranks alike, the lowest keeps the most micro-batches in flight (`in_flight`), the
    same states: the others bound nothing."""
    def kinds(r: int) -> list[list[bool]]:
        return [[config.is_moe_layer(i) for i in x] for x in config.rank_chunks(r)]
    return kinds(rank) != kinds(rank - 1)


def middle_stage(config: ModelConfig, rank: int) -> Stage:
    """Pipeline rank `rank` of Megatron-LM's schedule, neither the first nor the last: its layers
    (`ModelConfig.rank_chunks`), its in_flight chunk-micro-batches of a model chunk's layers kept."""
    c = config
    chunk, kept = len(c.rank_chunks(rank)[0]), in_flight(c.pp, c.vpp, rank, c.microbatches)
    says = (f"1F1B keeps {kept} micro-batch{'es' if kept > 1 else ''}" if c.vpp is None else
            f"interleaved 1F1B keeps {kept} chunk-micro-batches")
    return Stage(f"rank {rank}", _held(c, rank), chunk * kept, 0, 0, f"{says} of {chunk} layers", kept)


def stage_rank(name: str, pp: int) -> int:
    """The pipeline rank of the stage called `name` (`stages`' and `torchtitan_stages`' names)."""
    named = {"only": 0, "first": 0, "last": pp - 1}
    return named[name] if name in named else int(name.split()[-1])


def stage_named(config: ModelConfig, name: str | None) -> Stage:
    """`config`'s pipeline stage called `name` (one of `pipeline_stages`), the first by default."""
    found = pipeline_stages(config)
    chosen = next((x for x in found if name in (None, x.name)), None)
    if chosen is None:
        raise ConfigError(f"no {name} pipeline stage with pp={config.pp}: {', '.join(x.name for x in found)}")
    return chosen


def warmup(pp: int, vpp: int | None, rank: int, microbatches: int | None) -> int:
    """Forwards rank `rank` runs before its first backward (megatron-core's get_pp_rank_microbatches, with
    microbatch_group_size_per_vp_stage at its default, pp): capped at the step's chunk-micro-batches."""
    steady = pp - rank - 1 if vpp is None else 2 * (pp - rank - 1) + (vpp - 1) * pp
    return steady if microbatches is None else min(steady, microbatches * (vpp or 1))


def all_warmup(pp: int, vpp: int | None, rank: int, microbatches: int) -> bool:
    """Whether the step is too short for rank `rank` to reach 1F1B: every forward runs before any backward."""
    return warmup(pp, vpp, rank, microbatches) == microbatches * (vpp or 1)


def in_flight(pp: int, vpp: int | None, rank: int, microbatches: int | None) -> int:
    """Chunk-micro-batches rank `rank` keeps at its peak: its warm-up, plus the first steady forward if any."""
    kept = warmup(pp, vpp, rank, microbatches)
    return kept if microbatches is not None and all_warmup(pp, vpp, rank, microbatches) else kept + 1
