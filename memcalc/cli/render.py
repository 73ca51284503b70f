"""Rich tables for people. Imported only when output goes to a person, not for --json."""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import KNOBS
from memcalc.model.evaluate import LayerEstimate
from memcalc.model.knobs import Accounting
from memcalc.sizing.verdict import need
from memcalc.text import for_rich
from memcalc.units import human_bytes

if TYPE_CHECKING:  # per-GPU totals load only when --totals asks for them
    from memcalc.config.gpus import Budget
    from memcalc.sizing.totals import PerGpu, StageTotal


class _Console(Console):
    """rich's Console, less its own rule for a closed pipe (exit 1): `memcalc.cli.main` has memcalc's."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "stdout's reader closed the pipe")


console = _Console()


def describe(config: ModelConfig) -> str:
    """One line naming the model's sizes and knobs."""
    c = config
    name = f"{for_rich(c.name)}: " if c.name else ""  # a name from a file may hold markup or terminal escapes
    return f"{name}b={c.b} s={c.s} h={c.h} a={c.a} t={c.t} L={c.L} | {describe_knobs(c)}"


def describe_knobs(knobs: Any) -> str:
    """'gelu (ffn 49152), eager attention (96 K/V groups), layernorm, dropout 0.1, recompute none, bf16'.

    Each knob's words come from the knob table; a config's MLP width and K/V
    groups are shown as used, a bare knob set's as set (or 4h and a).
    """
    return ", ".join(words for k in KNOBS if (words := k.describe(knobs)))


def accounting_note(accounting: Accounting) -> str:
    """How the bytes were counted, for the line above a table."""
    if accounting.exact:
        return f"exact accounting, every saved byte, norm statistics as on {accounting.device}"
    return "the paper's accounting; --exact adds norm statistics and LSE"


def print_estimates(
    config: ModelConfig, accounting: Accounting, results: list[LayerEstimate], baseline: LayerEstimate, breakdown: bool
) -> None:
    """The per-strategy table and, if asked, the per-tensor table."""
    console.print(describe(config), highlight=False)
    if config.cp > 1:
        console.print(f"context parallel: cp={config.cp}, so each rank keeps s/cp = {config.s // config.cp} tokens")
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


def describe_layout(config: ModelConfig) -> str:
    """One line naming the parallel layout and what the model's ends and parameters are."""
    from memcalc.sizing.states import describe_sharding, padded_vocab, total_params

    c = config
    schedule = f"interleaved 1F1B, vpp={c.vpp}" if c.vpp else "1F1B" if c.pp > 1 else "no pipelining"
    optimizer = describe_sharding(c)
    tied = "tied" if c.tie_embeddings else "untied"
    gpus = f"{c.gpus} GPUs = t*pp*cp*dp = {c.t}*{c.pp}*{c.cp}*{c.dp}, " if c.gpus is not None else ""
    steps = f", {c.microbatches} micro-batches per step" if c.microbatches is not None else ""
    padded = padded_vocab(c, c.t)
    vocab = f"vocab {c.vocab_size}" + (f" padded to {padded}" if padded != c.vocab_size else "")
    return (
        f"layout: {gpus}pp={c.pp} ({schedule}), dp={c.dp}, cp={c.cp}{steps}, {optimizer} | {vocab} ({tied}),"
        f" {c.position_embedding_type} positions | {total_params(c):,} parameters"
    )


def headroom(budget: int, used: int) -> str:
    """'12.00 GiB left' or '3.00 GiB over'."""
    return f"{human_bytes(budget - used)} left" if used <= budget else f"{human_bytes(used - budget)} over"


def print_totals(config: ModelConfig, per: list[PerGpu], device: Budget, peaks: dict | None = None) -> None:
    """A table per bounding pipeline stage, every term by name, a verdict per strategy, and the step's peak."""
    console.print(describe_layout(config), highlight=False)
    for i, stage in enumerate(per[0].stages):
        console.print(stage_table([p.stages[i] for p in per], [p.strategy.name for p in per]))
        where = "" if stage.stage.name == "only" else f"{stage.stage.name} stage: "
        console.print(f"[dim]{where}{stage.stage.schedule}[/dim]")
    budget = device.bytes
    console.print(
        f"Fits in {human_bytes(budget)} per GPU? ({device.source}: {human_bytes(device.device_bytes)}, less a"
        f" {human_bytes(device.reserve_bytes)} reserve for what the allocator does not see)", highlight=False,
    )
    for p in per:
        needed = need(p, (peaks or {}).get(p.strategy.name))
        where = f", {needed.stage} stage" if needed.stage != "only" else ""
        console.print(
            f"  {p.strategy.name}: {'yes' if needed.bytes <= budget else 'no'}, {needed.bytes:,} B ="
            f" {human_bytes(needed.bytes)} ({needed.basis}{where}), {headroom(budget, needed.bytes)}",
            highlight=False,
        )
    _print_peaks(peaks or {})


def _print_peaks(peaks: dict) -> None:
    """Each strategy's step peak per bounding stage: when, what is live, and the steady state; or why not."""
    unmodelled = {peak for peak in peaks.values() if isinstance(peak, str)}
    if len(unmodelled) == 1 and len(peaks) > 1 and all(isinstance(x, str) for x in peaks.values()):
        console.print(f"[dim]  the step's peak is not modelled here ({for_rich(unmodelled.pop())})[/dim]")
        return
    for name, timelines in peaks.items():
        if isinstance(timelines, str):
            console.print(f"[dim]  {name}: the step's peak is not modelled here ({for_rich(timelines)})[/dim]")
            continue
        worst = max(timelines, key=lambda x: x.peak.bytes)
        where = "" if worst.stage == "only" else f" on the {worst.stage} stage"
        live = ", ".join(f"{c} {human_bytes(n)}" for c, n in worst.peak.by_category().items() if n)
        others = "".join(
            f"; {x.stage} stage {human_bytes(x.peak.bytes)} ({x.peak.phase} {x.peak.where})".replace(" )", ")")
            for x in timelines if x is not worst
        )
        console.print(
            f"  {name}: the step peaks at {human_bytes(worst.peak.bytes)}{where}, {worst.peak.label()}: {live}"
            f"{others}; {human_bytes(worst.steady.bytes)} between steps", highlight=False,
        )


_STAGE_TITLES = {"only": "Per-GPU memory", "first": "Per-GPU memory, first stage", "last": "Per-GPU memory, last stage"}


def stage_table(stages: list[StageTotal], names: list[str]) -> Table:
    """One row per term of one stage, one column per strategy."""
    table = Table(title=_STAGE_TITLES[stages[0].stage.name])
    table.add_column("term", no_wrap=True)
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)
    for rows in zip(*(st.terms for st in stages)):
        table.add_row(rows[0].name, *(human_bytes(x.bytes) for x in rows))
    held = (f"[dim]{sum(st.params.values()):,}[/dim]" for st in stages)
    table.add_row("[dim]parameters held[/dim]", *held, end_section=True)
    table.add_row("[bold]total[/bold]", *(f"[bold]{human_bytes(st.bytes())}[/bold]" for st in stages))
    return table
