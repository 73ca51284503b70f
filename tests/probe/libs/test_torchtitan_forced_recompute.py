"""torchtitan's SelectiveAC forces every matmul whose weight on a rank has its MoE block's router gate shape, (h, E),
to recompute (force_recompute_mm_shapes_by_fqns) and leaves it out of its every-second-matmul count, so the matmuls
after it swap saved and recomputed. Measured on torchtitan's own blocks (Qwen3's MoE block behind Llama3's attention,
DeepSeek-V3's) under its TP plan on the fake group, against the rules (memcalc.model.impls.torchtitan: `_forced`)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs import torchtitan as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config  # noqa: E402

from . import assert_exact  # noqa: E402

CPU = Accounting(exact=True, device="cpu")
# h = 32, a = 4 heads of d = 8, g = 2: wqkv (32, 64/t), wo (32/t, 32); E = 4 experts of 32 (16-byte runs at t = 2)
SIZES = {"h": 32, "a": 4, "num_query_groups": 2, "impl": "torchtitan", "recompute": "op", "num_experts": 4,
         "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_tokens": "balanced"}
DEEPSEEK_V3 = {"moe_router_score_function": "sigmoid", "num_query_groups": None, "kv_lora_rank": 24,
               "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}  # wkv_a (h, 24 + 4)
MATMULS = {"attention/qkv_out", "attention/wo_out", "moe/shared_gate", "moe/shared_up", "moe/shared_fc2_out",
           "mla/wq_out", "mla/wq_a_out", "mla/wkv_a_out", "mla/wkv_b_out"}

# each block at t = 2, and the matmul outputs SelectiveAC saves there
CASES = {
    "no weight of the gate's shape: wqkv's, w1's and w2's (the control)": (
        {"moe_shared_expert_intermediate_size": 16}, {"attention/qkv_out", "moe/shared_gate", "moe/shared_fc2_out"}),
    "the shared experts' w1 and w3 at u/t = E: recomputed, w2 still third": (
        {"moe_shared_expert_intermediate_size": 8}, {"attention/qkv_out", "moe/shared_fc2_out"}),
    "wqkv at (a + 2g)d/t = E: the count starts at wo, so wo's and w3's": (
        {"num_experts": 32, "moe_shared_expert_intermediate_size": 16}, {"attention/wo_out", "moe/shared_up"}),
    "h = E = u/t: wqkv and every shared matmul forced, wo's alone": (
        {"num_experts": 32, "moe_shared_expert_intermediate_size": 64}, {"attention/wo_out"}),
    "deepseek-v3's block, the shared experts' w1 and w3 at u/t = E: w3 no longer fourth": (
        DEEPSEEK_V3 | {"q_lora_rank": 16, "moe_shared_expert_intermediate_size": 8},
        {"mla/wq_a_out", "mla/wkv_a_out", "attention/wo_out"}),
    "deepseek-v3's block, its replicated wkv_a at r_kv + d_r = E: wkv_b, w1 and w2 take the odd places": (
        DEEPSEEK_V3 | {"q_lora_rank": 16, "num_experts": 28, "moe_shared_expert_intermediate_size": 16},
        {"mla/wq_a_out", "mla/wkv_b_out", "moe/shared_gate", "moe/shared_fc2_out"}),
    "deepseek-v3's block without a query latent, wkv_a forced: wq's, wo's and w3's": (
        DEEPSEEK_V3 | {"num_experts": 28, "moe_shared_expert_intermediate_size": 16},
        {"mla/wq_out", "attention/wo_out", "moe/shared_up"}),
}


@pytest.mark.parametrize("b, s", [(1, 6), (2, 10)])  # s/t odd
@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
@pytest.mark.parametrize("knobs, saved", CASES.values(), ids=CASES.keys())
def test_a_matmul_of_the_gate_shape_shifts_which_matmul_outputs_selective_ac_saves(knobs, saved, strategy, b, s):
    config = build_config(SIZES | knobs | {"t": 2, "b": b, "s": s})
    layout = STRATEGIES[strategy]
    rows = compare(estimate(config, layout, CPU), run_fake(runner.run_layer, (config, layout, "balanced"), 2))
    assert_exact(rows)
    assert {row.name for row in rows} & MATMULS == saved


@pytest.mark.parametrize("experts, saved", [
    (64, {"attention/wo_out", "moe/shared_up"}),  # wqkv (h, (a + 2g)d) = (32, 64) forced
    (32, {"attention/qkv_out", "moe/shared_up"}),  # wo (ad, h) = (32, 32) forced: h = E
])
def test_without_tensor_parallelism_a_whole_weight_of_the_gate_shape_is_recomputed(experts, saved):
    config = build_config(SIZES | {"num_experts": experts, "moe_shared_expert_intermediate_size": 16, "b": 2, "s": 7})
    none = STRATEGIES["none"]
    rows = compare(estimate(config, none, CPU), runner.run_layer(single("cpu"), config, none, route="balanced"))
    assert_exact(rows)
    assert {row.name for row in rows} & MATMULS == saved


@pytest.mark.parametrize("changes, strategy", [
    ({"t": 2, "b": 1, "s": 7, "num_experts": 48}, "tp"),  # wqkv (64, (8 + 4)8/2): every later matmul shifted
    ({"t": 2, "b": 2, "s": 10, "moe_shared_expert_intermediate_size": 8}, "tp-sp"),  # w1 and w3 at u/t = E = 4
    # the dense layer's w1 (64, 176/2) at E = 88: no gate in its block, so nothing forced there
    ({"t": 2, "b": 1, "s": 7, "num_experts": 88, "moe_first_dense_layers": 1}, "tp"),
], ids=str)
def test_the_step_walk_caches_what_selective_ac_saves_after_the_shift(one_thread, changes, strategy):
    """The step timeline's checkpoint caches the ledger's shifted set: the peak, each category there and the state
    between steps to the byte."""
    moe = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_tokens": "balanced"}
    (r,) = measure_step(make_config(LLAMA3, **(moe | changes), recompute="op"), [strategy], route="balanced")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
