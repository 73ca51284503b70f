"""fit's answers are exact: the answer fits by per_gpu (estimate's totals), the next valid value does not,
and brute force over every candidate finds nothing better."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.sizing.fit import Candidate, _largest, fit
from memcalc.model.strategy import STRATEGIES, TP, TP_SP
from memcalc.sizing.timeline import timelines
from memcalc.sizing.totals import per_gpu

GPT = dict(b=1, s=256, h=32, a=16, t=4, L=8, vocab_size=1000, position_embedding_type="rope")  # every b fills a softmax block
LAYOUTS = [{}, {"pp": 2}, {"pp": 2, "vpp": 2, "dp": 4, "distributed_optimizer": True}]
RECOMPUTES = ["none", "selective", "full"]


def _needs(fields: dict, strategy, count="total") -> int | None:
    """What per_gpu says the config needs, or None if the config is invalid."""
    try:
        return per_gpu(build_config(fields), strategy).bytes(count)
    except ConfigError:
        return None


@settings(max_examples=25, deadline=None)
@given(budget=st.integers(2**20, 2**32), layout=st.sampled_from(LAYOUTS), recompute=st.sampled_from(RECOMPUTES),
       name=st.sampled_from(list(STRATEGIES)))
def test_b_is_where_the_linear_total_crosses_the_budget(budget, layout, recompute, name):
    """Each stage needs fixed + b * per_b; the answer is the largest b every stage fits."""
    fields = GPT | layout | {"recompute": recompute}
    strategy = STRATEGIES[name]
    one, two = (per_gpu(build_config(fields | {"b": b}), strategy).stages for b in (1, 2))
    lines = [(2 * x.bytes() - y.bytes(), y.bytes() - x.bytes()) for x, y in zip(one, two)]  # (fixed, per_b)
    expected = min((budget - fixed) // per_b for fixed, per_b in lines)
    got = fit(build_config(fields), strategy, "b", budget, count="total")
    assert (got.answer.value if got.answer else 0) == max(expected, 0)
    if got.answer:
        assert got.answer.bytes == _needs(fields | {"b": expected}, strategy) <= budget
    assert got.beyond.value == max(expected, 0) + 1 and got.beyond.bytes > budget


@settings(max_examples=20, deadline=None)
@given(budget=st.integers(2**22, 2**31), cp=st.sampled_from([1, 2]), name=st.sampled_from(["none", "tp", "tp-sp"]))
def test_s_is_the_largest_valid_length_that_fits(budget, cp, name):
    fields = GPT | {"cp": cp, "attention": "flash"}
    strategy = STRATEGIES[name]
    got = fit(build_config(fields), strategy, "s", budget, count="total")
    if got.answer is None:
        lowest = min(s for s in range(1, 64) if _needs(fields | {"s": s}, strategy) is not None)
        assert got.beyond.value == lowest and got.beyond.bytes > budget
        return
    answer = got.answer.value
    assert got.answer.bytes == _needs(fields | {"s": answer}, strategy) <= budget
    for s in range(answer + 1, got.beyond.value + 1):  # everything up to the next candidate: invalid or too big
        needs = _needs(fields | {"s": s}, strategy)
        assert needs is None or needs > budget, s
    assert _needs(fields | {"s": got.beyond.value}, strategy) is not None


def test_s_stops_at_a_learned_position_table():
    fields = GPT | {"s": 64, "position_embedding_type": "learned_absolute", "max_position_embeddings": 128}
    got = fit(build_config(fields), TP_SP, "s", 2**40, count="total")
    assert got.answer.value == 128
    assert got.beyond.bytes is None and "exceeds max_position_embeddings=128" in got.beyond.reason


@pytest.mark.parametrize("budget", [2**20, 6 * 2**20, 2**22, 2**24, 2**30])
@pytest.mark.parametrize("strategy", [TP, TP_SP], ids=lambda x: x.name)
def test_t_is_the_smallest_valid_divisor_that_fits(budget, strategy):
    fields = GPT | {"s": 36, "L": 4}  # s = 36: tp-sp cannot use t = 8
    candidates = {t: _needs(fields | {"t": t}, strategy) for t in range(1, 9)}
    fitting = [t for t, n in candidates.items() if n is not None and n <= budget]
    got = fit(build_config(fields), strategy, "t", budget, count="total")
    if fitting:
        assert got.answer.value == fitting[0] and got.answer.bytes == candidates[fitting[0]]
        below = [t for t, n in candidates.items() if n is not None and t < fitting[0]]
        assert (got.beyond.value if got.beyond else None) == (below[-1] if below else None)
    else:
        assert got.answer is None
        assert got.beyond.bytes == min(n for n in candidates.values() if n is not None)


MOE = GPT | {"num_experts": 8, "moe_router_topk": 2, "dp": 8, "add_bias_linear": False}  # none at etp > 1


@pytest.mark.parametrize("tokens", ["balanced", "worst"])  # worst: the slots received grow with ep
def test_ep_is_the_smallest_divisor_of_the_experts_that_fits(tokens):
    fields = MOE | {"moe_tokens": tokens}
    candidates = {ep: _needs(fields | {"ep": ep}, TP_SP) for ep in range(1, 9)}
    assert candidates[3] is None  # ep must divide E
    for budget in sorted({n for n in candidates.values() if n is not None} | {0}):
        fitting = [ep for ep, n in candidates.items() if n is not None and n <= budget]
        got = fit(build_config(fields), TP_SP, "ep", budget, count="total")
        if fitting:
            assert got.answer.value == fitting[0] and got.answer.bytes == candidates[fitting[0]]
        else:
            assert got.answer is None and got.beyond.bytes == min(n for n in candidates.values() if n is not None)


def test_solving_for_ep_without_experts_is_refused():
    with pytest.raises(ConfigError, match="no experts"):
        fit(build_config(GPT), TP_SP, "ep", 2**30)


def test_nothing_fits_reports_the_cheapest_candidate():
    got = fit(build_config(GPT), TP_SP, "b", 1000, count="total")
    assert got.answer is None and (got.beyond.value, got.beyond.bytes) == (1, _needs(GPT, TP_SP))


def test_counting_activations_only_leaves_the_model_states_out():
    budget = _needs(GPT | {"b": 6}, TP_SP, "activations")  # six micro-batches' activations exactly: no room for states
    total = fit(build_config(GPT), TP_SP, "b", budget, count="total")
    acts = fit(build_config(GPT), TP_SP, "b", budget, count="activations")
    assert acts.answer.value > total.answer.value
    assert acts.answer.bytes == _needs(GPT | {"b": acts.answer.value}, TP_SP, "activations") <= budget


def _peak(fields: dict, strategy) -> int:
    """The most loaded stage's step peak (memcalc.sizing.timeline), what estimate's verdict counts."""
    return max(x.peak.bytes for x in timelines(build_config(fields), strategy))


@pytest.mark.parametrize("solve, layout", [("b", {}), ("b", {"pp": 2}), ("s", {"pp": 2, "vpp": 2}), ("t", {})])
def test_counting_the_peak_the_answer_fits_and_the_next_candidate_does_not(solve, layout):
    fields = GPT | layout
    budget = (_peak(fields | {"b": 3}, TP_SP) + _peak(fields | {"b": 4}, TP_SP)) // 2  # room for b = 3, not 4
    got = fit(build_config(fields), TP_SP, solve, budget)  # the peak is the default count, as estimate's verdict
    assert got.answer.basis == got.beyond.basis == "the step's peak"
    assert got.answer.bytes == _peak(fields | {solve: got.answer.value}, TP_SP) <= budget
    assert got.beyond.bytes == _peak(fields | {solve: got.beyond.value}, TP_SP) > budget
    if solve == "b":
        assert got.answer.value == 3


def test_counting_the_peak_falls_back_on_the_total_where_the_step_is_not_modelled_and_says_so():
    fields = GPT | {"cp": 2, "attention": "flash"}  # context parallelism: not in the step timeline yet
    got = fit(build_config(fields), TP_SP, "b", 2**30)
    assert got.answer.basis == "states + saved activations"
    assert got.answer.bytes == _needs(fields | {"b": got.answer.value}, TP_SP)


def test_a_cheaper_residue_class_past_the_first_that_fails_is_still_found():
    """Where a kernel runs only on some residues (k % 3 == 2 here), bytes grow within each class, not across them:
    the answer is the largest k that fits in any class, not where one bisection over every k lands (20)."""
    def try_value(k: int) -> Candidate:
        return Candidate(k, 10 * k - (35 if k % 3 == 2 else 0))

    answer, beyond = _largest(try_value, 200, period=3)
    assert (answer.value, beyond.value, beyond.bytes) == (23, 24, 240)


@pytest.mark.parametrize("solve, fields", [
    ("s", GPT | {"attention": "eager"}),  # b*a/t = 4 fills a block above s = 128 only, at multiples of 4
    # the same, where s = 128 (unfused) keeps more than 132 (fused): doubling's 128 fails, and 132 still fits
    ("s", GPT | {"attention": "eager", "h": 16, "L": 4, "vocab_size": 64, "dropout": 0.0}),
    ("b", GPT | {"attention": "eager", "h": 48, "a": 12, "attention_softmax_in_fp32": True}),  # a/t = 3: b % 4
])
def test_where_the_fused_softmax_runs_only_at_some_sizes_no_larger_value_fits(solve, fields):
    """Megatron's fused softmax keeps less at multiples of its block than at its neighbours: brute force over every
    value up to twice the answer finds none larger that fits."""
    budget = _peak(fields | {solve: 132 if solve == "s" else 8}, TP)  # a multiple of 4: the fused kernel runs
    got = fit(build_config(fields), TP, solve, budget)
    fitting = [v for v in range(1, 2 * got.answer.value + 8) if _peak(fields | {solve: v}, TP) <= budget]
    assert got.answer.value == max(fitting) and got.beyond.bytes > budget
