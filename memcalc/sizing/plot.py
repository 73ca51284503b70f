"""Figures: activation memory against s or t (`line_figure`), per tensor (`breakdown_figure`), and one step
over time (`timeline_figure`), in GiB.

matplotlib is imported inside the functions (about a second), and figures are drawn on an Agg canvas, never
pyplot: no global state, no window, the same pixels on every machine.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from memcalc.errors import ConfigError, MemcalcError
from memcalc.model.evaluate import LayerEstimate
from memcalc.output import atomic_write
from memcalc.sizing.timeline.tape import CATEGORIES
from memcalc.text import printable
from memcalc.units import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from memcalc.sizing.timeline import Timeline

GIB = 2**30
LINE_SIZE = (8.0, 5.0)  # inches; at DPI, an 800 x 500 PNG
BREAKDOWN_SIZE = (10.0, 5.0)  # wider: the legend of tensor names sits beside the bars
TIMELINE_HEIGHT = 5.0  # inches; each strategy's panel is 5.5 wide
# The timeline's categories, bottom to top (their order): what is there all step, then what comes and goes.
CATEGORY_COLOURS = dict(zip(CATEGORIES, ("#4c72b0", "#55a868", "#8172b2", "#dd8452", "#c44e52")))
DPI = 100
CHARACTERS_PER_INCH = 16  # of the 8.5-point details line, about: where it wraps
SUFFIXES = (".png", ".svg")
X_LABELS = {"s": "sequence length s (tokens)", "t": "tensor-parallel size t (GPUs)"}
# One colour family per block, a shade per tensor: neighbours in the stack stay apart.
BLOCK_COLOURS = {"layer": "Greys", "ln1": "Greens", "attention": "Blues", "ln2": "Purples", "mlp": "Oranges"}


@dataclass(frozen=True)
class Titles:
    """What a figure is about: a headline and a line of details under it."""

    title: str
    details: str


def check_suffix(path: Path) -> str:
    """The image format an output path asks for: png or svg."""
    if path.suffix.lower() not in SUFFIXES:
        raise ConfigError(f"cannot tell the image format of '{path}': use .png or .svg")
    return path.suffix.lower()[1:]


def line_figure(
    x_name: str, x: Sequence[int], lines: dict[str, Sequence[float]], layers: int, titles: Titles,
    device_memory: int | None = None,
) -> Figure:
    """Bytes against `x`, one line per label in `lines` (NaN leaves a gap), over `layers` layers; an axis is
    logarithmic where its values span a factor of 8 (x, base 2) or 100 (y), so small strategies do not flatten."""
    import numpy as np

    fig, (ax,) = _panels(titles, LINE_SIZE, 1)
    marker = "o" if len(x) <= 40 else None
    for label, y in lines.items():
        ax.plot(x, np.asarray(y, dtype=float) / GIB, marker=marker, markersize=4, label=label)
    finite = np.concatenate([np.asarray(y, dtype=float) for y in lines.values()])
    finite = finite[np.isfinite(finite) & (finite > 0)]
    if min(x) > 0 and max(x) >= 8 * min(x):
        ax.set_xscale("log", base=2)
        if len(x) <= 12:
            ax.set_xticks(list(x))
        ax.xaxis.set_major_formatter(_formatter(_count_label))
        ax.xaxis.set_minor_formatter(_formatter(lambda v: ""))
    if finite.size and finite.max() > 100 * finite.min():
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(_formatter(lambda v: f"{v:g}"))
    else:
        ax.set_ylim(bottom=0)
    _device_line(ax, device_memory)
    ax.set_xlabel(X_LABELS.get(x_name, x_name))
    ax.set_ylabel(_bytes_label(layers))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    return fig


def breakdown_figure(
    estimates: Sequence[LayerEstimate], by_block: bool, layers: int, titles: Titles, device_memory: int | None
) -> Figure:
    """One stacked bar per strategy: a segment per ledger tensor (or per block), bottom to
    top in forward order, each bar's total above it. `layers` multiplies one layer's bytes."""
    fig, (ax,) = _panels(titles, BREAKDOWN_SIZE, 1)
    names = [r.strategy.name for r in estimates]
    segments = _segments(estimates, by_block, layers)
    bottoms = [0.0] * len(estimates)
    colours = _colours(list(segments))
    for (label, sizes), colour in zip(segments.items(), colours):
        heights = [n / GIB for n in sizes]
        ax.bar(names, heights, bottom=bottoms, color=colour, edgecolor="white", linewidth=0.5, label=label, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, r in enumerate(estimates):
        ax.annotate(human_bytes(r.layers_bytes(layers, 0, _copies(r, layers))), (i, bottoms[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=9)
    ax.set_xticks(range(len(estimates)), [f"{r.strategy.name}\n({r.strategy.title})" for r in estimates], fontsize=9)
    ax.set_ylabel(_bytes_label(layers))
    _device_line(ax, device_memory)
    ax.set_ylim(0, max(bottoms + [device_memory / GIB if device_memory else 0]) * 1.12)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def timeline_figure(timelines: Sequence[Timeline], titles: Titles, device_memory: int | None) -> Figure:
    """A panel per strategy: one step's memory per GPU, moment by moment (x), stacked by category, with the
    phases marked, the peak named and the device's memory as a line."""
    fig, axes = _panels(titles, (5.5 * len(timelines), TIMELINE_HEIGHT + 0.5), len(timelines))
    first = axes[0]
    for ax, timeline in zip(axes, timelines):
        _timeline_panel(ax, timeline, device_memory)
    top = max([x.peak.bytes for x in timelines] + [device_memory or 0]) / GIB
    first.set_ylim(0, top * 1.12)  # shared by every panel
    first.set_ylabel("memory per GPU over one step (GiB, $2^{30}$ bytes)")
    handles, labels = first.get_legend_handles_labels()
    axes[-1].legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                    frameon=False)
    return fig


def _timeline_panel(ax: Axes, timeline: Timeline, device_memory: int | None) -> None:
    moments = timeline.moments
    x = list(range(len(moments)))
    layers = [[m.by_category()[c] / GIB for m in moments] for c in CATEGORY_COLOURS]
    ax.stackplot(x, layers, labels=list(CATEGORY_COLOURS), colors=list(CATEGORY_COLOURS.values()), step="post")
    for i, m in enumerate(moments):
        if i and m.phase != moments[i - 1].phase:
            ax.axvline(i, color="0.4", linewidth=0.8, linestyle=":")
            ax.annotate(m.phase, (i, 0), xytext=(2, 2), textcoords="offset points", fontsize=7.5, color="0.3")
    peak = timeline.peak
    at = moments.index(peak)
    ax.plot([at], [peak.bytes / GIB], marker="v", color="black", markersize=5)
    ax.annotate(f"peak {human_bytes(peak.bytes)}: {peak.phase} {peak.where}", (at, peak.bytes / GIB), xytext=(0, 6),
                textcoords="offset points", ha="left" if at < len(moments) / 2 else "right", fontsize=7.5)
    _device_line(ax, device_memory)
    stage = "" if timeline.stage == "only" else f", {timeline.stage} stage"
    ax.set_title(f"{timeline.strategy.name} ({timeline.strategy.title}){stage}", fontsize=9)
    ax.set_xlabel("moments of one step, in order")
    ax.set_xlim(0, len(moments) - 1)
    ax.grid(True, axis="y", alpha=0.3)


def save(fig: Figure, path: Path) -> None:
    """Write the figure as PNG or SVG (by suffix) at DPI, uncropped: a PNG is
    exactly its figure size times DPI pixels."""
    fmt = check_suffix(path)
    with atomic_write(path) as stream:  # whole or not at all: a temporary file, renamed when complete
        fig.savefig(stream, format=fmt, dpi=DPI)


def _bytes_label(layers: int) -> str:
    """The y axis: what is counted, over how many layers, in which unit."""
    scope = "one layer" if layers == 1 else f"all {layers} layers"
    return f"activation memory per GPU, {scope} (GiB, $2^{{30}}$ bytes)"


def _segments(estimates: Sequence[LayerEstimate], by_block: bool, layers: int) -> dict[str, list[int]]:
    """Label -> bytes of `layers` layers per strategy, as `LayerEstimate.layers_bytes` counts them: all L layers each
    kind at its own count (dense layers beside MoE ones), one layer the MoE layer's; a model-wide tensor once for
    each kind of layer. In forward order; every strategy saves the same tensors."""
    segments: dict[str, list[int]] = {}
    for i, r in enumerate(estimates):
        dense = r.dense_layers if layers > 1 else 0
        kinds = ((x, layers - dense) for x in r.tensors), ((x, dense) for x in r.dense if not x.tensor.model_wide)
        for x, count in (pair for kind in kinds for pair in kind):
            label = x.tensor.block if by_block else x.tensor.name
            times = _copies(r, layers) if x.tensor.model_wide else count
            segments.setdefault(label, [0] * len(estimates))[i] += x.bytes * times
    return segments


def _copies(r: LayerEstimate, layers: int) -> int:
    """The copies of the model-wide tensors `layers` layers keep: one layer's one, all L layers' the estimate's."""
    return 1 if layers == 1 else r.model_wide_copies


def _colours(labels: list[str]) -> list[Any]:
    """A colour family per block (the part of a name before '/'), a shade per member."""
    from matplotlib import colormaps

    blocks = [label.split("/", 1)[0] for label in labels]
    colours = []
    for i, block in enumerate(blocks):
        family, rank = blocks.count(block), blocks[:i].count(block)
        shade = 0.6 if family == 1 else 0.3 + 0.55 * rank / (family - 1)
        colours.append(colormaps[BLOCK_COLOURS.get(block, "Greys")](shade))
    return colours


def _panels(titles: Titles, size: tuple[float, float], n: int) -> tuple[Figure, list[Axes]]:
    """A figure of `n` panels side by side sharing the y axis, on an Agg canvas, laid out so that nothing is clipped
    at a fixed size; the details line under the title."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MemcalcError(
            "memcalc plot needs matplotlib: pip install matplotlib (in a checkout: pip install -e '.[plot]')"
        ) from None
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(literal(titles.title), fontsize=13)
    axes = list(fig.subplots(1, n, sharey=True, squeeze=False)[0])
    # A long knob line (a mixture of experts says a lot) is wrapped to the figure's width, not cut at its edges.
    width = int(size[0] * CHARACTERS_PER_INCH)
    details = "\n".join(textwrap.fill(line, width) for line in literal(titles.details).split("\n"))
    if n == 1:
        axes[0].set_title(details, fontsize=8.5, color="0.35")
    else:
        fig.supxlabel(details, fontsize=8.5, color="0.35")
    return fig, axes


def literal(text: str) -> str:
    """`text` drawn as written, line by line: a name like '$\\frac{$' is not mathtext; other control characters
    show as escapes."""
    return "\n".join(printable(line).replace("$", r"\$") for line in text.split("\n"))


def _device_line(ax: Axes, device_memory: int | None) -> None:
    if device_memory is not None:
        ax.axhline(device_memory / GIB, color="crimson", linestyle="--", linewidth=1.2,
                   label=f"device memory ({human_bytes(device_memory)})")


def _formatter(label: Any) -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: label(v))


def _count_label(v: float) -> str:
    """1024 -> '1K', 32768 -> '32K', 8 -> '8': how sequence lengths are spoken of."""
    n = int(round(v))
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}K"
    return f"{n:g}" if n == v else f"{v:g}"
