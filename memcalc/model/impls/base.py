"""What an implementation is: the rules one library's code follows when it keeps tensors for backward.

The paper's ledger says what backward *needs*; a library decides what it *keeps*: an fp32 copy here, K and V
expanded to every head there, a gathered input where Megatron keeps a shard. Each module under `memcalc.model.impls`
declares the tensors only its library keeps, the function that lists every tensor one layer keeps in forward order,
and its TP plan (`memcalc.model.tp_plan`); how a layout splits each tensor stays with the layout
(`memcalc.model.strategy`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Callable, Iterable

from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.knobs import BY_NAME as KNOB_NAMES, DTYPE_BYTES, Accounting
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import STRATEGIES
from memcalc.model.tp_plan import TPPlan
from memcalc.records import record


def _accept_all(knobs: Any) -> None:
    """Every knob value runs."""


def check_grouped_mm(config: Any, impl: str, whose: str, advice: str = "", t: int | None = None) -> None:
    """torch._grouped_mm takes only strides of whole 16-byte runs (aten's GroupedMMUtils.h,
    check_valid_strides_and_return_transposed, on the CPU and CUDA alike): h and each rank's expert width e/t must be
    multiples of 16 bytes' worth of elements. `whose`: the library's path that runs it; `advice`: a way out; `t`: the
    split of the expert width (config.t unless given)."""
    run, t = 16 // DTYPE_BYTES[config.dtype], config.t if t is None else t
    for name, value in (("h", config.h), (f"moe_ffn_hidden_size/t={config.expert_ffn}/{t}", config.expert_ffn // t)):
        if value % run:
            raise ConfigError(f"impl {impl}: {name}={value} is not a multiple of {run}: torch._grouped_mm ({whose})"
                              f" needs strides of whole 16-byte runs in {config.dtype}{advice}")


@record
class SizeRule:
    """A kernel that runs only for some sizes; outside them the layer keeps `outside` instead.

    `runs` works on numbers and on numpy arrays alike (sweeps evaluate it over a grid);
    symbolic formulas hold where the kernel runs, and `outside` gives those that hold elsewhere.
    """

    what: str
    applies: Callable[[Any], bool]  # the knobs under which the sizes matter
    runs: Callable[[dict[Any, Any], Any], Any]  # (per-rank sizes by Dim, t) -> bool or bool array
    outside: Callable[[Any, Accounting], tuple[SavedTensor, ...]]
    shown_with: dict[str, Any] = field(default_factory=dict)  # knobs the docs add to eager bf16 to show `outside`
    # (per-rank sizes by Dim, t) -> which of the kernel's conditions the sizes miss, with their values, in words
    misses: Callable[[dict[Any, Any], int], str] | None = None
    runs_for: Callable[[Any], Callable[[dict[Any, Any], Any], Any]] | None = None  # the knobs pick `runs` (one rule,
    # several layers: transformers' GQA copies and GPT-NeoX's fused V differ in when they are views)
    # Each size `runs` is not monotone in, the others fixed: (period, edges). Within each piece (the first starting at
    # 1, the next at each edge) `runs` depends on it only through its residue mod period: where each class of it
    # is searched alone, its bytes grow with it (`memcalc fit`). A size not named here changes `runs` only at 1.
    pattern: dict[Any, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def runs_at(self, knobs: Any, sizes: dict[Any, Any], t: Any) -> Any:
        """Whether the kernel runs at these sizes, under the condition these knobs' layer has."""
        return (self.runs_for(knobs) if self.runs_for is not None else self.runs)(sizes, t)


def always(knobs: Any) -> bool:
    """Every knob set: a size condition's `applies` by default, and a refusal's `when` for a layout the library
    runs under no knobs: `plan` cites it when the layout is asked for by name, the implementation's page says it,
    and the commands that show every layout leave it out without a note (the library never runs it, so nothing
    about these knobs needs saying)."""
    return True


@record
class SizeCondition:
    """One tensor a layer keeps as written only at some sizes; elsewhere `instead` in its place (nothing if empty).

    Where a `SizeRule` swaps the set a kernel keeps, a condition touches one tensor: an edge of the
    sizes at which the library's own code takes another branch (no causal mask for one query) or
    a view stays a view (one K/V group per rank). `kept` works on numbers and numpy arrays alike.
    """

    tensor: SavedTensor
    what: str
    kept: Callable[[dict[Any, Any], Any], Any]  # (sizes by Dim, t: the layout's split) -> bool or bool array
    instead: tuple[SavedTensor, ...] = ()
    applies: Callable[[Any], bool] = always  # the knobs under which the sizes choose (elsewhere `tensor` is kept)


@record
class Refusal:
    """A layout the library does not run under some knobs, and why, in the library's own code.

    Declared as data on the implementation (`Implementation.refuses`): `plan` refuses the layout when asked for
    it by name, and the commands that show every layout leave it out and name it in one line.
    """

    strategy: str  # the layout's name (memcalc.model.strategy.STRATEGIES)
    when: Callable[[Any], bool]  # the knob sets under which the library does not run it (`always`: none runs it)
    condition: str  # `when` in words: "with experts (num_experts set)"
    reason: str  # why, short: what the library's code refuses
    source: str  # where: the library's version, file and function, and anything memcalc decides on top

    def cited(self) -> str:
        """The condition, the reason and its source, as the refusal of an explicit --strategy says them."""
        return f"{self.condition}: {self.reason} ({self.source})"


@record
class Rerun:
    """How a library's recomputation reruns a layer's forward collectives in backward (memcalc.model.comm)."""

    regions: frozenset[str] = frozenset({"full"})  # the recompute values whose rerun covers the layer's collectives
    # torch.utils.checkpoint, non-reentrant: backward first meets the nodes that save nothing (the output
    # collective's backward), and the first saved tensor it unpacks starts the rerun (a reentrant one reruns first)
    after_output: bool = False
    early_stop: bool = False  # the rerun stops at the last saved tensor, before the output collective (torch's default)


@record
class Implementation:
    """One library's rules: which tensors a layer keeps, and which layouts and knobs it runs."""

    name: str  # the --impl value
    title: str
    measured_on: str  # the library, its version and the modules the rules were measured on
    keeps: Callable[[Any, Accounting], tuple[SavedTensor, ...]]  # one layer, forward order, unless fully recomputed
    tp_plan: Callable[[Any], TPPlan]  # for a knob set, the library's TP plan of one layer (memcalc.model.tp_plan)
    rerun: Rerun = Rerun()
    refuses: tuple[Refusal, ...] = ()  # layouts it does not run under some knobs (or any: `always`), and why
    # For a config (its ep), the dimension a tensor-parallel layout splits by t in tensors the library's plan splits
    # otherwise than their region says, before what it keeps whole: torchtitan's experts, spread over the TP ranks
    splits: Callable[[Any], tuple[tuple[str, Any], ...]] = lambda config: ()
    # For a knob set, what a sequence-splitting layout keeps in place of the same-named tensors of `layer_tensors`
    # (another width or split); unlike a plan's gathered input, it changes no collective: backward gathers as before.
    sequence_parallel_forms: Callable[[Any], tuple[SavedTensor, ...]] = lambda knobs: ()
    check: Callable[[Any], None] = _accept_all  # ConfigError for knob values the library cannot run
    check_sizes: Callable[[Any], None] = _accept_all  # ConfigError for a config's sizes its kernels refuse
    # the library's own values, where not the seed's: knobs, and config fields such as biases and positions
    defaults: dict[str, Any] = field(default_factory=dict)
    tensors: tuple[SavedTensor, ...] = ()  # the tensors only this library keeps (or describes its own way)
    size_rule: SizeRule | None = None  # where what is kept depends on the sizes, not only the knobs
    size_conditions: tuple[SizeCondition, ...] = ()  # single tensors kept as written only at some sizes
    ends: tuple[SavedTensor, ...] = ()  # the model's end tensors it keeps its own way, for the ledger's of their names
    # For a knob set, how many copies of the model-wide tensors (ledger.SavedTensor.model_wide) a model chunk of
    # `layers` layers keeps (numbers or arrays): the model makes one for every layer that reads the same
    model_wide_copies: Callable[[Any, Any], Any] = lambda knobs, layers: 1

    def layer_tensors(self, knobs: Any, accounting: Accounting) -> tuple[SavedTensor, ...]:
        """Every tensor one layer keeps for backward, in forward order: under full recomputation the layer's input
        alone, which the checkpoint reruns the layer from in backward (every library's), else `keeps`."""
        if knobs.recompute == "full":
            return (ledger.LAYER_INPUT,)
        return self.keeps(knobs, accounting)

    def knob_defaults(self) -> dict[str, Any]:
        """The library's own knob values alone (what a knob set, without sizes or layout, takes)."""
        return {k: v for k, v in self.defaults.items() if k in KNOB_NAMES}

    def refusal(self, knobs: Any, strategy: str) -> Refusal | None:
        """Why the library does not run `strategy` for these knobs, if a declared refusal says so."""
        return next((r for r in self.refuses if r.strategy == strategy and r.when(knobs)), None)

    def runs(self, knobs: Any) -> tuple[str, ...]:
        """The layouts the library runs for these knobs, in the order of STRATEGIES."""
        return tuple(n for n in STRATEGIES if self.refusal(knobs, n) is None)

    def by_name(self) -> dict[str, SavedTensor]:
        """Every tensor this implementation can name: the ledger's, with its own in their place where they differ."""
        return ledger.BY_NAME | {x.name: x for x in self.tensors}


def drop_small(tensors: Iterable[SavedTensor], accounting: Accounting) -> tuple[SavedTensor, ...]:
    """The paper's accounting leaves out the small terms (`paper=False`); exact accounting keeps all."""
    return tuple(t for t in tensors if accounting.exact or t.paper)
