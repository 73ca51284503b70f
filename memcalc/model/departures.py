"""Where an implementation's numbers depart from the paper's, each departure named from the ledger.

The paper is an implementation like the others, so the same estimate runs for it and every tensor whose bytes
differ is a departure, said once in the words that explain it: a size rule's (its kernel's window missed), a
knob's (a setting only the library has), or else the ledger's (who keeps it and why). No list of messages.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from memcalc.model.evaluate import LayerEstimate, dim_sizes, estimate, routers
from memcalc.model.impls import layer_tensors, size_rule, tensors_at
from memcalc.model.impls.paper import outside
from memcalc.model.knobs import KNOBS, Accounting, Impl, Knobs
from memcalc.model.strategy import STRATEGIES
from memcalc.records import record

if TYPE_CHECKING:
    from memcalc.config.schema import ModelConfig


@record
class Departure:
    """One reason the implementation keeps other bytes than the paper, and the tensors it moves."""

    rule: str  # why: a size rule's words (with the sizes that miss its window), or a tensor's saved_by and why
    tensors: tuple[tuple[str, int], ...]  # (tensor name, implementation's bytes - the paper's) per layer, per rank

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.tensors)


@record
class PaperComparison:
    """The paper's estimate at the same inputs and layout, and each departure from it; or why the paper has none."""

    paper: LayerEstimate | None
    departures: tuple[Departure, ...] = ()
    not_modelled: str | None = None  # the paper's refusal of these inputs, when it has no number for them


def paper_config(config: ModelConfig) -> ModelConfig:
    """The same inputs under the paper, the knobs only other libraries have at their defaults (it has none)."""
    unset = {k.name: k.default for k in KNOBS if k.impls and Impl.PAPER not in k.impls}
    return replace(config, impl=Impl.PAPER, **unset)


def compare_with_paper(config: ModelConfig, result: LayerEstimate, accounting: Accounting) -> PaperComparison:
    """`result` (one layout's estimate of `config`) beside the paper's at the same inputs, departures named."""
    if config.impl == Impl.PAPER:
        return PaperComparison(result)
    same = paper_config(config)
    knob = outside(same)
    if knob is not None:
        return PaperComparison(None, not_modelled=f"{knob} is outside the paper's layer")
    paper = estimate(same, STRATEGIES[result.strategy.name], accounting)
    return PaperComparison(paper, departures(config, result, paper, accounting))


def departures(
    config: ModelConfig, result: LayerEstimate, paper: LayerEstimate, accounting: Accounting,
) -> tuple[Departure, ...]:
    """Each tensor whose bytes differ, those a size rule moved gathered into the rule's one departure."""
    mine = {x.tensor.name: x.bytes for x in result.tensors}
    theirs = {x.tensor.name: x.bytes for x in paper.tensors}
    names = [*mine, *(n for n in theirs if n not in mine)]
    differing = [(n, mine.get(n, 0) - theirs.get(n, 0)) for n in names if mine.get(n, 0) != theirs.get(n, 0)]
    knobs, t = Knobs.of(config), result.strategy.weight_shards(config.t)
    sizes = dim_sizes(config, routers(config, result.strategy))
    out, claimed = [], set()
    for rule, moved in (_window(knobs, sizes, t, accounting), *_settings(knobs, sizes, t, accounting)):
        by_rule = tuple((n, d) for n, d in differing if n in moved and n not in claimed)
        claimed |= {n for n, _ in by_rule}
        out += [Departure(rule, by_rule)] if by_rule else []
    known = {x.tensor.name: x.tensor for x in (*paper.tensors, *result.tensors)}  # this layer's own record wins
    for name, delta in differing:
        if name not in claimed:
            x = known[name]
            out.append(Departure(f"{x.saved_by}: {x.why}", ((name, delta),)))
    return tuple(out)


def _settings(knobs: Knobs, sizes: dict, t: int, accounting: Accounting) -> list[tuple[str, frozenset[str]]]:
    """Each knob the paper does not have (`Knob.impls`) set away from its default, in its own words (the effect
    docs/model.md shows for it), and the tensors the layout (at per-rank `sizes` on t ranks) keeps otherwise than
    at the default."""
    kept = set(tensors_at(knobs, accounting, sizes, t))
    out = []
    for knob in KNOBS:
        value = getattr(knobs, knob.name)
        if not knob.impls or Impl.PAPER in knob.impls or value == knob.default:
            continue
        default = set(tensors_at(replace(knobs, **{knob.name: knob.default}), accounting, sizes, t))
        words = next((meaning for values, meaning in knob.variants() if values.get(knob.name) == value), knob.help)
        out.append((f"{knob.flag if value is not False else '--no-' + knob.flag[2:]}: {words}",
                    frozenset(x.name for x in kept ^ default)))
    return out


def _window(knobs: Knobs, sizes: dict, t: int, accounting: Accounting) -> tuple[str, frozenset[str]]:
    """The size rule that moved the layout outside its kernel's window, in words, and the tensors it moved."""
    rule = size_rule(knobs)
    if rule is None or rule.runs_at(knobs, sizes, t):
        return "", frozenset()
    inside, outside = set(layer_tensors(knobs, accounting)), set(rule.outside(knobs, accounting))
    misses = f"{rule.misses(sizes, t)}: " if rule.misses is not None else ""
    return f"{misses}{rule.what}", frozenset(x.name for x in inside ^ outside)


def describe(departure: Departure) -> str:
    """'rule: attention/causal_mask +9,216 B': the rule and each tensor it moves, with its bytes."""
    tensors = ", ".join(f"{name} {delta:+,} B" for name, delta in departure.tensors)
    return f"{departure.rule}: {tensors}"
