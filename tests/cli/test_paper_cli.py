"""`--impl paper` on the command line, and every other implementation's departures from it, said in one line each."""

import json

import pytest

from . import memcalc_cli, one_line_error

SIZES = ("--b", "1", "--s", "96", "--h", "768", "--a", "12", "--t", "2")


def test_formula_of_the_paper_is_the_seeds_three_formulas():
    run = memcalc_cli("formula", "--impl", "paper")
    assert run.code == 0
    lines = run.out.splitlines()
    assert lines[0].startswith("Activation bytes per GPU, one layer; the paper's accounting")
    assert lines[1:4] == ["  none   sbh(34 + 5as/h)", "  tp     sbh(10 + 24/t + 5as/(ht))", "  tp-sp  sbh(34/t + 5as/(ht))"]


def test_the_header_says_the_papers_accounting_only_for_the_paper():
    paper = memcalc_cli("estimate", "--impl", "paper", *SIZES)
    megatron = memcalc_cli("estimate", *SIZES)
    assert "the paper's accounting" in paper.out
    assert "the paper's accounting" not in megatron.out and "impl megatron's accounting" in megatron.out


def test_outside_the_fused_window_megatron_names_its_departure_with_the_sizes_and_the_bytes():
    run = memcalc_cli("estimate", *SIZES, "--attention-softmax-in-fp32", "--strategy", "tp")
    text = " ".join(run.out.split())  # however the terminal wraps it
    assert text.count("departs from the paper") == 1
    assert "departs from the paper (tp +119,808 B per layer): b*a/t=1*12/2=6 is not a multiple of 8" in text
    assert "attention/softmax_fp32 +221,184 B" in text and "attention/softmax_out -110,592 B" in text


def test_inside_the_window_megatron_says_it_keeps_the_papers_bytes():
    run = memcalc_cli("estimate", "--b", "1", "--s", "512", "--h", "768", "--a", "16", "--t", "2")
    assert "impl megatron keeps the paper's bytes here, tensor by tensor" in run.out
    assert "departs" not in run.out


def test_breakdown_shows_the_papers_bytes_under_each_tensor_it_differs_in_keyed_by_name():
    run = memcalc_cli("estimate", *SIZES, "--strategy", "tp", "--breakdown")
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in run.out.splitlines() if line.startswith("│")]
    at = {row[0]: i for i, row in enumerate(cells) if row[0]}
    assert cells[at["attention/causal_mask"]][1] == "9,216" and cells[at["attention/causal_mask"] + 1] == ["", "paper -"]
    assert cells[at["attention/q"] + 1][0] == "attention/k"  # the same bytes: no paper line


def test_json_carries_the_papers_numbers_and_each_departure():
    doc = json.loads(memcalc_cli("estimate", *SIZES, "--strategy", "tp", "--json").out)
    tp = doc["strategies"]["tp"]
    paper = tp["paper"]
    assert doc["accounting"]["impl"] == "megatron"
    (departure,) = paper["departures"]
    assert departure["tensors"] == [{"name": "attention/causal_mask", "bytes": 96 * 96}]
    assert tp["per_layer_bytes"] - paper["per_layer_bytes"] == departure["bytes"] == 9216


def test_json_says_why_the_paper_has_no_number_for_a_layer_it_does_not_model():
    doc = json.loads(memcalc_cli("estimate", *SIZES, "--mlp", "swiglu", "--json").out)
    assert doc["strategies"]["none"]["paper"] == {"not_modelled": "mlp=swiglu is outside the paper's layer"}


@pytest.mark.parametrize("flags, knob", [
    (("--mlp", "swiglu"), "mlp=swiglu"), (("--attention", "flash"), "attention=flash"),
    (("--num-query-groups", "4"), "num_query_groups=4"), (("--num-experts", "8"), "num_experts=8"),
    (("--cp", "2"), "cp=2"), (("--dtype", "fp32"), "dtype=fp32"),
    (("--no-masked-softmax-fusion",), "masked_softmax_fusion=False"),
])
def test_the_paper_refuses_what_it_does_not_model_in_one_line_naming_the_knob(flags, knob):
    one_line_error(memcalc_cli("estimate", "--impl", "paper", *SIZES, *flags), knob)


@pytest.mark.parametrize("flag", ["--no-masked-softmax-fusion", "--attention-softmax-in-fp32"])
def test_megatrons_softmax_knobs_with_flash_attention_are_refused(flag):
    one_line_error(memcalc_cli("estimate", *SIZES, "--attention", "flash", flag), flag, "flash")


def test_megatrons_softmax_knobs_under_another_library_are_refused():
    one_line_error(memcalc_cli("estimate", "--impl", "hf", *SIZES, "--attention-softmax-in-fp32"),
                   "attention_softmax_in_fp32=True", "impl megatron only")
