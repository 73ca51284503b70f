"""transformers' sparse-MoE layers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) keep, tensor by tensor, what memcalc's hf rules predict.

Each runs its experts both ways transformers does: grouped_mm (its default) and the eager loop. The tokens each
expert receives depend on the router, so the byte-exact checks force it (`--route`): balanced (kbs/E slots each)
and all-to-one (every token to experts 0..k-1). With the real router the measured bytes fall within the predicted
balanced and worst bounds. Under transformers' own tensor-parallel plan each rank keeps its
F_E/t of every expert's width and the rest of the sparse block whole (the router, the routed tokens, the routing
weights, and Qwen2-MoE's shared expert, which the plan does not name).
"""

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import hf as runner  # noqa: E402
from memcalc.probe.libs.hf_shim import force_routers  # noqa: E402
from memcalc.probe.measure import compare, measure  # noqa: E402
from . import assert_exact, assert_within_bounds  # noqa: E402

# torch._grouped_mm wants 16-byte strides: h and each rank's expert width F_E/t multiples of 8 in bf16.
SIZES = {"b": 2, "s": 8, "h": 32, "a": 4, "num_query_groups": 2, "impl": "hf", "attention": "eager",
         "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}
PATHS = ("grouped_mm", "eager")  # experts_implementation: transformers' default first
MIXTRAL = {"family": "mixtral"}
QWEN2_MOE = {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 16, "add_qkv_bias": True, "moe_router_pre_softmax": True}
QWEN3_MOE = {"family": "qwen3_moe", "qk_layernorm": True, "kv_channels": 16}  # Qwen2-MoE's router and experts, no shared expert
# DeepseekV3DecoderLayer: latent attention, a sigmoid router over 8 experts in 2 groups, one shared expert
DEEPSEEK_V3 = {"family": "deepseek_v3", "num_query_groups": None, "num_experts": 8, "moe_shared_expert_intermediate_size": 32,
               "moe_router_score_function": "sigmoid", "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4,
               "qk_nope_head_dim": 8, "v_head_dim": 8}
NONE = STRATEGIES["none"]
CPU = Accounting(exact=True, device="cpu")


def _rows(knobs: dict, route: str | None, dense: bool = False, bound: str = "balanced"):
    config = build_config(SIZES | knobs | {"moe_tokens": bound})
    saved = runner.run_layer(single("cpu"), config, NONE, route=route, dense=dense)
    prediction = estimate(config, NONE, CPU)
    return compare(replace(prediction, tensors=prediction.dense) if dense else prediction, saved)


CASES = {
    "mixtral: fp32 router with the top-k renormalised, fp32 routing weights": MIXTRAL,
    "qwen2-moe: gated shared expert, top-k used as is, routing weights cast to bf16": QWEN2_MOE,
    "qwen2-moe with norm_topk_prob: the renormalisation's sum and weights too":
        QWEN2_MOE | {"moe_router_pre_softmax": False},
    "qwen2-moe sdpa with two experts a token of eight": QWEN2_MOE | {"attention": "flash", "num_experts": 8},
    "qwen2-moe's sparse layer of a dense + moe mix (decoder_sparse_step 2)": QWEN2_MOE | {"moe_layer_freq": 2, "L": 2},
    "qwen3-moe: q/k norms, heads of head_dim, norm_topk_prob, routing weights cast to bf16": QWEN3_MOE,
    "qwen3-moe without norm_topk_prob, sdpa, two experts a token of eight":
        QWEN3_MOE | {"moe_router_pre_softmax": True, "attention": "flash", "num_experts": 8},
    "qwen3-moe's sparse layer of a dense + moe mix (decoder_sparse_step 2)": QWEN3_MOE | {"moe_layer_freq": 2, "L": 2},
    "deepseek-v3: fp32 router input, sigmoid scores, renormalised top-k, shared expert on the block's input":
        DEEPSEEK_V3,
    "deepseek-v3 without norm_topk_prob, two shared experts, past a first dense layer":
        DEEPSEEK_V3 | {"moe_router_pre_softmax": True, "moe_shared_expert_intermediate_size": 64,
                       "moe_first_dense_layers": 1, "L": 2},
    "mixtral at b=1, s=7: fourteen slots that four experts do not share evenly": MIXTRAL | {"b": 1, "s": 7},
    "qwen2-moe at b=1, s=5": QWEN2_MOE | {"b": 1, "s": 5},
    "qwen3-moe at b=1, s=3, sdpa": QWEN3_MOE | {"b": 1, "s": 3, "attention": "flash"},
    "deepseek-v3 at b=2, s=7": DEEPSEEK_V3 | {"s": 7},  # b=1: latent attention's V differs (not the experts')
    # found by the step: the router's cast is a no-op, so F.linear keeps the block's input itself, no fp32 copy
    "deepseek-v3 in fp32": DEEPSEEK_V3 | {"dtype": "fp32"},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("route", ["balanced", "all-to-one"])
@pytest.mark.parametrize("knobs", CASES.values(), ids=CASES.keys())
def test_a_forced_router_makes_the_moe_layer_keep_exactly_what_the_rules_predict(knobs, route, path):
    rows = _rows(knobs | {"experts_implementation": path}, route)
    assert_exact(rows)
    assert any(row.name == "moe/expert_gate" for row in rows)


def test_grouped_mm_keeps_no_combine_source_but_three_slot_permutations_and_int32_offsets():
    grouped, eager = (_rows(MIXTRAL | {"experts_implementation": path}, "balanced") for path in PATHS)
    kept = {row.name: row.measured for row in grouped}
    b, s, h, e, k = (SIZES[x] for x in ("b", "s", "h", "num_experts", "moe_router_topk"))
    slots = k * b * s
    assert "moe/combine_in" not in kept and "moe/token_slots" not in kept
    assert [kept[x] for x in ("moe/token_indices", "moe/sorted_slots", "moe/unsorted_slots")] == [8 * slots] * 3
    assert kept["moe/expert_offsets"] == 4 * e
    dropped = sum(row.measured for row in eager) - sum(kept.values())
    assert dropped == 2 * slots * h + 16 * slots - (3 * 8 * slots + 4 * e)  # index_add_'s bf16 source, the pairs


def test_the_dense_layer_of_a_mix_keeps_the_dense_mlp_of_the_rules():
    rows = _rows(QWEN2_MOE | {"moe_layer_freq": 2, "L": 2}, None, dense=True)  # layer 0 dense, layer 1 MoE
    assert [row.describe() for row in rows if not row.matches] == []
    assert "mlp/gate" in {row.name for row in rows} and not any(row.name.startswith("moe/") for row in rows)


def test_qwen3_moes_dense_layer_of_a_mix_keeps_the_dense_mlp_and_the_qk_norms():
    rows = _rows(QWEN3_MOE | {"moe_layer_freq": 2, "L": 2}, None, dense=True)
    assert [row.describe() for row in rows if not row.matches] == []
    names = {row.name for row in rows}
    assert {"mlp/gate", "attention/q_norm_normed"} <= names and not any(n.startswith("moe/") for n in names)


def test_deepseek_v3s_first_dense_layer_keeps_the_dense_mlp_of_the_rules():
    rows = _rows(DEEPSEEK_V3 | {"moe_first_dense_layers": 1, "L": 2}, None, dense=True)
    assert [row.describe() for row in rows if not row.matches] == []
    assert "mlp/gate" in {row.name for row in rows} and not any(row.name.startswith("moe/") for row in rows)


def test_what_deepseeks_group_choice_saves_is_freed_with_the_router_so_not_counted():
    rows = _rows(DEEPSEEK_V3, "balanced")
    assert not [row.describe() for row in rows if row.name is None or "unlabelled" in row.name]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("knobs", [MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3],
                         ids=["mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"])
def test_with_the_real_router_each_tensor_lies_within_the_balanced_and_worst_bounds(knobs, path):
    knobs = knobs | {"experts_implementation": path}
    assert_within_bounds(_rows(knobs, None), _rows(knobs, "balanced", bound="balanced"),
                         _rows(knobs, "balanced", bound="worst"))


def _slots_per_expert(route: str) -> list[int]:
    config = transformers.MixtralConfig(hidden_size=8, num_local_experts=4, num_experts_per_tok=2)
    router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.02)
    force_routers(router, (type(router),), route, k=2)
    _, _, indices = router(torch.randn(6, 8))
    return torch.bincount(indices.flatten(), minlength=4).tolist()


def test_the_forced_routes_send_each_expert_the_slots_they_say_and_leave_the_router_class_alone():
    original = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter.forward
    assert _slots_per_expert("balanced") == [3, 3, 3, 3]  # k*b*s/E = 2*6/4
    assert _slots_per_expert("all-to-one") == [6, 6, 0, 0]
    assert transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter.forward is original


# -- tensor parallelism: transformers' own plan for the experts ------------------------------------------------------

TP = STRATEGIES["tp"]


def _tp_rows(knobs: dict, route: str | None, t: int = 2, mode: str = "fake", dense: bool = False):
    """Each rank's rows under transformers' tp_plan at t with the router forced (rank 0 of the fake group, or every
    spawned rank); `dense` a mix's dense layer."""
    config = build_config(SIZES | knobs | {"t": t})
    prediction = estimate(config, TP, CPU)
    per_rank = run(runner.run_layer, (config, TP, route, dense), mode=mode, t=t)
    expected = replace(prediction, tensors=prediction.dense) if dense else prediction
    return [compare(expected, saved) for saved in per_rank]


TP_CASES = {
    "mixtral t=2: packed_colwise gate_up and rowwise down split each expert's width": (MIXTRAL, 2),
    "mixtral sdpa t=4, two experts a token of eight":
        (MIXTRAL | {"attention": "flash", "num_experts": 8, "h": 64, "a": 8, "num_query_groups": 4}, 4),
    "qwen3-moe t=2: q/k norms on this rank's heads, routing weights cast to bf16": (QWEN3_MOE, 2),
    "qwen2-moe t=2: the shared expert, named by no rule, whole": (QWEN2_MOE, 2),
    "qwen2-moe with norm_topk_prob, sdpa, eight experts, t=2":
        (QWEN2_MOE | {"moe_router_pre_softmax": False, "attention": "flash", "num_experts": 8}, 2),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("route", ["balanced", "all-to-one"])
@pytest.mark.parametrize("knobs, t", TP_CASES.values(), ids=TP_CASES.keys())
def test_under_its_own_tp_plan_a_forced_moe_layer_keeps_exactly_what_the_rules_predict(one_thread, knobs, t, route,
                                                                                     path):
    (rows,) = _tp_rows(knobs | {"experts_implementation": path}, route, t)
    assert_exact(rows)


def test_under_tp_each_rank_keeps_its_share_of_the_expert_width_and_every_routed_token(one_thread):
    (rows,) = _tp_rows(MIXTRAL, "all-to-one")
    shapes = {row.name: row.measured_shape for row in rows}
    b, s, h, e, k, f = (SIZES[x] for x in ("b", "s", "h", "num_experts", "moe_router_topk", "moe_ffn_hidden_size"))
    r = k * b * s  # every slot, on every rank: each runs all E experts on its F_E/t columns
    assert shapes["moe/expert_gate"] == shapes["moe/expert_silu_out"] == shapes["moe/expert_fc2_in"] == (r, f // 2)
    assert shapes["moe/expert_in"] == shapes["moe/expert_out"] == (r, h)
    assert shapes["moe/sorted_slots"] == (r,) and shapes["moe/expert_offsets"] == (e,)  # grouped_mm's, whole
    assert shapes["moe/router_probs_fp32"] == (b, s, e) and shapes["moe/topk_weights_fp32"] == (b, s, k)


def test_under_tp_qwen2_moes_shared_expert_is_whole_and_a_mixs_dense_mlp_split(one_thread):
    (sparse,) = _tp_rows(QWEN2_MOE, "balanced")
    (dense,) = _tp_rows(QWEN2_MOE | {"moe_layer_freq": 2, "L": 2}, None, dense=True)
    assert [row.describe() for row in dense if not row.matches] == []
    b, s, u = SIZES["b"], SIZES["s"], QWEN2_MOE["moe_shared_expert_intermediate_size"]
    f = 4 * SIZES["h"]  # the dense layer's ffn_hidden_size, unset: 4h
    shapes = {row.name: row.measured_shape for row in (*sparse, *dense)}
    assert shapes["moe/shared_gate"] == shapes["moe/shared_fc2_in"] == (b, s, u)  # mlp.shared_expert: no rule
    assert shapes["mlp/gate"] == shapes["mlp/fc2_in"] == (b, s, f // 2)  # the plan's mlp.gate_proj etc.


@pytest.mark.procs
def test_two_gloo_ranks_route_alike_and_each_keep_what_rank_zero_of_the_fake_group_keeps():
    ranks = _tp_rows(MIXTRAL, "balanced", mode="spawn")
    assert [[row.describe() for row in rows if not row.matches] for rows in ranks] == [[], []]
    assert ranks[0] == ranks[1] == _tp_rows(MIXTRAL, "balanced")[0]


@pytest.mark.parametrize("knobs, words", [
    (MIXTRAL | {"moe_router_pre_softmax": True}, "MixtralSparseMoeBlock always renormalises"),
    (MIXTRAL | {"moe_layer_freq": 2}, "every MixtralDecoderLayer is a MoE layer"),
    (MIXTRAL | {"moe_expert_capacity_factor": 1.0}, "drop no tokens"),
    (MIXTRAL | {"moe_token_dispatcher_type": "allgather"}, "is Megatron's"),
    (MIXTRAL | {"moe_router_score_function": "sigmoid"}, "the sigmoid router is DeepseekV3MoE's"),
    (DEEPSEEK_V3 | {"moe_router_score_function": "softmax"}, "DeepseekV3TopkRouter scores with sigmoid"),
    (DEEPSEEK_V3 | {"moe_shared_expert_intermediate_size": 20}, "must be a multiple of moe_ffn_hidden_size=32"),
    (QWEN3_MOE | {"moe_shared_expert_intermediate_size": 16},
     "Qwen3MoeDecoderLayer, which has no moe_shared_expert_intermediate_size"),
    (DEEPSEEK_V3 | {"qk_layernorm": True}, "qk_layernorm with kv_lora_rank"),
    (MIXTRAL | {"t": 2, "moe_ffn_hidden_size": 24}, "moe_ffn_hidden_size/t=24/2=12 is not a multiple of 8:"
                                                   " torch._grouped_mm"),
    (MIXTRAL | {"h": 36, "a": 6}, "h=36 is not a multiple of 8"),
    (MIXTRAL | {"dtype": "fp32", "moe_ffn_hidden_size": 18}, "moe_ffn_hidden_size/t=18/1=18 is not a multiple of 4"),
])
def test_moe_knobs_no_transformers_block_has_are_refused(knobs, words):
    with pytest.raises(ConfigError, match=words):
        estimate(build_config(SIZES | knobs), NONE)


@pytest.mark.parametrize("impl", ["megatron", "torchtitan"])
def test_experts_implementation_is_refused_outside_transformers(impl):
    with pytest.raises(ConfigError, match=f"transformers' choice .--impl hf.; impl {impl} runs its own experts"):
        estimate(build_config(SIZES | {"impl": impl, "experts_implementation": "eager"}), NONE)


def test_the_eager_loop_runs_at_widths_grouped_mm_refuses():
    rows = _rows(MIXTRAL | {"moe_ffn_hidden_size": 20, "experts_implementation": "eager"}, "balanced")
    assert_exact(rows)


def test_a_forced_route_needs_experts_and_a_library_whose_router_it_forces():
    dense = build_config({k: v for k, v in SIZES.items() if not k.startswith(("num_experts", "moe_"))})
    with pytest.raises(ConfigError, match="--route balanced forces a library's MoE router"):
        measure(dense, ["none"], "cpu", None, "auto", 60.0, route="balanced")
