"""Hugging Face config.json files: the fields each family maps, published parameter counts, and one-line errors."""

import json
import re
from pathlib import Path

import pytest

from memcalc.config.schema import load_config
from memcalc.errors import ConfigError
from memcalc.config.hf import read_hf_config
from memcalc.sizing.states import total_params

DATA = Path(__file__).parents[1] / "data" / "hf"


def _from_hf(name: str, **overrides):
    hf = read_hf_config(DATA / f"{name}.json")
    return load_config(DATA / f"{name}.json", overrides, base=hf.fields)


def _write(tmp_path: Path, fields: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


# Published totals: the model cards and papers (GPT-2 124M, Llama 2 7B, Mistral 7B, Qwen2 0.5B, Pythia 70M).
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama2-7b": 6_738_415_616,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "pythia-70m": 70_426_624,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_mapped_config_has_the_published_parameter_count(name):
    within_window = {"s": 4096} if name == "mistral-7b" else {}  # Mistral 7B v0.1's window is shorter than its 32k
    neox = {"impl": "hf", "attention": "eager"} if name == "pythia-70m" else {}  # GPTNeoXLayer is modelled there
    assert total_params(_from_hf(name, **within_window, **neox)) == PUBLISHED[name]


def test_llama_fields():
    c = _from_hf("llama2-7b")
    assert (c.h, c.a, c.num_query_groups, c.ffn, c.L, c.vocab_size, c.s) == (4096, 32, 32, 11008, 32, 32000, 4096)
    assert (c.mlp, c.norm, c.dropout, c.tie_embeddings) == ("swiglu", "rmsnorm", 0.0, False)
    assert (c.position_embedding_type, c.add_bias_linear, c.add_qkv_bias) == ("rope", False, False)


def test_mistral_keeps_its_kv_heads_and_qwen2_its_qkv_bias():
    mistral, qwen = _from_hf("mistral-7b", s=4096), _from_hf("qwen2-0.5b")
    assert (mistral.groups, mistral.ffn, mistral.sliding_window) == (8, 14336, 4096)
    assert (qwen.groups, qwen.add_qkv_bias, qwen.add_bias_linear, qwen.tie_embeddings) == (2, True, False, True)


def test_gpt2_defaults_its_mlp_to_4h_and_learns_positions():
    c = _from_hf("gpt2")
    assert (c.h, c.a, c.L, c.ffn, c.vocab_size) == (768, 12, 12, 4 * 768, 50257)
    assert (c.mlp, c.norm, c.dropout, c.tie_embeddings) == ("gelu_tanh", "layernorm", 0.1, True)
    assert (c.position_embedding_type, c.max_position_embeddings, c.s, c.add_bias_linear) == (
        "learned_absolute", 1024, 1024, True,
    )


def test_gpt_neox_fields():
    c = _from_hf("pythia-70m", impl="hf", attention="eager")
    assert (c.h, c.a, c.L, c.ffn, c.vocab_size, c.s) == (512, 8, 6, 2048, 50304, 2048)
    assert (c.parallel_residual, c.rotary_percent) == (True, 0.25)
    assert (c.mlp, c.norm, c.dropout, c.tie_embeddings, c.position_embedding_type) == (
        "gelu", "layernorm", 0.0, False, "rope",
    )


def test_flags_override_the_file():
    c = _from_hf("llama2-7b", s=1024, t=8, attention="flash")
    assert (c.s, c.t, c.attention, c.h) == (1024, 8, "flash", 4096)


def test_used_fields_are_named():
    text = read_hf_config(DATA / "gpt2.json").describe()
    for part in ("gpt2", "n_embd->h=768", "n_head->a=12", "n_layer->L=12", "layer_norm_epsilon->norm=layernorm",
                 "resid_pdrop+embd_pdrop+attn_pdrop->dropout=0.1", "position_embedding_type=learned_absolute"):
        assert part in text


@pytest.mark.parametrize("family, field", [("gpt2", "activation_function"), ("pythia-70m", "hidden_act")])
@pytest.mark.parametrize("act, mlp", [
    ("gelu_new", "gelu_tanh"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_fast", "gelu_tanh"), ("gelu", "gelu"),
])
def test_tanh_gelus_read_as_gelu_tanh_and_the_line_shows_the_mapping(tmp_path, family, field, act, mlp):
    raw = json.loads((DATA / f"{family}.json").read_text()) | {field: act}
    hf = read_hf_config(_write(tmp_path, raw))
    assert hf.fields["mlp"] == mlp
    shown = f"{field}={act}->mlp={mlp}" if act != mlp else f"{field}->mlp={mlp}"
    assert shown in hf.describe()


def test_gpt2_without_an_activation_takes_gpt2configs_gelu_new(tmp_path):
    raw = json.loads((DATA / "gpt2.json").read_text())
    del raw["activation_function"]
    hf = read_hf_config(_write(tmp_path, raw))
    assert hf.fields["mlp"] == "gelu_tanh" and "assumed: " in hf.describe() and "mlp=gelu_tanh" in hf.describe()


def test_architectures_alone_name_the_family(tmp_path):
    raw = json.loads((DATA / "mistral-7b.json").read_text())
    del raw["model_type"]
    assert read_hf_config(_write(tmp_path, raw)).family == "mistral"


def test_gpt2_takes_the_largest_dropout(tmp_path):
    raw = json.loads((DATA / "gpt2.json").read_text()) | {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.2}
    assert read_hf_config(_write(tmp_path, raw)).fields["dropout"] == 0.2


def test_unknown_architecture_is_named(tmp_path):
    path = _write(tmp_path, {"model_type": "mpt", "architectures": ["MptForCausalLM"], "hidden_size": 4096})
    with pytest.raises(ConfigError, match=r"unknown architecture \(model_type='mpt', .*MptForCausalLM.*llama"):
        read_hf_config(path)


def test_no_architecture_at_all(tmp_path):
    with pytest.raises(ConfigError, match="names no architecture"):
        read_hf_config(_write(tmp_path, {"hidden_size": 64}))


def test_missing_fields_are_all_named(tmp_path):
    raw = json.loads((DATA / "llama2-7b.json").read_text())
    for name in ("hidden_size", "intermediate_size", "vocab_size"):
        del raw[name]
    with pytest.raises(ConfigError, match="llama config.json is missing hidden_size, vocab_size, intermediate_size$"):
        read_hf_config(_write(tmp_path, raw))


def test_a_missing_field_two_rows_read_is_named_once(tmp_path):
    # GPT-2's n_positions gives both s and max_position_embeddings: it was named twice, "n_positions, n_positions"
    raw = json.loads((DATA / "gpt2.json").read_text())
    del raw["n_positions"]
    with pytest.raises(ConfigError, match="gpt2 config.json is missing n_positions$"):
        read_hf_config(_write(tmp_path, raw))


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' in a gated MLP"),
    ({"attention_bias": True, "mlp_bias": False}, "attention_bias and mlp_bias differ"),
    ({"head_dim": 0}, "head_dim must be a positive whole number, got 0"),
])
def test_what_memcalc_cannot_model_is_refused(tmp_path, change, message):
    raw = json.loads((DATA / "llama2-7b.json").read_text()) | change
    with pytest.raises(ConfigError, match=message):
        read_hf_config(_write(tmp_path, raw))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_hf_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama",\n  "hidden_size": }')
    with pytest.raises(ConfigError, match="invalid JSON at line 2, column 18"):
        read_hf_config(bad)
    with pytest.raises(ConfigError, match="expected a JSON object"):
        read_hf_config(_write(tmp_path, [1, 2]))


@pytest.mark.parametrize("model_type, change, named", [
    ("mistral", {"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts=8 (mixture of experts)"),
    ("olmoe", {"num_experts": 64}, "num_experts=64 (mixture of experts)"),
    ("llama", {"n_routed_experts": 64}, "n_routed_experts=64 (mixture of experts)"),
    ("qwen2", {"num_experts": 60}, "num_experts=60 (mixture of experts)"),
    ("llama", {"kv_lora_rank": 512}, "kv_lora_rank=512 (multi-head latent attention)"),
    ("llama", {"kv_lora_rank": 512, "n_routed_experts": 64},
     "n_routed_experts=64 (mixture of experts), kv_lora_rank=512 (multi-head latent attention)"),
])
def test_experts_and_latent_attention_are_refused_naming_the_fields(tmp_path, model_type, change, named):
    """A Mixtral config labelled mistral used to give Mistral 7B's 7.24B parameters, its experts dropped."""
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | {"model_type": model_type} | change
    with pytest.raises(ConfigError, match=f"config.json sets {named.replace('(', r'[(]').replace(')', r'[)]')},"
                                          r" which memcalc does not read for \w+"
                                          r" \(it reads these for deepseek_v2, deepseek_v3, gpt_oss, mixtral, qwen2_moe,"
                                          r" qwen3_moe\)"):
        read_hf_config(_write(tmp_path, raw))


MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": 14336,
           "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
           "output_router_logits": False, "max_position_embeddings": 32768}
QWEN2_MOE = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60,
             "num_experts_per_tok": 4, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
             "norm_topk_prob": False, "decoder_sparse_step": 1, "output_router_logits": True,
             "router_aux_loss_coef": 0.001}


def test_a_mixtral_config_reads_its_experts_and_shows_each_field_used(tmp_path):
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | MIXTRAL
    hf = read_hf_config(_write(tmp_path, raw))
    assert {k: hf.fields[k] for k in ("num_experts", "moe_router_topk", "moe_aux_loss")} == {
        "num_experts": 8, "moe_router_topk": 2, "moe_aux_loss": False}
    line = hf.describe()
    for shown in ("num_local_experts->num_experts=8", "num_experts_per_tok->moe_router_topk=2",
                  "output_router_logits+router_aux_loss_coef->moe_aux_loss=False"):
        assert shown in line


def test_a_qwen2_moe_config_reads_experts_shared_expert_router_and_sparse_step(tmp_path):
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | QWEN2_MOE
    hf = read_hf_config(_write(tmp_path, raw))
    assert {k: hf.fields[k] for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                      "moe_shared_expert_intermediate_size", "moe_router_pre_softmax",
                                      "moe_layer_freq", "moe_aux_loss")} == {
        "num_experts": 60, "moe_router_topk": 4, "moe_ffn_hidden_size": 1408,
        "moe_shared_expert_intermediate_size": 5632, "moe_router_pre_softmax": True, "moe_layer_freq": 1,
        "moe_aux_loss": True}
    assert "norm_topk_prob->moe_router_pre_softmax=True" in hf.describe()


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [0, 5]}, "mlp_only_layers=.* is not modelled"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
])
def test_qwen2_moe_layouts_memcalc_cannot_count_are_refused_by_name(tmp_path, change, words):
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | QWEN2_MOE | change
    with pytest.raises(ConfigError, match=words):
        read_hf_config(_write(tmp_path, raw))


@pytest.mark.parametrize("change", [{"num_experts": None}, {"num_local_experts": 1}, {"kv_lora_rank": None}])
def test_a_dense_config_that_names_an_expert_field_unset_is_read(tmp_path, change):
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | change
    assert read_hf_config(_write(tmp_path, raw)).family == "mistral"


def test_deepseek_v3_experts_are_read_and_every_router_field_is_shown():
    hf = read_hf_config(DATA / "deepseek-v3.json")
    assert {k: hf.fields[k] for k in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                      "moe_shared_expert_intermediate_size", "moe_first_dense_layers",
                                      "moe_router_pre_softmax", "moe_router_score_function")} == dict(
        num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_first_dense_layers=3, moe_router_pre_softmax=False, moe_router_score_function="sigmoid")
    line = hf.describe()
    for shown in ("n_shared_experts+moe_intermediate_size->moe_shared_expert_intermediate_size=2048",
                  "first_k_dense_replace->moe_first_dense_layers=3", "topk_method=noaux_tc (changes nothing kept)",
                  "n_group=8 (changes nothing kept)", "topk_group=4 (changes nothing kept)",
                  "routed_scaling_factor=2.5 (changes nothing kept)", "num_nextn_predict_layers=1 (not counted"):
        assert shown in line, shown


@pytest.mark.parametrize("change, words", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not modelled: transformers' DeepseekV3TopkRouter always"),
    ({"topk_method": "group_limited_greedy"}, "topk_method='group_limited_greedy' is not modelled"),
    ({"n_group": 0}, "n_group must be a positive number, got 0"),
    ({"n_shared_experts": "one"}, "n_shared_experts and moe_intermediate_size must be whole numbers"),
])
def test_deepseek_v3_router_fields_transformers_does_not_run_are_refused_by_name(tmp_path, change, words):
    raw = json.loads((DATA / "deepseek-v3.json").read_text()) | change
    with pytest.raises(ConfigError, match=re.escape(words)):
        read_hf_config(_write(tmp_path, raw))


def test_deepseek_v2_experts_are_still_refused_by_name(tmp_path):
    raw = json.loads((DATA / "deepseek-v3.json").read_text()) | {"model_type": "deepseek_v2",
                                                                   "architectures": ["DeepseekV2ForCausalLM"]}
    with pytest.raises(ConfigError, match=r"sets n_routed_experts=256 \(mixture of experts\)"):
        read_hf_config(_write(tmp_path, raw))


def _dense_deepseek(tmp_path, **change):
    """DeepSeek's config.json without its MoE fields, every layer dense, read as DeepSeek-V2's (V3's class defaults
    are experts): a test of the MLA rows."""
    raw = json.loads((DATA / "deepseek-v3.json").read_text()) | {
        "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "first_k_dense_replace": 61} | change
    for name in ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "num_experts_per_tok"):
        raw.pop(name)
    return read_hf_config(_write(tmp_path, raw))


def test_deepseek_latent_attention_fields_are_read_and_shown(tmp_path):
    hf = _dense_deepseek(tmp_path)
    assert {k: hf.fields[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                      "v_head_dim")} == dict(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                                                             qk_nope_head_dim=128, v_head_dim=128)
    assert "kv_lora_rank->kv_lora_rank=512" in hf.describe() and "v_head_dim->v_head_dim=128" in hf.describe()


def test_deepseek_v2_lite_style_null_q_lora_rank_means_no_query_latent(tmp_path):
    hf = _dense_deepseek(tmp_path, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
                         q_lora_rank=None, head_dim=64)  # head_dim: DeepseekV3Config's RoPE part, not h/a
    assert hf.family == "deepseek_v2" and "q_lora_rank" not in hf.fields


def test_a_llama_family_head_dim_is_kv_channels_and_counts_where_it_is_not_h_over_a(tmp_path):
    raw = json.loads((DATA / "llama2-7b.json").read_text()) | {"head_dim": 256}  # 32 heads of 256: a*d = 8192
    hf = read_hf_config(_write(tmp_path, raw))
    assert hf.fields["kv_channels"] == 256 and "head_dim->kv_channels=256" in hf.describe()
    wider = load_config(_write(tmp_path, raw), {}, base=hf.fields)
    assert total_params(wider) - PUBLISHED["llama2-7b"] == 32 * 4 * 4096 * 4096  # q, k, v and o twice as wide


def test_a_head_dim_of_h_over_a_is_shown_and_changes_nothing(tmp_path):
    raw = json.loads((DATA / "llama2-7b.json").read_text()) | {"head_dim": 128}
    hf = read_hf_config(_write(tmp_path, raw))
    config = load_config(_write(tmp_path, raw), {}, base=hf.fields)
    assert total_params(config) == PUBLISHED["llama2-7b"] and not config.head_dim_set


def test_qwen3_has_heads_of_head_dim_and_a_qk_norm():
    hf = read_hf_config(DATA / "qwen3-0.6b.json")
    c = load_config(DATA / "qwen3-0.6b.json", {}, base=hf.fields)
    assert (c.h, c.a, c.groups, c.head_dim, c.ffn, c.L, c.tie_embeddings) == (1024, 16, 8, 128, 3072, 28, True)
    assert c.qk_layernorm and c.head_dim_set and ("qk_layernorm", True) in hf.assumed
    assert "use_sliding_window=False (full causal attention in every layer)" in hf.describe()
    # the model card: 0.6B parameters, 0.44B without the (tied) embedding
    assert round(total_params(c) / 1e9, 1) == 0.6 and round((total_params(c) - c.vocab_size * c.h) / 1e9, 2) == 0.44


def test_qwen3s_class_default_head_dim_is_128_whatever_h_over_a_is(tmp_path):
    raw = json.loads((DATA / "qwen3-0.6b.json").read_text())
    del raw["head_dim"]
    hf = read_hf_config(_write(tmp_path, raw))
    assert hf.fields["kv_channels"] == 128 and ("kv_channels", 128) in hf.assumed


def test_a_qwen3_moe_config_reads_every_field_and_has_the_published_30_5b_parameters():
    hf = read_hf_config(DATA / "qwen3-30b-a3b.json")
    c = load_config(DATA / "qwen3-30b-a3b.json", {}, base=hf.fields)
    assert (c.num_experts, c.moe_router_topk, c.expert_ffn, c.moe_router_pre_softmax, c.moe_layer_freq) == (
        128, 8, 768, False, 1)
    assert (c.head_dim, c.groups, c.qk_layernorm, c.moe_shared_expert_intermediate_size) == (128, 4, True, None)
    line = hf.describe()
    for shown in ("head_dim->kv_channels=128", "num_experts->num_experts=128", "num_experts_per_tok->moe_router_topk=8",
                  "moe_intermediate_size->moe_ffn_hidden_size=768", "norm_topk_prob->moe_router_pre_softmax=False",
                  "decoder_sparse_step->moe_layer_freq=1", "mlp_only_layers=[] (no layer made dense by index)",
                  "output_router_logits+router_aux_loss_coef->moe_aux_loss=False"):
        assert shown in line, shown
    assert round(total_params(c) / 1e9, 1) == 30.5  # the Qwen3 technical report
    assert load_config("qwen3-30b-a3b", {}).as_dict(exclude_none=True) | {"name": None, "description": None} == (
        c.as_dict(exclude_none=True) | {"name": None, "description": None, "s": 4096, "attention": "flash"})


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [0, 47]}, "mlp_only_layers=[0, 47] (dense layers at chosen indices) is not modelled"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not modelled"),
    ({"head_dim": 12.5}, "head_dim must be a positive whole number, got 12.5"),
])
def test_qwen3_moe_layouts_memcalc_cannot_count_are_refused_by_name(tmp_path, change, words):
    raw = json.loads((DATA / "qwen3-30b-a3b.json").read_text()) | change
    with pytest.raises(ConfigError, match=re.escape(words)):
        read_hf_config(_write(tmp_path, raw))


@pytest.mark.parametrize("family", [MIXTRAL, QWEN2_MOE], ids=["mixtral", "qwen2-moe"])
def test_an_moe_configs_experts_implementation_is_read_and_unset_is_transformers_default_grouped_mm(tmp_path, family):
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | family
    path = _write(tmp_path, raw | {"experts_implementation": "eager"})
    hf = read_hf_config(path)
    assert hf.fields["experts_implementation"] == "eager"
    assert "experts_implementation->experts_implementation=eager" in hf.describe()
    unset = _write(tmp_path, raw)
    assert load_config(unset, {}, base=read_hf_config(unset).fields).experts_implementation == "grouped_mm"


@pytest.mark.parametrize("value", ["batched_mm", "sonicmoe", {"": "eager"}])
def test_an_experts_implementation_memcalc_has_not_measured_is_refused_by_name(tmp_path, value):
    raw = json.loads((DATA / "mistral-7b.json").read_text()) | MIXTRAL | {"experts_implementation": value}
    with pytest.raises(ConfigError, match="experts_implementation=.* is not modelled .*grouped_mm, its default, and eager"):
        read_hf_config(_write(tmp_path, raw))


def test_a_model_directory_reads_its_config_json_as_from_pretrained_does(tmp_path):
    model = tmp_path / "llama-tiny"
    model.mkdir()
    (model / "config.json").write_text((DATA / "llama-tiny.json").read_text())
    read = read_hf_config(model)
    assert read.fields == read_hf_config(model / "config.json").fields and read.fields["name"] == "llama-tiny"


def test_a_directory_without_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="it is a directory"):
        read_hf_config(tmp_path)
