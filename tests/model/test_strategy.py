"""A layout's per-tensor overrides come from the implementation that runs it (`Strategy.planned`)."""

from memcalc.config.schema import build_config
from memcalc.model.impls import IMPLEMENTATIONS, plan
from memcalc.model.ledger import Dim
from memcalc.model.strategy import TP

HF = {"impl": "hf", "b": 2, "s": 8, "h": 32, "a": 4, "t": 2}
QWEN2_MOE = HF | {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                  "moe_shared_expert_intermediate_size": 16}
TENSORS = IMPLEMENTATIONS["hf"].by_name()


def test_tp_keeps_whole_what_the_librarys_own_plan_leaves_unsharded():
    tp = plan(build_config(QWEN2_MOE), TP)
    assert TP.split_dim(TENSORS["moe/shared_gate"]) is Dim.U  # the region's default, which hf's plan overrides
    assert [tp.split_dim(TENSORS[f"moe/shared_{x}"]) for x in ("gate", "up", "silu_out", "fc2_in")] == [None] * 4
    assert tp.split_dim(TENSORS["moe/expert_gate"]) is Dim.FE  # the routed experts' width is still split


def test_where_the_library_shards_everything_the_plan_is_the_layout_itself():
    assert plan(build_config(HF), TP) is TP
    assert plan(build_config(QWEN2_MOE | {"moe_shared_expert_intermediate_size": None}), TP) is TP
