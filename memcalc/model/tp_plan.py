"""A library's tensor-parallel plan as data: which module of its layer runs in which parallel style.

torchtitan writes a block's TP+SP layout as a table from module to style (models/llama3/sharding.py), transformers
as a config class's base_model_tp_plan ("layers.*.self_attn.q_proj": "colwise"); megatron-core builds the same
plan into its classes (ColumnParallelLinear, RowParallelLinear, norms with sequence_parallel). Each implementation
declares its plan in that form (`Implementation.tp_plan`), and the rest derives from it: the tensors a layout keeps
whole (memcalc.model.strategy) and each column/row-parallel pair's collectives (memcalc.model.comm): a colwise
module's entry is the seed's f (tp) or g (tp-sp), a rowwise module's exit f* or g*, and under SP a colwise
module's backward gathers its input again unless the plan keeps the input it gathered.
"""

from __future__ import annotations

from enum import Enum

from memcalc.model.ledger import Dim
from memcalc.records import record


class Style(Enum):
    """How a module runs over the t ranks; the value is the library's word for it where it has one."""

    COLWISE = "colwise"  # output columns split: enters through f (tp) / g (tp-sp); SP keeps its input's shard only
    COLWISE_KEEPS_INPUT = "colwise (its gathered input kept)"  # DTensor's: the input gathered at entry is kept
    COLWISE_GATHER_OUTPUT = "colwise_gather_output"  # output gathered (transformers': every rank runs the block whole)
    ROWWISE = "rowwise"  # input rows split: leaves through f* (tp) / g* (tp-sp)
    ROWWISE_SPLIT_INPUT = "rowwise_split_input"  # transformers': rowwise, its whole input split on the rank first
    SEQUENCE = "sequence parallel"  # a norm: under SP it runs on its rank's sequence shard, no collective of its own
    REPLICATED = "replicated"  # no rule shards it: every rank runs it whole
    # a norm inside a pair, whole on every rank: its weight's gradient is all-reduced once autograd has it
    REPLICATED_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
    EXPERTS = "experts"  # each expert's width split by t (etp = t), tokens dispatched to them (comm's MoE block)


_ENTERS = (Style.COLWISE, Style.COLWISE_KEEPS_INPUT, Style.COLWISE_GATHER_OUTPUT)
_LEAVES = (Style.ROWWISE, Style.ROWWISE_SPLIT_INPUT)
_WHOLE_UNDER_TP = (Style.REPLICATED, Style.COLWISE_GATHER_OUTPUT)


@record
class Pair:
    """A column/row-parallel pair of the layer, and what crosses its two ends, in the words comm's rows use."""

    name: str  # the block, as its collectives are named: "attention/f"
    entering: str  # the colwise modules' input
    leaving: str  # the rowwise module's output


ATTENTION = Pair("attention", "the QKV input", "the projection output")
MLP = Pair("mlp", "the fc1 input", "the fc2 output")
SHARED = Pair("shared", "the shared experts' fc1 input", "the shared experts' fc2 output")


@record
class Rule:
    """One line of a plan: a module of the library's layer (as its own plan names it), and its style."""

    module: str
    style: Style
    pair: Pair | None = None  # the pair a colwise or rowwise module is an end of
    # ledger tensors kept whole where the layout would split them: under SP, what a colwise module keeps of the input
    # it gathered or a rowwise one of its output before the reduce-scatter; under TP, what a whole block makes
    whole: tuple[str, ...] = ()
    # what a collective at this module moves where the plan gathers a block (a colwise module's whole output, a
    # rowwise module's input gradient) or replicates a norm (its weight's gradient); `parts` such tensors
    moves: tuple[Dim, ...] = ()
    parts: int = 1


@record
class TPPlan:
    """One layer's plan: its rules in forward order."""

    rules: tuple[Rule, ...]

    def kept_whole(self) -> frozenset[str]:
        """Tensors a sequence-splitting layout keeps gathered (the whole sequence)."""
        return frozenset(n for r in self.rules if r.style not in _WHOLE_UNDER_TP for n in r.whole)

    def unsharded(self) -> frozenset[str]:
        """Tensors a tensor-parallel layout keeps whole on every rank: made by a block the plan runs whole."""
        return frozenset(n for r in self.rules if r.style in _WHOLE_UNDER_TP for n in r.whole)

    def ends(self, p: Pair) -> tuple[tuple[Rule, ...], Rule]:
        """Pair `p`'s modules before its rowwise one (colwise, and the norms between them), and its rowwise one."""
        return tuple(r for r in self.rules if r.pair == p and r.style not in _LEAVES), \
            next(r for r in self.rules if r.pair == p and r.style in _LEAVES)

    def pairs(self) -> dict[Pair, Style]:
        """Each column/row-parallel pair in forward order, with the style of its (first) colwise module."""
        entries = {r.pair: r.style for r in reversed(self.rules) if r.style in _ENTERS}
        return {r.pair: entries[r.pair] for r in self.rules if r.style in _LEAVES and r.pair is not None}


def pair(p: Pair, colwise: tuple[str, ...], rowwise: str, style: Style = Style.COLWISE,
         whole: tuple[str, ...] = ()) -> tuple[Rule, ...]:
    """A pair's rules: its colwise modules in `style` (the first keeping `whole`), then its rowwise module."""
    leave = Style.ROWWISE_SPLIT_INPUT if style is Style.COLWISE_GATHER_OUTPUT else Style.ROWWISE
    return (*(Rule(m, style, p, () if i else whole) for i, m in enumerate(colwise)), Rule(rowwise, leave, p))
