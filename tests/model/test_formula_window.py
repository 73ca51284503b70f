"""formula = estimate: the formula `memcalc formula` prints for given sizes, evaluated there, is `estimate`'s number,
for every implementation and layout, at shapes where a kernel's window of sizes matters (b = 1, odd s <= 16)."""

import sympy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model import formula as F
from memcalc.model.evaluate import estimate
from memcalc.model.impls import IMPLEMENTATIONS
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import Dim
from memcalc.model.strategy import STRATEGIES


@st.composite
def layers(draw):
    """An implementation, a layout and a small shape of any ratio of heads to K/V groups."""
    strategy = draw(st.sampled_from(list(STRATEGIES)))
    t = 1 if strategy == "tp-sp" else draw(st.sampled_from([1, 2]))  # odd s: SP's shards need t = 1
    groups = t * draw(st.integers(1, 3))
    a = groups * draw(st.sampled_from([1, 2, 3, 4]))  # a/g heads per K/V group
    fields = dict(
        impl=draw(st.sampled_from(list(IMPLEMENTATIONS))), b=1, s=draw(st.integers(0, 7)) * 2 + 1, a=a,
        num_query_groups=groups, h=a * draw(st.integers(1, 4)) * 2, t=t,
        attention=draw(st.sampled_from(["eager", "flash"])), dropout=draw(st.sampled_from([0.0, 0.1])),
    )
    try:
        config = build_config(fields)
        knobs = Knobs.of(config)
        IMPLEMENTATIONS[config.impl].refusal(knobs, strategy) is None or assume(False)
    except ConfigError:
        assume(False)
    return config, strategy


@settings(max_examples=150, deadline=None)
@given(layers(), st.booleans())
def test_the_formula_that_holds_at_the_sizes_evaluates_to_estimate(layer, exact):
    config, name = layer
    knobs, strategy, accounting = Knobs.of(config), STRATEGIES[name], Accounting(exact=exact)
    sizes = {Dim.B: config.b, Dim.S: config.s, Dim.A: config.a, Dim.G: config.groups}
    formula = F.formula_at(strategy, knobs, accounting, sizes, config.t)
    values = {F.b: config.b, F.s: config.s, F.h: config.h, F.a: config.a, F.t: config.t, F.g: config.groups,
              F.d: config.head_dim, F.f: config.ffn}
    assert formula.total.subs(values) == sympy.Integer(estimate(config, strategy, accounting).per_layer_bytes)
