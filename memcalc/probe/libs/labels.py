"""Ledger names for tensors made inside a library's own code, which the probe cannot edit.

How rules name what a library's own code makes: docs/probe.md, "Naming a library's tensors".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable, Sequence

from memcalc.model import ledger
from memcalc.model.impls.base import Implementation
from memcalc.model.ledger import Region, SavedTensor
from memcalc.probe import require_torch
from memcalc.probe.recorder import SavedStorage, label

torch = require_torch()
from torch.overrides import TorchFunctionMode  # noqa: E402  (after the install check above)


@dataclass(frozen=True)
class Rule:
    """Which tensor, made where, is which ledger entry."""

    module: str  # fnmatch pattern on the innermost running module's name under the root ("" is the root)
    function: str  # __name__ of the torch function or tensor method called there (an aten op's name), or "forward"
    tensor: SavedTensor
    nth: int | None = 0  # which matching call in one forward of that module (None: every one)
    every: int | None = None  # a loop's body: the nth of each `every` matching calls (an expert's two linears)
    arg: int | str | None = None  # None: the result (a tuple's `output`-th tensor); int or keyword: that argument
    output: int = 0  # which tensor of a tuple result: 0 the first, 1 an aten op's second (its rstd, its lse)
    view: Callable[[Any], Any] | None = None  # the tensor as a view in the ledger's axis order, for its shape


@dataclass
class _Frame:
    """One running forward call of a module: its name and how often each function was called in it."""

    name: str
    calls: Counter = field(default_factory=Counter)


class ModuleFrames:
    """Label the tensors `rules` pick out while `root` (and its submodules) run: which module runs is kept by hooks
    on each while inside (a `_Frame` each, the innermost last); a torch mode (`Labels`, or an aten dispatch mode) hands
    each call it sees to `_called`."""

    def __init__(self, root: torch.nn.Module, rules: Sequence[Rule]) -> None:
        super().__init__()
        self._root, self._rules = root, tuple(rules)
        self._stack: list[_Frame] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Any:
        for name, module in self._root.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._entered(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._left, with_kwargs=True))
        return super().__enter__()

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _called(self, function: str, args: tuple, kwargs: dict, result: Any) -> Any:
        """Label what the rules name in a call made inside a module; its result, passed on."""
        if self._stack:
            self._match(self._stack[-1], function, args, kwargs, result)
        return result

    def _entered(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._stack.append(frame := _Frame(name))
            self._match(frame, "forward", args, kwargs, None, output=False)
        return hook

    def _left(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """A module's forward hook, every module's the same: leave its frame, labelling its output."""
        self._match(self._stack.pop(), "forward", args, kwargs, output, output=True)

    def _match(
        self, frame: _Frame, function: str, args: tuple, kwargs: dict, result: Any, output: bool | None = None
    ) -> None:
        """Label what each rule for this call names; count the call (a forward counts once, on entry)."""
        nth = frame.calls[function]
        if output is not True:
            frame.calls[function] += 1
        for rule in self._rules:
            if rule.function != function or not fnmatchcase(frame.name, rule.module):
                continue
            position = nth if output is None else 0  # in a loop's body of `every` calls, the nth in the body
            if rule.nth is not None and rule.nth != (position % rule.every if rule.every else position):
                continue
            if output is not None and output != (rule.arg is None):
                continue  # a forward's input rules apply on entry, its output rules on exit
            target = _pick(result, args, kwargs, rule.arg, rule.output)
            named = rule.view(target) if rule.view and isinstance(target, torch.Tensor) else target
            if isinstance(named, torch.Tensor):  # a view may find nothing to name (None)
                label(named, rule.tensor)


class Labels(ModuleFrames, TorchFunctionMode):
    """Context manager: label the tensors `rules` pick out of torch's functions and tensor methods."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        return self._called(getattr(func, "__name__", ""), args, kwargs, func(*args, **kwargs))


def _pick(result: Any, args: tuple, kwargs: dict, arg: int | str | None, output: int) -> Any:
    """The result (a tuple's `output`-th tensor), or the positional or keyword argument `arg`."""
    if arg is None:
        if not isinstance(result, tuple):
            return result
        tensors = [x for x in result if isinstance(x, torch.Tensor)]
        return tensors[output] if output < len(tensors) else None
    if isinstance(arg, int):
        return args[arg] if arg < len(args) else None
    return kwargs.get(arg)


SDPA = "scaled_dot_product_attention"  # torch's function, as rules name it


def sdpa_inputs(module: str) -> tuple[Rule, ...]:
    """Q, K and V as `module` passes them to SDPA, whose flash kernel keeps them as they are."""
    return tuple(Rule(module, SDPA, x, arg=i) for i, x in enumerate((ledger.Q, ledger.K, ledger.V)))


def head_columns(d: int) -> Callable[[Any], Any]:
    """A rule's view: (b, s, heads * d) as (b, s, heads, d), a heads or under tp this rank's a/t (a fused QKV output,
    the output projection's input)."""
    return lambda x: x.unflatten(-1, (-1, d))


def statistics(x: Any) -> Any:
    """A rule's view: (b, s, 1) per-token statistics (a norm's rstd, a routing weight) as (b, s)."""
    return x.squeeze(-1)


def merged_rows(saved: tuple[SavedStorage, ...], impl: Implementation) -> tuple[SavedStorage, ...]:
    """The storages of each tensor `impl` keeps per expert (Region.EXPERT: one storage an expert) as one row, where
    the first is: the sum of their bytes and rows, so that a ledger row of r token slots reads as the experts'
    storages together."""
    names = {name for name, x in impl.by_name().items() if x.region is Region.EXPERT}
    rows: dict[str | int, SavedStorage] = {}  # keyed by name where merged, else by position
    for i, storage in enumerate(saved):
        key = storage.name if storage.name in names else i
        known = rows.get(key)
        rows[key] = storage if known is None else SavedStorage(
            storage.name, known.nbytes + storage.nbytes, (known.shape[0] + storage.shape[0], *known.shape[1:]),
            storage.dtype)
    return tuple(rows.values())


Part = tuple[SavedTensor, int, tuple[int, ...]]  # a ledger tensor, its share of a storage's columns, its shape


def split_rows(saved: tuple[SavedStorage, ...], splits: dict[str, tuple[Part, ...]],
               halves: dict[str, tuple[SavedTensor, SavedTensor]]) -> tuple[SavedStorage, ...]:
    """The storages as ledger rows: a marker of `splits` as its tensors, each its share of the bytes; a marker of
    `halves` (gate and up side by side) as its two tensors, the first and second half of each row."""
    rows: list[SavedStorage] = []
    for storage in saved:
        parts = splits.get(storage.name or "")
        if storage.name in halves:
            half = (*storage.shape[:-1], storage.shape[-1] // 2)
            parts = tuple((x, 1, half) for x in halves[storage.name])
        if parts is None:
            rows.append(storage)
            continue
        columns = sum(share for _, share, _ in parts)
        rows += [SavedStorage(tensor.name, storage.nbytes * share // columns, shape, storage.dtype)
                 for tensor, share, shape in parts]
    return tuple(rows)
