"""torchtitan's pipeline on one stage's rank: torch's Schedule1F1B (torchtitan's default schedule) over the chunk its
pipeline_llm builds there, micro-batch by micro-batch, each walked as the whole model's step walks it
(memcalc.sizing.timeline.torchtitan).

What a stage holds beside its chunk, and how long the schedule keeps each micro-batch's tensors: docs/timeline.md,
"torchtitan's pipeline".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import Stage, stage_named, stage_rank, torchtitan_microbatches
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRAD_SEED, Live, Replays, Sizes, Tape, Timeline, bulk
from memcalc.sizing.timeline.fsdp import Fsdp
from memcalc.sizing.timeline.torchtitan import Parts, Segment, embedding_ops, flex_inputs, model_parts, stage_layers
from memcalc.sizing.timeline.walk import Op


FSDP = "fsdp/"  # what FSDP2's tensors are named under (memcalc.sizing.timeline.fsdp)


def pipeline_timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting,
                      stage: str | None = None) -> Timeline:
    """The moments of one training step of torchtitan's Llama3Model on the rank of pipeline stage `stage` (the
    first by default), pp > 1."""
    st = stage_named(config, stage)
    parts, fsdp = model_parts(config, strategy, accounting, st)
    receive_buffers(parts.tape, config, parts.z, st)
    parts.tape.mark("steady", "", "model states between steps")
    with bulk():  # every micro-batch's moments: half a million on gpt3-1t's 64 stages
        walk_stage(parts, st, fsdp)
    return parts.timeline(st.name)


def receive_buffers(tape: Tape, config: ModelConfig, z: Sizes, stage: Stage) -> None:
    """torch's PipelineStage makes its receive buffers once, one (b, s, h) per micro-batch (under SP this rank's
    (b, s/t, h): the stream between blocks, which torchtitan's TP plan leaves a plain local tensor), and keeps them
    between steps: for the gradient of what it sends (but on the last stage) and for what it is sent (but on the
    first)."""
    m = torchtitan_microbatches(config)
    what = [x for x, has in (("the sent output's gradient", not stage.has_output),
                             ("the input", not stage.has_embedding)) if has]
    tape.add("pipeline/receive buffers", ACTIVATIONS, len(what) * m * z.seq(z.h),
             f"{m} buffers for {' and for '.join(what)}, one per micro-batch, made by the first step")


def walk_stage(parts: Parts, stage: Stage, fsdp: Fsdp | None = None) -> None:
    """The schedule on `stage`'s rank (`schedule`): the trainer's batch of m micro-batches loaded and counted (on
    CUDA then each micro-batch's positions and block mask, live all step), then each micro-batch's forward and
    backward (`_Schedule`), under FSDP2 its gradients reduce-scattered at the step's end (perform_reduce_grad)."""
    z, m = parts.z, torchtitan_microbatches(parts.config)
    count = embedding_ops(replace(z, b=z.b * m, cuda=False))[0]  # the local batch, every micro-batch's ids and labels
    parts.ends(None, "", (count,)).walk.forward((count,))
    run = _Schedule(parts, stage, fsdp)
    for j in range(m if z.cuda else 0):
        run.load(j)
    for forward, j in schedule(m, parts.config.pp, stage_rank(stage.name, parts.config.pp)):
        (run.forward if forward else run.backward)(j)
    if fsdp is not None:
        fsdp.reduce_accumulated(parts.tape)
    run.end()


@dataclass
class _Schedule:
    """Micro-batches walked on one stage's rank, each one's tensors renamed apart (`apart`) from its forward to its
    backward. Beyond a backward the schedule keeps its latest forward's output (its `output`) until the next forward
    returns; on the last stage each loss to the step's end, and each input gradient, sent, until the next backward
    returns (its `bwd_sends`).

    Every micro-batch runs the same ops, and a walk of them reads and writes the tape only under the names they know
    (`names`), never another micro-batch's, renamed apart: where it finds the same tensors under those names as an
    earlier micro-batch's walk did (in backward, after the same forward: its walks' state), it does what that one
    did, which is replayed (`Replays`) rather than walked again. Under FSDP2 its hooks run at each segment's
    edges, on the stage's units, whose tensors (every name under fsdp/) its walks find too: each unit gathered by the
    first forward and kept unsharded (torchtitan's policy under pp), each gradient kept unreduced to the step's end
    (`Fsdp.accumulate_unsynced`)."""

    parts: Parts
    stage: Stage
    fsdp: Fsdp | None = None
    made: dict[int, dict[str, str]] = field(default_factory=dict)  # micro-batch -> what its forward left live, apart
    forwards: dict[int, _Walked] = field(default_factory=dict)  # micro-batch -> its forward's last walk
    done: set[int] = field(default_factory=set)  # micro-batches whose backward ran
    latest: int = 0  # the micro-batch of the latest forward
    fsdp_names: dict[str, None] = field(default_factory=dict)  # FSDP2's tensors the walks traced made, in order

    def __post_init__(self) -> None:
        parts, layers = self.parts, stage_layers(self.parts.config, self.stage)  # the layers the stage's chunk holds
        # what the stage's chunk returns (its last layer's output, on the last stage the logits), and the gradient of
        # its input, which it sends (but on the first stage)
        self.output = f"layers.{layers.stop}/input"
        if self.stage.has_output:  # under the chunked loss the final norm's output, which lm_head's loop reads
            self.output = ledger.OUTPUT_INPUT.name if parts.config.loss_chunk_count else "lm_head/logits"
        self.sent = f"grad/layers.{layers.start}/input"
        self.replays = Replays(parts.tape)  # the walks done, replayed where they would do the same
        # the segments walked (each walk walks a copy): CUDA's flex inputs, the chunk and the loss
        self.flex = [parts.ends(None, "", (Op("", forward=flex_inputs(parts.z), backward=()),))]
        self.chunk, self.loss = parts.chunk(self.stage, layers, pipelined=True)
        # the names each walk touches (`found`): CUDA's flex inputs', and the chunk's with the loss's
        self.flex_names, self.names = (tuple(set().union(*(x.walk.names(x.ops) for x in walks)))
                                       for walks in (self.flex, (*self.chunk, *self.loss)))

    def load(self, j: int) -> None:
        """Micro-batch j's positions and block mask (CUDA's flex attention reads them), made: live all step."""
        self.parts.tape.rename_all({x: apart(j, x) for x in self._walk(("flex",), self.flex, self.flex_names).made})

    def forward(self, j: int) -> None:
        tape = self.parts.tape
        chunk = self._walk(("chunk",), self.chunk, self.names)
        if self.latest in self.done:  # the schedule's `output` lets the previous forward's go as this one returns
            tape.drop(apart(self.latest, self.output))
        self.latest = j
        # the loss (on the last stage: elsewhere none), walked after the chunk; its backward follows it
        last = self._walk(("loss", chunk), self.loss, self.names, before=(chunk,)) if self.loss else chunk
        # FSDP2's unsharded units are the stage's, not the micro-batch's
        self.forwards[j], self.made[j] = last, {x: apart(j, x) for x in last.made if not x.startswith(FSDP)}
        tape.rename_all(self.made[j])

    def backward(self, j: int) -> None:
        tape = self.parts.tape
        # but the output, which its backward's rerun (under a checkpoint) makes again
        tape.rename_all({new: old for old, new in self.made.pop(j).items() if old != self.output})
        last = self.forwards.pop(j)
        self._walk(("backward", last), last.segments, self.names, backward=True)
        self.done.add(j)
        if self.latest != j:
            tape.drop(apart(j, self.output))
        if self.stage.has_output:  # stage_backward returns: its seed goes; the loss is kept
            tape.drop(GRAD_SEED)
            tape.rename("loss/value", apart(j, "loss/value"))
        if not self.stage.has_embedding:  # the input's gradient, sent, kept until the next backward returns
            tape.drop(apart(j - 1, self.sent))
            tape.rename(self.sent, apart(j, self.sent))

    def _walk(self, what: tuple[object, ...], segments: list[Segment], names: tuple[str, ...],
              backward: bool = False, before: tuple[_Walked, ...] = ()) -> _Walked:
        """The forward (or `backward`, last first) of copies of `segments` (their walks as they are) on the tape,
        replayed (`Replays`) if walked before as `what` (the walk, and the forward it follows) under the same
        tensors under `names` (those its ops know) and FSDP2's (`fsdp_names`: any live was made by a walk traced
        before), else walked; a forward also says what it left live, with the walks of the same forward `before` it,
        and its segments as it left them (the state its backward walks from: after the loss, the chunk's and the
        loss's)."""
        tape = self.parts.tape
        names = (*names, *self.fsdp_names)

        def walk() -> _Walked:
            walks, at = [replace(x, walk=x.walk.copy()) for x in segments], len(tape.live.log)
            found = tuple(filter(None, map(tape.live.get, names)))
            self._segments(walks, backward)
            done = _Walked(found, tuple(tape.live.log[at:]))
            made_here = (x.name for x in done.log if type(x) is not str)
            self.fsdp_names |= dict.fromkeys(x for x in made_here if x.startswith(FSDP))
            if not backward:  # the walks' state, from which a micro-batch's backward walks
                ahead = [y for x in before for y in x.segments]
                done.segments = [*ahead, *(replace(x, walk=x.walk.copy()) for x in walks)]
                first = before[0] if before else done  # the forward's first walk: what was live before it
                done.made = made(first.found, *(x.log for x in (*before, done)))
            return done
        return self.replays.run(what, names, "", walk)  # the walk's kind, the walk it follows (by identity)

    def _segments(self, walks: list[Segment], backward: bool) -> None:
        """The forward of `walks` (or their `backward`, last first), under FSDP2 with its hooks: in forward the
        root's returns after the last (its last all-gather buffer freed); in backward the final callback runs the
        embedding's post-backward (its input, the ids, needs no gradient)."""
        fsdp, tape = self.fsdp, self.parts.tape
        if backward:
            for x in reversed(walks):
                x.backward(fsdp, None)  # each unit unsharded still: nothing to prefetch
            if fsdp is not None and "tok_embeddings" in (x.unit for x in walks):
                fsdp.post_backward(tape, "tok_embeddings", "")
            return
        for i, x in enumerate(walks):
            x.forward(fsdp, walks[i + 1].unit if i + 1 < len(walks) else None)
        if fsdp is not None:
            fsdp.forward_done(tape)

    def end(self) -> None:
        """The schedule's step returns: its latest output goes, and the last input gradient sent."""
        self.parts.tape.drop(apart(self.latest, self.output), apart(max(self.done), self.sent))


@dataclass(eq=False)
class _Walked:
    """A walk done once: the tensors it found under the names its ops know (`found`), its changes to the live
    tensors (`log`), and after a forward its segments as it left them (the state a micro-batch's backward walks
    from)."""

    found: tuple[Live, ...]
    log: tuple[Live | str, ...]
    segments: list[Segment] = field(default_factory=list)
    made: list[str] = field(default_factory=list)  # a forward: what it left live (with the walks before it)


def made(found: tuple[Live, ...], *logs: tuple[Live | str, ...]) -> list[str]:
    """The names walks left live, in order, that were not live before them (when `found` was, of every name they
    touch), from their changes to the live tensors (`logs`)."""
    live = {x.name: x for x in found}
    for log in logs:
        for x in log:
            if type(x) is str:
                del live[x]
            else:
                live[x.name] = x
    before = {x.name for x in found}
    return [x for x in live if x not in before]


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

