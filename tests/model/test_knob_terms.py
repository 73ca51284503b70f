"""Each knob changes exactly the terms it should, by the bytes first principles say.

Expectations are worked out from the operators (what each backward reads), with
sizes chosen so that no two terms coincide: b=2, s=64, h=96, a=12, t=4, f=256,
g=4.
"""

import pytest

from memcalc.model import ledger
from memcalc.config.schema import build_config
from memcalc.model.evaluate import estimate
from memcalc.model.impls import layer_tensors
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.ledger import Kind
from memcalc.model.strategy import STRATEGIES

B, S, H, A, T, F, G = 2, 64, 96, 12, 4, 256, 4
BSH, BSF, BASS, BS = B * S * H, B * S * F, B * A * S * S, B * S


def _estimate(strategy="none", exact=False, device="cuda", **knobs):
    config = build_config(dict(b=B, s=S, h=H, a=A, t=T) | knobs)
    return estimate(config, STRATEGIES[strategy], Accounting(exact=exact, device=device))


def _bytes(strategy="none", **kw) -> int:
    return _estimate(strategy, **kw).per_layer_bytes


def _by_name(strategy="none", **kw) -> dict[str, int]:
    return {x.tensor.name: x.bytes for x in _estimate(strategy, **kw).tensors}


def test_default_layer_is_the_seeds_34_bsh_plus_5_bas2():
    # Seed section 2: MLP 19bsh, attention 11bsh + 5bas^2, two norms 4bsh.
    assert _bytes() == 34 * BSH + 5 * BASS


def test_default_mlp_saves_the_seeds_four_tensors():
    got = _by_name()
    assert (got["mlp/fc1_in"], got["mlp/gelu_in"], got["mlp/fc2_in"], got["mlp/dropout_mask"]) == (
        2 * BSH, 8 * BSH, 8 * BSH, BSH,
    )


def test_tensors_come_in_forward_order_of_blocks():
    blocks = [x.block for x in layer_tensors(Knobs(), Accounting(exact=True))]
    order = ["ln1", "attention", "ln2", "mlp"]
    assert sorted(blocks, key=order.index) == blocks
    assert set(blocks) == set(order)


def test_swiglu_replaces_gelu_input_with_gate_up_silu_out_and_megatrons_copy_of_up():
    gelu = _by_name(ffn_hidden_size=F)
    swiglu = _by_name(mlp="swiglu", ffn_hidden_size=F)
    assert set(gelu) - set(swiglu) == {"mlp/gelu_in"}
    assert set(swiglu) - set(gelu) == {"mlp/gate", "mlp/up", "mlp/silu_out", "mlp/up_plus_offset"}
    # Four (b, s, f) tensors in place of one: glu()'s `up + offset` is a copy the product keeps.
    assert sum(swiglu.values()) - sum(gelu.values()) == 4 * 2 * BSF - 2 * BSF


def test_fused_swiglu_keeps_fc1s_output_alone_gate_and_up():
    gelu = _by_name(ffn_hidden_size=F)
    fused = _by_name(mlp="swiglu", ffn_hidden_size=F, bias_activation_fusion=True)
    assert set(fused) - set(gelu) == {"mlp/gate", "mlp/up"}
    assert sum(fused.values()) - sum(gelu.values()) == 2 * 2 * BSF - 2 * BSF


def test_ffn_hidden_size_changes_only_the_two_mlp_inner_terms():
    default, wide = _by_name(), _by_name(ffn_hidden_size=F)
    changed = {n for n in default if default[n] != wide[n]}
    assert changed == {"mlp/gelu_in", "mlp/fc2_in"}
    assert sum(wide.values()) - sum(default.values()) == 2 * 2 * B * S * (F - 4 * H)


def test_flash_attention_has_no_s_squared_terms():
    names = _by_name(attention="flash")
    s_squared = {x.name for x in ledger.ALL_TENSORS if x.shape.count(ledger.Dim.S) == 2}
    assert not s_squared & set(names)
    assert sum(names.values()) == 34 * BSH


def test_flash_attention_under_exact_keeps_an_fp32_log_sum_exp_per_row():
    eager, flash = _by_name(exact=True), _by_name(attention="flash", exact=True)
    assert flash["attention/softmax_lse"] == 4 * B * A * S
    assert "attention/softmax_lse" not in eager


def test_dropout_zero_saves_no_masks():
    names = _by_name(dropout=0.0)
    assert not [n for n in names if ledger.BY_NAME[n].kind is Kind.MASK]
    # Without dropout, weights x V reads the softmax output itself: 2bas^2 instead of 5bas^2,
    # and the two bsh masks are gone.
    assert sum(names.values()) == 32 * BSH + 2 * BASS


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.999])
def test_any_positive_dropout_saves_the_masks(p):
    assert _bytes(dropout=p) == 34 * BSH + 5 * BASS


def test_selective_recompute_drops_the_5as_over_h_terms():
    # Korthikanti et al. 2022, section 5: selective recomputation leaves 34sbh, 10sbh + 24sbh/t, 34sbh/t.
    assert _bytes("none", recompute="selective") == 34 * BSH
    assert _bytes("tp", recompute="selective") == 10 * BSH + 24 * BSH // T
    assert _bytes("tp-sp", recompute="selective") == 34 * BSH // T


def test_full_recompute_keeps_only_layer_input():
    for name, expected in (("none", 2 * BSH), ("tp", 2 * BSH), ("tp-sp", 2 * BSH // T)):
        assert _by_name(name, recompute="full") == {"layer/input": expected}


def test_gqa_with_flash_attention_shrinks_k_and_v_by_groups_over_heads():
    mha, gqa = _by_name(attention="flash"), _by_name(attention="flash", num_query_groups=G)
    for name in ("attention/k", "attention/v"):
        assert gqa[name] * A == mha[name] * G
    assert {n for n in mha if mha[n] != gqa[n]} == {"attention/k", "attention/v"}


def test_gqa_in_megatrons_eager_attention_expands_k_and_v_to_every_head_and_saves_nothing():
    mha, gqa = _by_name(), _by_name(num_query_groups=G)
    # the query, a view of the fused QKV output multi-head, is the core's copy of it under GQA (b > 1 here)
    assert set(mha) - set(gqa) == {"attention/q", "attention/k", "attention/v"}
    assert set(gqa) - set(mha) == {"attention/q_copy", "attention/k_expanded", "attention/v_expanded"}
    assert gqa["attention/q_copy"] == mha["attention/q"] and gqa["attention/k_expanded"] == mha["attention/k"]
    assert sum(gqa.values()) == sum(mha.values())


def test_query_groups_equal_to_heads_is_plain_multi_head_attention():
    assert _by_name(num_query_groups=A) == _by_name()
    assert not Knobs.of(build_config(dict(s=S, h=H, a=A, num_query_groups=A))).gqa


def test_rmsnorm_has_no_mean():
    names = _by_name(norm="rmsnorm", exact=True)
    assert {"ln1/rstd", "ln2/rstd"} <= set(names)
    assert not {"ln1/mean", "ln2/mean"} & set(names)
    assert _bytes(norm="rmsnorm") == _bytes()  # the paper counts only the norm's input


def test_exact_adds_norm_statistics_as_their_own_tensors():
    paper, exact = _by_name(), _by_name(exact=True)
    assert set(exact) - set(paper) == {"ln1/mean", "ln1/rstd", "ln2/mean", "ln2/rstd"}
    assert all(exact[n] == paper[n] for n in paper)
    assert sum(exact.values()) - sum(paper.values()) == 4 * 4 * BS  # four fp32 values per token


def test_fp32_doubles_activation_bytes_but_not_masks():
    bf16, fp32 = _by_name(), _by_name(dtype="fp32")
    for name, n in bf16.items():
        is_mask = ledger.BY_NAME[name].kind is Kind.MASK
        assert fp32[name] == (n if is_mask else 2 * n), name


def test_fp16_and_bf16_are_both_two_bytes():
    assert _by_name(dtype="fp16") == _by_name(dtype="bf16")


def test_norm_stats_are_fp32_on_cuda_and_activation_dtype_on_cpu():
    exact_cuda, exact_cpu = Accounting(exact=True, device="cuda"), Accounting(exact=True, device="cpu")
    assert element_bytes(Kind.NORM_STATS, Knobs(dtype="bf16"), exact_cuda) == 4
    assert element_bytes(Kind.NORM_STATS, Knobs(dtype="bf16"), exact_cpu) == 2
    assert element_bytes(Kind.NORM_STATS, Knobs(dtype="fp32"), exact_cpu) == 4
    assert _by_name(exact=True, device="cpu")["ln1/rstd"] == 2 * BS


def test_log_sum_exp_is_fp32_whatever_the_device():
    assert _by_name(attention="flash", exact=True, device="cpu")["attention/softmax_lse"] == 4 * B * A * S


def test_masks_are_one_byte_whatever_the_dtype():
    for dtype in ("bf16", "fp32"):
        assert element_bytes(Kind.MASK, Knobs(dtype=dtype), Accounting()) == 1


def test_knobs_of_a_config_note_which_sizes_the_config_set():
    plain = Knobs.of(build_config(dict(s=S, h=H, a=A)))
    assert (plain.ffn_set, plain.gqa, plain.has_dropout) == (False, False, True)
    custom = Knobs.of(build_config(dict(s=S, h=H, a=A, ffn_hidden_size=F, num_query_groups=G, dropout=0.0)))
    assert (custom.ffn_set, custom.gqa, custom.has_dropout) == (True, True, False)
