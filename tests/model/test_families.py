"""A transformers family is a field of the config, named once where the config is born (config.json's model_type, a
YAML's `family:`, --family over either), and --impl hf runs that family's layer: never one guessed from the knobs."""

import json

import pytest

from memcalc.config.hf import read_hf_config
from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.families import layer_family
from tests.cli import memcalc_cli, one_line_error, shipped

HF = "tests/data/hf"
SIZES = {"impl": "hf", "b": 1, "s": 8, "h": 32, "a": 4}


def _family(*args: str) -> str | None:
    run = memcalc_cli("estimate", *args, "--s", "8", "--json")
    assert run.code == 0, run.err
    return json.loads(run.out)["config"].get("family")


@pytest.mark.parametrize("path, family", [("mistral-7b.json", "mistral"), ("qwen3-0.6b.json", "qwen3"),
                                          ("gpt2.json", "gpt2"), ("pythia-70m.json", "gpt_neox")])
def test_a_config_json_names_the_family_its_model_type_says(path, family):
    assert read_hf_config(f"{HF}/{path}").fields["family"] == family
    assert _family("--impl", "hf", "--attention", "eager", "--hf-config", f"{HF}/{path}") == family


def test_a_yaml_names_its_family_and_its_layer_is_that_familys(tmp_path):
    path = tmp_path / "qwen3.yaml"
    path.write_text("family: qwen3\nimpl: hf\nh: 64\na: 4\nnorm: rmsnorm\nmlp: swiglu\nqk_layernorm: true\n")
    assert _family("--config", str(path)) == "qwen3"
    assert layer_family(build_config({"family": "qwen3", "qk_layernorm": True, "norm": "rmsnorm", "mlp": "swiglu"}
                                     | SIZES)).layer == "Qwen3DecoderLayer"


def test_the_flag_overrides_the_family_a_config_json_names():
    assert _family("--impl", "hf", "--hf-config", f"{HF}/llama-tiny.json", "--family", "mistral") == "mistral"


@pytest.mark.parametrize("knobs, layer", [({"norm": "rmsnorm", "mlp": "swiglu"}, "LlamaDecoderLayer"),
                                          ({"norm": "layernorm", "mlp": "gelu"}, "GPT2Block")])
def test_a_config_that_names_no_family_runs_llamas_or_gpt2s_layer_by_its_norm_and_mlp(knobs, layer):
    config = build_config(SIZES | knobs)
    assert config.family is None and layer_family(config).layer == layer


@pytest.mark.parametrize("flags, words", [
    (["--family", "llama", "--qk-layernorm"], "family llama runs transformers' LlamaDecoderLayer, which has no"
                                              " qk_layernorm"),
    (["--family", "qwen3"], "family qwen3 runs transformers' Qwen3DecoderLayer, which needs qk_layernorm True"),
    (["--num-experts", "4"], "a config that names no family runs transformers' LlamaDecoderLayer, which has no"
                             " num_experts"),
    (["--family", "lama"], "field 'family': 'lama' is not a transformers family memcalc reads (llama, mistral,"),
])
def test_knobs_the_named_familys_layer_does_not_run_are_refused_in_one_line(flags, words):
    one_line_error(memcalc_cli("estimate", "--impl", "hf", "--s", "8", "--h", "32", "--a", "4", "--norm", "rmsnorm",
                               "--mlp", "swiglu", *flags), words)


def test_a_family_is_only_a_name_under_another_library_but_must_be_one_memcalc_reads():
    assert build_config(SIZES | {"impl": "megatron", "family": "mixtral"}).family == "mixtral"
    with pytest.raises(ConfigError, match="field 'family': 'nope' is not a transformers family"):
        build_config(SIZES | {"impl": "megatron", "family": "nope"})


@pytest.mark.parametrize("name, family", [("mixtral-8x7b", "mixtral"), ("qwen1.5-moe-a2.7b", "qwen2_moe"),
                                          ("qwen3-30b-a3b", "qwen3_moe"), ("deepseek-v3", "deepseek_v3")])
def test_the_shipped_moe_configs_name_their_family_and_run_under_hf(name, family):
    assert _family("--config", shipped(name), "--impl", "hf", "--attention", "eager") == family
