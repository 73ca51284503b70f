"""torchtitan's Llama3Model stepped as CUDA runs it (`memcalc measure --step --impl torchtitan --device cuda`): its
default flex attention given the batch's positions and block mask (SDPA's CPU flash kernel standing in for the
compiled kernel, which keeps the same tensors), its norms torch's fused rms_norm kernel, one op each way; against the
step timeline on device cuda: the peak, each category at it and the state between steps to the byte, and every
moment the timeline names among MemTracker's readings, in order, at t = 1 and under its TP plan, without
recomputation and under FullAC and SelectiveAC."""

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
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config  # noqa: E402

from ..step_readings import (  # noqa: E402
    assert_moments_in_order, readings_after_every_op, readings_of_the_measured_step)
from .test_torchtitan_qwen3_step import QWEN3  # noqa: E402

CUDA = Accounting(exact=True, device="cuda")

# Random shapes: b = 1 and b > 1, odd s (and s past one 128-token mask block), one K/V group, no GQA.
CASES = [
    ({}, "none"),
    ({"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100}, "none"),  # lm_head's GEMMs
    ({"vocab_size": 16, "s": 131, "a": 16, "num_query_groups": 16, "L": 1}, "none"),
    ({"vocab_size": 16, "b": 3, "s": 9, "num_query_groups": 1, "ffn_hidden_size": 512}, "none"),  # w2's GEMMs
    ({"t": 2}, "tp-sp"),
    ({"t": 2, "b": 1, "s": 10, "L": 1}, "tp-sp"),
    ({"t": 4, "num_query_groups": 4, "vocab_size": 32, "s": 64}, "tp-sp"),
    ({"t": 2, "b": 1, "s": 8, "num_query_groups": 8, "vocab_size": 64, "ffn_hidden_size": 512}, "tp"),
    ({"t": 4, "num_query_groups": 4, "b": 3, "s": 12, "L": 1}, "tp"),
    ({"t": 2, "b": 3, "s": 130, "vocab_size": 16, "L": 1, "num_query_groups": 4}, "tp-sp"),  # two mask blocks
]


def _readings(config, strategy: str):
    def on_rank(tp):
        with runtime(tp, device="cuda") as dims:
            return readings_after_every_op(warmed_up(tp, config, STRATEGIES[strategy], dims, device="cuda"))

    return run_fake(on_rank, (), config.t) if STRATEGIES[strategy].tensor_parallel else on_rank(single())


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", CASES, ids=str)
def test_as_cuda_runs_it_memtracker_reaches_the_peak_to_the_byte(one_thread, recompute, changes, strategy):
    (r,) = measure_step(make_config(LLAMA3, recompute=recompute, **changes), [strategy], device="cuda")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", [CASES[0], CASES[1], CASES[4], CASES[7], CASES[9]], ids=str)
def test_as_cuda_runs_it_every_moment_happens_in_order_in_its_module(one_thread, recompute, changes, strategy):
    """The fused norms' one moment each way, what they keep (the residual stream itself), RoPE's gathered table, the
    positions and block mask live all step."""
    config = make_config(LLAMA3, recompute=recompute, **changes)
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CUDA).moments[1:-1], _readings(config, strategy))


# Under its FSDP2 (parallelize_llama): dp_shard 2 and 4, with and without resharding, HSDP, its AC, at t = 1 and on
# its 2-D and 3-D meshes beside tp-sp (the TP plan on DTensor: the shim's sharding rules for the fused norm).
SHARDED = [
    ({"dp_shard": 2}, "none"),
    ({"dp_shard": 4, "recompute": "full", "b": 1, "s": 7}, "none"),
    ({"dp_shard": 2, "recompute": "op", "reshard_after_forward": False}, "none"),
    ({"dp_shard": 2, "dp_replicate": 2, "b": 3, "s": 9, "num_query_groups": 1}, "none"),
    ({"dp_shard": 2, "recompute": "full", "vocab_size": 16, "s": 131, "L": 1}, "none"),
    ({"dp_shard": 2, "t": 2}, "tp-sp"),
    ({"dp_shard": 2, "t": 2, "b": 1, "s": 10, "recompute": "full"}, "tp-sp"),
    ({"dp_shard": 4, "t": 2, "recompute": "op"}, "tp-sp"),
    ({"dp_shard": 2, "t": 2, "reshard_after_forward": False, "b": 3, "s": 12}, "tp-sp"),
    ({"dp_shard": 2, "dp_replicate": 2, "t": 2, "recompute": "op", "b": 1, "s": 8}, "tp-sp"),
]


@pytest.mark.parametrize("changes, strategy", SHARDED, ids=str)
def test_as_cuda_runs_it_under_fsdp2_fsdpmemtracker_reaches_the_peak_to_the_byte(one_thread, changes, strategy):
    (r,) = measure_step(make_config(LLAMA3, **changes), [strategy], device="cuda")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_tokens": "balanced"}


@pytest.mark.parametrize("changes", [
    {},
    {"b": 1, "s": 7, "recompute": "full"},
    {"moe_shared_expert_intermediate_size": 48, "recompute": "op", "moe_router_score_function": "sigmoid", "s": 9},
    {"moe_first_dense_layers": 1, "recompute": "op"},
    {"dp_shard": 2},
    {"dp_shard": 2, "recompute": "full", "b": 1, "s": 7},
], ids=str)
def test_as_cuda_runs_it_with_experts_memtracker_reaches_the_peak_to_the_byte(one_thread, changes):
    """Its Qwen3 MoE layers (the router forced balanced): the same fused norms, RoPE and flex around the MoE."""
    (r,) = measure_step(make_config(LLAMA3, **(MOE | changes)), ["none"], route="balanced", device="cuda")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


# Under tp-sp at t = 2, the peak in the MoE (a vocabulary of 16): experts at ep = t and at ep = 1, b = 1 and 2, s/t odd,
# after its Llama3 attention and its Qwen3 one (q_norm, k_norm)
OVER_TP = [
    ({"ep": 2, "b": 2, "s": 10}, "balanced"),
    ({"ep": 2, "b": 1, "s": 14}, "balanced"),
    ({"ep": 2, "b": 2, "s": 6, "moe_tokens": "worst", "moe_shared_expert_intermediate_size": 48}, "all-to-one"),
    ({"b": 2, "s": 10, "moe_ffn_hidden_size": 32}, "balanced"),  # each expert split in width: 16 a rank
]


@pytest.mark.parametrize("attention", [{}, QWEN3], ids=["llama3", "qwen3"])
@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, route", OVER_TP, ids=str)
def test_as_cuda_runs_it_with_experts_over_tp_sp_every_moment_happens_and_the_peak_to_the_byte(
        one_thread, attention, recompute, changes, route):
    """At ep = 2 routed_experts' local_map copies no dY: the residual stream's gradient is the fused norms' contiguous
    dX (on a CPU, the (s/t, b, h) reduce-scatter output seen as (b, s/t, h), copied at b > 1)."""
    config = make_config(LLAMA3, **(MOE | attention | changes), t=2, vocab_size=16, recompute=recompute)
    with readings_of_the_measured_step() as readings:
        (r,) = measure_step(config, ["tp-sp"], route=route, device="cuda")
    assert_moments_in_order(timeline(config, STRATEGIES["tp-sp"], CUDA).moments[1:-1], readings)
    assert r.measured.moment == r.predicted_moment and ".moe.routed_experts" in r.measured.moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def test_only_torchtitans_step_runs_as_cuda_does():
    with pytest.raises(ConfigError, match="only with --impl torchtitan"):
        measure_step(make_config(LLAMA3, impl="megatron", loss_chunks=None), ["none"], device="cuda")


def test_measure_step_on_device_cuda_says_it_ran_as_cuda_runs_and_matches(tmp_path):
    from tests.cli import memcalc_cli

    path = tmp_path / "llama3.yaml"
    path.write_text("b: 1\ns: 26\nh: 64\na: 8\nL: 2\nvocab_size: 250\nffn_hidden_size: 176\nnum_query_groups: 2\n"
                    "position_embedding_type: rope\nadd_bias_linear: false\ntie_embeddings: false\nloss_chunks: 0\n")
    run = memcalc_cli("measure", "--step", "--impl", "torchtitan", "--device", "cuda", "--config", str(path),
                      "--strategy", "tp-sp", "--t", "2")
    assert run.code == 0 and run.err == ("memcalc: note: llama3 sets no mlp, attention, norm, dropout, recompute: impl"
                                         " torchtitan's defaults apply (mlp=swiglu, attention=flash, norm=rmsnorm,"
                                         " dropout=0.0, recompute=op), not the seed's\n")
    assert "fake process group on cpu, run as CUDA runs it" in run.out and "match: the peak" in run.out
    assert "shim: device emulation: each norm runs as torch's CUDA _fused_rms_norm" in run.out


# fp32, torchtitan's default training.dtype: the fused norms keep the stream itself as in bf16; RoPE's products are Q
# and K, the loss reads the logits themselves
@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("changes, strategy", [CASES[0], CASES[1], CASES[4], CASES[7], ({"dp_shard": 2}, "none")],
                         ids=str)
def test_in_fp32_as_cuda_runs_it_memtracker_reaches_the_peak_to_the_byte(one_thread, changes, strategy, recompute):
    config = make_config(LLAMA3, dtype="fp32", recompute=recompute, **changes)
    if config.dp_shard is None:
        assert_moments_in_order(timeline(config, STRATEGIES[strategy], CUDA).moments[1:-1],
                                _readings(config, strategy))
    (r,) = measure_step(config, [strategy], device="cuda")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


# torchtitan's ChunkedLossWrapper as CUDA runs it: the positions chunked beside the labels (b > 1: copies), and under
# FSDP2 lm_head's unit gathered for the loop
CHUNKED = [
    ({"loss_chunks": 4}, "none"),
    ({"loss_chunks": 4, "b": 1, "recompute": "op"}, "none"),
    ({"loss_chunks": 2, "t": 2}, "tp-sp"),
    ({"loss_chunks": 3, "t": 2, "b": 3, "s": 12, "recompute": "full"}, "tp"),
    ({"loss_chunks": 2, "dp_shard": 2}, "none"),
]


@pytest.mark.parametrize("changes, strategy", CHUNKED, ids=str)
def test_as_cuda_runs_it_under_the_chunked_loss_memtracker_reaches_the_peak_to_the_byte(one_thread, changes, strategy):
    (r,) = measure_step(make_config(LLAMA3, **changes), [strategy], device="cuda")
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


@pytest.mark.parametrize("changes, strategy", CHUNKED[:4], ids=str)
def test_as_cuda_runs_it_under_the_chunked_loss_every_moment_happens_in_order(one_thread, changes, strategy):
    config = make_config(LLAMA3, **changes)
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CUDA).moments[1:-1], _readings(config, strategy))
