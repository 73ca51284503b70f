"""What `memcalc measure` and `memcalc measure --step` print alike: each strategy's prediction next to its measurement
(a result with `strategy`, `matches` and `differences()`), as JSON or tables, and exit 1 where they differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from memcalc.cli import echo_json, json_document
from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError

if TYPE_CHECKING:
    from rich.table import Table


def report(results: Sequence[Any], as_json: bool, document: Callable[[], dict[str, Any]], tables: Callable[[], None],
           differ: str) -> None:
    """The results as JSON or tables; then ProbeError (exit 1) naming each strategy's differences after `differ`."""
    if as_json:
        echo_json(document())
    else:
        tables()
    differences = [f"{r.strategy.name}: {d}" for r in results for d in r.differences()]
    if differences:
        raise ProbeError(f"{differ}: {'; '.join(differences)}")


def document(config: ModelConfig, results: Sequence[Any], **fields: Any) -> dict[str, Any]:
    """A measurement's JSON document: its schema version, the config, whether every strategy matched, then `fields`."""
    return json_document(config, match=all(r.matches for r in results), **fields)


def print_header(config: ModelConfig, what: str) -> None:
    """The config in one line, then (dimmed) what the tables below count."""
    from memcalc.cli.render import console, describe

    console.print(describe(config))
    console.print(f"[dim]{what}[/dim]")


def print_outcome(ran_as: str, notes: Iterable[str], matches: bool, agreed: str, *lines: str) -> None:
    """The lines under a strategy's table: how it ran, each CPU shim's note (dimmed), `lines`, then the verdict: a
    match and what agreed, or that it differs."""
    from memcalc.cli.render import console

    console.print(f"ran as: {ran_as}")
    for line in (*(f"[dim]shim: {note}[/dim]" for note in notes), *lines):
        console.print(line)
    console.print(f"[green]match[/green]: {agreed}" if matches else "[red]differs[/red]")


def comparison_table(title: str, *labels: str) -> Table:
    """A table of rows named by `labels`' columns, then predicted, measured and their difference."""
    from memcalc.cli.render import new_table

    return new_table(title, labels, ("predicted", "measured", "difference"))


def add_total(table: Table, predicted: int, measured: int, difference: str, *blanks: str) -> None:
    """The bold total row that closes a comparison table (`blanks`: the label columns after the first)."""
    table.add_row(
        "[bold]total[/bold]", *blanks, f"[bold]{predicted:,}[/bold]", f"[bold]{measured:,}[/bold]",
        f"[bold]{difference}[/bold]", end_section=True,
    )
