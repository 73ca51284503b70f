"""torchtitan's SelectiveAC in the ledger: a MoE block's matmul whose weight on a rank has the router gate's shape,
(h, E), is recomputed and left out of the every-second-matmul count (force_recompute_mm_shapes_by_fqns), which shifts
the matmul outputs saved after it; a dense block has no gate, so nothing is forced there. Measured on torchtitan's own
blocks in tests/probe/libs/test_torchtitan_forced_recompute.py."""

from __future__ import annotations

import pytest

from memcalc.config.files import parse_yaml
from memcalc.config.schema import build_config
from memcalc.config.shipped import shipped_dir
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.strategy import STRATEGIES

DEEPSEEK_V3 = parse_yaml((shipped_dir() / "deepseek-v3.yaml").read_text())
MATMULS = {"attention/qkv_out", "attention/wo_out", "mlp/gate", "mlp/up", "mlp/fc2_out", "moe/shared_gate",
           "moe/shared_up", "moe/shared_fc2_out", "mla/wq_out", "mla/wq_a_out", "mla/wkv_a_out", "mla/wkv_b_out"}
# Llama3's attention (wqkv (32, 64/t), wo (32/t, 32)) before a MoE of 4 experts; recompute op (SelectiveAC)
SMALL = {"impl": "torchtitan", "b": 1, "s": 6, "h": 32, "a": 4, "num_query_groups": 2, "recompute": "op",
         "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}


def _saved(fields: dict, strategy: str, dense: bool = False) -> set[str]:
    """The matmul outputs one layer (with `dense`, a dense layer of the model) keeps under `strategy`."""
    result = estimate(build_config(fields), STRATEGIES[strategy])
    return {x.tensor.name for x in (result.dense if dense else result.tensors)} & MATMULS


@pytest.mark.parametrize("t, strategy, saved", [
    (8, "none", {"mla/wq_a_out", "mla/wkv_a_out", "attention/wo_out", "moe/shared_up"}),  # whole: (7168, 2048)
    (4, "tp", {"mla/wq_a_out", "mla/wkv_a_out", "attention/wo_out", "moe/shared_up"}),  # u/t = 512
    (8, "tp", {"mla/wq_a_out", "mla/wkv_a_out", "attention/wo_out"}),  # u/t = 256 = E: w1 and w3 forced
    (8, "tp-sp", {"mla/wq_a_out", "mla/wkv_a_out", "attention/wo_out"}),
])
def test_deepseek_v3_at_t_8_recomputes_its_shared_experts_w1_and_w3_and_so_no_longer_saves_w3(t, strategy, saved):
    assert _saved(DEEPSEEK_V3 | {"impl": "torchtitan", "t": t}, strategy) == saved


def test_a_forced_wqkv_or_wo_shifts_the_count_of_the_matmuls_after_it():
    """At E = h = 32: under tp wqkv (32, 64/2) is forced, so wo's and w3's outputs are saved; whole, wqkv is (32, 64)
    and wo (32, 32) is forced, so w3's is saved where w1's and w2's were. The shared experts' (32, 16/t) never are."""
    fields = SMALL | {"t": 2, "num_experts": 32, "moe_shared_expert_intermediate_size": 16}
    assert _saved(fields, "tp") == {"attention/wo_out", "moe/shared_up"}
    assert _saved(fields, "none") == {"attention/qkv_out", "moe/shared_up"}


def test_a_dense_layer_of_a_moe_model_has_no_gate_so_its_w1_of_the_gate_shape_is_saved():
    """The dense FeedForward's w1 at f/t = 8/2 = E = 4; SelectiveAC collects the forced shapes block by block."""
    fields = SMALL | {"t": 2, "ffn_hidden_size": 8, "moe_layer_freq": 2, "L": 2}
    assert _saved(fields, "tp", dense=True) == {"attention/qkv_out", "mlp/gate", "mlp/fc2_out"}


def test_a_shift_onto_wq_b_whose_output_memcalc_does_not_name_is_refused_in_one_line():
    """wq_a (h, r_q) at r_q = E: SelectiveAC counts wq_b first and saves its output."""
    fields = DEEPSEEK_V3 | {"impl": "torchtitan", "q_lora_rank": 256}
    with pytest.raises(ConfigError, match=r"wq_a's weight \(h, r_q\) = \(7168, 256\) is the router gate's") as caught:
        build_config(fields)
    assert "\n" not in str(caught.value)
