"""The ledger describes each saved tensor once, consistently with how it is split."""

import re

from memcalc.model import ledger
from memcalc.model.ledger import ALL_TENSORS, BY_NAME, END_TENSORS, Dim, Kind, Region


def test_every_tensor_has_a_unique_block_slash_name():
    names = [x.name for x in ALL_TENSORS]
    assert len(names) == len(set(names))
    for name in names:
        assert re.fullmatch(r"[a-z0-9]+/[a-z0-9_]+", name), name


def test_by_name_finds_every_tensor_and_nothing_else():
    assert set(BY_NAME) == {x.name for x in (*ALL_TENSORS, *END_TENSORS)}
    assert all(BY_NAME[x.name] is x for x in ALL_TENSORS)


def test_block_is_the_part_of_the_name_before_the_slash():
    assert ledger.SOFTMAX_OUT.block == "attention"
    assert ledger.LN2.rstd.block == "ln2"
    assert ledger.FC2_IN.block == "mlp"


def test_every_tensor_says_who_saves_it_and_why():
    for x in ALL_TENSORS:
        assert x.saved_by.strip() and x.why.strip(), x.name


def test_sequence_parallelism_can_split_every_tensor_outside_the_tp_pair():
    # SP splits s, so each tensor in the sequence region must have one.
    for x in ALL_TENSORS:
        if x.region is Region.SEQUENCE:
            assert Dim.S in x.shape, x.name


def test_tensor_parallelism_can_split_every_tensor_inside_the_tp_pair():
    # Inside the column/row-parallel pair each rank holds a slice of heads, groups or width.
    for x in ALL_TENSORS:
        if x.region is Region.TENSOR:
            assert {Dim.A, Dim.G, Dim.F, Dim.U, Dim.H} & set(x.shape), x.name


def test_terms_left_out_of_the_paper_are_per_token_statistics_and_routing_indices():
    # The paper drops only small terms: nothing with a hidden, head-dim or MLP width.
    small = [x for x in ALL_TENSORS if not x.paper]
    assert {x.name for x in small} == {
        "ln1/mean", "ln1/rstd", "ln2/mean", "ln2/rstd", "attention/softmax_lse", "moe/topk_indices",
        "mla/q_norm_mean", "mla/q_norm_rstd", "mla/kv_norm_mean", "mla/kv_norm_rstd",
        "attention/q_norm_mean", "attention/q_norm_rstd", "attention/k_norm_mean", "attention/k_norm_rstd",
    }
    for x in small:
        assert not {Dim.H, Dim.D, Dim.F, Dim.FE, Dim.U} & set(x.shape), x.name


def test_dropouts_save_one_byte_masks_and_softmax_saves_its_output():
    # Seed section 1: dropout keeps its mask, softmax its output (not its input).
    masks = {x.name for x in ALL_TENSORS if x.kind is Kind.MASK}
    assert masks == {"attention/dropout_mask", "attention/out_dropout_mask", "mlp/dropout_mask"}
    assert ledger.SOFTMAX_OUT.kind is Kind.ACTIVATION
    assert "output" in ledger.SOFTMAX_OUT.why


def test_attention_core_tensors_are_s_by_s_per_head():
    for x in (ledger.SOFTMAX_OUT, ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT):
        assert x.shape == (Dim.B, Dim.A, Dim.S, Dim.S)


def test_the_two_norms_differ_only_in_name():
    for first, second in zip(ledger.LN1, ledger.LN2):
        assert first.name.split("/")[1] == second.name.split("/")[1]
        assert (first.shape, first.kind, first.region, first.why) == (
            second.shape, second.kind, second.region, second.why,
        )
