"""`memcalc sweep`: many configurations at once, as CSV, JSON or a table.

Without --out or --format: a table on a terminal, CSV into a pipe or file (so `> runs.csv` and `| head` do what
they look like). numpy and rich are imported inside the command.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import click

from memcalc.cli import note
from memcalc.cli.options import (
    EXPERT_FLAGS, KNOB_FLAGS, SIZE_FLAGS, STRATEGY_CHOICES, accounting_options, config_option, file_fields,
    hf_config_option, knob_option, note_left_out,
)
from memcalc.cli.types import INTEGER, Parsed
from memcalc.config.schema import field_help
from memcalc.errors import in_file
from memcalc.model.knobs import KNOBS, Accounting
from memcalc.model.strategy import STRATEGIES, Strategy

if TYPE_CHECKING:  # numpy: only when the command runs
    from memcalc.sizing.sweep import Sweep, SweepResult

FORMATS = {".csv": "csv", ".json": "json"}
PROGRESS_ROWS = 200_000  # below this a sweep is done before a bar would draw
TABLE_ROWS = 40  # a longer table shows its first and last 20 rows


def _values(text: str) -> Sequence[int]:
    """A list or range of sizes (`memcalc.sizing.sweep.parse_values`; numpy loads with it, when a flag is read)."""
    from memcalc.sizing.sweep import parse_values

    return parse_values(text)


VALUES = Parsed("VALUES", _values)


SWEPT_KNOBS = ("num_experts", "moe_router_topk")  # E and k take ranges; every other knob one value
RANGE_FLAGS = (*SIZE_FLAGS, *SWEPT_KNOBS, "ep")  # each takes one value, a list or a range


def size_range_options(f: Callable) -> Callable:
    """--b .. --L and, for experts, --num-experts, --moe-router-topk and --ep, each a list or range; --etp one value."""
    f = click.option("--etp", "etp", type=INTEGER, help="Expert tensor-parallel size (memcalc models etp = t).")(f)
    for name in reversed(RANGE_FLAGS):
        meaning = field_help(name)
        help_text = f"{meaning[:1].upper()}{meaning[1:]}: one value, a list or a range."
        f = click.option(f"--{name.replace('_', '-')}", name, type=VALUES, help=help_text)(f)
    return f


def single_knob_options(f: Callable) -> Callable:
    """Every knob's flag but those SWEPT_KNOBS takes as ranges, one value each (built here: only sweep has them)."""
    for knob in reversed(KNOBS):
        if knob.name not in SWEPT_KNOBS:
            f = knob_option(knob)(f)
    return f


def check_out(ctx: click.Context, param: click.Parameter, out: Path | None) -> Path | None:
    """Refuse an --out path that cannot be written, before any work is done (`memcalc.output.check_writable`)."""
    if out is None:
        return None
    from memcalc.output import OutputError, check_writable

    if os.path.isdir(out):  # os.path's: False, not OSError, for a name too long (check_writable names that)
        raise click.BadParameter(f"'{out}' is a directory", ctx, param)
    if not os.path.isdir(out.parent):
        raise click.BadParameter(f"directory '{out.parent}' does not exist", ctx, param)
    try:
        check_writable(out)
    except OutputError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return out


strategies_option = click.option(
    "--strategy", "strategy", type=click.Choice(STRATEGY_CHOICES), multiple=True, default=("all",), show_default=True,
    help="Strategy to evaluate; repeat for several. all: every layout the implementation runs for the knobs.",
)


def chosen_strategies(choices: Sequence[str]) -> list[Strategy] | None:
    """The strategies --strategy names, each once, in STRATEGIES' order; None for "all" (known once knobs are read)."""
    if "all" in choices:
        return None
    return [st for name, st in STRATEGIES.items() if name in choices]


def build_sweep(
    params: dict[str, Any], ranges: dict[str, Sequence[int]], strategies: Sequence[Strategy] | None,
    accounting: Accounting,
) -> Sweep:
    """A checked `memcalc.sizing.sweep.Sweep`: the file's fields, the size and knob flags over them, `ranges`
    over those, errors naming the file; with `strategies` None, a layout left out is named on stderr."""
    from memcalc.sizing.sweep import make_sweep

    fields, path, read = file_fields(params)
    fields.update({k: params[k] for k in SIZE_FLAGS + EXPERT_FLAGS + KNOB_FLAGS
                   if params.get(k) is not None and k not in ranges})
    with in_file(path):
        sweep = make_sweep(fields, ranges, strategies, accounting)
    if read is not None:
        note(f"memcalc: {read}")
    if strategies is None:
        note_left_out(sweep.knobs)
    return sweep


@click.command("sweep")
@config_option
@hf_config_option
@size_range_options
@single_knob_options
@strategies_option
@accounting_options
@click.option(
    "--out", type=click.Path(path_type=Path), callback=check_out,
    help="Write every row to this file; .csv or .json picks the format.",
)
@click.option(
    "--format", "fmt", type=click.Choice(["csv", "json", "table"]),
    help="Output format [default: from --out's suffix; else a table on a terminal, CSV when piped].",
)
def command(
    strategy: tuple[str, ...], exact: bool, device: str, out: Path | None, fmt: str | None, **params: Any
) -> None:
    """Activation bytes for every combination of the given sizes and strategies.

    Each of --b --s --h --a --t --L (and, for a mixture of experts, --num-experts
    --moe-router-topk --ep) takes one value, a list (1024,2048), an arithmetic
    range start:stop[:step] with stop included (1:64, 64:65536:64) or a
    geometric one start:stop:xK (1024:32768:x2); sizes not given come from
    --config or --hf-config. Configurations that break a rule (e.g. t must divide
    a, s under tp-sp, ep must divide the experts) are skipped and counted in one
    line on stderr.

    \b
    CSV columns: b,s,h,a,t,L,strategy,per_layer_bytes,total_bytes, then the
    knobs, ep and the accounting, so that each row is a whole configuration.
    JSON holds the knobs once and one list per column (E, k and ep among them
    when the model has experts).

    \b
    Example: memcalc sweep --config gpt3-175b --b 1:8 --s 1024:32768:x2
             memcalc sweep --config gpt3-175b --b 1:100 --s 64:640000:64 --out runs.csv
    """
    fmt = _output_format(out, fmt)
    from memcalc.sizing.sweep import describe_skips, evaluate_sweep

    ranges = {name: params[name] for name in RANGE_FLAGS if params.get(name) is not None}
    sweep = build_sweep(params, ranges, chosen_strategies(strategy), Accounting(exact=exact, device=device))
    rows_to_terminal = out is None and fmt != "table" and sys.stdout.isatty()
    with _progress(sweep.rows, shown=not rows_to_terminal) as advance:
        result = evaluate_sweep(sweep, advance)
        if fmt != "table":
            _write(result, fmt, out, advance)
    if fmt == "table":
        _print_table(result)
    skipped = describe_skips(result)
    if skipped:
        note(f"memcalc: note: {skipped}")


def _output_format(out: Path | None, fmt: str | None) -> str:
    """--format if given, else --out's suffix, else a table for a person and CSV for a pipe."""
    if out is not None:
        if fmt == "table":
            raise click.UsageError("--format table prints to the terminal; write --out files as csv or json")
        if fmt is None and out.suffix.lower() not in FORMATS:
            raise click.UsageError(f"cannot tell the format of '{out}' from its suffix: use .csv or .json, or --format")
        return fmt or FORMATS[out.suffix.lower()]
    return fmt or ("table" if sys.stdout.isatty() else "csv")


def _write(result: SweepResult, fmt: str, out: Path | None, advance: Callable[[float], None]) -> None:
    """Stream the rows to --out or to stdout, chunk by chunk."""
    from memcalc.cli.sweep_output import csv_chunks, json_chunks

    chunks = csv_chunks(result) if fmt == "csv" else json_chunks(result)
    if out is not None:
        from memcalc.output import atomic_write

        with atomic_write(out) as stream:  # whole or not at all: a temporary file, renamed when complete
            _copy(chunks, stream.write, advance)
        return
    binary = getattr(sys.stdout, "buffer", None)  # absent when stdout is swapped for a StringIO
    _copy(chunks, binary.write if binary else lambda data: sys.stdout.write(data.decode()), advance)
    sys.stdout.flush()


def _copy(
    chunks: Iterator[tuple[float, bytes]], write: Callable[[bytes], Any], advance: Callable[[float], None]
) -> None:
    for rows, data in chunks:
        write(data)
        advance(rows)


@contextmanager
def _progress(rows: int, shown: bool) -> Iterator[Callable[[float], None]]:
    """A rich bar on stderr for a long sweep, if stderr is a terminal; else nothing."""
    if not shown or rows < PROGRESS_ROWS or not sys.stderr.isatty():
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"sweep: {rows:,} configurations", total=2 * rows)  # evaluating, then writing
        yield lambda n: bar.advance(task, n)


LABELS = {"num_experts": "E", "moe_router_topk": "k"}  # a swept expert count or top-k, as a column names it


class SweptKnobs:
    """A sweep's knobs as a table's or figure's first line words them: a swept E or k by its column's name, the
    other knobs as set (a knob set holds one E and one k, which would misname the other rows)."""

    def __init__(self, knobs: Any, swept: Sequence[str]) -> None:
        self._knobs = knobs
        self._swept = {name: LABELS[name] for name in swept if name in LABELS}

    def __getattr__(self, name: str) -> Any:
        return self._swept[name] if name in self._swept else getattr(self._knobs, name)


def _print_table(result: SweepResult) -> None:
    """The rows as a rich table: swept sizes, strategy, bytes; long tables keep head and tail."""
    from rich.table import Table

    from memcalc.cli.render import accounting_note, console, describe_knobs
    from memcalc.text import for_rich
    from memcalc.units import human_bytes

    sweep = result.sweep
    swept = [n for n in sweep.axes if len(sweep.values[n]) > 1]
    fixed = " ".join(f"{n}={sweep.values[n][0]}" for n in SIZE_FLAGS if n not in swept) + (
        f" ep={sweep.ep}" if sweep.ep not in (None, 1) else "")
    name = f"{for_rich(sweep.name)}: " if sweep.name else ""  # a name from a file may hold markup or escapes
    console.print(f"{name}{fixed} | {describe_knobs(SweptKnobs(sweep.knobs, swept))}")
    console.print(f"[dim]{accounting_note(sweep.accounting, sweep.knobs.impl)}[/dim]")
    layers = "all L layers" if "L" in swept else f"all {sweep.values['L'][0]} layers"
    table = Table(title="Activation memory per GPU")
    for col in (*(LABELS.get(n, n) for n in swept), "strategy", "per layer", layers):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    half = TABLE_ROWS // 2
    shown = range(result.rows) if result.rows <= TABLE_ROWS else [*range(half), *range(result.rows - half, result.rows)]
    for i in shown:
        if i == result.rows - half and result.rows > TABLE_ROWS:
            table.add_row(*["..."] * (len(swept) + 3))
        row = result.row(i)
        table.add_row(*(str(row[n]) for n in swept), row["strategy"],
                      human_bytes(row["per_layer_bytes"]), human_bytes(row["total_bytes"]))
    if result.rows > TABLE_ROWS:
        table.caption = f"the first and last {half} of {result.rows:,} rows; --out FILE.csv writes them all, in bytes"
    console.print(table)
