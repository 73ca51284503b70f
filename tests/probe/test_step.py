"""One whole training step of memcalc's own GPT under torch's MemTracker, against the step timeline: the peak,
each category at the peak and the state between steps within 1% (issue 8's bound; today to the byte), for
three layouts and for variants of the model; and MemTracker reaches its peak at the moment the timeline names,
for sizes that put the peak in five different places."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.step import TOLERANCE, CategoryRow, Trainer, _fake_world, _in_words, measure_step  # noqa: E402
from memcalc.sizing.timeline import ACTIVATIONS, timeline  # noqa: E402

from .step_readings import assert_moments_in_order, readings_after_every_op  # noqa: E402

# b*a/t = 8 and 16 < s <= 128 with s a multiple of 4: Megatron's fused softmax runs.
STEP = dict(b=2, s=24, h=64, a=8, t=2, L=2, vocab_size=250)
# Llama-style: SwiGLU (f = 176), RMSNorm, two K/V groups, RoPE, no biases, no dropout, an untied output layer.
LLAMA = STEP | dict(
    mlp="swiglu", ffn_hidden_size=176, norm="rmsnorm", num_query_groups=2, position_embedding_type="rope",
    add_bias_linear=False, dropout=0.0, tie_embeddings=False,
)
MODELS = {"gpt": STEP, "llama": LLAMA}
LAYOUTS = ["none", "tp", "tp-sp"]
CASES = [(m, s) for m in MODELS for s in LAYOUTS]


@pytest.fixture(scope="module")
def measured():
    return {(m, r.strategy.name): r for m, c in MODELS.items() for r in measure_step(build_config(c), LAYOUTS)}


@pytest.mark.parametrize("model, strategy", CASES)
def test_the_peak_and_every_category_at_it_are_within_one_percent_of_memtracker(measured, model, strategy):
    r = measured[model, strategy]
    for row in r.rows("peak"):
        assert row.within, (strategy, row)
    assert r.measured.peak_bytes == r.rows("peak")[-1].measured


@pytest.mark.parametrize("model, strategy", CASES)
def test_between_steps_memtracker_sees_the_model_states_the_timeline_predicts(measured, model, strategy):
    r = measured[model, strategy]
    for row in r.rows("steady"):
        assert row.within, (strategy, row)
    assert r.measured.steady.get(ACTIVATIONS, 0) == 0  # the batch is loaded inside the step


@pytest.mark.parametrize("model, strategy", CASES)
def test_memtracker_peaks_at_the_moment_the_timeline_names(measured, model, strategy):
    r = measured[model, strategy]
    assert r.measured.moment == r.predicted_moment


# Sizes that move the peak: each entry's peak is somewhere no other entry's is.
MOMENTS = [
    ({}, "tp-sp"),  # the last layer's fc2 GEMMs
    ({"vocab_size": 2000}, "none"),  # the loss: bf16 and fp32 logits at once
    ({"s": 128, "h": 32, "vocab_size": 64}, "none"),  # the last layer's attention: (s, s) gradients
    ({"b": 1, "a": 16, "s": 20, "vocab_size": 5000}, "tp-sp"),  # the tied embedding's two gradients summed
    ({"b": 1, "a": 16, "s": 20, "vocab_size": 5000, "tie_embeddings": False}, "tp"),  # the output layer's GEMMs
]


def test_the_chosen_sizes_put_the_peak_in_five_different_places():
    """What gives the next test its meaning: no two cases share a predicted moment."""
    cpu = Accounting(exact=True, device="cpu")
    moments = {timeline(build_config(STEP | c), STRATEGIES[s], cpu).peak.where for c, s in MOMENTS}
    assert len(moments) == len(MOMENTS), moments


@pytest.mark.parametrize("changes, strategy", MOMENTS[1:], ids=lambda x: str(x))
def test_wherever_the_peak_is_memtracker_reaches_it_there_and_agrees_on_the_bytes(changes, strategy):
    (r,) = measure_step(build_config(STEP | changes), [strategy])
    assert r.measured.moment == r.predicted_moment
    assert r.matches, r.differences()


@pytest.mark.parametrize("changes, strategy", [
    ({"dropout": 0.0, "add_bias_linear": False}, "tp"),  # no masks; weights x V keeps the softmax output itself
    ({"s": 16}, "tp-sp"),  # outside the fused softmax kernel's sizes: Megatron's fp32 torch softmax
    ({"position_embedding_type": "rope", "dtype": "fp16", "L": 3}, "tp"),  # no position table
    ({"mlp": "swiglu", "bias_activation_fusion": True}, "tp-sp"),  # the fused SwiGLU: one 2f-wide gradient
    ({"mlp": "swiglu", "num_query_groups": 4, "norm": "rmsnorm"}, "tp"),  # unfused SwiGLU, GQA, RMSNorm
    ({"attention": "flash", "num_query_groups": 2}, "tp-sp"),  # the flash kernel keeps the projection's input
    ({"attention": "flash", "recompute": "selective", "s": 128, "vocab_size": 64}, "tp"),  # the kernel rerun
    ({"recompute": "selective"}, "tp-sp"),  # the eager core rerun inside backward, beside its checkpoint's inputs
    ({"recompute": "selective", "num_query_groups": 2, "s": 16}, "tp"),  # K/V expanded again, fp32 softmax
    ({"recompute": "full"}, "tp-sp"),  # each layer rerun: its tensors again, its input and dY held by the checkpoint
    ({"recompute": "full", "dropout": 0.0, "mlp": "swiglu", "norm": "rmsnorm", "num_query_groups": 2}, "none"),
    ({"recompute": "full", "attention": "flash", "mlp": "swiglu", "bias_activation_fusion": True}, "tp"),
], ids=lambda x: str(x))
def test_variants_of_the_model_agree_within_one_percent(changes, strategy):
    (r,) = measure_step(build_config(STEP | changes), [strategy])
    assert r.matches, r.differences()


def _bytes_after_every_op(tp, config, strategy):
    """Where and bytes per category after each op of one step of memcalc's GPT on this rank."""
    return readings_after_every_op(Trainer.warmed_up(tp, config, strategy))


def _assert_every_moment_in_order(config, strategy):
    """Not only the peak: each moment's bytes per category are MemTracker's after some op, in the timeline's order."""
    st = STRATEGIES[strategy]
    if st.tensor_parallel:
        readings = run_fake(_bytes_after_every_op, (config, st), config.t)
    else:
        readings = _bytes_after_every_op(single(), config, st)
    moments = timeline(config, st, Accounting(exact=True, device="cpu")).moments[1:]
    assert_moments_in_order(moments, readings, places=())  # a forward moment names a block, not its last op's module


@pytest.mark.parametrize("model, strategy", CASES)
def test_every_moment_the_timeline_names_happens_in_order_with_its_bytes(model, strategy):
    _assert_every_moment_in_order(build_config(MODELS[model]), strategy)


# Shapes at the edges: one token per sequence, odd s, b = 1, three query heads per K/V group, the fp32 softmax.
ODD = dict(b=1, s=7, a=12, h=96, num_query_groups=4, attention_softmax_in_fp32=True)


@pytest.mark.parametrize("changes, strategy", [
    ({"b": 1, "s": 1, "attention_softmax_in_fp32": True}, "tp"),  # one query: megatron masks nothing
    ({"s": 1, "dropout": 0.0}, "none"),  # b = 2, s = 1: the labels made sequence-first are contiguous, no copy
    (ODD, "tp"),  # odd s outside the fused softmax's window, fp32 softmax, K and V copied to three heads each
    (ODD | {"recompute": "selective", "mlp": "swiglu", "ffn_hidden_size": 176}, "tp"),
    ({"s": 1, "recompute": "full", "attention_softmax_in_fp32": True, "num_query_groups": 2, "dropout": 0.0}, "tp"),
    # full recomputation's rerun of the eager core: at the fp32 softmax's cast, the dropout and the projection's input
    (ODD | {"recompute": "full", "dropout": 0.1}, "tp"),  # K and V, expanded, held by the attention
    (ODD | {"recompute": "full", "dropout": 0.1, "num_query_groups": 12, "b": 3, "s": 9}, "none"),
    ({"recompute": "full", "dropout": 0.1, "s": 10, "num_query_groups": 2}, "tp-sp"),  # the 16-bit softmax
], ids=lambda x: str(x))
def test_at_odd_shapes_every_moment_happens_in_order_with_its_bytes(changes, strategy):
    _assert_every_moment_in_order(build_config(STEP | changes), strategy)


# Heads of kv_channels (h/a = 8 here: 4, 12 and 20 wide) and megatron-core's QK norms, at odd shapes, with one, two
# and every query head per K/V group (a/g = 1, 2, 8), eager and flash, each recomputation, t = 1, 2 and 4.
QK = dict(qk_layernorm=True, b=1, s=7)


@pytest.mark.parametrize("changes, strategy", [
    ({"kv_channels": 12, "num_query_groups": 4, "attention_softmax_in_fp32": True}, "tp"),  # no QK norm
    (QK | {"kv_channels": 12}, "tp"),  # multi-head: the norms' inputs, Q and K, V apart
    (QK | {"kv_channels": 20, "num_query_groups": 1, "norm": "rmsnorm", "t": 1}, "none"),  # one K/V group, 8 heads
    (QK | {"kv_channels": 4, "num_query_groups": 8, "s": 10, "norm": "rmsnorm", "mlp": "swiglu"}, "tp-sp"),  # a/g = 1
    (QK | {"kv_channels": 12, "num_query_groups": 4}, "tp"),  # the key norm's input holds V and the query columns
    (QK | {"kv_channels": 12, "num_query_groups": 4, "t": 4, "s": 12}, "tp-sp"),  # g/t = 1: V, no query columns
    (QK | {"kv_channels": 20, "num_query_groups": 2, "attention": "flash", "s": 10}, "tp-sp"),
    (QK | {"kv_channels": 4, "num_query_groups": 4, "recompute": "selective"}, "tp"),  # the core rerun, norms not
    (QK | {"kv_channels": 12, "num_query_groups": 8, "attention": "flash", "recompute": "selective"}, "tp"),
    (QK | {"kv_channels": 4, "num_query_groups": 4, "recompute": "full"}, "tp"),  # the norms rerun with the layer
    (QK | {"kv_channels": 20, "num_query_groups": 2, "recompute": "full", "attention": "flash", "s": 12,
           "norm": "rmsnorm", "dropout": 0.0}, "tp-sp"),
], ids=lambda x: str(x))
def test_with_heads_of_kv_channels_and_qk_norms_every_moment_happens_in_order_with_its_bytes(changes, strategy):
    _assert_every_moment_in_order(build_config(STEP | changes), strategy)


def test_with_wide_normed_heads_the_step_peaks_in_the_attention_to_the_byte():
    """Heads 8 times h/a wide, normed: the flash kernel's dQ, dK and dV beside the norms' inputs are the peak."""
    config = build_config(STEP | QK | {"s": 64, "h": 16, "vocab_size": 32, "ffn_hidden_size": 16, "kv_channels": 64,
                                       "num_query_groups": 8, "norm": "rmsnorm", "attention": "flash"})
    (r,) = measure_step(config, ["tp"])
    assert r.measured.moment == r.predicted_moment == "backward layers.1.attention"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def test_under_full_recomputation_with_a_narrow_mlp_the_step_peaks_at_the_reruns_fc2_to_the_byte():
    """fc2's forward in a layer's rerun holds its GEMM's share of the sum, f*'s all-reduced copy and the bias added
    to it at once: beside the output's gradient the checkpoint holds, two (s, b, h) more than the rerun's end (found by
    the step differential at b = 3, s = 7, h = 40, L = 2: 16 B above the tied embedding's summed gradients)."""
    config = build_config(dict(b=2, s=12, h=36, a=6, t=2, L=1, vocab_size=4, ffn_hidden_size=2, recompute="full",
                               dropout=0.0, position_embedding_type="rope"))
    (r,) = measure_step(config, ["tp"])
    assert r.measured.moment == r.predicted_moment == "backward layers.0.mlp.fc2"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def test_under_full_recomputation_rmsnorms_rerun_makes_no_fp32_temporaries_the_fused_kernel_does_not():
    """The probe's RMSNorm runs its forward as one op, as Apex's and Transformer Engine's kernel: its fp32 input copy
    and products are never seen (found by the step differential at b = 1, s = 14, h = 24, L = 2, ffn 2: op by op,
    the second layer's rerun peaked inside ln2, 130 B above the tied embedding's summed gradients)."""
    config = build_config(dict(b=1, s=14, h=24, a=6, num_query_groups=2, t=2, L=2, vocab_size=4, ffn_hidden_size=2,
                               norm="rmsnorm", recompute="full", add_bias_linear=False))
    (r,) = measure_step(config, ["tp"])
    assert r.measured.moment == r.predicted_moment == "backward embedding"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def test_a_category_off_by_more_than_one_percent_is_reported(measured):
    r = measured["gpt", "tp"]
    off = int(r.measured.peak[ACTIVATIONS] * (1 + 2 * TOLERANCE))
    wrong = replace(r, measured=replace(r.measured, peak=r.measured.peak | {ACTIVATIONS: off}))
    assert not wrong.matches
    assert any(d.startswith("peak activations") for d in wrong.differences())
    assert CategoryRow("x", 101, 100).within and not CategoryRow("x", 102, 100).within
    assert not CategoryRow("x", 1, 0).within


def test_megatrons_distributed_optimizer_is_refused_not_compared_with_one_ranks_whole_adamw():
    """A drawn step found it: at dp 2 the timeline sharded the optimizer's states that the probe's one rank keeps
    whole, a disagreement of half of them (exit 1) where --step runs no distributed optimizer at all."""
    config = build_config(STEP | dict(t=1, dp=2, distributed_optimizer=True))
    with pytest.raises(ConfigError, match=r"distributed optimizer \(its states sharded over dp\*cp=2\)"):
        measure_step(config, ["none"])


# fp32, as Megatron trains it without master weights (FP32Optimizer): fp32 weights and main_grad buffer, Adam's
# moments, no master copy; the output layer's logits are the loss's fp32 copy itself and their gradient its softmax.
FP32 = dict(dtype="fp32")


@pytest.mark.parametrize("changes, strategy", [
    (FP32, "tp-sp"),
    (FP32 | {"vocab_size": 2000}, "none"),  # the loss's peak: the logits are the softmax, no copy
    (FP32 | ODD, "tp"),  # b = 1, odd s, three query heads a K/V group
    (FP32 | ODD | {"recompute": "selective", "mlp": "swiglu", "ffn_hidden_size": 176, "t": 1}, "none"),
    (FP32 | {"recompute": "full", "b": 1, "s": 14, "num_query_groups": 2}, "tp-sp"),
    (FP32 | LLAMA | {"b": 1, "s": 9, "attention": "flash", "t": 4, "a": 12, "h": 96, "num_query_groups": 4}, "tp"),
], ids=lambda x: str(x))
def test_in_fp32_every_moment_happens_in_order_with_its_bytes(changes, strategy):
    _assert_every_moment_in_order(build_config(STEP | changes), strategy)


@pytest.mark.parametrize("changes, strategy, words", [
    ({}, "none", ""),  # one process alone: no fake world to name
    ({"t": 2}, "tp", "t=2"),
    ({"t": 2}, "none", ""),
    ({"impl": "hf", "dp_shard": 2}, "none", "dp_shard=2"),
    ({"impl": "hf", "zero_stage": 2, "dp": 3}, "none", "dp=3"),  # DeepSpeed's world is dp
    ({"impl": "hf", "t": 2, "dp_shard": 2, "dp_replicate": 3}, "tp", "dp_replicate*dp_shard*t=3*2*2=12"),
], ids=str)
def test_a_step_names_the_fake_world_it_runs_rank_zero_of_by_its_factors(changes, strategy, words):
    config = build_config(dict(name="w", b=1, s=4, h=16, a=2, L=1, vocab_size=8, **changes))
    assert _in_words(_fake_world(config, STRATEGIES[strategy])) == words
