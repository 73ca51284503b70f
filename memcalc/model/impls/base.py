"""What an implementation is: the rules one library's code follows when it keeps tensors for backward.

The paper's ledger says what backward *needs*; a library decides what it
*keeps*: an fp32 copy here, K and V expanded to every head there, a gathered
input where Megatron keeps a shard. An implementation is one module under
`memcalc.model.impls` that declares the tensors only its library keeps and the
function that lists, for a knob set, every tensor one layer keeps, in forward
order. How a layout splits each tensor stays with the layout
(`memcalc.model.strategy`); an implementation only names the tensors that a
sequence-parallel layout keeps gathered, as torchtitan's DTensor plan does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from memcalc.model import ledger
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import SavedTensor


def _accept_all(knobs: Any) -> None:
    """Every knob value runs."""


@dataclass(frozen=True)
class SizeRule:
    """A kernel that runs only for some sizes; outside them the layer keeps `outside` instead.

    `runs` works on numbers and on numpy arrays alike (sweeps evaluate it over a grid);
    symbolic formulas assume the kernel runs and say so.
    """

    what: str
    applies: Callable[[Any], bool]  # the knobs under which the sizes matter
    runs: Callable[[dict[Any, Any], Any], Any]  # (per-rank sizes by Dim, t) -> bool or bool array
    outside: Callable[[Any, Accounting], tuple[SavedTensor, ...]]


@dataclass(frozen=True)
class Implementation:
    """One library's rules: which tensors a layer keeps, and which layouts and knobs it runs."""

    name: str  # the --impl value
    title: str
    measured_on: str  # the library, its version and the modules the rules were measured on
    layer_tensors: Callable[[Any, Accounting], tuple[SavedTensor, ...]]  # one layer, forward order
    strategies: tuple[str, ...] = ("none", "tp", "tp-sp")  # the layouts the library runs
    kept_whole: frozenset[str] = frozenset()  # tensors a sequence-splitting layout keeps gathered (full s)
    check: Callable[[Any], None] = _accept_all  # ConfigError for knob values the library cannot run
    defaults: dict[str, Any] = field(default_factory=dict)  # the library's own knob values, where not the seed's
    tensors: tuple[SavedTensor, ...] = ()  # the tensors only this library keeps (or describes its own way)
    size_rule: SizeRule | None = None  # where what is kept depends on the sizes, not only the knobs

    def by_name(self) -> dict[str, SavedTensor]:
        """Every tensor this implementation can name: the ledger's, with its own in their place where they differ."""
        return ledger.BY_NAME | {x.name: x for x in self.tensors}


def drop_small(tensors: Iterable[SavedTensor], accounting: Accounting) -> tuple[SavedTensor, ...]:
    """The paper's accounting leaves out the small terms (`paper=False`); exact accounting keeps all."""
    return tuple(t for t in tensors if accounting.exact or t.paper)
