"""One whole training step of memcalc's GPT whose attention is megatron-core's own MLASelfAttention (`--impl megatron`
with kv_lora_rank) under torch's MemTracker, against the step timeline (memcalc.sizing.timeline.megatron_mla): the
peak, each category at it and the state between steps to the byte, and every moment the timeline names is
MemTracker's reading after some op, in order (in backward at the module MemTracker names); with and without a query
latent, at b = 1 and odd s, with the fused softmax, torch's (fp32 too) and dropout, without recomputation, under
selective recomputation (megatron's core-attention checkpoint) and under full (the layer's), at t = 1 and as rank 0
of t under tp and tp-sp (fake group)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.megatron_step import inside_megatron, warmed_up  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from ..step_readings import assert_moments_in_order, readings_after_every_op  # noqa: E402

# DeepSeek-V3's layer, small: latents r_q = 16, r_kv = 24; heads of d_n + d_r = 12 + 8, values of d_v = 10 (a*d_v =
# 80, not h = 64); b*a = 16 and s = 24: the fused causal softmax runs.
MLA = dict(b=2, s=24, h=64, a=8, L=2, vocab_size=250, kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8,
           qk_nope_head_dim=12, v_head_dim=10, norm="rmsnorm", dropout=0.0, mlp="swiglu", ffn_hidden_size=176,
           position_embedding_type="rope", add_bias_linear=False, tie_embeddings=False)
NO_QUERY_LATENT = {"q_lora_rank": None}  # DeepSeek-V2-Lite: q_proj on x

CASES = {
    "the fused softmax, a query latent": ({}, "none"),
    "b = 1, odd s: torch's softmax keeps the causal mask": ({"b": 1, "s": 7}, "none"),
    "no query latent: q_proj runs where q_up_proj would": (NO_QUERY_LATENT, "none"),
    "no query latent, layernorm, an fp32 softmax at b = 1, odd s": (
        NO_QUERY_LATENT | {"b": 1, "s": 7, "norm": "layernorm", "attention_softmax_in_fp32": True}, "none"),
    "dropout, twelve heads": ({"s": 20, "a": 12, "h": 96, "dropout": 0.1}, "none"),
    "tp: the down projections' columns split back, x's gradients summed before dW is handed over": ({"t": 2}, "tp"),
    "tp at b = 1, odd s, dropout": ({"t": 2, "b": 1, "s": 7, "dropout": 0.1}, "tp"),
    "tp t = 4, no query latent, layernorm": (NO_QUERY_LATENT | {"t": 4, "norm": "layernorm"}, "tp"),
    "tp-sp: dX reduce-scattered, the latents' dY gathered along s": ({"t": 2}, "tp-sp"),
    "tp-sp t = 4 at b = 1, dropout": ({"t": 4, "b": 1, "s": 28, "dropout": 0.1}, "tp-sp"),
    "tp-sp, no query latent, an fp32 torch softmax": (
        NO_QUERY_LATENT | {"t": 2, "s": 16, "norm": "layernorm", "attention_softmax_in_fp32": True}, "tp-sp"),
    "selective: the core rerun, dQ, dK, dV copied into the checkpoint's inputs' layout": (
        {"recompute": "selective"}, "none"),
    "selective tp-sp with dropout: the bmm's node returns before dV's copy": (
        {"recompute": "selective", "t": 2, "dropout": 0.1}, "tp-sp"),
    "selective tp at b = 1, odd s, an fp32 torch softmax, no query latent": (
        NO_QUERY_LATENT | {"recompute": "selective", "t": 2, "b": 1, "s": 7, "attention_softmax_in_fp32": True}, "tp"),
    "full: the layer rerun in backward, the fused softmax's scale made by the rerun alone": (
        {"recompute": "full"}, "none"),
    "full at b = 1, odd s, no query latent, layernorm, an fp32 torch softmax": (
        NO_QUERY_LATENT | {"recompute": "full", "b": 1, "s": 7, "norm": "layernorm", "attention_softmax_in_fp32": True},
        "none"),
    "full, dropout, twelve heads": ({"recompute": "full", "s": 20, "a": 12, "h": 96, "dropout": 0.1}, "none"),
    "full tp at b = 1, odd s, dropout": ({"recompute": "full", "t": 2, "b": 1, "s": 7, "dropout": 0.1}, "tp"),
    "full tp-sp t = 4 at b = 1, dropout": ({"recompute": "full", "t": 4, "b": 1, "s": 28, "dropout": 0.1}, "tp-sp"),
    "full tp-sp, no query latent, an fp32 torch softmax": (
        NO_QUERY_LATENT | {"recompute": "full", "t": 2, "s": 16, "norm": "layernorm",
                           "attention_softmax_in_fp32": True}, "tp-sp"),
}
# fp32, as Megatron trains it without master weights: torch's softmax (the fused kernel takes 16-bit scores only)
CASES |= {
    "fp32 at b = 1, odd s": ({"dtype": "fp32", "b": 1, "s": 7}, "none"),
    "fp32 in the fused softmax's window: torch's softmax keeps the causal mask": ({"dtype": "fp32"}, "none"),
    "fp32 tp-sp, no query latent, dropout": (NO_QUERY_LATENT | {"dtype": "fp32", "t": 2, "s": 14, "b": 1,
                                                                "dropout": 0.1}, "tp-sp"),
    "fp32 selective tp": ({"dtype": "fp32", "recompute": "selective", "t": 2, "b": 1, "s": 7}, "tp"),
    "fp32 full": ({"dtype": "fp32", "recompute": "full", "b": 1, "s": 9}, "none"),
}


def _readings(tp, config, strategy):
    with inside_megatron(tp, config, None):
        return readings_after_every_op(warmed_up(tp, config, strategy))


@pytest.mark.parametrize("case", list(CASES))
def test_every_moment_the_timeline_names_happens_in_order_with_its_bytes(case):
    changes, layout = CASES[case]
    config, strategy = build_config(MLA | changes), STRATEGIES[layout]
    if strategy.tensor_parallel:
        readings = run_fake(_readings, (config, strategy), config.t)
    else:
        readings = _readings(single(), config, strategy)
    moments = timeline(config, strategy, Accounting(exact=True, device="cpu")).moments[1:]
    assert_moments_in_order(moments, readings, places=("backward",))  # a forward moment names a layer, not its op


@pytest.mark.parametrize("changes, layout", [
    ({"s": 128, "h": 32, "vocab_size": 64}, "none"),  # the peak in the last layer's attention core: (s, s) gradients
    ({"b": 1, "s": 7}, "none"),  # in the last layer's fc1
    ({"t": 2, "b": 1, "h": 256}, "tp-sp"),  # megatron's global buffer sized by the linears' gathered x, not the scores
    ({"recompute": "selective", "s": 128, "h": 32, "vocab_size": 64}, "none"),  # in the rerun core's backward
    ({"recompute": "full", "s": 128, "h": 32, "vocab_size": 64}, "none"),  # in the rerun layer's core
    ({"recompute": "full", "t": 2, "b": 1, "h": 256}, "tp-sp"),  # in the last layer's fc1, after its rerun
], ids=str)
def test_the_peak_each_category_at_it_and_the_steady_state_are_memtrackers_to_the_byte(changes, layout):
    (r,) = measure_step(build_config(MLA | changes), [layout])
    assert r.matches, r.differences()
    assert r.rows("peak")[-1].difference == 0 and r.rows("steady")[-1].difference == 0


def test_torchs_softmax_masks_a_view_of_the_scores_and_its_backward_peaks_with_four_of_them_live():
    """DotProductAttention's unfused softmax masks a view of baddbmm's output in place: backward puts dY into zeros of
    the scores' shape (the view's node), then CopySlices copies it into a new gradient and runs masked_fill's backward
    on a clone of the slice: four (b, a, s, s) tensors at once (found by the step differential at b = 1, s = 15, one
    layer under selective recomputation: 48 B above the forward loss, where the walk had put the peak)."""
    config = build_config(dict(b=1, s=15, h=10, a=5, L=1, vocab_size=2, kv_lora_rank=12, qk_rope_head_dim=4,
                               qk_nope_head_dim=6, v_head_dim=5, norm="layernorm", dropout=0.0, mlp="swiglu",
                               ffn_hidden_size=1, add_bias_linear=False, recompute="selective"))
    (r,) = measure_step(config, ["none"])
    assert r.measured.moment == r.predicted_moment == "backward layers.0.attention"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
