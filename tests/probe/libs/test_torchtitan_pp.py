"""torchtitan's pipeline (torch's Schedule1F1B, its default) on one stage's rank under torch's MemTracker,
against the step timeline (memcalc.sizing.timeline.torchtitan_pp): the chunk its pipeline_llm builds there, run by
torch's PipelineStage through the fake process group, every stage on its rank (pp = 2, 3 and 4): the peak, each
category at it and the state between steps to the byte, where the timeline names it, on the CPU's kernels and run
as CUDA runs them; and every moment the timeline
names is MemTracker's reading after some op, in order, in its module."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs import torchtitan_shim as shim  # noqa: E402
from memcalc.probe.libs.torchtitan_pp import measure_torchtitan_pp_step_on_rank, warmed_up_stage  # noqa: E402
from memcalc.sizing.pipeline import pipeline_stages, stage_rank  # noqa: E402
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
             MOE | {"pp": 4, "L": 12, "moe_layer_freq": 2},
             MOE | {"pp": 3, "L": 7, "moe_layer_freq": 2, "b": 1, "s": 7}]  # pp not dividing L  # 3, 4, 3 and 2 layers, 2, 2, 1 and 1 MoE: not L/pp/freq
MOE_CUDA_CASES = [MOE | {"recompute": "op", "moe_shared_expert_intermediate_size": 48, "b": 1, "s": 130}]


def _measured(config, stage, device, route=None):
    return run_fake(measure_torchtitan_pp_step_on_rank, (config, STRATEGIES["none"], route, device), config.pp,
                    rank=stage_rank(stage, config.pp))


def _assert_peak_exact(config, stage, device, route=None):
    """The stage's peak at the predicted moment, each category at it and between steps to the byte."""
    accounting = Accounting(exact=True, device=device)
    predicted = timeline(config, STRATEGIES["none"], accounting, stage)
    measured = _measured(config, stage, device, route)
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
    *((*x, "all-to-one") for x in _ranks([MOE_CASES[1], MOE_CASES[3]], "cpu"))], ids=str)
def test_every_moment_the_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, changes, device, stage,
                                                                                   route):
    """Each micro-batch's forward and backward as the schedule runs them, and what it keeps between."""
    config = _config(changes)

    def readings(group):
        with shim.pipeline_on_fake_group():
            return readings_after_every_op(warmed_up_stage(group, config, route=route))

    found = run_fake(readings, (), config.pp, rank=stage_rank(stage, config.pp))
    cpu = Accounting(exact=True, device="cpu")
    assert_moments_in_order(timeline(config, STRATEGIES["none"], cpu, stage).moments[1:-1], found)
