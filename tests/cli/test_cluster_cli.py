"""`--gpus`, `--gpu`, `--reserve` and micro-batches per step on the command line, and exit code 3
("nothing fits") kept apart from 2 (bad input)."""

import json

import pytest

from . import memcalc_cli, one_line_error

ISSUE = ["--config", "llama3-70b", "--gpus", "64", "--gpu", "h100-80gb", "--t", "8", "--pp", "4",
         "--recompute", "selective"]


def test_the_issues_command_gives_the_layout_and_the_verdict_with_the_reserve():
    run = memcalc_cli("estimate", *ISSUE)
    assert run.code == 0, run.err
    assert "layout: 64 GPUs = t*pp*cp*dp = 8*4*1*2, pp=4 (1F1B), dp=2" in run.out
    assert "vocab 128256 padded to 129024" in run.out
    assert ("Fits in 76.65 GiB per GPU? (h100-80gb: 79.65 GiB, less a 3.00 GiB reserve for what the allocator"
            " does not see)") in run.out
    assert "  tp-sp: yes, 73,033,940,996 B = 68.02 GiB (the step's peak, first stage), 8.63 GiB left" in run.out
    # the peak: when, on which stage, and what is live then
    assert "  tp-sp: the step peaks at 68.02 GiB on the first stage, backward layers.19.mlp.fc2" in run.out
    assert "activations 29.69 GiB, temporaries 256.00 MiB; last stage 46.27 GiB (forward" in run.out


def test_json_carries_the_gpu_the_reserve_and_the_budget():
    doc = json.loads(memcalc_cli("estimate", *ISSUE, "--reserve", "5GiB", "--json").out)["per_gpu"]
    assert (doc["gpu"], doc["device_memory_bytes"], doc["reserve_bytes"]) == ("h100-80gb", 81559 * 2**20, 5 * 2**30)
    assert doc["budget_bytes"] == 81559 * 2**20 - 5 * 2**30
    assert (doc["gpus"], doc["padded_vocab"]) == (64, 129024)


def test_gpus_that_do_not_divide_are_one_line_with_what_is_left_over():
    run = memcalc_cli("estimate", "--config", "llama3-70b", "--gpus", "60", "--pp", "4")
    one_line_error(run, "gpus=60 is not divisible by t*pp*cp=8*4*1=32", "28 GPUs left over")


def test_an_unknown_gpu_is_bad_input():
    one_line_error(memcalc_cli("estimate", "--config", "llama3-70b", "--gpu", "h800"), "'--gpu'", "h100-80gb")


def test_estimate_exits_3_when_no_strategy_fits_and_still_prints_the_verdict():
    run = memcalc_cli("estimate", "--config", "llama3-70b", "--pp", "4", "--gpu", "a100-40gb")
    assert run.code == 3 and run.err == ""
    assert "tp-sp: no," in run.out


def test_a_short_step_keeps_fewer_micro_batches_on_the_first_stage():
    run = memcalc_cli("estimate", *ISSUE, "--global-batch-size", "4", "--strategy", "tp-sp")
    assert "2 micro-batches per step" in run.out  # 4 / (dp*b) = 4 / 2
    assert "first stage: 1F1B keeps 2 micro-batches of 20 layers (a step of only 2" in run.out


def test_fit_answers_at_a_fixed_gpu_count_and_the_help_documents_exit_3():
    run = memcalc_cli("fit", "--config", "llama3-70b", "--gpus", "64", "--gpu", "h200", "--pp", "4", "--solve", "t",
                      "--strategy", "tp-sp", "--recompute", "full", "--json")
    assert run.code == 0, run.err
    (row,) = json.loads(run.out)["results"]
    assert row["answer"]["value"] == 4 and row["beyond"]["value"] == 2  # 64/(4*4): dp=4 at the answer
    assert "Exits 3 if nothing fits" in memcalc_cli("fit", "--help").out
    assert "2 bad input, 3 nothing fits" in " ".join(memcalc_cli("--help").out.split())


@pytest.mark.parametrize("solve,answer", [("pp", "4"), ("t", "8")])
def test_fit_solves_pp_or_t_at_a_fixed_gpu_count(solve, answer):
    run = memcalc_cli("fit", "--config", "llama3-70b", "--gpus", "64", "--gpu", "h100-80gb", "--solve", solve,
                      "--strategy", "tp-sp", "--recompute", "selective", *(["--pp", "4"] if solve == "t" else []))
    assert run.code == 0, run.err
    row = next(line for line in run.out.splitlines() if line.startswith("\u2502tp-sp"))
    assert row.split("\u2502")[3].strip() == answer
