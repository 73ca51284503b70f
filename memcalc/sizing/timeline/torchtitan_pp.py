"""torchtitan's pipeline on one stage's rank: torch's Schedule1F1B (torchtitan's default schedule) over the chunk its
pipeline_llm builds there, micro-batch by micro-batch, each walked as the whole model's step walks it
(memcalc.sizing.timeline.torchtitan).

What a stage holds beside its chunk, and how long the schedule keeps each micro-batch's tensors: docs/timeline.md,
"torchtitan's pipeline".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import Stage, stage_named, stage_rank, torchtitan_microbatches
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRAD_SEED, Sizes, Tape, Timeline
from memcalc.sizing.timeline.torchtitan import Parts, Segment, embedding_ops, flex_inputs, model_parts, stage_layers
from memcalc.sizing.timeline.walk import Op


def pipeline_timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting,
                      stage: str | None = None) -> Timeline:
    """The moments of one training step of torchtitan's Llama3Model on the rank of pipeline stage `stage` (the
    first by default), pp > 1."""
    st = stage_named(config, stage)
    parts, _ = model_parts(config, strategy, accounting, st)
    receive_buffers(parts.tape, config, parts.z, st)
    parts.tape.mark("steady", "", "model states between steps")
    walk_stage(parts, st)
    return parts.timeline(st.name)


def receive_buffers(tape: Tape, config: ModelConfig, z: Sizes, stage: Stage) -> None:
    """torch's PipelineStage makes its receive buffers once, one (b, s, h) per micro-batch, and keeps them between
    steps: for the gradient of what it sends (but on the last stage) and for what it is sent (but on the first)."""
    m = torchtitan_microbatches(config)
    what = [x for x, has in (("the sent output's gradient", not stage.has_output),
                             ("the input", not stage.has_embedding)) if has]
    tape.add("pipeline/receive buffers", ACTIVATIONS, len(what) * m * z.tokens(z.act * z.h),
             f"{m} buffers for {' and for '.join(what)}, one per micro-batch, made by the first step")


def walk_stage(parts: Parts, stage: Stage) -> None:
    """The schedule on `stage`'s rank (`schedule`): the trainer's batch of m micro-batches loaded and counted (on
    CUDA then each micro-batch's positions and block mask, live all step), then each micro-batch's forward and
    backward (`_Schedule`)."""
    z, m, tape = parts.z, torchtitan_microbatches(parts.config), parts.tape
    count = embedding_ops(replace(z, b=z.b * m, cuda=False))[0]  # the local batch, every micro-batch's ids and labels
    parts.ends(None, "", (count,)).walk.forward((count,))
    for j in range(m if z.cuda else 0):
        before = set(tape.live)
        flex = Op("", forward=flex_inputs(z), backward=())
        parts.ends(None, "", (flex,)).walk.forward((flex,))
        for x in [x for x in tape.live if x not in before]:
            tape.rename(x, apart(j, x))
    run = _Schedule(parts, stage)
    for forward, j in schedule(m, parts.config.pp, stage_rank(stage.name, parts.config.pp)):
        (run.forward if forward else run.backward)(j)
    run.end()


@dataclass
class _Schedule:
    """Micro-batches walked on one stage's rank, each one's tensors renamed apart (`apart`) from its forward to its
    backward. Beyond a backward the schedule keeps its latest forward's output (its `output`) until the next forward
    returns; on the last stage each loss to the step's end, and each input gradient, sent, until the next backward
    returns (its `bwd_sends`)."""

    parts: Parts
    stage: Stage
    made: dict[int, list[str]] = field(default_factory=dict)  # micro-batch -> what its forward left live
    walks: dict[int, list[Segment]] = field(default_factory=dict)  # micro-batch -> its walks, for its backward
    done: set[int] = field(default_factory=set)  # micro-batches whose backward ran
    latest: int = 0  # the micro-batch of the latest forward

    @property
    def layers(self) -> range:
        """The layers the stage's chunk holds."""
        return stage_layers(self.parts.config, self.stage)

    @property
    def output(self) -> str:
        """What the stage's chunk returns: its last layer's output, on the last stage the logits."""
        return "lm_head/logits" if self.stage.has_output else f"layers.{self.layers.stop}/input"

    @property
    def sent(self) -> str:
        """The gradient of the stage's input, which it sends (but on the first stage)."""
        return f"grad/layers.{self.layers.start}/input"

    def forward(self, j: int) -> None:
        tape = self.parts.tape
        before = set(tape.live)
        chunk, loss = self.parts.chunk(self.stage, self.layers, pipelined=True)
        for segment in chunk:
            segment.walk.forward(segment.ops)
        if self.latest in self.done:  # the schedule's `output` lets the previous forward's go as this one returns
            tape.drop(apart(self.latest, self.output))
        self.latest = j
        for segment in loss:
            segment.walk.forward(segment.ops)
        self.made[j], self.walks[j] = [x for x in tape.live if x not in before], [*chunk, *loss]
        for x in self.made[j]:
            tape.rename(x, apart(j, x))

    def backward(self, j: int) -> None:
        tape = self.parts.tape
        for x in self.made.pop(j):  # but the output, which its backward's rerun (under a checkpoint) makes again
            if x != self.output:
                tape.rename(apart(j, x), x)
        for segment in reversed(self.walks.pop(j)):
            segment.walk.backward(segment.ops)
        self.done.add(j)
        if self.latest != j:
            tape.drop(apart(j, self.output))
        if self.stage.has_output:  # stage_backward returns: its seed goes; the loss is kept
            tape.drop(GRAD_SEED)
            tape.rename("loss/value", apart(j, "loss/value"))
        if not self.stage.has_embedding:  # the input's gradient, sent, kept until the next backward returns
            tape.drop(apart(j - 1, self.sent))
            tape.rename(self.sent, apart(j, self.sent))

    def end(self) -> None:
        """The schedule's step returns: its latest output goes, and the last input gradient sent."""
        self.parts.tape.drop(apart(self.latest, self.output), apart(max(self.done), self.sent))


def schedule(m: int, pp: int, rank: int) -> list[tuple[bool, int]]:
    """torch's Schedule1F1B on rank `rank`, as (forward?, micro-batch): min(m, pp - rank) forwards, then a backward
    and the next forward while any are left, then the remaining backwards."""
    warm = min(m, pp - rank)
    order = [(True, j) for j in range(warm)]
    for j in range(m):
        order.append((False, j))
        if warm + j < m:
            order.append((True, warm + j))
    return order


def apart(j: int, name: str) -> str:
    """Micro-batch j's tensor `name` while another micro-batch's ops make and free tensors of that name."""
    return f"micro-batch {j}/{name}"

