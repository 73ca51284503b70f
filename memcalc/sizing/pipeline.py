"""Pipeline stages: which layers and model ends a GPU holds, and how many micro-batches it keeps.

Under pipeline parallelism a stage's activations are not its layers' share of
one micro-batch: a schedule keeps several micro-batches in flight so that no
stage idles (Korthikanti et al. 2022, section 4.2.3). With Megatron-LM's
schedules, after the warm-up every step runs one forward and then one backward,
so a rank's peak is its warm-up forwards plus one:

- 1F1B (PipeDream-Flush): rank r warms up with p - r - 1 forwards, so the first
  stage keeps p micro-batches of its L/p layers (L layers' worth, whatever p
  is) and the last stage keeps one.
- Interleaved 1F1B with m model chunks of L/(pm) layers per rank: rank r warms
  up with 2(p - r - 1) + (m - 1)p chunk forwards, so the first stage keeps
  pm + p - 1 chunk-micro-batches, L(1 + (p-1)/(pm)) layers' worth (the paper's
  factor), and the last stage (m - 1)p + 1. Forward k runs chunk (k mod pm) // p,
  so chunk 0, which holds the embedding, reaches 2p micro-batches in flight at
  that same peak, while the output layer's chunk on the last stage keeps one.

The middle stages hold fewer micro-batches than the first and no model ends,
so the first and the last stage bound every GPU. The counts are the steady
state of a step with enough micro-batches m to fill the warm-up. A step with
fewer keeps fewer: under 1F1B rank r warms up with min(p - r - 1, m) forwards,
so the first stage keeps min(p, m) micro-batches. Interleaved, Megatron-LM
needs p | m, and with m = p it sets `all_warmup_microbatches`: every rank runs
all m*vpp chunk forwards before any backward, so the first and the last stage
both keep m*vpp, m of them the embedding's (or the output layer's) chunk.
With m unknown (None) the steady state is assumed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds at its memory peak."""

    name: str  # "only" (no pipelining), "first" or "last"
    layers: int  # transformer layers whose weights this stage holds
    layer_slots: int  # layer-activations kept at the peak: layers times micro-batches in flight
    embedding_in_flight: int  # micro-batches whose embedding activations are kept (0: no embedding here)
    output_in_flight: int  # micro-batches whose output-layer and loss activations are kept (0: none here)
    schedule: str  # how the counts arise, for people

    @property
    def has_embedding(self) -> bool:
        return self.embedding_in_flight > 0

    @property
    def has_output(self) -> bool:
        return self.output_in_flight > 0


def stages(L: int, pp: int, vpp: int | None, microbatches: int | None = None) -> tuple[Stage, ...]:
    """The stages that bound per-GPU memory: the only one, or the first and the last.

    Expects a validated layout (pp divides L, or pp*vpp does when interleaved, and then pp divides
    `microbatches`). `microbatches` caps what a stage keeps when the step is shorter than the warm-up.
    """
    m = microbatches
    if pp == 1:
        return (Stage("only", L, L, 1, 1, "no pipelining: one micro-batch at a time"),)
    if vpp is None:
        per_stage = L // pp
        kept = pp if m is None else min(pp, m)
        why = "" if kept == pp else f" (a step of only {m}: all forwards before any backward)"
        return (
            Stage(
                "first", per_stage, per_stage * kept, kept, 0,
                f"1F1B keeps {kept} micro-batch{'es' if kept > 1 else ''} of {per_stage} layers{why}",
            ),
            Stage("last", per_stage, per_stage, 0, 1, f"1F1B keeps 1 micro-batch of {per_stage} layers"),
        )
    chunk = L // (pp * vpp)
    first, last, embedding, output = pp * vpp + pp - 1, (vpp - 1) * pp + 1, 2 * pp, 1
    why = ""
    if m is not None and m <= pp:  # pp | m, so m == pp: Megatron-LM runs every forward as warm-up, on every rank
        first = last = m * vpp
        embedding = output = m
        why = f" (a step of only {m} micro-batches: every forward before any backward)"
    return (
        Stage(
            "first", chunk * vpp, chunk * first, embedding, 0,
            f"interleaved 1F1B keeps {first} chunk-micro-batches of {chunk} layers,"
            f" {embedding} of them the embedding's chunk{why}",
        ),
        Stage(
            "last", chunk * vpp, chunk * last, 0, output,
            f"interleaved 1F1B keeps {last} chunk-micro-batches of {chunk} layers,"
            f" {output} of them the output layer's chunk{why}",
        ),
    )
