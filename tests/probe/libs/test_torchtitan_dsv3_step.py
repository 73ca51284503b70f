"""One whole training step of torchtitan's own DeepSeekV3Model (`--impl torchtitan` with kv_lora_rank: its latent
attention, wq or wq_a, q_norm and wq_b, wkv_a, kv_norm, wkv_b, ComplexRoPE on the d_r-wide parts, SDPA, wo; with experts
its MoE layers after dense ones) under torch's MemTracker, against the step timeline
(memcalc.sizing.timeline.torchtitan_mla): the peak, each category at it and the state between steps to the byte, at
the moment the timeline names, and every moment it names among MemTracker's readings, in order, in its module. At b = 1
and 2, odd s, without and with a query latent, one head a rank and several, t = 1 and 2 under its TP plan with and
without its sequence-parallel norms, without recomputation and under FullAC and SelectiveAC, with its MoE (a sigmoid
router, shared experts) at ep = 1, as CUDA runs it, under FSDP2 and pipelined. Values are as wide as the heads
(d_v = d_n + d_r): the probe's CPU stand-in for flex attention takes one width (docs/timeline.md)."""

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
# a latent of 24, four heads of d_n + d_r = 8 + 4, values as wide; no K/V groups
DSV3 = {"num_query_groups": None, "a": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 12}
Q_LATENT = {"q_lora_rank": 16}
WIDE = {"vocab_size": 16, "ffn_hidden_size": 16, "a": 16, "kv_lora_rank": 64, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "b": 1}  # heads dwarf the rest
LATENTS = {"vocab_size": 16, "ffn_hidden_size": 16, "kv_lora_rank": 512, "b": 1, "s": 33}  # the latents dwarf the rest

CASES = [
    ({"b": 1, "s": 7}, "none"),
    (Q_LATENT | {"b": 2, "s": 9}, "none"),
    (WIDE | {"s": 33}, "none"),  # backward: SDPA's dQ, dK, dV
    (LATENTS, "none"),  # backward: kv_norm's pow's backward
    (LATENTS | {"kv_lora_rank": 64, "q_lora_rank": 512}, "none"),  # backward: q_norm's
    ({"t": 2, "b": 1, "s": 13}, "tp"),
    (Q_LATENT | {"t": 2, "b": 2, "s": 9, "a": 2}, "tp"),  # one head a rank: k_pe's expand a view in backward
    (Q_LATENT | {"t": 2, "b": 2, "s": 10}, "tp-sp"),
    (WIDE | Q_LATENT | {"t": 2, "s": 34}, "tp-sp"),
]
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_tokens": "balanced",
       "moe_first_dense_layers": 1, "moe_router_score_function": "sigmoid"}  # layer 0 dense, layer 1 MoE
MOE_CASES = [
    ({"b": 2, "s": 9, "moe_shared_expert_intermediate_size": 48}, "none", "balanced"),
    (Q_LATENT | {"t": 2, "b": 1, "s": 7}, "tp", "balanced"),
    ({"t": 2, "b": 2, "s": 10, "moe_shared_expert_intermediate_size": 48}, "tp-sp", "all-to-one"),
]


def _assert_exact(config, strategy, route=None):
    assert_step_exact_moment_by_moment(config, strategy, "torchtitan's DeepSeekV3Model", route)


def test_the_chosen_sizes_put_the_peak_in_its_latent_attention():
    """What gives the tests below their meaning: the peak in SDPA's backward and in each latent norm's."""
    moments = {timeline(make_config(LLAMA3, **(DSV3 | c)), STRATEGIES[st], CPU).peak.label() for c, st in CASES}
    assert {"backward layers.1.attention.inner_attention (SDPA's flash kernel's backward: dQ, dK, dV)",
            "backward layers.1.attention.kv_norm (pow's backward: dpow * 2x)",
            "backward layers.1.attention.q_norm (pow's backward: dpow * 2x)"} <= moments


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", CASES, ids=str)
def test_its_deepseek_v3_step_is_memtrackers_moment_by_moment_and_at_the_peak(one_thread, changes, strategy,
                                                                               recompute):
    """RoPE on views of wq's (wq_b's) and wkv_a's outputs; the latents whole on every rank; wkv_b's output kept as V;
    ModTracker's hooks holding dK and dV to the query's concatenation and RoPE's dK to the query's split; under a
    checkpoint the rerun's."""
    _assert_exact(make_config(LLAMA3, **(DSV3 | changes), recompute=recompute), strategy)


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy, route", MOE_CASES, ids=str)
def test_with_experts_its_deepseek_v3_moe_step_is_memtrackers(one_thread, changes, strategy, route, recompute):
    """A dense first layer, then its MoE behind the same attention (a sigmoid router, shared experts), at ep = 1."""
    _assert_exact(make_config(LLAMA3, **(DSV3 | MOE | changes), recompute=recompute), strategy, route)


@pytest.mark.parametrize("changes, strategy, route", [
    ({"b": 1, "s": 7}, "none", None),  # fused latent norms keep the down projections' outputs; the gathered table
    (Q_LATENT | {"t": 2, "b": 2, "s": 10, "recompute": "full"}, "tp-sp", None),
    (MOE | Q_LATENT | {"b": 1, "s": 7, "recompute": "op"}, "none", "balanced"),
], ids=str)
def test_as_cuda_runs_it_its_deepseek_v3_step_reaches_the_peak_to_the_byte(one_thread, changes, strategy, route):
    (r,) = measure_step(make_config(LLAMA3, **(DSV3 | changes)), [strategy], route=route, device="cuda")
    assert_step_exact(r)


@pytest.mark.parametrize("changes, strategy, route", [
    ({"dp_shard": 2, "b": 1, "s": 13}, "none", None),
    (Q_LATENT | {"dp_shard": 2, "t": 2, "b": 2, "s": 10}, "tp-sp", None),
    (MOE | {"dp_shard": 2, "b": 2, "s": 9, "moe_shared_expert_intermediate_size": 48}, "none", "balanced"),
    ({"pp": 2, "num_microbatches": 2, "b": 2, "s": 9}, "none", None),  # each stage's
    (Q_LATENT | {"pp": 2, "num_microbatches": 2, "t": 2, "b": 1, "s": 10}, "tp-sp", None),
    (MOE | {"moe_first_dense_layers": None, "pp": 2, "num_microbatches": 2, "b": 2, "s": 9}, "none", "balanced"),
], ids=str)
def test_sharded_and_pipelined_its_deepseek_v3_step_reaches_the_peak_to_the_byte(one_thread, changes, strategy, route):
    for r in measure_step(make_config(LLAMA3, **(DSV3 | changes)), [strategy], route=route):
        assert_step_exact(r)


# its first dense layers under pp, on the stages torchtitan's split puts them (the embedding and the output a layer
# each): the first stage's layers dense, or dense and MoE, the others MoE; b = 1 and 2, pp 2 and 3, FullAC and
# SelectiveAC, under tp-sp, FSDP2 and as CUDA runs it
PIPELINED_DENSE_FIRST = [
    ({"pp": 2, "num_microbatches": 2, "b": 2, "s": 9}, "none", "cpu"),  # layer 0 dense on the first, 1 MoE on the last
    ({"pp": 2, "L": 4, "b": 1, "s": 9, "moe_shared_expert_intermediate_size": 48, "recompute": "op"}, "none", "cpu"),
    ({"pp": 2, "L": 4, "moe_first_dense_layers": 2, "num_microbatches": 3, "b": 2, "s": 9, "recompute": "full"}, "none",
     "cpu"),  # the first stage's two layers both dense
    (Q_LATENT | {"pp": 3, "L": 4, "num_microbatches": 3, "b": 1, "s": 7}, "none", "cpu"),  # 1, 2 and 1 layers
    ({"pp": 3, "L": 4, "moe_first_dense_layers": 2, "b": 2, "s": 9}, "none", "cpu"),  # dense on the first two stages
    (Q_LATENT | {"pp": 2, "L": 3, "t": 2, "b": 2, "s": 10}, "tp-sp", "cpu"),
    ({"pp": 2, "L": 4, "dp_shard": 2, "b": 2, "s": 9}, "none", "cpu"),
    ({"pp": 2, "L": 4, "b": 1, "s": 7, "recompute": "op"}, "none", "cuda"),
]


@pytest.mark.parametrize("changes, strategy, device", PIPELINED_DENSE_FIRST, ids=str)
def test_pipelined_with_dense_first_layers_each_stage_reaches_the_peak_to_the_byte(one_thread, changes, strategy,
                                                                                   device):
    """Each stage's walk takes its own layers' kinds: a dense block's FeedForward where the split puts the first
    dense layers, the MoE elsewhere; its states and saved activations its own."""
    for r in measure_step(make_config(LLAMA3, **(DSV3 | MOE | changes)), [strategy], route="balanced", device=device):
        assert_step_exact(r)


@pytest.mark.parametrize("changes, strategy", [
    ({"t": 2, "b": 2, "s": 9, "moe_shared_expert_intermediate_size": 8}, "tp"),  # shared w1, w3 (h, 8/2): E = 4
    (Q_LATENT | {"t": 2, "b": 2, "s": 10, "moe_shared_expert_intermediate_size": 8}, "tp-sp"),
    ({"t": 2, "b": 1, "s": 9, "num_experts": 28}, "tp"),  # wkv_a's (h, 24 + 4): E = 28
], ids=str)
def test_under_selective_ac_a_weight_of_the_gate_shape_shifts_what_its_moe_step_caches(one_thread, changes, strategy):
    """SelectiveAC recomputes a matmul whose weight on a rank is the router gate's (h, E), uncounted: the step caches
    the shifted set (the ledger's op_checkpoint at these sizes), as MemTracker measures it."""
    _assert_exact(make_config(LLAMA3, **(DSV3 | MOE | changes), recompute="op"), strategy, "balanced")
