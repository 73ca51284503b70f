"""`memcalc formula`: the seed's formulas in text, LaTeX that parses back, JSON and sympy."""

import json
from pathlib import Path

import pytest
import sympy
from sympy.parsing.latex import parse_latex

from memcalc.model.formula import SYMBOLS
from memcalc.model.impls import layer_tensors
from memcalc.model.knobs import Accounting, Knobs

from tests.helpers import SEED_TEXT, seed_bytes

from . import memcalc_cli, one_line_error, shipped

b, s, h, a, t = (SYMBOLS[n] for n in "bshat")
SEED = {name: seed_bytes(name, b, s, h, a, t) for name in SEED_TEXT}


def _ok(*args: str) -> str:
    run = memcalc_cli("formula", *args)
    assert (run.code, run.err) == (0, "")
    return run.out


def test_text_prints_the_seeds_three_formulas():
    out = _ok()
    for name, text in SEED_TEXT.items():
        assert any(line.split() == [name, *text.split()] for line in out.splitlines()), name
    assert "b = micro-batch size" in out and "multiply by L" in out


def test_the_rope_tables_every_hf_layer_keeps_are_counted_once_in_all_l_layers():
    out = _ok("--impl", "hf", "--norm", "rmsnorm", "--mlp", "swiglu", "--exact")
    assert ("all L layers: multiply by L, but attention/rope_cos, attention/rope_sin once for all layers of a kind"
            " (the model makes them for every layer).") in " ".join(out.split())
    assert "once for all" not in _ok("--impl", "hf", "--norm", "rmsnorm", "--mlp", "swiglu")  # the paper's terms only


def test_text_lists_each_tensors_term():
    # The softmax output is 2bas^2 bytes: 2as/h per sbh, split by t under both tp and tp-sp.
    row = next(line for line in _ok().splitlines() if "attention/softmax_out" in line)
    assert [cell.strip() for cell in row.split("│")[1:-1]] == [
        "attention/softmax_out", "sbh(2as/h)", "sbh(2as/(ht))", "sbh(2as/(ht))",
    ]


def test_latex_pastes_into_a_paper_and_parses_back_to_the_seed():
    lines = _ok("--format", "latex").splitlines()
    assert [line.split(":")[0] for line in lines[::2]] == ["% none", "% tp", "% tp-sp"]
    for name, latex in zip(SEED, lines[1::2], strict=True):
        parsed = parse_latex(latex, backend="antlr").subs({sympy.Symbol(n): x for n, x in SYMBOLS.items()})
        assert sympy.simplify(parsed - SEED[name]) == 0, latex


def test_sympy_format_is_python_sympy_reads_back():
    for line in _ok("--format", "sympy").splitlines():
        name, expr = line.split(": ", 1)
        assert sympy.simplify(sympy.sympify(expr, locals=SYMBOLS) - SEED[name]) == 0


def test_json_has_every_strategys_formula_and_each_tensors_term():
    doc = json.loads(_ok("--format", "json"))
    assert list(doc["symbols"]) == ["b", "s", "h", "a", "t"]
    assert doc["accounting"] == {"exact": False, "device": "cuda"}
    for name, text in SEED_TEXT.items():
        entry = doc["strategies"][name]
        assert entry["formula"] == text
        assert {"latex", "sympy", "terms"} <= set(entry)
        assert [x["name"] for x in entry["terms"]] == [x.name for x in layer_tensors(Knobs(), Accounting())]
        assert all({"name", "formula", "latex", "paper"} <= set(x) for x in entry["terms"])


def test_knob_flags_change_the_formula():
    # Korthikanti et al. 2022: selective recomputation removes the 5as/h terms.
    out = _ok("--recompute", "selective", "--strategy", "tp-sp")
    assert "sbh(34/t)" in out and "5as" not in out


def test_a_config_with_gqa_and_its_own_ffn_writes_g_and_f():
    doc = json.loads(_ok("--config", shipped("llama3-70b"), "--format", "json"))
    assert {"g", "f"} <= set(doc["symbols"])
    assert doc["knobs"]["mlp"] == "swiglu" and doc["knobs"]["attention"] == "flash"


def test_exact_adds_the_per_token_norm_statistics():
    doc = json.loads(_ok("--exact", "--format", "json", "--strategy", "none"))
    assert doc["strategies"]["none"]["formula"] == "sbh(34 + 16/h + 5as/h)"
    stats = [x for x in doc["strategies"]["none"]["terms"] if not x["paper"]]
    assert {x["name"] for x in stats} == {"ln1/mean", "ln1/rstd", "ln2/mean", "ln2/rstd"}


@pytest.mark.parametrize("args, needle", [
    (["--s", "128", "--a", "8", "--t", "3"], "a=8 is not divisible by t=3"),
    (["--s", "127", "--a", "8", "--t", "2", "--strategy", "tp-sp"], "s=127 is not divisible by t=2"),
    (["--s", "128", "--a", "8", "--num-query-groups", "3"], "a=8 is not divisible by num_query_groups=3"),
])
def test_formula_at_sizes_no_layout_runs_is_refused_as_estimate_refuses_them(args, needle):
    # at a=8 t=3 it printed "b*a/t=1*6/3=2": a formula for a = 6, never the sizes asked for
    one_line_error(memcalc_cli("formula", *args), needle)
    one_line_error(memcalc_cli("estimate", "--h", "64", *args), needle)


@pytest.mark.parametrize("args", [["--s", "128"], ["--a", "8"], ["--b", "2"], ["--t", "2"]])
def test_formula_at_sizes_without_both_s_and_a_is_refused(args):
    # a size given without --s and --a: the formula's per-rank sizes need both, so it names them, never a guess
    one_line_error(memcalc_cli("formula", *args), "formula at given sizes needs --s and --a")


def test_at_sizes_sequence_parallelism_cannot_split_all_leaves_it_out_with_a_note_as_estimate_does():
    for command in (("formula",), ("estimate", "--h", "64")):
        result = memcalc_cli(*command, "--s", "127", "--a", "8", "--t", "2")
        assert result.code == 0, result.err
        assert result.err.splitlines()[-1] == ("memcalc: note: tp-sp left out: s=127 is not divisible by t=2 (sequence"
                                               " parallelism splits the sequence across t ranks)")
        assert "tp-sp" not in result.out and " tp " in result.out


def test_formula_at_sizes_takes_s_not_divisible_by_t_without_sequence_parallelism():
    assert "At b=1 s=127 a=8 t=2, tp is outside" in _ok("--s", "127", "--a", "8", "--t", "2", "--strategy", "tp")


def test_formula_and_explain_read_an_hf_config_as_estimate_does():
    # they took --config only: a config.json that estimate, sweep and fit read had no formula
    llama = str(Path(__file__).parents[1] / "data/hf/llama-tiny.json")
    doc = json.loads(_ok_with_note("--hf-config", llama, "--format", "json"))
    estimate = json.loads(memcalc_cli("estimate", "--hf-config", llama, "--json").out)
    config = estimate["config"]
    at = {SYMBOLS[n]: config[field] for n, field in (("b", "b"), ("s", "s"), ("h", "h"), ("a", "a"), ("t", "t"),
                                                    ("g", "num_query_groups"), ("f", "ffn_hidden_size"))}
    for name, entry in doc["strategies"].items():
        value = sympy.sympify(entry["sympy"], locals=SYMBOLS).subs(at)
        assert value == estimate["strategies"][name]["per_layer_bytes"], name
    assert "attention/q" in memcalc_cli("explain", "--hf-config", llama).out


def _ok_with_note(*args: str) -> str:
    """formula's output where stderr holds only what --hf-config read."""
    run = memcalc_cli("formula", *args)
    assert run.code == 0 and run.err.startswith("memcalc: read ") and run.err.count("\n") == 1, run.err
    return run.out


def test_formula_at_sizes_validates_the_file_at_those_sizes():
    # Mistral's file says s = 32768 beyond its 4096 window, which impl megatron refuses: --s 4096 was not applied
    mistral = str(Path(__file__).parents[1] / "data/hf/mistral-7b.json")
    assert "At b=1 s=4096 a=32 t=1" in _ok_with_note("--hf-config", mistral, "--s", "4096", "--a", "32")
    one_line_error(memcalc_cli("formula", "--config", shipped("tiny"), "--s", "16", "--a", "8", "--t", "3"),
                   "tiny.yaml: a=8 is not divisible by t=3")
