"""One training step of transformers' LlamaForCausalLM under DeepSpeed's own engine (memcalc.probe.libs.hf_zero,
rank 0 of dp through the fake group), against the ZeRO walk (memcalc.sizing.timeline.zero): at stages 1 and 2 the
state between steps is MemTracker's to the byte; the peak is not yet (docs/limitations.md, "DeepSpeed's step"), and
experts and gradient checkpointing add no difference of their own to it."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from memcalc.probe.step import measure_step  # noqa: E402
from tests.helpers import LLAMA_HF as LLAMA, make_config  # noqa: E402

MIXTRAL = {"family": "mixtral", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
# Qwen2-MoE's shared expert, a dense layer before each sparse one (decoder_sparse_step 2)
QWEN2_MOE = MIXTRAL | {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 40, "moe_layer_freq": 2}


def _step(stage: int, **changes):
    """The step at `stage` (dp 2) with the walk's and MemTracker's bytes; experts under the balanced route."""
    config = make_config(LLAMA, zero_stage=stage, dp=2, **changes)
    (r,) = measure_step(config, ["none"], route="balanced" if config.moe else None)
    return r


@pytest.mark.parametrize("stage,changes", [
    (1, {"b": 1, "s": 7}),
    (2, {"b": 3, "s": 5, "num_query_groups": 1}),
    (2, {"b": 1, "s": 9, "a": 4, "num_query_groups": 4}),
    (1, {"b": 3, "s": 5, "recompute": "full"}),
    (2, {"b": 1, "s": 7, "recompute": "full", "num_query_groups": 8}),
    (2, {"b": 1, "s": 6, **MIXTRAL}),
    (1, {"b": 3, "s": 4, **MIXTRAL, "experts_implementation": "eager"}),
    (2, {"b": 1, "s": 5, **QWEN2_MOE}),
])
def test_between_steps_deepspeed_holds_what_the_zero_walk_holds(one_thread, stage, changes):
    """bf16 weights whole, this rank's fp32 master partition, Adam's moments and the two groups' steps."""
    r = _step(stage, **changes)
    steady = r.rows("steady")[-1]
    assert (steady.predicted, r.measured.group) == (steady.measured, "fake"), r.rows("steady")


@pytest.mark.parametrize("changes", [{"recompute": "full"}, MIXTRAL, MIXTRAL | {"experts_implementation": "eager"}])
def test_experts_and_checkpointing_leave_the_peaks_difference_the_dense_steps(one_thread, changes):
    """The peak sits in DeepSpeed's optimizer step, after backward: what backward keeps adds nothing to it."""
    dense, corner = _step(2, b=1, s=8), _step(2, b=1, s=8, **changes)
    assert corner.rows("peak")[-1].difference == dense.rows("peak")[-1].difference
