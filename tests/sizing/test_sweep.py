"""Sweeps: range syntax, numbers equal to single estimates, rules applied per point,
int64 limits, and the CSV/JSON writers."""

import csv
import io
import itertools
import json
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.config.files import parse_yaml
from memcalc.config.schema import build_config
from memcalc.config.shipped import shipped_dir
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import NONE, STRATEGIES, TP, TP_SP
from memcalc.sizing.sweep import MAX_ROWS, describe_skips, evaluate_sweep, make_sweep, parse_values
from memcalc.cli.sweep_output import _digits, csv_chunks, json_chunks

from tests.helpers import seed_bytes

GPT3 = dict(name="gpt3-175b", b=1, s=2048, h=12288, a=96, t=8, L=96)  # Korthikanti et al. 2022, Table 3
ALL = list(STRATEGIES.values())


def _sweep(fields=GPT3, strategies=ALL, accounting=Accounting(), **ranges):
    ranges = {k: parse_values(v) for k, v in ranges.items()}
    return evaluate_sweep(make_sweep(dict(fields), ranges, strategies, accounting))


# --- range syntax ---

@pytest.mark.parametrize("text, values", [
    ("1024,2048,4096", [1024, 2048, 4096]),
    ("4096, 1024", [4096, 1024]),
    ("7", [7]),
    ("1:5", [1, 2, 3, 4, 5]),
    ("64:320:64", [64, 128, 192, 256, 320]),
    ("1:10:4", [1, 5, 9]),
    ("1024:32768:x2", [1024, 2048, 4096, 8192, 16384, 32768]),
    ("3:100:x3", [3, 9, 27, 81]),
    ("5:5", [5]),
])
def test_values_are_a_list_an_inclusive_range_or_a_geometric_range(text, values):
    assert list(parse_values(text)) == values


def test_a_long_arithmetic_range_is_lazy():
    values = parse_values("64:640000000000:64")
    assert len(values) == 10_000_000_000 and values[-1] == 640000000000


@pytest.mark.parametrize("text, needle", [
    ("10:1", "is empty: start 10 is above stop 1"),
    ("1:10:0", "step must be positive"),
    ("1:10:-2", "step must be positive (got -2"),
    ("1.5", "'1.5' is not a whole number in the digits 0-9"),
    ("1024:2048:x1", "geometric factor must be at least 2"),
    ("1:64:x1.5", "factor: '1.5' is not a whole number in the digits 0-9"),
    ("0:8", "value must be positive"),
    ("abc", "'abc' is not a whole number"),
    ("", "expected a list"),
    ("1,,2", "expected a list"),
    ("1:2:3:4", "has 3 colons"),
    ("8,16,8", "repeats 8"),
])
def test_bad_values_name_the_rule(text, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        parse_values(text)


# --- what a sweep accepts ---

def test_sizes_not_swept_come_from_the_config_then_its_defaults():
    sweep = make_sweep({"s": 16, "h": 64, "a": 8}, {"t": range(1, 3)}, ALL, Accounting())
    values = {k: list(v) for k, v in sweep.values.items()}
    assert values == {"b": [1], "s": [16], "h": [64], "a": [8], "t": [1, 2], "L": [1]}


@pytest.mark.parametrize("fields, needle", [
    ({"h": 64, "a": 8}, "field 's' is required"),
    ({"s": "16", "h": 64, "a": 8}, "field 's': must be a positive whole number (got '16')"),
    ({"s": 16, "h": 64, "a": 8, "L": 0}, "field 'L': must be a positive whole number (got 0)"),
    ({"s": 16, "h": 64, "a": 8, "heads": 8}, "unknown field 'heads'"),
    ({"s": 16, "h": 64, "a": 8, "mlp": "relu"}, "field 'mlp'"),
    ({"s": 16, "h": 64, "a": 8, "cp": 2}, "context parallelism (cp=2)"),
    ({"s": 16, "h": 2**41, "a": 8}, "h=2199023255552 is too large"),
    ({"s": 16, "h": 64, "a": [8]}, "field 'a': must be a positive whole number (got [8])"),  # unhashable: no TypeError
    ({"s": 16, "h": {}, "a": 8}, "field 'h': must be a positive whole number (got {})"),
])
def test_bad_fields_are_refused_once_for_the_whole_sweep(fields, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make_sweep(fields, {}, ALL, Accounting())


def test_layout_fields_do_not_change_the_numbers():
    plain = _sweep(s="1024,2048")
    laid_out = _sweep(GPT3 | {"pp": 8, "vpp": 3, "vocab_size": 51200}, s="1024,2048")
    assert laid_out.per_layer.tolist() == plain.per_layer.tolist()


# without biases, as Megatron-LM's MoE recipes (--disable-bias-linear): megatron-core refuses them at etp = t > 1
MOE = dict(b=1, s=64, h=32, a=4, t=2, L=6, num_experts=8, moe_router_topk=2, dp=4, add_bias_linear=False)


@pytest.mark.parametrize("family, kinds", [
    ({"norm": "rmsnorm", "mlp": "swiglu"}, {1: 1, 3: 1, 6: 1}),  # Llama: one pair of tables
    ({"family": "gemma3_text", "norm": "rmsnorm_1p", "mlp": "geglu_tanh", "sandwich_norm": True, "qk_layernorm": True},
     {1: 1, 3: 1, 6: 2}),  # Gemma 3: a pair for sliding layers, another from the first full one (the sixth)
])
def test_an_hf_sweep_counts_the_rope_tables_once_for_each_kind_of_layer_as_estimate_does(family, kinds):
    fields = dict(impl="hf", attention="eager", b=1, h=64, a=4, num_query_groups=2) | family
    exact = Accounting(exact=True, device="cpu")
    result = _sweep(fields, [NONE, TP], exact, L="1,3,6", s="7,16", t="1,2")
    for i in range(result.rows):
        row = result.row(i)
        config = build_config(fields | {k: row[k] for k in ("s", "L", "t")})
        expected = estimate(config, STRATEGIES[row["strategy"]], exact)
        assert (row["per_layer_bytes"], row["total_bytes"]) == (expected.per_layer_bytes, expected.total_bytes)
        tables = 2 * 2 * row["s"] * 16  # cos and sin, (s, d) in bf16, whole on every rank
        assert row["total_bytes"] == row["L"] * row["per_layer_bytes"] - (row["L"] - kinds[row["L"]]) * tables


@pytest.mark.parametrize("moe", [
    {"moe_layer_freq": 2},
    {"moe_first_dense_layers": 3, "moe_ffn_hidden_size": 48},
    {"moe_layer_freq": 3, "moe_first_dense_layers": 1, "moe_shared_expert_intermediate_size": 16},
    {"ep": 4, "moe_tokens": "worst"},  # the worst case grows with ep: every ep rank may route here
    {"ep": 2, "moe_expert_capacity_factor": 1.5, "moe_tokens": "capacity", "moe_layer_freq": 2},
    {"moe_expert_capacity_factor": 0.33, "moe_tokens": "capacity"},  # under SP each of t ranks rounds its own up
])
def test_a_mixture_of_experts_sweep_totals_each_layer_kind_and_ep_as_estimate_does(moe):
    fields = MOE | moe
    result = _sweep(fields, [NONE, TP_SP], L="4:9", s="32,64")
    for i in range(result.rows):
        row = result.row(i)
        expected = estimate(build_config(fields | {k: row[k] for k in ("s", "L")}), STRATEGIES[row["strategy"]])
        assert (row["per_layer_bytes"], row["total_bytes"]) == (expected.per_layer_bytes, expected.total_bytes)
    assert result.sweep.ep == moe.get("ep", 1)


@pytest.mark.parametrize("moe, strategies", [
    ({"moe_tokens": "worst"}, [NONE, TP_SP]),
    ({"moe_router_score_function": "sigmoid", "moe_layer_freq": 2, "exact": True}, [TP_SP]),  # k = 1 keeps less
    ({"moe_expert_capacity_factor": 1.25, "moe_tokens": "capacity"}, [NONE, TP_SP]),
    ({"impl": "hf", "family": "mixtral", "mlp": "swiglu", "moe_tokens": "worst"}, [NONE]),
])
def test_experts_top_k_and_ep_sweep_as_axes_and_each_row_is_what_estimate_says(moe, strategies):
    accounting = Accounting(exact=moe.get("exact", False))
    moe = {k: v for k, v in moe.items() if k != "exact"}
    result = _sweep(MOE | moe, strategies, accounting, num_experts="2,4,8", moe_router_topk="1:3", ep="1,2,4", L="6")
    seen = set()
    for i in range(result.rows):
        row = result.row(i)
        point = {k: row[k] for k in ("num_experts", "moe_router_topk", "ep")}
        expected = estimate(build_config(MOE | moe | point), STRATEGIES[row["strategy"]], accounting)
        assert (row["per_layer_bytes"], row["total_bytes"]) == (expected.per_layer_bytes, expected.total_bytes)
        seen.add(tuple(point.values()))
    top_one = (MOE | moe).get("impl", "megatron") == "megatron" and "moe_router_score_function" not in moe
    valid = {(e, k, ep) for e in (2, 4, 8) for k in (1, 2, 3) for ep in (1, 2, 4)
             if k <= e and e % ep == 0 and not (top_one and k == 1)}
    refused_k1 = {"moe_router_topk may not be 1 under impl megatron's softmax router without moe_router_pre_softmax"}
    assert seen == valid and {s.rule.text for s in result.skipped} == {
        "ep must divide num_experts", "moe_router_topk may not exceed num_experts"} | (refused_k1 if top_one else set())


def test_a_csv_row_of_an_expert_sweep_names_its_own_experts_top_k_and_ep():
    rows = _csv(_sweep(MOE, [TP_SP], num_experts="4,8", moe_router_topk="2,3", ep="2"))
    assert [(r["num_experts"], r["moe_router_topk"], r["ep"]) for r in rows] == [
        ("4", "2", "2"), ("4", "3", "2"), ("8", "2", "2"), ("8", "3", "2")]


def test_a_swept_top_one_under_megatrons_softmax_router_is_skipped_as_megatron_core_refuses_it():
    result = _sweep(MOE, [TP_SP], num_experts="4", moe_router_topk="1,2")
    assert [result.row(i)["moe_router_topk"] for i in range(result.rows)] == [2]
    assert "needs moe_router_pre_softmax under impl megatron" in result.skipped[0].example
    with_pre_softmax = _sweep(MOE | {"moe_router_pre_softmax": True}, [TP_SP], num_experts="4", moe_router_topk="1,2")
    assert with_pre_softmax.rows == 2 and not with_pre_softmax.skipped
    with pytest.raises(ConfigError, match="moe_router_topk=1 needs moe_router_pre_softmax under impl megatron"):
        build_config(MOE | {"moe_router_topk": 1})


def test_experts_swept_without_a_mixture_of_experts_are_refused():
    with pytest.raises(ConfigError, match="ep is given but num_experts is not"):
        _sweep(GPT3, ALL, ep="1,2")
    with pytest.raises(ConfigError, match="moe_router_topk is set but num_experts is not"):
        _sweep(GPT3, ALL, moe_router_topk="1,2")


def test_the_expert_parallel_size_is_a_column_of_the_csv():
    rows = _csv(_sweep(MOE | {"ep": 4}, [TP_SP], L="4,8"))
    assert {row["ep"] for row in rows} == {"4"}


@pytest.mark.parametrize("fields, ranges, needle", [
    (MOE | {"moe_first_dense_layers": 4}, {"L": "4:8"}, "moe_first_dense_layers=4 leaves none of L=4 layers"),
    (MOE | {"etp": 2}, {"t": "1,2"}, "etp=2 is fixed while t is swept"),
])
def test_expert_fields_no_point_could_use_are_refused_once(fields, ranges, needle):
    with pytest.raises(ConfigError, match=needle):
        _sweep(fields, ALL, **ranges)


def test_a_sweep_too_big_for_memory_is_refused_before_any_work():
    with pytest.raises(ConfigError, match=f"at most {MAX_ROWS:,}"):
        make_sweep(GPT3, {"b": parse_values("1:10000"), "s": parse_values("1:10000")}, ALL, Accounting())


# --- numbers ---

def _seed_per_layer(strategy: str, b: int, s: int, t: int) -> int:
    return int(seed_bytes(strategy, b, s, GPT3["h"], GPT3["a"], t))


def test_gpt3_175b_rows_are_the_seeds_formulas():
    result = _sweep(b="1:3", s="1024:4096:x2", t="4,8")  # up to 4096: where Megatron's fused softmax runs
    assert result.rows == 3 * 3 * 2 * 3
    for i in range(result.rows):
        row = result.row(i)
        expected = _seed_per_layer(row["strategy"], row["b"], row["s"], row["t"])
        assert (row["per_layer_bytes"], row["total_bytes"]) == (expected, 96 * expected), row


def _grids(draw):
    """Random short lists per size, many of whose combinations break some rule."""
    pick = lambda options: draw(st.lists(st.sampled_from(options), min_size=1, max_size=2, unique=True))  # noqa: E731
    return dict(b=pick([1, 2, 3]), s=pick([1, 6, 8, 15, 16, 64]), h=pick([48, 64, 96, 120]), a=pick([2, 3, 4, 8]),
                t=pick([1, 2, 3, 4]), L=pick([1, 3]))


@st.composite
def sweeps(draw):
    knobs = dict(
        mlp=draw(st.sampled_from(["gelu", "swiglu"])), attention=draw(st.sampled_from(["eager", "flash"])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])), dropout=draw(st.sampled_from([0.0, 0.1])),
        recompute=draw(st.sampled_from(["none", "selective", "full"])), dtype=draw(st.sampled_from(["bf16", "fp32"])),
    )
    if draw(st.booleans()):
        knobs["num_query_groups"] = draw(st.sampled_from([1, 2, 4]))
    if draw(st.booleans()):
        knobs["ffn_hidden_size"] = draw(st.sampled_from([96, 100, 256]))
    accounting = Accounting(exact=draw(st.booleans()), device=draw(st.sampled_from(["cuda", "cpu"])))
    return knobs, _grids(draw), accounting


@settings(max_examples=40, deadline=None)
@given(sweeps())
def test_every_row_equals_estimate_and_every_dropped_point_is_one_estimate_refuses(case):
    knobs, grid, accounting = case
    try:
        result = evaluate_sweep(make_sweep(knobs, grid, ALL, accounting))
    except ConfigError as exc:  # every point breaks some rule: checked below, point by point
        assert str(exc).startswith("no configuration in the sweep passes")
        rows = {}
    else:
        rows = {
            tuple(r[k] for k in ("b", "s", "h", "a", "t", "L", "strategy")): (r["per_layer_bytes"], r["total_bytes"])
            for r in map(result.row, range(result.rows))
        }
    for point in _points(grid):
        for strategy in ALL:
            try:
                expected = estimate(build_config(knobs | point), strategy, accounting)
            except ConfigError:
                assert (*point.values(), strategy.name) not in rows
            else:
                got = rows[(*point.values(), strategy.name)]
                assert got == (expected.per_layer_bytes, expected.total_bytes)


def _points(grid):
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


@pytest.mark.parametrize("fields, strategy", [
    (dict(s=16, h=60, a=8), NONE),
    (dict(s=16, h=64, a=8, t=3), NONE),
    (dict(s=16, h=64, a=8, t=2, ffn_hidden_size=33), TP),
    (dict(s=16, h=64, a=8, num_query_groups=3), NONE),
    (dict(s=16, h=64, a=8, num_query_groups=2, t=4), TP),
    (dict(s=15, h=64, a=8, t=2), TP_SP),
])
def test_a_dropped_point_is_explained_in_the_words_of_estimate(fields, strategy):
    with pytest.raises(ConfigError) as refused:
        estimate(build_config(fields), strategy)
    with pytest.raises(ConfigError) as dropped:
        evaluate_sweep(make_sweep(fields, {}, [strategy], Accounting()))
    assert str(dropped.value) == f"no configuration in the sweep passes the divisibility rules, e.g. {refused.value}"


def test_skips_are_counted_by_the_first_rule_each_point_breaks():
    result = _sweep(t="1:8")  # a=96, s=2048
    # t=5, 7 do not divide a=96: dropped under all three strategies (6 rows);
    # t=3, 6 divide a but not s=2048: dropped under tp-sp only (2 rows).
    assert [(s.rule.value, s.count) for s in result.skipped] == [("a", 6), ("s", 2)]
    assert result.rows == 8 * 3 - 8
    assert describe_skips(result) == (
        "skipped 8 of 24 configurations that break a divisibility rule: "
        "6 because t must divide a, e.g. a=96 is not divisible by t=5 (tensor parallelism gives each rank a/t heads); "
        "2 because t must divide s, e.g. s=2048 is not divisible by t=3 (sequence parallelism splits the sequence"
        " across t ranks)"
    )


def test_a_clean_sweep_reports_no_skips():
    assert describe_skips(_sweep(b="1:4")) is None


def test_bytes_past_int64_are_refused_not_wrapped():
    # none keeps 5bas^2 L bytes in the attention core alone: 5 * 64 * 96 * (2^21)^2 * 96 > 2^63.
    with pytest.raises(ConfigError, match="beyond 64-bit integers"):
        _sweep(b="64", s=str(2**21))


def test_bytes_just_inside_int64_are_exact():
    result = _sweep(b="16", s=str(2**21), t="1")
    for i in range(result.rows):
        row = result.row(i)
        config = build_config(GPT3 | {"b": 16, "s": 2**21, "t": 1})
        exact = estimate(config, STRATEGIES[row["strategy"]])
        assert (row["per_layer_bytes"], row["total_bytes"]) == (exact.per_layer_bytes, exact.total_bytes)
        assert exact.total_bytes > 2**61


def test_a_series_along_one_size_has_a_gap_where_a_rule_dropped_the_point():
    series = _sweep(t="1:8").along("t")
    tp_sp = series[TP_SP]
    assert [math.isnan(v) for v in tp_sp] == [t in (3, 5, 6, 7) for t in range(1, 9)]
    assert tp_sp[7] == 96 * _seed_per_layer("tp-sp", 1, 2048, 8)


def test_a_series_needs_the_other_sizes_fixed():
    with pytest.raises(ValueError, match="a series along s needs every other size fixed"):
        _sweep(b="1:2", s="1024,2048").along("s")


# --- writers ---

@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2**63 - 1), st.integers(0, 10**5), st.sampled_from([0, 9999, 10**8])),
                min_size=1, max_size=20))
def test_digits_write_integers_as_str_does(values):
    text = _digits(np.array(values, dtype=np.int64))
    assert text[text != 0].tobytes().decode() == "".join(f"{v}," for v in values)


def _csv(result, chunk_rows=1 << 18) -> list[dict]:
    data = b"".join(chunk for _, chunk in csv_chunks(result, chunk_rows))
    return list(csv.DictReader(io.StringIO(data.decode())))


def test_csv_has_a_header_and_one_complete_row_per_configuration():
    result = _sweep(GPT3 | {"mlp": "swiglu", "dropout": 0.0}, b="1,2", s="1024,2048,4096")
    rows = _csv(result)
    assert len(rows) == 2 * 3 * 3
    first = rows[0]
    assert list(first) == ["b", "s", "h", "a", "t", "L", "strategy", "per_layer_bytes", "total_bytes",
                           "ffn_hidden_size", "num_query_groups", "impl", "family", "mlp", "attention", "kv_channels",
                           "qk_layernorm", "norm", "dropout",
                           "recompute", "dtype", "bias_activation_fusion", "attention_softmax_in_fp32",
                           "masked_softmax_fusion", "num_layers_in_first_pipeline_stage",
                           "num_layers_in_last_pipeline_stage", "account_for_embedding_in_pipeline_split",
                           "account_for_loss_in_pipeline_split", "num_experts", "moe_router_topk",
                           "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor",
                           "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type", "moe_layer_freq",
                           "moe_first_dense_layers", "moe_router_score_function", "moe_router_enable_expert_bias",
                           "moe_tokens", "moe_aux_loss", "moe_router_pre_softmax", "experts_implementation", "kv_lora_rank",
                           "q_lora_rank",
                           "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "sliding_window",
                           "sandwich_norm", "attn_logit_softcapping", "final_logit_softcapping", "loss_chunks",
                           "parallel_residual",
                           "rotary_percent", "post_norm",
                           "fused_qkv", "alibi", "single_norm", "attention_sinks", "ep",
                           "accounting"]
    assert first | {"per_layer_bytes": None, "total_bytes": None} == dict(
        b="1", s="1024", h="12288", a="96", t="8", L="96", strategy="none", per_layer_bytes=None, total_bytes=None,
        ffn_hidden_size="49152", num_query_groups="96", impl="megatron", family="", mlp="swiglu", attention="eager",
        kv_channels="", qk_layernorm="false", norm="layernorm", dropout="0.0", recompute="none", dtype="bf16", bias_activation_fusion="false",
        attention_softmax_in_fp32="false", masked_softmax_fusion="true", num_layers_in_first_pipeline_stage="",
        num_layers_in_last_pipeline_stage="", account_for_embedding_in_pipeline_split="false",
        account_for_loss_in_pipeline_split="false", num_experts="", moe_router_topk="2", moe_ffn_hidden_size="", moe_shared_expert_intermediate_size="",
        moe_expert_capacity_factor="", moe_pad_expert_input_to_capacity="false", moe_token_dispatcher_type="alltoall",
        moe_layer_freq="1", moe_first_dense_layers="", moe_router_score_function="softmax",
        moe_router_enable_expert_bias="false", moe_tokens="balanced", moe_aux_loss="false",
        moe_router_pre_softmax="false", experts_implementation="grouped_mm",
        kv_lora_rank="", q_lora_rank="", qk_rope_head_dim="", qk_nope_head_dim="", v_head_dim="", sliding_window="",
        sandwich_norm="false", attn_logit_softcapping="", final_logit_softcapping="", loss_chunks="",
        parallel_residual="false",
        rotary_percent="", post_norm="false",
        fused_qkv="false", alibi="false", single_norm="false", attention_sinks="false", ep="1",
        accounting="paper",
    )
    for row in rows:  # each row is a configuration that estimate reproduces
        fields = {k: int(row[k]) for k in ("b", "s", "h", "a", "t", "L", "ffn_hidden_size", "num_query_groups")}
        config = build_config(fields | {"mlp": row["mlp"], "dropout": float(row["dropout"])})
        expected = estimate(config, STRATEGIES[row["strategy"]])
        got = (int(row["per_layer_bytes"]), int(row["total_bytes"]))
        assert got == (expected.per_layer_bytes, expected.total_bytes)


def test_csv_is_the_same_whatever_the_chunk_size():
    result = _sweep(b="1:5", s="1024:4096:1024")
    assert _csv(result, chunk_rows=7) == _csv(result)


def test_json_holds_the_knobs_once_and_a_list_per_column():
    result = _sweep(t="1:8", strategies=[TP_SP])
    doc = json.loads(b"".join(chunk for _, chunk in json_chunks(result, chunk_rows=3)))
    assert doc["knobs"]["mlp"] == "gelu" and doc["accounting"] == "paper"
    assert doc["configurations"] == 8 and doc["rows"] == 4
    assert doc["skipped"][0]["count"] == 2 and "a=96 is not divisible by t=5" in doc["skipped"][0]["example"]
    assert doc["columns"]["t"] == [1, 2, 4, 8]
    assert doc["columns"]["strategy"] == ["tp-sp"] * 4
    assert doc["columns"]["per_layer_bytes"] == [_seed_per_layer("tp-sp", 1, 2048, t) for t in (1, 2, 4, 8)]


@pytest.mark.parametrize("knobs", [
    {"recompute": "none", "dtype": "fp32"},  # the fp32 softmax and its causal mask, none at s = 1
    {"recompute": "selective", "num_query_groups": 2},  # the query columns, none with one K/V group per rank
    {"qk_layernorm": True, "num_query_groups": 2},
], ids=["causal mask", "selective gqa", "qk_layernorm gqa"])
def test_sweep_rows_follow_megatrons_size_conditions_as_estimate_does(knobs):
    """Regression (issue 18): a tensor kept only at some sizes (s > 1, g/t > 1) is dropped point by point."""
    grid = dict(b=[1, 2], s=[1, 8], h=[32], a=[4], t=[1, 2], L=[1])
    accounting = Accounting(exact=True, device="cpu")
    result = evaluate_sweep(make_sweep(knobs, grid, ALL, accounting))
    for r in map(result.row, range(result.rows)):
        point = {k: r[k] for k in grid}
        assert r["per_layer_bytes"] == estimate(build_config(knobs | point), STRATEGIES[r["strategy"]],
                                                accounting).per_layer_bytes


def test_a_sweep_skips_the_points_a_librarys_own_size_checks_refuse_as_estimate_does():
    """DeepSeek-V3's 576-wide kv down projection is not split by t = 128 (megatron's check_sizes): that point is
    skipped and counted, the others kept."""
    fields = parse_yaml((shipped_dir() / "deepseek-v3.yaml").read_text())
    result = evaluate_sweep(make_sweep(fields, {"t": (64, 128)}, [STRATEGIES["tp-sp"]], Accounting()))
    assert [result.row(i)["t"] for i in range(result.rows)] == [64]
    assert "576 is not divisible by t=128" in describe_skips(result)
    with pytest.raises(ConfigError, match="576 is not divisible by t=128"):
        build_config(fields | {"t": 128})


def test_a_torchtitan_moe_sweep_under_selective_ac_shifts_its_count_where_a_matmul_has_the_gate_s_shape_as_estimate():
    """u/t = E at (t, E) = (4, 8) and (2, 16): the shared experts' w1 and w3 have the router gate's (h, E) weight
    there, which SelectiveAC recomputes uncounted (neither's output saved, w2's still); each row is estimate's."""
    fields = {"impl": "torchtitan", "s": 16, "h": 64, "a": 4, "ffn_hidden_size": 80, "mlp": "swiglu", "norm": "rmsnorm",
              "position_embedding_type": "rope", "add_bias_linear": False, "tie_embeddings": False,
              "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
              "moe_shared_expert_intermediate_size": 32, "recompute": "op"}
    result = evaluate_sweep(make_sweep(fields, {"t": (1, 2, 4), "num_experts": (8, 16)}, ALL, Accounting()))
    assert result.rows == 3 * 2 * len(ALL)  # every point, none skipped
    for i in range(result.rows):
        row = result.row(i)
        point = {k: row[k] for k in ("t", "num_experts")}
        expected = estimate(build_config(fields | point), STRATEGIES[row["strategy"]])
        assert (row["per_layer_bytes"], row["total_bytes"]) == (expected.per_layer_bytes, expected.total_bytes)
