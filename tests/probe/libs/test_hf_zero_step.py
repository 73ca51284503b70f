"""One training step of transformers' LlamaForCausalLM under DeepSpeed's own engine (memcalc.probe.libs.hf_zero,
rank 0 of dp through the fake group), against the ZeRO walk (memcalc.sizing.timeline.zero): at stages 1 and 2 the
state between steps is MemTracker's to the byte; the peak is not yet (docs/limitations.md, "DeepSpeed's step")."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from memcalc.probe.step import measure_step  # noqa: E402
from tests.helpers import LLAMA_HF as LLAMA, make_config  # noqa: E402


@pytest.mark.parametrize("stage,changes", [
    (1, {"b": 1, "s": 7}),
    (2, {"b": 3, "s": 5, "num_query_groups": 1}),
    (2, {"b": 1, "s": 9, "a": 4, "num_query_groups": 4}),
])
def test_between_steps_deepspeed_holds_what_the_zero_walk_holds(one_thread, stage, changes):
    """bf16 weights whole, this rank's fp32 master partition, Adam's moments and the two groups' steps."""
    (r,) = measure_step(make_config(LLAMA, zero_stage=stage, dp=2, **changes), ["none"])
    steady = r.rows("steady")[-1]
    assert (steady.predicted, r.measured.group) == (steady.measured, "fake"), r.rows("steady")
