"""A layer described once, as an ordered list of ops, and the one walk that puts any such list on the tape.

Issue 19: each op says what it makes in forward, which of the ledger's saved tensors it keeps for backward (the
`SavedTensor` records themselves, sized by the ledger: nothing is written twice), and what its backward makes and
frees. `Walk.forward` and `Walk.backward` turn any list of ops into moments, the way autograd runs them:

    forward     op by op, in order: each step's tensors made (activations), a moment, then what the step frees;
                what an op keeps stays on the tape until its backward has run
    backward    op by op, in reverse: each step's gradients made (temporaries), a moment, then what it frees; a
                weight's gradient is handed to autograd after the step that names it (`hands_over`; the walk's
                `hand_over` adds it into the fp32 buffer, or under FSDP2 would keep it to the block's
                reduce-scatter); when the op's autograd node returns, the saved tensors no op before it keeps go

A step is one op's output (or several outputs made together, as a GEMM's dW and dX), i.e. a moment at which
MemTracker can read a new high; `frees` go when the next op runs. Names are whole tape names (the layer's prefix
included): the op that makes a tensor and the op that frees it may be different ops, as a residual stream's
gradient is freed where the branches meet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from memcalc.model.ledger import SavedTensor
from memcalc.sizing.timeline.tape import ACTIVATIONS, TEMPORARIES, Tape

HandOver = Callable[[str, str, int], None]  # (where, name, bytes): a weight's gradient given to autograd


@dataclass(frozen=True)
class Made:
    """A tensor a step makes: its tape name, its bytes, why it exists. `keeps`: the ledger's record when it is one
    of the saved tensors (its bytes are then the ledger's, not `bytes`). `category`: the tape category it is filed
    under; empty for the phase's own (activations in forward, temporaries in backward)."""

    name: str
    bytes: int
    why: str
    keeps: SavedTensor | None = None
    category: str = ""


@dataclass(frozen=True)
class Step:
    """What one aten op (or a few made together) allocates, then what is freed before the next one, and which
    weights' gradients autograd then hands over (`hands_over`, names of tensors made before). A step that makes
    nothing marks no moment: it only frees."""

    what: str
    makes: tuple[Made, ...] = ()
    frees: tuple[str, ...] = ()
    hands_over: tuple[str, ...] = ()
    returns: bool = False  # in backward: the op's autograd node returns here, and what it saves goes (default: last)


@dataclass(frozen=True)
class Op:
    """One op of a layer: where it runs (the probe's module path below the layer's), its forward and backward steps,
    and the ledger's records it keeps for backward (`saves`: freed when its autograd node returns, unless an op before
    it, whose backward runs later, keeps them too).

    A collective is a step like any other (its output buffer is what it makes). Not fields yet, for want of a walk
    that needs them: a TP style and a recomputation region (a wrapper that reruns its ops' forward steps at the start
    of their backward); the first description that needs them adds them here.
    """

    where: str
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]
    saves: tuple[SavedTensor, ...] = ()


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
    _kept_by: dict[str, int] = field(default_factory=dict)  # saved name -> index of the first op that keeps it
    _releases: dict[int, tuple[str, ...]] = field(default_factory=dict)  # op index -> the tape names it frees

    def kept(self, tensor: SavedTensor) -> str:
        """A saved tensor's tape name."""
        return kept_name(self.prefix, tensor)

    def forward(self, ops: tuple[Op, ...]) -> None:
        if not self._kept_by:
            self._first_keepers(ops)
        for op in ops:
            for step in op.forward:
                self._step(step, op, "forward")

    def _first_keepers(self, ops: tuple[Op, ...]) -> None:
        """Each saved tensor's first keeper: its backward runs last, and the tensor goes when it returns."""
        for i, op in enumerate(ops):
            for x in op.saves:
                self._kept_by.setdefault(x.name, i)

    def backward(self, ops: tuple[Op, ...]) -> None:
        """The ops' backward, last op first. Without a forward walked first (a layer rerun inside backward by full
        recomputation), the first op that keeps each saved tensor is found here. One walk serves several layers of
        the same ops (`module` set to each in turn): that is found once."""
        if not self._kept_by:
            self._first_keepers(ops)
        for i in reversed(range(len(ops))):
            op = ops[i]
            returns = next((j for j, x in enumerate(op.backward) if x.returns), len(op.backward) - 1)
            for j, step in enumerate(op.backward):
                self._step(step, op, "backward")
                if j == returns:
                    self._release(op, i)
            if not op.backward:
                self._release(op, i)

    def _release(self, op: Op, i: int) -> None:
        """What op i saves goes, unless an op before it (whose backward runs later) keeps it too (found once per op:
        one walk serves every layer, and a MoE layer has thousands of ops)."""
        if i not in self._releases:
            self._releases[i] = tuple(self.kept(x) for x in op.saves if self._kept_by.get(x.name) == i)
        self.tape.drop(*self._releases[i])

    def _step(self, step: Step, op: Op, phase: str) -> None:
        where = ".".join(x for x in (self.module, op.where) if x)
        category = ACTIVATIONS if phase == "forward" else TEMPORARIES
        for x in step.makes:
            if x.keeps is not None and x.keeps.name not in self.saved:
                continue  # not kept under these sizes (the ledger's size rules)
            nbytes = self.saved[x.keeps.name] if x.keeps is not None else x.bytes
            self.tape.add(x.name, x.category or category, nbytes, x.why)
        if step.makes:
            self.tape.mark(phase, where, step.what)
        self.tape.drop(*step.frees)
        for name in step.hands_over:
            self.hand_over(where, name, self.tape.live[name].bytes)


def kept_name(prefix: str, tensor: SavedTensor) -> str:
    """The tape name of a saved tensor of the layer (or model end) `prefix` names: "layers.0/ln1/rstd_fp32"."""
    return f"{prefix}/{tensor.name}" if prefix else tensor.name


def kept(prefix: str, tensor: SavedTensor, why: str = "kept for backward (the ledger)") -> Made:
    """A saved tensor made by a step: sized by the ledger."""
    return Made(kept_name(prefix, tensor), 0, why, keeps=tensor)
