"""`memcalc plot`: activation memory against s or t (a one-size sweep), the per-tensor breakdown (estimate
--breakdown as stacked bars) or one step's timeline, as PNG or SVG; matplotlib and numpy load inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import click

from memcalc.cli import note
from memcalc.cli.options import BYTES, SIZE_FLAGS, accounting_options, model_from, model_options, strategy_names
from memcalc.cli.sweep import VALUES, SweptKnobs, build_sweep, chosen_strategies, check_out, strategies_option
from memcalc.model.knobs import Knobs
from memcalc.errors import ConfigError
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES, Strategy
from memcalc.text import printable

if TYPE_CHECKING:  # matplotlib: only when the command runs
    from matplotlib.figure import Figure

DEFAULT_RANGES = {"s": "1024:131072:x2", "t": "1:64:x2", "num_experts": "8:256:x2", "moe_router_topk": "1:8",
                  "ep": "1:64:x2"}
X_WORDS = {"s": "sequence length", "t": "tensor-parallel size", "num_experts": "experts",
           "moe_router_topk": "experts per token", "ep": "expert-parallel size"}


def _image_out(ctx: click.Context, param: click.Parameter, out: Path) -> Path:
    """Refuse an --out that is not a writable .png or .svg path, before any work is done."""
    from memcalc.sizing.plot import check_suffix

    try:
        check_suffix(out)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return check_out(ctx, param, out)


@click.command("plot")
@model_options
@strategies_option
@accounting_options
@click.option(
    "--kind", type=click.Choice(["line", "breakdown", "timeline"]), default="line", show_default=True,
    help="line: memory against --x, a line per strategy; breakdown: a stacked bar per strategy, a segment per"
    " tensor; timeline: one training step's memory over time, stacked by category, a panel per strategy (the"
    " most loaded pipeline stage's).",
)
@click.option(
    "--x", "x_name", type=click.Choice(list(X_WORDS)), default="s", show_default=True,
    help="What the line view varies (the last three: a mixture of experts' E, k and ep).",
)
@click.option(
    "--range", "x_values", type=VALUES,
    help="Values of --x: a list or range as in `memcalc sweep`"
    f" [default: {', '.join(f'{x} {r}' for x, r in DEFAULT_RANGES.items())}].",
)
@click.option("--group", type=click.Choice(["tensor", "block"]), default="tensor", show_default=True,
              help="Breakdown segments: each saved tensor, or each block (norms, attention, MLP).")
@click.option("--per-layer", is_flag=True, help="One layer's bytes instead of all L layers'.")
@click.option("--device-memory", type=BYTES, help="Draw the device's memory as a line, e.g. 80GiB.")
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, callback=_image_out, help="Image to write: .png or .svg."
)
def command(
    strategy: tuple[str, ...], exact: bool, device: str, kind: str, x_name: str, x_values: Sequence[int] | None, group: str,
    per_layer: bool, device_memory: int | None, out: Path, **params: Any,
) -> None:
    """Plot activation memory per GPU (in GiB) for a model.

    \b
    Example: memcalc plot --config gpt3-175b --range 1024:65536:x2 --device-memory 80GiB --out s.png
             memcalc plot --config gpt3-175b --x t --range 1,2,4,8,16,32 --out t.svg
             memcalc plot --config gpt3-175b --kind breakdown --out breakdown.png
             memcalc plot --config llama3-70b --kind timeline --strategy tp-sp --device-memory 80GiB --out step.png

    Sizes not plotted come from --config and the size flags. Points that break
    a divisibility rule (e.g. t must divide s under tp-sp) leave a gap, counted
    in one line on stderr.
    """
    from memcalc.sizing import plot

    accounting = Accounting(exact=exact, device=device)
    strategies = chosen_strategies(strategy)
    if kind != "line" and x_values is not None:
        raise click.UsageError(f"--range applies to --kind line; the {kind} is drawn at the config's sizes")
    if kind == "line" and params.get(x_name) is not None:  # the line varies it: the flag's value would be dropped
        flag = "--" + x_name.replace("_", "-")
        raise click.UsageError(f"{flag} is the line's x axis (--x {x_name}); give its values with --range")
    if kind == "breakdown":
        figure = _breakdown(params, strategies, accounting, group == "block", per_layer, device_memory)
    elif kind == "timeline":
        figure = _timeline(params, strategies, device_memory, device)
    else:
        figure = _line(params, x_name, x_values, strategies, accounting, per_layer, device_memory)
    plot.save(figure, out)
    click.echo(f"wrote {printable(str(out))}")


def _breakdown(
    params: dict[str, Any], strategies: list[Strategy] | None, accounting: Accounting, by_block: bool,
    per_layer: bool, device_memory: int | None,
) -> Figure:
    """Estimate the config under each strategy, as `estimate --breakdown` does, and draw the stacked bars."""
    from memcalc.sizing import plot
    from memcalc.model.evaluate import estimate  # what `estimate --breakdown` shows

    config = model_from(params)
    layers = 1 if per_layer else config.L
    sizes = " ".join(f"{n}={getattr(config, n)}" for n in SIZE_FLAGS)
    titles = plot.Titles(f"{config.name or 'model'}: what each GPU keeps for backward",
                         _details(sizes, config, accounting))
    estimates = [estimate(config, st, accounting) for st in _runs(config, strategies)]
    return plot.breakdown_figure(estimates, by_block, layers, titles, device_memory)


def _runs(config: Any, strategies: list[Strategy] | None) -> list[Strategy]:
    """The strategies --strategy chose; for "all" (None), every layout the implementation runs (one left out named)."""
    return strategies if strategies is not None else [STRATEGIES[n] for n in strategy_names("all", config)]


def _timeline(params: dict[str, Any], strategies: list[Strategy] | None, device_memory: int | None,
              device: str = "cuda") -> Figure:
    """One step per strategy (`estimate --totals`' peak), its most loaded stage, drawn moment by moment."""
    from memcalc.sizing import plot
    from memcalc.sizing.timeline import timelines

    config = model_from(params)
    accounting = Accounting(exact=True, device=device)
    worst = [max(timelines(config, st, accounting), key=lambda x: x.peak.bytes) for st in _runs(config, strategies)]
    sizes = " ".join(f"{n}={getattr(config, n)}" for n in SIZE_FLAGS)
    titles = plot.Titles(f"{config.name or 'model'}: one training step's memory per GPU",
                         _details(sizes, config, accounting))
    return plot.timeline_figure(worst, titles, device_memory)


def _line(
    params: dict[str, Any], x_name: str, x_values: Sequence[int] | None, strategies: list[Strategy] | None,
    accounting: Accounting, per_layer: bool, device_memory: int | None,
) -> Figure:
    """Evaluate the one-size sweep and draw it."""
    from memcalc.sizing import plot
    from memcalc.sizing.sweep import describe_skips, evaluate_sweep, parse_values

    values = x_values if x_values is not None else parse_values(DEFAULT_RANGES[x_name])
    sweep = build_sweep(params, {x_name: values}, strategies, accounting)
    result = evaluate_sweep(sweep)
    skipped = describe_skips(result)
    if skipped:
        note(f"memcalc: note: {skipped}")
    layers = 1 if per_layer else sweep.values["L"][0]
    lines = {f"{st.name} ({st.title})": y for st, y in result.along(x_name, per_layer).items()}
    sizes = " ".join(f"{n}={sweep.values[n][0]}" for n in SIZE_FLAGS if n != x_name)
    titles = plot.Titles(f"{sweep.name or 'model'}: activation memory per GPU against {X_WORDS[x_name]}",
                         _details(sizes, SweptKnobs(sweep.knobs, [x_name]), accounting))
    return plot.line_figure(x_name, list(values), lines, layers, titles, device_memory)


def _details(sizes: str, knobs: Knobs, accounting: Accounting) -> str:
    """The line under a figure's title: fixed sizes, then knobs and accounting."""
    from memcalc.cli.render import describe_knobs

    counted = f"exact accounting (as on {accounting.device})" if accounting.exact else "the paper's accounting"
    return f"{sizes}\n{describe_knobs(knobs)}; {counted}"
