"""One whole training step of transformers' own LlamaForCausalLM (`--impl hf`) under torch's MemTracker, against
the hf step timeline: the peak, each category at it and the state between steps to the byte, with eager and SDPA
attention, at t = 1 and under transformers' own tp_plan (rank 0 of t = 2 through the fake group); MemTracker reaches
its peak at the moment the timeline names, for sizes that put the peak in six different places (five under tp); and
every moment the timeline names is MemTracker's reading after some op, in order."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.model.families import FAMILIES  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.hf_step import warmed_up  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import ACTIVATIONS, PARAMETERS, TEMPORARIES, timeline  # noqa: E402

from tests.helpers import GPT2_HF, LLAMA_HF as LLAMA, make_config  # noqa: E402

from ..step_readings import (  # noqa: E402
    assert_moments_in_order, readings_after_every_op, readings_of_the_measured_step,
)

ATTENTIONS = ["eager", "flash"]  # transformers' attn_implementation "eager" and "sdpa"
CPU = Accounting(exact=True, device="cpu")


LAYOUTS = ["none", "tp"]  # transformers runs no sequence parallelism (memcalc.model.impls.hf.NO_SEQUENCE_PARALLEL)

def _exact_step(config, layout: str, route: str | None = None):
    """The step of `config` under `layout`: every moment the walk names among MemTracker's readings, in order; the
    peak's moment, and every category at the peak and between steps, MemTracker's to the byte."""
    with readings_of_the_measured_step() as readings:
        (r,) = measure_step(config, [layout], route=route)
    assert_moments_in_order(timeline(config, STRATEGIES[layout], CPU).moments[1:], readings)
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    return r


@pytest.fixture(scope="module")
def measured(one_thread):
    return {(attention, r.strategy.name): r for attention in ATTENTIONS
            for r in measure_step(make_config(LLAMA, attention=attention, t=2), LAYOUTS)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_peak_and_every_category_at_it_are_memtrackers_to_the_byte(measured, attention, layout):
    r = measured[attention, layout]
    assert [row.difference for row in r.rows("peak")] == [0] * 6, r.rows("peak")
    assert r.matches and r.measured.peak_bytes == r.predicted.peak.bytes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_between_steps_memtracker_sees_the_model_states_the_timeline_predicts(measured, attention, layout):
    r = measured[attention, layout]
    assert [row.difference for row in r.rows("steady")] == [0] * 6, r.rows("steady")
    assert r.measured.steady.get(ACTIVATIONS, 0) == 0  # the batch is loaded inside the step


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_memtracker_peaks_at_the_moment_the_timeline_names(measured, attention, layout):
    r = measured[attention, layout]
    assert r.measured.moment == r.predicted_moment
    assert r.model == "transformers' LlamaForCausalLM"


def test_under_tp_each_rank_holds_half_the_model_states_and_the_loss_sees_every_logit(measured):
    """transformers' plan shards every weight but the norms; lm_head's colwise_gather_output gathers the logits, so
    the loss's three fp32 (b*s, v) tensors are whole on every rank and the peak's temporaries are those of t = 1."""
    none, tp = measured["eager", "none"], measured["eager", "tp"]
    assert tp.measured.t == 2 and tp.how().startswith("one process as rank 0 of t=2")
    assert tp.measured.peak[TEMPORARIES] == none.measured.peak[TEMPORARIES]
    replicated = (2 * LLAMA["L"] + 1) * 2 * LLAMA["h"] + 2 * 4 * (LLAMA["h"] // LLAMA["a"] // 2)  # norms, RoPE's
    assert 2 * tp.measured.steady[PARAMETERS] - none.measured.steady[PARAMETERS] == replicated


# Sizes that move the peak: each entry's peak is somewhere no other entry's is.
MOMENTS = [
    ("eager", {}),  # the loss's backward: three fp32 (b*s, v) tensors
    ("flash", {"vocab_size": 40}),  # the final RMSNorm's fp32 backward
    ("flash", {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # the last layer's SwiGLU gradients
    ("eager", {"s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the last layer's fp32 softmax
    ("flash", {"b": 1, "s": 4, "vocab_size": 3000, "tie_embeddings": True}),  # the tied embedding's two gradients
    ("eager", {"b": 1, "s": 4, "vocab_size": 3000, "num_query_groups": 8}),  # lm_head's GEMMs (no GQA)
]


def test_the_chosen_sizes_put_the_peak_in_six_different_places():
    """What gives the next test its meaning: no two cases share a predicted moment."""
    moments = {timeline(make_config(LLAMA, attention=a, **c), STRATEGIES["none"], CPU).peak.label() for a, c in MOMENTS}
    assert len(moments) == len(MOMENTS), moments


@pytest.mark.parametrize("attention, changes", MOMENTS[1:], ids=str)
def test_wherever_the_peak_is_memtracker_reaches_it_there_to_the_byte(one_thread, attention, changes):
    (r,) = measure_step(make_config(LLAMA, attention=attention, **changes), ["none"])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("attention, changes", [
    ("eager", {}), ("flash", {}),
    ("flash", {"b": 1, "tie_embeddings": True, "L": 3}),  # labels sliced without a copy; the tied gradients
    ("eager", {"num_query_groups": 8, "dtype": "fp16"}),  # no repeat_kv copies
    ("eager", {"b": 1, "num_query_groups": 1}),  # one K/V group, b = 1: matmul keeps K and V unexpanded
], ids=str)
def test_every_moment_the_timeline_names_happens_in_order_in_its_module_with_its_bytes(one_thread, attention, changes):
    """Not only the peak: each moment is MemTracker's reading after some op, in the named module, in order."""
    config = make_config(LLAMA, attention=attention, **changes)
    readings = readings_after_every_op(warmed_up(single(), config))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], readings)


# -- under transformers' own tp_plan (DTensor), rank 0 of t through the fake group ------------------------------------

TP_MOMENTS = [
    ("eager", {}),  # the loss's backward: the logits are gathered whole on every rank
    ("flash", {"vocab_size": 40}),  # the final RMSNorm's fp32 backward
    ("flash", {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # the last layer's SwiGLU gradients
    ("eager", {"s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the last layer's fp32 softmax
    ("flash", {"b": 1, "s": 4, "vocab_size": 3000}),  # the embedding's whole-table gradient and this rank's rows
]


def test_under_tp_the_chosen_sizes_put_the_peak_in_five_different_places():
    moments = {timeline(make_config(LLAMA, attention=a, t=2, **c), STRATEGIES["tp"], CPU).peak.label()
               for a, c in TP_MOMENTS}
    assert len(moments) == len(TP_MOMENTS), moments


@pytest.mark.parametrize("attention, changes", TP_MOMENTS[1:], ids=str)
def test_under_tp_wherever_the_peak_is_memtracker_reaches_it_there_to_the_byte(one_thread, attention, changes):
    (r,) = measure_step(make_config(LLAMA, attention=attention, t=2, **changes), ["tp"])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("attention, changes", [
    ("eager", {"t": 2}), ("flash", {"t": 2}),
    ("eager", {"t": 4, "num_query_groups": 4, "vocab_size": 252}),  # one K/V group per rank: no k, v copies
    ("flash", {"t": 4, "num_query_groups": 8, "vocab_size": 252, "dtype": "fp16"}),
    ("eager", {"t": 2, "b": 1, "L": 3}),  # b = 1, one K/V group per rank: matmul keeps K and V unexpanded
    # checkpointed: in the forward and the rerun o_proj's and down_proj's partial sums beside their all-reduced outputs
    ("eager", {"t": 2, "b": 1, "s": 7, "recompute": "full"}), ("flash", {"t": 2, "b": 3, "s": 5, "recompute": "full"}),
], ids=str)
def test_under_tp_every_moment_the_timeline_names_happens_in_order(one_thread, attention, changes):
    """The all-gathered logits and their gradient's columns, each colwise dX's all-reduce, the embedding's rows."""
    config = make_config(LLAMA, attention=attention, **changes)
    readings = run_fake(lambda tp: readings_after_every_op(warmed_up(tp, config)), (), config.t)
    assert_moments_in_order(timeline(config, STRATEGIES["tp"], CPU).moments[1:], readings)


@pytest.mark.parametrize("changes, named", [
    ({"tie_embeddings": True, "dp_shard": 2}, "tied embeddings under tp with dp_shard or zero_stage"),
    ({"t": 4, "num_query_groups": 4}, "vocab_size=250 that t=4 does not divide"),
])
def test_under_tp_what_the_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(LLAMA, attention="eager", **({"t": 2} | changes)), STRATEGIES["tp"], CPU)


# -- transformers' MixtralForCausalLM, its router forced balanced (kbs/E slots an expert) -----------------------------

MIXTRAL = {"family": "mixtral", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "vocab_size": 40,
           "experts_implementation": "eager"}  # the loop the timeline walks
QWEN3 = {"family": "qwen3", "qk_layernorm": True}  # Qwen3ForCausalLM: q_norm and k_norm on each head
QWEN3_MOE = MIXTRAL | QWEN3 | {"family": "qwen3_moe"}  # Qwen2-MoE's experts, no shared one
QWEN2 = {"family": "qwen2", "add_qkv_bias": True}  # Qwen2ForCausalLM: q_proj, k_proj and v_proj with biases
MIXTRAL_MOMENTS = [
    ("flash", {}),  # the last layer's gate_up gradients summed: the sum and its two inputs, (E, 2e, h) each
    ("eager", {"vocab_size": 250}),  # the loss's backward
    ("eager", {"num_experts": 2, "moe_router_topk": 1}),  # the final RMSNorm's fp32 backward
    # forward, the last expert of the last layer: the loop's (b*s, k, E + 1) int64 routing mask outweighs the rest
    ("flash", {"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 8, "s": 96, "h": 16, "a": 2,
               "num_query_groups": 1, "vocab_size": 20}),
]


def test_mixtral_sizes_put_the_peak_in_four_different_places_two_inside_the_experts():
    moments = [timeline(make_config(LLAMA, attention=a, **(MIXTRAL | c)), STRATEGIES["none"], CPU).peak
               for a, c in MIXTRAL_MOMENTS]
    assert len({m.label() for m in moments}) == len(MIXTRAL_MOMENTS)
    assert [m.phase for m in moments if m.where == "model.layers.1.mlp.experts"] == ["backward", "forward"]


@pytest.mark.parametrize("attention, changes", [
    ("flash", {}),
    ("eager", {"num_experts": 2, "moe_router_topk": 1}),  # one expert per token: r = bs/2
    ("flash", {"num_experts": 8, "b": 1, "L": 3}),  # eight experts of six slots
    ("eager", {"h": 128, "moe_ffn_hidden_size": 16, "dtype": "fp16"}),
], ids=str)
def test_mixtral_every_moment_of_the_experts_and_router_backward_happens_in_order(one_thread, attention, changes):
    """Each block's last expert in forward; in backward each expert's routing-weight product, its two weight
    gradients' sums, the router's GEMMs and the input gradients' sum: MemTracker's reading after some op, in the
    named module, in order."""
    config = make_config(LLAMA, attention=attention, **(MIXTRAL | changes))
    readings = readings_after_every_op(warmed_up(single(), config, "balanced"))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], readings)


@pytest.mark.parametrize("route", [None, "all-to-one"])
def test_a_mixtral_step_is_measured_only_under_the_balanced_route_the_timeline_walks(route):
    with pytest.raises(ConfigError, match="needs --route balanced with moe_tokens balanced"):
        measure_step(make_config(LLAMA, attention="flash", **MIXTRAL), ["none"], route=route)


# -- transformers' default grouped_mm experts: the slots sorted by expert, two torch._grouped_mm ------------------------

GROUPED = MIXTRAL | {"experts_implementation": "grouped_mm"}
QWEN3_MOE_GROUPED = GROUPED | QWEN3 | {"family": "qwen3_moe"}
QWEN2_MOE_GROUPED = GROUPED | {"family": "qwen2_moe"}  # with a shared expert
GROUPED_MOMENTS = [
    ("MixtralForCausalLM", GROUPED, "flash", {}),  # backward: dY * w cast to bf16 beside its fp32 products
    ("MixtralForCausalLM", GROUPED, "eager", {"moe_router_topk": 1, "b": 1, "s": 13}),  # gate_up_proj's dW and dX
    ("MixtralForCausalLM", GROUPED, "flash", {"moe_ffn_hidden_size": 256, "moe_router_topk": 4}),  # down_proj's
    # forward: the weighted rows twice, in expert and in slot order
    ("Qwen2MoeForCausalLM", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 8}, "flash", {
        "num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 8, "s": 96, "h": 16, "a": 2,
        "num_query_groups": 1, "vocab_size": 20}),
    ("Qwen3MoeForCausalLM", QWEN3_MOE_GROUPED, "flash", {"b": 3, "s": 5, "num_experts": 8, "moe_router_topk": 3,
                                                         "moe_ffn_hidden_size": 16, "kv_channels": 12}),
]


def test_grouped_mm_sizes_put_the_peak_in_four_different_places_of_the_experts():
    moments = [timeline(make_config(LLAMA, attention=a, **(base | c)), STRATEGIES["none"], CPU).peak
               for _, base, a, c in GROUPED_MOMENTS]
    assert len({m.label() for m in moments}) == 4 and {m.where for m in moments} == {"model.layers.1.mlp.experts"}
    assert [m.phase for m in moments] == ["backward"] * 3 + ["forward", "backward"]


@pytest.mark.parametrize("route", ["balanced", "all-to-one"])
@pytest.mark.parametrize("model, base, attention, changes", GROUPED_MOMENTS, ids=str)
def test_a_grouped_mm_moe_model_peaks_where_the_timeline_says_to_the_byte_under_either_forced_route(
    one_thread, model, base, attention, changes, route
):
    """grouped_mm's tensors hold all k*b*s slots whatever each expert's count: every expert's or the first k's."""
    (r,) = measure_step(make_config(LLAMA, attention=attention, **(base | changes)), ["none"], route=route)
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.model == f"transformers' {model}, router forced {route}"


@pytest.mark.parametrize("base, attention, changes, route", [
    (GROUPED, "flash", {}, "balanced"),
    (GROUPED, "flash", {"moe_router_topk": 1, "b": 1, "s": 13}, "all-to-one"),
    # fourteen slots that three experts do not share evenly: grouped_mm does not mind
    (QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40}, "eager", {
        "num_experts": 3, "moe_ffn_hidden_size": 24, "b": 1, "s": 7}, "all-to-one"),
    (QWEN3_MOE_GROUPED, "flash", {"b": 3, "s": 5, "num_experts": 8, "moe_router_topk": 3, "moe_ffn_hidden_size": 16,
                                  "kv_channels": 12}, "balanced"),
    (GROUPED, "eager", {"num_experts": 2, "moe_router_topk": 1, "moe_ffn_hidden_size": 8, "h": 128, "b": 3, "s": 11,
                        "dtype": "fp16"}, "balanced"),
    # decoder_sparse_step 2: dense layers among the sparse ones (layer i sparse when 2 divides i + 1)
    (QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 64}, "flash", {"moe_layer_freq": 2}, "balanced"),
    (QWEN3_MOE_GROUPED, "eager", {"moe_layer_freq": 2, "L": 3, "b": 1, "s": 13}, "all-to-one"),
], ids=str)
def test_grouped_mm_every_moment_of_the_block_happens_in_order(one_thread, base, attention, changes, route):
    """The rows put back in slot order and their sum in forward; in backward the sum's, the unpermuting index's, the
    routing weight's product, both grouped GEMMs (dW, then dX), SwiGLU's and chunk's, the gather's: MemTracker's
    reading after some op, in the named module, in order."""
    config = make_config(LLAMA, attention=attention, **(base | changes))
    readings = readings_after_every_op(warmed_up(single(), config, route))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], readings)


@pytest.mark.parametrize("base, attention, changes, route", [
    (GROUPED, "flash", {"t": 2}, "balanced"),
    (QWEN3_MOE_GROUPED, "flash", {"t": 2, "b": 3, "s": 5, "num_experts": 8, "moe_router_topk": 3,
                                  "moe_ffn_hidden_size": 16, "kv_channels": 12}, "balanced"),
    (GROUPED, "eager", {"t": 4, "num_query_groups": 4, "moe_router_topk": 1, "moe_ffn_hidden_size": 256, "b": 1,
                        "s": 13}, "all-to-one"),
    # Qwen2-MoE: the plan names no shared expert: whole on every rank
    (QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40}, "eager", {"t": 2, "b": 1, "s": 13}, "all-to-one"),
], ids=str)
def test_under_tp_grouped_mm_experts_of_e_over_t_peak_where_the_timeline_says_with_every_moment_in_order(
    one_thread, base, attention, changes, route
):
    """transformers' plan gives each rank e/t of every expert, local tensors from the experts' start: their weights'
    gradients are handed over when the experts' backward ends, the input's and routing weights' all-reduced in
    place."""
    _exact_step(make_config(LLAMA, attention=attention, **(base | changes)), "tp", route)


# -- transformers' Qwen2MoeForCausalLM: Mixtral's experts (bf16 routing weights) beside a gated shared expert ----------

QWEN2_MOE = MIXTRAL | {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 64}
QWEN2_MOE_MOMENTS = [
    ("flash", {}),  # the last layer's gate_up gradients summed
    # a wide shared expert: its down_proj's dW and dX, autograd's last ops in the block
    ("flash", {"moe_shared_expert_intermediate_size": 1024, "num_experts": 2, "moe_router_topk": 1,
               "moe_ffn_hidden_size": 8}),
    # forward, the last expert of the last layer: the routing mask outweighs the rest
    ("flash", {"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 8, "s": 96, "h": 16, "a": 2,
               "num_query_groups": 1, "vocab_size": 20, "moe_shared_expert_intermediate_size": 8}),
]


def test_qwen2_moe_sizes_put_the_peak_in_three_different_places_of_the_block():
    moments = {timeline(make_config(LLAMA, attention=a, **(QWEN2_MOE | c)), STRATEGIES["none"], CPU).peak.label()
               for a, c in QWEN2_MOE_MOMENTS}
    assert len(moments) == len(QWEN2_MOE_MOMENTS) and all(".mlp." in x for x in moments), moments


MOE_STEPS = [("MixtralForCausalLM", MIXTRAL, a, c) for a, c in MIXTRAL_MOMENTS] + [
    ("Qwen2MoeForCausalLM", QWEN2_MOE, a, c) for a, c in QWEN2_MOE_MOMENTS]


@pytest.mark.parametrize("model, base, attention, changes", MOE_STEPS, ids=str)
def test_a_moe_model_under_balanced_routing_peaks_where_the_timeline_says_to_the_byte(
    one_thread, model, base, attention, changes
):
    (r,) = measure_step(make_config(LLAMA, attention=attention, **(base | changes)), ["none"], route="balanced")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.model == f"transformers' {model}, router forced balanced"


@pytest.mark.parametrize("attention, changes", [
    ("flash", {}),
    ("eager", {}),  # a second additive (b, 1, s, s) mask
    ("flash", {"moe_router_pre_softmax": True}),  # norm_topk_prob false: no division in the router
    ("eager", {"num_experts": 8, "b": 1, "L": 3, "num_query_groups": 8, "dtype": "fp16"}),
], ids=str)
def test_qwen2_moe_every_moment_of_the_block_happens_in_order(one_thread, attention, changes):
    """The shared expert gate's GEMMs, each expert's moments, the router's, the shared expert's down_proj, up_proj and
    gate_proj with the block input's gradients summed one path at a time."""
    config = make_config(LLAMA, attention=attention, **(QWEN2_MOE | changes))
    readings = readings_after_every_op(warmed_up(single(), config, "balanced"))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], readings)


# -- odd shapes: b = 1, odd s, a/g = 1, 2, 3, heads other than h/a wide (kv_channels, transformers' head_dim) ---------

ODD = {"h": 48, "a": 6}
ODD_SHAPES = [
    ("none", "flash", ODD | {"b": 1, "s": 23, "num_query_groups": 6}),  # a/g = 1
    ("none", "eager", ODD | {"b": 1, "s": 23, "num_query_groups": 6}),
    ("none", "eager", ODD | {"b": 1, "s": 23, "num_query_groups": 3}),  # a/g = 2
    ("none", "flash", ODD | {"b": 3, "s": 17, "num_query_groups": 2}),  # a/g = 3
    ("none", "eager", ODD | {"b": 3, "s": 17, "num_query_groups": 2}),
    ("tp", "eager", ODD | {"t": 2, "b": 1, "s": 23, "num_query_groups": 2, "vocab_size": 252}),
    ("tp", "flash", ODD | {"t": 3, "b": 1, "s": 17, "num_query_groups": 3, "vocab_size": 252, "ffn_hidden_size": 177}),
    ("none", "flash", {"s": 19, "kv_channels": 12}),  # heads wider than h/a
    ("none", "eager", {"s": 19, "kv_channels": 12}),
    ("none", "eager", {"b": 1, "s": 13, "kv_channels": 4, "num_query_groups": 4}),  # narrower, one group a rank
    ("tp", "flash", {"t": 2, "kv_channels": 12}),
    ("tp", "eager", {"t": 2, "kv_channels": 4}),
]


@pytest.mark.parametrize("layout, attention, changes", ODD_SHAPES, ids=str)
def test_at_odd_shapes_every_moment_happens_in_order_and_the_peak_is_memtrackers(one_thread, layout, attention,
                                                                                 changes):
    config = make_config(LLAMA, attention=attention, **changes)
    _exact_step(config, layout)


def test_qwen2_moe_with_wide_heads_at_odd_sizes_peaks_where_the_timeline_says(one_thread):
    config = make_config(LLAMA, attention="eager", **(QWEN2_MOE | {"b": 3, "s": 5, "num_experts": 3, "moe_router_topk": 3,
                                                                   "moe_ffn_hidden_size": 24, "kv_channels": 12,
                                                                   "moe_shared_expert_intermediate_size": 40}))
    readings = readings_after_every_op(warmed_up(single(), config, "balanced"))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], readings)


CHECKPOINTED_LOOP = {"recompute": "full", "b": 1, "s": 14, "h": 16, "a": 1, "num_query_groups": 1, "L": 1,
                     "vocab_size": 2, "ffn_hidden_size": 1, "num_experts": 2, "moe_router_topk": 1,
                     "moe_ffn_hidden_size": 8}


@pytest.mark.parametrize("base, changes", [
    (MIXTRAL, {"dtype": "fp32"}),
    (QWEN3_MOE, {}),
    (QWEN2_MOE, {"s": 12, "moe_shared_expert_intermediate_size": 8}),
], ids=str)
def test_a_checkpointed_loop_peaks_at_the_first_experts_index_backward_beside_its_unsummed_weight_gradients(
        one_thread, base, changes):
    """The first expert autograd runs holds its gate_up and down weight gradients, each in an (E, ...) zero tensor
    not yet summed with another's, when index's backward makes its (b*s, h) zeros and their put; found by drawn
    runs, where the walk marked no moment there (Qwen2-MoE: 55,312 B measured, the walk's peak 55,012 at the next
    expert's sum)."""
    config = make_config(LLAMA, attention="eager", **(base | CHECKPOINTED_LOOP | changes))
    _exact_step(config, "none", "balanced")


# -- transformers' Qwen3ForCausalLM (qk_layernorm: each query and key head RMS-normalised) and Qwen3MoeForCausalLM ---

QWEN3_STEPS = [
    ("none", "flash", QWEN3, None),
    ("none", "eager", QWEN3, None),
    ("none", "eager", QWEN3 | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}, None),
    ("none", "flash", QWEN3 | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2}, None),
    ("tp", "flash", QWEN3 | {"t": 2}, None),
    ("tp", "eager", QWEN3 | {"t": 2, "kv_channels": 12}, None),
    ("none", "flash", QWEN3_MOE, "balanced"),  # Qwen3-MoE: Qwen2-MoE's experts, no shared one
    ("none", "eager", QWEN3_MOE | {"moe_router_pre_softmax": True, "b": 1, "s": 12,
                                 "kv_channels": 12}, "balanced"),
]


@pytest.mark.parametrize("layout, attention, changes, route", QWEN3_STEPS, ids=str)
def test_qwen3_and_qwen3_moe_steps_happen_in_order_and_peak_where_the_timeline_says(one_thread, layout, attention,
                                                                                   changes, route):
    config = make_config(LLAMA, attention=attention, **changes)
    r = _exact_step(config, layout, route)
    assert r.model.startswith("transformers' Qwen3")


# -- transformers' Qwen2ForCausalLM (add_qkv_bias: q_proj, k_proj and v_proj with biases) -----------------------------

QWEN2_STEPS = [
    ("none", "eager", QWEN2 | {"b": 1, "s": 13}),  # a/g = 4
    ("none", "flash", QWEN2 | {"s": 11, "num_query_groups": 8}),  # a/g = 1
    ("none", "eager", QWEN2 | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 3}),  # a/g = 2
    ("tp", "flash", QWEN2 | {"t": 2, "s": 9}),
]


@pytest.mark.parametrize("layout, attention, changes", QWEN2_STEPS, ids=str)
def test_qwen2s_qkv_bias_gradients_happen_in_order_and_the_peak_is_memtrackers(one_thread, layout, attention, changes):
    """Each bias's gradient is dY summed to (out,) inside the GEMMs' node, beside dY, dW and dX."""
    config = make_config(LLAMA, attention=attention, **changes)
    r = _exact_step(config, layout)
    assert r.model.startswith("transformers' Qwen2")


# -- attention_dropout (eager: native_dropout's bool mask, CUDA's, through the probe's shim) --------------------------

DROPOUT_STEPS = [
    ("none", {"dropout": 0.1, "s": 13}, None),  # a/g = 4
    ("none", {"dropout": 0.1, "b": 1, "s": 11, "num_query_groups": 8} | QWEN2, None),  # a/g = 1, Qwen2
    ("none", {"dropout": 0.1, "b": 1, "s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, None),  # softmax's
    ("tp", {"dropout": 0.1, "t": 2, "s": 9}, None),
    ("none", MIXTRAL | {"dropout": 0.1, "s": 13}, "balanced"),
    ("none", QWEN3_MOE | {"dropout": 0.1, "b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 3,
                        "num_experts": 3, "moe_router_topk": 1, "moe_ffn_hidden_size": 24}, "balanced"),  # Qwen3-MoE
]


@pytest.mark.parametrize("layout, changes, route", DROPOUT_STEPS, ids=str)
def test_attention_dropout_keeps_its_mask_to_its_backward_and_the_peak_is_memtrackers(one_thread, layout, changes,
                                                                                      route):
    """native_dropout keeps a 1-byte mask and weights x V the dropped-out weights (not the softmax's bf16 cast); its
    backward is one kernel, the gradient through the mask."""
    config = make_config(LLAMA, attention="eager", **changes)
    _exact_step(config, layout, route)


# SDPA with dropout on a CPU: torch's math kernel (aten _scaled_dot_product_attention_math), fp32 throughout
SDPA_DROPOUT_STEPS = [
    ("none", {"s": 13}, None),  # a/g = 4: K and V repeated (enable_gqa); the loss's backward
    ("none", {"b": 1, "s": 11, "num_query_groups": 8} | QWEN2, None),  # a/g = 1, b = 1: no copies to fold (b, a)
    ("none", {"b": 1, "s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, None),  # dropped x V's backward
    # forward, the kernel's output cast back with every local live: GQA with bmm's copies, then multi-head
    ("none", {"b": 3, "s": 33, "h": 16, "a": 8, "ffn_hidden_size": 16, "vocab_size": 20, "kv_channels": 4}, None),
    ("none", {"b": 2, "s": 64, "h": 16, "a": 2, "num_query_groups": 2, "ffn_hidden_size": 16, "vocab_size": 20,
              "family": "mistral"}, None),
    ("none", {"b": 3, "s": 17, "h": 48, "a": 6, "num_query_groups": 3, "vocab_size": 20} | QWEN3, None),
    ("none", {"b": 2, "s": 1}, None),  # one token: no causal mask
    ("tp", {"t": 2, "s": 9}, None),
    ("tp", {"t": 4, "b": 3, "s": 7, "num_query_groups": 4, "vocab_size": 252}, None),  # one K/V group a rank
    ("none", MIXTRAL | {"b": 1, "s": 96, "h": 16, "a": 2, "num_query_groups": 1}, "balanced"),  # top-2
    ("none", QWEN3_MOE | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 3, "num_experts": 3,
                          "moe_router_topk": 1, "moe_ffn_hidden_size": 24}, "balanced"),  # top-1
]


def test_sdpa_dropout_sizes_put_the_peak_in_six_different_places():
    """What gives the next test its meaning: forward inside the math kernel, its backward, and four outside."""
    peaks = {timeline(make_config(LLAMA, attention="flash", dropout=0.1, **c), STRATEGIES[layout], CPU).peak.label()
             for layout, c, _ in SDPA_DROPOUT_STEPS}
    assert len(peaks) >= 6, peaks
    assert any(p.startswith("forward") and "math kernel" in p for p in peaks), peaks


@pytest.mark.parametrize("layout, changes, route", SDPA_DROPOUT_STEPS, ids=str)
def test_sdpa_with_dropout_runs_the_math_kernel_on_a_cpu_and_the_step_is_memtrackers_to_the_byte(one_thread, layout,
                                                                                                changes, route):
    """The math kernel keeps the ledger's fp32 q, k^T, softmax, dropout mask, dropped-out weights and v; its C++ locals
    live to its return (its widest forward moment); its backward runs each op's, the fp32 gradients cast back last."""
    _exact_step(make_config(LLAMA, attention="flash", dropout=0.1, **changes), layout, route)


# -- other families' own *ForCausalLM: the Llama walk with each family's declared variations -------------------------

# GemmaForCausalLM: (1 + w) RMSNorm, tanh GeGLU, scaled embedding
GEMMA = {"family": "gemma", "norm": "rmsnorm_1p", "mlp": "geglu_tanh"}
# Gemma2ForCausalLM: eager attention only (_supports_sdpa False)
GEMMA2 = GEMMA | {"family": "gemma2", "sandwich_norm": True}
CAPPED = {"attn_logit_softcapping": 50.0}
PHI3 = {"family": "phi3", "fused_qkv": True}
OLMO = {"family": "olmo", "norm": "layernorm_np"}
# heads wider than h (a * d >> h), a small vocabulary and MLP: in bf16 the step peaks at RoPE's fp32 products and sums
WIDE_HEADS = [
    ({"b": 3, "s": 16, "h": 64, "a": 2, "kv_channels": 256, "num_query_groups": 1}, "flash", "none"),
    ({"b": 2, "s": 3, "h": 32, "a": 4, "kv_channels": 256, "num_query_groups": 4, "tie_embeddings": True}, "eager",
     "none"),
    ({"b": 1, "s": 9, "h": 32, "a": 4, "kv_channels": 128, "num_query_groups": 2, "L": 2}, "eager", "none"),
    ({"b": 3, "s": 5, "h": 32, "a": 4, "kv_channels": 128, "num_query_groups": 1}, "flash", "full"),  # the rerun's
]
WIDE = {"vocab_size": 8, "ffn_hidden_size": 8, "L": 1}
# Starcoder2ForCausalLM: nn.LayerNorm, biases on every linear, a GELU MLP (mlp gelu: torch's tanh kernel), RoPE
STARCODER2 = {"family": "starcoder2", "norm": "layernorm", "mlp": "gelu", "rotary_percent": 1.0,
              "add_bias_linear": True}
# CohereForCausalLM: the attention and the MLP side by side on one CohereLayerNorm, fp32 RoPE, scaled logits
COHERE = {"family": "cohere", "norm": "layernorm_nb", "parallel_residual": True, "single_norm": True}
FAMILY_STEPS = [
    ("gemma", "eager", GEMMA),  # the loss's backward
    ("gemma", "flash", GEMMA | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}),  # lm_head's GEMMs
    ("gemma", "flash", GEMMA | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("gemma", "flash", GEMMA | {"vocab_size": 40}),  # the final GemmaRMSNorm's backward
    ("gemma", "flash", GEMMA | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # the last GeGLU's gradients
    ("gemma", "eager", GEMMA | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the fp32 softmax
    ("gemma2", "eager", GEMMA2 | CAPPED),  # sandwich norms, every other layer sliding, the scores soft-capped
    ("gemma2", "eager", GEMMA2 | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}),  # not capped
    ("gemma2", "eager", GEMMA2 | CAPPED | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2,
                                          "tie_embeddings": True}),
    ("gemma2", "eager", GEMMA2 | CAPPED | {"vocab_size": 40}),
    ("gemma2", "eager", GEMMA2 | CAPPED | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),
    ("gemma2", "eager", GEMMA2 | CAPPED | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20,
                                          "sliding_window": 16}),  # a window shorter than s
    ("phi3", "eager", PHI3),  # Phi3ForCausalLM: one qkv_proj, one gate_up_proj, eager (the ledger's)
    ("phi3", "eager", PHI3 | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}),
    ("phi3", "eager", PHI3 | {"b": 1, "s": 13, "num_query_groups": 1}),  # V kept as the whole qkv_proj output
    ("phi3", "eager", PHI3 | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("phi3", "eager", PHI3 | {"vocab_size": 40}),
    ("phi3", "eager", PHI3 | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),
    ("phi3", "eager", PHI3 | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),
    ("olmo", "eager", OLMO),  # OlmoForCausalLM: LayerNorm without parameters on an fp32 copy, fp32 RoPE tables
    ("olmo", "flash", OLMO | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}),
    ("olmo", "eager", OLMO | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("olmo", "flash", OLMO | {"vocab_size": 40}),
    ("olmo", "flash", OLMO | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),
    ("olmo", "eager", OLMO | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),
    ("starcoder2", "eager", STARCODER2),
    ("starcoder2", "flash", STARCODER2 | {"b": 1, "s": 13}),
    ("starcoder2", "eager", STARCODER2 | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2,
                                         "tie_embeddings": True}),
    ("starcoder2", "flash", STARCODER2 | {"vocab_size": 40}),  # c_proj's bias gradient
    ("starcoder2", "eager", STARCODER2 | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512, "mlp": "gelu_tanh"}),
    ("starcoder2", "eager", STARCODER2 | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),
    ("cohere", "eager", COHERE),
    ("cohere", "flash", COHERE | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}),
    ("cohere", "eager", COHERE | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("cohere", "flash", COHERE | {"vocab_size": 40}),  # the final norm's weight gradient
    ("cohere", "flash", COHERE | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),
    ("cohere", "eager", COHERE | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),
]


# attention dropout in Gemma's and Gemma 2's models (eager: native_dropout through the shim; SDPA: the math kernel),
# with and without gradient checkpointing
GEMMA_DROPOUT_STEPS = [
    ("eager", GEMMA, "none"),
    ("flash", GEMMA | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}, "none"),  # heads wider than h/a
    ("eager", GEMMA | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2}, "full"),
    ("flash", GEMMA | {"b": 3, "s": 7}, "full"),
    ("eager", GEMMA2 | CAPPED, "none"),  # the scores soft-capped before the mask, the softmax and dropout
    ("eager", GEMMA2 | CAPPED | {"b": 1, "s": 13, "sliding_window": 4}, "full"),
    ("eager", GEMMA2 | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20, "sliding_window": 16}, "full"),
]


@pytest.mark.parametrize("attention, changes, recompute", GEMMA_DROPOUT_STEPS, ids=str)
def test_gemmas_attention_dropout_is_llamas_and_the_step_is_memtrackers(one_thread, attention, changes, recompute):
    r = _exact_step(make_config(LLAMA, attention=attention, dropout=0.1, recompute=recompute, **changes), "none")
    assert r.model.startswith("transformers' Gemma")


PHI3_DROPOUT_STEPS = [
    (PHI3, "none"),
    (PHI3 | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}, "none"),
    (PHI3 | {"b": 3, "s": 7, "num_query_groups": 8}, "full"),  # V, a view of qkv_proj's output, copied
    (PHI3 | {"b": 2, "s": 5, "num_query_groups": 1}, "full"),
]


@pytest.mark.parametrize("changes, recompute", PHI3_DROPOUT_STEPS, ids=str)
def test_phi3s_residual_dropouts_keep_their_masks_and_the_step_is_memtrackers(one_thread, changes, recompute):
    """resid_attn_dropout and resid_mlp_dropout (p > 0) drop out o_proj's and down_proj's outputs, which the layer's
    variable holds to the residual sum; each keeps its bool mask, and its backward makes the projection's dY."""
    r = _exact_step(make_config(LLAMA, attention="eager", dropout=0.1, recompute=recompute, **changes), "none")
    assert r.model.startswith("transformers' Phi3ForCausalLM")


# OlmoForCausalLM in fp32 (its casts no-ops: x.to(float32) is the stream itself, RoPE Llama's), under gradient
# checkpointing (each OlmoLayerNorm and the fp32 RoPE op by op in the rerun), with dropout, under the tp_plan
OLMO_STEPS = [
    ("eager", OLMO | {"dtype": "fp32", "b": 3, "s": 7, "num_query_groups": 8}, "none", "none"),
    ("flash", OLMO | {"dtype": "fp32", "b": 1, "s": 13}, "full", "none"),
    ("eager", OLMO | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}, "full", "none"),
    ("flash", OLMO | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2}, "full", "none"),
    ("eager", OLMO | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, "full", "none"),
    ("eager", OLMO | {"dropout": 0.1, "b": 3, "s": 9}, "full", "none"),
    ("flash", OLMO | {"dropout": 0.1, "b": 1, "s": 5, "dtype": "fp32"}, "none", "none"),
    ("flash", OLMO | {"t": 2, "b": 3, "s": 7}, "full", "tp"),
    *((attention, OLMO | WIDE | changes, recompute, "none") for changes, attention, recompute in WIDE_HEADS),
]


@pytest.mark.parametrize("attention, changes, recompute, layout", OLMO_STEPS, ids=str)
def test_olmos_parameterless_layernorms_and_fp32_rope_step_as_the_walk_says_to_the_byte(one_thread, attention,
                                                                                      changes, recompute, layout):
    r = _exact_step(make_config(LLAMA, attention=attention, recompute=recompute, **changes), layout)
    assert r.model.startswith("transformers' OlmoForCausalLM")


# Starcoder2ForCausalLM in fp32, under gradient checkpointing (each nn.LayerNorm keeps its input, the layer's own
# tensor), with gelu_new, with dropout (F.dropout on the embedding, o_proj's and c_proj's outputs; the attention's
# weights), at b = 1 and 3, a/g 1 to 4
STARCODER2_STEPS = [
    ("eager", STARCODER2 | {"dropout": 0.1, "b": 3, "s": 7}, "none"),
    ("eager", STARCODER2 | {"dropout": 0.1, "s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, "none"),
    ("eager", STARCODER2 | {"dropout": 0.1, "b": 3, "s": 7}, "full"),
    ("flash", STARCODER2 | {"dropout": 0.1, "b": 3, "s": 9, "mlp": "gelu_tanh", "num_query_groups": 4}, "full"),
    ("flash", STARCODER2 | {"dropout": 0.1, "dtype": "fp32", "b": 1, "s": 5}, "full"),
    # found by the step differential: o_proj's GEMMs, their rerun's input still held, as wide as its bias's sum
    ("eager", STARCODER2 | {"mlp": "gelu_tanh", "ffn_hidden_size": 1, "num_query_groups": 1, "b": 1, "s": 1, "h": 8,
                            "a": 2, "L": 1, "vocab_size": 2}, "full"),
    ("eager", STARCODER2 | {"dtype": "fp32", "b": 3, "s": 7, "num_query_groups": 8}, "none"),
    # o_proj's bias gradient
    ("eager", STARCODER2 | {"vocab_size": 20, "b": 1, "s": 3, "h": 128, "ffn_hidden_size": 64}, "none"),
    ("flash", STARCODER2 | {"b": 1, "s": 13}, "full"),
    ("eager", STARCODER2 | {"b": 3, "s": 7, "mlp": "gelu_tanh"}, "full"),
    ("eager", STARCODER2 | {"dtype": "fp32", "b": 3, "s": 9, "num_query_groups": 4}, "full"),
    ("flash", STARCODER2 | {"dtype": "fp32", "b": 1, "s": 5, "num_query_groups": 8}, "full"),
]


# under its tp_plan (q, k, v and c_fc colwise, o_proj and c_proj rowwise, their biases whole; the MLP's dropout mask
# made after c_proj's all-reduce)
STARCODER2_TP_STEPS = [
    ("eager", STARCODER2 | {"t": 2, "vocab_size": 40, "h": 32, "ffn_hidden_size": 512}, "none"),
    ("eager", STARCODER2 | {"t": 2, "vocab_size": 20, "b": 1, "s": 3, "h": 128, "ffn_hidden_size": 64}, "none"),
    ("eager", STARCODER2 | {"t": 2, "b": 3, "s": 5, "dropout": 0.1, "a": 6, "h": 48, "num_query_groups": 2,
                            "vocab_size": 40, "ffn_hidden_size": 256}, "none"),
    ("flash", STARCODER2 | {"t": 2, "b": 3, "s": 7, "dropout": 0.1}, "full"),
    # o_proj's partial sum goes as it returns, before the attention's dropout (hf_ln.dropped_attention)
    ("eager", STARCODER2 | {"t": 2, "b": 1, "s": 5, "h": 16, "a": 4, "num_query_groups": 2, "ffn_hidden_size": 4,
                            "vocab_size": 4, "L": 1, "dropout": 0.1, "mlp": "gelu_tanh"}, "full"),
    ("eager", STARCODER2 | {"t": 4, "b": 1, "s": 9, "num_query_groups": 4, "dtype": "fp32", "vocab_size": 248,
                            "mlp": "gelu_tanh"}, "none"),
]


@pytest.mark.parametrize("attention, changes, recompute", STARCODER2_STEPS + STARCODER2_TP_STEPS, ids=str)
def test_starcoder2s_layernorms_biases_and_gelu_mlp_step_as_the_walk_says_to_the_byte(one_thread, attention, changes,
                                                                                      recompute):
    _exact_family_step(attention, changes, recompute, "Starcoder2ForCausalLM")


def _exact_family_step(attention: str, changes: dict, recompute: str, architecture: str) -> None:
    """`_exact_step` on `architecture`'s model, under its tp_plan where t > 1."""
    layout = "tp" if changes.get("t", 1) > 1 else "none"
    r = _exact_step(make_config(LLAMA, attention=attention, recompute=recompute, **changes), layout)
    assert r.model.startswith(f"transformers' {architecture}")


# CohereForCausalLM in fp32 (x.to(float32) is x: its gradients summed into the stream's as they come), under gradient
# checkpointing (the norm and the fp32 RoPE op by op in the rerun, which peaks there), with dropout, a/g 1 to 3
COHERE_STEPS = [
    ("eager", COHERE | {"dtype": "fp32", "b": 3, "s": 7}, "none"),
    ("flash", COHERE | {"dtype": "fp32", "b": 1, "s": 13, "vocab_size": 40, "num_query_groups": 8}, "none"),
    ("eager", COHERE | {"vocab_size": 20, "h": 128, "ffn_hidden_size": 16, "a": 2, "num_query_groups": 1}, "none"),
    ("eager", COHERE | {"vocab_size": 20, "h": 256, "ffn_hidden_size": 8, "a": 2, "num_query_groups": 2}, "full"),
    ("eager", COHERE | {"dtype": "fp32", "b": 3, "s": 9, "num_query_groups": 4}, "full"),
    ("flash", COHERE | {"b": 1, "s": 13, "num_query_groups": 8}, "full"),
    ("flash", COHERE | {"dropout": 0.1, "b": 3, "s": 7}, "full"),
    ("eager", COHERE | {"dropout": 0.1, "b": 1, "s": 5, "h": 48, "a": 6, "num_query_groups": 3}, "full"),
    *((attention, COHERE | WIDE | changes, recompute) for changes, attention, recompute in WIDE_HEADS),
]


# under its tp_plan (Llama's: q, k, v, gate, up colwise, o and down rowwise, the norm whole)
COHERE_TP_STEPS = [
    ("flash", COHERE | {"t": 2, "vocab_size": 40, "h": 32, "ffn_hidden_size": 512}, "none"),
    ("eager", COHERE | {"t": 2, "vocab_size": 20, "h": 128, "ffn_hidden_size": 16, "a": 2, "num_query_groups": 2,
                        "b": 1, "s": 5}, "none"),
    ("eager", COHERE | {"t": 2, "b": 1, "s": 13, "dropout": 0.1, "a": 6, "h": 48, "num_query_groups": 2}, "none"),
    ("eager", COHERE | {"t": 4, "b": 3, "s": 9, "num_query_groups": 4, "dtype": "fp32", "vocab_size": 248}, "none"),
    # the peak in layer 0's SDPA, before any rowwise o_proj has run: o_proj's meta tensor (transformers' rowwise style
    # reads its strides from one) raised the meta device's peak there, which MomentTracker took for the step's
    # (found by a drawn run: 'forward model.layers.0.self_attn.o_proj' measured, every byte the walk's)
    ("flash", COHERE | {"t": 2, "b": 1, "s": 12, "h": 4, "a": 2, "num_query_groups": 2, "L": 1, "vocab_size": 4,
                        "ffn_hidden_size": 2, "dropout": 0.1}, "none"),
    # checkpointed: found by the step differential, the peak in the rerun's o_proj (tied with its backward's GEMMs),
    # its partial sum and the all-reduced output both live (hf_layer.rowwise; the walk had one, 896 B short)
    ("eager", COHERE | {"t": 2, "b": 2, "s": 2, "h": 16, "a": 4, "num_query_groups": 4, "ffn_hidden_size": 2,
                        "vocab_size": 4, "L": 1, "dtype": "fp32"}, "full"),
    ("eager", COHERE | {"t": 2, "b": 2, "s": 2, "h": 8, "a": 4, "num_query_groups": 2, "ffn_hidden_size": 2,
                        "vocab_size": 4, "L": 1}, "full"),
    ("flash", COHERE | {"t": 2, "b": 3, "s": 5, "h": 16, "a": 4, "num_query_groups": 2, "ffn_hidden_size": 8,
                        "vocab_size": 6, "L": 1, "dtype": "fp32", "dropout": 0.1}, "full"),
    ("eager", COHERE | {"t": 2, "b": 1, "s": 7, "h": 24, "a": 6, "num_query_groups": 2, "ffn_hidden_size": 6,
                        "vocab_size": 10}, "full"),  # the fp32 softmax's backward
]


@pytest.mark.parametrize("attention, changes, recompute", COHERE_STEPS + COHERE_TP_STEPS, ids=str)
def test_coheres_parallel_block_on_one_norm_steps_as_the_walk_says_to_the_byte(one_thread, attention, changes,
                                                                               recompute):
    _exact_family_step(attention, changes, recompute, "CohereForCausalLM")


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_mistrals_own_model_without_a_window_steps_as_the_llama_walk_says_to_the_byte(one_thread, attention):
    """family mistral builds MistralForCausalLM, Llama's model under another name (a window is refused before)."""
    r = _exact_step(make_config(LLAMA, attention=attention, family="mistral", b=1, s=13), "none")
    assert r.model.startswith("transformers' MistralForCausalLM")


SOFTCAPPED = {"final_logit_softcapping": 30.0}  # Gemma2ForCausalLM's logits: c * tanh(logits / c)


@pytest.mark.parametrize("changes", [
    GEMMA2 | CAPPED | SOFTCAPPED,
    GEMMA2 | SOFTCAPPED | {"b": 3, "s": 7, "h": 16, "ffn_hidden_size": 16, "vocab_size": 301, "num_query_groups": 2},
], ids=str)
def test_gemma_2s_final_logit_softcapping_keeps_tanhs_output_and_the_step_is_memtrackers_to_the_byte(one_thread,
                                                                                                     changes):
    r = _exact_step(make_config(LLAMA, attention="eager", **changes), "none")  # the division, tanh, the product
    assert r.model.startswith("transformers' Gemma2ForCausalLM")


# tied under tp, the model loaded as users load it (from_pretrained(distributed_config=...), hf_tp.loaded): one
# Shard(0) weight at both ends; DTensor adds this rank's rows of the lookup's (v, h) gradient to lm_head's
TIED = {"tie_embeddings": True}
TIED_TP_STEPS = [
    ("llama", "eager", TIED | {"t": 2, "b": 1, "s": 4, "vocab_size": 3000}),  # the rows summed: the peak
    ("llama", "flash", TIED | {"t": 4, "b": 2, "s": 5, "num_query_groups": 4, "vocab_size": 3000, "dtype": "fp32"}),
    ("llama", "flash", TIED | {"t": 2, "b": 2, "s": 7}),  # the loss's backward
    ("llama", "eager", TIED | {"t": 4, "b": 1, "s": 9, "num_query_groups": 4, "vocab_size": 252, "dtype": "fp32"}),
    ("qwen2", "eager", QWEN2 | TIED | {"t": 2, "b": 1, "s": 5, "vocab_size": 3000}),
    ("qwen2", "flash", QWEN2 | TIED | {"t": 4, "b": 2, "s": 7, "num_query_groups": 4, "vocab_size": 252,
                                       "dtype": "fp32"}),
    ("gemma", "flash", GEMMA | TIED | {"t": 2, "b": 1, "s": 5, "vocab_size": 3000}),  # the scaled lookup's gradient
    ("gemma", "eager", GEMMA | TIED | {"t": 4, "b": 2, "s": 7, "num_query_groups": 4, "vocab_size": 252,
                                       "dtype": "fp32"}),
]


@pytest.mark.parametrize("family, attention, changes", TIED_TP_STEPS, ids=str)
def test_under_tp_a_tied_models_one_shard_takes_both_gradients_and_the_step_is_memtrackers(one_thread, family,
                                                                                          attention, changes):
    _exact_step(make_config(LLAMA, attention=attention, **changes), "tp")


def test_the_families_sizes_put_the_peak_in_different_places():
    """What gives the next test its meaning: a family's cases peak at five different moments (the default sizes and
    the tied model both in the loss; Phi-3's two b = 1 cases both in lm_head)."""
    peaks = [(family, timeline(make_config(LLAMA, attention=a, **c), STRATEGIES["none"], CPU).peak.label())
             for family, a, c in FAMILY_STEPS]
    families = {family for family, _ in peaks}
    assert [len({p for f, p in peaks if f == family}) for family in families] == [5] * len(families), peaks


@pytest.mark.parametrize("family, attention, changes", FAMILY_STEPS, ids=str)
def test_each_familys_step_happens_in_order_and_peaks_where_the_timeline_says_to_the_byte(one_thread, family,
                                                                                           attention, changes):
    r = _exact_step(make_config(LLAMA, attention=attention, **changes), "none")
    assert r.model.startswith(f"transformers' {FAMILIES[family].architectures[0]}")


def test_starcoder2_without_biases_makes_no_mlp_bias_gradients_and_the_step_is_memtrackers(one_thread):
    """use_bias false: Starcoder2MLP's c_fc and c_proj are nn.Linear(bias=False), so their backward sums no bias
    gradient (the walk once gave GPT-2's Conv1D biases to every GELU MLP)."""
    r = _exact_step(make_config(LLAMA, attention="flash", **(STARCODER2 | {"add_bias_linear": False,
                                                                             "vocab_size": 40})), "none")
    assert r.model.startswith("transformers' Starcoder2ForCausalLM")


# -- GPT2LMHeadModel: its own walk (memcalc.sizing.timeline.hf_gpt2), forward op by op ---------------------------------

GPT2_STEPS = [
    {},  # the loss's backward
    {"b": 1, "s": 13, "h": 24, "a": 3, "vocab_size": 40},  # b = 1: bmm keeps c_attn's output whole, not copies
    {"b": 3, "s": 7, "h": 48, "a": 6, "tie_embeddings": False},
    {"b": 2, "s": 9, "a": 1},  # one head: q's and v's gradients are (b, s, h) views
    {"b": 1, "s": 7, "a": 1},
    {"b": 3, "s": 1, "h": 24, "a": 4},  # one token: the last c_attn's gradients
    {"b": 1, "s": 1, "h": 24, "a": 3, "L": 3},
    {"mlp": "gelu", "b": 3, "s": 7},  # torch's GELU kernel keeps its input alone
    {"dtype": "fp16", "b": 3, "s": 7, "h": 24, "a": 3},
    {"h": 32, "ffn_hidden_size": 512, "vocab_size": 40},  # the last c_proj's gradients
    {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20, "max_position_embeddings": 100},  # the softmax's
]


def test_gpt2s_sizes_put_the_peak_in_five_different_places():
    peaks = {timeline(make_config(GPT2_HF, **c), STRATEGIES["none"], CPU).peak.label() for c in GPT2_STEPS}
    assert len(peaks) == 5, peaks


def test_with_dropout_gpt2s_sizes_put_the_peak_in_five_different_places_one_in_forward():
    peaks = {timeline(make_config(GPT2_HF, dropout=0.1, **c), STRATEGIES["none"], CPU).peak.label()
             for c in GPT2_STEPS}
    assert len(peaks) == 5 and any(x.startswith("forward") for x in peaks), peaks


def test_under_recomputation_gpt2s_sizes_put_the_peak_in_five_different_places():
    peaks = {timeline(make_config(GPT2_HF, recompute="full", **c), STRATEGIES["none"], CPU).peak.label()
             for c in GPT2_STEPS}
    assert len(peaks) == 5, peaks


# GPT2Config's default dropout, 0.1, after the embedding, on the attention's weights, after c_proj and after the MLP;
# SDPA (its CPU flash kernel; with dropout torch's math kernel); gradient checkpointing (each block's early-stopped
# rerun)
@pytest.mark.parametrize("attention, dropout, recompute", [
    ("eager", 0.0, "none"), ("eager", 0.1, "none"), ("flash", 0.0, "none"), ("eager", 0.0, "full"),
    ("flash", 0.0, "full"), ("eager", 0.1, "full"), ("flash", 0.1, "none"), ("flash", 0.1, "full")])
@pytest.mark.parametrize("changes", GPT2_STEPS, ids=str)
def test_gpt2s_step_happens_in_order_and_peaks_where_the_timeline_says_to_the_byte(one_thread, changes, attention,
                                                                                    dropout, recompute):
    """LayerNorm's one kernel each way, Conv1D's addmm and its bias's sum, c_attn's output split into q, k and v
    (eager: copied for bmm unless b or a is 1; SDPA keeps the views, c_attn's output whole), the softmax in bf16,
    gelu_new's eight ops, the learned positions' gradient; with dropout, each dropout's bool mask (the probe's
    CUDA-like shim) and its input gone as it returns (c_attn's output at the attention's return, after
    resid_dropout). Under a checkpoint each kept tensor goes at its last read in forward, and each block reruns up
    to gelu_new's product, the last saved tensor."""
    r = _exact_step(make_config(GPT2_HF, attention=attention, dropout=dropout, recompute=recompute, **changes), "none")
    assert r.model == "transformers' GPT2LMHeadModel"


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("changes", [c for c in GPT2_STEPS if "dtype" not in c], ids=str)
def test_in_fp32_gpt2s_math_kernel_keeps_v_as_a_copy_or_c_attns_whole_output_to_the_byte(one_thread, changes,
                                                                                         recompute):
    """SDPA with dropout on a CPU in fp32: the math kernel casts nothing; bmm copies v to fold (b, a) (the ledger's
    GPT2_MATH_V), at b = 1 or one head folds its view and keeps c_attn's output whole."""
    r = _exact_step(make_config(GPT2_HF, attention="flash", dropout=0.1, dtype="fp32", recompute=recompute,
                                **changes), "none")
    assert r.model == "transformers' GPT2LMHeadModel"


@pytest.mark.parametrize("changes, named", [
    ({"add_bias_linear": False}, "GPT-2 without add_bias_linear"),
    ({"position_embedding_type": "rope"}, "GPT-2 with position_embedding_type rope"),
    ({"t": 2, "tie_embeddings": False}, "GPT-2's model under tp \\(t=2\\): GPT2Config has no base_model_tp_plan"),
    ({"dp_shard": 2}, "GPT-2's model under dp_shard or zero_stage"),
])
def test_what_the_gpt2_walk_does_not_model_is_refused_by_name(changes, named):
    layout = "tp" if changes.get("t", 1) > 1 else "none"
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(GPT2_HF, **changes), STRATEGIES[layout], CPU)


def test_on_cuda_gpt2s_sdpa_with_dropout_is_the_flash_kernels_walk_beside_the_measured_dropouts():
    """On CUDA the flash kernel drops out inside and keeps what it keeps without dropout (the ledger's
    FLASH_DROPOUT_LSE, read from torch's flash_api.cpp, not measured): GPT-2's SDPA walk, measured without dropout,
    with the embedding's, resid_dropout's and the MLP's dropouts, measured under eager."""
    config = make_config(GPT2_HF, attention="flash", dropout=0.1)
    steps = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cuda"))
    labels = {m.label() for m in steps.moments}
    for label in ("forward transformer.h.1.attn (SDPA's flash kernel: its output and log-sum-exp)",
                  "forward transformer.h.1.attn.resid_dropout (native_dropout: its output and bool mask)",
                  "backward transformer.h.1.attn (the SDPA kernel's backward: dQ, dK, dV)"):
        assert label in labels, label
    kept = {x.name.partition("/")[2] for x in steps.peak.live if x.name.startswith("layers.1/")}
    assert {"attention/out_dropout_mask", "mlp/dropout_mask", "attention/softmax_lse"} <= kept, kept
    assert not any(x.startswith("attention/math") or x == "attention/dropout_mask" for x in kept), kept


# -- gradient checkpointing (activation_checkpointing_enable's defaults: non-reentrant, early stop) -------------------

RECOMPUTE_STEPS = [
    ("none", "eager", {}),  # the last layer's down_proj GEMMs, right after its early-stopped rerun
    ("none", "flash", {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # the last layer's SwiGLU gradients
    ("none", "eager", {"s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the last layer's fp32 softmax
    ("none", "flash", {"b": 1, "s": 4, "vocab_size": 3000, "tie_embeddings": True}),  # the tied embedding's gradients
    ("none", "eager", ODD | {"b": 1, "s": 23, "num_query_groups": 6}),  # a/g = 1, b = 1: matmul keeps K and V
    ("none", "flash", ODD | {"b": 1, "s": 23, "num_query_groups": 3}),  # a/g = 2
    ("none", "eager", ODD | {"b": 3, "s": 17, "num_query_groups": 2, "L": 3}),  # a/g = 3, b > 1: matmul copies Q
    ("none", "eager", ODD | {"b": 3, "s": 17, "num_query_groups": 6}),  # and K and V, without repeat_kv's copies
    ("none", "flash", {"s": 19, "kv_channels": 12, "dtype": "fp16"}),  # heads wider than h/a
    ("none", "eager", QWEN3),  # Qwen3ForCausalLM: q_norm and k_norm on each head, rerun too
    ("none", "flash", ODD | QWEN3 | {"b": 1, "s": 23, "num_query_groups": 3}),
    ("none", "eager", QWEN2),  # Qwen2ForCausalLM: ln1's output goes before q's bias gradient's sum
    ("none", "flash", ODD | QWEN2 | {"b": 3, "s": 17, "num_query_groups": 2}),
    ("none", "eager", GEMMA),  # GemmaForCausalLM: GemmaRMSNorm's fp32 (1 + w) product, the tanh GeGLU
    ("none", "flash", GEMMA | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("none", "eager", GEMMA2 | CAPPED),  # Gemma2ForCausalLM: the sandwich norms, the capped scores, both masks
    ("none", "eager", GEMMA2 | CAPPED | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "L": 3}),
    ("none", "eager", GEMMA2 | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20, "sliding_window": 16}),
    ("none", "eager", PHI3),  # Phi3ForCausalLM: one qkv_proj sliced, RoPE's concatenation, one gate_up_proj chunked
    ("none", "eager", PHI3 | {"b": 3, "s": 7, "num_query_groups": 8}),  # V, a view of qkv_proj's output, copied
    ("none", "eager", PHI3 | {"b": 2, "s": 5, "num_query_groups": 1}),
    ("none", "eager", {"b": 3, "s": 7, "num_query_groups": 1}),  # repeat_kv's zero-stride views: matmul copies them
    ("none", "eager", {"b": 2, "s": 1, "num_query_groups": 1}),  # one token: the context is o_proj's input itself
    ("tp", "eager", ODD | {"t": 2, "b": 1, "s": 23, "num_query_groups": 2, "vocab_size": 252}),  # transformers' plan
    ("tp", "flash", {"t": 2, "b": 3, "s": 9, "vocab_size": 252} | QWEN3),
    ("tp", "eager", {"t": 4, "b": 3, "s": 7, "num_query_groups": 4, "vocab_size": 252}),  # one K/V group a rank
    ("tp", "flash", ODD | {"t": 3, "b": 1, "s": 17, "num_query_groups": 3, "vocab_size": 252, "ffn_hidden_size": 177}),
    ("tp", "eager", {"t": 2, "b": 3, "s": 5, "vocab_size": 252, "kv_channels": 12} | QWEN2),
]


def test_under_recomputation_the_sizes_put_the_peak_in_four_different_places():
    peaks = {timeline(make_config(LLAMA, attention=a, recompute="full", **c), STRATEGIES[layout], CPU).peak.label()
             for layout, a, c in RECOMPUTE_STEPS[:4]}
    assert len(peaks) == 4, peaks


@pytest.mark.parametrize("layout, attention, changes", RECOMPUTE_STEPS, ids=str)
def test_under_gradient_checkpointing_each_layer_and_its_early_stopped_rerun_happen_in_order_to_the_byte(
        one_thread, layout, attention, changes):
    """Each layer's forward op by op, keeping only its input (the first layer's frame also the mask, the position
    ids and RoPE's tables; Gemma 2's second layer's the causal mask); in backward its rerun up to the MLP's product,
    the last saved tensor (Gemma 2's: its post_feedforward_layernorm's 1 + w), then its backward."""
    _exact_step(make_config(LLAMA, attention=attention, recompute="full", **changes), layout)


# experts checkpointed: the block's forward op by op, its rerun stopped early at the last tensor the layer saves
RECOMPUTE_MOE_STEPS = [
    ("none", "flash", GROUPED, "balanced"),  # the last layer's rows back in expert order
    ("none", "eager", GROUPED | {"moe_router_topk": 1, "b": 1, "s": 13}, "balanced"),  # top-1: dY's rows a view
    ("none", "flash", GROUPED | {"moe_ffn_hidden_size": 256, "moe_router_topk": 4}, "all-to-one"),  # down_proj's
    ("none", "flash", GROUPED | {"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 16, "s": 96, "h": 16,
                                 "a": 2, "num_query_groups": 1, "vocab_size": 20}, "balanced"),
    ("none", "flash", QWEN3_MOE_GROUPED | {"b": 3, "s": 5, "num_experts": 8, "moe_router_topk": 3,
                                           "moe_ffn_hidden_size": 16, "kv_channels": 12}, "balanced"),
    ("none", "flash", QWEN3_MOE_GROUPED | {"moe_router_topk": 1, "b": 3, "s": 7, "num_query_groups": 1}, "balanced"),
    ("none", "eager", QWEN3_MOE_GROUPED | {"moe_router_pre_softmax": True, "b": 1, "s": 12}, "balanced"),
    # the rerun's widest moment, its early stop at inv_perm
    ("none", "eager", QWEN3_MOE_GROUPED | {"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 16,
                                           "s": 95, "h": 16, "a": 2, "num_query_groups": 1, "vocab_size": 20,
                                           "b": 1}, "all-to-one"),
    ("none", "eager", QWEN3_MOE_GROUPED | {"moe_layer_freq": 2, "L": 4, "b": 1, "s": 13}, "all-to-one"),  # dense too
    ("tp", "flash", QWEN3_MOE_GROUPED | {"t": 2, "b": 3, "s": 5, "num_experts": 8, "moe_router_topk": 3,
                                         "moe_ffn_hidden_size": 16, "kv_channels": 12}, "balanced"),
    ("tp", "eager", GROUPED | {"t": 4, "num_query_groups": 4, "moe_router_topk": 1, "moe_ffn_hidden_size": 256,
                               "b": 1, "s": 9, "vocab_size": 252}, "balanced"),
    # Qwen2-MoE: the shared expert first, its gate after the experts; the rerun stops at the gate's sigmoid
    ("none", "flash", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40}, "balanced"),
    ("none", "eager", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40, "num_experts": 3,
                                           "moe_ffn_hidden_size": 24, "b": 1, "s": 7}, "all-to-one"),
    ("none", "flash", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 1024, "num_experts": 2,
                                           "moe_router_topk": 1, "moe_ffn_hidden_size": 16}, "balanced"),
    ("none", "eager", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40, "moe_router_pre_softmax": True,
                                           "b": 3, "s": 5, "kv_channels": 12}, "balanced"),
    ("tp", "eager", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40, "t": 2, "b": 1, "s": 13},
     "all-to-one"),
    # the eager loop: each expert's tensors held by the loop's variables until the next expert rebinds them; the rerun
    # stops at the last expert's index_add_ source (the probe forces the route in the rerun too)
    ("none", "flash", MIXTRAL, "balanced"),
    ("none", "eager", MIXTRAL | {"num_experts": 2, "moe_router_topk": 1}, "balanced"),
    ("none", "flash", MIXTRAL | {"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 8, "s": 96, "h": 16,
                                 "a": 2, "num_query_groups": 1, "vocab_size": 20}, "balanced"),
    ("none", "eager", QWEN3_MOE | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 3, "num_experts": 3,
                                   "moe_router_topk": 1, "moe_ffn_hidden_size": 24}, "balanced"),
    ("none", "flash", QWEN3_MOE | {"moe_router_pre_softmax": True, "b": 1, "s": 12}, "balanced"),
    ("none", "eager", QWEN2_MOE | {"moe_shared_expert_intermediate_size": 40, "b": 3, "s": 5, "num_experts": 3,
                                   "moe_router_topk": 3, "moe_ffn_hidden_size": 24, "kv_channels": 12}, "balanced"),
]


def test_checkpointed_experts_sizes_put_the_peak_in_seven_different_places():
    peaks = {timeline(make_config(LLAMA, attention=a, recompute="full", **c), STRATEGIES[layout], CPU).peak.label()
             for layout, a, c, _ in RECOMPUTE_MOE_STEPS}
    assert len(peaks) >= 7 and any("inv_perm" in p for p in peaks) and any("source" in p for p in peaks), peaks


@pytest.mark.parametrize("layout, attention, changes, route", RECOMPUTE_MOE_STEPS, ids=str)
def test_checkpointed_experts_run_op_by_op_and_rerun_to_the_last_saved_tensor_to_the_byte(one_thread, layout, attention,
                                                                                       changes, route):
    """The router and the experts op by op (grouped_mm's locals to its return, the loop's to the next expert; Qwen2-MoE's
    shared expert before, its gate after), keeping nothing in forward; in backward, once the block's first node that
    saves reads it, the layer's rerun up to the last tensor saved (inv_perm, the last expert's index_add_ source, or
    the shared gate's sigmoid); the routing weight's product releases its rerun's tensors before autograd casts and
    sums its gradients."""
    _exact_step(make_config(LLAMA, attention=attention, recompute="full", **changes), layout, route)


# attention dropout checkpointed: the probe's CUDA-like shim drops out in the rerun too (the checkpoint's context_fn)
RECOMPUTE_DROPOUT_STEPS = [
    ("none", {"s": 13}, None),  # a/g = 4: the last layer's down_proj GEMMs
    ("none", QWEN2 | {"b": 1, "s": 11, "num_query_groups": 8}, None),  # a/g = 1, b = 1
    ("none", {"b": 1, "s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, None),  # dropped x V's backward
    ("none", ODD | {"b": 3, "s": 17, "num_query_groups": 2}, None),  # a/g = 3, b > 1: matmul's copies
    ("tp", {"t": 2, "s": 9}, None),
    ("none", MIXTRAL | {"s": 13}, "balanced"),
    ("none", QWEN3_MOE | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 3, "num_experts": 3,
                          "moe_router_topk": 1, "moe_ffn_hidden_size": 24}, "balanced"),
]


@pytest.mark.parametrize("layout, changes, route", RECOMPUTE_DROPOUT_STEPS, ids=str)
def test_under_gradient_checkpointing_attention_dropout_keeps_its_mask_in_the_rerun_to_the_byte(one_thread, layout,
                                                                                                changes, route):
    """In forward native_dropout's mask goes at once and its input, the softmax cast back, as it returns; the layer
    holds the dropped-out weights the attention returns to its end. The rerun drops out as the forward did (its own
    mask, which the rerun keeps)."""
    _exact_step(make_config(LLAMA, attention="eager", dropout=0.1, recompute="full", **changes), layout, route)


@pytest.mark.parametrize("layout, changes, route", SDPA_DROPOUT_STEPS, ids=str)
def test_under_gradient_checkpointing_sdpas_math_kernel_frees_what_no_local_holds_and_the_rerun_keeps_it(
        one_thread, layout, changes, route):
    """In forward k^T scaled, the softmax, dropout's mask and matmul's fold copies go at once (autograd keeps none of
    them), the kernel's locals at its return; the rerun keeps them all, its widest moment the one without a
    checkpoint."""
    _exact_step(make_config(LLAMA, attention="flash", dropout=0.1, recompute="full", **changes), layout, route)


# fp32 (no master weights: the trainer's FlatAdamW steps the weights themselves): every cast a no-op, so each norm's
# fp32 input is the residual stream's tensor itself, its gradients added in place; the loss's log-softmax reads the
# logits themselves; Mixtral's routing weights are the activation dtype's.
FP32 = {"dtype": "fp32"}
FP32_STEPS = [
    ("none", "eager", FP32, None),  # the loss's backward
    ("none", "flash", FP32 | {"b": 1, "s": 7, "a": 12, "h": 96, "num_query_groups": 4, "vocab_size": 40}, None),
    ("none", "eager", FP32 | {"s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, None),  # the softmax
    ("tp", "eager", FP32 | {"t": 2, "b": 1, "s": 9, "a": 12, "h": 96, "num_query_groups": 4}, None),
    ("tp", "flash", FP32 | {"t": 2}, None),
    ("none", "eager", FP32 | {"dropout": 0.1, "b": 1, "s": 7, "tie_embeddings": True}, None),
    ("none", "flash", FP32 | QWEN3 | {"b": 1, "s": 7, "kv_channels": 12, "num_query_groups": 4}, None),
    ("none", "flash", FP32 | QWEN2 | {"b": 1, "s": 9}, None),
    ("none", "eager", FP32 | GEMMA | {"b": 1, "s": 7}, None),
    ("none", "eager", FP32 | GEMMA2 | CAPPED | {"b": 1, "s": 7, "sliding_window": 3}, None),  # sandwich norms
    ("none", "eager", FP32 | PHI3 | {"b": 1, "s": 7}, None),
    ("none", "eager", FP32 | MIXTRAL, "balanced"),
    ("none", "flash", FP32 | GROUPED | {"b": 1, "s": 7}, "balanced"),
    ("tp", "flash", FP32 | GROUPED | {"t": 2}, "balanced"),
    ("none", "flash", FP32 | QWEN2_MOE | {"b": 1, "s": 10}, "balanced"),  # 5 slots an expert
    # tiny: without the forward's fp32 copy of the logits the step peaks at nll_loss's backward (found by the step
    # differential test)
    ("none", "eager", FP32 | {"b": 1, "s": 1, "h": 2, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 1,
                              "vocab_size": 2}, None),
    # tiny and tied: the peak at the final norm's weight * y backward, the tied weight's gradient waiting
    ("none", "eager", FP32 | PHI3 | {"b": 1, "s": 1, "h": 2, "a": 1, "num_query_groups": 1, "L": 1,
                                     "ffn_hidden_size": 1, "vocab_size": 2, "tie_embeddings": True}, None),
]


@pytest.mark.parametrize("layout, attention, changes, route", FP32_STEPS, ids=str)
def test_in_fp32_every_moment_happens_in_order_and_the_peak_is_memtrackers(one_thread, layout, attention, changes,
                                                                           route):
    _exact_step(make_config(LLAMA, attention=attention, **changes), layout, route)


# fp32 under gradient checkpointing: each norm's x.to(float32) is x itself (the checkpoint's input, the rerun's residual
# stream, a projection's output), which the rerun keeps to the norm's backward; its cast back is x * rstd, the router's
# casts and Qwen's cast of the top-k weights are no-ops
FP32_RECOMPUTE_STEPS = [
    ("none", "eager", {}, None),  # the last layer's down_proj GEMMs
    ("none", "flash", {"b": 1, "s": 7, "a": 12, "h": 96, "num_query_groups": 4, "vocab_size": 40}, None),
    ("none", "eager", {"s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}, None),  # the softmax
    ("none", "eager", ODD | {"b": 3, "s": 17, "num_query_groups": 2}, None),  # a/g = 3
    ("tp", "eager", {"t": 2, "b": 1, "s": 9, "a": 12, "h": 96, "num_query_groups": 4}, None),
    ("none", "eager", {"dropout": 0.1, "b": 1, "s": 7, "tie_embeddings": True}, None),
    ("none", "flash", QWEN3 | {"b": 1, "s": 7, "kv_channels": 12, "num_query_groups": 4}, None),  # q_norm's, k_norm's x
    ("none", "flash", QWEN2 | {"b": 1, "s": 9}, None),
    ("none", "eager", GEMMA | {"b": 1, "s": 7}, None),  # weight.float() is the weight, type_as(x) the product
    ("none", "eager", GEMMA2 | CAPPED | {"b": 1, "s": 7, "sliding_window": 3}, None),  # the sandwich norms' inputs
    ("none", "eager", MIXTRAL, "balanced"),  # the eager loop
    ("none", "flash", GROUPED | {"b": 1, "s": 7}, "balanced"),
    ("none", "flash", QWEN2_MOE_GROUPED | {"moe_shared_expert_intermediate_size": 40, "b": 1, "s": 10}, "balanced"),
    ("none", "eager", QWEN3_MOE | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 3, "num_experts": 3,
                                   "moe_router_topk": 1, "moe_ffn_hidden_size": 24}, "balanced"),
    # Phi-3's post_attention_layernorm: y, dY and weight * y's two products (found by the step differential)
    *(("none", "eager", PHI3 | {"L": 1, "h": 4 * a, "a": a, "num_query_groups": g, "ffn_hidden_size": 1,
                                "vocab_size": 2} | bs, None)
      for a, g, bs in ((1, 1, {"b": 3, "s": 3}), (1, 1, {"b": 1, "s": 5}), (3, 1, {"b": 3, "s": 7}),
                       (2, 2, {"b": 1, "s": 9}))),
]


@pytest.mark.parametrize("layout, attention, changes, route", FP32_RECOMPUTE_STEPS, ids=str)
def test_in_fp32_under_gradient_checkpointing_the_rerun_keeps_each_norms_input_itself_to_the_byte(
        one_thread, layout, attention, changes, route):
    _exact_step(make_config(LLAMA, attention=attention, recompute="full", **FP32, **changes), layout, route)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("layout, changes, route", SDPA_DROPOUT_STEPS, ids=str)
def test_in_fp32_sdpas_math_kernel_casts_nothing_and_the_step_is_memtrackers(one_thread, layout, changes, route,
                                                                            recompute):
    """q's, k's and v's casts, the dropped-out weights' and the output's are no-ops: bmm's output is the kernel's,
    and without a repeat or a copy the kept v is v itself (the layer's input is the first norm's too: found by the
    step differential)."""
    _exact_step(make_config(LLAMA, attention="flash", dropout=0.1, recompute=recompute, **FP32, **changes), layout,
                route)


@pytest.mark.parametrize("changes, named", [
    ({"zero_stage": 3, "dp": 2}, "dtype fp32 with zero_stage=3"),
])
def test_in_fp32_what_the_walk_does_not_alias_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(LLAMA, **FP32, **changes), STRATEGIES["none"], CPU)
