"""megatron-core's MoELayer (TopKRouter, the all-to-all dispatcher, SequentialMLP, SharedExpertMLP) keeps, tensor
by tensor, what memcalc's megatron rules predict.

The tokens each expert receives depend on the router, so the byte-exact checks force it (`--route`): balanced
(kbs/E slots each) and all-to-one (every token to experts 0..k-1: with ep > 1 the worst bound on rank 0). Expert
parallelism runs as rank 0 of t*ep ranks in torch's fake group. With the real router the measured bytes fall within
the predicted balanced and worst bounds.
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ProbeError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import megatron as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402

# b*a/t is a multiple of 8 and 16 < s: the fused causal softmax runs. No biases: megatron's MoE has none with
# expert tensor parallelism or shared experts.
SIZES = {"b": 2, "s": 32, "h": 64, "a": 16, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
         "add_bias_linear": False, "dropout": 0.0}
SWIGLU = {"mlp": "swiglu"}
SHARED = {"moe_shared_expert_intermediate_size": 48}

CASES = {
    "gelu experts": ("none", 1, {}),
    "swiglu experts: the expert's up copy and SiLU output": ("none", 1, SWIGLU),
    "shared gelu experts with dropout": ("none", 1, SHARED | {"dropout": 0.1}),
    "shared swiglu experts: the shared up copy too": ("none", 1, SWIGLU | SHARED),
    "the aux loss: all experts' scores, the token counts, the loss": ("none", 1, {"moe_aux_loss": True}),
    "pre-softmax: every expert's probability": ("none", 1, {"moe_router_pre_softmax": True}),
    "tp-sp t=2, etp = t: the experts gather the tokens of the tensor-parallel group": ("tp-sp", 2, SWIGLU | SHARED),
    "ep=2": ("none", 1, {"ep": 2}),
    "ep=4, one expert a rank": ("none", 1, SWIGLU | {"ep": 4}),
    "ep=2 under tp-sp t=2": ("tp-sp", 2, SHARED | {"ep": 2}),
}


def _measured(tp, config, strategy, route):
    return runner.run_layer(tp, config, STRATEGIES[strategy], route=route)


def _rows(strategy, t, knobs, route):
    config = build_config(SIZES | knobs | {"t": t})
    mode = "single" if t == 1 and config.ep == 1 else "fake"
    (saved,) = run(_measured, (config, strategy, route), mode=mode, t=t)
    return compare(estimate(config, STRATEGIES[strategy], Accounting(exact=True, device="cpu")), saved)


@pytest.mark.parametrize("route, bound", [("balanced", "balanced"), ("all-to-one", "worst")])
@pytest.mark.parametrize("case", list(CASES))
def test_a_forced_router_makes_megatrons_moe_layer_keep_exactly_what_the_rules_predict(case, route, bound):
    strategy, t, knobs = CASES[case]
    rows = _rows(strategy, t, knobs | {"moe_tokens": bound}, route)
    assert [row.describe() for row in rows if not row.matches] == []
    assert all(row.measured > 0 for row in rows)  # every predicted tensor was found, none unlabelled
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


@pytest.mark.parametrize("strategy, knobs, words", [
    ("tp", {}, "without sequence parallelism"),
    ("tp-sp", {"add_bias_linear": True}, "no biases with expert tensor parallelism"),
])
def test_what_megatrons_moe_layer_refuses_is_refused_in_one_line(strategy, knobs, words):
    config = build_config(SIZES | knobs | {"t": 2})
    with pytest.raises(ProbeError, match=words):
        run(_measured, (config, strategy, None), mode="fake", t=2)
