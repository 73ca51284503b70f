"""A layer described once, as an ordered list of ops, and the one walk that puts any such list on the tape.

Op, Step, Made and Checkpoint, and how forward, backward and a rerun put them on the tape: docs/timeline.md,
"Ops and the one walk".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.tape import ACTIVATIONS, TEMPORARIES, Tape

HandOver = Callable[[str, str, int], None]  # (where, name, bytes): a weight's gradient given to autograd


@dataclass(frozen=True)
class Made:
    """A tensor a step makes: its tape name, its bytes, why it exists. `keeps`: the ledger's record when it is one
    of the saved tensors (its bytes are then the ledger's, not `bytes`; without a name, the walk names it by its
    prefix, so that every layer's walk can share the one Made). `category`: the tape category it is filed under;
    empty for the phase's own (activations in forward, temporaries in backward). `alias`: a no-op cast (x.to(float32)
    in fp32) whose output, the saved tensor `keeps`, is the live tensor `name` itself: nothing is made, and the op
    that saves it lets `name` go (under a checkpoint its rerun keeps `name` to then)."""

    name: str
    bytes: int
    why: str
    keeps: SavedTensor | None = None
    category: str = ""
    alias: bool = False


@dataclass(frozen=True)
class Step:
    """What one aten op (or a few made together) allocates, then what is freed before the next one, and which
    weights' gradients autograd then hands over (`hands_over`, names of tensors made before). A step that makes
    nothing marks no moment: it only frees; one with `moment` false makes its tensors without marking one (an op
    whose output MemTracker never reads at a high: a transient the next op frees at once)."""

    what: str
    makes: tuple[Made, ...] = ()
    frees: tuple[str, ...] = ()
    hands_over: tuple[str, ...] = ()
    returns: bool = False  # in backward: the op's autograd node returns here, and what it saves goes (default: last)
    # autograd sums this gradient to its input's shape (validate_outputs) after the node returned: the node's saved
    # tensors go after it, but under a checkpoint, whose rerun's tensors are the node's locals, before it
    reduced: bool = False
    reads_last: tuple[str, ...] = ()  # kept tensors read here for the last time (under a checkpoint they go after it)
    moment: bool = True

    @functools.cached_property
    def net(self) -> tuple[tuple[Made, ...], tuple[str, ...]]:
        """What a step without a moment leaves on the tape: the tensors it makes but those it frees again (no moment
        reads them), and what it frees of the rest."""
        made = {x.name for x in self.makes} - {""}
        return (tuple(x for x in self.makes if x.name not in self.frees),
                tuple(x for x in self.frees if x not in made))


@dataclass(frozen=True)
class Op:
    """One op of a layer: where it runs (the probe's module path below the layer's), its forward and backward steps,
    and the ledger's records it keeps for backward (`saves`: freed when its autograd node returns, unless an op before
    it, whose backward runs later, keeps them too). A collective is a step like any other (its output buffer is what
    it makes); a recomputation region is the walk's (`Checkpoint`), around all of its ops."""

    where: str
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    saves: tuple[SavedTensor, ...] = ()
    shadow: str = ""  # where MemTracker reads its backward, if a module that returns its output as its own runs last

    @functools.cached_property
    def returns(self) -> int:
        """The backward step after which the op's autograd node returns: the one that says so, else the last."""
        return next((j for j, x in enumerate(self.backward) if x.returns), len(self.backward) - 1)

    @functools.cached_property
    def validated(self) -> int:
        """The backward step after which the node's saved tensors go: its return, and the sums autograd then makes."""
        j = self.returns
        while j + 1 < len(self.backward) and self.backward[j + 1].reduced:
            j += 1
        return j


@dataclass(frozen=True)
class Checkpoint:
    """torch.utils.checkpoint (non-reentrant) around a walk's ops: `holds`, the region's input, which its frame keeps
    for the rerun; `cached`, the op outputs a selective policy keeps from forward to the rerun, which then takes them
    instead of making them again; `rerun`, the category the rerun's tensors are read in (MemTracker's activations;
    FSDPMemTracker, which tells a rerun by an FSDP unit's forward in backward, reads a rerun inside one as
    temporaries); `own`, the category of what the region's own ops (where "") make in the rerun (transformers
    checkpoints a layer's forward, not its __call__: MemTracker, inside no module's forward then, reads temporaries);
    `early_stop`, whether the rerun stops at the last saved tensor's pack hook, its frame's locals going then (torch's
    default; torchtitan turns it off); `frame`, what else the frame holds (the forward's keyword arguments)."""

    holds: str
    cached: frozenset[str] = frozenset()
    rerun: str = ACTIVATIONS
    own: str | None = None  # None: as `rerun`
    early_stop: bool = False
    frame: tuple[str, ...] = ()


@dataclass
class Walk:
    """Puts ops on a tape: `prefix` names the layer's saved tensors ("layers.0" -> "layers.0/ln1/rstd_fp32"),
    `saved` holds each saved tensor's bytes on this rank (the ledger's, by name), `module` the probe's module path
    of the layer ("layers.0")."""

    tape: Tape
    prefix: str
    module: str
    saved: dict[str, int]
    hand_over: HandOver
    checkpoint: Checkpoint | None = None
    _kept_by: dict[str, int] = field(default_factory=dict)  # saved name -> index of the first op that keeps it
    _rerun_kept: set[str] = field(default_factory=set)  # under a checkpoint: what the rerun made that ops keep
    _input_freed: bool = False  # under a checkpoint: whether an op's backward frees the region's input by name
    _aliases: dict[str, str] = field(default_factory=dict)  # a saved tensor's tape name -> the live tensor it is

    def names(self, ops: tuple[Op, ...]) -> set[str]:
        """Every tape name a walk of `ops` reads or writes: what they make (a saved tensor also by the walk's prefix),
        free, read last and hand over, what they keep, and the checkpoint's. It touches no other tensor."""
        checkpoint = self.checkpoint or Checkpoint("")
        found = {checkpoint.holds, *checkpoint.cached, *checkpoint.frame}
        for op in ops:
            found.update(kept_name(self.prefix, x) for x in op.saves)
            for step in (*op.forward, *op.backward):
                found.update(step.frees, step.reads_last, step.hands_over, (x.name for x in step.makes))
                found.update(kept_name(self.prefix, x.keeps) for x in step.makes if x.keeps is not None)
        return found

    def copy(self) -> Walk:
        """The walk as it is now, with a state of its own (what it found and kept so far)."""
        return replace(self, _kept_by=dict(self._kept_by), _rerun_kept=set(self._rerun_kept),
                       _aliases=dict(self._aliases))

    def forward(self, ops: tuple[Op, ...]) -> None:
        self._first_keepers(ops)
        for op in ops:
            for step in op.forward:
                self._step(step, op, "forward")

    def _first_keepers(self, ops: tuple[Op, ...]) -> None:
        """Each saved tensor's first keeper (its backward runs last, the tensor going as it returns), found once."""
        for i, op in enumerate(ops if not self._kept_by else ()):
            for x in op.saves:
                self._kept_by.setdefault(x.name, i)

    def backward(self, ops: tuple[Op, ...]) -> None:
        """The ops' backward, last op first (without a forward walked first, a layer rerun inside backward by full
        recomputation, each saved tensor's first keeper is found here; once for every layer the walk serves)."""
        self._first_keepers(ops)
        if self.checkpoint is not None:
            holds = self.checkpoint.holds
            self._input_freed = any(holds in step.frees for op in ops for step in op.backward)
        for i in reversed(range(len(ops))):
            op = ops[i]
            if self.checkpoint is not None and op.saves and not self._rerun_kept:
                self._rerun(ops, op, self.checkpoint)
            returns = op.returns if self.checkpoint is not None else op.validated
            for j, step in enumerate(op.backward):
                self._step(step, op, "backward", i if j == returns else None)
                self._release_frame()
            if not op.backward:
                self._release(op, i)

    def _rerun(self, ops: tuple[Op, ...], trigger: Op, checkpoint: Checkpoint) -> None:
        """The checkpoint's rerun of the forward, when `trigger`'s backward first unpacks a saved tensor: each step
        makes its tensors (in the checkpoint's `rerun` category; the cached ones are taken, not made), what the ops
        keep stays, the rest goes as in forward, and what the rerun returns goes at its end. MemTracker reads it in
        backward, a rerun module that is an ancestor of the trigger's (its own ops, the block's residual sums) at the
        trigger, which is still active."""
        made: list[str] = []
        pending = {x.name for op in ops for step in op.forward for x in step.makes  # early stop waits for the last
                   if x.keeps is not None and x.keeps.name in self.saved} if checkpoint.early_stop else None
        for op, step in ((op, step) for op in ops for step in op.forward):
            where = (trigger.shadow or trigger.where) if _ancestor(op.where, trigger.where) else op.where
            new = tuple(x for x in step.makes if x.name not in checkpoint.cached)
            self._make(new, checkpoint.rerun if op.where else checkpoint.own or checkpoint.rerun)
            if step.moment and any(not x.alias for x in new):
                self.tape.mark("backward", ".".join(x for x in (self.module, where) if x), step.what)
            made += [x.name for x in new if x.keeps is None]
            kept = {x.name for x in step.makes if x.keeps is not None and x.name in self.tape.live}
            self._rerun_kept.update(kept)  # an alias's tensor too: a local the saved tensor is, kept with it
            self.tape.drop(*(x for x in step.frees if x != checkpoint.holds and x not in self._rerun_kept))
            if pending is not None and not (pending := pending - kept):
                break  # early stop: the last saved tensor is made again; the forward's frame unwinds
        self.tape.drop(*(x for x in made if x not in self._rerun_kept))

    def _release_frame(self) -> None:
        """Under a checkpoint: its frame, and with it the region's input, goes when the last tensor the rerun kept
        does (the last saved-tensor hook that refers to it); an input that an op keeps itself (a norm's, in fp32 its
        upcast's) goes with that op's saved tensors, where its backward frees it."""
        if self.checkpoint is not None and self._rerun_kept and not self._rerun_kept & self.tape.live.keys():
            self.tape.drop(*(() if self._input_freed else (self.checkpoint.holds,)), *self.checkpoint.frame)

    def _release(self, op: Op, i: int) -> None:
        """What op i saves goes, unless an op before it (whose backward runs later) keeps it too."""
        names = (kept_name(self.prefix, x) for x in op.saves if self._kept_by.get(x.name) == i)
        self.tape.drop(*(self._aliases.get(x, x) for x in names))

    def _step(self, step: Step, op: Op, phase: str, returns: int | None = None) -> None:
        """The step's tensors made, its moment, what it frees; at the op's return (`returns`, the op's index) what the
        op saves goes; then the weights' gradients are handed over (after the node returned, as AccumulateGrad runs)."""
        makes, frees = (step.makes, step.frees) if step.moment else step.net
        self._make(makes, ACTIVATIONS if phase == "forward" else TEMPORARIES)
        if step.moment and any(not x.alias for x in step.makes):  # an alias makes nothing: no op ran
            self.tape.mark(phase, self._where(op, phase), step.what)
        if self.checkpoint is not None:
            # also the kept tensors it reads last: in forward nothing keeps them (but the region's input and the cached
            # op outputs), in backward the rerun's are the node's locals
            held = {self.checkpoint.holds, *self.checkpoint.cached} if phase == "forward" else set()
            frees = tuple(x for x in (*frees, *step.reads_last) if x not in held)
        self.tape.drop(*frees)
        if returns is not None:
            self._release(op, returns)
        for name in step.hands_over:
            self.hand_over(self._where(op, phase), name, self.tape.live[name].bytes)

    def _where(self, op: Op, phase: str = "forward") -> str:
        """The probe's module path of the op (in backward its shadow's, if any): the layer's, and the op's below it."""
        where = op.shadow if phase == "backward" and op.shadow else op.where
        return f"{self.module}.{where}" if self.module and where else self.module or where


    def _make(self, makes: tuple[Made, ...], category: str) -> None:
        tape = self.tape
        for x in makes:
            if x.alias:
                self._aliases[kept_name(self.prefix, x.keeps)] = x.name
            elif x.keeps is None:
                tape.add(x.name, x.category or category, x.bytes, x.why)
            elif x.keeps.name in self.saved:  # else not kept under these sizes (the ledger's size rules)
                name = x.name or kept_name(self.prefix, x.keeps)
                tape.add(name, x.category or category, self.saved[x.keeps.name], x.why)


def _ancestor(module: str, of: str) -> bool:
    """Whether `module` (a path below the walk's) is `of` or a module around it ("" is the walk's own)."""
    return not module or of == module or of.startswith(module + ".")


def kept_name(prefix: str, tensor: SavedTensor) -> str:
    """The tape name of a saved tensor of the layer (or model end) `prefix` names: "layers.0/ln1/rstd_fp32"."""
    return f"{prefix}/{tensor.name}" if prefix else tensor.name


def kept_names(prefix: str, *tensors: SavedTensor) -> tuple[str, ...]:
    """The tape names of saved tensors of the layer `prefix` names (a step's `reads_last`)."""
    return tuple(kept_name(prefix, x) for x in tensors)


def kept(prefix: str, tensor: SavedTensor, why: str = "kept for backward (the ledger)") -> Made:
    """A saved tensor made by a step: sized by the ledger."""
    return Made(kept_name(prefix, tensor), 0, why, keeps=tensor)
