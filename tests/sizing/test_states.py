"""Parameters per GPU and the bytes of weights, gradients and Adam: against published parameter counts,
by-hand tensor-parallel shards, and Megatron-LM's 18 and 6 + 12/dp bytes per parameter."""

import pytest

from memcalc.config.schema import build_config, load_config
from memcalc.errors import ConfigError
from memcalc.sizing.pipeline import pipeline_stages, stages
from memcalc.sizing.states import (group_params, megatron_chunks, moe_layers_held, router_buffer_bytes, state_bytes,
                                   total_params)
from memcalc.sizing.params import padded_vocab, vocab_shard

# By-hand counts use v as given (no padding); the padding tests below set the divisor themselves.
GPT = dict(s=128, h=64, a=8, L=4, vocab_size=1000, make_vocab_size_divisible_by=1)


def _held(config, t):
    """Parameters one rank of each bounding stage holds, by stage name."""
    return {st.name: sum(group_params(config, st, t).values()) for st in stages(config.L, config.pp, config.vpp)}


def test_llama3_70b_config_has_its_published_parameter_count():
    assert total_params(load_config("llama3-70b", {})) == 70_553_706_496


def test_gpt_layer_by_hand():
    """12h^2 + 13h per layer (QKV 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h)."""
    h, L, v, s = 64, 4, 1000, 128
    embeddings = v * h + s * h  # word table and a learned position table of s rows
    assert total_params(build_config(GPT)) == L * (12 * h * h + 13 * h) + embeddings + 2 * h


def test_tensor_parallel_splits_all_but_norms_row_biases_and_positions():
    h, L, s, t = 64, 4, 128, 4
    whole, one_rank = _held(build_config(GPT), 1)["only"], _held(build_config(GPT | {"t": t}), t)["only"]
    replicated = L * (4 * h + 2 * h) + s * h + 2 * h  # per layer: two LayerNorms, proj and fc2 biases
    assert t * one_rank - (t - 1) * replicated == whole


def test_vocabulary_is_padded_to_a_multiple_of_t():
    config = build_config(GPT | {"vocab_size": 1001, "t": 8, "add_bias_linear": False, "norm": "rmsnorm"})
    h = 64
    layer = (4 * h * h + 8 * h * h) // 8 + 2 * h
    assert _held(config, 8)["only"] == 4 * layer + 126 * h + 128 * h + h  # ceil(1001/8) = 126 rows


@pytest.mark.parametrize("v,t,padded", [(50257, 1, 50304), (50257, 8, 51200), (51200, 8, 51200), (128256, 8, 129024)])
def test_vocabulary_is_padded_as_megatron_does_to_128_times_t(v, t, padded):
    """Megatron-LM's _vocab_size_with_padding: GPT-2's 50257 becomes 50304 on one rank and 51200 at t=8."""
    config = build_config(GPT | {"vocab_size": v, "t": t, "make_vocab_size_divisible_by": 128})
    assert padded_vocab(config, t) == padded
    assert vocab_shard(config, t) * t == padded


def test_padded_vocabulary_rows_are_held_but_not_counted_as_the_models_parameters():
    unpadded, padded = (build_config(GPT | {"make_vocab_size_divisible_by": d}) for d in (1, 128))
    assert _held(padded, 1)["only"] - _held(unpadded, 1)["only"] == (1024 - 1000) * 64  # 24 padded rows of h
    assert total_params(padded) == total_params(unpadded)


def test_tied_output_layer_is_free_on_one_stage_and_a_copy_on_the_last_of_several():
    h, v = 64, 1000
    one = _held(build_config(GPT), 1)["only"]
    assert _held(build_config(GPT | {"tie_embeddings": False}), 1)["only"] == one + v * h
    held = _held(build_config(GPT | {"pp": 2}), 1)
    assert held["first"] + held["last"] == one + v * h  # Megatron-LM keeps the embedding's copy on the last stage
    assert total_params(build_config(GPT | {"pp": 2})) == one


def test_swiglu_and_gqa_change_the_layer_weights():
    h, f, g, a = 64, 96, 2, 8
    config = build_config(GPT | dict(mlp="swiglu", ffn_hidden_size=f, num_query_groups=g, add_bias_linear=False,
                                     norm="rmsnorm", position_embedding_type="rope", vocab_size=10))
    d = h // a
    layer = h * (a + 2 * g) * d + h * h + 3 * h * f + 2 * h
    assert total_params(config) == 4 * layer + 10 * h + h


@pytest.mark.parametrize("dtype,per_param", [("bf16", 18), ("fp16", 18), ("fp32", 16)])
def test_bytes_per_parameter_without_distributed_optimizer(dtype, per_param):
    """Megatron-LM: 2 (bf16 weight) + 4 (fp32 grad) + 4 (fp32 master) + 8 (Adam); fp32 needs no master copy."""
    assert sum(state_bytes(build_config(GPT | {"dtype": dtype}), 1000).values()) == per_param * 1000


@pytest.mark.parametrize("dp,cp", [(1, 1), (8, 1), (4, 2), (3, 1)])
def test_distributed_optimizer_shards_twelve_bytes_over_dp_times_cp(dp, cp):
    """Megatron-LM: 6 + 12/(data-parallel size) bytes per parameter; its optimizer group spans dp*cp ranks."""
    fields = GPT | dict(dp=dp, cp=cp, distributed_optimizer=True, attention="flash")
    params = 24_000
    got = state_bytes(build_config(fields), params)
    assert sum(got.values()) == 6 * params + 12 * params // (dp * cp)
    assert got["states/weights"] == 2 * params and got["states/grads"] == 4 * params


def test_data_parallelism_alone_shards_nothing():
    assert state_bytes(build_config(GPT | {"dp": 8}), 100) == state_bytes(build_config(GPT), 100)


# -- experts ------------------------------------------------------------------------------------

MOE = GPT | dict(norm="rmsnorm", mlp="swiglu", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                 position_embedding_type="rope", add_bias_linear=False)


def test_mixtral_8x7b_config_has_its_published_46_7b_parameters():
    """Jiang et al. 2024 ("Mixtral of Experts"): 46.7B parameters, 13B active; the count to the parameter is
    32 layers of (QKV 4096*6144 + projection 4096^2 + router 4096*8 + 8 experts of 3*4096*14336 + two norms)
    plus two 32000-row tables and the final norm."""
    h, L, e, v = 4096, 32, 14336, 32000
    layer = h * 6144 + h * h + h * 8 + 8 * 3 * h * e + 2 * h
    assert total_params(load_config("mixtral-8x7b", {})) == L * layer + 2 * v * h + h == 46_702_792_704


def test_each_rank_holds_its_e_over_ep_experts_split_by_t_and_the_router_whole():
    config = build_config(MOE | dict(t=2, ep=4, dp=4))
    params = group_params(config, stages(config.L, 1, None)[0], 2)
    assert params["moe/experts"] == config.L * (8 // 4) * 3 * 64 * 96 // 2
    assert params["moe/router"] == config.L * 64 * 8
    assert "mlp/fc1" in params and params["mlp/fc1"] == 0  # every layer is a MoE layer


def test_torchtitans_experts_over_its_tp_ranks_are_whole_on_each():
    """torchtitan takes its expert-parallel ranks from the TP ranks (ep = t): each holds E/ep experts, unsplit."""
    config = build_config(MOE | dict(t=2, ep=2, impl="torchtitan", mlp="swiglu", norm="rmsnorm", dropout=0.0,
                                     position_embedding_type="rope", add_bias_linear=False, attention="flash"))
    params = group_params(config, stages(config.L, 1, None)[0], 2)
    assert params["moe/experts"] == config.L * (8 // 2) * 3 * 64 * 96


def test_dense_layers_between_moe_layers_keep_the_dense_mlp():
    config = build_config(MOE | dict(moe_layer_freq=2, ffn_hidden_size=128))
    params = group_params(config, stages(config.L, 1, None)[0], 1)
    assert params["mlp/fc1"] == 2 * 64 * 2 * 128 and params["moe/experts"] == 2 * 8 * 3 * 64 * 96


def test_each_torchtitan_stage_holds_the_moe_layers_of_its_own_share_of_the_layers():
    """torchtitan's split (the embedding and the output a layer each) gives pp=3 of L=6 layers 0-1, 2-4 and 5: with
    MoE every 2 layers, rank 1 holds two of them (2 and 4), the last none, not layers/freq each."""
    config = build_config(MOE | dict(impl="torchtitan", pp=3, L=6, moe_layer_freq=2, dropout=0.0, attention="flash",
                                     position_embedding_type="rope", add_bias_linear=False))
    held = [moe_layers_held(config, x) for x in pipeline_stages(config)]
    experts = [group_params(config, x, 1)["moe/experts"] // (8 * 3 * 64 * 96) for x in pipeline_stages(config)]
    assert held == experts == [1, 2, 0]


def test_torchtitan_under_pp_takes_a_freq_that_does_not_divide_l_over_pp():
    """Megatron's chunks of L/(pp*vpp) layers must each hold layers/freq MoE layers; torchtitan's ranks hold their
    own split, counted as such: pp=4 of L=12 at freq 2 gives ranks 3, 4, 3 and 2 layers, 2, 2, 1 and 1 MoE ones
    (once refused: freq 2 does not divide L/pp = 3)."""
    config = build_config(MOE | dict(impl="torchtitan", pp=4, L=12, moe_layer_freq=2, dropout=0.0, attention="flash",
                                     position_embedding_type="rope", add_bias_linear=False))
    held = [moe_layers_held(config, x) for x in pipeline_stages(config)]
    experts = [group_params(config, x, 1)["moe/experts"] // (8 * 3 * 64 * 96) for x in pipeline_stages(config)]
    assert held == experts == [2, 2, 1, 1]


def test_torchtitan_under_pp_holds_the_first_dense_layers_on_the_stages_its_split_puts_them():
    """DeepSeek-V3's first dense layers under torchtitan's pipeline: pp=3 of L=6 with two dense layers gives ranks
    layers 0-1 (both dense), 2-4 and 5, each stage's experts its own MoE layers' (Megatron's even chunks of two
    would give 0-1, 2-3 and 4-5)."""
    config = build_config(MOE | dict(impl="torchtitan", pp=3, L=6, moe_first_dense_layers=2, dropout=0.0,
                                     attention="flash", position_embedding_type="rope", add_bias_linear=False))
    held = [moe_layers_held(config, x) for x in pipeline_stages(config)]
    experts = [group_params(config, x, 1)["moe/experts"] // (8 * 3 * 64 * 96) for x in pipeline_stages(config)]
    assert held == experts == [0, 3, 1]


def test_shared_experts_are_split_by_t_as_the_dense_mlp():
    config = build_config(MOE | dict(moe_shared_expert_intermediate_size=32, t=2))
    params = group_params(config, stages(config.L, 1, None)[0], 2)
    assert params["moe/shared_experts"] == config.L * 3 * 64 * 32 // 2


def test_transformers_tp_plan_leaves_qwen2_moes_shared_expert_and_its_gate_whole_on_every_rank():
    config = build_config(MOE | dict(moe_shared_expert_intermediate_size=32, t=2, impl="hf", family="qwen2_moe", mlp="swiglu",
                                     norm="rmsnorm", position_embedding_type="rope", add_bias_linear=False))
    params = group_params(config, stages(config.L, 1, None)[0], 2)
    assert params["moe/shared_experts"] == config.L * (3 * 64 * 32 + 64)


DEEPSEEK_MOE = MOE | dict(impl="hf", family="deepseek_v3", mlp="swiglu", norm="rmsnorm", attention="eager",
                          position_embedding_type="rope", add_bias_linear=False, moe_ffn_hidden_size=32,
                          moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid", kv_lora_rank=12,
                          qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5)


def test_deepseek_v3s_shared_experts_have_no_gate_and_its_router_holds_an_fp32_weight_and_bias():
    """DeepseekV3MLP is ungated (Qwen2-MoE's h -> 1 gate is not there); DeepseekV3TopkRouter's (E, h) weight stays fp32
    in a bf16 model (2 bytes a value above the weights' count) beside its fp32 (E,) e_score_correction_bias (measured
    by the hf step, tests/probe/libs/test_hf_deepseek_step.py)."""
    config = build_config(DEEPSEEK_MOE)
    stage = stages(config.L, 1, None)[0]
    assert group_params(config, stage, 1)["moe/shared_experts"] == config.L * 3 * 64 * 32
    assert router_buffer_bytes(config, stage) == config.L * (2 * config.num_experts * 64 + 4 * config.num_experts)
    fp32 = build_config(DEEPSEEK_MOE | dict(dtype="fp32"))
    assert router_buffer_bytes(fp32, stage) == config.L * 4 * config.num_experts


def test_the_distributed_optimizer_shards_expert_states_over_the_expert_data_parallel_group():
    """dp=4, ep=2: dense parameters' 12 bytes over 4 ranks, the experts' over t*cp*dp/(ep*etp) = 2."""
    config = build_config(MOE | dict(dp=4, ep=2, distributed_optimizer=True))
    states = state_bytes(config, 1000, 400)
    assert states["states/adam_m"] == 4 * (600 // 4 + 400 // 2)
    assert states["states/weights"] == 2 * 1000


def test_ep_times_etp_must_divide_the_ranks_that_hold_a_layer():
    config = build_config(MOE | dict(dp=2, ep=4))
    with pytest.raises(ConfigError, match=r"ep\*etp=4 does not divide t\*cp\*dp=2"):
        group_params(config, stages(config.L, 1, None)[0], 1)


def test_qwen1_5_moe_config_has_its_published_14_3b_parameters():
    """The Qwen team's release of Qwen1.5-MoE-A2.7B: 14.3B parameters (shared expert and its gate included)."""
    assert round(total_params(load_config("qwen1.5-moe-a2.7b", {})) / 1e9, 1) == 14.3


# DeepSeek-V3's attention (its config.json): h=7168, a=128, q_lora_rank=1536, kv_lora_rank=512, heads of
# qk_nope_head_dim=128 + qk_rope_head_dim=64, v_head_dim=128, RMSNorm.
DEEPSEEK_V3_MLA = dict(s=4096, h=7168, a=128, L=1, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                       qk_nope_head_dim=128, v_head_dim=128, norm="rmsnorm", add_bias_linear=False)


def _attention_params(config, t):
    params = group_params(config, stages(config.L, 1, None)[0], t)
    return params["attention/qkv"], params["attention/proj"]


def test_deepseek_v3_latent_attention_has_its_published_187m_parameters_per_layer():
    """q_down 7168*1536, q_norm 1536, q_up 1536*128*192, kv_down 7168*576, kv_norm 512, kv_up 512*128*256,
    o_proj 128*128*7168: 187,107,328 (DeepSeek-V3's modelling code and technical report)."""
    qkv, proj = _attention_params(build_config(DEEPSEEK_V3_MLA), 1)
    assert (qkv, proj) == (69_666_816, 117_440_512) and qkv + proj == 187_107_328


def test_megatron_splits_latent_projections_by_t_and_keeps_the_latent_norms_whole():
    qkv, proj = _attention_params(build_config(DEEPSEEK_V3_MLA | {"t": 8}), 8)
    assert qkv == (69_666_816 - 1536 - 512) // 8 + 1536 + 512 and proj == 117_440_512 // 8


def test_without_a_query_latent_the_query_is_one_projection_from_x():
    qkv, _ = _attention_params(build_config(DEEPSEEK_V3_MLA | {"q_lora_rank": None}), 1)
    assert qkv == 7168 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256


def test_deepseek_v3_config_has_its_published_671b_parameters_without_the_mtp_module():
    """The technical report's 671B are the main model; the multi-token prediction module's 14B more (the Hugging
    Face release's 685B) are not modelled, and not counted."""
    assert round(total_params(load_config("deepseek-v3", {})) / 1e9) == 671


def test_the_first_k_dense_layers_hold_a_dense_mlp_and_the_rest_experts():
    config = build_config(MOE | dict(L=6, moe_first_dense_layers=2))
    params = group_params(config, stages(config.L, 1, None)[0], 1)
    one_moe = group_params(build_config(MOE | dict(L=1)), stages(1, 1, None)[0], 1)
    assert config.moe_layers == 4 and params["moe/experts"] == 4 * one_moe["moe/experts"]
    assert build_config(MOE | dict(L=7, moe_layer_freq=2, moe_first_dense_layers=3)).moe_layers == 2  # layers 4, 6


def test_first_dense_layers_that_cover_the_model_or_an_interleaved_chunk_are_refused():
    with pytest.raises(ConfigError, match="moe_first_dense_layers=6 leaves none of the L=6 layers a MoE layer"):
        build_config(MOE | dict(L=6, moe_first_dense_layers=6))
    # found by the random audit: layer 0 dense, layer 1 not a multiple of 2 (the probe said "every layer is MoE")
    with pytest.raises(ConfigError, match="moe_first_dense_layers=1 with moe_layer_freq=2 leaves none of the L=2"):
        build_config(MOE | dict(L=2, moe_layer_freq=2, moe_first_dense_layers=1))
    config = build_config(MOE | dict(L=8, pp=2, vpp=2, moe_first_dense_layers=1))
    with pytest.raises(ConfigError, match="moe_first_dense_layers=1 with vpp=2: memcalc counts every interleaved"):
        group_params(config, stages(config.L, 2, 2)[0], 1)
    config = load_config("deepseek-v3", {"L": 4, "pp": 2, "impl": "hf", "attention": "eager"})
    with pytest.raises(ConfigError, match="moe_first_dense_layers=3 with pp=2: under impl hf memcalc counts"):
        group_params(config, stages(config.L, 2, None)[0], 1)


def test_megatrons_first_stage_holds_the_first_dense_layers_and_its_chunk_no_expert_buffer_without_moe_ones():
    """Megatron-LM's even chunks under 1F1B: L=4 over pp=2 with one dense layer gives rank 0 layers 0 (dense) and 1,
    rank 1 two MoE layers; with two, rank 0's chunk holds no expert parameter, so no expert buffer (its
    _ParamAndGradBuffer of the experts' is made only for parameters that exist)."""
    config = build_config(MOE | dict(L=4, pp=2, moe_first_dense_layers=1))
    first, last = pipeline_stages(config)
    assert [moe_layers_held(config, x) for x in (first, last)] == [1, 2]
    assert [group_params(config, x, 1)["moe/experts"] // (8 * 3 * 64 * 96) for x in (first, last)] == [1, 2]
    config = build_config(MOE | dict(L=4, pp=2, ep=2, dp=2, distributed_optimizer=True, moe_first_dense_layers=2))
    first, last = pipeline_stages(config)
    assert [len(megatron_chunks(config, x, 1)[1]) for x in (first, last)] == [0, 1]


def test_transformers_mixtral_experts_carry_no_biases_whatever_add_bias_linear_says():
    """MixtralExperts' gate_up_proj and down_proj have no biases (MixtralForCausalLM builds none, attention_bias or
    not): the count is transformers' inventory's, which never listed them; it once added E*(2e + h) a layer."""
    config = build_config(MOE | dict(impl="hf", family="mixtral", attention="eager", add_bias_linear=True))
    params = group_params(config, stages(config.L, 1, None)[0], 1)
    assert params["moe/experts"] == config.L * 8 * 3 * 96 * 64  # E experts' gate, up and down: (e, h) each
