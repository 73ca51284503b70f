"""The notebook API (memcalc.api): the CLI's answers as typed results, and docs/api.md's example."""

from __future__ import annotations

import doctest
import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

import memcalc
from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError, DoesNotFit
from memcalc.model.evaluate import LayerEstimate
from memcalc.sizing.fit import Fit
from memcalc.sizing.sweep import SweepResult
from memcalc.cli import main
from memcalc.sizing.totals import PerGpu

ROOT = Path(__file__).parents[1]


def _cli_json(*args: str) -> dict:
    """What `memcalc ARGS --json` prints, read back."""
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit:
        main([*args, "--json"])
    assert exit.value.code in (0, DoesNotFit.exit_code)  # a "does not fit" verdict still prints its numbers
    return json.loads(out.getvalue())


def test_the_guides_worked_example_prints_what_the_page_shows():
    result = doctest.testfile(str(ROOT / "docs" / "api.md"), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0


def test_estimate_gives_the_clis_numbers_for_a_config_and_flags():
    cli = _cli_json("estimate", "--config", "gpt3-175b", "--t", "4", "--exact", "--strategy", "tp")
    layer = memcalc.estimate("gpt3-175b", strategy="tp", t=4, exact=True)
    assert isinstance(layer, LayerEstimate)
    assert (layer.per_layer_bytes, layer.total_bytes) == (
        cli["strategies"]["tp"]["per_layer_bytes"], cli["strategies"]["tp"]["total_bytes"])
    assert [x.tensor.name for x in layer.tensors] == [x["name"] for x in cli["strategies"]["tp"]["tensors"]]


def test_sizes_alone_need_no_config():
    layer = memcalc.estimate(b=1, s=2048, h=12288, a=96, t=8, L=96, recompute="selective", strategy="tp-sp")
    assert layer.per_layer_bytes == 2048 * 12288 * 34 // 8


def test_per_gpu_gives_the_totals_of_estimate_totals():
    cli = _cli_json("estimate", "--config", "gpt3-175b", "--dp", "8", "--pp", "4", "--strategy", "tp-sp", "--totals")
    totals = memcalc.per_gpu("gpt3-175b", strategy="tp-sp", dp=8, pp=4)
    assert isinstance(totals, PerGpu)
    assert totals.bytes() == cli["per_gpu"]["strategies"]["tp-sp"]["total_bytes"]


def test_fit_gives_the_row_of_memcalc_fit_for_that_recompute_choice():
    cli = _cli_json("fit", "--config", "gpt3-175b", "--budget", "80GiB", "--strategy", "tp-sp", "--recompute", "full")
    answer = memcalc.fit("gpt3-175b", budget=80 * 2**30, strategy="tp-sp", recompute="full")
    assert isinstance(answer, Fit)
    assert (answer.answer.value, answer.beyond.value) == (
        cli["results"][0]["answer"]["value"], cli["results"][0]["beyond"]["value"])


def test_a_loaded_config_can_be_reused_with_fields_changed():
    base = memcalc.load("gpt3-175b")
    assert isinstance(base, ModelConfig)
    assert memcalc.estimate(base, t=4).per_layer_bytes == memcalc.estimate("gpt3-175b", t=4).per_layer_bytes
    assert memcalc.estimate(base).per_layer_bytes == memcalc.estimate("gpt3-175b").per_layer_bytes


def test_sweep_takes_lists_ranges_and_the_clis_text_alike():
    grids = [memcalc.sweep("tiny", t=t, strategies=["tp"]) for t in ([1, 2], range(1, 3), "1:2", "1,2")]
    assert all(isinstance(g, SweepResult) for g in grids)
    assert {tuple(g.per_layer.tolist()) for g in grids} == {(90368, 55552)}


def test_sweep_skips_what_a_rule_refuses_and_counts_it():
    grid = memcalc.sweep("tiny", t=[1, 2, 3], strategies="tp")
    assert (grid.rows, [(s.rule.text, s.count) for s in grid.skipped]) == (2, [("t must divide a", 1)])
    assert repr(grid) == "<SweepResult tiny: 2 rows of 3 configurations (1 skipped); strategies tp>"


@pytest.mark.parametrize("call, needle", [
    (lambda: memcalc.estimate("gpt3-175b", t=7), "a=96 is not divisible by t=7"),
    (lambda: memcalc.estimate("tiny", strategy="sp"), "strategy='sp' is not one of none, tp, tp-sp"),
    (lambda: memcalc.estimate("tiny", device="tpu", exact=True), "device='tpu' is not one of cuda, cpu"),
    (lambda: memcalc.estimate("no-such-model"), "config file not found: no-such-model"),
    (lambda: memcalc.estimate("tiny", heads=8), "heads"),
    (lambda: memcalc.fit("tiny", budget="lots"), "cannot read 'lots' as a size"),
    (lambda: memcalc.fit("tiny", budget=-1), "budget=-1 must be a positive number of bytes"),
    (lambda: memcalc.fit("tiny", budget="1GiB", solve="h"), "solve='h' is not one of b, s, t"),
    (lambda: memcalc.fit("tiny", budget="1GiB", solve="t", strategy="none"), "no t to solve for"),
    (lambda: memcalc.sweep("tiny", t=[2, 2]), "repeats a value"),
    (lambda: memcalc.sweep("tiny", t=[0, 2]), "every value must be a positive whole number"),
    (lambda: memcalc.sweep("tiny", strategies=["tp", "sp"]), "strategy='sp'"),
])
def test_bad_input_raises_the_clis_one_line_config_error(call, needle):
    with pytest.raises(ConfigError) as error:
        call()
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_reprs_are_one_short_line():
    shown = [repr(x) for x in (
        memcalc.estimate("gpt3-175b"), memcalc.per_gpu("gpt3-175b"), memcalc.fit("tiny", budget="1GiB"),
        memcalc.sweep("gpt3-175b", s="1024:32768:x2", t="1:8"),
    )]
    assert all(len(r) < 120 and "\n" not in r and r.startswith("<") for r in shown), shown


def test_import_memcalc_loads_neither_the_api_nor_anything_heavy(starts_processes):
    probe = ("import sys, memcalc; before = sorted(m for m in sys.modules if m.startswith(('memcalc.', 'pydantic',"
             " 'numpy', 'sympy'))); memcalc.estimate; after = [m for m in ('numpy', 'sympy') if m in sys.modules];"
             " print(before, after)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "[] []", run.stderr


def test_an_unknown_attribute_of_the_package_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'estimat'"):
        memcalc.estimat  # noqa: B018
