"""Strategies split regions of the layer: TP the inside of the pair, SP the rest; a layout's per-tensor overrides
come from the implementation that runs it (`Strategy.planned`)."""

import itertools

import pytest

from memcalc.model import ledger
from memcalc.config.schema import build_config
from memcalc.model.evaluate import estimate
from memcalc.model.impls import IMPLEMENTATIONS, layer_tensors, plan
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import Dim, Region
from memcalc.model.strategy import NONE, STRATEGIES, TP, TP_SP

KNOB_CHOICES = {
    "mlp": ["gelu", "swiglu"],
    "attention": ["eager", "flash"],
    "num_query_groups": [None, 4],
    "norm": ["layernorm", "rmsnorm"],
    "dropout": [0.0, 0.1],
    "recompute": ["none", "selective", "full"],
    "dtype": ["bf16", "fp32"],
}


def _every_knob_combination():
    for values in itertools.product(*KNOB_CHOICES.values()):
        yield dict(zip(KNOB_CHOICES, values))


def test_no_parallelism_splits_nothing():
    assert all(NONE.split_dim(x) is None for x in ledger.ALL_TENSORS)


def test_tp_splits_heads_groups_ffn_or_hidden_inside_the_pair():
    expected = {
        ledger.Q: Dim.A, ledger.K: Dim.G, ledger.V: Dim.G, ledger.SOFTMAX_OUT: Dim.A,
        ledger.ATTN_DROPOUT_MASK: Dim.A, ledger.ATTN_DROPOUT_OUT: Dim.A, ledger.SOFTMAX_LSE: Dim.A,
        ledger.PROJ_IN: Dim.A, ledger.GELU_IN: Dim.F, ledger.SWIGLU_GATE: Dim.F, ledger.SWIGLU_UP: Dim.F,
        ledger.SWIGLU_SILU_OUT: Dim.F, ledger.FC2_IN: Dim.F,
        # experts: etp = t splits each expert's width; shared experts split theirs like the dense MLP
        **{x: Dim.FE for x in (ledger.EXPERT_GELU_IN, ledger.EXPERT_GATE, ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT,
                               ledger.EXPERT_FC2_IN)},
        **{x: Dim.U for x in (ledger.SHARED_GELU_IN, ledger.SHARED_GATE, ledger.SHARED_UP, ledger.SHARED_SILU_OUT,
                              ledger.SHARED_FC2_IN)},
        # latent attention: the up-projected heads; the latents stay whole per token
        **{x: Dim.A for x in (ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V, ledger.MLA_PROJ_IN)},
        # QK norms: each head's, split with the heads
        **{x: Dim.A for x in ledger.Q_NORM}, **{x: Dim.G for x in ledger.K_NORM},
    }
    assert {x: TP.split_dim(x) for x in ledger.ALL_TENSORS if TP.split_dim(x)} == expected


def test_tp_leaves_the_seeds_10bsh_replicated():
    # Seed section 3: two norm inputs, the two norm outputs feeding QKV and fc1, two dropout masks.
    replicated = [x for x in layer_tensors(Knobs(), Accounting()) if TP.split_dim(x) is None]
    assert {x.name for x in replicated} == {
        "ln1/input", "ln2/input", "attention/qkv_in", "mlp/fc1_in",
        "attention/out_dropout_mask", "mlp/dropout_mask",
    }


def test_sp_splits_along_s_exactly_what_tp_replicates():
    for x in ledger.ALL_TENSORS:
        if TP.split_dim(x) is None and x.region is not Region.EXPERT:  # r counts a rank's expert slots already
            assert TP_SP.split_dim(x) is Dim.S, x.name
        else:
            assert TP_SP.split_dim(x) is TP.split_dim(x), x.name


def test_strategies_are_rules_over_regions():
    assert NONE.splits == frozenset()
    assert TP.splits == {Region.TENSOR}
    assert TP_SP.splits == {Region.TENSOR, Region.SEQUENCE}


@pytest.mark.parametrize("exact", [False, True])
def test_tp_sp_divides_every_term_by_t(exact):
    t = 2  # a*g/t: two K/V groups per rank, where every term divides (megatron's CONDITIONS)
    for knobs in _every_knob_combination():
        config = build_config(dict(b=4, s=32, h=64, a=8, t=t) | knobs)  # b*a/t fills a fused-softmax block
        accounting = Accounting(exact=exact)
        whole = estimate(config, NONE, accounting)
        split = estimate(config, TP_SP, accounting)
        for w, p in zip(whole.tensors, split.tensors, strict=True):
            replicated = p.tensor.region is Region.REPLICATED  # megatron's fp32 causal mask: whole everywhere
            assert p.bytes * (1 if replicated else t) == w.bytes, (knobs, p.tensor.name)


def test_strategies_are_the_three_of_the_seed_in_order():
    assert list(STRATEGIES.values()) == [NONE, TP, TP_SP]
    assert list(STRATEGIES) == ["none", "tp", "tp-sp"]


HF = {"impl": "hf", "b": 2, "s": 8, "h": 32, "a": 4, "t": 2}
QWEN2_MOE = HF | {"family": "qwen2_moe", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                  "moe_shared_expert_intermediate_size": 16}
TENSORS = IMPLEMENTATIONS["hf"].by_name()


def test_tp_keeps_whole_what_the_librarys_own_plan_leaves_unsharded():
    tp = plan(build_config(QWEN2_MOE), TP)
    assert TP.split_dim(TENSORS["moe/shared_gate"]) is Dim.U  # the region's default, which hf's plan overrides
    assert [tp.split_dim(TENSORS[f"moe/shared_{x}"]) for x in ("gate", "up", "silu_out", "fc2_in")] == [None] * 4
    assert tp.split_dim(TENSORS["moe/expert_gate"]) is Dim.FE  # the routed experts' width is still split


def test_where_the_library_shards_everything_the_plan_is_the_layout_itself():
    assert plan(build_config(HF), TP) is TP
    assert plan(build_config(QWEN2_MOE | {"family": "mixtral", "moe_shared_expert_intermediate_size": None}), TP) is TP
