"""One training step of transformers' LlamaForCausalLM under DeepSpeed's own engine (memcalc.probe.libs.hf_zero,
rank 0 of dp through the fake group), against the ZeRO walk (memcalc.sizing.timeline.zero): at stages 1 and 2 the
state between steps and the peak's total are MemTracker's to the byte, with experts, gradient checkpointing and in
fp32 too; the categories at the peak and its moment are not yet (docs/limitations.md, "DeepSpeed's step")."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402
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
    (2, {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3, "ffn_hidden_size": 100}),
    # small and checkpointed: the peak in backward, grads_in_partition made by the first reduction into rank 0's
    # partition, in layer 0 (the walk made it at the first reduction: its peak a layer early, 376 B over)
    (2, {"b": 3, "s": 4, "h": 16, "a": 4, "ffn_hidden_size": 12, "vocab_size": 14, "recompute": "full",
         "attention": "eager"}),
    # fp32: no flat copy to cast; the peak at stage 1's reductions after backward, at stage 2 in the first group's
    # clip factors (a wide gradient held to the next reduction, grads_in_partition made by the first into it)
    (1, {"b": 1, "s": 7, "dtype": "fp32"}),
    (1, {"b": 3, "s": 5, "recompute": "full", "dtype": "fp32"}),
    (2, {"b": 3, "s": 5, "num_query_groups": 1, "dtype": "fp32"}),
    (2, {"b": 1, "s": 9, "a": 4, "num_query_groups": 4, "dtype": "fp32"}),
    (2, {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3, "ffn_hidden_size": 100, "dtype": "fp32"}),
    (2, {"b": 1, "s": 6, **MIXTRAL, "dtype": "fp32"}),
])
def test_deepspeeds_step_holds_what_the_zero_walk_holds_between_steps_and_at_its_peak(one_thread, stage, changes):
    """Between steps: the weights whole, this rank's fp32 master partition, Adam's moments and the two groups' steps;
    at the peak, in bf16 in DeepSpeed's step: the first group's flat bf16 and fp32 gradient partitions beside
    grads_in_partition and the gradient norm."""
    r = _step(stage, **changes)
    steady, peak = r.rows("steady")[-1], r.rows("peak")[-1]
    assert (steady.predicted, r.measured.group) == (steady.measured, "fake"), r.rows("steady")
    assert peak.predicted == peak.measured == r.measured.peak_bytes, r.rows("peak")


def _totals_after_every_op(config) -> list[int]:
    """MemTracker's total after each op of one step under DeepSpeed's engine, experts under the balanced route (its
    categories are not the walk's yet: docs/limitations.md, "DeepSpeed's step")."""
    from memcalc.probe.launch import run_fake
    from memcalc.probe.libs.hf_zero import ZERO_CATEGORIES, warmed_up_zero
    from memcalc.probe.step import MomentTracker
    from ..step_readings import reading_every_op

    def on_rank(tp):
        trainer = warmed_up_zero(tp, config, "balanced" if config.moe else None)
        tracker = reading_every_op(MomentTracker, ZERO_CATEGORIES)()
        tracker.readings = []
        trainer.register(tracker)
        with tracker:
            trainer.step()
        return [sum(reading.values()) for _, reading in tracker.readings]

    return run_fake(on_rank, (), config.dp)


@pytest.mark.parametrize("stage,changes", [
    (1, {"b": 1, "s": 7, "dtype": "fp32"}),
    (2, {"b": 3, "s": 5, "num_query_groups": 1, "dtype": "fp32"}),
    (1, {"b": 3, "s": 5, "num_query_groups": 1}),
    (2, {"b": 1, "s": 7}),
    (2, {"b": 1, "s": 7, "recompute": "full", "num_query_groups": 8, "dtype": "fp32"}),
    (2, {"b": 1, "s": 6, **MIXTRAL, "dtype": "fp32"}),
])
def test_every_moment_of_the_zero_walk_is_memtrackers_total_after_some_op_in_order(one_thread, stage, changes):
    """engine.backward's two 0-d losses and the loss's gradient through them, the reduce bucket from the first
    gradient, a norm's dY gone before its weight's gradient is reduced, a wide gradient held to the next reduction,
    grads_in_partition made by the first reduction into it, each group's fp32 gradient and clip factors in turn."""
    config = make_config(LLAMA, zero_stage=stage, dp=2, **changes)
    totals, position = _totals_after_every_op(config), 0
    for moment in timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu")).moments[1:]:
        found = next((i for i in range(position, len(totals)) if totals[i] == moment.bytes), None)
        assert found is not None, f"{moment.label()}: {moment.bytes} B is not among the totals after op {position}"
        position = found
