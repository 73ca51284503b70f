"""A layout an implementation does not run for a knob set (megatron's MoE layer under tp without SP): every command
that shows all layouts leaves it out with one note on stderr saying why, and asking for it by name is refused in
one line."""

import json

import pytest

from memcalc.config.schema import load_config
from memcalc.model.impls import strategies_of

from . import memcalc_cli, one_line_error, shipped

MIXTRAL = shipped("mixtral-8x7b")
WHY = "megatron-core's MoELayer refuses tensor parallelism without sequence parallelism in training"
NOTE = f"memcalc: note: tp left out: impl megatron does not run it with experts (num_experts set): {WHY}\n"


def _rows(out: str) -> list[str]:
    """The strategy column of a rich table."""
    cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    return [cell for cell in cells if cell]


def test_megatron_mixtral_at_t2_shows_no_tp_row_and_says_why_in_one_note():
    run = memcalc_cli("estimate", "--config", MIXTRAL, "--t", "2")
    assert run.code == 0
    assert _rows(run.out) == ["none", "tp-sp"]
    assert run.err == NOTE


def test_the_json_holds_only_the_layouts_megatron_runs():
    run = memcalc_cli("estimate", "--config", MIXTRAL, "--t", "2", "--json")
    assert (run.code, run.err) == (0, NOTE)
    assert list(json.loads(run.out)["strategies"]) == ["none", "tp-sp"]


@pytest.mark.parametrize("t", ["1", "2"])  # at t=1 tp is none: refused for the knobs, whatever t
def test_asking_megatron_for_tp_with_experts_is_refused_in_one_line(t):
    run = memcalc_cli("estimate", "--config", MIXTRAL, "--t", t, "--strategy", "tp")
    one_line_error(run, "impl megatron", "does not run tp", "with experts (num_experts set)", WHY,
                   "megatron/core/transformer/moe/moe_layer.py", "it runs: none, tp-sp")


def test_totals_and_tp_sp_alone_are_unchanged():
    run = memcalc_cli("estimate", "--config", MIXTRAL, "--t", "2", "--strategy", "tp-sp", "--json")
    assert (run.code, run.err) == (0, "")
    assert list(json.loads(run.out)["strategies"]) == ["tp-sp"]


@pytest.mark.parametrize("impl, config", [("megatron", "llama2-7b"), ("torchtitan", "llama3-70b")])
def test_a_dense_model_keeps_its_tp_row(impl, config):
    run = memcalc_cli("estimate", "--config", shipped(config), "--impl", impl, "--t", "2", "--json")
    assert run.code == 0 and "left out" not in run.err  # torchtitan's note is its own recompute default
    assert list(json.loads(run.out)["strategies"]) == ["none", "tp", "tp-sp"]


def test_other_libraries_moe_rows_are_what_they_run_without_megatrons_reason():
    run = memcalc_cli("estimate", "--config", MIXTRAL, "--impl", "hf", "--t", "2", "--json")
    assert run.code == 0 and "MoELayer" not in run.err
    runs = strategies_of(load_config(MIXTRAL, {"impl": "hf", "t": 2}))
    assert list(json.loads(run.out)["strategies"]) == list(runs)


def test_the_rule_is_megatrons_alone():
    for impl in ("hf", "torchtitan"):  # torchtitan refuses experts altogether; hf declares its own
        run = memcalc_cli("formula", "--impl", impl, "--num-experts", "8")
        assert "MoELayer" not in run.err


def test_formula_fit_and_explain_leave_tp_out_with_the_note():
    formula = memcalc_cli("formula", "--num-experts", "8", "--moe-router-topk", "2")
    assert (formula.code, formula.err) == (0, NOTE)
    assert [line.split()[0] for line in formula.out.splitlines()[1:3]] == ["none", "tp-sp"]
    fit = memcalc_cli("fit", "--config", MIXTRAL, "--t", "2", "--pp", "8", "--budget", "80GiB", "--json")
    assert fit.err == NOTE
    assert {row["strategy"] for row in json.loads(fit.out)["results"]} == {"none", "tp-sp"}
    explain = memcalc_cli("explain", "--num-experts", "8")
    assert (explain.code, explain.err) == (0, NOTE)
    assert "yes (a/t)" in explain.out  # tensor parallelism's splits, as tp-sp runs them


def test_a_sweep_over_t_skips_tp_with_the_note_and_refuses_it_by_name(tmp_path):
    out = tmp_path / "rows.csv"
    run = memcalc_cli("sweep", "--config", MIXTRAL, "--s", "1024", "--t", "1,2", "--out", str(out))
    assert (run.code, run.err) == (0, NOTE)
    strategies = {line.split(",")[6] for line in out.read_text().splitlines()[1:]}
    assert strategies == {"none", "tp-sp"}
    refused = memcalc_cli("sweep", "--config", MIXTRAL, "--s", "1024", "--t", "1,2", "--strategy", "tp")
    one_line_error(refused, "does not run tp", WHY)


def test_a_plot_draws_the_layouts_megatron_runs(tmp_path):
    run = memcalc_cli("plot", "--config", MIXTRAL, "--x", "t", "--range", "1,2", "--out", str(tmp_path / "t.svg"))
    assert (run.code, run.err) == (0, NOTE)
    bars = memcalc_cli("plot", "--config", MIXTRAL, "--t", "2", "--kind", "breakdown", "--out", str(tmp_path / "b.svg"))
    assert (bars.code, bars.err) == (0, NOTE)


# --route all-to-one sends every token's k slots to experts 0..k-1 (mixtral: E = 8, k = 2), the worst bound's own
ALL_TO_ONE = ("measure", "--config", MIXTRAL, "--impl", "megatron", "--strategy", "none", "--b", "1", "--h", "16",
              "--a", "8", "--moe-ffn-hidden-size", "16", "--attention", "eager", "--moe-tokens", "worst",
              "--route", "all-to-one")


@pytest.mark.parametrize("capacity, s", [("0.5", "8"), ("3.6", "16")])
def test_measure_refuses_the_all_to_one_route_where_an_unpadded_capacity_drops_tokens_at_these_sizes(capacity, s):
    # found by a random-shape hunt: the route fills only its k experts, the capped bound every expert ("differs");
    # an expert keeps ceil(k*n/E*c) = ceil(2*8/8*0.5) = 1 of n = 8 tokens, or ceil(2*16/8*3.6) = 15 of n = 16
    run = memcalc_cli(*ALL_TO_ONE, "--s", s, "--moe-expert-capacity-factor", capacity)
    one_line_error(run, "--route all-to-one pins moe_tokens worst only where no capacity drops tokens",
                   f"of the n = {s} tokens a router sees", "moe_pad_expert_input_to_capacity")


def test_measure_runs_the_all_to_one_route_to_a_match_where_the_capacity_drops_no_tokens():
    """ceil(k*n/E*c) = ceil(2*8/8*3.6) = 8: each expert keeps all n = 8 tokens a router sees, so the capacity caps
    nothing and the route makes the worst bound (once refused with every capacity factor)."""
    pytest.importorskip("megatron.core")
    run = memcalc_cli(*ALL_TO_ONE, "--s", "8", "--moe-expert-capacity-factor", "3.6")
    assert run.code == 0, run.err
    assert "match: every tensor agrees to the byte" in run.out


def test_measure_refuses_the_balanced_route_against_a_capacity_it_does_not_fill(tmp_path):
    # found by a random-shape hunt: each of t=2 routers deals its k*b*s/t = 3 slots round E = 6 experts, where the
    # capacity bound counts every expert of the ep = 2 ranks at ceil(c*k*b*s/(t*E)) = 1: measure said "differs"
    fields = {"impl": "megatron", "add_bias_linear": False, "norm": "layernorm", "attention": "eager", "dropout": 0.0,
              "num_experts": 6, "moe_router_topk": 1, "moe_router_score_function": "sigmoid", "ep": 2, "dp": 4,
              "moe_expert_capacity_factor": 0.25,
              "moe_tokens": "capacity", "L": 1, "b": 1, "s": 6, "a": 4, "h": 16, "t": 2, "ffn_hidden_size": 10,
              "vocab_size": 22, "moe_ffn_hidden_size": 2}
    config = tmp_path / "capacity.yaml"
    config.write_text("".join(f"{k}: {str(v).lower()}\n" for k, v in fields.items()))
    run = memcalc_cli("measure", "--config", str(config), "--strategy", "tp-sp", "--route", "balanced")
    one_line_error(run, "--route balanced makes the balanced bound's slots, which moe_tokens capacity does not count",
                   "--moe-tokens balanced")


def test_measure_refuses_the_all_to_one_route_where_an_unpadded_capacity_caps_the_capacity_bound():
    # found by a random-shape hunt: moe_tokens capacity counts every expert full, the route fills only its k experts
    # (c=0.5, ep=4, t=4: permute_indices 24 B short of it)
    run = memcalc_cli(*ALL_TO_ONE[:-4], "--moe-tokens", "capacity", "--route", "all-to-one", "--s", "8",
                      "--moe-expert-capacity-factor", "0.5")
    one_line_error(run, "--route all-to-one pins moe_tokens capacity only where no capacity caps it",
                   "moe_pad_expert_input_to_capacity")


def test_moe_tokens_capacity_without_a_capacity_factor_is_refused():
    # capacity counts the tokens each expert keeps after drops: without a factor no expert drops any
    one_line_error(memcalc_cli("estimate", "--config", MIXTRAL, "--moe-tokens", "capacity"),
                   "moe_tokens capacity needs moe_expert_capacity_factor")


@pytest.mark.parametrize("config", [["--config", shipped("qwen1.5-moe-a2.7b")],
                                    ["--hf-config", "tests/data/hf/qwen2-0.5b.json"]])
def test_torchtitan_refuses_qkv_biases_naming_the_impls_that_count_them(config):
    # Qwen's q, k and v biases are the model's (Qwen2's config.json cannot turn them off, and no flag does)
    one_line_error(memcalc_cli("estimate", *config, "--impl", "torchtitan", "--totals"),
                   "add_qkv_bias True is not in torchtitan's Llama3", "use impl megatron or hf")


def test_a_qwen_moe_whose_sparse_step_does_not_divide_l_is_counted_by_impl_hf_alone():
    # decoder_sparse_step 2 at L 5: transformers builds layers 1 and 3 sparse; megatron's i % 2 would count 0, 2, 4
    qwen = ("--config", shipped("qwen1.5-moe-a2.7b"), "--moe-layer-freq", "2", "--L", "5", "--totals")
    one_line_error(memcalc_cli("estimate", *qwen), "L=5 is not divisible by moe_layer_freq=2", "impl hf places them")
    assert memcalc_cli("estimate", *qwen, "--impl", "hf").code == 0


def test_a_sweep_skips_the_qwen_moe_lengths_its_sparse_step_does_not_divide_outside_impl_hf():
    # each point as estimate checks it: L=5 was priced with megatron's three MoE layers where Qwen's model has two
    qwen = ("--config", shipped("qwen1.5-moe-a2.7b"), "--moe-layer-freq", "2", "--L", "4,5,6", "--strategy", "none")
    done = memcalc_cli("sweep", *qwen)
    assert done.code == 0 and [row.split(",")[5] for row in done.out.splitlines()[1:]] == ["4", "6"]
    assert "1 because moe_layer_freq must divide L" in done.err
    hf = memcalc_cli("sweep", *qwen, "--impl", "hf")
    assert [row.split(",")[5] for row in hf.out.splitlines()[1:]] == ["4", "5", "6"]
