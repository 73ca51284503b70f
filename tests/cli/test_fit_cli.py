"""`memcalc fit` agrees with `memcalc estimate` at the boundary: the answer fits by estimate's per-GPU
totals, the next candidate does not; what nothing fits is one line with exit code 2; and the outputs
pasted in docs/guide-fit-totals.md are what the commands print."""

import json

import pytest

from . import memcalc_cli, one_line_error

GPT3 = ["--config", "gpt3-175b"]  # Table 3's layout: t=8, pp=8, vpp=3


def _fit(*args: str) -> dict:
    run = memcalc_cli("fit", *args, "--json")
    assert run.code == 0, run.err
    return json.loads(run.out)


def _estimate_total(args: list[str], strategy: str, recompute: str, solve: str, value: int, count: str) -> int | None:
    """What `estimate --totals` says one GPU needs at solve=value (None: estimate refuses the config)."""
    run = memcalc_cli("estimate", *args, "--totals", "--json", "--strategy", strategy, "--recompute", recompute,
                      f"--{solve}", str(value))
    if run.code == 2:
        return None
    result = json.loads(run.out)["per_gpu"]["strategies"][strategy]
    if count == "peak":
        return result["needed_bytes"]
    if count == "total":
        return result["total_bytes"]
    return max(sum(x["bytes"] for x in st["terms"] if x["group"] == "activations") for st in result["stages"])


@pytest.mark.parametrize("solve,count,extra", [
    ("b", "peak", []), ("t", "peak", []), ("b", "total", []), ("s", "total", []), ("t", "total", []),
    ("b", "activations", []),
    ("s", "total", ["--attention", "flash", "--cp", "2", "--pp", "4", "--vpp", "2", "--dp", "4",
                    "--distributed-optimizer"]),
])
def test_answers_fit_by_estimate_and_the_next_candidate_does_not(solve, count, extra):
    args = [*GPT3, *extra]
    doc = _fit(*args, "--budget", "80GiB", "--solve", solve, "--count", count)
    budget = doc["budget_bytes"]
    assert budget == 80 * 2**30 and doc["solve"] == solve and doc["count"] == count
    answered = [r for r in doc["results"] if r["answer"]]
    assert answered
    for r in answered:
        at = _estimate_total(args, r["strategy"], r["recompute"], solve, r["answer"]["value"], count)
        assert at == r["answer"]["bytes"] <= budget
        assert r["left_over_bytes"] == budget - at
        if r["beyond"]:
            beyond = _estimate_total(args, r["strategy"], r["recompute"], solve, r["beyond"]["value"], count)
            assert beyond == r["beyond"]["bytes"] and beyond > budget


def test_table_says_what_was_solved_and_counted():
    out = memcalc_cli("fit", *GPT3, "--budget", "80GiB").out
    assert "The largest micro-batch b that fits 80.00 GiB per GPU, counting the step's peak" in out
    assert "│tp-sp    │ selective │  2 │" in out  # the paper ran b=1; b=2 fits with selective recompute
    out = memcalc_cli("fit", *GPT3, "--budget", "80GiB", "--count", "activations", "--solve", "t").out
    assert "smallest tensor-parallel size t" in out and "activations only" in out
    assert "'none' keeps whole layers on one GPU" in out


def test_recompute_flag_picks_one_choice():
    doc = _fit(*GPT3, "--budget", "80GiB", "--recompute", "selective", "--strategy", "tp-sp")
    assert [(r["strategy"], r["recompute"]) for r in doc["results"]] == [("tp-sp", "selective")]


@pytest.mark.parametrize("budget, expected", [("1PiB", 2**50), ("2PB", 2 * 10**15)])
def test_a_budget_can_be_given_in_the_petabyte_units_fit_prints(budget, expected):
    doc = _fit(*GPT3, "--budget", budget, "--strategy", "tp-sp", "--recompute", "none", "--solve", "t")
    assert doc["budget_bytes"] == expected


def test_hf_config_works_with_fit():
    run = memcalc_cli("fit", "--hf-config", "tests/data/hf/llama2-7b.json", "--attention", "flash",
                      "--budget", "40GiB", "--solve", "t", "--json")
    assert run.code == 0 and "read llama config.json" in run.err
    answers = {(r["strategy"], r["recompute"]): r["answer"]["value"] for r in json.loads(run.out)["results"]}
    assert answers[("tp-sp", "selective")] in (1, 2, 4, 8, 16, 32)


def test_nothing_fits_is_one_line_saying_by_how_much_and_exits_3_not_2():
    run = memcalc_cli("fit", "--config", "gpt3-22b", "--budget", "20GiB")
    assert (run.code, run.out, run.err.count("\n")) == (3, "", 1), run.err
    for needle in ("nothing fits in 20.00 GiB per GPU", "the cheapest candidate, tp-sp with recompute full at b=1",
                   "GiB over, counting the step's peak"):
        assert needle in run.err


@pytest.mark.parametrize("args,needles", [
    (["--budget", "80GiB", "--solve", "t", "--strategy", "none"], ["no t to solve for"]),
    (["--budget", "eighty"], ["'--budget'", "cannot read 'eighty' as a size"]),
    (["--solve", "b"], ["give --budget SIZE or --gpu NAME"]),
    (["--budget", "80GiB", "--gpu", "h200"], ["give --budget, or --gpu/--device-memory/--reserve, not both"]),
])
def test_bad_requests_are_one_line(args, needles):
    one_line_error(memcalc_cli("fit", *GPT3, *args), *needles)


def test_no_valid_candidate_names_the_rule(tmp_path):
    config = tmp_path / "short.yaml"
    config.write_text("s: 4\nh: 64\na: 8\nt: 8\nmax_position_embeddings: 4\n")  # tp-sp needs s = 8, 16, ...
    run = memcalc_cli("fit", "--config", str(config), "--strategy", "tp-sp", "--solve", "s", "--budget", "80GiB")
    one_line_error(run, "no valid s: s=8 exceeds max_position_embeddings=4")
