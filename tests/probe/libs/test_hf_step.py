"""One whole training step of transformers' own LlamaForCausalLM (`--impl hf`) under torch's MemTracker, against
the hf step timeline: the peak, each category at it and the state between steps to the byte, with eager and SDPA
attention, at t = 1 and under transformers' own tp_plan (rank 0 of t = 2 through the fake group); MemTracker reaches
its peak at the moment the timeline names, for sizes that put the peak in six different places (five under tp); and
every moment the timeline names is MemTracker's reading after some op, in order."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.hf_step import warmed_up  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import ACTIVATIONS, PARAMETERS, TEMPORARIES, timeline  # noqa: E402

from ..step_readings import assert_moments_in_order, readings_after_every_op  # noqa: E402

# Llama-style: SwiGLU (f = 176), RMSNorm, two K/V groups for eight heads, RoPE, no biases, no dropout, untied.
LLAMA = dict(
    impl="hf", b=2, s=24, h=64, a=8, L=2, vocab_size=250, mlp="swiglu", ffn_hidden_size=176, norm="rmsnorm",
    num_query_groups=2, position_embedding_type="rope", add_bias_linear=False, dropout=0.0, tie_embeddings=False,
)
ATTENTIONS = ["eager", "flash"]  # transformers' attn_implementation "eager" and "sdpa"
CPU = Accounting(exact=True, device="cpu")


def _config(attention, **changes):
    return build_config(LLAMA | {"attention": attention} | changes)


LAYOUTS = ["none", "tp"]  # transformers runs no sequence parallelism (memcalc.model.impls.hf.NO_SEQUENCE_PARALLEL)


@pytest.fixture(scope="module")
def measured(one_thread):
    return {(attention, r.strategy.name): r for attention in ATTENTIONS
            for r in measure_step(_config(attention, t=2), LAYOUTS)}


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
    moments = {timeline(_config(a, **c), STRATEGIES["none"], CPU).peak.label() for a, c in MOMENTS}
    assert len(moments) == len(MOMENTS), moments


@pytest.mark.parametrize("attention, changes", MOMENTS[1:], ids=str)
def test_wherever_the_peak_is_memtracker_reaches_it_there_to_the_byte(one_thread, attention, changes):
    (r,) = measure_step(_config(attention, **changes), ["none"])
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
    config = _config(attention, **changes)
    readings = readings_after_every_op(warmed_up(single(), config, STRATEGIES["none"]))
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
    moments = {timeline(_config(a, t=2, **c), STRATEGIES["tp"], CPU).peak.label() for a, c in TP_MOMENTS}
    assert len(moments) == len(TP_MOMENTS), moments


@pytest.mark.parametrize("attention, changes", TP_MOMENTS[1:], ids=str)
def test_under_tp_wherever_the_peak_is_memtracker_reaches_it_there_to_the_byte(one_thread, attention, changes):
    (r,) = measure_step(_config(attention, t=2, **changes), ["tp"])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("attention, changes", [
    ("eager", {"t": 2}), ("flash", {"t": 2}),
    ("eager", {"t": 4, "num_query_groups": 4, "vocab_size": 252}),  # one K/V group per rank: no k, v copies
    ("flash", {"t": 4, "num_query_groups": 8, "vocab_size": 252, "dtype": "fp16"}),
    ("eager", {"t": 2, "b": 1, "L": 3}),  # b = 1, one K/V group per rank: matmul keeps K and V unexpanded
], ids=str)
def test_under_tp_every_moment_the_timeline_names_happens_in_order(one_thread, attention, changes):
    """The all-gathered logits and their gradient's columns, each colwise dX's all-reduce, the embedding's rows."""
    config = _config(attention, **changes)
    readings = run_fake(lambda tp: readings_after_every_op(warmed_up(tp, config, STRATEGIES["tp"])), (), config.t)
    assert_moments_in_order(timeline(config, STRATEGIES["tp"], CPU).moments[1:], readings)


@pytest.mark.parametrize("changes, named", [
    ({"tie_embeddings": True}, "tied embeddings under tp"),
    ({"t": 4, "num_query_groups": 4}, "vocab_size=250 that t=4 does not divide"),
])
def test_under_tp_what_the_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        timeline(_config("eager", **({"t": 2} | changes)), STRATEGIES["tp"], CPU)
