"""Symbolic formulas: the seed's three exactly, knob variants from first principles,
and text / LaTeX / sympy output that reads back to the same expression."""

import pytest
import sympy
from sympy.parsing.latex import parse_latex

from memcalc.model import formula as F
from memcalc.config.schema import build_config
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.strategy import NONE, STRATEGIES, TP, TP_SP

from tests.helpers import SEED_TEXT, seed_bytes

b, s, h, a, t, g, f = (F.SYMBOLS[n] for n in "bshatgf")
SEED = {name: seed_bytes(name, b, s, h, a, t) for name in SEED_TEXT}

VARIANTS = [
    Knobs(), Knobs(mlp="swiglu", ffn_hidden_size=96), Knobs(attention="flash", num_query_groups=2), Knobs(norm="rmsnorm"),
    Knobs(dropout=0.0), Knobs(recompute="selective"), Knobs(recompute="full"), Knobs(dtype="fp32"),
]
ACCOUNTINGS = [Accounting(), Accounting(exact=True), Accounting(exact=True, device="cpu")]


def _total(strategy, knobs=Knobs(), accounting=Accounting()):
    return F.layer_formula(strategy, knobs, accounting).total


def _same(x, y) -> bool:
    # Every formula is a sum of monomials in b, s, h, a, t, g, f (powers may be negative),
    # so expanding the difference is enough to reach 0, and much faster than simplify.
    return sympy.expand(x - y) == 0


@pytest.mark.parametrize("name", SEED)
def test_default_formulas_are_the_seeds_exactly(name):
    assert sympy.simplify(_total(STRATEGIES[name]) - SEED[name]) == 0


@pytest.mark.parametrize("name", SEED)
def test_text_prints_the_seeds_notation(name):
    assert F.to_text(_total(STRATEGIES[name])) == SEED_TEXT[name]


def test_swiglu_with_ffn_f_saves_five_bsf_tensors_in_place_of_two():
    # gate, up, SiLU out, Megatron's copy of up and fc2's input: 5 x 2bsf, where GELU saved 2 x 2bsh*4.
    got = _total(NONE, Knobs(mlp="swiglu", ffn_hidden_size=96))
    assert _same(got, SEED["none"] - 16 * s * b * h + 10 * b * s * f)


def test_gqa_writes_k_and_v_with_g_groups_where_they_are_not_expanded():
    flash = Knobs(attention="flash")
    got = _total(TP, Knobs(attention="flash", num_query_groups=2))
    assert _same(got, _total(TP, flash) - 4 * s * b * h / t + 2 * 2 * b * s * g * (h / a) / t)
    assert _same(_total(TP, Knobs(num_query_groups=2)), SEED["tp"])  # eager: K and V copied to every head


def test_g_and_f_appear_only_when_the_config_sets_them():
    gqa_flash = Knobs(attention="flash", num_query_groups=2)
    assert _total(TP_SP).free_symbols == {b, s, h, a, t}
    assert _total(TP_SP, Knobs(attention="flash", num_query_groups=2, ffn_hidden_size=96)).free_symbols == {
        b, s, h, a, t, g, f,
    }
    assert F.symbols_in([_total(TP, gqa_flash)]) == ["b", "s", "h", "a", "t", "g"]


def test_exact_accounting_adds_norm_statistics_per_token():
    # Two LayerNorms keep an fp32 mean and rstd per token: 16 bytes per token, split by SP only.
    assert _same(_total(NONE, accounting=Accounting(exact=True)), SEED["none"] + 16 * b * s)
    assert _same(_total(TP_SP, accounting=Accounting(exact=True)), SEED["tp-sp"] + 16 * b * s / t)


def test_terms_sum_to_the_total_and_follow_the_ledger_order():
    lf = F.layer_formula(TP, Knobs(), Accounting())
    assert _same(sum(e for _, e in lf.terms), lf.total)
    assert [x.name for x, _ in lf.terms][:2] == ["ln1/input", "attention/qkv_in"]


@pytest.mark.parametrize("accounting", ACCOUNTINGS)
@pytest.mark.parametrize("knobs", VARIANTS)
def test_numbers_are_the_formula_evaluated_at_the_config(knobs, accounting):
    fields = dict(b=4, s=24, h=48, a=6, t=3, mlp=knobs.mlp, attention=knobs.attention, norm=knobs.norm,
                  dropout=knobs.dropout, recompute=knobs.recompute, dtype=knobs.dtype)
    fields |= {"ffn_hidden_size": 96} if knobs.ffn_set else {}
    fields |= {"num_query_groups": 3} if knobs.gqa else {}
    config = build_config(fields)
    values = {b: 4, s: 24, h: 48, a: 6, t: 3, f: 96, g: 3}
    for strategy in STRATEGIES.values():
        lf = F.layer_formula(strategy, knobs, accounting)
        result = estimate(config, strategy, accounting)
        for (x, expr), number in zip(lf.terms, result.tensors, strict=True):
            assert expr.subs(values) == number.bytes, (strategy.name, x.name)


def _from_latex(text: str) -> sympy.Expr:
    # parse_latex makes plain symbols; give them the package's assumptions before comparing.
    parsed = parse_latex(text, backend="antlr")
    return parsed.subs({sympy.Symbol(n): x for n, x in F.SYMBOLS.items()})


@pytest.mark.parametrize("name", SEED)
def test_latex_of_the_seed_formulas_parses_back_to_them(name):
    assert sympy.simplify(_from_latex(F.to_latex(_total(STRATEGIES[name]))) - SEED[name]) == 0


@pytest.mark.parametrize("knobs", [
    Knobs(mlp="swiglu", ffn_hidden_size=96, num_query_groups=2, attention="flash", dtype="fp32"),
    Knobs(dropout=0.0, norm="rmsnorm"),
    Knobs(recompute="full"),
])
def test_latex_of_knob_variants_totals_parses_back(knobs):
    for strategy in STRATEGIES.values():
        expr = _total(strategy, knobs, Accounting(exact=True))
        assert _same(_from_latex(F.to_latex(expr)), expr), F.to_latex(expr)


@pytest.mark.parametrize("knobs", [Knobs(), Knobs(mlp="swiglu", attention="flash", num_query_groups=2, ffn_hidden_size=96)])
def test_latex_of_every_tensors_term_parses_back(knobs):
    # TP has both kinds of term: split by t and replicated.
    for x, expr in F.layer_formula(TP, knobs, Accounting(exact=True)).terms:
        assert _same(_from_latex(F.to_latex(expr)), expr), (x.name, F.to_latex(expr))


def test_latex_is_bare_math_to_paste_inside_a_math_environment():
    text = F.to_latex(_total(TP))
    assert "$" not in text and "\n" not in text
    assert text.count("{") == text.count("}")
    assert text.startswith("s b h") and "\\frac{24}{t}" in text


@pytest.mark.parametrize("knobs", VARIANTS)
def test_plain_output_is_python_that_sympy_reads_back(knobs):
    for strategy in STRATEGIES.values():
        expr = _total(strategy, knobs)
        assert _same(sympy.sympify(F.to_plain(expr), locals=F.SYMBOLS), expr)


def test_plain_output_reads_back_with_a_bare_sympify_even_where_a_name_is_sympys_own():
    # E (routed experts) is Euler's number to a bare sympify: written Symbol('E'), it stays the experts' count
    expr = F.SBH * (4 * F.E / F.h + 2 * F.k)
    text = F.to_plain(expr)
    assert "Symbol('E')" in text
    assert _same(sympy.sympify(text).subs({sympy.Symbol(n): x for n, x in F.SYMBOLS.items()}), expr)
    assert [n for n in F.SYMBOLS if sympy.sympify(n) != sympy.Symbol(n)] == sorted(F._READ_OTHERWISE)


def test_text_wraps_compound_denominators_and_writes_powers():
    assert F.to_text(F.SBH * (3 * a**2 / h**2 + 2 / (3 * t) + 1)) == "sbh(1 + 2/(3t) + 3a^2/(h^2))"


def test_text_of_a_bare_constant_keeps_the_sbh_prefix():
    assert F.to_text(_total(NONE, Knobs(recompute="selective"))) == "sbh(34)"
