"""`memcalc estimate`: the seed's numbers for GPT-3 175B, the JSON shape, the tables."""

import json

import pytest

from memcalc.model.ledger import BY_NAME

from tests.helpers import seed_bytes

from . import memcalc_cli, shipped

GPT3_175B = shipped("gpt3-175b")
B, S, H, A, T, L = 1, 2048, 12288, 96, 8, 96  # Korthikanti et al. 2022, Table 3


def _seed(strategy: str, t: int = T) -> int:
    """SEED.md section 3 evaluated by hand at GPT-3 175B's sizes."""
    value = seed_bytes(strategy, B, S, H, A, t)
    assert value.denominator == 1
    return int(value)


def _json(*args: str) -> dict:
    run = memcalc_cli("estimate", *args, "--json")
    assert (run.code, run.err) == (0, "")
    return json.loads(run.out)


def test_gpt3_175b_json_is_the_seeds_three_formulas():
    doc = _json("--config", GPT3_175B)
    for name in ("none", "tp", "tp-sp"):
        got = doc["strategies"][name]
        assert got["per_layer_bytes"] == _seed(name), name
        assert got["total_bytes"] == L * _seed(name), name
        assert got["ratio_to_none"] == pytest.approx(_seed(name) / _seed("none"))


def test_the_json_lists_each_strategys_tensors_by_ledger_name_summing_to_its_bytes():
    doc = _json("--config", GPT3_175B)
    assert {"config", "accounting", "strategies"} <= set(doc)
    assert doc["accounting"] == {"exact": False, "device": "cuda", "impl": "megatron"}
    assert list(doc["strategies"]) == ["none", "tp", "tp-sp"]
    for result in doc["strategies"].values():
        assert {"per_layer_bytes", "total_bytes", "ratio_to_none", "tensors"} <= set(result)
        for tensor in result["tensors"]:
            assert {"name", "bytes", "shape", "saved_by"} <= set(tensor)
            assert tensor["name"] in BY_NAME
            assert all(isinstance(n, int) for n in tensor["shape"])
        assert sum(x["bytes"] for x in result["tensors"]) == result["per_layer_bytes"]


def test_json_config_spells_out_the_defaults_it_used():
    config = _json("--config", GPT3_175B)["config"]
    assert {k: config[k] for k in ("b", "s", "h", "a", "t", "L")} == dict(b=B, s=S, h=H, a=A, t=T, L=L)
    assert (config["ffn_hidden_size"], config["num_query_groups"]) == (4 * H, A)
    assert (config["mlp"], config["dropout"], config["dtype"]) == ("gelu", 0.1, "bf16")


def test_json_shapes_are_per_rank():
    tp_sp = {x["name"]: x["shape"] for x in _json("--config", GPT3_175B)["strategies"]["tp-sp"]["tensors"]}
    assert tp_sp["ln1/input"] == [B, S // T, H]
    assert tp_sp["attention/softmax_out"] == [B, A // T, S, S]


def test_flags_override_the_config_file():
    doc = _json("--config", GPT3_175B, "--t", "4")
    assert doc["strategies"]["tp"]["per_layer_bytes"] == _seed("tp", t=4)


def test_sizes_can_come_from_flags_alone():
    doc = _json("--b", "1", "--s", "2048", "--h", "12288", "--a", "96", "--t", "8")
    assert doc["strategies"]["tp-sp"]["per_layer_bytes"] == _seed("tp-sp")
    assert doc["config"]["L"] == 1


def test_one_strategy_can_be_asked_for():
    assert list(_json("--config", GPT3_175B, "--strategy", "tp")["strategies"]) == ["tp"]


def test_exact_adds_the_norm_statistics_to_the_json():
    doc = _json("--config", GPT3_175B, "--exact", "--device", "cpu")
    names = [x["name"] for x in doc["strategies"]["none"]["tensors"]]
    assert {"ln1/mean", "ln1/rstd"} <= set(names)
    assert doc["accounting"] == {"exact": True, "device": "cpu", "impl": "megatron"}


def test_knob_flags_reach_the_estimate():
    doc = _json("--config", GPT3_175B, "--recompute", "selective")
    assert doc["strategies"]["none"]["per_layer_bytes"] == 34 * S * B * H  # Korthikanti et al., selective


def test_table_shows_each_strategys_exact_bytes_and_binary_units():
    run = memcalc_cli("estimate", "--config", GPT3_175B)
    assert run.code == 0 and run.err == ""
    for name in ("none", "tp", "tp-sp"):
        assert f"{_seed(name):,} B" in run.out
        assert f"{L * _seed(name):,} B" in run.out
    assert f"{_seed('none') / 2**30:.2f} GiB" in run.out
    assert f"{_seed('tp') / 2**20:.2f} MiB" in run.out


def test_breakdown_adds_a_row_per_saved_tensor():
    plain = memcalc_cli("estimate", "--config", GPT3_175B).out
    detailed = memcalc_cli("estimate", "--config", GPT3_175B, "--breakdown").out
    assert "attention/softmax_out" not in plain
    softmax_row = next(line for line in detailed.splitlines() if "attention/softmax_out" in line)
    assert f"{2 * B * A * S * S:,}" in softmax_row and f"{2 * B * A * S * S // T:,}" in softmax_row


def test_another_impl_on_a_seed_config_names_the_knobs_it_switches():
    """GPT-3's file leaves its layer to the seed's defaults; --impl hf runs transformers' own defaults instead (a
    SwiGLU layer with RMSNorm): said on stderr, with every value, so the number is not read as GPT-3's layer."""
    run = memcalc_cli("estimate", "--config", "gpt3-175b", "--impl", "hf", "--json")
    assert run.code == 0 and json.loads(run.out)["config"]["mlp"] == "swiglu"
    assert run.err == ("memcalc: note: gpt3-175b sets no mlp, attention, norm, dropout: impl hf's defaults apply"
                       " (mlp=swiglu, attention=flash, norm=rmsnorm, dropout=0.0), not the seed's\n")


@pytest.mark.parametrize("args", [
    ("--config", "gpt3-175b", "--impl", "megatron"),  # the seed's defaults are megatron's
    ("--config", "llama2-7b", "--impl", "hf"),  # its file names every knob
    ("--config", "gpt3-175b", "--impl", "hf", "--mlp", "gelu", "--norm", "layernorm", "--attention", "eager",
     "--dropout", "0.1", "--strategy", "none"),
])
def test_an_impl_that_switches_no_knob_notes_nothing(args):
    run = memcalc_cli("estimate", *args, "--json")
    assert (run.code, run.err) == (0, "")


def test_naming_qwen2_on_the_command_line_gives_its_layer_as_its_config_file_does(tmp_path):
    # Qwen2Attention's q, k and v always carry biases (add_qkv_bias, a config field no flag sets): `--family qwen2`
    # was refused as needing add_qkv_bias true, so the family ran from a config file only
    model = ("--impl", "hf", "--norm", "rmsnorm", "--mlp", "swiglu", "--s", "16", "--h", "64", "--a", "4", "--totals")
    config = tmp_path / "qwen2.yaml"
    config.write_text("name: qwen2\nimpl: hf\nfamily: qwen2\nadd_qkv_bias: true\n")
    named = _json(*model, "--family", "qwen2")
    assert named["config"]["add_qkv_bias"] is True
    assert named["per_gpu"] == _json(*model, "--config", str(config))["per_gpu"]
