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
against them). torch's functional collectives, which DTensor's redistributions run (transformers' TP styles),
are logged below the API, as aten ops.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from memcalc.model.comm import Collective, Op, sent_bytes
from memcalc.model.ledger import Dim
from memcalc.probe import require_torch

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)
from torch.distributed import distributed_c10d as c10d  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# The wrapped API calls, what each is, and which of its arguments is the whole tensor (or list of its pieces).
_CALLS: dict[str, tuple[Op, int]] = {
    "all_reduce": (Op.ALL_REDUCE, 0),  # all_reduce(tensor)
    "all_gather_single": (Op.ALL_GATHER, 0),  # all_gather_single(output, input)
    "reduce_scatter_single": (Op.REDUCE_SCATTER, 1),  # reduce_scatter_single(output, input)
    "all_gather_into_tensor": (Op.ALL_GATHER, 0),  # megatron's SP gathers: (output, input)
    "reduce_scatter_tensor": (Op.REDUCE_SCATTER, 1),  # megatron's SP reduce-scatters: (output, input)
    "all_gather": (Op.ALL_GATHER, 0),  # (output pieces, input): megatron's gather of uneven token splits
    "reduce_scatter": (Op.REDUCE_SCATTER, 1),  # (output, input pieces)
    "all_to_all_single": (Op.ALL_TO_ALL, 1),  # (output, input, output_split_sizes, input_split_sizes)
}

# torch's functional collectives (what DTensor's redistributions run: transformers' TP styles), by aten name: what each
# is, and where its whole tensor is: "out" its result (the gathered tensor), else that argument.
_FUNCTIONAL: dict[str, tuple[Op, int | str]] = {
    "all_reduce": (Op.ALL_REDUCE, 0),  # (input, reduce_op, group_name)
    "all_gather_into_tensor": (Op.ALL_GATHER, "out"),  # (input, group_size, group_name)
    "reduce_scatter_tensor": (Op.REDUCE_SCATTER, 0),  # (input, reduce_op, group_size, group_name)
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
    ranks: int = 0  # the size of the group it ran over (0: the t the comparison is given)
    sent: int | None = None  # an all-to-all's bytes bound for the other ranks, from its split sizes

    def moved_bytes(self, t: int) -> int:
        """Bytes this rank sends for a collective (ring algorithm; an all-to-all: what its splits send
        away), or the message a send or recv moves."""
        if self.op in (SEND, RECV):
            return self.tensor_bytes
        if self.sent is not None:
            return self.sent
        return int(Op(self.op).share(self.ranks or t) * self.tensor_bytes)


class CollectiveLog:
    """Context manager: log every wrapped torch.distributed call made inside it, in order.

    `aliases`: modules that bound a wrapped function to a name of their own when imported (megatron's
    mappings and layers keep `dist_all_gather_func = torch.distributed.all_gather_into_tensor`); each such
    name is wrapped too, and put back on exit.
    """

    def __init__(self, aliases: tuple[ModuleType, ...] = ()) -> None:
        self.phase = "forward"
        self._functional = _FunctionalLog(self)
        self.calls: list[LoggedCollective] = []
        self._originals: dict[str, Callable] = {}
        self._aliases = aliases
        self._rebound: list[tuple[ModuleType, str, Callable]] = []

    def __enter__(self) -> CollectiveLog:
        for name, (op, arg) in _CALLS.items():
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._wrapped(self._originals[name], op.value, arg))
            self._rebind(self._originals[name], getattr(dist, name))
        for name, kind in _P2P_CALLS.items():
            self._originals[name] = getattr(dist, name)
            wrapped = self._wrapped(self._originals[name], kind, 0)
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)
        self._functional.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._functional.__exit__(*exc_info)
        for name, original in self._originals.items():
            setattr(dist, name, original)
            if name in _P2P_CALLS:
                setattr(c10d, name, original)
        for module, name, original in self._rebound:
            setattr(module, name, original)
        self._originals.clear()
        self._rebound.clear()

    def _rebind(self, original: Callable, wrapped: Callable) -> None:
        """Wrap each alias of `original` in the `aliases` modules."""
        for module in self._aliases:
            for name, value in list(vars(module).items()):
                if value is original:
                    self._rebound.append((module, name, original))
                    setattr(module, name, wrapped)

    def _wrapped(self, original: Callable, op: str, arg: int) -> Callable:
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            if op in (SEND, RECV):  # p2p calls name the message `tensor`
                whole = args[arg] if len(args) > arg else kwargs["tensor"]
                self.calls.append(LoggedCollective(op, self.phase, _nbytes(whole)))
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            whole, group = list(bound.values())[arg], bound.get("group")
            sent = _all_to_all_sent(bound, group) if op == Op.ALL_TO_ALL.value else None
            self.calls.append(LoggedCollective(op, self.phase, _nbytes(whole), dist.get_world_size(group), sent))
            return original(*args, **kwargs)
        return call


class _FunctionalLog(TorchDispatchMode):
    """Logs torch's functional collectives into a CollectiveLog: DTensor redistributes through them, below the
    torch.distributed calls the log wraps."""

    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()
        self._log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            op, arg = _FUNCTIONAL[name]
            ranks = c10d._resolve_process_group(args[-1]).size()
            whole = out if arg == "out" else args[arg]
            self._log.calls.append(LoggedCollective(op.value, self._log.phase, _nbytes(whole), ranks))
        return out


def _nbytes(whole: Any) -> int:
    """A tensor's bytes, or the sum of a list of pieces (the list forms of all_gather and reduce_scatter)."""
    if isinstance(whole, (list, tuple)):
        return sum(_nbytes(x) for x in whole)
    return whole.numel() * whole.element_size()


def _all_to_all_sent(bound: dict[str, Any], group: Any) -> int:
    """all_to_all_single: the input's rows bound for the other ranks of the group, in bytes (even splits
    when none are given)."""
    x, ranks = bound["input"], dist.get_world_size(group)
    splits = bound.get("input_split_sizes")
    rows = list(splits) if splits is not None and len(splits) else [x.shape[0] // ranks] * ranks
    row_bytes = x[0].numel() * x.element_size() if x.shape[0] else 0
    return int(sum(rows) - rows[dist.get_rank(group)]) * row_bytes  # split sizes may come as numpy integers


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
    predicted: tuple[Collective, ...], sizes: dict[Dim, int], t: int, width: int, logged: tuple[LoggedCollective, ...],
    ep: int = 1,
) -> tuple[CommRow, ...]:
    """The ledger's collectives and the issued ones, in order; bytes sent under the ring algorithm for both
    (for a point-to-point call, its message's bytes; for an all-to-all, what leaves for other ranks)."""
    want = [(c.name, (c.op.value, c.phase, sent_bytes(c, sizes, t, width, ep))) for c in predicted]
    got = [(x.op, x.phase, x.moved_bytes(t)) for x in logged]
    rows = [CommRow(name, p, got[i] if i < len(got) else None) for i, (name, p) in enumerate(want)]
    return tuple(rows + [CommRow("not in the ledger", None, g) for g in got[len(want):]])
