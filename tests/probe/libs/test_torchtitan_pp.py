"""torchtitan's pipeline (torch's Schedule1F1B, its default) on one stage's rank under torch's MemTracker,
against the step timeline (memcalc.sizing.timeline.torchtitan_pp): the chunk its pipeline_llm builds there, run by
torch's PipelineStage through the fake process group, every stage on its rank (pp = 2, 3 and 4; under tp and tp-sp
on a pp x t mesh, each chunk laid out by torchtitan's own TP plan): the peak, each category at it and the state between
steps to the byte, where the timeline names it, on the CPU's kernels and run as CUDA runs them; and every moment the
timeline names is MemTracker's reading after some op, in order, in its module."""

import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.torchtitan_pp import (  # noqa: E402
    measure_torchtitan_pp_step_on_rank, pipeline_runtime, warmed_up_stage)
from memcalc.probe.step import stage_world  # noqa: E402
from memcalc.sizing.pipeline import pipeline_stages  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config  # noqa: E402

from ..step_readings import assert_moments_in_order, readings_after_every_op  # noqa: E402

CASES = [
    {},  # two micro-batches: the first stage holds both at its first backward
    {"num_microbatches": 3},  # the last stage keeps each loss, and each input gradient to the next backward
    {"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100, "L": 4},  # b = 1, odd s, a/g = 1, two layers
    {"b": 3, "s": 5, "dtype": "fp32", "num_query_groups": 4},  # fp32 (no casts), a/g = 2
    {"b": 1, "s": 9, "num_query_groups": 1, "vocab_size": 31, "num_microbatches": 4},  # one K/V group, odd vocabulary
    {"recompute": "full"},  # FullAC: each block's rerun at its backward, the stage's output still held
    {"recompute": "full", "dtype": "fp32", "b": 1, "s": 7},
    {"recompute": "op", "num_microbatches": 3},  # SelectiveAC
    {"pp": 4, "L": 8},  # torchtitan's split: 2, 3, 2 and 1 layers; rank 1 holds the most
    {"pp": 3, "L": 6, "num_microbatches": 5, "recompute": "full"},  # 2, 3, 1 layers; five micro-batches
    {"pp": 4, "L": 4, "b": 1, "s": 7},  # 1, 2, 1, 0 layers: the last stage holds the norm and lm_head alone
    {"pp": 3, "L": 5, "b": 1, "s": 7},  # pp not dividing L, which torchtitan's split takes (Megatron's refuses)
    {"pp": 2, "L": 3, "num_microbatches": 3},
    {"pp": 4, "L": 2, "b": 1, "s": 7},  # pp = L + 2: 0, 1, 1, 0 layers, the first stage the embedding alone
]
# on CUDA's kernels (the CPU run as CUDA runs it: flex attention given each micro-batch's positions and block mask,
# torch's fused RMSNorm): s past one mask block, b = 1 (the document mask's offsets table)
CUDA_CASES = [{}, {"recompute": "op", "s": 130, "b": 1, "vocab_size": 31},
              {"recompute": "full", "num_microbatches": 3, "dtype": "fp32", "b": 3, "s": 5, "num_query_groups": 4},
              {"pp": 4, "L": 8, "num_microbatches": 6}]


def _config(changes):
    return make_config(LLAMA3, **({"pp": 2} | changes))


def _ranks(cases, device):
    """(changes, device, stage) for every rank's stage of each case."""
    return [(c, device, x.name) for c in cases for x in pipeline_stages(_config(c))]


# Qwen3's MoE blocks (each stage's routers forced): b = 1 and 3, odd s, a/g = 1, 2 and 4, shared experts, FullAC and
# SelectiveAC, pp = 3, dense blocks beside MoE ones (pp = 4: a share of them not layers/freq, freq not dividing L/pp); on CUDA's kernels with
# flex attention past one mask block
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_tokens": "balanced"}
MOE_CASES = [MOE, MOE | {"b": 1, "s": 7, "L": 4, "moe_shared_expert_intermediate_size": 48},
             MOE | {"b": 3, "s": 5, "num_query_groups": 4, "recompute": "full"},
             MOE | {"recompute": "op", "num_microbatches": 3, "moe_shared_expert_intermediate_size": 48, "s": 9},
             MOE | {"pp": 3, "L": 6, "num_query_groups": 1, "s": 7, "num_microbatches": 4},
             MOE | {"L": 4, "moe_layer_freq": 2, "recompute": "op", "b": 1, "s": 7},
             MOE | {"pp": 4, "L": 12, "moe_layer_freq": 2},  # 3, 4, 3 and 2 layers, 2, 2, 1 and 1 MoE: not L/pp/freq
             MOE | {"pp": 3, "L": 7, "moe_layer_freq": 2, "b": 1, "s": 7},  # pp not dividing L
             # DeepSeek-V3's first dense layers over two stages: 2 dense, then 1 dense and 1 MoE, then 1 MoE
             MOE | {"pp": 3, "L": 5, "moe_first_dense_layers": 3, "b": 1, "s": 7}]
MOE_CUDA_CASES = [MOE | {"recompute": "op", "moe_shared_expert_intermediate_size": 48, "b": 1, "s": 130}]


def _on_stage_rank(fn, args, config, stage, strategy="none"):
    """fn(group, *args) as the rank of `stage` (tp rank 0) in the pp x t world (t under a TP strategy, else 1)."""
    world, rank = stage_world(config, STRATEGIES[strategy], stage)
    return run_fake(fn, args, math.prod(world.values()), rank=rank)


def _assert_peak_exact(config, stage, device, route=None, strategy="none"):
    """The stage's peak at the predicted moment, each category at it and between steps to the byte."""
    accounting = Accounting(exact=True, device=device)
    predicted = timeline(config, STRATEGIES[strategy], accounting, stage)
    measured = _on_stage_rank(measure_torchtitan_pp_step_on_rank, (config, STRATEGIES[strategy], route, device),
                              config, stage, strategy)
    assert f"{predicted.peak.phase} {predicted.peak.where}".strip() == measured.moment
    assert predicted.peak.by_category() == {c: measured.peak.get(c, 0) for c in predicted.peak.by_category()}
    assert predicted.steady.by_category() == {c: measured.steady.get(c, 0) for c in predicted.steady.by_category()}


@pytest.mark.parametrize("changes, device, stage", [*_ranks(CASES, "cpu"), *_ranks(CUDA_CASES, "cuda")], ids=str)
def test_each_stage_peaks_where_the_walk_says_to_the_byte(one_thread, changes, device, stage):
    _assert_peak_exact(_config(changes), stage, device)


@pytest.mark.parametrize("route", ["balanced", "all-to-one"])
@pytest.mark.parametrize("changes, device, stage", [*_ranks(MOE_CASES, "cpu"), *_ranks(MOE_CUDA_CASES, "cuda")],
                         ids=str)
def test_with_experts_each_stage_peaks_where_the_walk_says_to_the_byte(one_thread, changes, device, stage, route):
    """Each stage holds its own MoE layers' buffers; its walk is the whole model's MoE block's."""
    _assert_peak_exact(_config(changes), stage, device, route)


@pytest.mark.parametrize("changes, device, stage, route", [
    *((*x, None) for x in _ranks([CASES[1], CASES[3], CASES[5], CASES[9]], "cpu")),
    *((*x, "all-to-one") for x in _ranks([MOE_CASES[1], MOE_CASES[3], MOE_CASES[8]], "cpu"))], ids=str)
def test_every_moment_the_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, changes, device, stage,
                                                                                   route):
    """Each micro-batch's forward and backward as the schedule runs them, and what it keeps between."""
    _assert_moments_in_order(_config(changes), stage, route)


def _assert_moments_in_order(config, stage, route=None, strategy="none"):
    """Every moment of the stage's walk (but the first and the last) is MemTracker's reading after some op, in
    order."""

    def readings(group):
        with pipeline_runtime(group, config) as dims:
            return readings_after_every_op(warmed_up_stage(group, config, STRATEGIES[strategy], dims, route=route))

    found = _on_stage_rank(readings, (), config, stage, strategy)
    cpu = Accounting(exact=True, device="cpu")
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], cpu, stage).moments[1:-1], found)


# torchtitan's 2-D parallelism: pipeline_llm's chunk laid out by its TP plan (parallelize_llama's model.parallelize)
# on a pp x t mesh. Under tp-sp a stage sends and receives its (b, s/t, h) shard of the stream; a receiving stage's
# stream keeps its buffer's batch-first layout (no norm's contiguous copy), a sending stage's gradient too (no dY
# copy before an all-gather); the last stage's loss is vocabulary-parallel. b = 1 and 3, odd s (tp), t = 2 and 4,
# pp = 2, 3 and 4 (a last stage of no layers), FullAC and SelectiveAC, fp32, a/g = 1 and 2, an odd vocabulary.
TP_CASES = [
    ({}, "tp-sp"), ({}, "tp"),
    ({"b": 1, "s": 7, "num_query_groups": 8, "ffn_hidden_size": 100, "L": 4}, "tp"),
    ({"b": 3, "s": 6, "dtype": "fp32", "num_query_groups": 4, "num_microbatches": 3}, "tp-sp"),
    ({"pp": 3, "L": 4, "b": 1, "s": 9, "vocab_size": 31, "num_microbatches": 4}, "tp"),
    ({"pp": 3, "L": 4, "recompute": "full"}, "tp-sp"),
    ({"recompute": "op", "num_microbatches": 3, "s": 10}, "tp-sp"),
    ({"pp": 4, "L": 8, "t": 4, "num_query_groups": 4}, "tp-sp"),
    ({"pp": 4, "L": 2, "b": 1, "s": 8}, "tp-sp"),
]
TP_CUDA_CASES = [({"recompute": "op", "s": 130, "b": 1, "vocab_size": 31}, "tp"),
                 ({"recompute": "full", "num_microbatches": 3, "dtype": "fp32", "b": 3, "s": 6}, "tp-sp")]
# Qwen3's MoE blocks under its MoE sharding plan: the experts split in width at ep = 1, over the TP ranks at ep = 2
# (each rank routing its own shard; all-to-one pins the worst bound there)
TP_MOE = MOE | {"moe_ffn_hidden_size": 32}
TP_MOE_CASES = [
    (TP_MOE, "tp-sp", "balanced"),
    (TP_MOE | {"b": 1, "s": 7, "L": 4, "moe_shared_expert_intermediate_size": 48}, "tp", "all-to-one"),
    (TP_MOE | {"recompute": "op", "num_microbatches": 3, "moe_shared_expert_intermediate_size": 48, "s": 10}, "tp-sp",
     "all-to-one"),
    (TP_MOE | {"ep": 2}, "tp-sp", "balanced"),
    (TP_MOE | {"ep": 2, "moe_tokens": "worst", "recompute": "full", "pp": 3, "L": 4}, "tp-sp", "all-to-one"),
    (TP_MOE | {"ep": 2, "b": 1, "s": 6, "num_experts": 6, "moe_ffn_hidden_size": 16, "L": 4}, "tp-sp", "balanced"),
]

# on CUDA's kernels: flex attention past one mask block at b = 1; at ep = 2, b = 3 over three stages
TP_MOE_CUDA_CASES = [
    (TP_MOE | {"recompute": "op", "moe_shared_expert_intermediate_size": 48, "b": 1, "s": 130}, "tp-sp", "balanced"),
    (TP_MOE | {"ep": 2, "b": 3, "s": 6, "pp": 3, "L": 4, "moe_tokens": "worst"}, "tp-sp", "all-to-one"),
]


def _config_t(changes):
    return _config({"t": 2} | changes)


def _tp_stages(cases, device):
    """(changes, strategy, route, device, stage) for every rank's stage of each case."""
    return [(c, strategy, route, device, x.name) for c, strategy, route in cases for x in pipeline_stages(_config_t(c))]


@pytest.mark.parametrize("changes, strategy, route, device, stage", [
    *_tp_stages([(*x, None) for x in TP_CASES], "cpu"), *_tp_stages([(*x, None) for x in TP_CUDA_CASES], "cuda"),
    *_tp_stages(TP_MOE_CASES, "cpu"), *_tp_stages(TP_MOE_CUDA_CASES, "cuda")], ids=str)
def test_under_tp_each_stage_peaks_where_the_walk_says_to_the_byte(one_thread, changes, strategy, route, device,
                                                                   stage):
    _assert_peak_exact(_config_t(changes), stage, device, route, strategy)


@pytest.mark.parametrize("changes, strategy, route, stage", [
    *((c, s, r, x) for c, s, r, _, x in _tp_stages([(*TP_CASES[0], None), (*TP_CASES[3], None), (*TP_CASES[5], None)],
                                                   "cpu")),
    *((c, s, r, x) for c, s, r, _, x in _tp_stages([TP_MOE_CASES[2], TP_MOE_CASES[4]], "cpu"))], ids=str)
def test_under_tp_every_moment_the_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, changes,
                                                                                          strategy, route, stage):
    """Under tp-sp the stream's layout on each stage: batch-first where it was received, its gradient where sent."""
    _assert_moments_in_order(_config_t(changes), stage, route, strategy)


# torchtitan's ChunkedLossWrapper on the last stage (its trainer's set_lm_head on the last model part, which skips
# lm_head and sends nothing): the schedule keeps each micro-batch's hidden states, the loop runs inside its loss
CHUNKED = [
    ({"loss_chunks": 4}, "none"),
    ({"loss_chunks": 2, "recompute": "op", "num_microbatches": 3}, "none"),
    ({"loss_chunks": 3, "b": 1, "s": 9, "recompute": "full"}, "none"),
    ({"loss_chunks": 2, "pp": 4, "L": 4, "b": 1, "s": 8}, "none"),  # the last stage: the norm and lm_head alone
    ({"loss_chunks": 2, "t": 2}, "tp-sp"),
    ({"loss_chunks": 4, "t": 2, "dtype": "fp32", "b": 3, "s": 8}, "tp"),
]


@pytest.mark.parametrize("changes, strategy", CHUNKED, ids=str)
def test_under_the_chunked_loss_the_last_stage_is_memtrackers_moment_by_moment_and_at_the_peak(one_thread, changes,
                                                                                                 strategy):
    config = _config(changes)
    _assert_peak_exact(config, "last", "cpu", strategy=strategy)
    _assert_moments_in_order(config, "last", strategy=strategy)
