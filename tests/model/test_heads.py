"""Heads of their own width (kv_channels, transformers' head_dim) and a norm on each query and key head
(qk_layernorm): numbers, formulas, rules and parameters, with every existing number unchanged by default."""

from __future__ import annotations

import pytest
import sympy
from sympy.parsing.latex import parse_latex

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model import formula as F
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.states import total_params
from memcalc.sizing.sweep import evaluate_sweep, make_sweep

SIZES = dict(b=4, s=32, h=48, a=4, t=2, L=2)  # b*a/t a multiple of 8: megatron's fused softmax runs
QWEN3 = dict(kv_channels=16, qk_layernorm=True, num_query_groups=2, mlp="swiglu", norm="rmsnorm", dropout=0.0)
ACCOUNTINGS = [Accounting(), Accounting(exact=True), Accounting(exact=True, device="cpu")]


def _bytes(config, accounting=Accounting()):
    return {name: estimate(config, st, accounting).per_layer_bytes for name, st in STRATEGIES.items()}


def test_heads_of_h_over_a_are_plain_heads_whatever_says_so():
    plain, said = build_config(SIZES), build_config(SIZES | {"kv_channels": 12})
    assert Knobs.of(said) == Knobs.of(plain) and not said.head_dim_set
    assert _bytes(said, Accounting(exact=True)) == _bytes(plain, Accounting(exact=True))
    assert total_params(said) == total_params(plain)


@pytest.mark.parametrize("accounting", ACCOUNTINGS)
@pytest.mark.parametrize("knobs", [QWEN3, {"kv_channels": 5}, QWEN3 | {"norm": "layernorm", "dropout": 0.1},
                                   QWEN3 | {"recompute": "selective"}, {"qk_layernorm": True, "attention": "flash"}])
def test_numbers_are_the_formula_with_d_evaluated_at_the_config(knobs, accounting):
    config = build_config(SIZES | knobs)
    values = {F.b: 4, F.s: 32, F.h: 48, F.a: 4, F.t: 2, F.g: 2, F.d: knobs.get("kv_channels", 12)}
    if knobs.get("num_query_groups") == 2:  # formulas assume several K/V groups per rank (megatron's CONDITIONS)
        config, values[F.t] = build_config(SIZES | knobs | {"t": 1}), 1
    for strategy in STRATEGIES.values():
        lf = F.layer_formula(strategy, Knobs.of(config), accounting)
        result = estimate(config, strategy, accounting)
        for (x, expr), number in zip(lf.terms, result.tensors, strict=True):
            assert expr.subs(values) == number.bytes, (strategy.name, x.name)


def test_the_formula_writes_d_only_where_heads_are_not_h_over_a():
    text = F.to_text(F.layer_formula(STRATEGIES["tp"], Knobs(kv_channels=128), Accounting()).total)
    assert text == "sbh(10 + 16/t + 8ad/(ht) + 5as/(ht))"
    assert "d" not in F.to_text(F.layer_formula(STRATEGIES["tp"], Knobs(), Accounting()).total)


def test_qk_layernorm_adds_a_copy_of_q_and_k_to_megatrons_layer():
    terms = dict((x.name, F.to_text(e)) for x, e in F.layer_formula(STRATEGIES["tp-sp"], Knobs(
        qk_layernorm=True, num_query_groups=8), Accounting()).terms)
    assert (terms["attention/q_norm_input"], terms["attention/k_norm_input"]) == ("sbh(2/t)", "sbh(2g/(at))")


def test_latex_with_d_parses_back():
    expr = F.layer_formula(STRATEGIES["tp-sp"], Knobs(**QWEN3), Accounting(exact=True)).total
    parsed = parse_latex(F.to_latex(expr), backend="antlr")
    # the parser reads "d g" as one differential symbol "dg": split it back into the product it is
    split = {x: F.d * F.SYMBOLS[x.name[1:]] for x in parsed.free_symbols if x.name not in F.SYMBOLS}
    parsed = parsed.subs(split).subs({sympy.Symbol(n): x for n, x in F.SYMBOLS.items()})
    assert sympy.simplify(parsed - expr) == 0


def test_heads_of_their_own_width_need_not_divide_h():
    with pytest.raises(ConfigError, match=r"h=50 is not divisible by a=4 \(each head gets h/a channels unless"):
        build_config(SIZES | {"h": 50})
    assert build_config(SIZES | {"h": 50, "kv_channels": 16}).head_dim == 16


def test_a_sweep_with_kv_channels_gives_what_estimate_gives_at_each_point():
    fields = SIZES | QWEN3
    result = evaluate_sweep(make_sweep(fields, {"h": (48, 50, 96), "t": (1, 2)}, None, Accounting()))
    assert not result.skipped  # kv_channels lifts a | h; t | a and t | g hold everywhere
    for i in range(result.rows):
        row = result.row(i)
        config = build_config(fields | {k: row[k] for k in ("b", "s", "h", "a", "t", "L")})
        assert row["per_layer_bytes"] == estimate(config, STRATEGIES[row["strategy"]]).per_layer_bytes


def test_q_k_v_and_the_projection_are_a_d_wide_and_the_qk_norms_d_wide_per_layer():
    config = build_config(SIZES | QWEN3 | {"add_bias_linear": False, "t": 1})
    plain = build_config(SIZES | {k: v for k, v in QWEN3.items() if k not in ("kv_channels", "qk_layernorm")}
                         | {"add_bias_linear": False, "t": 1})
    h, a, g, d, L = 48, 4, 2, 16, 2
    qkv_proj = h * (a + 2 * g) * d + a * d * h
    assert total_params(config) - total_params(plain) == L * (qkv_proj - h * (a + 2 * g) * 12 - h * h + 2 * d)


@pytest.mark.parametrize("impl, knobs, words", [
    ("torchtitan", {"kv_channels": 16}, "impl torchtitan: kv_channels 16 .* its Qwen3 model's head_dim, whose"
     " attention has q_norm and k_norm; set qk_layernorm"),
    ("megatron", {"qk_layernorm": True, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                  "v_head_dim": 4}, "qk_layernorm with kv_lora_rank"),
])
def test_what_an_implementation_does_not_model_is_refused_by_name(impl, knobs, words):
    with pytest.raises(ConfigError, match=words):
        build_config(SIZES | {"impl": impl} | knobs)


@pytest.mark.parametrize("knobs", [{"qk_layernorm": True}, {"qk_layernorm": True, "kv_channels": 16}])
def test_torchtitans_qwen3_attention_is_accepted_with_heads_of_h_over_a_or_of_kv_channels(knobs):
    config = build_config(SIZES | {"impl": "torchtitan"} | knobs)
    assert config.qk_layernorm and config.head_dim == knobs.get("kv_channels", config.h // config.a)


@pytest.mark.parametrize("knobs", [{"kv_channels": 5}, {"kv_channels": 3}, {"kv_channels": 1}, {"h": 20, "kv_channels": None}])
def test_transformers_rope_on_whole_heads_of_odd_width_is_refused(knobs):
    """transformers refuses d = 5 (its RoPE validation), fails at d = 3 and rotates a wider table at d = 1."""
    with pytest.raises(ConfigError, match=r"RoPE on whole heads needs an even head width: d = \d+ is odd"):
        build_config(SIZES | QWEN3 | {"impl": "hf", "family": "qwen3", "num_query_groups": None} | knobs)


def test_transformers_rope_on_a_share_of_an_odd_rotary_width_is_accepted():
    """GLM rotates int(6 * 0.5) = 3 channels of each head, rounded up within it (measured to the byte)."""
    config = build_config(SIZES | {"impl": "hf", "family": "glm", "norm": "rmsnorm", "mlp": "swiglu",
                                   "rotary_percent": 0.5, "kv_channels": 6})
    assert config.head_dim == 6


def test_the_families_said_to_want_a_dividing_h_are_those_whose_config_class_refuses_it():
    """`_A_DIVIDES_H` against transformers itself: each family the probe builds, at h = 12 and a = 8."""
    transformers = pytest.importorskip("transformers")
    from huggingface_hub.errors import StrictDataclassClassValidationError

    from memcalc.model.families import FAMILIES
    from memcalc.model.impls.hf import _A_DIVIDES_H

    def refuses(family):
        try:
            getattr(transformers, family.config_class)(hidden_size=12, num_attention_heads=8)
        except StrictDataclassClassValidationError:
            return True
        return False

    built = [family for family in FAMILIES.values() if family.when is not None]
    assert [family.name for family in built if refuses(family)] == list(_A_DIVIDES_H)


def test_heads_of_kv_channels_that_do_not_tile_h_are_refused_where_the_config_class_refuses_them():
    llama = SIZES | {"impl": "hf", "norm": "rmsnorm", "mlp": "swiglu", "h": 50, "kv_channels": 12, "dropout": 0.0}
    with pytest.raises(ConfigError, match="LlamaConfig wants h divisible by a whatever head_dim: h=50 is not"):
        build_config(llama)
    assert build_config(llama | {"qk_layernorm": True, "family": "qwen3"}).head_dim == 12  # Qwen3Config takes them
