"""One training step of transformers' own DeepseekV3ForCausalLM with dense MLPs (latent attention: the query's and the
key/value latents, their RMSNorms and up projections, RoPE's interleaved halves, expand_kv's copies into the keys,
the eager core over heads of d_n + d_r and values of d_v) against the hf step walk (memcalc.sizing.timeline.hf_mla),
and with DeepseekV3MoE (hf_moe; grouped_mm and the eager loop): at sizes that put the peak in sixteen different
places (six with the experts), every moment the walk names is MemTracker's reading after some op, in order, and the
peak, each category at it and between steps are MemTracker's to the byte."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import LLAMA_HF, make_config  # noqa: E402

from ..step_readings import assert_moments_in_order  # noqa: E402
from .test_hf_fsdp import _readings  # noqa: E402
from .test_hf_step import CPU, _exact_step  # noqa: E402

# DeepseekV3ForCausalLM as the probe builds it (every layer dense: first_k_dense_replace = L), small latents
DEEPSEEK = LLAMA_HF | {"family": "deepseek_v3", "attention": "eager", "num_query_groups": None, "kv_lora_rank": 12,
                       "q_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5}
NARROW = {"h": 16, "vocab_size": 8, "ffn_hidden_size": 8}  # the attention's own moments outweigh the ends and the MLP


def _latents(kv: int, q: int | None, rope: int, nope: int, v: int) -> dict:
    return {"kv_lora_rank": kv, "q_lora_rank": q, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v}


# each peaks in a different place: the comment says where
PEAKS = [
    {},  # the loss's backward
    {"b": 1, "s": 13},  # lm_head's GEMMs
    NARROW | {"b": 2, "s": 31, "a": 2, "q_lora_rank": 4},  # the final norm's backward
    NARROW | {"b": 1, "s": 31, "a": 4} | _latents(8, None, 8, 2, 2),  # forward: the fp32 softmax
    NARROW | {"b": 3, "s": 7, "a": 8} | _latents(12, 8, 64, 6, 40),  # forward: o_proj's input made (b, s, a, d_v)
    NARROW | {"b": 2, "s": 31, "a": 8} | _latents(4, 48, 8, 2, 5),  # the softmax's backward
    NARROW | {"b": 1, "s": 31, "a": 8} | _latents(4, 4, 2, 6, 40),  # weights x V's dV and dWeights
    NARROW | {"b": 3, "s": 1, "a": 8} | _latents(8, 4, 64, 2, 5),  # copy_(k_rot)'s CopySlices
    NARROW | {"b": 1, "s": 5, "a": 2} | _latents(12, 4, 8, 40, 40),  # o_proj's GEMMs
    NARROW | {"b": 1, "s": 5, "a": 8} | _latents(64, 4, 64, 2, 40),  # kv_b_proj's GEMMs
    NARROW | {"b": 2, "s": 7, "a": 1} | _latents(64, None, 64, 6, 40),  # kv_a_layernorm's backward
    NARROW | {"b": 1, "s": 1, "a": 1} | _latents(64, 48, 2, 6, 5),  # kv_a_proj_with_mqa's GEMMs
    NARROW | {"b": 1, "s": 3, "a": 4} | _latents(4, 48, 64, 6, 40),  # q_b_proj's GEMMs
    NARROW | {"b": 1, "s": 3, "a": 1} | _latents(4, 48, 8, 6, 5),  # q_a_layernorm's backward
    NARROW | {"b": 1, "s": 1, "a": 2} | _latents(8, 48, 4, 2, 2),  # q_a_proj's GEMMs
    NARROW | {"b": 1, "s": 1, "a": 2} | _latents(12, None, 64, 6, 40),  # q_proj's GEMMs (no query latent)
]


def test_the_sizes_put_the_peak_in_sixteen_different_places():
    peaks = {timeline(make_config(DEEPSEEK, **c), STRATEGIES["none"], CPU).peak.label() for c in PEAKS}
    assert len(peaks) == len(PEAKS), peaks


@pytest.mark.parametrize("changes", [
    *PEAKS,
    {"b": 3, "s": 7, "dropout": 0.1},  # attention_dropout keeps its bool mask
    {"b": 3, "s": 5, "dtype": "fp16", "tie_embeddings": True},
    # fp32: the norms' casts are no-ops, and the kv norm keeps kv_a_proj_with_mqa's whole output (its input a view)
    {"b": 3, "s": 7, "dtype": "fp32"},
    NARROW | {"b": 2, "s": 7, "a": 1, "dtype": "fp32"} | _latents(64, None, 64, 6, 40),
    NARROW | {"b": 3, "s": 7, "a": 8, "dtype": "fp32", "dropout": 0.1} | _latents(12, 8, 64, 6, 40),
    NARROW | {"b": 3, "s": 11, "a": 4} | _latents(4, None, 8, 40, 40),  # matmul copies V at b > 1
], ids=str)
def test_deepseek_v3s_step_happens_in_order_and_peaks_where_the_timeline_says_to_the_byte(one_thread, changes):
    r = _exact_step(make_config(DEEPSEEK, **changes), "none")
    assert r.model.startswith("transformers' DeepseekV3ForCausalLM")


# DeepseekV3MoE: DeepseekV3TopkRouter (an fp32 GEMM on an fp32 copy of the input, sigmoid scores, group-limited top-k,
# the k scores normalised and scaled), Mixtral's grouped_mm experts on fp32 routing weights, then the shared experts
EXPERTS = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 8, "moe_shared_expert_intermediate_size": 8,
           "moe_router_score_function": "sigmoid"}
MOE_PEAKS = [  # (route, changes): each peaks in a different place
    ("balanced", {}),  # the loss's backward
    ("balanced", NARROW | {"b": 1, "s": 17, "a": 4, "num_experts": 8, "moe_router_topk": 3, "moe_ffn_hidden_size": 64,
                           "moe_shared_expert_intermediate_size": 64}),  # the experts' down_proj grouped GEMMs
    ("all-to-one", NARROW | {"b": 2, "s": 5, "a": 4, "moe_router_topk": 1, "moe_ffn_hidden_size": 256,
                             "moe_shared_expert_intermediate_size": 256}),  # their gate_up_proj grouped GEMMs
    ("balanced", NARROW | {"b": 2, "s": 13, "a": 4, "num_experts": 6, "moe_router_topk": 3, "moe_ffn_hidden_size": 16,
                           "moe_shared_expert_intermediate_size": 16}),  # dY * w cast to bf16
    ("all-to-one", NARROW | {"b": 2, "s": 31, "a": 4, "moe_ffn_hidden_size": 256,
                             "moe_shared_expert_intermediate_size": 256}),  # the shared experts' product's backward
    ("balanced", NARROW | {"b": 1, "s": 3, "h": 64, "moe_shared_expert_intermediate_size": 1024}),  # their down_proj
]


def test_with_experts_the_sizes_put_the_peak_in_six_different_places():
    peaks = {timeline(make_config(DEEPSEEK, **(EXPERTS | c)), STRATEGIES["none"], CPU).peak.label()
             for _, c in MOE_PEAKS}
    assert len(peaks) == len(MOE_PEAKS), peaks


@pytest.mark.parametrize("route, changes", [
    *MOE_PEAKS,
    ("all-to-one", {"b": 3, "s": 7, "L": 3, "moe_first_dense_layers": 1}),  # first_k_dense_replace: LlamaMLP first
    ("balanced", {"b": 1, "s": 13, "moe_router_topk": 1, "q_lora_rank": None}),
    ("balanced", {"b": 3, "s": 11, "moe_shared_expert_intermediate_size": 64, "moe_router_pre_softmax": True,
                  "dropout": 0.1}),  # norm_topk_prob false: no division
    # the eager loop: its experts' dX summed apart (their input a view of the block's), then into the shared experts'
    ("balanced", {"b": 2, "s": 9, "experts_implementation": "eager", "moe_first_dense_layers": 1}),
    ("balanced", NARROW | {"b": 1, "s": 32, "a": 4, "num_experts": 8, "moe_router_topk": 3,
                           "experts_implementation": "eager"}),  # forward: the last expert's weighted output
    ("balanced", NARROW | {"b": 1, "s": 4, "h": 64, "a": 4, "moe_router_topk": 3, "dtype": "fp32",  # gate_up's sum
                           "moe_shared_expert_intermediate_size": 16, "experts_implementation": "eager"}),
    # fp32: the router's cast a no-op, its GEMM keeps the block's input itself
    ("all-to-one", {"b": 3, "s": 7, "L": 3, "moe_first_dense_layers": 1, "dtype": "fp32"}),
    ("balanced", NARROW | {"b": 2, "s": 31, "a": 4, "moe_ffn_hidden_size": 256,
                           "moe_shared_expert_intermediate_size": 256, "dtype": "fp32"}),
], ids=str)
def test_deepseek_v3moe_steps_happen_in_order_and_peak_where_the_timeline_says_to_the_byte(one_thread, route,
                                                                                           changes):
    r = _exact_step(make_config(DEEPSEEK, **(EXPERTS | changes)), "none", route)
    assert r.model == f"transformers' DeepseekV3ForCausalLM, router forced {route}"


@pytest.mark.parametrize("changes", [
    {"b": 1, "s": 7, "dp_shard": 2},
    {"b": 3, "s": 5, "dp_shard": 2, "reshard_after_forward": False, "q_lora_rank": None},
    {"b": 2, "s": 9, "dp_shard": 4, "dtype": "fp32"},
], ids=str)
def test_under_fsdp2_the_latent_attentions_step_happens_in_order_and_peaks_where_the_timeline_says(one_thread,
                                                                                                   changes):
    """FSDP2 over DeepseekV3DecoderLayer: each layer's unit lays out the latents' projections and norms."""
    config = make_config(DEEPSEEK, **changes)
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], _readings(config))
    (r,) = measure_step(config, ["none"])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("changes, named", [
    ({"recompute": "full"}, "recompute full \\(gradient checkpointing\\) with latent attention"),
    ({"zero_stage": 3}, "zero_stage with latent attention"),
    (EXPERTS | {"dp_shard": 2}, "DeepseekV3MoE under dp_shard"),
])
def test_what_the_latent_attention_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(DEEPSEEK, **changes), STRATEGIES["none"], CPU)
