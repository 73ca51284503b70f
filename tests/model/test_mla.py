"""Multi-head latent attention in the ledger: which tensors each library keeps, and how each layout splits them."""

from __future__ import annotations

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.impls import IMPLEMENTATIONS
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import MLA_KV_NORM
from memcalc.model.strategy import STRATEGIES

# The sizes the probe measures (tests/probe/libs): a/t = 2 heads per rank at t = 2.
MLA = {"b": 2, "s": 32, "h": 64, "a": 4, "kv_lora_rank": 24, "q_lora_rank": 16, "qk_rope_head_dim": 8,
       "qk_nope_head_dim": 12, "v_head_dim": 10, "norm": "rmsnorm", "dropout": 0.0}
EXACT = Accounting(exact=True)


def _knobs(fields: dict) -> Knobs:
    return Knobs(**{k: v for k, v in fields.items() if k not in ("b", "s", "h", "a")})


def _shapes(fields: dict, strategy: str, t: int = 1) -> dict[str, tuple[int, ...]]:
    result = estimate(build_config(fields | {"t": t}), STRATEGIES[strategy], EXACT)
    return {x.tensor.name: x.shape for x in result.tensors}


def test_a_latent_width_without_kv_lora_rank_is_refused_by_name():
    with pytest.raises(ConfigError, match="^q_lora_rank is set but kv_lora_rank is not"):
        build_config({"s": 32, "h": 64, "a": 4, "q_lora_rank": 16})


def test_kv_lora_rank_without_its_head_widths_is_refused_naming_them():
    with pytest.raises(ConfigError, match="needs qk_rope_head_dim, qk_nope_head_dim, v_head_dim"):
        build_config({"s": 32, "h": 64, "a": 4, "kv_lora_rank": 24})


def test_latent_attention_with_kv_groups_is_refused():
    with pytest.raises(ConfigError, match="^num_query_groups=2 with kv_lora_rank"):
        build_config(MLA | {"num_query_groups": 2})


def test_megatron_tp_splits_the_heads_and_keeps_the_latents_whole():
    shapes = _shapes(MLA, "tp", t=2)
    assert shapes["mla/q_norm_input"] == (2, 32, 16) and shapes["mla/kv_up_in"] == (2, 32, 24)
    assert shapes["mla/q"] == shapes["mla/k"] == (2, 2, 32, 20)  # a/t heads of d_n + d_r
    assert shapes["mla/v"] == (2, 2, 32, 10) and shapes["mla/proj_in"] == (2, 32, 2, 10)


@pytest.mark.parametrize("strategy", ["none", "tp"])
def test_megatron_kv_norm_keeps_the_down_projections_whole_output_outside_sp(strategy):
    # kv_layernorm's input is torch.split(kv_combined)[0]: a view of all r_kv + d_r = 24 + 8 columns
    assert _shapes(MLA, strategy, t=2)["mla/kv_norm_input"] == (2, 32, 32)


def test_megatron_sp_copies_the_kv_latents_shard_but_keeps_the_query_latent_whole():
    shapes = _shapes(MLA, "tp-sp", t=2)
    assert shapes["mla/kv_norm_input"] == (2, 16, 24)  # scatter_to_sequence_parallel_region copies the shard
    assert shapes["mla/q_norm_input"] == (2, 32, 16)  # its scatter returns a view of the gathered latent
    assert shapes["mla/q_norm_rstd"] == (2, 16) and shapes["mla/kv_up_in"] == (2, 16, 24)


def test_megatron_sp_ropes_the_whole_sequence():
    shapes = _shapes(MLA, "tp-sp", t=2)
    assert {shapes[f"mla/rope_{p}_{f}"] for p in "qk" for f in ("cos", "sin")} == {(32, 8)}


def test_megatrons_sp_plan_keeps_the_kv_latents_shard_only_with_latent_attention():
    megatron, tp_sp = IMPLEMENTATIONS["megatron"], STRATEGIES["tp-sp"]
    assert tp_sp.planned(megatron, Knobs()) is tp_sp  # a dense layer's plan is the layout itself
    assert tp_sp.planned(megatron, _knobs(MLA)).forms == (MLA_KV_NORM.input,)


def test_comm_gives_each_latent_projection_its_own_collectives_in_megatrons_order():
    from memcalc.model.comm import layer_collectives

    rows = [(c.name, c.op.value, c.phase) for c in layer_collectives(_knobs(MLA), STRATEGIES["tp"])
            if c.name.startswith("attention")]
    assert rows == [
        ("attention/linear_q_down_proj/gather", "all-gather", "forward"),
        ("attention/linear_kv_down_proj/gather", "all-gather", "forward"),
        ("attention/f*", "all-reduce", "forward"),
        ("attention/linear_kv_up_proj/f", "all-reduce", "backward"),
        ("attention/linear_q_up_proj/f", "all-reduce", "backward"),
        ("attention/linear_kv_down_proj/f", "all-reduce", "backward"),
        ("attention/linear_q_down_proj/f", "all-reduce", "backward"),
    ]


def test_comm_refuses_overlap_with_latent_attention_naming_kv_lora_rank():
    from memcalc.model.comm import layer_collectives

    with pytest.raises(ConfigError, match="^kv_lora_rank=24: tp_comm_overlap with latent attention"):
        layer_collectives(_knobs(MLA), STRATEGIES["tp-sp"], frozenset({"ring-ag"}), t=2)


def test_comm_enters_torchtitans_latent_attention_once_at_x_and_leaves_it_at_wo():
    """Its plan gathers x at the attention's entry, kept by the colwise up projections; the down projections are
    replicated: no collective of their own (measured: tests/probe/libs/test_library_comm.py)."""
    from memcalc.model.comm import layer_collectives

    knobs = _knobs(MLA | {"impl": "torchtitan", "recompute": "none", "mlp": "swiglu", "attention": "flash"})
    rows = [f"{c.name} {c.op.value} {c.phase}" for c in layer_collectives(knobs, STRATEGIES["tp-sp"], t=2)
            if c.name.startswith("attention")]
    assert rows == ["attention/g all-gather forward", "attention/g* reduce-scatter forward",
                    "attention/g* all-gather backward", "attention/g reduce-scatter backward"]


def test_without_a_query_latent_the_query_keeps_no_norm_and_no_up_projection_input():
    names = set(_shapes(MLA | {"q_lora_rank": None}, "none"))
    assert not {n for n in names if n.startswith("mla/q_")}
    assert {"attention/qkv_in", "mla/kv_norm_input", "mla/q", "mla/k", "mla/v"} <= names


def test_latent_attention_replaces_the_dense_q_k_v_and_projection_input():
    names = set(_shapes(MLA, "none"))
    assert not names & {"attention/q", "attention/k", "attention/v", "attention/proj_in"}


def test_hf_eager_attention_keeps_what_deepseek_v3_attention_saved_on_the_cpu():
    # DeepseekV3Attention alone, b=2 s=16 h=64 a=4, bf16, eager, recorded: 42,752 bytes
    fields = MLA | {"impl": "hf", "family": "deepseek_v3", "attention": "eager", "s": 16, "ffn_hidden_size": 96}
    result = estimate(build_config(fields), STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    attention = [x for x in result.tensors if x.tensor.block in ("attention", "mla")]
    assert sum(x.bytes for x in attention) == 42_752


def test_hf_sdpa_with_latent_attention_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="its flash kernel does not run.*use attention eager"):
        build_config(MLA | {"impl": "hf", "family": "deepseek_v2", "attention": "flash"})


def test_torchtitan_keeps_the_latent_attentions_q_k_and_wkv_bs_output_but_refuses_it_in_fp32():
    """Its DeepSeek-V3 block (measured in tests/probe/libs/test_torchtitan.py) at the none layout on a CPU."""
    result = estimate(build_config(MLA | {"impl": "torchtitan", "recompute": "none"}), STRATEGIES["none"],
                      Accounting(exact=True, device="cpu"))
    assert {"mla/q", "mla/k", "mla/kv_up_out", "mla/proj_in"} <= {x.tensor.name for x in result.tensors}
    with pytest.raises(ConfigError, match="^impl torchtitan with kv_lora_rank .*: dtype fp32: measured in bf16 only"):
        build_config(MLA | {"impl": "torchtitan", "dtype": "fp32"})


def test_formula_writes_the_latent_terms_in_their_own_symbols():
    from memcalc.model import formula as F

    knobs = _knobs(MLA)
    text = F.to_text(F.layer_formula(STRATEGIES["tp-sp"], knobs, Accounting()).total)
    assert "2r_kv/(ht)" not in text and "4r_kv/(ht)" in text and "4a*d_v/(ht)" in text
    assert "r_{kv}" in F.to_latex(F.layer_formula(STRATEGIES["tp-sp"], knobs, Accounting()).total)


@pytest.mark.parametrize("knobs, words", [
    ({"kv_lora_rank": 25}, r"kv_lora_rank\+qk_rope_head_dim=25\+8=33 is not divisible by t=2"),
    ({"q_lora_rank": 15}, "q_lora_rank=15 is not divisible by t=2"),
])
def test_megatron_latent_widths_its_column_parallel_down_projections_cannot_split_are_refused(knobs, words):
    """Found by the random audit: megatron-core's ColumnParallelLinear asserted (exit 70) at t = 3, r_kv + d_r = 16."""
    with pytest.raises(ConfigError, match=words):
        build_config(MLA | {"impl": "megatron", "t": 2} | knobs)
