"""With a capacity factor each router drops its own tokens past every expert's capacity (or pads up to it): the
bounds on the slots a rank's experts receive, and on those its own tokens keep."""

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES

SIZES = dict(b=2, s=32, h=64, a=16, t=2, num_experts=4, moe_router_topk=2, add_bias_linear=False)


def _shape(knobs: dict, strategy: str, name: str) -> tuple[int, ...]:
    prediction = estimate(build_config(SIZES | knobs), STRATEGIES[strategy], Accounting(exact=True))
    return next(x.shape for x in prediction.tensors if x.tensor.name == name)


def test_under_sp_each_rank_drops_its_own_tokens_to_its_own_capacity_rounded_up():
    knobs = {"moe_expert_capacity_factor": 0.33, "moe_tokens": "capacity"}
    # none: ceil(2*64/4 * 0.33) = 11 slots an expert; tp-sp: ceil(2*32/4 * 0.33) = 6 from each of the t=2 ranks
    assert _shape(knobs, "none", "moe/expert_in") == (4 * 11, 64)
    assert _shape(knobs, "tp-sp", "moe/expert_in") == (4 * 6 * 2, 64)
    assert _shape(knobs, "tp-sp", "moe/permute_indices") == (4 * 6,)  # what this rank's own tokens keep


@pytest.mark.parametrize("bound", ["balanced", "capacity", "worst"])
def test_padded_to_capacity_every_bound_is_every_expert_full(bound):
    knobs = {"moe_expert_capacity_factor": 1.25, "moe_pad_expert_input_to_capacity": True, "moe_tokens": bound}
    assert _shape(knobs, "none", "moe/expert_in") == (4 * 40, 64)  # ceil(2*64/4 * 1.25) = 40, past kbs = 128


def test_without_padding_no_bound_passes_the_slots_there_are():
    dropped = {"moe_expert_capacity_factor": 0.5, "moe_tokens": "balanced"}
    assert _shape(dropped, "none", "moe/expert_in") == (4 * 16, 64)  # a balanced load, cut to capacity
    roomy = {"moe_expert_capacity_factor": 4.0, "moe_tokens": "capacity"}
    assert _shape(roomy, "none", "moe/expert_in") == (2 * 64, 64)  # capacity past the tokens: each token's k slots
    assert _shape(roomy, "none", "moe/permute_indices") == (2 * 64,)


@pytest.mark.parametrize("knobs, words", [
    ({"moe_pad_expert_input_to_capacity": True}, "needs moe_expert_capacity_factor"),
    ({"moe_router_enable_expert_bias": True}, "needs moe_router_score_function sigmoid"),
])
def test_padding_without_a_capacity_and_an_expert_bias_without_sigmoid_are_refused(knobs, words):
    with pytest.raises(ConfigError, match=words):
        estimate(build_config(SIZES | knobs), STRATEGIES["none"])


@pytest.mark.parametrize("pad", [False, True])
def test_the_all_gather_map_of_one_token_is_a_view_of_the_routers_capacity_mask(pad):
    # found by a random-shape hunt: with nothing gathered (t*ep = 1), local_map.T.contiguous() of one token's (1, E)
    # map is a view of the mask the router's probs * map keeps; the ledger counted those E bytes twice
    knobs = {"moe_token_dispatcher_type": "allgather", "moe_expert_capacity_factor": 1.0, "t": 1,
             "moe_pad_expert_input_to_capacity": pad}

    def names(**sizes: int) -> set[str]:
        prediction = estimate(build_config(SIZES | knobs | sizes), STRATEGIES["none"], Accounting(exact=True))
        return {x.tensor.name for x in prediction.tensors}

    assert "moe/allgather_map" not in names(b=1, s=1)
    assert {"moe/allgather_map", "moe/capacity_mask"} <= names(b=1, s=2)  # a copy from two tokens on
    assert "moe/allgather_map" in names(b=1, s=1, ep=2)  # gathered over ep: a new map
