"""torchtitan's pipeline with FSDP2 on each stage (pp x dp_shard on the fake process group): the chunk its
pipeline_llm builds on a stage's rank, laid out by its own parallelize_llama, run by torch's Schedule1F1B, under
torch's FSDPMemTracker (memcalc.probe.libs.torchtitan_pp), against the step timeline's walk of it
(memcalc.sizing.timeline.torchtitan_pp; dense and with experts at ep = 1, on the CPU's kernels and CUDA's) and
memcalc's own tables of the stage's parameters (memcalc.sizing.totals, memcalc.sizing.timeline.fsdp.stage_params).
Under pp torchtitan's "default" policy never reshards after forward, and the schedule runs every micro-batch's
backward with set_requires_gradient_sync(False) and set_reshard_after_backward(False), then each unit's post_backward
once (perform_reduce_grad): every unit stays unsharded from the first forward to the step's end, its gradients kept
unsharded in the reduce dtype (fp32) until one reduce-scatter at the end."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.errors import ProbeError  # noqa: E402
from memcalc.probe.libs.torchtitan_pp import (  # noqa: E402
    measure_torchtitan_pp_fsdp_step_on_rank, warmed_up_sharded_stage)
from memcalc.sizing.pipeline import pipeline_stages, stage_rank  # noqa: E402
from memcalc.sizing.timeline import (  # noqa: E402
    ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, timeline)
from memcalc.sizing.timeline.fsdp import stage_params  # noqa: E402
from memcalc.sizing.timeline.tape import prod  # noqa: E402
from memcalc.sizing.totals import per_gpu  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3, make_config  # noqa: E402

from ..step_readings import assert_moments_in_order, torchtitan_pp_fsdp_readings  # noqa: E402

# As the FSDP2 step tests' Llama3 (an ffn width dp_shard = 4 pads), on pp = 2 by dp_shard = 2 unless a case says.
LLAMA3 = TORCHTITAN_LLAMA3 | {"ffn_hidden_size": 102, "pp": 2, "dp_shard": 2}
CASES = [
    {},
    {"b": 1, "s": 7, "dp_shard": 3},  # b = 1, odd s, dp_shard = 3 pads the vocabulary and the ffn width
    {"pp": 3, "L": 3, "recompute": "full", "num_microbatches": 4},  # FullAC; 1, 2, 0 layers: norm and lm_head alone
    {"recompute": "op", "num_microbatches": 3, "b": 1, "s": 9},  # SelectiveAC
    {"dtype": "fp32", "dp_shard": 3, "b": 1, "s": 5},  # no casts: each unit gathered in fp32
    {"b": 3, "s": 5, "num_microbatches": 3, "pp": 3, "L": 4},  # 1, 2, 1 layers
]
# Qwen3's MoE blocks at ep = 1 (each stage's routers forced) and CUDA's kernels (flex attention, fused norms), each
# case's stages measured in its own test: shared experts, SelectiveAC and FullAC, dense blocks beside MoE ones
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_tokens": "balanced"}
MORE_CASES = [
    (MOE, "balanced", "cpu"),
    (MOE | {"recompute": "op", "moe_shared_expert_intermediate_size": 48, "b": 1, "s": 9, "num_microbatches": 3},
     "all-to-one", "cpu"),
    (MOE | {"pp": 3, "L": 5, "moe_layer_freq": 2, "recompute": "full", "b": 3, "s": 5, "dp_shard": 3}, "balanced",
     "cpu"),
    (MOE | {"num_experts": 2, "moe_router_topk": 1, "dp_shard": 4, "b": 1, "s": 7}, "all-to-one", "cpu"),  # dim 1
    ({}, None, "cuda"),
    ({"recompute": "full", "dtype": "fp32", "b": 1, "s": 7, "dp_shard": 3, "num_microbatches": 3}, None, "cuda"),
    (MOE | {"recompute": "op", "moe_shared_expert_intermediate_size": 48, "b": 1, "s": 130}, "balanced", "cuda"),
]


def _stages(cases):
    return [(c, x.name) for c in cases for x in pipeline_stages(make_config(LLAMA3 | c))]


@pytest.fixture(scope="module")
def measured(one_thread):
    """Each stage's measurement, on its first rank of pp x dp_shard."""
    out = {}
    for changes, stage in _stages(CASES):
        config = make_config(LLAMA3 | changes)
        rank = stage_rank(stage, config.pp) * config.dp_shard
        out[str(changes), stage] = run_fake(measure_torchtitan_pp_fsdp_step_on_rank, (config, STRATEGIES["none"]),
                                            config.pp * config.dp_shard, rank=rank)
    return out


def _states(config, stage):
    """memcalc's model states of `stage` (per_gpu's terms by name) and its parameters' count."""
    totals = next(x for x in per_gpu(config, STRATEGIES["none"], Accounting(exact=True, device="cpu")).stages
                  if x.stage.name == stage)
    terms = {x.name: x.bytes for x in totals.terms}
    return terms, len(stage_params(config, totals.stage, 1))


def _padded_elements(config, stage):
    """Elements of the stage's parameters gathered whole: every rank's shard, each dim 0 padded to dp_shard."""
    return _states(config, stage)[0]["states/weights"] // 4 * config.dp_shard


def _rope_buffers(config, stage):
    """Each block's ComplexRoPE table, a buffer FSDPMemTracker files with the parameters: complex64 (s, d/2)."""
    held = next(x for x in pipeline_stages(config) if x.name == stage).layers
    return held * 8 * config.s * (config.h // config.a // 2)


def _assert_walked(config, stage, r, device="cpu"):
    """The walk (memcalc.sizing.timeline.torchtitan_pp under FSDP2) against FSDPMemTracker's measurement `r`: the
    peak's moment, each category at it and between steps."""
    predicted = timeline(config, STRATEGIES["none"], Accounting(exact=True, device=device), stage)
    assert f"{predicted.peak.phase} {predicted.peak.where}".strip() == r.moment
    assert predicted.peak.by_category() == {c: r.peak.get(c, 0) for c in predicted.peak.by_category()}
    assert predicted.steady.by_category() == {c: r.steady.get(c, 0) for c in predicted.steady.by_category()}


@pytest.mark.parametrize(("changes", "stage"), _stages(CASES))
def test_each_stage_peaks_where_the_walk_says_to_the_byte(measured, changes, stage):
    _assert_walked(make_config(LLAMA3 | changes), stage, measured[str(changes), stage])


@pytest.mark.parametrize(("changes", "route", "device", "stage"), [
    (c, r, d, x.name) for c, r, d in MORE_CASES for x in pipeline_stages(make_config(LLAMA3 | c))], ids=str)
def test_with_experts_and_on_cudas_kernels_each_stage_peaks_where_the_walk_says(one_thread, changes, route, device,
                                                                                  stage):
    config = make_config(LLAMA3 | changes)
    r = run_fake(measure_torchtitan_pp_fsdp_step_on_rank, (config, STRATEGIES["none"], route, device),
                 config.pp * config.dp_shard, rank=stage_rank(stage, config.pp) * config.dp_shard)
    _assert_walked(config, stage, r, device)


@pytest.mark.parametrize(("changes", "route", "stage"), [
    *((c, None, x) for c, x in _stages([CASES[0], CASES[2], CASES[4]])),
    *((c, "balanced", x.name) for c in [MOE | {"num_experts": 2, "moe_router_topk": 1, "dp_shard": 4, "b": 1, "s": 7}]
      for x in pipeline_stages(make_config(LLAMA3 | c)))], ids=str)
def test_every_moment_the_walk_names_has_its_bytes_after_some_op_in_order(one_thread, changes, route, stage):
    """Each micro-batch's gathers, accumulations and the step's end's reduce-scatters as FSDPMemTracker reads them
    (at dp_shard 4 over 2 experts FSDP2 shards them on dim 1). By bytes alone: after the last backward
    perform_reduce_grad runs outside any module's hooks, where FSDPMemTracker names the last module it saw."""
    config = make_config(LLAMA3 | changes)
    moments = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"), stage).moments[1:-1]
    assert_moments_in_order(moments, torchtitan_pp_fsdp_readings(config, stage, route), places=())


def test_under_tp_the_stage_is_refused_as_its_3d_layout_does_not_run():
    """torchtitan's FSDP2 with TP makes the chunk's stream a DTensor, which the stage's received plain tensor is not
    (and under tp-sp each rank holds s/t of it): the probe names t = 1 rather than measure another layout."""
    config = make_config(LLAMA3 | {"t": 2})
    with pytest.raises(ProbeError, match="pp and dp_shard runs at t = 1"):
        warmed_up_sharded_stage(None, config, STRATEGIES["tp-sp"], None)


@pytest.mark.parametrize(("changes", "stage"), _stages(CASES))
def test_between_steps_a_stage_holds_its_chunks_fp32_shards_gradients_and_adamw_states(measured, changes, stage):
    config = make_config(LLAMA3 | changes)
    terms, count = _states(config, stage)
    steady = measured[str(changes), stage].steady
    assert steady[PARAMETERS] == terms["states/weights"] + _rope_buffers(config, stage)
    assert steady[GRADIENTS] == terms["states/grads"]
    assert steady[OPTIMIZER] == terms["states/adam_m"] + terms["states/adam_v"] + 4 * count  # a 0-d step each


@pytest.mark.parametrize(("changes", "stage"), _stages(CASES))
def test_at_the_peak_every_unit_of_the_stage_is_unsharded(measured, changes, stage):
    """The first micro-batch's forward gathers each unit; neither forward nor a micro-batch's backward reshards."""
    config = make_config(LLAMA3 | changes)
    r = measured[str(changes), stage]
    assert r.peak[PARAMETERS] == r.steady[PARAMETERS] + {"bf16": 2, "fp32": 4}[config.dtype] * _padded_elements(
        config, stage)


@pytest.mark.parametrize(("changes", "stage"), _stages(CASES[:3]))
def test_each_units_gradient_is_kept_whole_in_fp32_to_one_reduce_scatter_at_the_steps_end(one_thread, changes, stage):
    """The last reading with every unit unsharded (and no gather in flight), before perform_reduce_grad reshards the
    first unit: every parameter's whole gradient (unpadded), accumulated over the micro-batches in the reduce dtype
    (fp32; FSDPMemTracker files it as temporary: to_accumulated_grad_if_needed makes it inside post_backward) and, on
    every stage but the first, the last input gradient sent, (b, s, h) in bf16; its gradients are the sharded ones
    alone."""
    config = make_config(LLAMA3 | changes)
    readings = [r for _, r in torchtitan_pp_fsdp_readings(config, stage)]
    terms = _states(config, stage)[0]
    unsharded = readings[-1][PARAMETERS] + 2 * _padded_elements(config, stage)
    before = readings[max(i for i, r in enumerate(readings) if r[PARAMETERS] == unsharded)]
    held = next(x for x in pipeline_stages(config) if x.name == stage)
    whole = sum(prod(p.shape) for p in stage_params(config, held, 1))
    sent = 0 if held.has_embedding else 2 * config.b * config.s * config.h
    assert (before.get(TEMPORARIES, 0), before[GRADIENTS]) == (4 * whole + sent, terms["states/grads"])


def test_the_stages_peaks_are_the_ones_docs_timeline_md_gives(measured):
    """docs/timeline.md, "torchtitan's pipeline", quotes the first case's peaks: pinned so a change shows there."""
    first, last = measured["{}", "first"], measured["{}", "last"]
    assert (first.peak_bytes, first.moment, last.peak_bytes) == (824_936, "backward layers.0.ffn_norm", 981_816)
    assert first.peak == {PARAMETERS: 184_576, GRADIENTS: 91_904, ACTIVATIONS: 80_072, TEMPORARIES: 284_544,
                          OPTIMIZER: 183_840}
