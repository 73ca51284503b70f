"""Figures: the image files (size, format), the axes (units, scales), and that the
breakdown's segments are the ledger's tensors in forward order."""

import sys
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from memcalc.api import load  # noqa: E402
from memcalc.sizing import plot  # noqa: E402
from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError, MemcalcError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.impls import layer_tensors  # noqa: E402
from memcalc.model.knobs import Accounting, Knobs  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.units import human_bytes  # noqa: E402

from tests.helpers import seed_bytes  # noqa: E402

GPT3 = build_config(dict(name="gpt3-175b", b=1, s=2048, h=12288, a=96, t=8, L=96))
TITLES = plot.Titles("a model: activation memory", "b=1 h=12288")
S_VALUES = [1024, 2048, 4096, 8192, 16384, 32768, 65536]


def _seed_bytes(strategy: str, s: int, t: int = 8, b: int = 1, h: int = 12288, a: int = 96) -> int:
    return int(seed_bytes(strategy, b, s, h, a, t))


def _lines(xs=S_VALUES, **kw):
    series = {name: [96 * _seed_bytes(name, s=x, **kw) for x in xs] for name in ("none", "tp", "tp-sp")}
    return plot.line_figure("s", xs, series, 96, TITLES, device_memory=80 * 2**30)


def test_png_has_the_figure_size_times_dpi(tmp_path):
    path = tmp_path / "mem.png"
    plot.save(_lines(), path)
    width, height = plot.LINE_SIZE
    assert imread(path).shape == (height * plot.DPI, width * plot.DPI, 4)


def test_svg_is_xml_of_the_figure_size(tmp_path):
    path = tmp_path / "mem.svg"
    plot.save(_lines(), path)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert root.get("width") == f"{plot.LINE_SIZE[0] * 72:g}pt"  # points: 72 per inch


def test_memory_against_s_uses_log_axes_labelled_in_gib():
    ax = _lines().axes[0]
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")  # s x64, bytes span more than x100
    assert ax.get_ylabel() == "activation memory per GPU, all 96 layers (GiB, $2^{30}$ bytes)"
    assert ax.get_xlabel() == "sequence length s (tokens)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1K", "2K", "4K", "8K", "16K", "32K", "64K"]


def test_lines_are_in_gib_and_the_device_memory_is_a_labelled_line():
    ax = _lines().axes[0]
    by_label = {line.get_label(): line for line in ax.get_lines()}
    assert list(by_label["tp-sp"].get_ydata()) == [96 * _seed_bytes("tp-sp", s) / 2**30 for s in S_VALUES]
    assert list(by_label["device memory (80.00 GiB)"].get_ydata()) == [80, 80]


def test_a_narrow_span_keeps_linear_axes_from_zero():
    fig = plot.line_figure("t", [2, 4], {"tp": [3 * 2**30, 2 * 2**30]}, 1, TITLES)
    ax = fig.axes[0]
    assert (ax.get_xscale(), ax.get_yscale(), ax.get_ylim()[0]) == ("linear", "linear", 0)
    assert ax.get_ylabel().startswith("activation memory per GPU, one layer (GiB")


def _breakdown(by_block=False, config=GPT3):
    estimates = [estimate(config, st) for st in STRATEGIES.values()]
    return plot.breakdown_figure(estimates, by_block, config.L, TITLES, device_memory=80 * 2**30)


def test_breakdown_has_a_segment_per_ledger_tensor_in_forward_order():
    legend = [t.get_text() for t in _breakdown().axes[0].get_legend().get_texts()]
    names = [x.name for x in layer_tensors(Knobs.of(GPT3), Accounting())]
    assert legend == [*reversed(names), "device memory (80.00 GiB)"]  # top of the stack first


def test_breakdown_by_block_has_a_segment_per_block():
    legend = [t.get_text() for t in _breakdown(by_block=True).axes[0].get_legend().get_texts()]
    assert legend[:-1] == ["mlp", "ln2", "attention", "ln1"]


def test_each_bar_stacks_up_to_the_seeds_total():
    ax = _breakdown().axes[0]
    for i, name in enumerate(STRATEGIES):
        top = max(p.get_y() + p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 1e-9)
        assert top == pytest.approx(96 * _seed_bytes(name, s=2048) / 2**30)


def test_a_bar_of_dense_layers_beside_moe_ones_stacks_up_to_estimates_total():
    """DeepSeek-V3's first 3 layers keep a dense MLP's tensors, the other 58 the MoE's: not 61 MoE layers."""
    config = load("deepseek-v3")
    layer = estimate(config, STRATEGIES["none"])
    ax = plot.breakdown_figure([layer], False, config.L, TITLES, None).axes[0]
    assert max(p.get_y() + p.get_height() for p in ax.patches) == pytest.approx(layer.total_bytes / 2**30)


def test_breakdown_png_is_wider_for_its_legend(tmp_path):
    path = tmp_path / "b.png"
    plot.save(_breakdown(), path)
    width, height = plot.BREAKDOWN_SIZE
    assert imread(path).shape == (height * plot.DPI, width * plot.DPI, 4)


@pytest.mark.parametrize("name", ["mem.jpg", "mem", "mem.pdf"])
def test_only_png_and_svg_are_written(name):
    with pytest.raises(ConfigError, match="use .png or .svg"):
        plot.check_suffix(plot.Path(name))


def test_an_unwritable_path_is_one_error(tmp_path):
    with pytest.raises(MemcalcError, match="cannot write"):
        plot.save(_lines(), tmp_path / "missing" / "mem.png")


def test_without_matplotlib_the_error_says_how_to_install_it(monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MemcalcError, match=r"pip install matplotlib \(in a checkout: pip install -e '.\[plot\]'\)"):
        _lines()


def test_a_timeline_panel_stacks_each_moments_categories_up_to_its_bytes_and_names_the_peak():
    from memcalc.sizing.timeline import CATEGORIES, timeline

    step = timeline(build_config(dict(b=2, s=24, h=64, a=8, t=2, L=2, vocab_size=250)), STRATEGIES["tp-sp"])
    fig = plot.timeline_figure([step], TITLES, device_memory=2**21)
    ax = fig.axes[0]
    stacked = [c for c in ax.collections if c.get_label() in CATEGORIES]
    assert [c.get_label() for c in stacked] == list(CATEGORIES)  # bottom to top: states, then what comes and goes
    tops = stacked[-1].get_paths()[0].vertices[:, 1].max()
    assert tops == pytest.approx(step.peak.bytes / plot.GIB)
    assert any(t.get_text().startswith(f"peak {human_bytes(step.peak.bytes)}") for t in ax.texts)
