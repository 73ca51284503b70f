"""Count what autograd really keeps for backward, storage by storage, under ledger names.

A `SavedTensorRecorder` sees every tensor autograd saves through a saved-tensor pack hook and counts each storage
once, at its full size; `label` names a tensor after its ledger entry. Why storages, why labels made without
gradients are ignored, and what `kept_only` leaves out: docs/probe.md, "How it measures".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from memcalc.errors import ProbeError
from memcalc.model.ledger import SavedTensor
from memcalc.probe import require_torch

torch = require_torch()

_active: list[SavedTensorRecorder] = []  # the recorders in effect, innermost last


@dataclass(frozen=True)
class SavedStorage:
    """One storage autograd kept for backward: plain values, so results pickle across processes."""

    name: str | None  # the ledger name it was labelled with, None if unlabelled
    nbytes: int
    shape: tuple[int, ...]  # the labelled view's shape, or the saved tensor's if unlabelled
    dtype: str


def label(tensor: torch.Tensor, saved: SavedTensor, in_function: bool = False) -> None:
    """Name the storage under `tensor` (a view in the ledger's axis order: its shape is reported) after the
    ledger entry `saved`, for the active recorder. Tensors made without autograd are never saved, so not labelled;
    `in_function` is for an autograd Function's forward (autograd off): the caller says whether it was on outside."""
    if _active and (in_function or torch.is_grad_enabled()):
        _active[-1].add_label(tensor, saved)


def batch_first(x: torch.Tensor) -> torch.Tensor:
    """A sequence-first (s, b, ...) tensor as a (b, s, ...) view: the ledger's axis order, for labels."""
    return x.transpose(0, 1)


class HeldBy(torch.autograd.Function):
    """forward: x itself, holding `held` for backward, so that the recorder counts them as long as x's node lives;
    backward: dx as it came, and `held` goes."""

    @staticmethod
    def forward(ctx, x, *held):
        ctx.save_for_backward(*held)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(None for _ in ctx.saved_tensors))


class SavedTensorRecorder:
    """Context manager: every storage saved for backward inside it, deduplicated and labelled."""

    def __init__(self, parameters: Iterable[torch.Tensor] = (), kept_only: bool = False) -> None:
        self._parameters = tuple(parameters)  # held, so that their storages' keys stay theirs
        self._kept_only = kept_only
        self._savers: dict[int, list[weakref.ref]] = {}  # storage key -> what each node that saved it holds
        self._parameter_storages = {_storage_key(p) for p in self._parameters}
        self._saved: dict[int, torch.Tensor] = {}  # storage key -> first saved tensor using it
        # Labels hold their tensor until the recorder closes, so no storage's key is
        # reused for another storage while labels and saved storages are being matched.
        self._labels: dict[int, tuple[str, torch.Tensor]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self.saved: tuple[SavedStorage, ...] = ()

    def __enter__(self) -> SavedTensorRecorder:
        _active.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)
        _active.remove(self)
        self.saved = tuple(self._describe(key, tensor) for key, tensor in self._saved.items() if self._kept(key))
        self._saved.clear()
        self._savers.clear()
        self._labels.clear()
        self._parameters = ()

    def add_label(self, tensor: torch.Tensor, saved: SavedTensor) -> None:
        """Name the storage under `tensor`; one storage under two ledger names is a bug in the layer."""
        key = _storage_key(tensor)
        known = self._labels.get(key)
        if known is not None and known[0] != saved.name:
            raise ProbeError(f"one storage labelled both {known[0]} and {saved.name}: the probe's layer has a bug")
        self._labels[key] = (saved.name, tensor)

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = _storage_key(tensor)
        if key in self._parameter_storages:
            return tensor
        self._saved.setdefault(key, tensor)
        if not self._kept_only:
            return tensor  # unchanged: backward must still work
        packed = _Packed(tensor)  # held by the saving node alone: it dies with the node
        self._savers.setdefault(key, []).append(weakref.ref(packed))
        return packed

    def _kept(self, key: int) -> bool:
        """Whether a node that saved the storage still holds it (always, unless kept_only)."""
        return not self._kept_only or any(ref() is not None for ref in self._savers[key])

    def _describe(self, key: int, tensor: torch.Tensor) -> SavedStorage:
        name, labelled = self._labels.get(key, (None, tensor))
        storage = local(tensor).untyped_storage()
        shape = tuple(local(labelled).shape)
        return SavedStorage(name, storage.nbytes(), shape, str(tensor.dtype).removeprefix("torch."))


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of the storage under `tensor`: its StorageImpl's address, not the data's (every meta or
    empty tensor has data_ptr() 0); unique while the storage lives, which the recorder ensures by holding it."""
    return local(tensor).untyped_storage()._cdata


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's own local shard, the storage this rank holds (DTensor TP plans save DTensors, transformers' TP
    plans make DTensor weights); else the tensor. Not to_local(), which gives a Parameter's shard as a view of it."""
    return getattr(tensor, "_local_tensor", None) if type(tensor).__name__ == "DTensor" else tensor


class _Packed:
    """A saved tensor as the saving node holds it under kept_only, so that the recorder can tell when it is freed."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Packed) else packed
