"""Figures: activation memory against s or t, and what each tensor adds to it.

Two views of the same numbers: `line_figure` draws one line per strategy over
a swept size (from `memcalc.sizing.sweep`), `breakdown_figure` stacks one bar per
strategy from the ledger's tensors (from `memcalc.model.evaluate.estimate`). Bytes
are shown in GiB (2^30 bytes), and every axis says so.

matplotlib is imported inside the functions (it costs about a second), and
figures are `matplotlib.figure.Figure` objects drawn on an Agg canvas, never
pyplot: no global state, no window, the same pixels on every machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from memcalc.errors import ConfigError, MemcalcError
from memcalc.model.evaluate import LayerEstimate
from memcalc.output import atomic_write
from memcalc.text import printable
from memcalc.units import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

GIB = 2**30
LINE_SIZE = (8.0, 5.0)  # inches; at DPI, an 800 x 500 PNG
BREAKDOWN_SIZE = (10.0, 5.0)  # wider: the legend of tensor names sits beside the bars
DPI = 100
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
    """Bytes against `x`, one line per label in `lines` (NaN leaves a gap); `layers`
    says how many layers the bytes cover, for the axis label.

    The x axis is logarithmic (base 2) when x spans a factor of 8 or more, as
    geometric ranges do; the y axis is logarithmic when the values span more
    than a factor of 100, so that small strategies do not flatten to zero.
    """
    import numpy as np

    fig, ax = _figure(titles, LINE_SIZE)
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
    estimates: Sequence[LayerEstimate], by_block: bool, layers: int, titles: Titles, device_memory: int | None = None
) -> Figure:
    """One stacked bar per strategy: a segment per ledger tensor (or per block), bottom to
    top in forward order, each bar's total above it. `layers` multiplies one layer's bytes."""
    fig, ax = _figure(titles, BREAKDOWN_SIZE)
    names = [r.strategy.name for r in estimates]
    segments = _segments(estimates, by_block)
    bottoms = [0.0] * len(estimates)
    colours = _colours(list(segments))
    for (label, sizes), colour in zip(segments.items(), colours):
        heights = [layers * n / GIB for n in sizes]
        ax.bar(names, heights, bottom=bottoms, color=colour, edgecolor="white", linewidth=0.5, label=label, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, r in enumerate(estimates):
        ax.annotate(human_bytes(layers * r.per_layer_bytes), (i, bottoms[i]), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=9)
    ax.set_xticks(range(len(estimates)), [f"{r.strategy.name}\n({r.strategy.title})" for r in estimates], fontsize=9)
    ax.set_ylabel(_bytes_label(layers))
    _device_line(ax, device_memory)
    ax.set_ylim(0, max(bottoms + [device_memory / GIB if device_memory else 0]) * 1.12)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7.5, frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


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


def _segments(estimates: Sequence[LayerEstimate], by_block: bool) -> dict[str, list[int]]:
    """Label -> bytes per strategy, in forward order; every strategy saves the same tensors."""
    segments: dict[str, list[int]] = {}
    for i, r in enumerate(estimates):
        for x in r.tensors:
            label = x.tensor.block if by_block else x.tensor.name
            segments.setdefault(label, [0] * len(estimates))[i] += x.bytes
    return segments


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


def _figure(titles: Titles, size: tuple[float, float]) -> tuple[Figure, Axes]:
    """A figure on an Agg canvas, laid out so that nothing is clipped at a fixed size."""
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
    ax = fig.add_subplot()
    ax.set_title(literal(titles.details), fontsize=8.5, color="0.35")
    return fig, ax


def literal(text: str) -> str:
    """`text` drawn as written: a name like '$\\frac{$' is not mathtext; control characters show as escapes."""
    return printable(text).replace("$", r"\$")


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
