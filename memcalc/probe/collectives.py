"""Count the collectives a layer really issues, at the process-group API, not in the model.

While a `CollectiveLog` is active, torch.distributed's all_reduce,
all_gather_single and reduce_scatter_single (the calls the probe's f, f*, g, g*
and column-parallel linears make) are wrapped: each call is logged with its
kind, the pass it ran in (`log.phase`, which the runner sets around forward and
backward) and the bytes of the whole tensor it collects: the all-reduced
tensor, the all-gather's output, the reduce-scatter's input. The bytes a rank
then sends under the ring algorithm follow from those (memcalc.model.comm.Op.share).
Under torch's fake process group the calls are logged as well; no data moves.

Point-to-point calls (isend, irecv, send, recv: what the overlapped rings of
overlap.py issue, batch_isend_irecv included) are logged one message each, as
"send" or "recv" with the message's bytes. A send's bytes are what the rank
sends: no ring share applies, as it does to a collective's tensor. They are wrapped in
torch.distributed's own module as well as its namespace, because
batch_isend_irecv looks isend and irecv up there (and checks its P2POps' ops
against them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from memcalc.model.comm import Collective, Op, sent_bytes
from memcalc.model.ledger import Dim
from memcalc.probe import require_torch

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)
from torch.distributed import distributed_c10d as c10d  # noqa: E402

# The wrapped API calls, what each is, and which of its arguments is the whole tensor.
_CALLS: dict[str, tuple[Op, int]] = {
    "all_reduce": (Op.ALL_REDUCE, 0),  # all_reduce(tensor)
    "all_gather_single": (Op.ALL_GATHER, 0),  # all_gather_single(output, input)
    "reduce_scatter_single": (Op.REDUCE_SCATTER, 1),  # reduce_scatter_single(output, input)
}

SEND, RECV = "send", "recv"  # a point-to-point message, as logged
# The wrapped point-to-point calls; the message is each one's first argument, `tensor`.
_P2P_CALLS = {"isend": SEND, "send": SEND, "irecv": RECV, "recv": RECV}


@dataclass(frozen=True)
class LoggedCollective:
    """One call: plain values, so it pickles home from a worker."""

    op: str  # Op's value, or SEND or RECV
    phase: str  # "forward" or "backward"
    tensor_bytes: int  # the whole collected tensor; a point-to-point call's message

    def moved_bytes(self, t: int) -> int:
        """Bytes this rank sends for a collective (ring algorithm), or the message a send or recv moves."""
        if self.op in (SEND, RECV):
            return self.tensor_bytes
        return int(Op(self.op).share(t) * self.tensor_bytes)


class CollectiveLog:
    """Context manager: log every wrapped torch.distributed call made inside it, in order."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.calls: list[LoggedCollective] = []
        self._originals: dict[str, Callable] = {}

    def __enter__(self) -> CollectiveLog:
        for name, (op, arg) in _CALLS.items():
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrapped(self._originals[name], op.value, arg))
        for name, kind in _P2P_CALLS.items():
            self._originals[name] = getattr(dist, name)
            wrapped = self._wrapped(self._originals[name], kind, 0)
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
            if name in _P2P_CALLS:
                setattr(c10d, name, original)
        self._originals.clear()

    def _wrapped(self, original: Callable, op: str, arg: int) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            whole = args[arg] if len(args) > arg else kwargs["tensor"]  # p2p calls name it `tensor`
            self.calls.append(LoggedCollective(op, self.phase, whole.numel() * whole.element_size()))
            return original(*args, **kwargs)
        return call


@dataclass(frozen=True)
class CommRow:
    """One collective: the ledger's next to the one the layer issued at the same place (None: missing)."""

    name: str
    predicted: tuple[str, str, int] | None  # (op, phase, bytes one rank sends; a send's or recv's message)
    measured: tuple[str, str, int] | None

    @property
    def matches(self) -> bool:
        return self.predicted == self.measured


def compare_collectives(
    predicted: tuple[Collective, ...], sizes: dict[Dim, int], t: int, width: int, logged: tuple[LoggedCollective, ...]
) -> tuple[CommRow, ...]:
    """The ledger's collectives and the issued ones, in order; bytes sent under the ring algorithm for both
    (for a point-to-point call, its message's bytes)."""
    want = [(c.name, (c.op.value, c.phase, sent_bytes(c, sizes, t, width))) for c in predicted]
    got = [(x.op, x.phase, x.moved_bytes(t)) for x in logged]
    rows = [CommRow(name, p, got[i] if i < len(got) else None) for i, (name, p) in enumerate(want)]
    return tuple(rows + [CommRow("not in the ledger", None, g) for g in got[len(want):]])
