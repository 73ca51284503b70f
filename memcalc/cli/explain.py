"""`memcalc explain`: the ledger as a table, one row per saved tensor."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import click

from memcalc.cli.options import (
    accounting_options, config_option, hf_config_option, knob_options, knobs_from, note_left_out,
)
from memcalc.model.impls import implementation, layer_tensors, plan, size_rule, strategies_of
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import TP, TP_SP, Strategy

if TYPE_CHECKING:
    from rich.table import Table


WIDE = 140  # below this the seven columns wrap into unreadable slivers: print a list instead
COLUMNS = ("tensor", "saved by", "shape", "bytes/elem", "split by tp", "split by sp", "why backward needs it")


@click.command("explain")
@config_option
@hf_config_option
@knob_options
@accounting_options
def command(exact: bool, device: str, **params: Any) -> None:
    """Every tensor a layer keeps for backward: shape, bytes per element, whether
    TP and SP split it (and along which dimension), and why backward needs it.

    The knobs choose which tensors appear (e.g. --mlp swiglu, --attention flash,
    --dropout 0, --recompute selective); --exact adds the small terms.
    """
    from memcalc.cli.render import accounting_note, console

    knobs = knobs_from(params)
    accounting = Accounting(exact=exact, device=device)
    runs = strategies_of(knobs)
    note_left_out(knobs)
    # "split by tp" is what tensor parallelism splits, which tp-sp does too where tp alone is not run
    tp = plan(knobs, TP) if TP.name in runs else TP if TP_SP.name in runs else None
    plans = [tp, plan(knobs, TP_SP) if TP_SP.name in runs else None]
    kept = layer_tensors(knobs, accounting)
    rows = [_row(x, element_bytes(x.kind, knobs, accounting), *plans) for x in kept]
    title = f"Saved for backward, one layer: {accounting_note(accounting, knobs.impl)}"
    if console.width >= WIDE:
        console.print(_table(title, rows))
    else:
        _print_list(title, rows)
    for line in _at_some_sizes(knobs, accounting, kept):
        click.echo(line)


def _at_some_sizes(knobs: Knobs, accounting: Accounting, kept: tuple[SavedTensor, ...]) -> list[str]:
    """What the sizes change in the set above, as `estimate` keeps it at its sizes (`tensors_at`): the size rule's
    other set where its kernel does not run, and each size condition's tensor where the library takes its other
    branch."""
    rule = size_rule(knobs)
    other = rule.outside(knobs, accounting) if rule is not None else ()
    lines = [f"At some sizes: {rule.what} (adds {_names(x for x in other if x not in kept)}; drops"
             f" {_names(x for x in kept if x not in other)})"] if rule is not None else []
    conditions = [c for c in implementation(knobs).size_conditions if c.applies(knobs) and c.tensor in (*kept, *other)]
    return lines + [f"At some sizes: {c.tensor.name}: {c.what}" + (f" ({_names(c.instead)} in its place)"
                                                                     if c.instead else "") for c in conditions]


def _names(tensors: Iterable[SavedTensor]) -> str:
    return ", ".join(x.name for x in tensors) or "nothing"


def _row(x: SavedTensor, width: int, tp: Strategy | None, tp_sp: Strategy | None) -> tuple[str, ...]:
    """A tensor's cells; a split shows which dimension each strategy (as the implementation plans it) divides by t."""
    tp_dim, sp_dim = (st.split_dim(x) if st else None for st in (tp, tp_sp))
    return (
        x.name if x.paper else f"{x.name} (exact)",
        x.saved_by,
        "(" + ", ".join(d.value for d in x.shape) + ")",
        str(width),
        f"yes ({tp_dim.value}/t)" if tp_dim else "no",
        f"yes ({sp_dim.value}/t)" if sp_dim and not tp_dim else "no",
        x.why,
    )


def _table(title: str, rows: list[tuple[str, ...]]) -> Table:
    from rich.table import Table

    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, no_wrap=col != COLUMNS[-1] and col != "saved by")
    for row in rows:
        table.add_row(*row)
    return table


def _print_list(title: str, rows: list[tuple[str, ...]]) -> None:
    """Two lines a tensor: its facts, then what saves it and why."""
    from memcalc.cli.render import console

    console.print(f"[bold]{title}[/bold]")
    console.print("[dim]tensor, shape, bytes per element, split by tp, split by sp[/dim]")
    for name, saved_by, shape, width, tp, sp, why in rows:
        console.print(f"[bold]{name}[/bold]  {shape} x {width} B  tp: {tp}  sp: {sp}")
        console.print(f"    saved by {saved_by}: {why}")
