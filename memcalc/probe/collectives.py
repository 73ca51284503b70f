"""Count the collectives a layer really issues, at the process-group API, not in the model.

While a `CollectiveLog` is active, torch.distributed's all_reduce, all_gather_single and reduce_scatter_single are
wrapped: each call is logged with its kind, pass (`log.phase`) and the bytes of the whole tensor it collects (the ring's
per-rank share follows, memcalc.model.comm.Op.share). Point-to-point calls are logged one message each, "send" or
"recv", wrapped in torch.distributed's own module too because batch_isend_irecv looks them up there. torch's functional
collectives, which DTensor's redistributions run (transformers' TP styles), are logged below the API, as aten ops.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from memcalc.model.comm import Collective, Op, sent_bytes
from memcalc.model.ledger import Dim
from memcalc.probe import require_torch
from memcalc.probe.shims import patched

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
    "all_to_all": (Op.ALL_TO_ALL, 1),  # (output pieces, input pieces): spmd_types' exchanges (torchtitan's EP)
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
        """Bytes this rank sends: a collective's ring share, an all-to-all's split rows, a send's or recv's message."""
        if self.op in (SEND, RECV):
            return self.tensor_bytes
        if self.sent is not None:
            return self.sent
        return int(Op(self.op).share(self.ranks or t) * self.tensor_bytes)


class CollectiveLog:
    """Context manager: log every wrapped torch.distributed call made inside it, in order; `aliases` are modules
    that bound a wrapped function to a name of their own (megatron's `dist_all_gather_func`), wrapped too and put back
    on exit."""

    def __init__(self, aliases: tuple[ModuleType, ...] = ()) -> None:
        self.phase = "forward"
        self.calls: list[LoggedCollective] = []
        self._aliases = aliases

    def __enter__(self) -> CollectiveLog:
        self._patches = ExitStack()
        for name, (op, arg) in _CALLS.items():
            original = getattr(dist, name)
            wrapped = self._wrapped(original, op.value, arg)
            aliases = [(m, alias) for m in self._aliases for alias, value in vars(m).items() if value is original]
            for module, alias in [(dist, name), *aliases]:
                self._patches.enter_context(patched(module, **{alias: wrapped}))
        for name, kind in _P2P_CALLS.items():
            wrapped = self._wrapped(getattr(dist, name), kind, 0)
            for module in (dist, c10d):
                self._patches.enter_context(patched(module, **{name: wrapped}))
        self._patches.enter_context(_FunctionalLog(self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._patches.__exit__(*exc_info)  # the functional log first, then every attribute back as it was

    def backward(self, y: torch.Tensor, into: list[LoggedCollective] | None = None) -> None:
        """y's backward from a gradient of ones, logged as the backward phase; then every call the log holds (forward's
        and backward's) appended to `into`, where a runner's caller asks for them."""
        self.phase = "backward"
        y.backward(torch.ones_like(y))
        if into is not None:
            into.extend(self.calls)

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
    """all_to_all_single: the bytes of the input's rows bound for the group's other ranks (even splits if unsaid)."""
    x, ranks = list(bound.values())[1], dist.get_world_size(group)  # all_to_all_single's input, all_to_all's pieces
    if isinstance(x, (list, tuple)):  # all_to_all: one piece for each rank
        return sum(_nbytes(piece) for i, piece in enumerate(x) if i != dist.get_rank(group))
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
