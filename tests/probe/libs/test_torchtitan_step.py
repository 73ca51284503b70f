"""One whole training step of torchtitan's own Llama3Model (`--impl torchtitan`) under torch's MemTracker, against
the step timeline built from its ops (memcalc.sizing.timeline.torchtitan on the generic walk): the peak, each
category at it and the state between steps to the byte; MemTracker reaches its peak at the moment the timeline names,
for sizes that put the peak in four different places at t = 1 and three under its own TP plan, with and without its
sequence-parallel norms (rank 0 of t through the fake group); and every moment the timeline names is MemTracker's
reading after some op, in order, in its module."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.torchtitan_step import runtime, warmed_up  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import ACTIVATIONS, timeline  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config  # noqa: E402

from ..step_readings import (  # noqa: E402
    assert_moments_in_order, assert_step_exact_moment_by_moment, readings_after_every_op, readings_of_the_measured_step,
)

CPU = Accounting(exact=True, device="cpu")

# Sizes that move the peak: each entry's peak is somewhere no other entry's is.
MOMENTS = [
    {},  # the loss's backward: three fp32 (b*s, v) tensors
    {"vocab_size": 16, "s": 64, "a": 16, "num_query_groups": 16},  # the final RMSNorm's five fp32 temporaries
    {"vocab_size": 16, "ffn_hidden_size": 512},  # the last block's w2 GEMMs
    {"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100},  # lm_head's GEMMs
]


def test_the_chosen_sizes_put_the_peak_in_four_different_places():
    """What gives the next test its meaning: no two cases share a predicted moment."""
    moments = {timeline(make_config(LLAMA3, **c), STRATEGIES["none"], CPU).peak.label() for c in MOMENTS}
    assert len(moments) == len(MOMENTS), moments


@pytest.mark.parametrize("changes", MOMENTS, ids=str)
def test_wherever_the_peak_is_memtracker_reaches_it_there_to_the_byte(one_thread, changes):
    (r,) = measure_step(make_config(LLAMA3, **changes), ["none"])
    assert r.model == "torchtitan's Llama3Model"
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.measured.steady.get(ACTIVATIONS, 0) == 0  # the batch is loaded inside the step


@pytest.mark.parametrize("changes", [
    {},
    {"L": 1, "b": 3, "s": 16, "num_query_groups": 1, "vocab_size": 1000},  # one K/V group
    {"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100},  # no GQA, an odd sequence
], ids=str)
def test_every_moment_the_timeline_names_happens_in_order_in_its_module_with_its_bytes(one_thread, changes):
    """Not only the peak: each moment is MemTracker's reading after some op, in the named module, in order."""
    config = make_config(LLAMA3, **changes)
    readings = readings_after_every_op(warmed_up(single(), config, STRATEGIES["none"]))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:-1], readings)


# -- under torchtitan's own TP plan (tp-sp: its default; tp: enable_sp off), rank 0 of t through the fake group ------

TP_MOMENTS = [
    ({"t": 2}, "tp-sp"),  # the vocabulary-parallel loss's backward: the one-hot update beside exp(log_probs)
    ({"t": 2, "b": 1, "s": 8, "num_query_groups": 8, "vocab_size": 64, "ffn_hidden_size": 512}, "tp"),  # w2's GEMMs
    ({"t": 4, "num_query_groups": 4, "vocab_size": 32, "s": 64}, "tp-sp"),  # forward: the final norm's all-gather
    ({"t": 4, "num_query_groups": 4, "vocab_size": 32, "s": 64}, "tp"),  # the final norm's fp32 backward
]


def test_under_tp_the_chosen_sizes_put_the_peak_in_four_different_places():
    moments = {timeline(make_config(LLAMA3, **c), STRATEGIES[st], CPU).peak.label() for c, st in TP_MOMENTS}
    assert len(moments) == len(TP_MOMENTS), moments


@pytest.mark.parametrize("changes, strategy", TP_MOMENTS, ids=str)
def test_under_tp_wherever_the_peak_is_memtracker_reaches_it_there_to_the_byte(one_thread, changes, strategy):
    (r,) = measure_step(make_config(LLAMA3, **changes), [strategy])
    assert r.measured.t == changes["t"] and r.how().startswith(f"one process as rank 0 of t={changes['t']}")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("strategy", ["tp-sp", "tp"])
@pytest.mark.parametrize("changes", [TP_MOMENTS[0][0], TP_MOMENTS[1][0], {"t": 4, "num_query_groups": 4, "L": 1}],
                         ids=str)
def test_under_tp_every_moment_the_timeline_names_happens_in_order(one_thread, changes, strategy):
    """Each collective's buffer (under SP the all-gathers at the modules' entries and the reduce-scatters after wo and
    w2, at b > 1 and at b = 1 where the s-first copies are views; without SP f's and f*'s all-reduced copies), the
    vocabulary-parallel embedding and loss."""
    config = make_config(LLAMA3, **changes)

    def readings(tp):
        with runtime(tp) as dims:
            return readings_after_every_op(warmed_up(tp, config, STRATEGIES[strategy], dims))

    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CPU).moments[1:-1], run_fake(readings, (), config.t))


# -- under torchtitan's activation checkpointing: its FullAC and SelectiveAC config objects applied to the model ------

AC_CASES = [
    ({}, "none"),  # full: w2's GEMMs after the rerun; op: the loss's backward
    ({"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100}, "none"),  # b = 1, odd s, no GQA: lm_head's GEMMs
    ({"t": 2}, "tp"),
    ({"t": 2, "b": 1, "s": 7, "L": 1}, "tp"),
    ({"t": 2, "b": 1, "s": 10, "L": 1}, "tp-sp"),
    ({"t": 2}, "tp-sp"),  # b > 1: the norms' inputs are (s/t, b, h) views, made contiguous in fp32
    ({"t": 4, "num_query_groups": 4, "s": 12, "L": 1}, "tp-sp"),  # under full: in the rerun, w2's reduce-scatter
    ({"vocab_size": 16, "s": 64, "a": 16, "num_query_groups": 16}, "none"),  # after the rerun: the product's backward
    ({"vocab_size": 16, "s": 64, "a": 16, "num_query_groups": 16, "ffn_hidden_size": 16}, "none"),  # ffn_norm's pow
]


@pytest.mark.parametrize("recompute", ["full", "op"])
@pytest.mark.parametrize("changes, strategy", AC_CASES, ids=str)
def test_under_its_activation_checkpointing_memtracker_reaches_the_peak_to_the_byte(one_thread, recompute, changes,
                                                                                      strategy):
    """FullAC keeps each block's input alone, SelectiveAC also the outputs its policy caches; each block's forward
    reruns at the start of its backward."""
    (r,) = measure_step(make_config(LLAMA3, recompute=recompute, **changes), [strategy])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("recompute", ["full", "op"])
@pytest.mark.parametrize("changes, strategy", [AC_CASES[0], AC_CASES[2], AC_CASES[4], AC_CASES[5]], ids=str)
def test_under_its_activation_checkpointing_every_moment_happens_in_order(one_thread, recompute, changes, strategy):
    """What goes in forward when nothing keeps it, the rerun (read in backward, at w2 for the modules around it), what
    the rerun's locals free in backward and the block's input going with the last tensor the rerun kept."""
    config = make_config(LLAMA3, recompute=recompute, **changes)

    def readings(tp):
        with runtime(tp) as dims:
            return readings_after_every_op(warmed_up(tp, config, STRATEGIES[strategy], dims))

    found = run_fake(readings, (), config.t) if config.t > 1 else readings(single())
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CPU).moments[1:-1], found)


@pytest.mark.parametrize("changes, named", [
    ({"pp": 2, "num_microbatches": 1}, "num_microbatches=1 below pp=2"),
    ({"pp": 2, "dp_shard": 2, "dp_replicate": 2}, "pp with dp_shard beside tp, ep > 1 or dp_replicate"),
    ({"cp": 2}, "cp=2"),
    ({"zero_stage": 2}, "zero_stage"),
    ({"tie_embeddings": True, "dp_shard": 2}, "tie_embeddings with dp_shard"),
    ({"position_embedding_type": "learned_absolute"}, "position_embedding_type learned_absolute"),
])
def test_what_the_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(LLAMA3, **changes), STRATEGIES["none"], CPU)


# -- tied (enable_weight_tying, as its 1B and 3B flavours): lm_head's weight gradient waits for the table's ------------

TIED = [
    ({"b": 1, "s": 9, "h": 64, "a": 4, "num_query_groups": 4, "ffn_hidden_size": 64, "vocab_size": 40}, "none",
     "none"),  # wqkv's GEMMs, lm_head's gradient waiting
    ({"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": 24}, "none",
     "full"),  # w2's GEMMs after the rerun
    ({"b": 1, "s": 3, "h": 32, "a": 1, "num_query_groups": 1, "ffn_hidden_size": 2, "vocab_size": 96, "L": 1,
      "dtype": "fp32"}, "none", "op"),  # the two gradients summed
    ({"t": 2, "b": 1, "s": 4, "h": 32, "a": 2, "num_query_groups": 2, "ffn_hidden_size": 2, "vocab_size": 192,
      "L": 1, "dtype": "fp32"}, "tp", "none"),  # this rank's rows of both summed
    ({"t": 2, "b": 3, "s": 6, "h": 24, "a": 6, "num_query_groups": 2, "ffn_hidden_size": 4, "vocab_size": 96},
     "tp-sp", "op"),
]


@pytest.mark.parametrize("changes, strategy, recompute", TIED, ids=str)
def test_tied_lm_heads_weight_gradient_waits_for_the_tables_and_the_step_is_memtrackers(one_thread, changes,
                                                                                       strategy, recompute):
    config = make_config(LLAMA3, tie_embeddings=True, recompute=recompute, **changes)
    untied = timeline(make_config(LLAMA3, recompute=recompute, **changes), STRATEGIES[strategy], CPU)
    assert timeline(config, STRATEGIES[strategy], CPU).steady.bytes < untied.steady.bytes  # one table, not two
    (r,) = measure_step(config, [strategy])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


# -- with experts: its Qwen3 MoE decoder layers in the Llama3Model, the router forced ------------------------------

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_tokens": "balanced"}


@pytest.mark.parametrize("route, expected", [("balanced", [24, 24, 24, 24]), ("all-to-one", [48, 48, 0, 0])])
def test_with_experts_the_step_trains_its_moe_layers_on_the_forced_route(one_thread, route, expected):
    """Every layer is torchtitan's MoE (GroupedExperts behind its TokenChoiceTopKRouter), and the router takes the
    route forced: each expert's count of the step's k*b*s = 96 slots, as its MoE tallies them."""
    trainer = warmed_up(single(), make_config(LLAMA3, **MOE), STRATEGIES["none"], route=route)
    trainer.step()
    for layer in trainer.model.layers.values():
        assert layer.moe.tokens_per_expert_E.tolist() == [2 * x for x in expected]  # the warm-up's and the step's


@pytest.mark.parametrize("route, expected", [("balanced", [24, 24, 24, 24]), ("all-to-one", [48, 48, 0, 0])])
def test_over_the_fake_group_its_expert_parallel_step_keeps_the_forced_route(one_thread, route, expected):
    """At ep = t = 2 the all-to-all dispatcher's received rows are zeros on the fake group, never uninitialised
    memory whose NaNs the warm-up's update would write into the weights (and so into the measured step's route):
    rank 0 routes its own 48 slots as forced, in the warm-up and in the step alike."""
    config = make_config(LLAMA3, **(MOE | TP_MOE), ep=2)

    def counts(tp):
        with runtime(tp, config.ep) as dims:
            trainer = warmed_up(tp, config, STRATEGIES["tp-sp"], dims, route)
            trainer.step()
            return [layer.moe.tokens_per_expert_E.tolist() for layer in trainer.model.layers.values()]

    assert run_fake(counts, (), 2) == [expected] * config.L


def test_with_experts_the_step_needs_a_forced_route():
    from memcalc.errors import ProbeError

    with pytest.raises(ProbeError, match="forces the router"):
        warmed_up(single(), make_config(LLAMA3, **MOE), STRATEGIES["none"])


# Sizes that move the peak with experts (t = 1, b = 1 and b > 1, odd s, E and k, both score functions, with and
# without route_norm, with and without shared experts): the peak in w2's grouped GEMMs' backward, lm_head's GEMMs, the
# loss's backward, combine's fp32 backward, the shared experts' w2, the final norm's backward.
MOE_MOMENTS = [
    ({"vocab_size": 16, "moe_ffn_hidden_size": 200, "moe_router_pre_softmax": True}, "balanced"),
    ({"b": 1, "s": 7}, "balanced"),
    ({"b": 3, "s": 5, "num_experts": 8, "moe_router_topk": 1}, "all-to-one"),
    ({"moe_router_score_function": "sigmoid", "vocab_size": 16, "s": 9, "ffn_hidden_size": 16, "num_experts": 6,
      "moe_router_topk": 3, "moe_ffn_hidden_size": 8}, "all-to-one"),
    ({"moe_shared_expert_intermediate_size": 400, "vocab_size": 16, "b": 1, "s": 7}, "balanced"),  # shared w2's
    ({"moe_shared_expert_intermediate_size": 48, "moe_router_score_function": "sigmoid", "vocab_size": 16, "s": 9},
     "all-to-one"),  # DeepSeek-V3's router beside shared experts: the final norm's backward
]


def test_with_experts_the_chosen_sizes_put_the_peak_in_six_different_places():
    moments = {timeline(make_config(LLAMA3, **(MOE | c)), STRATEGIES["none"], CPU).peak.label() for c, _ in MOE_MOMENTS}
    assert len(moments) == len(MOE_MOMENTS), moments


def _assert_moe_peak_exact(config, route):
    """The MoE model's step on `route`: MemTracker's peak at the predicted moment, every category to the byte."""
    from memcalc.probe.libs.torchtitan_step import measure_torchtitan_step_on_rank
    from memcalc.probe.step import StepComparison
    from memcalc.probe.launch import Mode

    predicted = timeline(config, STRATEGIES["none"], CPU)
    measured = measure_torchtitan_step_on_rank(single(), config, STRATEGIES["none"], route)
    r = StepComparison(STRATEGIES["none"], Mode.SINGLE, predicted, measured)
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def _assert_moe_moments_in_order(config, route):
    """Each moment of the MoE model's step on `route` MemTracker's reading after some op, in its module, in order."""
    with runtime(single()) as dims:
        readings = readings_after_every_op(warmed_up(single(), config, STRATEGIES["none"], dims, route))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:-1], readings)


@pytest.mark.parametrize("changes, route", MOE_MOMENTS, ids=str)
def test_with_experts_memtracker_reaches_the_peak_to_the_byte(one_thread, changes, route):
    """At ep = 1 one rank runs every expert on all k*b*s slots: balanced or all-to-one, the same bytes."""
    _assert_moe_peak_exact(make_config(LLAMA3, **(MOE | changes)), route)


@pytest.mark.parametrize("changes, route", [MOE_MOMENTS[1], MOE_MOMENTS[2], MOE_MOMENTS[3], MOE_MOMENTS[5]], ids=str)
def test_with_experts_every_moment_the_timeline_names_happens_in_order(one_thread, changes, route):
    """The router (its fp32 gate, the forced lead, top-k, route_norm), the reorder, the grouped SwiGLU, the combine,
    the shared experts, and their backward: each moment MemTracker's reading after some op, in its module."""
    _assert_moe_moments_in_order(make_config(LLAMA3, **(MOE | changes)), route)


@pytest.mark.parametrize("recompute", ["full", "op"])
@pytest.mark.parametrize("changes, route", MOE_MOMENTS, ids=str)
def test_with_experts_under_its_activation_checkpointing_memtracker_reaches_the_peak_to_the_byte(
        one_thread, recompute, changes, route):
    """Each MoE block's input kept (FullAC), and under SelectiveAC the outputs its policy caches (wqkv's, the
    attention kernel's, the router's top-k, the shared experts' w1 and w2); its forward rerun in backward, the router
    forced alike both times."""
    _assert_moe_peak_exact(make_config(LLAMA3, **(MOE | changes), recompute=recompute), route)


@pytest.mark.parametrize("recompute", ["full", "op"])
@pytest.mark.parametrize("changes, route", [MOE_MOMENTS[1], MOE_MOMENTS[2], MOE_MOMENTS[4], MOE_MOMENTS[5]], ids=str)
def test_with_experts_under_its_activation_checkpointing_every_moment_happens_in_order(one_thread, recompute,
                                                                                       changes, route):
    """What the MoE's ops keep goes in forward as its Python locals do (the gate's fp32 casts at its return, the
    router's scores and ids at the MoE's); the rerun at the start of the combine's (or the shared experts')
    backward."""
    _assert_moe_moments_in_order(make_config(LLAMA3, **(MOE | changes), recompute=recompute), route)


# Dense blocks beside MoE ones (Llama3's FeedForward where is_moe_layer says no): every other layer, or the first dense
MIXES = [
    ({"moe_layer_freq": 2, "b": 1, "s": 7}, "balanced", "none"),
    ({"moe_first_dense_layers": 1, "b": 3, "s": 5}, "all-to-one", "op"),
    ({"moe_layer_freq": 2, "L": 3, "moe_shared_expert_intermediate_size": 48}, "balanced", "full"),
]


@pytest.mark.parametrize("changes, route, recompute", MIXES, ids=str)
def test_with_dense_and_moe_layers_memtracker_reaches_the_peak_to_the_byte(one_thread, changes, route, recompute):
    _assert_moe_peak_exact(make_config(LLAMA3, **(MOE | changes), recompute=recompute), route)


@pytest.mark.parametrize("changes, route, recompute", MIXES, ids=str)
def test_with_dense_and_moe_layers_every_moment_happens_in_order(one_thread, changes, route, recompute):
    """Each block walks its own ops (Llama3's FeedForward or the MoE) and keeps its own ledger's tensors."""
    _assert_moe_moments_in_order(make_config(LLAMA3, **(MOE | changes), recompute=recompute), route)


def test_with_experts_measure_step_runs_the_moe_model_on_the_balanced_route(one_thread):
    (r,) = measure_step(make_config(LLAMA3, **MOE, b=1, s=7), ["none"], route="balanced")
    assert r.model == "torchtitan's Llama3Model with its Qwen3 MoE layers, router forced balanced"
    assert r.measured.moment == r.predicted_moment and r.matches


# -- with experts under its own TP plan (set_moe_sharding_config) at ep = 1, rank 0 of t = 2 through the fake group:
# under SP the MoE's input all-gathered at its entry, the routed output (and the shared experts') reduce-scattered; under
# tp the summed partial output all-reduced as the MoE returns; every expert e/t wide
TP_MOE = {"t": 2, "moe_ffn_hidden_size": 32}
TP_MOE_MOMENTS = [
    ({"L": 1}, "tp-sp", "balanced", "none"),
    ({"b": 1, "s": 6, "num_experts": 6, "moe_router_topk": 3, "moe_ffn_hidden_size": 16}, "tp-sp", "all-to-one",
     "none"),  # b = 1, s/t odd
    ({"b": 1, "s": 7, "num_experts": 6, "moe_router_topk": 3, "moe_ffn_hidden_size": 16, "vocab_size": 16}, "tp",
     "all-to-one", "none"),  # an odd s
    ({"moe_shared_expert_intermediate_size": 48, "moe_router_score_function": "sigmoid", "vocab_size": 16}, "tp-sp",
     "balanced", "none"),
    ({"L": 1, "moe_shared_expert_intermediate_size": 48, "moe_ffn_hidden_size": 256}, "tp", "balanced", "full"),
    ({"moe_shared_expert_intermediate_size": 48}, "tp-sp", "all-to-one", "op"),
    ({"L": 1, "moe_router_pre_softmax": True}, "tp", "balanced", "op"),
    # found by a drawn run: a dense block beside MoE ones keeps w1's input gathered under SP, as in a dense model; the
    # rules laid it out under the MoE blocks' TP plan, w1's input a shard (b*s/t*h*2 = 512 B short at b = 1, s = 8)
    ({"L": 2, "moe_first_dense_layers": 1, "b": 1, "s": 8}, "tp-sp", "balanced", "none"),
]


def _tp_moe(changes, recompute):
    return make_config(LLAMA3, **(MOE | TP_MOE | changes), recompute=recompute)


@pytest.mark.parametrize("changes, strategy, route, recompute", TP_MOE_MOMENTS, ids=str)
def test_with_experts_under_its_tp_plan_memtracker_reaches_the_peak_to_the_byte(one_thread, changes, strategy, route,
                                                                                recompute):
    (r,) = measure_step(_tp_moe(changes, recompute), [strategy], route=route)
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("changes, strategy, route, recompute", TP_MOE_MOMENTS, ids=str)
def test_with_experts_under_its_tp_plan_every_moment_happens_in_order(one_thread, changes, strategy, route, recompute):
    """The MoE's collectives (the all-gather at its entry, the reduce-scatters or the all-reduce at its exit, their
    conjugates in backward) and its experts' e/t-wide grouped GEMMs, forward and backward, under recomputation too."""
    config = _tp_moe(changes, recompute)

    def readings(tp):
        with runtime(tp, config.ep) as dims:
            return readings_after_every_op(warmed_up(tp, config, STRATEGIES[strategy], dims, route))

    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CPU).moments[1:-1], run_fake(readings, (), config.t))


@pytest.mark.parametrize("changes, strategy, named", [
    ({"ep": 2}, "tp", "experts at ep=2 under tp without sequence parallel"),
    ({"dp_shard": 2}, "tp-sp", "experts under dp_shard with tp"),
])
def test_with_experts_under_tp_what_the_walk_does_not_model_is_refused_by_name(changes, strategy, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(LLAMA3, **(MOE | TP_MOE | changes)), STRATEGIES[strategy], CPU)


# -- with experts over its TP ranks (ep = t = 2, tp-sp): each rank routes its own s/t tokens; the all-to-all dispatcher
# exchanges the counts, sends the rows (chunks, concatenated), reorders them expert-major (_permute's int64 indices) for
# its E/ep whole experts, and returns them; forced balanced (r = k*b*s/t) or all-to-one (rank 0 receives every rank's);
# shared experts gather the shard themselves
EP_MOMENTS = [
    ({"L": 1}, "balanced"),
    ({"moe_tokens": "worst"}, "all-to-one"),
    ({"b": 1, "s": 6, "num_experts": 6, "moe_router_topk": 2, "moe_ffn_hidden_size": 16}, "balanced"),  # s/t odd
    ({"b": 3, "s": 10, "num_experts": 8, "moe_router_topk": 1, "moe_ffn_hidden_size": 48, "moe_tokens": "worst",
      "vocab_size": 16}, "all-to-one"),
    # shared experts: they gather the rank's shard at their entry, their partial output reduce-scattered
    ({"L": 1, "moe_shared_expert_intermediate_size": 48}, "balanced"),
    ({"b": 1, "s": 6, "num_experts": 6, "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 48,
      "moe_router_score_function": "sigmoid", "moe_tokens": "worst"}, "all-to-one"),
]


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, route", EP_MOMENTS, ids=str)
def test_with_experts_over_its_tp_ranks_memtracker_reaches_the_peak_to_the_byte(one_thread, changes, route, recompute):
    """Under FullAC and SelectiveAC too: _permute's indices held by the dispatch metadata to routed_experts' return,
    dY's contiguous copy made before the block's rerun."""
    (r,) = measure_step(_tp_moe(changes | {"ep": 2}, recompute), ["tp-sp"], route=route)
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, route", EP_MOMENTS, ids=str)
def test_with_experts_over_its_tp_ranks_every_moment_happens_in_order(one_thread, changes, route, recompute):
    config = _tp_moe(changes | {"ep": 2}, recompute)

    def readings(tp):
        with runtime(tp, config.ep) as dims:
            return readings_after_every_op(warmed_up(tp, config, STRATEGIES["tp-sp"], dims, route))

    assert_moments_in_order(timeline(config, STRATEGIES["tp-sp"], CPU).moments[1:-1], run_fake(readings, (), 2))


# fp32, torchtitan's default training.dtype (no FSDP: no mixed precision at all): every cast a no-op, so the
# composite norm's fp32 input is the residual stream's tensor itself, whose gradients autograd adds into the stream's
# as they come; RoPE's complex products are Q and K; the loss reads the logits themselves.
FP32_CASES = [
    ({}, "none"),  # the loss's backward
    ({"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100}, "none"),  # b = 1, odd s, no GQA
    ({"vocab_size": 16, "s": 64, "a": 16, "num_query_groups": 16}, "none"),
    ({"vocab_size": 16, "ffn_hidden_size": 512, "b": 1, "s": 9}, "none"),
    ({"t": 2}, "tp-sp"),
    ({"t": 2, "b": 1, "s": 10, "L": 1}, "tp-sp"),
    ({"t": 2, "b": 1, "s": 8, "num_query_groups": 8}, "tp"),
    ({"t": 4, "num_query_groups": 4, "b": 3, "s": 12, "L": 1}, "tp"),
]


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", FP32_CASES, ids=str)
def test_in_fp32_every_moment_happens_in_order_and_the_peak_is_memtrackers(one_thread, changes, strategy, recompute):
    """Under FullAC and SelectiveAC too: the norm keeps the checkpoint's input itself, until its pow's backward."""
    config = make_config(LLAMA3, dtype="fp32", recompute=recompute, **changes)
    with readings_of_the_measured_step() as readings:
        (r,) = measure_step(config, [strategy])
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CPU).moments[1:-1], readings)
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


# -- torchtitan's ChunkedLossWrapper (its model configs' loss): the final norm's output split along s, each chunk's
# lm_head, loss and backward inside the trainer's forward, their dX gathered in an fp32 buffer ---------------------

CHUNKED = [
    ({"loss_chunks": 4}, "none", "none"),  # b > 1: the hidden states' and labels' chunks are copies
    ({"loss_chunks": 4, "b": 1}, "none", "none"),  # b = 1: views of them
    ({"loss_chunks": 3, "s": 9}, "none", "op"),  # an odd s in an odd count of chunks
    ({"loss_chunks": 1, "b": 1, "s": 7}, "none", "full"),  # one chunk: the whole sequence, through the wrapper
    ({"loss_chunks": 8, "tie_embeddings": True}, "none", "none"),  # lm_head's gradient handed over chunk by chunk
    ({"loss_chunks": 2, "dtype": "fp32"}, "none", "none"),  # fp32: the buffer is the gradient, no casts
    ({"loss_chunks": 4, "t": 2}, "tp-sp", "none"),  # the norm's output gathered whole, each chunk vocabulary-parallel
    ({"loss_chunks": 3, "t": 2, "b": 1, "s": 12}, "tp-sp", "full"),
    ({"loss_chunks": 2, "t": 2}, "tp", "op"),
]


@pytest.mark.parametrize("changes, strategy, recompute", CHUNKED, ids=str)
def test_under_the_chunked_loss_every_moment_and_the_peak_are_memtrackers(one_thread, changes, strategy, recompute):
    assert_step_exact_moment_by_moment(make_config(LLAMA3, recompute=recompute, **changes), strategy,
                                       "torchtitan's Llama3Model")


def test_with_experts_under_the_chunked_loss_every_moment_and_the_peak_are_memtrackers(one_thread):
    """The model's end is the dense model's: a MoE model's too."""
    config = make_config(LLAMA3, **MOE, b=3, s=6, loss_chunks=3, recompute="op")
    assert_step_exact_moment_by_moment(config, "none", "torchtitan's Llama3Model", "balanced")
