"""`--impl paper` is Korthikanti et al.'s accounting at every shape: the seed's closed formulas, to the byte; and
every other implementation departs from it only by what its departures name."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.departures import compare_with_paper
from memcalc.model.evaluate import estimate
from memcalc.model.impls.megatron import fused_softmax_runs
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Dim
from memcalc.model.strategy import STRATEGIES

from tests.helpers import seed_bytes


@st.composite
def shapes(draw):
    """Any valid b, s, h, a, t: t divides a (heads), h (a*d) and s (SP's shards)."""
    t = draw(st.sampled_from([1, 2, 3, 4, 8]))
    a = t * draw(st.integers(1, 8))
    d = draw(st.integers(1, 64))
    return dict(b=draw(st.integers(1, 16)), s=t * draw(st.integers(1, 1024)), h=a * d, a=a, t=t)


@settings(max_examples=300, deadline=None)
@given(shapes(), st.sampled_from(["none", "selective", "full"]), st.sampled_from(["bf16", "fp16"]),
       st.sampled_from([0.1, 0.5]))
def test_the_paper_is_the_seeds_three_formulas_at_every_shape(fields, recompute, dtype, dropout):
    config = build_config(fields | dict(impl="paper", recompute=recompute, dtype=dtype, dropout=dropout))
    for name in ("none", "tp", "tp-sp"):
        assert estimate(config, STRATEGIES[name]).per_layer_bytes == seed_bytes(name, **fields, recompute=recompute), name


@pytest.mark.parametrize("knob", [
    {"mlp": "swiglu"}, {"mlp": "gelu_tanh"}, {"attention": "flash"}, {"num_query_groups": 2}, {"kv_channels": 8},
    {"qk_layernorm": True}, {"norm": "rmsnorm"}, {"ffn_hidden_size": 96}, {"dtype": "fp32"}, {"dropout": 0.0},
    {"num_experts": 4}, {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4},
    {"cp": 2}, {"recompute": "op"}, {"bias_activation_fusion": True}, {"attention_softmax_in_fp32": True},
    {"masked_softmax_fusion": False},
], ids=lambda k: next(iter(k)))
def test_the_paper_refuses_a_knob_it_does_not_model_naming_it(knob):
    with pytest.raises(ConfigError, match=next(iter(knob))):
        build_config(dict(impl="paper", b=1, s=32, h=64, a=4) | knob)


def test_the_paper_takes_heads_of_h_over_a_and_an_mlp_of_4h_said_outright():
    said = build_config(dict(impl="paper", b=1, s=32, h=64, a=4, num_query_groups=4, kv_channels=16,
                             ffn_hidden_size=256))
    assert estimate(said, STRATEGIES["none"]).per_layer_bytes == seed_bytes("none", 1, 32, 64, 4, 1)


@st.composite
def megatron_shapes(draw):
    """The seed's layer under megatron-core, at sizes inside and outside its fused softmax's window."""
    fields = draw(shapes())
    return fields | dict(s=fields["t"] * draw(st.integers(1, 1100)) if draw(st.booleans()) else fields["s"])


@settings(max_examples=200, deadline=None)
@given(megatron_shapes(), st.booleans(), st.booleans(), st.booleans())
def test_megatron_is_the_paper_inside_its_fused_window_and_its_departures_add_up_outside(
    fields, exact, in_fp32, fusion,
):
    config = build_config(fields | dict(attention_softmax_in_fp32=in_fp32, masked_softmax_fusion=fusion))
    accounting = Accounting(exact=exact)
    for name in ("none", "tp", "tp-sp"):
        strategy = STRATEGIES[name]
        mine = estimate(config, strategy, accounting)
        compared = compare_with_paper(config, mine, accounting)
        paper = estimate(build_config(fields | {"impl": "paper"}), strategy, accounting)
        assert compared.paper.per_layer_bytes == paper.per_layer_bytes
        assert sum(d.bytes for d in compared.departures) == mine.per_layer_bytes - paper.per_layer_bytes
        t = fields["t"] if strategy.tensor_parallel else 1
        window = fusion and fused_softmax_runs({Dim.B: fields["b"], Dim.A: fields["a"], Dim.S: fields["s"]}, t)
        # outside the window: the mask (none for one query: megatron builds no causal mask at s = 1), and an fp32
        # softmax in place of the 16-bit one where asked for
        mask = {"attention/causal_mask"} if fields["s"] > 1 else set()
        moved = set() if window else mask | ({"attention/softmax_fp32", "attention/softmax_out"} if in_fp32 else set())
        assert {n for d in compared.departures for n, _ in d.tensors} == moved, name
        if moved and fusion:  # all by the size rule, in its words
            (departure,) = compared.departures
            assert "fused softmax window" in departure.rule


def test_a_departure_says_which_sizes_miss_the_window():
    config = build_config(dict(b=1, s=96, h=768, a=12, t=2, attention_softmax_in_fp32=True))
    tp = estimate(config, STRATEGIES["tp"])
    (departure,) = compare_with_paper(config, tp, Accounting()).departures
    assert departure.rule.startswith("b*a/t=1*12/2=6 is not a multiple of 8: outside megatron-core's fused softmax")
    # the fp32 softmax (4 B) in place of the 16-bit one (2 B), for 6 heads of 96 x 96, and the 96 x 96 mask
    assert departure.bytes == 6 * 96 * 96 * (4 - 2) + 96 * 96 == 119_808


def test_a_layer_the_paper_does_not_model_is_compared_with_nothing_and_says_why():
    config = build_config(dict(b=1, s=64, h=64, a=4, mlp="swiglu"))
    compared = compare_with_paper(config, estimate(config, STRATEGIES["none"]), Accounting())
    assert compared.paper is None and compared.not_modelled == "mlp=swiglu is outside the paper's layer"
