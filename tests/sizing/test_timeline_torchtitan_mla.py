"""torchtitan's DeepSeek-V3 in the step walk at its shipped widths, values narrower than the heads (d_v < d_n + d_r),
which the probe cannot measure (its CPU stand-in for flex attention takes one width; the equal-width step is measured
to the byte: tests/probe/libs/test_torchtitan_dsv3_step.py): each gradient sized by its own width, and the step
leaves nothing behind."""

import pytest

from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.timeline import ACTIVATIONS, TEMPORARIES, timeline

from tests.helpers import TORCHTITAN_LLAMA3, make_config

# four heads of d_n + d_r = 8 + 4, values of d_v = 6, as DeepSeek-V3's 128 + 64 and 128
SHIPPED = {"num_query_groups": None, "a": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
           "v_head_dim": 6, "q_lora_rank": 16, "t": 2}
BATCH = {"batch/labels", "embedding/input_ids", "loss/value"}
FLEX = {"batch/block mask", "batch/document mask", "batch/positions"}  # CUDA's, live all step


def _live(moment) -> dict[str, int]:
    return {x.name: x.bytes for x in moment.live}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("strategy", ["none", "tp", "tp-sp"])
def test_at_unequal_widths_each_attention_gradient_is_sized_by_its_own_width(strategy, recompute, device):
    """SDPA's dQ and dK over d_n + d_r, its dV, wo's dX and d[k_nope | v] over d_v's and d_n's channels."""
    config = make_config(TORCHTITAN_LLAMA3, **SHIPPED, recompute=recompute)
    moments = timeline(config, STRATEGIES[strategy], Accounting(exact=True, device=device)).moments
    heads = 2 * config.b * config.s * config.a // STRATEGIES[strategy].weight_shards(config.t)  # bf16, a/t heads
    g = "grad/layers.1/attention"  # the last layer's, whose backward runs first
    kernel = _live(next(m for m in moments if m.what.endswith("'s backward: dQ, dK, dV")))
    assert (kernel[f"{g}/dq"], kernel[f"{g}/dk"], kernel[f"{g}/dv"]) == (heads * 12, heads * 12, heads * 6)
    wo = _live(next(m for m in moments if m.where.endswith("attention.wo") and m.what == "GEMMs: dW and dX"))
    assert wo[f"{g}/dout"] == heads * 6
    split = _live(next(m for m in moments if m.what == "the split's backward: d[k_nope | v] concatenated"))
    assert split[f"{g}/dkv up"] == heads * (8 + 6)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("recompute", ["none", "full", "op"])
@pytest.mark.parametrize("strategy", ["none", "tp", "tp-sp"])
def test_at_unequal_widths_the_step_leaves_only_the_batch_and_the_loss(strategy, recompute, device):
    config = make_config(TORCHTITAN_LLAMA3, **SHIPPED, recompute=recompute)
    last = timeline(config, STRATEGIES[strategy], Accounting(exact=True, device=device)).moments[-1]
    assert last.by_category()[TEMPORARIES] == 0
    left = {x.name for x in last.live if x.category == ACTIVATIONS}
    assert left == BATCH | (FLEX if device == "cuda" else set())
