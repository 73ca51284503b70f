"""One whole training step of transformers' own LlamaForCausalLM (`--impl hf`) under torch's MemTracker, against
the hf step timeline: the peak, each category at it and the state between steps to the byte, with eager and SDPA
attention; MemTracker reaches its peak at the moment the timeline names, for sizes that put the peak in six
different places; and every moment the timeline names is MemTracker's reading after some op, in order."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.libs.hf_step import warmed_up  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import ACTIVATIONS, timeline  # noqa: E402

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


@pytest.fixture(scope="module")
def measured(one_thread):
    return {attention: measure_step(_config(attention), ["none"])[0] for attention in ATTENTIONS}


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_the_peak_and_every_category_at_it_are_memtrackers_to_the_byte(measured, attention):
    r = measured[attention]
    assert [row.difference for row in r.rows("peak")] == [0] * 6, r.rows("peak")
    assert r.matches and r.measured.peak_bytes == r.predicted.peak.bytes


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_between_steps_memtracker_sees_the_model_states_the_timeline_predicts(measured, attention):
    r = measured[attention]
    assert [row.difference for row in r.rows("steady")] == [0] * 6, r.rows("steady")
    assert r.measured.steady.get(ACTIVATIONS, 0) == 0  # the batch is loaded inside the step


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_memtracker_peaks_at_the_moment_the_timeline_names(measured, attention):
    r = measured[attention]
    assert r.measured.moment == r.predicted_moment
    assert r.model == "transformers' LlamaForCausalLM"


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
], ids=str)
def test_every_moment_the_timeline_names_happens_in_order_in_its_module_with_its_bytes(one_thread, attention, changes):
    """Not only the peak: each moment is MemTracker's reading after some op, in the named module, in order."""
    config = _config(attention, **changes)
    readings = readings_after_every_op(warmed_up(single(), config, STRATEGIES["none"]))
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], readings)
