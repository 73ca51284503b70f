"""`memcalc plot` through click's test runner: the images it writes open at the
expected size, and bad input is one line with exit 2."""

import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("matplotlib")

from matplotlib.image import imread  # noqa: E402

from .test_sweep_cli import GPT3, _one_line_error, invoke  # noqa: E402


def test_memory_against_s_as_png(tmp_path):
    out = tmp_path / "mem.png"
    result = invoke("plot", "--config", GPT3, "--x", "s", "--range", "1024:65536:x2", "--device-memory", "80GiB",
                    "--out", str(out))
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"wrote {out}\n", "")
    assert imread(out).shape == (500, 800, 4)


def test_memory_against_t_as_svg_with_a_gap_where_t_does_not_divide_a(tmp_path):
    out = tmp_path / "t.svg"
    result = invoke("plot", "--config", GPT3, "--x", "t", "--out", str(out))  # default range 1:64:x2
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("memcalc: note: skipped 3 of 21 configurations")  # t=64 under each strategy
    assert "a=96 is not divisible by t=64" in result.stderr
    assert ET.parse(out).getroot().tag == "{http://www.w3.org/2000/svg}svg"


@pytest.mark.parametrize("x", ["num_experts", "moe_router_topk", "ep"])
def test_memory_against_a_mixture_of_experts_e_k_or_ep(tmp_path, x):
    out = tmp_path / f"{x}.png"
    result = invoke("plot", "--config", "mixtral-8x7b", "--x", x, "--moe-tokens", "worst", "--strategy", "tp-sp",
                    "--t", "2", "--out", str(out))  # default ranges: E 8..256, k 1..8, ep 1..64
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out}\n" and imread(out).shape == (500, 800, 4)
    if x == "ep":  # 16, 32 and 64 do not divide the 8 experts: skipped and said
        assert "memcalc: note: skipped 3 of 7 configurations" in result.stderr


def test_experts_axes_without_experts_are_one_line(tmp_path):
    _one_line_error(invoke("plot", "--config", GPT3, "--x", "ep", "--out", str(tmp_path / "x.png")),
                    "ep is given but num_experts is not")


@pytest.mark.parametrize("group", ["tensor", "block"])
def test_a_breakdown_is_a_1000_by_500_png_grouped_by_tensor_or_block(tmp_path, group):
    out = tmp_path / "breakdown.png"
    result = invoke("plot", "--config", GPT3, "--kind", "breakdown", "--group", group, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert imread(out).shape == (500, 1000, 4)


def test_one_steps_timeline_as_png_a_panel_per_strategy(tmp_path):
    out = tmp_path / "step.png"
    result = invoke("plot", "--config", GPT3, "--kind", "timeline", "--strategy", "tp", "--strategy", "tp-sp",
                    "--device-memory", "80GiB", "--out", str(out))
    assert (result.exit_code, result.stderr) == (0, ""), result.output
    assert imread(out).shape == (550, 1100, 4)


def test_a_timeline_the_step_does_not_model_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = invoke("plot", "--config", "tiny", "--kind", "timeline", "--impl", "torchtitan", "--t", "1", "--b", "1",
                 "--s", "1", "--loss-chunks", "0", "--out", "step.png")
    _one_line_error(run, "does not model b = s = 1")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, needles", [
    (["--out", "mem.jpg"], ["'--out'", "use .png or .svg"]),
    (["--out", "missing/mem.png"], ["'--out'", "directory 'missing' does not exist"]),
    (["--out", "mem.png", "--device-memory", "lots"], ["'--device-memory'", "cannot read 'lots' as a size"]),
    (["--out", "mem.png", "--range", "65536:1024"], ["'--range'", "is empty"]),
    (["--out", "mem.png", "--x", "b"], ["'--x'"]),
    (["--out", "mem.png", "--kind", "breakdown", "--range", "1:8"], ["--range applies to --kind line"]),
    (["--out", "mem.png", "--kind", "timeline", "--range", "1:8"], ["--range applies to --kind line"]),
    (["--out", "mem.png", "--x", "t", "--range", "5,7"], ["no configuration in the sweep passes"]),
    (["--out", "mem.png", "--range", f"1:{10**30}"], [f"s={10**30} is too large for a sweep"]),
    ([], ["Missing option '--out'"]),
])
def test_bad_input_is_one_line_and_exit_2(args, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(invoke("plot", "--config", GPT3, *args), *needles)
    assert list(tmp_path.iterdir()) == []
