"""`memcalc formula`: the per-layer formulas in symbols, and each tensor's term."""

from __future__ import annotations

from typing import Any

import click

from memcalc.cli import echo_json, json_document
from memcalc.cli.options import (
    accounting_options, config_option, hf_config_option, knob_options, knobs_from, runnable, strategy_names,
    strategy_option,
)
from memcalc.cli.types import Integer
from memcalc.model.knobs import Accounting, Knobs
from memcalc.errors import ConfigError
from memcalc.model.ledger import Dim
from memcalc.model.rules import DIVISIBILITY, SEQUENCE_SPLIT
from memcalc.model.strategy import STRATEGIES


@click.command("formula")
@config_option
@hf_config_option
@knob_options
@strategy_option
@accounting_options
@click.option("--b", "b", type=Integer(min=1), help="Micro-batch size, to pick the formula that holds there [default: 1].")
@click.option("--s", "s", type=Integer(min=1), help="Sequence length, to pick the formula that holds there.")
@click.option("--a", "a", type=Integer(min=1), help="Attention heads, to pick the formula that holds there.")
@click.option("--t", "t", type=Integer(min=1), help="Tensor-parallel size, to pick the formula that holds there [default: 1].")
@click.option(
    "--format", "fmt", type=click.Choice(["text", "latex", "json", "sympy"]), default="text", show_default=True,
    help="text: the seed's notation; latex: math to paste into a paper; json: everything; sympy: Python syntax.",
)
def command(
    strategy: str, exact: bool, device: str, fmt: str, b: int | None, s: int | None, a: int | None, t: int | None,
    **params: Any,
) -> None:
    """Per-layer activation bytes per GPU as formulas in b, s, h, a, t.

    Built from the same ledger as `estimate`; under --impl paper they are the
    seed's sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) and sbh(34/t + 5as/(ht)).
    Where what a layer keeps depends on the sizes (megatron-core's fused softmax
    runs in a window of them), the text says under which sizes each formula
    holds; given --s and --a (and --b, --t), it prints the one that holds there.
    """
    given = {name: size for name, size in zip("bsat", (b, s, a, t)) if size is not None}
    knobs = knobs_from(params | given)  # a file's sizes as given; bad input fails before sympy's second to import
    names = strategy_names(strategy, knobs)
    if strategy == "all":  # a layout these sizes rule out (SP where t does not divide s) left out, as estimate does
        names = runnable(names, lambda n: _sizes(knobs, [n], b, s, a, t))
    sizes = _sizes(knobs, names, b, s, a, t)
    from memcalc.model import formula as F  # sympy: paid only here

    accounting = Accounting(exact=exact, device=device)
    outside = [sizes is not None and F.outside_at(knobs, STRATEGIES[n], *sizes) for n in names]
    formulas = [F.layer_formula(STRATEGIES[n], knobs, accounting) if sizes is None else
                F.formula_at(STRATEGIES[n], knobs, accounting, *sizes) for n in names]
    if fmt == "json":
        echo_json(_json(F, formulas, knobs, accounting))
    elif fmt == "latex":
        for lf in formulas:
            click.echo(f"% {lf.strategy.name}: {lf.strategy.title}, bytes per GPU per layer")
            click.echo(F.to_latex(lf.total))
    elif fmt == "sympy":
        for lf in formulas:
            click.echo(f"{lf.strategy.name}: {F.to_plain(lf.total)}")
    else:
        _print_text(F, formulas, knobs, accounting)
        _print_window(F, names, knobs, accounting, sizes, outside)


def _sizes(
    knobs: Knobs, names: list[str], b: int | None, s: int | None, a: int | None, t: int | None,
) -> tuple[dict, int] | None:
    """The per-rank sizes a size rule reads (b, s, a, g) and t, when --s and --a are given; None when no size is.
    Sizes no layout runs (t not dividing a, or s under SP) are refused by estimate's rules, not shown a formula."""
    if (b, s, a, t) == (None,) * 4:
        return None
    if s is None or a is None:
        raise ConfigError("formula at given sizes needs --s and --a (and --b, --t: 1 unless given)")
    given = {"s": s, "a": a, "t": t or 1, "num_query_groups": knobs.num_query_groups or a}
    splits_s = any(STRATEGIES[n].sequence_parallel for n in names)
    for rule in (*DIVISIBILITY, *([SEQUENCE_SPLIT] if splits_s else [])):
        operands = [given.get(n) for n in rule.operands]
        if None not in operands and rule.applies(knobs) and rule.fails(*operands):
            raise ConfigError(rule.message(*operands))
    return {Dim.B: b or 1, Dim.S: s, Dim.A: a, Dim.G: given["num_query_groups"]}, given["t"]


def _print_window(F: Any, names: list[str], knobs: Knobs, accounting: Accounting, sizes: Any, outside: list) -> None:
    """Under which sizes the formulas hold: without sizes, the size rule's words and the formulas outside it; with
    them, which side of the rule each layout's formula is on."""
    from memcalc.model.impls import size_rule

    rule = size_rule(knobs)
    if rule is None:
        click.echo("They hold at every size: for these knobs what the layer keeps does not depend on the sizes.")
        return
    if sizes is not None:
        sized, t = sizes
        where = " ".join(f"{d.value}={sized[d]}" for d in (Dim.B, Dim.S, Dim.A)) + f" t={t}"
        for name, out in zip(names, outside):
            shards = STRATEGIES[name].weight_shards(t)
            why = rule.misses(sized, shards) if out and rule.misses is not None else ""
            side = f"outside the rule's window ({why})" if out else "inside the rule's window"
            click.echo(f"At {where}, {name} is {side}: the formula above is the one that holds there.")
        click.echo(f"The rule: {rule.what}.")
        return
    click.echo(f"They hold where the sizes let the kernel run; elsewhere ({rule.what}):")
    width = max(len(n) for n in names)
    for name in names:
        click.echo(f"  {name:<{width}}  {F.to_text(F.layer_formula(STRATEGIES[name], knobs, accounting, True).total)}")
    click.echo("Give --s and --a (and --b, --t) to print the formula that holds at those sizes.")


def _json(F: Any, formulas: list, knobs: Knobs, accounting: Accounting) -> dict:
    return json_document(
        knobs=knobs.__dict__, accounting={"exact": accounting.exact, "device": accounting.device},
        symbols={n: F.MEANINGS[n] for n in F.symbols_in([lf.total for lf in formulas])},
        strategies={
            lf.strategy.name: {
                "formula": F.to_text(lf.total), "latex": F.to_latex(lf.total), "sympy": F.to_plain(lf.total),
                "terms": [
                    {"name": x.name, "formula": F.to_text(e), "latex": F.to_latex(e), "paper": x.paper}
                    for x, e in lf.terms
                ],
            }
            for lf in formulas
        },
    )


def _print_text(F: Any, formulas: list, knobs: Knobs, accounting: Accounting) -> None:
    from rich.table import Table

    from memcalc.cli.render import accounting_note, console

    click.echo(f"Activation bytes per GPU, one layer; {accounting_note(accounting, knobs.impl)}:")
    width = max(len(lf.strategy.name) for lf in formulas)
    for lf in formulas:
        click.echo(f"  {lf.strategy.name:<{width}}  {F.to_text(lf.total)}")
    used = F.symbols_in([lf.total for lf in formulas])
    shared = ", ".join(dict.fromkeys(x.name for lf in formulas for x, _ in lf.terms if x.model_wide))
    once = f", but {shared} once for all layers of a kind (the model makes them for every layer)" if shared else ""
    click.echo("where " + ", ".join(f"{n} = {F.MEANINGS[n]}" for n in used) + f"; all L layers: multiply by L{once}.")
    table = Table(title="Each tensor's term")
    table.add_column("tensor")
    for lf in formulas:
        table.add_column(lf.strategy.name, no_wrap=True)
    by_name = [{x.name: e for x, e in lf.terms} for lf in formulas]  # rows by name: layouts may keep other tensors
    for name in dict.fromkeys(x.name for lf in formulas for x, _ in lf.terms):
        table.add_row(name, *(F.to_text(terms[name]) if name in terms else "-" for terms in by_name))
    console.print(table)
