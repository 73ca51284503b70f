"""One whole training step of torchtitan's own Qwen3 (`--impl torchtitan` with qk_layernorm: q_norm and k_norm on each
head of kv_channels, CosSinRoPE; with experts its Qwen3 MoE layers) under torch's MemTracker, against the step
timeline (memcalc.sizing.timeline.torchtitan): the peak, each category at it and the state between steps to the byte,
at the moment the timeline names, and every moment it names among MemTracker's readings, in order, in its module. At
b = 1 and 2, odd s, one K/V head, half as many as query heads and as many, t = 1 and 2 under its TP plan with and
without its sequence-parallel norms, without recomputation and under FullAC and SelectiveAC, bf16 and fp32, with
experts at ep = 1 and 2, as CUDA runs it, under FSDP2 and pipelined."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config  # noqa: E402

from ..step_readings import assert_step_exact, assert_step_exact_moment_by_moment  # noqa: E402

CPU = Accounting(exact=True, device="cpu")
QWEN3 = {"qk_layernorm": True, "kv_channels": 12}  # its Qwen3 attention: 8 heads of 12 channels, not h/a = 8
WIDE = {"vocab_size": 16, "ffn_hidden_size": 16, "a": 16, "kv_channels": 32, "b": 1, "s": 33}  # heads dwarf the rest

# n_kv = n_q / 4, n_q and 1 at t = 1; n_q / 4, n_q / 2 and n_q at t = 2; b = 1 and 2, odd s (but under SP, s/t)
CASES = [
    ({"b": 1, "s": 13}, "none"),
    ({"b": 2, "s": 9, "num_query_groups": 8}, "none"),
    ({"b": 2, "s": 11, "num_query_groups": 1}, "none"),
    (WIDE | {"num_query_groups": 8}, "none"),  # forward: RoPE's rotate_half(q) * sin
    ({"t": 2, "b": 1, "s": 13}, "tp"),
    ({"t": 2, "b": 2, "s": 10, "num_query_groups": 4}, "tp-sp"),
    ({"t": 2, "b": 1, "s": 14, "num_query_groups": 8}, "tp-sp"),
    (WIDE | {"t": 2, "num_query_groups": 16}, "tp"),  # forward: RoPE's rotate_half(k) * sin, on this rank's heads
]
FP32 = [
    ({"b": 1, "s": 13}, "none"),
    (WIDE | {"num_query_groups": 16}, "none"),  # backward: k_norm's pow's backward
    ({"t": 2, "b": 2, "s": 9, "num_query_groups": 4}, "tp"),
    ({"t": 2, "b": 1, "s": 10}, "tp-sp"),
]
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_tokens": "balanced"}
MOE_CASES = [
    ({"b": 1, "s": 7}, "none", "balanced"),
    ({"b": 2, "s": 9, "moe_shared_expert_intermediate_size": 48}, "none", "all-to-one"),
    ({"t": 2, "b": 1, "s": 7}, "tp", "balanced"),
    ({"t": 2, "b": 2, "s": 10}, "tp-sp", "all-to-one"),
    ({"t": 2, "ep": 2, "b": 2, "s": 10}, "tp-sp", "balanced"),
    ({"t": 2, "ep": 2, "b": 1, "s": 6, "moe_tokens": "worst", "moe_shared_expert_intermediate_size": 48}, "tp-sp",
     "all-to-one"),
]


def _assert_exact(config, strategy, route=None):
    assert_step_exact_moment_by_moment(config, strategy, "torchtitan's Qwen3Model", route)


def test_the_chosen_sizes_put_the_peak_in_its_qwen3_attention_too():
    """What gives the tests below their meaning: the peak in RoPE's forward and in k_norm's backward as well as where
    a Llama3 step puts it."""
    moments = {timeline(make_config(LLAMA3, **(QWEN3 | c), dtype=d), STRATEGIES[st], CPU).peak.label()
               for cases, d in ((CASES, "bf16"), (FP32, "fp32")) for c, st in cases}
    assert {"forward layers.1.attention.rope (rotate_half(q) * sin)", "forward layers.1.attention.rope"
            " (rotate_half(k) * sin)", "backward layers.1.attention.k_norm (pow's backward: dpow * 2x)"} <= moments


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", CASES, ids=str)
def test_its_qwen3_step_is_memtrackers_moment_by_moment_and_at_the_peak(one_thread, changes, strategy, recompute):
    """The head norms over (b*s*heads, d) rows, k_norm's dY held by ModTracker's hook on RoPE's inputs until q_norm's
    node starts, SDPA's dQ and dK until v's node in the split, CosSinRoPE's fp32 rotate_half; under a checkpoint
    the rerun's."""
    _assert_exact(make_config(LLAMA3, **(QWEN3 | changes), recompute=recompute), strategy)


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", FP32, ids=str)
def test_in_fp32_its_qwen3_step_is_memtrackers(one_thread, changes, strategy, recompute):
    """The head norms keep the split's q and k themselves (their x.to(float32) a no-op) until pow's backward; under a
    checkpoint they go as each norm returns (the attention rebinds q and k)."""
    _assert_exact(make_config(LLAMA3, **(QWEN3 | changes), dtype="fp32", recompute=recompute), strategy)


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy, route", MOE_CASES, ids=str)
def test_with_experts_its_qwen3_moe_step_is_memtrackers(one_thread, changes, strategy, route, recompute):
    """Its Qwen3 MoE layers behind the same attention: at ep = 1 at t = 1 and 2, at ep = t = 2 over its TP ranks."""
    _assert_exact(make_config(LLAMA3, **(QWEN3 | MOE | changes), recompute=recompute), strategy, route)


@pytest.mark.parametrize("changes, strategy, route", [
    ({"loss_chunks": 4}, "none", None),
    (MOE | {"t": 2, "s": 10, "loss_chunks": 5}, "tp-sp", "all-to-one"),
    (MOE | {"t": 2, "ep": 2, "b": 1, "s": 6, "loss_chunks": 3, "recompute": "op"}, "tp-sp", "balanced"),
], ids=str)
def test_under_the_chunked_loss_its_qwen3_step_is_memtrackers(one_thread, changes, strategy, route):
    """Its model's end is Llama3's: the chunked loss's walk is the one."""
    _assert_exact(make_config(LLAMA3, **(QWEN3 | changes)), strategy, route)


@pytest.mark.parametrize("changes, strategy, route", [
    ({"b": 1, "s": 13}, "none", None),  # as CUDA runs it: the fused head norms keep q and k, RoPE's gathered table
    ({"t": 2, "b": 2, "s": 10, "recompute": "full"}, "tp-sp", None),
    (MOE | {"b": 1, "s": 7, "recompute": "op"}, "none", "balanced"),
], ids=str)
def test_as_cuda_runs_it_its_qwen3_step_reaches_the_peak_to_the_byte(one_thread, changes, strategy, route):
    (r,) = measure_step(make_config(LLAMA3, **(QWEN3 | changes)), [strategy], route=route, device="cuda")
    assert_step_exact(r)


@pytest.mark.parametrize("changes, strategy", [
    ({"dp_shard": 2, "b": 1, "s": 13}, "none"),  # FSDP2: the peak in RoPE's backward
    ({"dp_shard": 2, "t": 2, "b": 2, "s": 10}, "tp-sp"),
    ({"pp": 2, "num_microbatches": 2, "b": 2, "s": 9}, "none"),  # each stage's
    ({"pp": 2, "num_microbatches": 2, "t": 2, "b": 1, "s": 10}, "tp-sp"),
], ids=str)
def test_sharded_and_pipelined_its_qwen3_step_reaches_the_peak_to_the_byte(one_thread, changes, strategy):
    for r in measure_step(make_config(LLAMA3, **(QWEN3 | changes)), [strategy]):
        assert_step_exact(r)
