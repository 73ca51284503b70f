"""The three ways of laying a layer over t GPUs, as rules over the ledger's regions.

A strategy does not list tensors; it says which regions of the layer it splits
by t (SEED.md section 3). Which dimension of a tensor gets split follows from
the region: TP splits heads (or K/V groups, MLP width, hidden) inside the
column/row-parallel pair, SP splits the sequence outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.model.ledger import Dim, Region, SavedTensor

# In the TP region the first of these that a tensor has is the one split by t.
_TP_SPLIT_DIMS = (Dim.A, Dim.G, Dim.F, Dim.H)


@dataclass(frozen=True)
class Strategy:
    """A parallel layout: its CLI name, a title, and the regions it splits by t."""

    name: str
    title: str
    splits: frozenset[Region]

    def split_dim(self, tensor: SavedTensor) -> Dim | None:
        """The dimension of `tensor` that this strategy divides by t, if any."""
        if tensor.region not in self.splits:
            return None
        if tensor.region is Region.SEQUENCE:
            return Dim.S
        return next(d for d in tensor.shape if d in _TP_SPLIT_DIMS)


NONE = Strategy("none", "no parallelism", frozenset())
TP = Strategy("tp", "tensor parallel", frozenset({Region.TENSOR}))
TP_SP = Strategy("tp-sp", "tensor + sequence parallel", frozenset({Region.TENSOR, Region.SEQUENCE}))

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (NONE, TP, TP_SP)}

