"""Symbolic formulas from the ledger: per tensor, per layer, printed like the seed's `sbh(34/t + 5as/(ht))`.

A tensor's term is `memcalc.model.evaluate`'s rule on sympy symbols. sympy takes about a second to import, so only
this module imports it, and only the commands that print formulas import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import Callable

import sympy
from sympy.printing.str import StrPrinter

from memcalc.model.impls import layer_tensors, plan, size_rule, tensors_at
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.ledger import Dim, SavedTensor
from memcalc.model.strategy import Strategy

# Symbols, made once; LaTeX names are the same letters.
b, s, h, a, t, g, d, f, v = sympy.symbols("b s h a t g d f v", positive=True, integer=True)
E, k, e, u, ep = sympy.symbols("E k e u ep", positive=True, integer=True)  # mixture of experts
c = sympy.Symbol("c", positive=True)  # the capacity factor, not a whole number
r_q, r_kv, d_r, d_n, d_v = sympy.symbols("r_q r_kv d_r d_n d_v", positive=True, integer=True)  # latent attention
SYMBOLS: dict[str, sympy.Symbol] = {
    str(x): x for x in (b, s, h, a, t, g, d, f, v, E, k, e, u, c, ep, r_q, r_kv, d_r, d_n, d_v)
}
SBH = s * b * h
MEANINGS = {
    "b": "micro-batch size", "s": "sequence length", "h": "hidden size", "a": "attention heads",
    "t": "tensor-parallel size", "g": "K/V groups (num_query_groups)",
    "d": "channels of each attention head (kv_channels; h/a unless set)", "f": "MLP hidden size (ffn_hidden_size)",
    "v": "vocabulary size", "E": "routed experts (num_experts)", "k": "experts per token (moe_router_topk)",
    "e": "one expert's MLP hidden size (moe_ffn_hidden_size)",
    "u": "shared experts' MLP hidden size (moe_shared_expert_intermediate_size)",
    "c": "expert capacity factor (moe_expert_capacity_factor; the formula leaves out rounding up)",
    "ep": "expert-parallel size (the worst case holds while k*ep <= E)",
    "r_q": "query latent width (q_lora_rank)", "r_kv": "key/value latent width (kv_lora_rank)",
    "d_r": "RoPE channels of a query/key head (qk_rope_head_dim)",
    "d_n": "channels of a query/key head without RoPE (qk_nope_head_dim)", "d_v": "value head channels (v_head_dim)",
}


# The dimensions that are not a symbol of their own, in symbols, given the knobs.
_DIM_EXPRS: dict[Dim, Callable[[Knobs], sympy.Expr]] = {
    Dim.D: lambda kn: d if kn.head_dim_set else h / a,
    Dim.G: lambda kn: g if kn.gqa else a,
    Dim.F: lambda kn: f if kn.ffn_set else 4 * h,
    Dim.QKV: lambda kn: a + 2 * dim_expr(Dim.G, kn),
    Dim.S1: lambda kn: s + 1,
    Dim.HALF_D: lambda kn: dim_expr(Dim.D, kn) / 2,
    Dim.QK: lambda kn: d_n + d_r,
    Dim.KVD: lambda kn: r_kv + d_r,
    Dim.NV: lambda kn: d_n + d_v,
    Dim.FE: lambda kn: e if kn.moe_ffn_hidden_size is not None else dim_expr(Dim.F, kn),
    Dim.R: lambda kn: routed_slots_expr(kn),
    Dim.EL: lambda kn: E / ep,
    # the slots a group's own tokens keep (evaluate.routed_slots' own bound; the capacity factor's without its rounding
    # and cap)
    Dim.RS: lambda kn: (c if kn.moe_expert_capacity_factor is not None else 1) * k * b * s,
}


def dim_expr(dim: Dim, knobs: Knobs) -> sympy.Expr:
    """A dimension in symbols: g, d and f appear only when the config sets them."""
    expr = _DIM_EXPRS.get(dim)
    return SYMBOLS[dim.value] if expr is None else expr(knobs)


def routed_slots_expr(knobs: Knobs) -> sympy.Expr:
    """r, the slots a rank's experts receive, under the knobs' bound (evaluate.routed_slots without its rounding up to
    whole slots a rank and an expert, or its cap of one slot a token)."""
    bound, capped = knobs.moe_tokens, knobs.moe_expert_capacity_factor is not None
    if bound == "capacity" or (capped and (bound == "worst" or knobs.moe_pad_expert_input_to_capacity)):
        return c * k * b * s
    return (ep if bound == "worst" else 1) * k * b * s


def tensor_expr(tensor: SavedTensor, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> sympy.Expr:
    """Bytes one rank keeps for `tensor`, as an expression."""
    split = strategy.split_dim(tensor)
    width = element_bytes(tensor.kind, knobs, accounting)
    return width * prod((dim_expr(d, knobs) / (t if d is split else 1) for d in tensor.shape), start=sympy.Integer(1))


@dataclass(frozen=True)
class LayerFormula:
    """A strategy's per-layer formula and the term of each tensor in it."""

    strategy: Strategy
    terms: tuple[tuple[SavedTensor, sympy.Expr], ...]

    @property
    def total(self) -> sympy.Expr:
        return sympy.Add(*(expr for _, expr in self.terms))


@lru_cache(maxsize=None)
def layer_formula(strategy: Strategy, knobs: Knobs, accounting: Accounting, outside: bool = False) -> LayerFormula:
    """The layer's formula under `strategy` (as the knobs' implementation lays it out), built from the ledger:
    where its size rule's kernel runs, or with `outside` where it does not (`window`)."""
    rule = size_rule(knobs)
    kept = rule.outside(knobs, accounting) if outside and rule is not None else layer_tensors(knobs, accounting)
    return _formula(strategy, knobs, accounting, kept)


def formula_at(strategy: Strategy, knobs: Knobs, accounting: Accounting, sizes: dict[Dim, int], t: int) -> LayerFormula:
    """The formula that holds at per-rank `sizes` (b, s, a, g) on t ranks: built from what the layer keeps there
    (`tensors_at`, as `estimate` asks: the size rule's set, each size condition's branch), so that evaluated at
    those sizes it is estimate's number."""
    return _formula(strategy, knobs, accounting, tensors_at(knobs, accounting, sizes, strategy.weight_shards(t)))


def _formula(strategy: Strategy, knobs: Knobs, accounting: Accounting, kept: tuple[SavedTensor, ...]) -> LayerFormula:
    """The terms of the tensors `kept`, as the knobs' implementation lays `strategy` out."""
    planned = plan(knobs, strategy)
    return LayerFormula(strategy, tuple((x, tensor_expr(x, planned, knobs, accounting)) for x in planned.kept(kept)))


def outside_at(knobs: Knobs, strategy: Strategy, sizes: dict[Dim, int], t: int) -> bool:
    """Whether per-rank `sizes` (b, s, a, g) under `strategy` on t ranks fall outside the window: which formula holds."""
    rule = size_rule(knobs)
    return rule is not None and not rule.runs_at(knobs, sizes, strategy.weight_shards(t))


def _monomials(expr: sympy.Expr) -> list[tuple[sympy.Rational, list[tuple[str, int]], list[tuple[str, int]]]]:
    """expr/(sbh) as (coefficient, numerator powers, denominator powers) per term, seed order."""
    out = []
    for term in sympy.Add.make_args(sympy.expand(expr / SBH)):
        coeff, rest = term.as_coeff_Mul()
        powers = sorted((str(k), int(v)) for k, v in rest.as_powers_dict().items() if k != 1)
        num = [(n, e) for n, e in powers if e > 0]
        den = [(n, -e) for n, e in powers if e < 0]
        out.append((sympy.Rational(coeff), num, den))
    return sorted(out, key=lambda m: (len(m[1]), len(m[2]), m[1], m[2]))


def _text_factor(coeff: int, powers: list[tuple[str, int]]) -> str:
    names = [n if e == 1 else f"{n}^{e}" for n, e in powers]
    # a subscripted name is written apart from its neighbours: a*d_v, not ad_v
    syms = "".join(("*" if i and "_" in names[i - 1] + n else "") + n for i, n in enumerate(names))
    return syms if coeff == 1 and syms else f"{coeff}{syms}"


def to_text(expr: sympy.Expr) -> str:
    """'sbh(34/t + 5as/(ht))': the seed's grouped, implicit-product notation."""
    parts = []
    for coeff, num, den in _monomials(expr):
        top, bottom = _text_factor(coeff.p, num), _text_factor(coeff.q, den)
        if bottom == "1":
            parts.append(top)
        else:
            wrap = len(den) + (coeff.q != 1) > 1 or any(e > 1 for _, e in den)
            parts.append(f"{top}/({bottom})" if wrap else f"{top}/{bottom}")
    return f"sbh({' + '.join(parts)})"


def latex_name(name: str) -> str:
    """A symbol's LaTeX: r_kv as r_{kv}."""
    base, _, sub = name.partition("_")
    return f"{base}_{{{sub}}}" if sub else name


def _latex_factor(coeff: int, powers: list[tuple[str, int]]) -> str:
    syms = [latex_name(n) if e == 1 else f"{latex_name(n)}^{{{e}}}" for n, e in powers]
    return " ".join(syms if coeff == 1 and syms else [str(coeff), *syms])


def to_latex(expr: sympy.Expr) -> str:
    """The same grouping as `to_text`, as LaTeX math: s b h \\left(... \\right)."""
    parts = []
    for coeff, num, den in _monomials(expr):
        top, bottom = _latex_factor(coeff.p, num), _latex_factor(coeff.q, den)
        parts.append(top if bottom == "1" else f"\\frac{{{top}}}{{{bottom}}}")
    return f"s b h \\cdot \\left({' + '.join(parts)}\\right)"


class _PlainPrinter(StrPrinter):
    """sympy's own printer, but a symbol whose bare name sympy reads as something else (E: Euler's number) is
    written Symbol('E'), so that a plain sympy.sympify of the text gives back the formula, not a wrong number."""

    def _print_Symbol(self, expr: sympy.Symbol) -> str:
        return f"Symbol({expr.name!r})" if expr.name in _READ_OTHERWISE else expr.name


_READ_OTHERWISE = frozenset({"E"})  # sympy's namespace names it too (tests pin that no other symbol is read so)


def to_plain(expr: sympy.Expr) -> str:
    """sympy's own string of the factored expression, for pasting into Python or reading with sympy.sympify."""
    return _PlainPrinter().doprint(SBH * sympy.expand(expr / SBH))


def symbols_in(exprs: list[sympy.Expr]) -> list[str]:
    """The symbols the expressions use, in the order of MEANINGS."""
    used = set().union(*(e.free_symbols for e in exprs))
    return [n for n in MEANINGS if SYMBOLS[n] in used]
