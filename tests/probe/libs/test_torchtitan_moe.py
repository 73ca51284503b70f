"""torchtitan's MoE layer (Qwen3TransformerBlock's MoE: router, local dispatcher, GroupedExperts on
torch._grouped_mm, shared experts) keeps, tensor by tensor, what memcalc's torchtitan rules predict.

The byte-exact checks force the router (`--route`): balanced and all-to-one. At ep = 1 one rank runs every
expert, so both routes keep the same bytes; with the real router the measured bytes fall within the predicted
balanced and worst bounds.
"""

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")
pytestmark = pytest.mark.usefixtures("one_thread")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.impls import plan  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs import torchtitan as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from . import assert_exact, assert_within_bounds  # noqa: E402

SIZES = {"b": 2, "s": 8, "h": 32, "a": 4, "num_query_groups": 2, "impl": "torchtitan", "recompute": "none",
         "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24}
QWEN3_MOE = {}  # softmax router, route_norm (its builder's), no shared experts
QWEN3_ATTENTION = {"qk_layernorm": True, "kv_channels": 12}  # its Qwen3 attention (heads of 12, not h/a = 8)
DEEPSEEK_V3 = {"moe_router_score_function": "sigmoid", "moe_shared_expert_intermediate_size": 48}
# its latent attention (DeepSeekV3TransformerBlock's own): heads of d_n + d_r = 8 + 4, values of d_v = 12
MLA = {"num_query_groups": None, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}
Q_LATENT = {"q_lora_rank": 16}
NONE = STRATEGIES["none"]
CPU = Accounting(exact=True, device="cpu")


def _rows(knobs: dict, route: str | None, bound: str = "balanced"):
    config = build_config(SIZES | knobs | {"moe_tokens": bound})
    return compare(estimate(config, NONE, CPU), runner.run_layer(single("cpu"), config, NONE, route=route))


CASES = {
    "qwen3-moe's router: softmax, top-k renormalised (route_norm)": QWEN3_MOE,
    "without route_norm: no top-k sum or quotient": QWEN3_MOE | {"moe_router_pre_softmax": True},
    "deepseek-v3's router: sigmoid, route_norm, a shared expert on the normalised input": DEEPSEEK_V3,
    "one expert a token of eight, shared experts wider than the routed": {
        "num_experts": 8, "moe_router_topk": 1, "moe_shared_expert_intermediate_size": 64},
    "the moe layer of a dense + moe mix": QWEN3_MOE | {"moe_layer_freq": 2, "L": 2},
    "qwen3-moe with its own attention: q_norm, k_norm, heads of kv_channels": QWEN3_MOE | QWEN3_ATTENTION,
    "deepseek-v3's own block: its latent attention (a query latent) before its MoE": DEEPSEEK_V3 | MLA | Q_LATENT,
}


@pytest.mark.parametrize("route", ["balanced", "all-to-one"])
@pytest.mark.parametrize("knobs", CASES.values(), ids=CASES.keys())
def test_a_forced_router_makes_the_moe_layer_keep_exactly_what_the_rules_predict(knobs, route):
    rows = _rows(knobs, route)
    assert_exact(rows)
    assert {"moe/router_in_fp32", "moe/expert_gate", "moe/expert_out_fp32"} <= {row.name for row in rows}


def test_the_router_runs_in_fp32_on_the_cpu_as_under_cudas_autocast():
    rows = {row.name: row for row in _rows(DEEPSEEK_V3, "balanced")}
    assert rows["moe/router_scores_fp32"].measured == 2 * 8 * 4 * 4  # b*s*E fp32, not bf16
    assert rows["moe/input"].measured == 2 * 8 * 32 * 2  # the shared experts keep the bf16 input


SELECTIVE = {"layer/input", "attention/qkv_out", "attention/proj_in", "attention/softmax_lse", "moe/topk_values_fp32",
             "moe/topk_indices"}


@pytest.mark.parametrize("recompute, knobs, kept", [
    ("full", QWEN3_MOE, {"layer/input"}),
    ("full", DEEPSEEK_V3, {"layer/input"}),
    ("op", QWEN3_MOE, SELECTIVE),
    ("op", DEEPSEEK_V3, SELECTIVE | {"moe/shared_gate", "moe/shared_fc2_out"}),
    ("op", DEEPSEEK_V3 | MLA, SELECTIVE - {"attention/qkv_out", "attention/proj_in"} | {
        "mla/wq_out", "mla/wkv_b_out", "mla/proj_in", "moe/shared_gate", "moe/shared_fc2_out"}),
    ("op", DEEPSEEK_V3 | MLA | Q_LATENT, SELECTIVE - {"attention/qkv_out", "attention/proj_in"} | {
        "mla/wq_a_out", "mla/wkv_a_out", "mla/proj_in", "attention/wo_out", "moe/shared_up"}),
], ids=["full-qwen3-moe", "full-deepseek-v3", "op-qwen3-moe", "op-deepseek-v3", "op-deepseek-v3-latent-attention",
        "op-deepseek-v3-latent-attention-with-a-query-latent"])
def test_under_its_activation_checkpointing_the_moe_layer_keeps_exactly_what_the_rules_predict(recompute, knobs, kept):
    """FullAC keeps the block's input alone; SelectiveAC also its cached op outputs: wqkv's matmul, the attention
    kernel's, the router's top-k (values and ids), and with shared experts their w1's and w2's matmuls (the gate's mm
    forced to recompute, the grouped experts' _grouped_mm not on its list). DeepSeek-V3's latent attention has four
    matmuls (wq's and wkv_b's saved), or with a query latent five (wq_a's, wkv_a's and wo's saved), which makes the
    shared experts' w3 the one saved."""
    rows = _rows(knobs | {"recompute": recompute}, "balanced")
    assert_exact(rows)
    assert {row.name for row in rows} == kept


@pytest.mark.parametrize("knobs", [QWEN3_MOE, DEEPSEEK_V3], ids=["qwen3-moe", "deepseek-v3"])
def test_with_the_real_router_each_tensor_lies_within_the_balanced_and_worst_bounds(knobs):
    assert_within_bounds(_rows(knobs, None), _rows(knobs, "balanced", bound="balanced"),
                         _rows(knobs, "balanced", bound="worst"))


@pytest.mark.parametrize("knobs, words", [
    ({"moe_expert_capacity_factor": 1.0}, "drops no tokens"),
    ({"moe_token_dispatcher_type": "allgather"}, "is Megatron's"),
    ({"moe_aux_loss": True}, "without an auxiliary loss"),
    ({"ep": 2, "t": 4}, "ep=2 is measured as ep = t"),
    ({"ep": 2, "t": 2, "s": 9}, "t dividing s"),
    ({"t": 2}, "moe_ffn_hidden_size/t=24/2=12 is not a multiple of 8"),
    ({"dtype": "fp32"}, "GroupedExperts computes in bf16"),
    # found by the random audit (a traceback from torch._grouped_mm before)
    ({"h": 12, "a": 2, "num_query_groups": 1}, r"h=12 is not a multiple of 8: torch._grouped_mm \(its GroupedExperts\)"),
    ({"moe_ffn_hidden_size": 20}, "moe_ffn_hidden_size/t=20/1=20 is not a multiple of 8"),
])
def test_moe_knobs_the_measured_block_does_not_run_are_refused_in_one_line(knobs, words):
    with pytest.raises(ConfigError, match=words) as caught:
        estimate(build_config(SIZES | knobs), NONE)
    assert "\n" not in str(caught.value)


def test_expert_parallelism_without_tensor_parallelism_is_refused_naming_where_torchtitan_takes_its_ranks():
    with pytest.raises(ConfigError, match="dp_shard"):
        plan(build_config(SIZES | {"t": 2, "ep": 2, "moe_ffn_hidden_size": 32}), STRATEGIES["none"])


# -- under its own TP plan (set_moe_sharding_config, Module.parallelize), rank 0 of t = 2 through the fake group:
# at ep = 1 the MoE's input gathered whole (under SP), the experts split in width; at ep = t each rank routes its own
# s/t tokens to E/ep whole experts over the all-to-all dispatcher (all-to-one: rank 0 receives every rank's slots)

# (the forced balanced route deals a rank's k*b*s/t slots round the ep ranks first, then round each rank's E/ep
# experts: every rank gets k*b*s/(t*ep) of them where ep divides them, whether or not E does; elsewhere rank 0 one more)
TP_CASES = {
    "qwen3-moe": QWEN3_MOE | {"moe_ffn_hidden_size": 32},
    "deepseek-v3 at b = 1, s/t odd, k = 2 of 6": DEEPSEEK_V3 | {
        "b": 1, "s": 6, "num_experts": 6, "moe_router_topk": 2, "moe_ffn_hidden_size": 16},
    "one of eight, b = 8, s/t = 1": QWEN3_MOE | {
        "b": 8, "s": 2, "num_experts": 8, "moe_router_topk": 1, "moe_ffn_hidden_size": 48},
    # found by a drawn run (tp-sp, t = ep = 2, b = 1, s = 2, k = 2 of 4): the route dealt slots m to experts m mod E,
    # so both of a rank's slots went to rank 0's experts 0 and 1 and rank 0 received 4 slots, not k*b*s/t = 2
    # (expert_in +384 B at h = 96); it now deals them round the ep ranks first, as megatron's forced route does
    "qwen3-moe at b = 1, s/t = 1: a rank's two slots, fewer than the four experts": QWEN3_MOE | {
        "b": 1, "s": 2, "moe_ffn_hidden_size": 32},
    # found by a drawn run: ep = 2 does not divide a rank's one slot, so rank 0 receives one from each rank, 2, where
    # the rules said k*b*s/t = 1 (evaluate.routed_slots now deals as the route does; under tp too, its `routers`)
    "qwen3-moe top-1 at b = 1, s/t = 1: one slot a rank, which ep = 2 does not divide": QWEN3_MOE | {
        "b": 1, "s": 2, "moe_router_topk": 1, "moe_ffn_hidden_size": 32},
    # found by `memcalc measure`: SelectiveAC keeps the shared experts' w2 output before its reduce-scatter, whole
    "deepseek-v3 under SelectiveAC: the shared experts' w2 output is every token's": DEEPSEEK_V3 | {
        "recompute": "op", "moe_ffn_hidden_size": 16},
    "qwen3-moe with its own attention at b = 1, s/t odd": QWEN3_MOE | QWEN3_ATTENTION | {
        "b": 1, "s": 10, "moe_ffn_hidden_size": 32},
}


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("route, bound", [("balanced", "balanced"), ("all-to-one", "worst")])
@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
@pytest.mark.parametrize("knobs", TP_CASES.values(), ids=TP_CASES.keys())
def test_under_its_tp_plan_and_ep_the_moe_layer_keeps_exactly_what_the_rules_predict(knobs, strategy, route, bound,
                                                                                     ep):
    config = build_config(SIZES | knobs | {"t": 2, "ep": ep, "moe_tokens": bound})
    layout = STRATEGIES[strategy]
    rows = compare(estimate(config, layout, CPU), run_fake(runner.run_layer, (config, layout, route), 2))
    assert_exact(rows)
    assert ("moe/permuted_indices" in {row.name for row in rows}) == (ep > 1 and config.recompute == "none")
