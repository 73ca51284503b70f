"""torchtitan's experts over the FSDP2 ranks (DeepSeek-V3's and Qwen3-MoE's training layout): at t = 1 its
ParallelDims takes the ep ranks from dp_shard (efsdp = dp_shard/ep), so each rank routes its own b*s tokens (not a
slice of the sequence, as under ep = t) to E/ep whole experts over the all-to-all dispatcher. The layer runs as rank 0
of a fake world of dp_shard ranks that its runner makes, its router forced: balanced (each rank receives k*b*s slots
where ep divides them) and all-to-one (every rank's slots to rank 0's experts, the worst bound). Its states and its
whole step under torchtitan's own parallelize (FSDP2 of the routed experts over efsdp beside the rest over dp_shard,
its explicit prefetching, the all-to-alls on funcol) are measured against --totals and the step walk to the byte."""

from math import prod

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs import torchtitan as runner  # noqa: E402
from memcalc.probe.libs.torchtitan_step import data_parallel, warmed_up_sharded  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.params import EXPERTS  # noqa: E402
from memcalc.sizing.states import describe_sharding  # noqa: E402
from memcalc.sizing.timeline.fsdp import Fsdp, _padded  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402
from memcalc.sizing.totals import per_gpu  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3, make_config  # noqa: E402

from ..step_readings import assert_moments_in_order, assert_step_exact, torchtitan_fsdp_readings  # noqa: E402
from . import assert_exact  # noqa: E402

SIZES = {"b": 2, "s": 7, "h": 32, "a": 4, "num_query_groups": 2, "impl": "torchtitan", "recompute": "none",
         "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "t": 1,
         "loss_chunks": 0}  # its plain loss: its chunked one refuses s = 7 in 8 chunks
DEEPSEEK_V3 = {"moe_router_score_function": "sigmoid", "moe_shared_expert_intermediate_size": 48}
NONE = STRATEGIES["none"]
CPU = Accounting(exact=True, device="cpu")

CASES = {
    "ep 2 of dp_shard 2, b 2, s odd": {"ep": 2, "dp_shard": 2},
    "ep 2 of dp_shard 4 (efsdp 2)": {"ep": 2, "dp_shard": 4},
    "ep 4 of dp_shard 4: one expert a rank": {"ep": 4, "dp_shard": 4},
    "ep 4 of dp_shard 4, eight experts, b 1, s odd": {"ep": 4, "dp_shard": 4, "num_experts": 8, "b": 1, "s": 9},
    "ep 2, top-1 of eight, b 1, s 3: slots ep does not divide": {
        "ep": 2, "dp_shard": 2, "num_experts": 8, "moe_router_topk": 1, "b": 1, "s": 3},
    "deepseek-v3's router and shared experts, ep 2 of dp_shard 4": DEEPSEEK_V3 | {"ep": 2, "dp_shard": 4},
}


@pytest.mark.parametrize("route, bound", [("balanced", "balanced"), ("all-to-one", "worst")])
@pytest.mark.parametrize("knobs", CASES.values(), ids=CASES.keys())
def test_each_rank_routes_its_own_tokens_to_its_experts_keeping_exactly_what_the_rules_predict(knobs, route, bound):
    config = build_config(SIZES | knobs | {"moe_tokens": bound})
    rows = _rows(config, route)
    assert_exact(rows)
    by_name = {row.name: row for row in rows}
    assert by_name["moe/expert_offsets"].measured_shape == (config.num_experts // config.ep,)
    assert by_name["moe/router_in_fp32"].measured_shape == (config.b, config.s, config.h)  # the rank's b*s tokens
    assert "moe/permuted_indices" in by_name  # the all-to-all dispatcher's, which ep = 1 does not run
    assert not dist.is_initialized()  # the fake world of dp_shard ranks is the runner's alone


@pytest.mark.parametrize("recompute", ["op", "full"])
def test_under_its_activation_checkpointing_ep_over_dp_shard_keeps_exactly_what_the_rules_predict(recompute):
    assert_exact(_rows(build_config(SIZES | {"ep": 2, "dp_shard": 4, "recompute": recompute}), "balanced"))


def _rows(config, route: str):
    return compare(estimate(config, NONE, CPU), runner.run_layer(single("cpu"), config, NONE, route=route))


def test_all_to_one_puts_every_ranks_slots_on_rank_0():
    config = build_config(SIZES | {"ep": 2, "dp_shard": 4, "moe_tokens": "worst"})
    expert_in = next(row for row in _rows(config, "all-to-one") if row.name == "moe/expert_in")
    assert expert_in.measured_shape == (config.ep * config.moe_router_topk * config.b * config.s, config.h)


@pytest.mark.parametrize("knobs, words", [
    ({"t": 2, "ep": 2, "dp_shard": 2}, "t=2, dp_shard=2"),
    ({"ep": 2, "dp_shard": 3}, "ep dividing dp_shard"),
    ({"ep": 2, "dp_shard": 2, "pp": 2, "L": 2}, "pp=2"),
    ({"ep": 2, "dp_shard": 2, "dp_replicate": 2}, "dp_replicate=2"),
    ({"ep": 2, "dp_shard": 2, "cp": 2}, "cp=2"),
])
def test_ep_over_dp_shard_beside_tp_pp_or_hsdp_or_not_dividing_it_is_refused_in_one_line(knobs, words):
    with pytest.raises(ConfigError, match=words) as caught:
        build_config(SIZES | knobs)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("ep, dp_shard, experts", [(2, 4, 8), (4, 4, 8), (2, 8, 4)])
def test_fsdp2_shards_the_routed_experts_over_efsdp_and_the_rest_over_dp_shard(ep, dp_shard, experts):
    config = build_config(SIZES | {"ep": ep, "dp_shard": dp_shard, "num_experts": experts})
    fsdp = Fsdp.torchtitan(config, 1, sp=False)
    params = [p for u in fsdp.units for p in u.params]
    routed = [p for p in params if p.group is EXPERTS]
    assert routed and all(p.shape[0] == experts // ep for p in routed)  # E/ep experts on each rank
    efsdp = dp_shard // ep  # dividing each expert weight's dim 0 (E/ep), or under Shard(1) its f and h: no padding
    rest = sum(_padded(p.shape, dp_shard) // dp_shard for p in params if p.group is not EXPERTS)
    assert fsdp.shard == sum(prod(p.shape) for p in routed) // efsdp + rest
    assert fsdp.shard > Fsdp.torchtitan(build_config(SIZES | {"dp_shard": dp_shard, "num_experts": experts // ep}),
                                        1, sp=False).shard


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_tokens": "balanced"}
STATE_CASES = {
    "ep 2 of dp_shard 2": {"ep": 2, "dp_shard": 2},
    "ep 2 of dp_shard 4 (efsdp 2)": {"ep": 2, "dp_shard": 4},
    "ep 4 of dp_shard 4 (efsdp 1)": {"ep": 4, "dp_shard": 4},
    "eight experts, ep 2 of dp_shard 4": {"ep": 2, "dp_shard": 4, "num_experts": 8},
    "eight experts, ep 4 of dp_shard 4": {"ep": 4, "dp_shard": 4, "num_experts": 8},
    "six experts, ep 2 of dp_shard 4: three a rank, dim 0 padded to 4": {"ep": 2, "dp_shard": 4, "num_experts": 6},
    "efsdp 4 above two experts a rank: Shard(1)": {"ep": 2, "dp_shard": 8},
    "efsdp 2 above one expert a rank: Shard(1)": {"ep": 4, "dp_shard": 8},
    "qwen3's blocks, a vocabulary dp_shard pads": {"qk_layernorm": True, "ep": 2, "dp_shard": 4, "vocab_size": 53,
                                                   "moe_ffn_hidden_size": 24},
    "deepseek-v3's: latent attention, a dense first layer, shared experts": DEEPSEEK_V3 | {
        "ep": 2, "dp_shard": 4, "num_query_groups": None, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 12, "moe_first_dense_layers": 1},
}


@pytest.mark.parametrize("knobs", STATE_CASES.values(), ids=STATE_CASES.keys())
def test_each_ranks_states_are_those_torchtitans_own_parallelize_shards_to_the_byte(one_thread, knobs):
    """Its trainer's parallelize function (parallelize_qwen3, parallelize_deepseekv3: expert parallel, then
    apply_fsdp_to_decoder with the routed experts on efsdp), stepped once on a fake world of dp_shard ranks: this
    rank's fp32 shards, their gradients and AdamW's m and v (beside a 0-d step per parameter) are --totals' terms."""
    config = make_config(TORCHTITAN_LLAMA3, **(MOE | knobs))
    measured, count = run_fake(_sharded_states, (config,), config.dp_shard)
    terms = {x.name: x.bytes for x in per_gpu(config, NONE).worst().terms}
    assert measured["weights"] == terms["states/weights"] and measured["grads"] == terms["states/grads"]
    assert measured["adam"] == terms["states/adam_m"] + terms["states/adam_v"] + 4 * count


def _sharded_states(tp, config) -> tuple[dict[str, int], int]:
    """This rank's bytes of its shards, their gradients and its optimizer's states after one step, read off the
    library's own DTensors (FSDPMemTracker instruments one parameter group a unit, not the two a MoE block has here),
    and the parameters' count; each routed expert's on the efsdp mesh."""
    with data_parallel(tp, config, NONE) as dims:
        trainer = warmed_up_sharded(tp, config, NONE, dims, "balanced")
        params = list(trainer.model.parameters())
        routed = [p for name, p in trainer.model.named_parameters() if ".routed_experts." in name]
        assert routed and all(p.device_mesh.mesh_dim_names == ("efsdp", "ep") for p in routed)
        states = [x for state in trainer.optimizer.state.values() for x in state.values()]
        return {"weights": sum(p.to_local().nbytes for p in params),
                "grads": sum(p.grad.to_local().nbytes for p in params),
                "adam": sum((x.to_local() if isinstance(x, DTensor) else x).nbytes for x in states)}, len(params)


def test_the_layout_line_names_the_experts_own_fsdp2_ranks():
    config = build_config(SIZES | {"ep": 2, "dp_shard": 8})
    assert describe_sharding(config) == "FSDP2 over dp_shard*cp=8, the experts' over dp_shard*cp/ep=4"


STEP = MOE | {"ep": 2}
STEP_CASES = [
    ({"dp_shard": 2, "b": 1, "s": 7}, "balanced"),  # efsdp 1: the experts neither gathered nor reduce-scattered
    ({"dp_shard": 2, "b": 2, "s": 9, "moe_tokens": "worst"}, "all-to-one"),
    ({"dp_shard": 4, "b": 1, "s": 7, "moe_tokens": "worst"}, "all-to-one"),  # efsdp 2
    ({"dp_shard": 4, "b": 2, "s": 9}, "balanced"),
]


@pytest.mark.parametrize("recompute", ["none", "op", "full"])
@pytest.mark.parametrize("changes, route", STEP_CASES, ids=str)
def test_its_step_with_experts_over_the_fsdp2_ranks_peaks_where_and_at_what_the_walk_says(one_thread, changes,
                                                                                         route, recompute):
    """torchtitan's own parallelize (expert parallel, each MoE block's fully_shard two parameter groups: the rest
    over dp_shard, the routed experts over efsdp; its explicit prefetching) and the all-to-all dispatcher on funcol,
    one step under FSDPMemTracker (each group instrumented): the peak, its moment, each category at it and the state
    between steps to the byte."""
    config = make_config(TORCHTITAN_LLAMA3, **(STEP | changes), recompute=recompute)
    for r in measure_step(config, ["none"], route=route):
        assert_step_exact(r)


@pytest.mark.parametrize("changes, route", [
    ({"dp_shard": 4, "b": 1, "s": 7}, "balanced"),  # the two groups' all-gathers prefetched, reduce-scatters kept
    ({"dp_shard": 2, "b": 2, "s": 9, "recompute": "full"}, "balanced"),  # efsdp 1: cast and copied one by one
    ({"dp_shard": 4, "b": 2, "s": 9, "recompute": "op", "moe_tokens": "worst"}, "all-to-one"),
], ids=str)
def test_every_moment_of_its_step_with_experts_over_the_fsdp2_ranks_is_fsdpmemtrackers(one_thread, changes, route):
    config = make_config(TORCHTITAN_LLAMA3, **(STEP | changes))
    predicted = timeline(config, NONE, CPU)
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, "none", route))


@pytest.mark.parametrize("changes", [
    {"ep": 4, "dp_shard": 4, "num_experts": 8, "b": 1, "s": 7},  # efsdp 1, two experts a rank
    {"ep": 2, "dp_shard": 8, "b": 1, "s": 9},  # efsdp 4 above two experts a rank: Shard(1)
    {"qk_layernorm": True, "ep": 2, "dp_shard": 4, "b": 2, "s": 7, "recompute": "op"},  # its Qwen3Model
    DEEPSEEK_V3 | {"ep": 2, "dp_shard": 2, "num_query_groups": None, "kv_lora_rank": 24, "qk_nope_head_dim": 8,
                   "qk_rope_head_dim": 4, "v_head_dim": 12, "moe_first_dense_layers": 1, "b": 1, "s": 9},
], ids=str)
def test_its_qwen3_and_deepseek_v3_steps_and_other_ep_layouts_peak_where_the_walk_says(one_thread, changes):
    for r in measure_step(make_config(TORCHTITAN_LLAMA3, **(MOE | changes)), ["none"], route="balanced"):
        assert_step_exact(r)
