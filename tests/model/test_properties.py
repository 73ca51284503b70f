"""Properties over random valid configurations (hypothesis).

Sizes are built from the divisibility rules outward (heads from groups, groups
from t, and so on), so every drawn configuration is valid for all three strategies.
"""

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memcalc.config.schema import ModelConfig, build_config
from memcalc.model.evaluate import dim_sizes, estimate
from memcalc.model.impls.megatron import CONDITIONS, FUSED_SOFTMAX
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import Dim
from memcalc.model.strategy import NONE, TP, TP_SP

small = st.integers(min_value=1, max_value=6)


@st.composite
def configs(draw, t=st.sampled_from([1, 2, 4, 8])) -> dict:
    """Fields of a random configuration that every strategy can lay out."""
    t = draw(t)
    groups = t * draw(small)  # t | groups
    a = groups * draw(small)  # groups | a
    fields = dict(
        b=draw(small), s=t * draw(st.integers(1, 64)), h=a * draw(st.integers(1, 16)), a=a, t=t,
        L=draw(small), mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        attention=draw(st.sampled_from(["eager", "flash"])), norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        dropout=draw(st.sampled_from([0.0, 0.1])), recompute=draw(st.sampled_from(["none", "selective", "full"])),
        dtype=draw(st.sampled_from(["bf16", "fp16", "fp32"])),
    )
    if draw(st.booleans()):
        fields["num_query_groups"] = groups
    if draw(st.booleans()):
        fields["ffn_hidden_size"] = t * draw(st.integers(1, 256))
    return fields


accountings = st.builds(Accounting, exact=st.booleans(), device=st.sampled_from(["cuda", "cpu"]))
examples = settings(max_examples=60, deadline=None)


def _per_layer(config: ModelConfig, accounting: Accounting) -> list[int]:
    return [estimate(config, s, accounting).per_layer_bytes for s in (NONE, TP, TP_SP)]


@examples
@given(configs(), accountings)
def test_tp_sp_never_keeps_more_than_tp_and_tp_never_more_than_none(fields, accounting):
    # Where megatron's fused softmax runs on the whole heads but not on a/t of them, tp keeps an fp32 softmax
    # that none does not (pinned below): compare where the kernel's choice agrees.
    assume(len(set(_fused_softmax_runs(fields))) == 1)
    none, tp, tp_sp = _per_layer(build_config(fields), accounting)
    assert tp_sp <= tp <= none


def test_where_the_fused_softmax_stops_at_a_over_t_heads_tp_keeps_more_than_none():
    """b*a = 8 fills the fused kernel's blocks of 8 (s <= 128); b*a/t = 4 does not: tp's ranks run megatron's fp32
    torch softmax (with --attention-softmax-in-fp32), which keeps the (s, s) fp32 output besides the bf16 one."""
    fields = dict(b=2, s=20, h=4, a=4, t=2, L=1, dropout=0.0, attention_softmax_in_fp32=True)
    assert _fused_softmax_runs(fields) == (True, False)
    none, tp, tp_sp = _per_layer(build_config(fields), Accounting())
    assert tp > none and tp > tp_sp > none


@examples
@given(configs(t=st.just(1)), accountings)
def test_one_gpu_makes_the_three_strategies_equal(fields, accounting):
    none, tp, tp_sp = _per_layer(build_config(fields), accounting)
    assert none == tp == tp_sp


@examples
@given(configs(t=st.sampled_from([2, 4, 8])), accountings)
def test_more_than_one_gpu_makes_tp_sp_strictly_smaller(fields, accounting):
    assume(len(set(_fused_softmax_runs(fields))) == 1)  # else a/t heads may keep an fp32 softmax (pinned above)
    none, tp, tp_sp = _per_layer(build_config(fields), accounting)
    assert tp_sp < none


@examples
@given(configs(), accountings, st.integers(2, 9))
def test_memory_is_linear_in_the_micro_batch(fields, accounting, k):
    # Every term with a batch dimension; megatron's fp32 causal mask, (s, s), is one per layer.
    # Megatron's fused softmax runs only where b*a/t fills its blocks, and at b = 1 its eager GQA core's query can be a
    # view of the fused QKV output (impls.megatron.CONDITIONS): compare b values where these choices agree.
    assume(len({_size_choices(fields | {"b": b}) for b in (1, k)}) == 1)
    one = _batch_terms(build_config(fields | {"b": 1}), accounting)
    many = _batch_terms(build_config(fields | {"b": k}), accounting)
    assert many == [k * x for x in one]


def _fused_softmax_runs(fields: dict) -> tuple[bool, ...]:
    """Whether the fused softmax runs under each strategy's split (t = 1 for none)."""
    config = build_config(fields)
    return tuple(bool(FUSED_SOFTMAX.runs(dim_sizes(config), t)) for t in (1, config.t))


def _size_choices(fields: dict) -> tuple[bool, ...]:
    """Whether the fused softmax runs, and each size condition these knobs meet keeps its tensor, under each
    strategy's split."""
    config = build_config(fields)
    conditions = (c for c in CONDITIONS if c.applies(Knobs.of(config)))
    kept = tuple(bool(c.kept(dim_sizes(config), t)) for c in conditions for t in (1, config.t))
    return (*_fused_softmax_runs(fields), *kept)


def _batch_terms(config: ModelConfig, accounting: Accounting) -> list[int]:
    return [
        sum(x.bytes for x in estimate(config, s, accounting).tensors if Dim.B in x.tensor.shape)
        for s in (NONE, TP, TP_SP)
    ]


@examples
@given(configs(), accountings, st.integers(2, 200))
def test_memory_is_linear_in_the_number_of_layers(fields, accounting, layers):
    config = build_config(fields | {"L": layers})
    for strategy in (NONE, TP, TP_SP):
        one_layer = estimate(build_config(fields | {"L": 1}), strategy, accounting).per_layer_bytes
        assert estimate(config, strategy, accounting).total_bytes == layers * one_layer
