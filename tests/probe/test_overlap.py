"""Overlapped TP communication (memcalc.probe.overlap) computes what plain g and g* compute, and moves
the bytes they move: the same outputs and gradients on 2 and 4 gloo ranks, and, at the process-group
API, each forward all-gather or reduce-scatter replaced by its pieces and nothing else changed."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

import memcalc.probe.overlap as overlap_module  # noqa: E402
from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ProbeError  # noqa: E402
from memcalc.probe.collectives import RECV, SEND, CollectiveLog, LoggedCollective  # noqa: E402
from memcalc.probe.launch import run_fake, run_spawned  # noqa: E402
from memcalc.probe.layer import TransformerLayer  # noqa: E402
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from memcalc.probe.overlap import NO_OVERLAP, Method, Overlap  # noqa: E402

from tests.helpers import TINY  # noqa: E402

from .test_layer import EQUIVALENCE_KNOBS, EQUIVALENCE_TOL, _equivalence_config, _input  # noqa: E402

S, B, H = TINY["s"], TINY["b"], TINY["h"]
FP32 = 4  # bytes
LAYER_OVERLAPS = {
    "ring-ag+ring-rs": Overlap.of("ring-ag", "ring-rs"),
    "ring-ag+pipelined-rs": Overlap.of("ring-ag", "pipelined-rs"),  # num_splits 4: h/4 output features a block
}
# Each method alone on the one linear it changes: the column h -> 4h, or the row 4h -> h.
LINEAR_OVERLAPS = {
    "ring-ag": ("column", Overlap.of("ring-ag")),
    "ring-rs": ("row", Overlap.of("ring-rs")),
    "pipelined-rs": ("row", Overlap.of("pipelined-rs")),
    "pipelined-rs, 2 splits": ("row", Overlap.of("pipelined-rs", num_splits=2)),
}
RINGS = ("ring-ag", "ring-rs")
LAYER_OVERLAPS_AND_PLAIN = {"plain": NO_OVERLAP, **LAYER_OVERLAPS}


# -- what one rank computes and logs -----------------------------------------------


def _logged_pass(module, x, upstream):
    """module(x) and its backward from `upstream`, with every process-group call logged by phase."""
    x.requires_grad_()
    with CollectiveLog() as log:
        y = module(x)
        log.phase = "backward"
        y.backward(upstream)
    grads = {f"grad {name}": p.grad for name, p in module.named_parameters()}
    return {"out": y.detach(), "grad x": x.grad, **grads, "calls": tuple(log.calls)}


def _layer_pass(tp, config, overlap):
    """The SP layer, fed this rank's sequence shard of one input and one upstream gradient."""
    torch.manual_seed(0)
    layer = TransformerLayer(config, tp, True, overlap)
    x, upstream = (tp.block(v, 0, "sequence length").clone() for v in (_input(config), _input(config, seed=8) / 4))
    return _logged_pass(layer, x, upstream)


def _linear_pass(tp, kind, overlap):
    """A column (h -> 4h: SP input shard in, output columns out) or row (4h -> h: the reverse) linear alone."""
    generator = torch.Generator().manual_seed(11)
    draw = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    if kind == "column":
        linear = ColumnParallelLinear(H, 4 * H, tp, True, seed=3, overlap=overlap)
        x, upstream = tp.block(draw(S, B, H), 0), tp.block(draw(S, B, 4 * H), 2)
    else:
        linear = RowParallelLinear(4 * H, H, tp, True, seed=5, overlap=overlap)
        x, upstream = tp.block(draw(S, B, 4 * H), 2), tp.block(draw(S, B, H), 0)
    return _logged_pass(linear, x.clone(), upstream.clone())


def _with_reversed_ring(fn, *args):
    """fn(*args) with every hop sent down the ranks instead of up: chunks arrive from the other side."""
    original = overlap_module.ring_neighbours
    overlap_module.ring_neighbours = lambda tp: original(tp)[::-1]
    try:
        return fn(*args)
    finally:
        overlap_module.ring_neighbours = original


def _with_chunks_one_step_late(fn, *args):
    """fn(*args) with each ring step working on the chunk of the step after it."""
    originals = overlap_module.gathered_chunk, overlap_module.reduced_chunk
    overlap_module.gathered_chunk, overlap_module.reduced_chunk = (
        lambda rank, step, t, chunk=chunk: chunk(rank, step + 1, t) for chunk in originals
    )
    try:
        return fn(*args)
    finally:
        overlap_module.gathered_chunk, overlap_module.reduced_chunk = originals


BREAKS = {"reversed": _with_reversed_ring, "one step late": _with_chunks_one_step_late}


def _on_rank(tp):
    """Per-rank fn: every layer and linear plain and overlapped, and each ring broken each way."""
    torch.set_num_threads(1)  # t ranks share the machine's cores: more threads each only contend
    layers = {}
    for name, knobs in EQUIVALENCE_KNOBS.items():
        config = _equivalence_config(knobs, tp.size)
        layers[name] = {which: _layer_pass(tp, config, o) for which, o in LAYER_OVERLAPS_AND_PLAIN.items()}
    linears = {f"plain {kind}": _linear_pass(tp, kind, NO_OVERLAP) for kind in ("column", "row")}
    linears |= {name: _linear_pass(tp, kind, o) for name, (kind, o) in LINEAR_OVERLAPS.items()}
    broken = {
        (name, how): breaking(_linear_pass, tp, *LINEAR_OVERLAPS[name])
        for name in RINGS
        for how, breaking in BREAKS.items()
    }
    return {"layers": layers, "linears": linears, "broken": broken}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda t: f"t={t}")
def ranks(request, starts_processes):
    """(t, per-rank results): one spawn per t, shared by the tests below."""
    return request.param, run_spawned(_on_rank, (), request.param, backend="gloo", timeout_s=120)


# -- comparing ------------------------------------------------------------------------


def _assert_same_results(got, want, where):
    """Output, input gradient and every parameter gradient equal within EQUIVALENCE_TOL (fp32)."""
    assert got.keys() == want.keys()
    for key in want.keys() - {"calls"}:
        assert want[key] is not None, f"{where}: {key} got no gradient"
        torch.testing.assert_close(got[key], want[key], **EQUIVALENCE_TOL, msg=lambda m: f"{where}, {key}: {m}")


def _largest_difference(got, want):
    return max((got[k] - want[k]).abs().max().item() for k in want.keys() - {"calls"})


def _linear_kind(name):
    return LINEAR_OVERLAPS[name][0]


def _pieces(call, overlap, t):
    """What the overlapped forward issues in place of the plain forward's `call`, in order."""
    if call.op == "all-gather" and Method.RING_AG in overlap.methods:
        hop = call.tensor_bytes // t  # one sequence chunk: (s/t, b, in)
        return [LoggedCollective(SEND, call.phase, hop), LoggedCollective(RECV, call.phase, hop)] * (t - 1)
    if call.op == "reduce-scatter" and Method.RING_RS in overlap.methods:
        hop = call.tensor_bytes // t  # one chunk's partial sum: (s/t, b, out)
        return [LoggedCollective(SEND, call.phase, hop), LoggedCollective(RECV, call.phase, hop)] * (t - 1)
    if call.op == "reduce-scatter" and Method.PIPELINED_RS in overlap.methods:
        block = call.tensor_bytes // overlap.num_splits  # (s, b, out/num_splits)
        return [replace(call, tensor_bytes=block)] * overlap.num_splits
    return [call]


def _expected_calls(plain, overlap, t, reruns_forward):
    """The overlapped layer's calls from the plain one's: each forward g all-gather and g* reduce-scatter
    cut into its pieces; backward unchanged, except that a full recomputation first reruns the (cut) forward."""
    forward = [c for c in plain if c.phase == "forward"]
    backward = [c for c in plain if c.phase == "backward"]
    cut = [piece for c in forward for piece in _pieces(c, overlap, t)]
    if reruns_forward:
        assert [(c.op, c.tensor_bytes) for c in backward[: len(forward)]] == [(c.op, c.tensor_bytes) for c in forward]
        rerun = [replace(c, phase="backward") for c in cut]
        backward = rerun + backward[len(forward):]
    return (*cut, *backward)


# -- the same function ------------------------------------------------------------------


@pytest.mark.parametrize("overlap", LAYER_OVERLAPS)
@pytest.mark.parametrize("knobs", EQUIVALENCE_KNOBS)
def test_overlapped_layer_gives_the_plain_sp_layers_output_and_gradients(ranks, knobs, overlap):
    t, per_rank = ranks
    for r, rank in enumerate(per_rank):
        layer = rank["layers"][knobs]
        _assert_same_results(layer[overlap], layer["plain"], f"t={t} rank {r}, {knobs}, {overlap}")


@pytest.mark.parametrize("name", LINEAR_OVERLAPS)
def test_each_overlapped_linear_alone_gives_the_plain_sp_linears_output_and_gradients(ranks, name):
    t, per_rank = ranks
    for r, rank in enumerate(per_rank):
        plain = rank["linears"][f"plain {_linear_kind(name)}"]
        _assert_same_results(rank["linears"][name], plain, f"t={t} rank {r}, {name}")


@pytest.mark.parametrize("how", BREAKS)
@pytest.mark.parametrize("name", RINGS)
def test_a_broken_ring_fails_the_equivalence_check(ranks, name, how):
    t, per_rank = ranks
    if (t, how) == (2, "reversed"):
        pytest.skip("at t=2 the rank above and the rank below are one rank: the reversed ring is the ring")
    for r, rank in enumerate(per_rank):
        plain = rank["linears"][f"plain {_linear_kind(name)}"]
        assert _largest_difference(rank["linears"][name], plain) < EQUIVALENCE_TOL["atol"]
        with pytest.raises(AssertionError, match="out"):
            _assert_same_results(rank["broken"][name, how], plain, f"t={t} rank {r}, {name} {how}")


# -- the same bytes, cut differently --------------------------------------------------------


def _sent(calls, phase):
    return [c.tensor_bytes for c in calls if c.op == SEND and c.phase == phase]


@pytest.mark.parametrize("name", RINGS)
def test_a_ring_sends_t_minus_1_chunks_of_a_t_th_of_the_whole_tensor_in_forward(ranks, name):
    t, per_rank = ranks
    whole = S * B * H * FP32  # ring-ag: the gathered input (s, b, h); ring-rs: the summed output (s, b, h)
    for rank in per_rank:
        calls = rank["linears"][name]["calls"]
        assert _sent(calls, "forward") == [whole // t] * (t - 1)
        assert sum(_sent(calls, "forward")) == (t - 1) * whole // t
        received = [c.tensor_bytes for c in calls if c.op == RECV]
        assert received == _sent(calls, "forward")
        assert not [c for c in calls if c.phase == "forward" and c.op not in (SEND, RECV)]


@pytest.mark.parametrize("name", ["pipelined-rs", "pipelined-rs, 2 splits"])
def test_the_pipelined_reduce_scatter_sends_t_minus_1_t_ths_of_each_chunk(ranks, name):
    t, per_rank = ranks
    splits = LINEAR_OVERLAPS[name][1].num_splits
    for rank in per_rank:
        forward = [c for c in rank["linears"][name]["calls"] if c.phase == "forward"]
        assert [(c.op, c.tensor_bytes) for c in forward] == [("reduce-scatter", S * B * H * FP32 // splits)] * splits
        assert [c.moved_bytes(t) for c in forward] == [(t - 1) * S * B * H * FP32 // (t * splits)] * splits


@pytest.mark.parametrize("name", LINEAR_OVERLAPS)
def test_an_overlapped_linear_sends_what_the_plain_one_sends_and_its_backward_is_unchanged(ranks, name):
    t, per_rank = ranks
    for rank in per_rank:
        plain = rank["linears"][f"plain {_linear_kind(name)}"]["calls"]
        calls = rank["linears"][name]["calls"]
        sent = lambda cs, phase: sum(c.moved_bytes(t) for c in cs if c.phase == phase and c.op != RECV)  # noqa: E731
        assert sent(calls, "forward") == sent(plain, "forward")
        assert [c for c in calls if c.phase == "backward"] == [c for c in plain if c.phase == "backward"]


@pytest.mark.parametrize("overlap", LAYER_OVERLAPS)
@pytest.mark.parametrize("knobs", EQUIVALENCE_KNOBS)
def test_the_overlapped_layer_issues_the_plain_layers_calls_with_each_forward_collective_cut(ranks, knobs, overlap):
    t, per_rank = ranks
    reruns = EQUIVALENCE_KNOBS[knobs].get("recompute") == "full"
    for rank in per_rank:
        layer = rank["layers"][knobs]
        assert layer[overlap]["calls"] == _expected_calls(layer["plain"]["calls"], LAYER_OVERLAPS[overlap], t, reruns)


def _layer_calls_on_fake_group(tp, overlap):
    """The calls of the plain and the overlapped layer as one rank of torch's fake group (no data moves)."""
    config = build_config(TINY | {"t": tp.size, "dtype": "fp32"})
    return {which: _layer_pass(tp, config, o)["calls"] for which, o in (("plain", NO_OVERLAP), ("overlapped", overlap))}


@pytest.mark.parametrize("overlap", LAYER_OVERLAPS)
def test_on_the_fake_group_of_eight_the_layer_issues_the_same_cut_calls(overlap):
    calls = run_fake(_layer_calls_on_fake_group, (LAYER_OVERLAPS[overlap],), t=8)
    assert calls["overlapped"] == _expected_calls(calls["plain"], LAYER_OVERLAPS[overlap], 8, reruns_forward=False)
    qkv_ring = [c.tensor_bytes for c in calls["overlapped"] if c.op == SEND][:7]
    assert qkv_ring == [S // 8 * B * H * FP32] * 7  # t-1 hops of a sequence chunk (s/t, b, h)


# -- choosing --------------------------------------------------------------------------------------


def test_overlap_is_refused_without_sequence_parallelism():
    with pytest.raises(ProbeError, match="needs sequence_parallel"):
        run_fake(lambda tp: ColumnParallelLinear(H, 4 * H, tp, False, overlap=Overlap.of("ring-ag")), (), t=2)


def test_an_unknown_method_and_two_reduce_scatter_methods_at_once_are_refused():
    with pytest.raises(ProbeError, match="unknown overlap method 'ring-a2a'; expected one of ring-ag, ring-rs"):
        Overlap.of("ring-a2a")
    with pytest.raises(ProbeError, match="ring-rs and pipelined-rs"):
        Overlap.of("ring-rs", "pipelined-rs")


def test_the_pipelined_reduce_scatter_refuses_blocks_that_do_not_divide_the_output():
    def run(tp):
        row = RowParallelLinear(4 * H, H, tp, True, overlap=Overlap.of("pipelined-rs", num_splits=3))
        row(torch.zeros(S, B, 4 * H // tp.size))

    with pytest.raises(ProbeError, match="out_features=64 is not divisible by num_splits=3"):
        run_fake(run, (), t=2)
