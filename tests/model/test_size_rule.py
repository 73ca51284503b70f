"""Where what a layer keeps depends on the sizes: Megatron's fused causal softmax runs only in a window."""

import numpy as np
import pytest

from memcalc.config.schema import build_config
from memcalc.model.evaluate import estimate
from memcalc.model.impls.megatron import FUSED_SOFTMAX, fused_softmax_runs
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Dim
from memcalc.model.strategy import STRATEGIES, TP
from memcalc.sizing.sweep import evaluate_sweep, make_sweep

GPT3 = dict(b=1, h=12288, a=96, t=8, dropout=0.0)


def _softmax_terms(s, accounting=Accounting(), **knobs):
    kept = estimate(build_config(GPT3 | {"s": s} | knobs), TP, accounting).tensors
    return {x.tensor.name: x.bytes for x in kept if x.tensor.name.startswith(("attention/softmax", "attention/causal"))}


def test_inside_the_window_the_fused_kernel_keeps_the_16_bit_softmax():
    assert _softmax_terms(4096) == {"attention/softmax_out": 2 * 12 * 4096 * 4096}


def test_past_4096_tokens_megatron_lms_default_keeps_a_16_bit_softmax_and_the_causal_mask():
    s, heads = 8192, 12
    assert _softmax_terms(s) == {"attention/softmax_out": 2 * heads * s * s, "attention/causal_mask": s * s}


def test_past_4096_tokens_softmax_in_fp32_keeps_an_fp32_softmax_and_the_causal_mask():
    s, heads = 8192, 12
    exact = _softmax_terms(s, Accounting(exact=True), attention_softmax_in_fp32=True)
    assert exact == {"attention/softmax_fp32": 4 * heads * s * s, "attention/softmax_out": 2 * heads * s * s,
                     "attention/causal_mask": s * s}


def test_without_the_fusion_the_mask_is_kept_at_every_size():
    assert _softmax_terms(4096, masked_softmax_fusion=False) == {
        "attention/softmax_out": 2 * 12 * 4096 * 4096, "attention/causal_mask": 4096 * 4096,
    }


def test_attention_batches_that_do_not_fill_a_kernel_block_fall_back_too():
    inside, outside = (estimate(build_config(dict(b=b, s=64, h=64, a=8, t=2, attention_softmax_in_fp32=True)), TP)
                       for b in (2, 3))
    assert "attention/softmax_fp32" not in {x.tensor.name for x in inside.tensors}  # 2 * 8/2 = 8 per block
    assert "attention/softmax_fp32" in {x.tensor.name for x in outside.tensors}  # 3 * 4 = 12: not a multiple of 8


def test_a_sweep_across_the_window_takes_each_points_own_set():
    sweep = make_sweep(GPT3 | {"L": 1}, {"s": range(2048, 8193, 2048)}, [TP], Accounting())
    result = evaluate_sweep(sweep)
    for i in range(result.rows):
        row = result.row(i)
        config = build_config(GPT3 | {"s": row["s"]})
        assert row["per_layer_bytes"] == estimate(config, STRATEGIES[row["strategy"]]).per_layer_bytes


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 6, 8, 12])
def test_the_fused_softmax_depends_on_s_and_b_only_as_its_pattern_declares(heads):
    """Within each piece the rule's `pattern` declares, fused_softmax_runs depends on s (b) only through its residue
    mod the declared period: what lets `memcalc fit` search each residue class alone."""
    for dim, other, fixed in ((Dim.S, Dim.B, (1, 2, 3, 5, 8)), (Dim.B, Dim.S, (1, 16, 17, 100, 128, 129, 2048, 4097))):
        period, edges = FUSED_SOFTMAX.pattern[dim]
        values = np.arange(1, 5000)
        piece = np.searchsorted(np.array(edges), values, side="right")
        for size in fixed:
            runs = fused_softmax_runs({dim: values, other: size, Dim.A: heads}, 1)
            for key in np.unique(piece * period + values % period):
                assert len(set(runs[piece * period + values % period == key])) == 1, (dim, size, key)
