"""memcalc.model.families.FAMILIES is the one table of transformers families: each entry's names are transformers' own,
config.json is read through the class's attribute_map, and a family memcalc cannot model is refused by what it lacks."""

import json

import pytest

from memcalc.config.hf import read_hf_config
from memcalc.config.schema import load_config
from memcalc.sizing.timeline.hf import WALKED
from memcalc.model.families import FAMILIES, UNREAD
from memcalc.errors import ConfigError
from tests.cli import memcalc_cli, one_line_error


def test_each_familys_config_class_layer_and_attribute_map_are_transformers_own():
    transformers = pytest.importorskip("transformers")
    import importlib

    for f in FAMILIES.values():
        config_class = getattr(transformers, f.config_class)
        assert config_class.model_type == f.name
        assert dict(config_class.attribute_map) == f.attribute_map, f.name
        module = importlib.import_module(f.modeling)
        assert hasattr(module, f.layer), f.layer
        assert all(hasattr(transformers, a) for a in f.architectures)


def test_a_qwen3_moe_config_written_by_its_class_is_read(tmp_path):
    """transformers 5.24's Qwen3MoeConfig saves num_local_experts; older files say num_experts: both are read."""
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3MoeConfig(num_experts=8, hidden_size=32, num_attention_heads=4).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in saved and "num_experts" not in saved
    assert read_hf_config(tmp_path / "config.json").fields["num_experts"] == 8


def test_an_alias_is_read_as_the_field_it_stands_for_and_shown_as_written(tmp_path):
    raw = {"model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2,
           "vocab_size": 64, "intermediate_size": 48, "num_experts": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = read_hf_config(tmp_path / "config.json")
    assert hf.fields["num_experts"] == 8 and "num_experts->num_experts=8" in hf.describe()


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_a_family_memcalc_cannot_model_is_refused_naming_what_it_lacks(tmp_path, model_type):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, "hidden_size": 64}))
    one_line_error(memcalc_cli("estimate", "--hf-config", str(path)),
                   f"{path}: model_type {model_type} has {UNREAD[model_type]}, which memcalc does not model")


# State-space and hybrid families, each config.json written by its own transformers class
_STATE_SPACE = {"mamba": "MambaConfig", "mamba2": "Mamba2Config", "falcon_mamba": "FalconMambaConfig",
                "jamba": "JambaConfig", "falcon_h1": "FalconH1Config"}


@pytest.mark.parametrize("model_type", _STATE_SPACE)
def test_a_state_space_config_its_class_wrote_is_refused_in_one_line_by_what_memcalc_lacks(tmp_path, model_type):
    transformers = pytest.importorskip("transformers")
    getattr(transformers, _STATE_SPACE[model_type])().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    run = memcalc_cli("estimate", "--impl", "hf", "--hf-config", str(path))
    one_line_error(run, f"model_type {model_type} has {UNREAD[model_type]}, which memcalc does not model")
    assert "state-space" in run.err and "memcalc reads" not in run.err


# config.json files of families whose code lives in the model's repository (as InternLM2's and ChatGLM3's do)
_REMOTE_CODE = {
    "internlm2": {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"], "hidden_size": 4096,
                  "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                               "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}},
    "chatglm": {"model_type": "chatglm", "architectures": ["ChatGLMModel"], "hidden_size": 4096,
                "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                             "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"}},
}


@pytest.mark.parametrize("model_type", _REMOTE_CODE)
def test_a_family_whose_code_is_not_in_transformers_is_refused_as_remote_code(tmp_path, model_type):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_REMOTE_CODE[model_type]))
    run = memcalc_cli("estimate", "--impl", "hf", "--hf-config", str(path))
    one_line_error(run, f"model_type '{model_type}' is built by the model's own code (auto_map, trust_remote_code),"
                        " not by a transformers class; memcalc measures only transformers' own classes")


def test_experts_a_family_does_not_read_are_refused_without_naming_it_as_a_reader(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_local_experts": 8}))
    with pytest.raises(ConfigError, match=r"which memcalc does not read for llama \(it reads these for deepseek_v2"
                                          r", deepseek_v3, gpt_oss, mixtral, qwen2_moe, qwen3_moe\)"):
        read_hf_config(path)


def test_hf_families_lists_each_family_with_the_layer_it_was_measured_on():
    run = memcalc_cli("hf-families")
    assert run.code == 0 and run.err == ""
    lines = {line.split()[0]: line for line in run.out.splitlines()}
    for f in FAMILIES.values():
        assert f.config_class in lines[f.name] and FAMILIES[f.runs_as or f.name].layer in lines[f.name]
        assert ("peak walked" in lines[f.name]) == ((f.runs_as or f.name) in WALKED)
    assert "peak walked" in lines["llama"] and "peak not walked" in lines["bloom"]  # bloom's ALiBi is not walked
    assert all("refused: " in lines[name] for name in UNREAD)


def test_a_sequence_past_mistrals_window_is_refused_unless_hf_eager_keeps_the_full_scores():
    """Mistral 7B v0.1: sliding_window 4096 under 32768 positions; only hf eager was measured to keep causal's bytes
    (tests/probe/libs/test_hf_families.py runs MistralDecoderLayer at s > W)."""
    mistral = "tests/data/hf/mistral-7b.json"
    one_line_error(memcalc_cli("estimate", "--hf-config", mistral),
                   "s=32768 exceeds sliding_window=4096", "give --s 4096 or less")
    assert memcalc_cli("estimate", "--hf-config", mistral, "--s", "4096").code == 0
    assert memcalc_cli("estimate", "--hf-config", mistral, "--impl", "hf", "--attention", "eager").code == 0


@pytest.mark.parametrize("family, sizes", [
    ("gemma2", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}),
    ("bloom", {"hidden_size": 64, "n_head": 4}),
])
def test_a_class_without_sdpa_is_read_as_the_eager_attention_transformers_falls_back_to(tmp_path, family, sizes):
    """Gemma2ForCausalLM and BloomForCausalLM support no sdpa: unasked, transformers runs them eager (from_pretrained's
    default, sdpa, falls back), so --impl hf counts eager attention where the impl's own default is flash."""
    transformers = pytest.importorskip("transformers")
    assert not getattr(transformers, FAMILIES[family].architectures[0])._supports_sdpa
    getattr(transformers, FAMILIES[family].config_class)(**sizes, vocab_size=256).save_pretrained(tmp_path)
    run = memcalc_cli("estimate", "--hf-config", str(tmp_path), "--impl", "hf", "--s", "32")
    assert run.code == 0, run.err
    assert "eager attention" in run.out.splitlines()[0]


def test_pythia_is_read_with_its_parallel_residual_and_rotary_share_and_counted_under_hf_only():
    pythia = "tests/data/hf/pythia-70m.json"
    one_line_error(memcalc_cli("estimate", "--hf-config", pythia),
                   "parallel_residual, rotary_percent and fused_qkv (of transformers' GPTNeoXLayer) are modelled under"
                   " --impl hf")
    run = memcalc_cli("estimate", "--hf-config", pythia, "--impl", "hf", "--attention", "eager", "--s", "64")
    assert run.code == 0, run.err
    assert "use_parallel_residual->parallel_residual=True, rotary_pct->rotary_percent=0.25" in run.err
    assert "tp left out: impl hf does not run it for GPT-NeoX" in run.err and "GPT-2" not in run.err


def _tp_blocks(plan: dict[str, str], style: str) -> set[str]:
    """The decoder-layer blocks (attention, mlp) a base_model_tp_plan gives a linear of `style` in."""
    blocks = {"self_attn": "attention", "attn": "attention", "attention": "attention", "mlp": "mlp"}
    return {blocks[name.split(".")[2]] for name, given in plan.items() if given == style and name.count(".") >= 3}


def test_each_familys_gathered_blocks_are_those_its_tp_plan_gathers():
    transformers = pytest.importorskip("transformers")
    for f in FAMILIES.values():
        plan = getattr(transformers, f.config_class).base_model_tp_plan or {}
        assert _tp_blocks(plan, "colwise_gather_output") == set(f.gathered), f.name


def test_a_phi3_config_reads_fused_projections_and_rotates_whole_heads_unless_a_share_is_given(tmp_path):
    transformers = pytest.importorskip("transformers")
    small = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}
    transformers.Phi3Config(**small).save_pretrained(tmp_path)
    whole = read_hf_config(tmp_path / "config.json")
    assert whole.fields["fused_qkv"] is True and whole.fields["rotary_percent"] is None
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    transformers.Phi3Config(**small, rope_parameters=rope, resid_pdrop=0.1).save_pretrained(tmp_path)
    share = read_hf_config(tmp_path / "config.json")
    assert (share.fields["rotary_percent"], share.fields["dropout"]) == (0.75, 0.1)
    older = {"model_type": "phi3", **small, "num_hidden_layers": 2, "vocab_size": 64, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(older))  # Phi-4-mini's file, written before rope_parameters
    assert read_hf_config(tmp_path / "config.json").fields["rotary_percent"] == 0.5


def test_a_gemma2_config_reads_its_final_logit_softcapping_and_null_is_none(tmp_path):
    transformers = pytest.importorskip("transformers")
    small = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}
    transformers.Gemma2Config(**small).save_pretrained(tmp_path)  # the class's 30.0 and 50.0
    fields = read_hf_config(tmp_path / "config.json").fields
    assert (fields["final_logit_softcapping"], fields["attn_logit_softcapping"]) == (30.0, 50.0)
    transformers.Gemma2Config(**small, final_logit_softcapping=None).save_pretrained(tmp_path)
    assert read_hf_config(tmp_path / "config.json").fields.get("final_logit_softcapping") is None  # memcalc's default
    raw = json.loads((tmp_path / "config.json").read_text()) | {"final_logit_softcapping": -1}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="final_logit_softcapping must be a positive number, got -1"):
        read_hf_config(tmp_path / "config.json")


def test_phi3s_fused_projections_are_refused_outside_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.Phi3Config(hidden_size=32, num_attention_heads=4, intermediate_size=48).save_pretrained(tmp_path)
    one_line_error(memcalc_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "megatron"),
                   "fused_qkv (of transformers' Phi3DecoderLayer) is modelled under --impl hf only")


@pytest.mark.parametrize("fields, words", [
    ({"alibi": True}, "alibi=true is not modelled (ALiBi"),
    ({"parallel_attn": False}, "parallel_attn=false is not modelled (Falcon's sequential block"),
    ({"new_decoder_architecture": True, "num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn must be 1 or 2"),
    ({"num_ln_in_parallel_attn": 2}, "num_ln_in_parallel_attn=2 without new_decoder_architecture is not a layer"),
])
def test_a_falcon_layout_memcalc_has_not_measured_is_refused_in_one_line(tmp_path, fields, words):
    transformers = pytest.importorskip("transformers")
    transformers.FalconConfig(hidden_size=32, num_attention_heads=4, **fields).save_pretrained(tmp_path)
    one_line_error(memcalc_cli("estimate", "--impl", "hf", "--hf-config", str(tmp_path / "config.json")), words)


@pytest.mark.parametrize("fields, words", [
    ({"attention_dropout": 0.0, "hidden_dropout": 0.1}, "attention_dropout=0.0 with hidden_dropout=0.1"),
    ({"pretraining_tp": 4, "slow_but_exact": True}, "slow_but_exact=true is not modelled"),
])
def test_a_bloom_setting_memcalc_cannot_count_is_refused_in_one_line(tmp_path, fields, words):
    transformers = pytest.importorskip("transformers")
    transformers.BloomConfig(hidden_size=32, n_head=4, **fields).save_pretrained(tmp_path)
    one_line_error(memcalc_cli("estimate", "--impl", "hf", "--hf-config", str(tmp_path / "config.json")), words)


def test_falcon_7b_is_read_as_multi_query_with_one_norm_and_counted_under_hf_eager_only():
    falcon = "tests/data/hf/falcon-7b.json"  # no max_position_embeddings: s is given
    one_line_error(memcalc_cli("estimate", "--hf-config", falcon, "--s", "2048"), "parallel_residual", "--impl hf")
    run = memcalc_cli("estimate", "--hf-config", falcon, "--impl", "hf", "--attention", "eager", "--s", "2048")
    assert run.code == 0, run.err
    assert "new_decoder_architecture+multi_query+num_attention_heads->num_query_groups=1" in run.err
    assert "new_decoder_architecture->single_norm=True" in run.err  # its one input_layernorm
    assert "tp left out: impl hf does not run it for Falcon" in run.err


def test_falcon_40bs_layout_is_read_as_grouped_fused_qkv_with_two_norms_and_counted_under_hf_only():
    """new_decoder_architecture: num_kv_heads groups (multi_query ignored), query_key_value laid out per group
    (fused_qkv), ln_attn and ln_mlp (num_ln_in_parallel_attn absent: 2); sdpa, FalconConfig's default, is counted."""
    falcon = "tests/data/hf/falcon-40b-tiny.json"  # written by FalconConfig(new_decoder_architecture=True, ...)
    fields = read_hf_config(falcon).fields
    assert (fields["num_query_groups"], fields["fused_qkv"], fields["single_norm"], fields["parallel_residual"]) == (
        2, True, False, True)
    one_line_error(memcalc_cli("estimate", "--hf-config", falcon), "fused_qkv", "--impl hf")
    run = memcalc_cli("estimate", "--hf-config", falcon, "--impl", "hf", "--b", "2", "--s", "9", "--json")
    assert run.code == 0, run.err
    assert "tp left out: impl hf does not run it for Falcon" in run.err


def test_a_starcoder2_config_reads_its_kernel_gelu_whole_head_rope_and_gqa_and_is_counted_under_hf_only(tmp_path):
    """Starcoder2Config's gelu_pytorch_tanh is torch's GELU kernel, which keeps its input alone (memcalc's gelu, not
    gelu_new's four tensors); its RoPE rotates whole heads of a LayerNorm layer, so rotary_percent 1 is assumed."""
    transformers = pytest.importorskip("transformers")
    transformers.Starcoder2Config(hidden_size=32, num_attention_heads=4, intermediate_size=48, residual_dropout=0.1,
                                  sliding_window=16).save_pretrained(tmp_path)
    read = read_hf_config(tmp_path / "config.json")
    fields = read.fields
    assert (fields["mlp"], fields["norm"], fields["num_query_groups"], fields["rotary_percent"]) == (
        "gelu", "layernorm", 2, 1.0)
    assert (fields["dropout"], fields["sliding_window"], fields["add_bias_linear"]) == (0.1, 16, True)
    assert "fused_qkv" not in fields  # separate q_proj, k_proj, v_proj: not GPT-NeoX's layer
    assert "hidden_act=gelu_pytorch_tanh->mlp=gelu" in read.describe()
    one_line_error(memcalc_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "megatron",
                               "--s", "16"),
                   "rotary_percent (of transformers' Starcoder2DecoderLayer) is modelled under --impl hf only")


def test_a_gptj_config_reads_its_one_norm_parallel_block_and_rotary_dim_as_a_share_of_each_head(tmp_path):
    """GPTJConfig's rotary_dim is channels of each n_embd / n_head head: 4 of 8 is rotary_percent 0.5; its block is
    GPTJBlock's parallel residual on one ln_1 (single_norm), counted under --impl hf only."""
    transformers = pytest.importorskip("transformers")
    transformers.GPTJConfig(n_embd=32, n_head=4, n_layer=2, n_inner=48, vocab_size=64, n_positions=64,
                            rotary_dim=4, resid_pdrop=0.1).save_pretrained(tmp_path)
    fields = read_hf_config(tmp_path / "config.json").fields
    assert (fields["h"], fields["a"], fields["s"], fields["rotary_percent"], fields["dropout"]) == (32, 4, 64, 0.5, 0.1)
    assert (fields["mlp"], fields["parallel_residual"], fields["single_norm"]) == ("gelu_tanh", True, True)
    one_line_error(memcalc_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "megatron"),
                   "parallel_residual, rotary_percent and single_norm (of transformers' GPTJBlock) are modelled under"
                   " --impl hf only")


def test_a_cohere_config_reads_its_one_fp32_layernorm_side_by_side_and_use_qk_norm_and_is_counted_under_hf_only(
        tmp_path):
    """CohereConfig: one CohereLayerNorm (memcalc's layernorm_nb) whose output the attention and the MLP read side by
    side (parallel_residual and single_norm, assumed), use_qk_norm as qk_layernorm, embeddings tied by default;
    logit_scale is read and shown but counted nowhere (the logits times a number keep nothing)."""
    transformers = pytest.importorskip("transformers")
    transformers.CohereConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                              num_hidden_layers=2, vocab_size=64, max_position_embeddings=64,
                              use_qk_norm=True).save_pretrained(tmp_path)
    read = read_hf_config(tmp_path / "config.json")
    fields = read.fields
    assert (fields["norm"], fields["mlp"], fields["num_query_groups"], fields["qk_layernorm"]) == (
        "layernorm_nb", "swiglu", 2, True)
    assert (fields["parallel_residual"], fields["single_norm"], fields["tie_embeddings"]) == (True, True, True)
    assert "rotary_percent" not in fields and "logit_scale" not in fields
    assert "logit_scale=0.0625 (outside the decoder layers: the logits times a number keep nothing)" in read.describe()
    one_line_error(memcalc_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "megatron"),
                   "parallel_residual and single_norm (of transformers' CohereDecoderLayer) are modelled under --impl"
                   " hf only")
    run = memcalc_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "hf", "--s", "8")
    assert run.code == 0, run.err
    assert "tp left out: impl hf does not run it for Cohere with use_qk_norm" in run.err


def test_cohere2_is_refused_in_one_line_by_its_two_layer_kinds(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.Cohere2Config(hidden_size=32, num_attention_heads=4, intermediate_size=48).save_pretrained(tmp_path)
    one_line_error(memcalc_cli("estimate", "--impl", "hf", "--hf-config", str(tmp_path / "config.json")),
                   "model_type cohere2 has two kinds of layer, sliding-window attention with RoPE and global attention"
                   " without it")


GPT_OSS = "tests/data/hf/gpt-oss-tiny.json"  # written by GptOssConfig (sliding_window 5, 4 experts, top-2)


def test_a_gpt_oss_config_reads_its_sinks_clamped_glu_experts_biases_and_window():
    """GptOssConfig: GQA heads of head_dim, GptOssRMSNorm (rmsnorm_fp32w), biases (attention_bias), sinks and the clamped
    GLU fixed by the family, every layer sparse over num_local_experts, run eager (transformers refuses sdpa for it)."""
    hf = read_hf_config(GPT_OSS)
    fields = hf.fields
    assert (fields["h"], fields["a"], fields["num_query_groups"], fields["kv_channels"]) == (32, 4, 2, 16)
    assert (fields["num_experts"], fields["moe_router_topk"], fields["ffn_hidden_size"]) == (4, 2, 32)
    assert (fields["norm"], fields["mlp"], fields["attention_sinks"], fields["attention"]) == \
        ("rmsnorm_fp32w", "swiglu_clamped", True, "eager")
    assert (fields["sliding_window"], fields["add_bias_linear"]) == (5, True)
    assert "layer_types=['sliding_attention', 'full_attention'] (sliding and full layers keep alike" in hf.describe()
    assert "swiglu_limit=7.0 (the GLU's clamp bound" in hf.describe()


def test_a_gpt_oss_config_is_counted_under_hf_only_and_eager_only():
    one_line_error(memcalc_cli("estimate", "--hf-config", GPT_OSS, "--impl", "megatron", "--s", "8"),
                   "attention_sinks (of transformers' GptOssDecoderLayer) is modelled under --impl hf only")
    one_line_error(memcalc_cli("estimate", "--hf-config", GPT_OSS, "--impl", "hf", "--attention", "flash", "--s", "8"),
                   "GptOssDecoderLayer runs eager attention only", "_supports_sdpa False")
    run = memcalc_cli("estimate", "--hf-config", GPT_OSS, "--impl", "hf", "--s", "16", "--exact", "--json")
    assert run.code == 0, run.err  # s = 16 past the window of 5: eager keeps full causal's bytes


def test_tp_for_gpt_oss_is_refused_in_one_line_naming_its_plan():
    """GptOssConfig.base_model_tp_plan shards embed_tokens only: no layer rule to measure."""
    run = memcalc_cli("estimate", "--hf-config", GPT_OSS, "--impl", "hf", "--s", "8", "--t", "2", "--strategy", "tp")
    (error,) = [line for line in run.err.splitlines() if line.startswith("memcalc: error: ")]
    assert (run.code, run.out) == (2, "")
    assert "does not run tp (tensor parallel) for gpt-oss (attention_sinks): GptOssConfig's base_model_tp_plan names" \
           " only embed_tokens" in error


@pytest.mark.parametrize("field, value, words", [
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types must list sliding_attention or"
                                                                " full_attention for each layer"),
    ("quantization_config", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not modelled"),
    ("swiglu_limit", -1, "swiglu_limit must be a positive number"),
])
def test_what_gpt_oss_s_config_asks_that_memcalc_has_not_measured_is_refused_in_one_line(tmp_path, field, value,
                                                                                          words):
    raw = json.loads(open(GPT_OSS).read()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    one_line_error(memcalc_cli("estimate", "--hf-config", str(tmp_path / "config.json"), "--impl", "hf", "--s", "8"),
                   words)


def test_gpt_oss_s_mxfp4_checkpoint_is_read_as_trained_dequantized(tmp_path):
    raw = json.loads(open(GPT_OSS).read()) | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = read_hf_config(tmp_path / "config.json")
    assert "quantization_config=mxfp4 (trained dequantized to bf16" in hf.describe()


@pytest.mark.parametrize("fields, published", [
    ({"num_hidden_layers": 36}, 116_829_156_672),  # GptOssConfig's defaults
    ({"num_hidden_layers": 24, "num_local_experts": 32}, 20_914_757_184),
], ids=["gpt-oss-120b", "gpt-oss-20b"])
def test_gpt_oss_s_parameters_are_what_openai_publishes(tmp_path, fields, published):
    """OpenAI's model card: 116.83B and 20.91B parameters, the sinks (a a layer), the router's bias (E a layer) and
    the experts' biases included."""
    counted, built = _counted_and_built(tmp_path, "gpt_oss", fields)
    assert counted[0] == built[0] == published


# Each family's config class at its defaults (2 layers) and at each setting its config.json switches that changes its
# parameters: biases, tied embeddings, QK norms, fused or multi-query projections, a query latent
_SETTINGS = {
    "llama": [{"attention_bias": True, "mlp_bias": True}, {"tie_word_embeddings": True}],
    "mistral": [{"tie_word_embeddings": True}],
    "qwen2": [{"tie_word_embeddings": True}],
    "qwen3": [{"tie_word_embeddings": False}],
    # decoder_sparse_step 2 at 3 and 5 layers: layer i sparse when 2 divides i + 1 (one and two sparse layers)
    "qwen2_moe": [{"qkv_bias": False}, *({"decoder_sparse_step": 2, "num_hidden_layers": n} for n in (3, 5))],
    "qwen3_moe": [{"decoder_sparse_step": 3, "num_hidden_layers": 5}],
    "gemma": [{"tie_word_embeddings": False}],
    "gemma3_text": [{"tie_word_embeddings": False}],
    "gpt2": [{"tie_word_embeddings": False}, {"n_inner": 100}],
    "gpt_neox": [{"attention_bias": False}, {"tie_word_embeddings": True}, {"use_parallel_residual": False}],
    "deepseek_v2": [{"q_lora_rank": 48}],
    "deepseek_v3": [{"q_lora_rank": None}],
    "phi3": [{"tie_word_embeddings": True}, {"attention_bias": True}],
    "olmo2": [{"tie_word_embeddings": True}],
    "falcon": [{"new_decoder_architecture": True}, {"multi_query": False}, {"bias": True}],
    "bloom": [{"tie_word_embeddings": False}],
    "glm": [{"attention_bias": False}],
    "glm4": [{"attention_bias": True}],
    "starcoder2": [{"use_bias": False}, {"tie_word_embeddings": False}],
    "gptj": [{"tie_word_embeddings": True}],
    "cohere": [{"use_qk_norm": True}],
    "gpt_oss": [{"attention_bias": False}, {"tie_word_embeddings": True}],  # the experts keep their biases
}
_DEFAULTS = {"deepseek_v2": {"n_routed_experts": 1, "first_k_dense_replace": 2},  # its experts are not read
             "deepseek_v3": {"num_hidden_layers": 4}}  # first_k_dense_replace 3 dense layers, then experts


@pytest.mark.parametrize("family, fields", [(f, _DEFAULTS.get(f, {}) | x) for f in FAMILIES
                                            for x in ({}, *_SETTINGS.get(f, []))], ids=str)
def test_each_familys_parameters_and_those_without_weight_decay_are_what_its_transformers_class_builds(
        tmp_path, family, fields):
    """total_params (every model state's count, `estimate --totals`' parameters held) is the sum of the parameters
    the family's ForCausalLM builds from its config.json, on the meta device, and no_decay_params (the group ZeRO-1/2
    pads apart) those the Trainer's get_decay_parameter_names leaves out."""
    counted, built = _counted_and_built(tmp_path, family, fields)
    assert counted == built


def _counted_and_built(tmp_path, family: str, fields: dict) -> tuple[tuple[int, int], tuple[int, int]]:
    """memcalc's count of the parameters of `family`'s config class at `fields` (2 layers unless given), read from
    the config.json it saves, and of those without weight decay; and the same of its transformers model."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from memcalc.config.schema import load_config
    from memcalc.sizing.pipeline import pipeline_stages
    from memcalc.sizing.states import total_params
    from memcalc.sizing.totals import no_decay_params

    f = FAMILIES[family]
    config = getattr(transformers, f.config_class)(**({"num_hidden_layers": 2} | fields))
    with torch.device("meta"):
        model = getattr(transformers, f.architectures[0])(config)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    built = [sum(p.numel() for n, p in model.named_parameters() if every or n not in decay) for every in (True, False)]
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    knobs = {"impl": "hf", "attention": "eager", "s": 8}  # the kernel and s change no parameter
    ours = load_config(path, knobs, base=read_hf_config(path).fields)
    (stage,) = pipeline_stages(ours)
    return (total_params(ours), no_decay_params(ours, stage, 1)), tuple(built)


@pytest.mark.parametrize("model_type, fields, words", [
    ("llama", {"attention_bias": True, "mlp_bias": False},
     "attention_bias and mlp_bias differ ([True, False]); memcalc's add_bias_linear is all or none"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' in a gated MLP is not modelled (memcalc knows SwiGLU: silu)"),
    ("gemma", {"hidden_act": "relu"}, "hidden_act 'relu' in Gemma's gated MLP is not modelled (memcalc knows"
     " gelu_pytorch_tanh, and gelu, which GemmaConfig reads as it)"),
    ("gpt2", {"activation_function": "relu"}, "activation 'relu' is not modelled (memcalc knows the GELU variants:"
     " gelu, gelu_python, quick_gelu, gelu_new, gelu_pytorch_tanh, gelu_fast)"),
    ("gpt2", {"resid_pdrop": "x"}, "dropout probabilities must be numbers, got ['x', 0.1, 0.1]"),
    ("gpt_neox", {"use_parallel_residual": "yes"}, "use_parallel_residual must be true or false, got 'yes'"),
    ("gpt_neox", {"rotary_pct": 2}, "the rotary fraction (partial_rotary_factor, rotary_pct) must be in (0, 1], got 2"),
    ("olmo", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not modelled (OLMo's in-place clamp of Q, K and V)"),
    ("gemma3_text", {"use_bidirectional_attention": True},
     "use_bidirectional_attention=True is not modelled (memcalc counts causal decoder layers)"),
    ("cohere", {"logit_scale": "x"}, "logit_scale must be a number or null, got 'x'"),
    *((family, {"attention_bias": True}, "attention_bias=True is not modelled (biases on the attention's projections"
       " alone: memcalc's add_bias_linear biases the MLP too)") for family in ("cohere", "olmo2", "olmo", "qwen3",
                                                                              "qwen3_moe", "gemma", "gemma2",
                                                                              "gemma3_text", "deepseek_v3")),
    ("qwen2", {"use_sliding_window": True},
     "use_sliding_window=True is not modelled (memcalc models full causal attention in every layer)"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a positive whole number or null, got 0"),
    ("llama", {"head_dim": 0}, "head_dim must be a positive whole number, got 0"),
    ("gemma2", {"attn_logit_softcapping": 0}, "attn_logit_softcapping must be a positive number, got 0"),
    ("gpt_oss", {"swiglu_limit": True}, "swiglu_limit must be a positive number, got True"),
    ("mixtral", {"experts_implementation": "batched_mm"}, "experts_implementation='batched_mm' is not modelled"
     " (memcalc models transformers' grouped_mm, its default, and eager)"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy' is not modelled: transformers'"
     " DeepseekV3TopkRouter always runs topk_method=noaux_tc"),
    ("deepseek_v2", {"num_hidden_layers": 4, "first_k_dense_replace": 1}, "first_k_dense_replace and"
     " num_hidden_layers [1, 4] make DeepSeek-V2's later layers sparse (DeepseekV2Moe), which memcalc does not read"),
    ("falcon", {"parallel_attn": False},
     "parallel_attn=false is not modelled (Falcon's sequential block: attention, dropout_add, then its MLP)"),
    ("bloom", {"slow_but_exact": True}, "slow_but_exact=true is not modelled (BLOOM's sliced dense layers under"
     " pretraining_tp, which memcalc has not measured)"),
])
def test_a_config_json_value_memcalc_has_not_measured_is_refused_in_its_own_words(tmp_path, model_type, fields,
                                                                                   words):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **fields}))
    with pytest.raises(ConfigError) as refused:
        read_hf_config(path)
    assert str(refused.value) == f"{path}: {words}"


def test_a_starcoder2_head_dim_is_read_and_refused_as_its_layer_has_none_modelled(tmp_path):
    """Starcoder2Attention sizes its heads by config.head_dim where set (getattr(config, "head_dim", None) or h/a):
    memcalc left it unread and counted h/a-wide heads; now it reads it, and impl hf refuses a head_dim in one line."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "starcoder2", "hidden_size": 32, "num_attention_heads": 4,
                                "num_hidden_layers": 2, "intermediate_size": 48, "vocab_size": 64, "head_dim": 16}))
    assert read_hf_config(path).fields["kv_channels"] == 16
    with pytest.raises(ConfigError, match="Starcoder2DecoderLayer has no kv_channels"):
        load_config(path, {"impl": "hf", "s": 8}, base=read_hf_config(path).fields)
