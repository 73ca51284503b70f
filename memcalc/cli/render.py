"""Rich tables for people. Imported only when output goes to a person, not for --json."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from memcalc.config import ModelConfig
from memcalc.evaluate import LayerEstimate
from memcalc.layer import Accounting
from memcalc.units import human_bytes

console = Console()


def describe(config: ModelConfig) -> str:
    """One line naming the model's sizes and knobs."""
    c = config
    name = f"{c.name}: " if c.name else ""
    return (
        f"{name}b={c.b} s={c.s} h={c.h} a={c.a} t={c.t} L={c.L} | {c.mlp} (ffn {c.ffn}), {c.attention} attention"
        f" ({c.groups} K/V groups), {c.norm}, dropout {c.dropout}, recompute {c.recompute}, {c.dtype}"
    )


def accounting_note(accounting: Accounting) -> str:
    if accounting.exact:
        return f"exact accounting (every saved byte; norm statistics as on {accounting.device})"
    return "the paper's accounting (use --exact for norm statistics and LSE)"


def print_estimates(
    config: ModelConfig, accounting: Accounting, results: list[LayerEstimate], baseline: LayerEstimate, breakdown: bool
) -> None:
    """The per-strategy table and, if asked, the per-tensor table."""
    console.print(describe(config), highlight=False)
    console.print(f"[dim]{accounting_note(accounting)}[/dim]")
    table = Table(title="Activation memory per GPU")
    table.add_column("strategy")
    for col in ("per layer", f"all {config.L} layers", "vs none"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        ratio = r.per_layer_bytes / baseline.per_layer_bytes
        table.add_row(r.strategy.name, _bytes_cell(r.per_layer_bytes), _bytes_cell(r.total_bytes), f"{ratio:.4f}")
    console.print(table)
    if breakdown:
        console.print(breakdown_table(results))


def _bytes_cell(n: int) -> str:
    """Exact bytes over the same number in binary units."""
    return f"{n:,} B\n[dim]{human_bytes(n)}[/dim]"


def breakdown_table(results: list[LayerEstimate]) -> Table:
    """One row per saved tensor, one column of per-layer bytes per strategy."""
    table = Table(title="Per-tensor bytes per GPU, one layer")
    table.add_column("tensor")
    for r in results:
        table.add_column(r.strategy.name, justify="right", no_wrap=True)
    for rows in zip(*(r.tensors for r in results)):
        x = rows[0].tensor
        name = x.name if x.paper else f"{x.name} [dim](exact)[/dim]"
        table.add_row(name, *(f"{row.bytes:,}" for row in rows))
    table.add_row("[bold]total[/bold]", *(f"[bold]{r.per_layer_bytes:,}[/bold]" for r in results), end_section=True)
    return table
