"""The three ways of laying a layer over t GPUs, as plans over the ledger.

A strategy does not list tensors. Its plan is region defaults (SEED.md section
3): TP splits the tensors inside the column/row-parallel pair along heads, K/V
groups, MLP width, hidden or vocabulary; SP splits the tensors outside it along
the sequence. On top of the defaults a plan may carry per-tensor overrides, as
torchtitan's parallelize plans name modules one by one: `planned(impl)` adds
those an implementation needs (a column-parallel input that DTensor keeps
gathered under SP, a module the library's TP plan does not shard), and the
forms an implementation keeps a tensor in under this layout only (megatron's
KV latent, a view of a wider output unless SP's scatter copies it): `kept`
puts them in their namesakes' place. Code outside this module asks a strategy
what it does (`tensor_parallel`, `sequence_parallel`, `split_dim`, `kept`),
never which regions it splits.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from memcalc.model.ledger import Dim, Region, SavedTensor
from memcalc.records import record

if TYPE_CHECKING:
    from memcalc.model.impls.base import Implementation

# In the TP region the first of these that a tensor has is the one split by t.
_TP_SPLIT_DIMS = (Dim.V, Dim.A, Dim.G, Dim.QKV, Dim.F, Dim.U, Dim.H)


@record
class Strategy:
    """A parallel layout: its CLI name, a title, the regions it splits by t, and per-tensor overrides."""

    name: str
    title: str
    splits: frozenset[Region]
    overrides: tuple[tuple[str, Dim | None], ...] = ()  # (tensor name, the dim it splits, or None: whole)
    forms: tuple[SavedTensor, ...] = ()  # what this layout keeps in place of the same-named tensors

    @property
    def tensor_parallel(self) -> bool:
        """Weights and the tensors between the column- and row-parallel linears are split by t."""
        return Region.TENSOR in self.splits

    @property
    def sequence_parallel(self) -> bool:
        """The tensors outside the pair are split along the sequence (so t must divide s)."""
        return Region.SEQUENCE in self.splits

    def weight_shards(self, t: int) -> int:
        """How many ways the column/row-parallel weights are split: t under TP, else 1."""
        return t if self.tensor_parallel else 1

    def split_dim(self, tensor: SavedTensor) -> Dim | None:
        """The dimension of `tensor` that this plan divides by t, if any."""
        for name, dim in self.overrides:
            if name == tensor.name:
                return dim
        if tensor.region not in self.splits and not (tensor.region is Region.EXPERT and self.tensor_parallel):
            return None
        if tensor.region is Region.SEQUENCE:  # its tokens: s, or the token-expert slots they keep
            return Dim.S if Dim.S in tensor.shape else Dim.RS
        if tensor.region is Region.EXPERT:  # r is per rank already; expert TP (etp = t) splits the expert width
            return Dim.FE if Dim.FE in tensor.shape else None
        return next(d for d in tensor.shape if d in _TP_SPLIT_DIMS)

    def kept(self, tensors: Iterable[SavedTensor]) -> tuple[SavedTensor, ...]:
        """`tensors` as this layout keeps them: a form the plan names takes its namesake's place in its region (a
        size condition's whole copy of the namesake, replicated, keeps its own form)."""
        forms = {x.name: x for x in self.forms}
        return tuple(f if (f := forms.get(x.name)) is not None and f.region is x.region else x for x in tensors)

    def planned(self, impl: Implementation, knobs: Any) -> Strategy:
        """This layout as `impl` runs `knobs`: under TP, the tensors its TP plan leaves unsharded stay whole and those
        it splits otherwise (`splits`) are split so; under SP, the tensors the plan keeps gathered stay whole too, and
        the tensors it keeps in another form (`sequence_parallel_forms`) are kept in that form."""
        if not self.tensor_parallel:
            return self
        tp_plan = impl.tp_plan(knobs)
        whole, splits = tp_plan.unsharded(), impl.splits(knobs)
        forms: tuple[SavedTensor, ...] = ()
        if self.sequence_parallel:
            whole |= tp_plan.kept_whole()
            forms = tuple(x for x in impl.sequence_parallel_forms(knobs) if x not in self.forms)
        overrides = self.overrides + tuple(x for x in splits if x not in self.overrides)
        overridden = {name for name, _ in overrides}
        pinned = tuple((name, None) for name in sorted(whole - overridden))
        changed = pinned or forms or overrides != self.overrides
        return replace(self, overrides=overrides + pinned, forms=self.forms + forms) if changed else self


NONE = Strategy("none", "no parallelism", frozenset())
TP = Strategy("tp", "tensor parallel", frozenset({Region.TENSOR}))
TP_SP = Strategy("tp-sp", "tensor + sequence parallel", frozenset({Region.TENSOR, Region.SEQUENCE}))

STRATEGIES: dict[str, Strategy] = {s.name: s for s in (NONE, TP, TP_SP)}
