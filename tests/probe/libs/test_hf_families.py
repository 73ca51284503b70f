"""Each family in memcalc.model.families.FAMILIES, end to end: a small config written by transformers' own config class
(`save_pretrained`), read by `estimate --impl hf --hf-config`, and its decoder layer measured by the probe against
the ledger, to the byte. A new family is one entry in `WRITTEN`."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memcalc.config.hf import read_hf_config
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.families import FAMILIES  # noqa: E402
from memcalc.config.schema import load_config  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.libs import hf as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from tests.cli import memcalc_cli  # noqa: E402
from . import assert_exact  # noqa: E402

_SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 48,
          "vocab_size": 64, "max_position_embeddings": 64}
_EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 24}
# family -> the fields its config class is built with (small sizes; the class's defaults for the rest)
WRITTEN = {
    "llama": _SMALL | {"num_key_value_heads": 2},
    "mistral": _SMALL | {"num_key_value_heads": 2, "sliding_window": 5},  # s > W: eager keeps what causal keeps
    "qwen2": _SMALL | {"num_key_value_heads": 2},
    "qwen3": _SMALL | {"num_key_value_heads": 2, "head_dim": 16},
    "mixtral": _SMALL | {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": _SMALL | _EXPERTS | {"num_key_value_heads": 2, "num_experts": 4,
                                      "shared_expert_intermediate_size": 16},
    "qwen3_moe": _SMALL | _EXPERTS | {"num_key_value_heads": 2, "num_experts": 4, "head_dim": 16},
    "gemma": _SMALL | {"num_key_value_heads": 2, "head_dim": 16},  # (1 + w) fp32 RMSNorm, tanh GeGLU
    "gemma2": _SMALL | {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 5},  # sandwich norms, softcap
    "gemma3_text": _SMALL | {"num_key_value_heads": 2, "head_dim": 16, "sliding_window": 5},  # + q_norm, k_norm
    "olmo": _SMALL | {"num_key_value_heads": 2},  # weightless fp32 LayerNorm
    "gpt_neox": _SMALL | {"rotary_pct": 0.25},  # Pythia's: parallel residual, a quarter of each head rotated
    "phi3": _SMALL | {"num_key_value_heads": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.75}},  # Phi-4-mini's
    "olmo2": _SMALL | {"num_key_value_heads": 2},  # post-norms, whole-width q/k norms
    "glm": _SMALL | {"num_key_value_heads": 2, "head_dim": 16},  # half of each head rotated, fused gate_up
    "glm4": _SMALL | {"num_key_value_heads": 2, "head_dim": 16},  # + sandwich norms
    "falcon": {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "ffn_hidden_size": 48,
               "vocab_size": 64, "max_position_embeddings": 64},  # Falcon-7B's: multi_query, parallel_attn, RoPE
    "bloom": {"hidden_size": 32, "n_head": 4, "n_layer": 2, "vocab_size": 64},  # ALiBi, fused query_key_value
    "gptj": {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 48, "vocab_size": 64, "n_positions": 64,
             "rotary_dim": 4},  # one LayerNorm read side by side, fp32 q and k, half of each head rotated
    "starcoder2": _SMALL | {"num_key_value_heads": 2, "sliding_window": 5},  # LayerNorm, whole-head RoPE, GQA
    "cohere": _SMALL | {"num_key_value_heads": 2, "use_qk_norm": True},  # Command R+'s: one fp32 LayerNorm read side
    # by side, a LayerNorm on each query and key head
    "gpt_oss": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                "vocab_size": 64, "sliding_window": 5},  # sinks, clamped-GLU experts; its YaRN RoPE's own positions
    "gpt2": {"n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 48, "vocab_size": 64, "n_positions": 64},
    "deepseek_v3": _SMALL | _EXPERTS | {"n_routed_experts": 4, "n_shared_experts": 1, "kv_lora_rank": 16,
                                        "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8,
                                        "v_head_dim": 8, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
                                        "num_key_value_heads": 4},
}
SHAPES = {"b=2, s=8": {"b": 2, "s": 8}, "b=1, odd s=7": {"b": 1, "s": 7}}
CPU = Accounting(exact=True, device="cpu")


def _written(tmp_path, family: str):
    """config.json as the family's transformers class saves it."""
    config_class = getattr(transformers, FAMILIES[family].config_class)
    config_class(**WRITTEN[family]).save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("family", WRITTEN)
def test_a_config_its_class_wrote_is_read_and_its_layer_keeps_what_memcalc_predicts(tmp_path, family, shape):
    path = _written(tmp_path, family)
    flags = {"impl": "hf", "attention": "eager", "dropout": 0.0} | shape
    config = load_config(path, flags, base=read_hf_config(path).fields)
    route = "balanced" if config.moe else None
    saved = runner.run_layer(single("cpu"), config, STRATEGIES["none"], route=route)
    assert_exact(compare(estimate(config, STRATEGIES["none"], CPU), saved))


@pytest.mark.parametrize("family", WRITTEN)
def test_estimate_reads_a_config_its_class_wrote(tmp_path, family):
    run = memcalc_cli("estimate", "--impl", "hf", "--attention", "eager", "--hf-config", str(_written(tmp_path, family)),
                      "--s", "8", "--json")
    assert run.code == 0, run.err
    assert json.loads(run.out)["config"]["h"] == 32


# Falcon-40B/180B's layout, as FalconConfig writes it: new_decoder_architecture's grouped query_key_value, with ln_attn
# and ln_mlp unless num_ln_in_parallel_attn is 1 (Falcon2-11B's one norm); multi_query is ignored.
FALCON_NEW = {
    "2 K/V groups, ln_attn and ln_mlp": {"num_kv_heads": 2},
    "one K/V group": {"num_kv_heads": 1},
    "a group a head, one norm, biases": {"num_kv_heads": 4, "num_ln_in_parallel_attn": 1, "bias": True},
}


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("fields", FALCON_NEW.values(), ids=FALCON_NEW.keys())
def test_falcons_new_decoder_architecture_its_class_wrote_is_read_and_its_layer_keeps_what_memcalc_predicts(
        tmp_path, fields, shape, dtype, attention):
    transformers.FalconConfig(**WRITTEN["falcon"], new_decoder_architecture=True, **fields).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = load_config(path, {"impl": "hf", "attention": attention, "dtype": dtype} | shape,
                         base=read_hf_config(path).fields)
    saved = runner.run_layer(single("cpu"), config, STRATEGIES["none"])
    assert_exact(compare(estimate(config, STRATEGIES["none"], CPU), saved))


@pytest.mark.parametrize("fields", [{}, {"multi_query": False, "bias": True}, *FALCON_NEW.values(),
                                    {"new_decoder_architecture": True, "tie_word_embeddings": False}])
def test_falcons_model_states_count_the_parameters_of_falcon_for_causal_lm(tmp_path, fields):
    """One input_layernorm a layer in Falcon-7B's layout (single_norm), ln_attn and ln_mlp in Falcon-40B's."""
    from memcalc.sizing.states import total_params
    fields = {"new_decoder_architecture": True} | fields if "num_kv_heads" in fields else fields
    hf_config = transformers.FalconConfig(**WRITTEN["falcon"], **fields)
    hf_config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = load_config(path, {"impl": "hf", "attention": "eager"}, base=read_hf_config(path).fields)
    model = transformers.FalconForCausalLM(hf_config)
    assert total_params(config) == sum(p.numel() for p in model.parameters())


# Which families read attention_bias and mlp_bias, as their modeling files build the linears: Llama both; Mistral,
# Mixtral, Qwen2 and Qwen2-MoE neither (hard-coded); Qwen3, Qwen3-MoE, Gemma's, OLMo's, OLMo 2's, Cohere's and
# DeepSeek-V3's attention_bias alone, on the attention's projections (refused: memcalc's add_bias_linear biases the
# MLP too); GLM's attention_bias on q, k and v (add_qkv_bias)
BIASED = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "glm", "glm4"}
UNBIASED_ATTENTION = {"qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "cohere", "deepseek_v3"}


@pytest.mark.parametrize("family", sorted(BIASED | UNBIASED_ATTENTION))
def test_attention_bias_and_mlp_bias_count_the_biases_the_familys_own_model_has_or_are_refused(tmp_path, family):
    """memcalc read both for every Llama-like family: Mistral's, Mixtral's and Qwen2's MLPs and o_proj it biased
    (their models have none), Qwen3's and Gemma's MLPs too (the model biases the attention alone)."""
    getattr(transformers, FAMILIES[family].config_class)(**WRITTEN[family], attention_bias=True, mlp_bias=True,
                                                            pad_token_id=None).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    if family in UNBIASED_ATTENTION:
        with pytest.raises(ConfigError, match="attention_bias=True is not modelled .biases on the attention's"):
            read_hf_config(path)
        return
    from memcalc.sizing.states import total_params
    config = load_config(path, {"impl": "hf", "attention": "eager"}, base=read_hf_config(path).fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert total_params(config) == sum(p.numel() for p in model.parameters())
