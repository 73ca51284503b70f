"""memcalc's own layer under `--impl paper` keeps, tensor by tensor, the paper's accounting at any shape: its fused
causal softmax keeps its 16-bit output alone, where megatron-core's would fall back to torch's outside its window."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("one_thread")
torch = pytest.importorskip("torch")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.measure import compare, measure_on_rank  # noqa: E402
from memcalc.probe.overlap import NO_OVERLAP  # noqa: E402


@st.composite
def paper_layers(draw):
    """A layout and a shape outside any kernel window: b*a/t and s odd where the layout lets them be."""
    strategy = draw(st.sampled_from(["none", "tp", "tp-sp"]))
    t = 1 if strategy == "none" else draw(st.sampled_from([2, 4]))
    heads = draw(st.integers(1, 3))  # per rank
    s = (t if strategy == "tp-sp" else 1) * draw(st.integers(1, 12).map(lambda k: 2 * k + 1))
    fields = dict(impl="paper", b=draw(st.integers(1, 3)), s=s, h=t * heads * draw(st.integers(1, 4)) * 2,
                  a=t * heads, t=t, recompute=draw(st.sampled_from(["none", "selective", "full"])),
                  dtype=draw(st.sampled_from(["bf16", "fp16"])))
    return build_config(fields), strategy


def _differences(config, strategy, results):
    prediction = estimate(config, STRATEGIES[strategy], Accounting(exact=True, device="cpu"))
    return [[row.describe() for row in compare(prediction, r.saved) if not row.matches] for r in results]


@settings(max_examples=12, deadline=None)
@given(paper_layers())
def test_the_papers_layer_keeps_the_papers_bytes_at_any_shape_on_the_fake_group(case):
    config, strategy = case
    mode = "single" if config.t == 1 or strategy == "none" else "fake"
    (results,) = run(measure_on_rank, (((config, strategy, "memcalc", NO_OVERLAP),),), mode=mode,
                     t=1 if mode == "single" else config.t)
    assert _differences(config, strategy, results) == [[]]
    names = {s.name for s in results[0].saved}
    assert "attention/causal_mask" not in names and "attention/softmax_fp32" not in names


@pytest.mark.procs
@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
def test_two_gloo_ranks_of_the_papers_layer_each_keep_the_papers_bytes(strategy):
    config = build_config(dict(impl="paper", b=1, s=38, h=96, a=6, t=2))  # b*a/t = 3: no window would take it
    per_rank = run(measure_on_rank, (((config, strategy, "memcalc", NO_OVERLAP),),), mode="spawn", t=2,
                   backend="gloo", timeout_s=240)
    assert [_differences(config, strategy, results) for results in per_rank] == [[[]], [[]]]
