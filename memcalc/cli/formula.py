"""`memcalc formula`: the per-layer formulas in symbols, and each tensor's term."""

from __future__ import annotations

import json
from typing import Any

import click

from memcalc.cli.knobs import knobs_from
from memcalc.cli.options import accounting_options, config_option, knob_options, strategy_names, strategy_option
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.strategy import STRATEGIES
from memcalc.schemas import SCHEMA_VERSION


@click.command("formula")
@config_option
@knob_options
@strategy_option
@accounting_options
@click.option(
    "--format", "fmt", type=click.Choice(["text", "latex", "json", "sympy"]), default="text", show_default=True,
    help="text: the seed's notation; latex: math to paste into a paper; json: everything; sympy: Python syntax.",
)
def command(strategy: str, exact: bool, device: str, fmt: str, **params: Any) -> None:
    """Per-layer activation bytes per GPU as formulas in b, s, h, a, t.

    Built from the same ledger as `estimate`; with the default knobs they are
    the seed's sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) and sbh(34/t + 5as/(ht)).
    """
    knobs = knobs_from(params)  # bad input fails before the second that sympy takes to import
    from memcalc.model import formula as F  # sympy: paid only here

    accounting = Accounting(exact=exact, device=device)
    formulas = [F.layer_formula(STRATEGIES[n], knobs, accounting) for n in strategy_names(strategy, knobs)]
    if fmt == "json":
        click.echo(json.dumps(_json(F, formulas, knobs, accounting), indent=2))
    elif fmt == "latex":
        for lf in formulas:
            click.echo(f"% {lf.strategy.name}: {lf.strategy.title}, bytes per GPU per layer")
            click.echo(F.to_latex(lf.total))
    elif fmt == "sympy":
        for lf in formulas:
            click.echo(f"{lf.strategy.name}: {F.to_plain(lf.total)}")
    else:
        _print_text(F, formulas, knobs, accounting)


def _json(F: Any, formulas: list, knobs: Knobs, accounting: Accounting) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "knobs": knobs.__dict__,
        "accounting": accounting.__dict__,
        "symbols": {n: F.MEANINGS[n] for n in F.symbols_in([lf.total for lf in formulas])},
        "strategies": {
            lf.strategy.name: {
                "formula": F.to_text(lf.total), "latex": F.to_latex(lf.total), "sympy": F.to_plain(lf.total),
                "terms": [
                    {"name": x.name, "formula": F.to_text(e), "latex": F.to_latex(e), "paper": x.paper}
                    for x, e in lf.terms
                ],
            }
            for lf in formulas
        },
    }


def _print_text(F: Any, formulas: list, knobs: Knobs, accounting: Accounting) -> None:
    from rich.table import Table

    from memcalc.cli.render import accounting_note, console

    click.echo(f"Activation bytes per GPU, one layer; {accounting_note(accounting, knobs.impl)}:")
    width = max(len(lf.strategy.name) for lf in formulas)
    for lf in formulas:
        click.echo(f"  {lf.strategy.name:<{width}}  {F.to_text(lf.total)}")
    used = F.symbols_in([lf.total for lf in formulas])
    click.echo("where " + ", ".join(f"{n} = {F.MEANINGS[n]}" for n in used) + "; all L layers: multiply by L.")
    table = Table(title="Each tensor's term")
    table.add_column("tensor")
    for lf in formulas:
        table.add_column(lf.strategy.name, no_wrap=True)
    for rows in zip(*(lf.terms for lf in formulas)):
        table.add_row(rows[0][0].name, *(F.to_text(e) for _, e in rows))
    console.print(table)
