"""The collectives memcalc's own layer issues are the communication ledger's, one by one, in order."""

import pytest

pytest.importorskip("torch")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.comm import layer_collectives  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.collectives import LoggedCollective, compare_collectives  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.measure import _compared_comm, measure_on_rank  # noqa: E402
from memcalc.probe.overlap import NO_OVERLAP, Overlap  # noqa: E402
from tests.helpers import TINY  # noqa: E402

KNOB_SETS = [{}, {"recompute": "full"}, {"recompute": "selective", "attention": "flash", "mlp": "swiglu"},
             {"a": 16, "num_query_groups": 8, "dropout": 0.0, "norm": "rmsnorm"},
             {"dtype": "fp32", "mlp": "swiglu", "bias_activation_fusion": True},
             {"dtype": "fp16", "attention": "flash", "recompute": "full", "mlp": "swiglu"}]


def _comm_rows(t, mode, knobs, overlap=NO_OVERLAP, names=("tp", "tp-sp")):
    cases = tuple((build_config(TINY | {"t": t} | knobs), name, "memcalc", overlap) for name in names)
    per_rank = run(measure_on_rank, (cases,), mode=mode, t=t, backend="gloo", timeout_s=240)
    return [_compared_comm(config, STRATEGIES[name], result, overlap)
            for results in per_rank for (config, name, _, _), result in zip(cases, results)]


@pytest.mark.parametrize("knobs", KNOB_SETS, ids=str)
def test_every_collective_matches_the_ledger_on_the_fake_group_of_eight(knobs):
    for rows in _comm_rows(8, "fake", knobs):
        assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]


@pytest.mark.parametrize("t", [2, 4])
def test_every_collective_matches_the_ledger_on_real_gloo_ranks(t):
    for rows in _comm_rows(t, "spawn", {"recompute": "full"}):
        assert rows and all(row.matches for row in rows)


@pytest.mark.parametrize("methods", [("ring-ag", "ring-rs"), ("ring-ag", "pipelined-rs")], ids=str)
@pytest.mark.parametrize("t", [2, 4])
def test_every_ring_hop_and_pipelined_chunk_matches_the_ledger_on_real_gloo_ranks(t, methods):
    overlap = Overlap.of(*methods, num_splits=2)
    for rows in _comm_rows(t, "spawn", {"recompute": "full"}, overlap, names=("tp-sp",)):
        assert any(row.predicted[0] == "send" for row in rows) and all(row.matches for row in rows)


def test_a_collective_the_ledger_does_not_list_is_a_difference():
    config = build_config(TINY | {"t": 2})
    predicted = layer_collectives(config, STRATEGIES["tp"])
    sizes = {d: 1 for d in predicted[0].shape}
    issued = tuple(LoggedCollective(c.op.value, c.phase, 2) for c in predicted)
    extra = issued + (LoggedCollective("all-gather", "backward", 2),)
    assert all(r.matches for r in compare_collectives(predicted, sizes, 2, 2, issued))
    rows = compare_collectives(predicted, sizes, 2, 2, extra)
    assert [r.name for r in rows if not r.matches] == ["not in the ledger"]
