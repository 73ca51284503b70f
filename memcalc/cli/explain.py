"""`memcalc explain`: the ledger as a table, one row per saved tensor."""

from __future__ import annotations

from typing import Any

import click

from memcalc.cli.knobs import knobs_from
from memcalc.cli.options import accounting_options, config_option, knob_options
from memcalc.layer import Accounting, element_bytes, layer_tensors
from memcalc.strategy import TP, TP_SP


@click.command("explain")
@config_option
@knob_options
@accounting_options
def command(exact: bool, device: str, **params: Any) -> None:
    """Every tensor a layer keeps for backward: shape, bytes per element, whether
    TP and SP split it (and along which dimension), and why backward needs it.

    The knobs choose which tensors appear (e.g. --mlp swiglu, --attention flash,
    --dropout 0, --recompute selective); --exact adds the small terms.
    """
    from rich.table import Table

    from memcalc.cli.render import accounting_note, console

    knobs = knobs_from(params)
    accounting = Accounting(exact=exact, device=device)
    table = Table(title=f"Saved for backward, one layer ({accounting_note(accounting)})")
    for col in ("tensor", "saved by", "shape", "bytes/elem", "split by tp", "split by sp", "why backward needs it"):
        table.add_column(col)
    for x in layer_tensors(knobs, accounting):
        tp_dim, sp_dim = TP.split_dim(x), TP_SP.split_dim(x)
        table.add_row(
            x.name if x.paper else f"{x.name} [dim](exact)[/dim]",
            x.saved_by,
            "(" + ", ".join(d.value for d in x.shape) + ")",
            str(element_bytes(x.kind, knobs, accounting)),
            f"yes ({tp_dim.value}/t)" if tp_dim else "no",
            f"yes ({sp_dim.value}/t)" if sp_dim and not tp_dim else "no",
            x.why,
        )
    console.print(table)
