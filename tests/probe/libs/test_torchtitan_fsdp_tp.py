"""torchtitan's own Llama3Model on its default 2-D layout: its TP plan (tp-sp) over the mesh's inner dimension (t = 2),
FSDP2 over dp_shard = 2 and 4 (its own parallelize_llama on a (dp_shard, t) mesh of the fake group, the partial_dtensor
backend), under FSDPMemTracker, against the torchtitan step timeline on this rank's TP shards with FSDP2's gathers and
reduce-scatters of them: the peak, each category at it and the state between steps to the byte, the peak's moment,
and every moment in order."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402
from memcalc.sizing.totals import per_gpu  # noqa: E402

from ..step_readings import assert_moments_in_order, torchtitan_fsdp_readings  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3, make_config  # noqa: E402

# As the step tests' Llama3, with a vocabulary and an ffn width whose TP shards dp_shard = 4 pads.
LLAMA3 = TORCHTITAN_LLAMA3 | {"ffn_hidden_size": 102}


@pytest.mark.parametrize("changes", [
    {"dp_shard": 2},
    {"dp_shard": 2, "reshard_after_forward": False},
    {"dp_shard": 4},
    {"dp_shard": 4, "reshard_after_forward": False},
    {"dp_shard": 2, "b": 1, "s": 26},  # b = 1, odd s/t: the peak in the final norm's backward
    {"dp_shard": 4, "b": 3, "s": 26},
    {"dp_shard": 2, "recompute": "full"},  # torchtitan's FullAC: the peak in a block's rerun
    {"dp_shard": 4, "recompute": "op", "b": 1, "s": 26, "reshard_after_forward": False},  # SelectiveAC
], ids=str)
def test_the_peak_every_category_and_the_steady_state_are_fsdpmemtrackers_to_the_byte(one_thread, changes):
    (r,) = measure_step(make_config(LLAMA3, t=2, **changes), ["tp-sp"])
    assert r.measured.t == changes["dp_shard"] * 2
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


def test_between_steps_each_rank_holds_its_tp_shard_of_each_parameter_over_dp_shard_four_times_in_fp32(one_thread):
    """wqkv, w1, w3 and the vocabulary rows split over t on dim 0, wo and w2 on dim 1, the norms whole; then each
    local shard's dim 0 padded to dp_shard and split over it: fp32 weights, gradients, AdamW's m and v."""
    n, t = 2, 2
    c = make_config(LLAMA3, dp_shard=n, t=t)
    pad = lambda rows: -(-rows // n) * n  # noqa: E731
    qkv = (c.a + 2 * c.groups) * c.head_dim // t
    block = (pad(qkv) + 2 * pad(c.ffn // t)) * c.h + pad(c.h) * (c.a * c.head_dim + c.ffn) // t + 2 * pad(c.h)
    shard = (c.L * block + 2 * pad(c.vocab_size // t) * c.h + pad(c.h)) // n
    (r,) = measure_step(c, ["tp-sp"])
    assert r.measured.steady["gradients"] == 4 * shard
    assert r.measured.steady["optimizer states"] == 8 * shard + 4 * (7 * c.L + 3)


def test_a_vocabulary_t_does_not_divide_is_padded_from_rank_0s_rows_in_the_walk_and_the_totals(one_thread):
    """torchtitan's TP plan splits tok_embeddings and output into uneven DTensor shards (v 253 over t 2: rank 0 holds
    127 rows, rank 1 126), whose dim 0 fully_shard pads over dp_shard 3 in turn, to 129: the walk's state between steps
    is FSDPMemTracker's, and --totals' states too (the walk padded 126 rows, to 126: 512 B of each fp32 state too
    few; --totals split the parameters' sum evenly: 796 B of each too few)."""
    c = make_config(LLAMA3, dp_shard=3, t=2, vocab_size=253)
    (r,) = measure_step(c, ["tp-sp"])
    assert r.matches, r.rows("steady")
    states = {x.name: x.bytes for x in per_gpu(c, STRATEGIES["tp-sp"]).worst().terms}
    assert r.measured.steady["gradients"] == states["states/grads"]
    adam = states["states/adam_m"] + states["states/adam_v"]
    assert r.measured.steady["optimizer states"] == adam + 4 * (7 * c.L + 3)  # and a 0-d step per parameter


@pytest.mark.parametrize("changes", [
    {"dp_shard": 2},
    {"dp_shard": 4, "reshard_after_forward": False},
    {"dp_shard": 2, "b": 1, "s": 26},
    {"dp_shard": 2, "recompute": "full"},
    {"dp_shard": 2, "recompute": "op"},  # SelectiveAC also keeps wo's and w2's reduce-scatter outputs
], ids=str)
def test_every_moment_the_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, changes):
    """The TP plan on DTensor: a reduce-scatter along s always concatenates the chunks (b = 1 too), an all-gather at
    b = 1 is its own output, the norms' inputs come contiguous; FSDP2 all-reduces each norm's Partial gradient over t
    before its reduce-scatter; each unit gathers and reduce-scatters its TP shards."""
    config = make_config(LLAMA3, t=2, **changes)
    predicted = timeline(config, STRATEGIES["tp-sp"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, "tp-sp"))


def test_as_hsdp_on_a_3d_mesh_every_moment_and_the_peak_are_fsdpmemtrackers(one_thread):
    """dp_replicate 2 x dp_shard 2 x t 2: its TP plan over t, HSDP over the outer two dimensions."""
    config = make_config(LLAMA3, t=2, dp_shard=2, dp_replicate=2)
    predicted = timeline(config, STRATEGIES["tp-sp"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, "tp-sp"))
    (r,) = measure_step(config, ["tp-sp"])
    assert r.measured.t == 8
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
