"""megatron-core's MoELayer (TopKRouter, the all-to-all and all-gather token dispatchers, SequentialMLP,
SharedExpertMLP) keeps, tensor by tensor, what memcalc's megatron rules predict; and a dense + MoE mix's dense layer,
as megatron's decoder block spec builds it, keeps the dense MLP's.

The tokens each expert receives depend on the router, so the byte-exact checks force it (`--route`): balanced
(kbs/E slots each) and all-to-one (every token to experts 0..k-1: with ep > 1 the worst bound on rank 0). With a
capacity factor below 1 the balanced route fills every expert to its capacity, the capacity bound; padded to
capacity every route does. Expert parallelism runs as rank 0 of t*ep ranks in torch's fake group. With the real
router the measured bytes fall within the predicted balanced and worst bounds.
"""

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError, ProbeError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import megatron as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from . import assert_exact  # noqa: E402

# b*a/t is a multiple of 8 and 16 < s: the fused causal softmax runs. No biases: megatron's MoE has none with
# expert tensor parallelism or shared experts.
SIZES = {"b": 2, "s": 32, "h": 64, "a": 16, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
         "add_bias_linear": False, "dropout": 0.0}
SWIGLU = {"mlp": "swiglu"}
SHARED = {"moe_shared_expert_intermediate_size": 48}
TOP1 = {"moe_router_topk": 1, "moe_router_pre_softmax": True}  # megatron's top-1 takes the softmax over all E

CASES = {
    "gelu experts": ("none", 1, {}),
    "swiglu experts: the expert's up copy and SiLU output": ("none", 1, SWIGLU),
    "shared gelu experts with dropout": ("none", 1, SHARED | {"dropout": 0.1}),
    "shared swiglu experts: the shared up copy too": ("none", 1, SWIGLU | SHARED),
    "fused swiglu experts: WeightedSwiGLUFunction keeps fc1's output and the probabilities, no product":
        ("none", 1, SWIGLU | SHARED | {"bias_activation_fusion": True}),
    "fused swiglu experts, tp-sp t=2 in fp32": ("tp-sp", 2, SWIGLU | SHARED | {"bias_activation_fusion": True,
                                                                              "dtype": "fp32"}),
    "the aux loss: all experts' scores, the token counts, the loss": ("none", 1, {"moe_aux_loss": True}),
    "pre-softmax: every expert's probability": ("none", 1, {"moe_router_pre_softmax": True}),
    "tp-sp t=2, etp = t: the experts gather the tokens of the tensor-parallel group": ("tp-sp", 2, SWIGLU | SHARED),
    "ep=2": ("none", 1, {"ep": 2}),
    "ep=4, one expert a rank": ("none", 1, SWIGLU | {"ep": 4}),
    "ep=2 under tp-sp t=2": ("tp-sp", 2, SHARED | {"ep": 2}),
    # found by a drawn run: where ep does not divide a router's k*b*s slots the forced route deals rank 0 one more from
    # each (here 2 of 3, so it receives 4); the rules said k*b*s = 3 (expert_in 16 B short at h = 8)
    "ep=2, three slots a router: rank 0 receives two of each rank's": ("none", 1, TOP1 | {"ep": 2, "b": 1, "s": 3}),
    "ep=2 under tp-sp t=2, three slots a router": ("tp-sp", 2, TOP1 | {"ep": 2, "b": 1, "s": 6}),
    "the sigmoid router: fp32 scores, the top k renormalised": ("none", 1, {"moe_router_score_function": "sigmoid"}),
    "sigmoid with the expert bias and its aux loss, ep=2 under tp-sp t=2: the gather's scores, bf16 aux scores":
        ("tp-sp", 2, SWIGLU | {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                               "moe_aux_loss": True, "ep": 2}),
    "sigmoid with the expert bias in fp32: the gather keeps the sigmoid's output itself (its cast is a no-op)":
        ("none", 1, {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "dtype": "fp32",
                     "moe_router_topk": 3, "num_experts": 6, "b": 1, "s": 7}),
    "sigmoid top-1 with the aux loss: no renormalisation": ("none", 1, {"moe_router_score_function": "sigmoid",
                                                                         "moe_router_topk": 1, "moe_aux_loss": True}),
    "padded to capacity 0.5: every expert exactly at capacity, probabilities gathered by index":
        ("none", 1, {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True}),
    "padded to capacity 0.33, ep=2 under tp-sp t=2: each router's own capacity, rounded up":
        ("tp-sp", 2, SWIGLU | {"moe_expert_capacity_factor": 0.33, "moe_pad_expert_input_to_capacity": True, "ep": 2}),
    "padded to capacity 1.25 with the aux loss, ep=4": ("none", 1, {"moe_expert_capacity_factor": 1.25, "ep": 4,
                                                                    "moe_pad_expert_input_to_capacity": True,
                                                                    "moe_aux_loss": True}),
    "the all-gather dispatcher": ("none", 1, {"moe_token_dispatcher_type": "allgather"}),
    "all-gather, ep=2 under tp-sp t=2: the gathered tokens' map whole on every rank, r permutation indices":
        ("tp-sp", 2, SWIGLU | SHARED | {"moe_token_dispatcher_type": "allgather", "ep": 2}),
    # found by a drawn run: get_capacity's ceil(k*b*s/E * c) = 5 is more than the 4 tokens, so
    # topk_routing_with_capacity masks none and pads every expert to the 4 tokens alone; the rules padded to 5
    # (expert_in 64 B over at h = 8)
    "all-gather padded to a capacity past the tokens (1.5, top-3 of 4)":
        ("none", 1, {"moe_token_dispatcher_type": "allgather", "moe_router_topk": 3, "moe_expert_capacity_factor": 1.5,
                     "moe_pad_expert_input_to_capacity": True, "b": 1, "s": 4}),
    "all-gather padded to capacity 0.5, ep=4": ("none", 1, {"moe_token_dispatcher_type": "allgather", "ep": 4,
                                                          "moe_expert_capacity_factor": 0.5,
                                                          "moe_pad_expert_input_to_capacity": True}),
    # found by a random-shape hunt: with nothing gathered (t*ep = 1) the dispatcher's map of one token, or of one
    # expert, is a view of the router's capacity mask; the probe stopped on the storage labelled twice, the rules
    # counted it twice (E bytes over)
    "all-gather padded to capacity, one token: the dispatcher's map a view of the router's mask":
        ("none", 1, {"moe_token_dispatcher_type": "allgather", "moe_expert_capacity_factor": 1.0,
                     "moe_pad_expert_input_to_capacity": True, "b": 1, "s": 1}),
    "all-gather with a capacity, one expert, three tokens: its map a view of the router's mask too":
        ("none", 1, TOP1 | {"moe_token_dispatcher_type": "allgather", "moe_expert_capacity_factor": 1.0,
                            "num_experts": 1, "b": 1, "s": 3}),
}


def _measured(tp, config, strategy, route, dense=False):
    return runner.run_layer(tp, config, STRATEGIES[strategy], route=route, dense=dense)


def _rows(strategy, t, knobs, route, dense=False):
    config = build_config(SIZES | knobs | {"t": t})
    mode = "single" if t == 1 and config.ep == 1 else "fake"
    (saved,) = run(_measured, (config, strategy, route, dense), mode=mode, t=t)
    prediction = estimate(config, STRATEGIES[strategy], Accounting(exact=True, device="cpu"))
    return compare(replace(prediction, tensors=prediction.dense) if dense else prediction, saved)


@pytest.mark.parametrize("route, bound", [("balanced", "balanced"), ("all-to-one", "worst")])
@pytest.mark.parametrize("case", list(CASES))
def test_a_forced_router_makes_megatrons_moe_layer_keep_exactly_what_the_rules_predict(case, route, bound):
    strategy, t, knobs = CASES[case]
    rows = _rows(strategy, t, knobs | {"moe_tokens": bound}, route)
    assert_exact(rows)
    assert any(row.name == "moe/expert_in" for row in rows)


@pytest.mark.parametrize("ep", [1, 2])
def test_with_the_real_router_each_tensor_lies_within_the_balanced_and_worst_bounds(ep):
    knobs = SWIGLU | SHARED | {"ep": ep}
    measured = {row.name: row.measured for row in _rows("none", 1, knobs, None)}
    lower = {row.name: row.predicted for row in _rows("none", 1, knobs | {"moe_tokens": "balanced"}, "balanced")}
    upper = {row.name: row.predicted for row in _rows("none", 1, knobs | {"moe_tokens": "worst"}, "balanced")}
    assert measured.keys() == lower.keys() == upper.keys()
    # At ep = 1 every slot lands on this rank's experts (r = kbs under either bound); with ep > 1 the real router
    # may send rank 0's experts fewer than the balanced share, so only the worst bound holds.
    assert all((lower[name] if ep == 1 else 0) <= measured[name] <= upper[name] for name in measured)


def test_megatrons_moe_layer_with_biases_is_refused_in_one_line():
    """megatron's own error would be a view autograd refuses (fc2's bias added in place). Its refusal of tp without
    sequence parallelism is the implementation's (`plan`, before any rank runs; tests/cli/test_refused_layouts_cli)."""
    config = build_config(SIZES | {"add_bias_linear": True, "t": 1})
    with pytest.raises(ProbeError, match="adds fc2's bias in place"):
        run(_measured, (config, "none", None), mode="single", t=1)


# -- a dense + MoE mix: each layer as megatron's decoder block spec builds it ------------------------------------

MIXES = {
    "gelu experts every 2nd layer": ("none", 1, {"moe_layer_freq": 2, "L": 4}),
    "swiglu and shared experts every 2nd layer": ("none", 1, SWIGLU | SHARED | {"moe_layer_freq": 2, "L": 4}),
    "gelu and shared experts past a first dense layer, ep=2": ("none", 1, SHARED | {"moe_first_dense_layers": 1,
                                                                                     "L": 3, "ep": 2}),
    "swiglu past a first dense layer (DeepSeek), ep=2 under tp-sp t=2":
        ("tp-sp", 2, SWIGLU | {"moe_first_dense_layers": 1, "L": 3, "ep": 2}),
    "three dense layers, then every 2nd": ("none", 1, SWIGLU | {"moe_first_dense_layers": 3, "moe_layer_freq": 2,
                                                                 "L": 8}),
}


@pytest.mark.parametrize("dense", [True, False], ids=["the dense layer", "the moe layer"])
@pytest.mark.parametrize("case", list(MIXES))
def test_each_layer_of_a_dense_and_moe_mix_keeps_what_the_rules_predict_for_its_kind(case, dense):
    strategy, t, knobs = MIXES[case]
    rows = _rows(strategy, t, knobs, "balanced", dense=dense)
    assert_exact(rows)
    names = {row.name for row in rows}
    assert ("moe/expert_in" in names) != dense and ("mlp/fc2_in" in names) == dense


@pytest.mark.parametrize("knobs", [
    {"moe_layer_freq": 2, "L": 5}, {"moe_layer_freq": 3, "L": 7}, {"moe_first_dense_layers": 3, "L": 6},
    {"moe_first_dense_layers": 3, "moe_layer_freq": 2, "L": 9}, {"L": 3},
])
@pytest.mark.filterwarnings("ignore::UserWarning")  # megatron warns that Apex is missing
def test_megatrons_block_spec_places_as_many_moe_layers_as_memcalc_counts_and_the_probe_builds_the_first(knobs):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from memcalc.probe.libs.megatron_shim import layer_spec

    config = build_config(SIZES | knobs)
    megatron_config = runner.transformer_config(config, 1, False)
    kinds = [layer_spec(megatron_config, i).submodules.mlp.module is MoELayer for i in range(config.L)]
    assert sum(kinds) == config.moe_layers
    assert kinds.index(True) == runner.layer_index(config)
    assert False not in kinds or kinds.index(False) == runner.layer_index(config, dense=True)


def test_a_dense_layer_is_refused_where_every_layer_is_moe():
    config = build_config(SIZES | {"L": 2})
    with pytest.raises(ProbeError, match="no dense layer to measure"):
        run(_measured, (config, "none", None, True), mode="single", t=1)


# -- the capacity factor: tokens dropped to each expert's capacity ------------------------------------------------


@pytest.mark.parametrize("strategy, t, knobs", [
    ("none", 1, {"moe_expert_capacity_factor": 0.5}),
    ("none", 1, SWIGLU | {"moe_expert_capacity_factor": 0.75, "moe_aux_loss": True, "ep": 2}),
    ("tp-sp", 2, SHARED | {"moe_expert_capacity_factor": 0.33, "ep": 2}),
], ids=["c=0.5", "c=0.75, aux loss, ep=2", "c=0.33, ep=2 under tp-sp t=2: each router's own capacity"])
def test_a_balanced_route_over_capacity_fills_every_expert_to_the_capacity_bound(strategy, t, knobs):
    rows = _rows(strategy, t, knobs | {"moe_tokens": "capacity"}, "balanced")
    assert [row.describe() for row in rows if not row.matches] == []
    assert "moe/capacity_mask" in {row.name for row in rows}


def test_all_to_one_drops_the_tokens_past_capacity_and_stays_within_the_capacity_bound():
    knobs = {"moe_expert_capacity_factor": 0.5, "moe_tokens": "capacity"}
    rows = {row.name: row for row in _rows("none", 1, knobs, "all-to-one")}
    assert all(row.measured <= row.predicted for row in rows.values())
    capacity = 16  # ceil(k*b*s/E * c) = ceil(2*64/4 * 0.5): experts 0 and 1 keep 16 of their 64 tokens each
    assert rows["moe/expert_in"].measured_shape == (2 * capacity, SIZES["h"])
    assert rows["moe/expert_in"].predicted_shape == (4 * capacity, SIZES["h"])  # every expert at capacity


@pytest.mark.parametrize("knobs, words", [
    ({"moe_ffn_hidden_size": 20}, "moe_ffn_hidden_size=20 is not divisible by t=3"),
    ({"moe_shared_expert_intermediate_size": 8}, "moe_shared_expert_intermediate_size=8 is not divisible by t=3"),
])
def test_expert_widths_t_does_not_divide_are_refused_in_one_line(knobs, words):
    """Found by the random audit: megatron-core's ColumnParallelLinear asserted (exit 70) at t = 3."""
    with pytest.raises(ConfigError, match=words):
        build_config(SIZES | {"h": 48, "a": 6, "t": 3, "moe_ffn_hidden_size": 24, "ffn_hidden_size": 96} | knobs)
