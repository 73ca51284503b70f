"""Layouts an implementation does not run for some knobs are declared once, as data (`Implementation.refuses`), and
everything that lists layouts for a knob set asks it: plan, strategies_of, the sweep, the API and the docs."""

import pytest

import memcalc
from memcalc.docgen import impls as impl_pages
from memcalc.docgen import model as model_page
from memcalc.errors import ConfigError
from memcalc.model.impls import IMPLEMENTATIONS, left_out, plan, strategies_of
from memcalc.model.impls.base import Refusal
from memcalc.model.knobs import Knobs
from memcalc.model.strategy import STRATEGIES, TP

MOE = Knobs(num_experts=8)
MEGATRON = IMPLEMENTATIONS["megatron"]


def test_megatron_declares_that_its_moe_layer_does_not_run_tp_and_cites_its_code():
    (refusal,) = [r for r in MEGATRON.refuses if r.strategy == "tp"]
    assert isinstance(refusal, Refusal)
    assert "megatron/core/transformer/moe/moe_layer.py" in refusal.source and "MoELayer.forward" in refusal.source
    assert "refused at any t" in refusal.source  # at t=1 tp is none: the knobs decide, not t
    assert refusal.when(MOE) and not refusal.when(Knobs())


def test_the_layouts_follow_the_knobs():
    assert strategies_of(Knobs()) == ("none", "tp", "tp-sp")
    assert strategies_of(MOE) == ("none", "tp-sp")
    assert strategies_of(Knobs(num_experts=8, moe_layer_freq=2)) == ("none", "tp-sp")  # some MoE layers: refused
    assert left_out(Knobs()) == ()
    (line,) = left_out(MOE)
    assert line.startswith("tp left out: impl megatron does not run it with experts") and "\n" not in line


def test_plan_refuses_tp_with_experts_in_one_line_and_plans_the_rest():
    with pytest.raises(ConfigError) as refused:
        plan(MOE, TP)
    assert "\n" not in str(refused.value) and str(refused.value).endswith("; it runs: none, tp-sp")
    assert plan(MOE, STRATEGIES["tp-sp"]).name == "tp-sp"
    assert plan(Knobs(), TP) is TP


def test_the_api_sweeps_and_estimates_only_what_megatron_runs():
    result = memcalc.sweep("mixtral-8x7b", s=1024, t=[1, 2])
    assert [st.name for st in result.sweep.strategies] == ["none", "tp-sp"]
    assert {result.row(i)["strategy"] for i in range(result.rows)} == {"none", "tp-sp"}
    with pytest.raises(ConfigError, match="does not run tp"):
        memcalc.sweep("mixtral-8x7b", s=1024, t=[1, 2], strategies="tp")
    with pytest.raises(ConfigError, match="does not run tp"):
        memcalc.estimate("mixtral-8x7b", strategy="tp", t=2)
    assert memcalc.estimate("mixtral-8x7b", strategy="tp-sp", t=2).per_layer_bytes > 0


def test_the_megatron_page_says_which_layout_it_does_not_run_and_why():
    page = impl_pages.render(MEGATRON)
    (line,) = [x for x in page.splitlines() if x.startswith("It does not run `tp`")]
    assert "with experts (num_experts set)" in line and "moe_layer.py" in line


def test_the_model_pages_moe_variants_leave_tp_out_and_say_why():
    variants = [v for v in model_page.VARIANTS if v.knobs.moe and v.knobs.impl == "megatron"]
    assert variants
    for v in variants:
        section = model_page._variant(v)
        assert "`tp` is left out: `--impl megatron` does not run it with experts" in section
        assert "| `tp` |" not in section and "| tensor | none | tp-sp |" in section
    hf_moe = [v for v in model_page.VARIANTS if v.knobs.moe and v.knobs.impl == "hf"]
    (hf,) = [v for v in hf_moe if not v.knobs.attention_sinks]  # transformers' experts
    section = model_page._variant(hf)
    assert "`tp-sp` is left out: `--impl hf` does not run it" in section and "| tensor | none | tp |" in section
    (gpt_oss,) = [v for v in hf_moe if v.knobs.attention_sinks]  # its plan shards no layer
    section = model_page._variant(gpt_oss)
    assert "`tp` is left out: `--impl hf` does not run it for gpt-oss" in section and "| tensor | none |" in section
    dense = model_page._variant(model_page.VARIANTS[0])
    assert "| `tp` |" in dense and "left out" not in dense
