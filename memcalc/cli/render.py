"""Rich tables for people. Imported only when output goes to a person, not for --json."""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any, Sequence

from rich.console import Console, ConsoleDimensions
from rich.measure import Measurement
from rich.table import Table

from memcalc.config.schema import ModelConfig
from memcalc.model.knobs import KNOBS, Accounting
from memcalc.model.departures import PaperComparison
from memcalc.model.departures import describe as describe_departure
from memcalc.model.evaluate import LayerEstimate
from memcalc.model.ledger import SavedTensor
from memcalc.errors import ConfigError
from memcalc.text import for_rich, whole_number
from memcalc.units import human_bytes

if TYPE_CHECKING:  # per-GPU totals load only when --totals asks for them
    from memcalc.config.gpus import Budget
    from memcalc.sizing.totals import PerGpu, StageTotal


PIPED_WIDTH = 1000  # output that is not a terminal is laid out at this width, whatever COLUMNS says: lines whole
NARROW_WIDTH = 40  # below this every line is printed whole and the terminal wraps it


class _Console(Console):
    """rich's Console with memcalc's rules: a closed pipe is `memcalc.cli.main`'s to handle (rich would exit 1);
    output that is not a terminal never depends on COLUMNS; a table too wide is listed as 'key: value' lines
    rather than cut to fit, so every number stays whole."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "stdout's reader closed the pipe")

    def _size(self) -> ConsoleDimensions:
        width, height = Console.size.fget(self)
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(PIPED_WIDTH, height)
        if self._width is None:
            width = _columns() or width
        return ConsoleDimensions(max(width, 1), height)  # at width 0 rich prints nothing at all

    size = property(_size, Console.size.fset)

    def print(self, *objects: Any, **options: Any) -> None:
        narrow = self.width < NARROW_WIDTH  # lines are left to the terminal to wrap: rich would cut a long word
        if narrow or any(isinstance(x, Table) and not self._fits(x) for x in objects):
            for x in objects:
                for line in table_lines(x) if isinstance(x, Table) else [x]:
                    super().print(line, **(options | {"soft_wrap": True, "highlight": False}))
            return
        super().print(*objects, **options)

    def _fits(self, table: Table) -> bool:
        """Whether rich can lay `table` out in this width by wrapping words, cutting no cell (PIPED_WIDTH is wider
        than any memcalc table: only a terminal is measured, which costs a quarter of drawing the table)."""
        if self.width >= PIPED_WIDTH:
            return True
        return Measurement.get(self, self.options.update_width(1 << 20), table).minimum <= self.width


def _columns() -> int | None:
    """COLUMNS, where it is a positive whole number; else None (unset, 0, or not a number: ignored)."""
    try:
        columns = whole_number(os.environ.get("COLUMNS", ""))
    except ConfigError:
        return None
    return columns if columns > 0 else None


def table_lines(table: Table) -> list[str]:
    """A table as lines a narrow terminal shows whole: its title, then per row
    'first cell: header value; header value; ...' (rich markup kept, line breaks in cells as spaces)."""
    first, *others = table.columns
    cells = [list(c.cells) for c in others]
    lines = [str(table.title)] if table.title else []
    for i, key in enumerate(first.cells):
        values = "; ".join(f"{c.header} {_one_line(column[i])}" for c, column in zip(others, cells))
        lines.append(f"  {_one_line(key)}: {values}")
    return lines + ([str(table.caption)] if table.caption else [])


def _one_line(cell: Any) -> str:
    return " ".join(str(cell).split("\n"))


# No highlighting or emoji codes: memcalc's markup says what is styled (a model name's ':x:' stays text). COLUMNS
# is hidden from rich, which would apply it to piped output too; `_size` reads it for a terminal only.
console = _Console(
    highlight=False, emoji=False, _environ={k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
)


def new_table(title: str | None, left: Sequence[str] = (), right: Sequence[str] = (), *, wrap: bool = False,
              **options: Any) -> Table:
    """A table whose `left` columns hold names (on one line unless `wrap`) and whose `right` columns hold numbers,
    right-aligned on one line; `options` go to rich's Table (a caption, edge padding)."""
    table = Table(title=title, **options)
    for col in left:
        table.add_column(col, no_wrap=not wrap)
    for col in right:
        table.add_column(col, justify="right", no_wrap=True)
    return table


def describe(config: ModelConfig) -> str:
    """One line naming the model's sizes and knobs."""
    c = config
    name = f"{for_rich(c.name)}: " if c.name else ""  # a name from a file may hold markup or terminal escapes
    return f"{name}b={c.b} s={c.s} h={c.h} a={c.a} t={c.t} L={c.L} | {describe_knobs(c)}"


def describe_knobs(knobs: Any) -> str:
    """'gelu (ffn 49152), eager attention (96 K/V groups), layernorm, dropout 0.1, recompute none, bf16', each
    knob's words from the knob table."""
    return ", ".join(words for k in KNOBS if (words := k.describe(knobs)))


def accounting_note(accounting: Accounting, impl: str) -> str:
    """How the bytes were counted and whose layer keeps them, for the line above a table."""
    if impl == "paper":
        whose = "the paper's accounting"
    else:
        from memcalc.model.impls import IMPLEMENTATIONS

        whose = f"impl {impl}'s accounting (what {IMPLEMENTATIONS[impl].title}'s layer keeps)"
    if accounting.exact:
        return f"exact {whose}, every saved byte, norm statistics as on {accounting.device}"
    return f"{whose}; --exact adds norm statistics and LSE"


def print_estimates(
    config: ModelConfig, accounting: Accounting, results: list[LayerEstimate], baseline: LayerEstimate, breakdown: bool,
    comparisons: list[PaperComparison],
) -> None:
    """The per-strategy table, each departure from the paper's numbers and, if asked, the per-tensor table."""
    console.print(describe(config))
    if config.cp > 1:
        console.print(f"context parallel: cp={config.cp}, so each rank keeps s/cp = {config.s // config.cp} tokens")
    console.print(f"[dim]{accounting_note(accounting, config.impl)}[/dim]")
    table = new_table("Activation memory per GPU", ["strategy"], ("per layer", f"all {config.L} layers", "vs none"),
                      wrap=True)
    for r in results:
        ratio = r.per_layer_bytes / baseline.per_layer_bytes
        table.add_row(r.strategy.name, _bytes_cell(r.per_layer_bytes), _bytes_cell(r.total_bytes), f"{ratio:.4f}")
    console.print(table)
    for line in departure_lines(config, comparisons):
        console.print(line)
    if breakdown:
        console.print(breakdown_table(results, comparisons))


def departure_lines(config: ModelConfig, comparisons: list[PaperComparison]) -> list[str]:
    """One line per rule by which the implementation departs from the paper's numbers (its bytes per layer under
    each layout it departs in), or the one line that says it departs in none, or why the paper has no number."""
    if config.impl == "paper" or not comparisons:
        return []
    refused = next((c.not_modelled for c in comparisons if c.not_modelled), None)
    if refused is not None:
        return [f"[dim]no comparison with the paper's accounting: {for_rich(refused)}[/dim]"]
    rules: dict[str, list[str]] = {}
    for c in comparisons:
        for d in c.departures:
            rules.setdefault(describe_departure(d), []).append(f"{c.paper.strategy.name} {d.bytes:+,} B per layer")
    if not rules:
        return [f"[dim]impl {config.impl} keeps the paper's bytes here, tensor by tensor[/dim]"]
    return [f"departs from the paper ({', '.join(where)}): {for_rich(rule)}" for rule, where in rules.items()]


def _bytes_cell(n: int) -> str:
    """Exact bytes over the same number in binary units."""
    return f"{n:,} B\n[dim]{human_bytes(n)}[/dim]"


def breakdown_table(results: list[LayerEstimate], comparisons: list[PaperComparison]) -> Table:
    """One row per saved tensor, keyed by name (a layout, or the paper, may keep one the others do not), one column
    of per-layer bytes per strategy; where the implementation departs from the paper, the paper's bytes below."""
    table = new_table("Per-tensor bytes per GPU, one layer", ["tensor"], [r.strategy.name for r in results], wrap=True)
    papers = [c.paper if c.departures else None for c in comparisons]
    compared = [p for p in papers if p is not None]
    for x, cells in tensor_rows([*results, *compared]):
        theirs = iter(cells[len(results):])
        paper_cells = [next(theirs) if p is not None else ... for p in papers]
        label = x.name if x.paper else f"{x.name} [dim](exact)[/dim]"
        table.add_row(label, *(_cell(mine, paper) for mine, paper in zip(cells[:len(results)], paper_cells)))
    totals = (_cell(r.per_layer_bytes, p.per_layer_bytes if p is not None else ...) for r, p in zip(results, papers))
    table.add_row("[bold]total[/bold]", *(f"[bold]{cell}[/bold]" for cell in totals), end_section=True)
    return table


def tensor_rows(results: list[LayerEstimate]) -> list[tuple[SavedTensor, list[int | None]]]:
    """Each saved tensor of any strategy, with its bytes under each (None where that strategy keeps no such tensor).

    Rows are keyed by name (and which of a name kept twice), never by position: strategies may keep different
    tensors. A tensor only some keep is placed after the one before it in the first strategy that keeps it.
    """
    keys: list[tuple[str, int]] = []
    tensors: dict[tuple[str, int], SavedTensor] = {}
    columns: list[dict[tuple[str, int], int]] = []
    for r in results:
        column: dict[tuple[str, int], int] = {}
        at = 0
        for x in r.tensors:
            key = (x.tensor.name, sum(k[0] == x.tensor.name for k in column))
            column[key] = x.bytes
            if key in tensors:
                at = keys.index(key) + 1
            else:
                tensors[key] = x.tensor
                keys.insert(at, key)
                at += 1
        columns.append(column)
    return [(tensors[k], [column.get(k) for column in columns]) for k in keys]


def _cell(mine: int | None, paper: Any) -> str:
    """A tensor's bytes ('-' where not kept), with the paper's below where they differ (`...`: no comparison)."""
    text = "-" if mine is None else f"{mine:,}"
    if paper is ... or paper == mine:
        return text
    return f"{text}\n[dim]paper {'-' if paper is None else f'{paper:,}'}[/dim]"


def describe_layout(config: ModelConfig) -> str:
    """One line naming the parallel layout and what the model's ends and parameters are."""
    from memcalc.sizing.params import padded_vocab
    from memcalc.sizing.states import describe_sharding, total_params

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


# A verdict in words: "maybe" where states + saved activations fit and the step's peak, above them, is not modelled.
_VERDICT = {True: "yes", False: "no", None: "maybe"}


def print_totals(config: ModelConfig, per: list[PerGpu], device: Budget, peaks: dict) -> None:
    """A table per bounding pipeline stage, every term by name, a verdict per strategy, and the step's peak."""
    from memcalc.sizing.verdict import need

    console.print(describe_layout(config))
    for i, stage in enumerate(per[0].stages):
        console.print(stage_table([p.stages[i] for p in per], [p.strategy.name for p in per]))
        where = "" if stage.stage.name == "only" else f"{stage.stage.name} stage: "
        console.print(f"[dim]{where}{stage.stage.schedule}[/dim]")
    budget = device.bytes
    console.print(f"Fits in {human_bytes(budget)} per GPU? ({device.source}: {human_bytes(device.device_bytes)}, less a"
                  f" {human_bytes(device.reserve_bytes)} reserve for what the allocator does not see)")
    for p in per:
        needed = need(p, peaks.get(p.strategy.name))
        where = f", {needed.stage} stage" if needed.stage != "only" else ""
        console.print(f"  {p.strategy.name}: {_VERDICT[needed.fits(budget)]}, {needed.bytes:,} B ="
                      f" {human_bytes(needed.bytes)} ({needed.basis}{where}), {human_bytes(abs(budget - needed.bytes))}"
                      f" {'left' if needed.bytes <= budget else 'over'}")
    from memcalc.sizing.states import sharding

    _print_peaks(peaks, sharded=sharding(config) != "megatron")


def _print_peaks(peaks: dict, sharded: bool) -> None:
    """Each strategy's step peak per bounding stage: when, what is live, and the steady state; or why not. Sharded by
    FSDP2 or ZeRO, the peak's moment in words too: which of their buffers sit on the states then."""
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
            f"{others}; {human_bytes(worst.steady.bytes)} between steps",
        )
        if sharded:
            from memcalc.sizing.timeline.words import in_words

            console.print(f"  {name}: at the peak, {in_words(worst.peak)}")




def stage_table(stages: list[StageTotal], names: list[str]) -> Table:
    """One row per term of one stage, one column per strategy."""
    name = stages[0].stage.name  # "only", "first", "last", or under torchtitan's split "rank 1"
    table = new_table("Per-GPU memory" if name == "only" else f"Per-GPU memory, {name} stage", ["term"], names)
    for rows in zip(*(st.terms for st in stages)):
        table.add_row(rows[0].name, *(human_bytes(x.bytes) for x in rows))
    held = (f"[dim]{sum(st.params.values()):,}[/dim]" for st in stages)
    table.add_row("[dim]parameters held[/dim]", *held, end_section=True)
    table.add_row("[bold]total[/bold]", *(f"[bold]{human_bytes(st.bytes())}[/bold]" for st in stages))
    return table
