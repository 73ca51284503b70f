"""Column- and row-parallel linears against the unsharded computation, on real gloo groups.

The MLP shape (Column h->4h, GELU, Row 4h->h) runs under tp and tp-sp on 2 and 4
processes with the same full weights as a plain single-process torch MLP; the
outputs and every gradient must match, cut the way each strategy cuts them.
"""

import math

import pytest

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

import memcalc.probe.linear as linear  # noqa: E402
from memcalc.errors import ProbeError  # noqa: E402
from memcalc.probe.launch import run_fake, run_spawned  # noqa: E402
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402

S, B, H = 8, 2, 8  # s divisible by t = 2 and 4; the MLP hidden size is 4h
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "w1": draw(4 * H, H), "b1": draw(4 * H), "w2": draw(H, 4 * H), "b2": draw(H),
        "x": draw(S, B, H), "upstream": draw(S, B, H),
    }


def _reference(inp: dict) -> dict:
    """The unsharded MLP in one process, with plain torch ops: outputs and gradients."""
    leaves = {k: inp[k].clone().requires_grad_() for k in ("w1", "b1", "w2", "b2", "x")}
    out = F.linear(F.gelu(F.linear(leaves["x"], leaves["w1"], leaves["b1"])), leaves["w2"], leaves["b2"])
    out.backward(inp["upstream"])
    return {"out": out.detach(), **{k: v.grad for k, v in leaves.items()}}


def _saved_during(module, x) -> tuple:
    """module(x), and (shape, is a parameter, shares x's storage) for each tensor its forward saves.

    torch's linear saves a 3-d input as a (s*b, h) view, so sizes compare by element count.
    """
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = module(x)
    params = {p.data_ptr() for p in module.parameters()}
    storage = x.untyped_storage().data_ptr()
    return y, [(tuple(t.shape), t.data_ptr() in params, t.untyped_storage().data_ptr() == storage) for t in saved]


def _mlp(tp, inp: dict, sequence_parallel: bool) -> dict:
    """One rank's MLP: outputs, gradients, and what the column linear saved."""
    column = ColumnParallelLinear(H, 4 * H, tp, sequence_parallel)
    row = RowParallelLinear(4 * H, H, tp, sequence_parallel)
    column.load_shard_of(inp["w1"], inp["b1"])
    row.load_shard_of(inp["w2"], inp["b2"])
    cut = (lambda x: x.chunk(tp.size, dim=0)[tp.rank]) if sequence_parallel else (lambda x: x)
    x = cut(inp["x"]).clone().requires_grad_()
    hidden, saved = _saved_during(column, x)
    out = row(F.gelu(hidden))
    out.backward(cut(inp["upstream"]))
    grads = {"w1": column.weight.grad, "b1": column.bias.grad, "w2": row.weight.grad, "b2": row.bias.grad}
    return {"out": out.detach(), "x": x.grad, **grads, "saved": saved}


def _gathers_in_sp_column(tp) -> tuple:
    """(all-gathers the SP column linear ran in forward, then in backward)."""
    counted = []
    original = linear.all_gather_seq
    linear.all_gather_seq = lambda x, tp: counted.append(x) or original(x, tp)
    try:
        column = ColumnParallelLinear(H, 4 * H, tp, sequence_parallel=True)
        y = column(torch.ones(S // tp.size, B, H, requires_grad=True))
        forward = len(counted)
        y.sum().backward()
        return forward, len(counted) - forward
    finally:
        linear.all_gather_seq = original


def _rank_checks(tp, inp: dict) -> dict:
    return {
        "tp": _mlp(tp, inp, sequence_parallel=False),
        "tp-sp": _mlp(tp, inp, sequence_parallel=True),
        "gathers": _gathers_in_sp_column(tp),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda t: f"t={t}")
def ranks(request, starts_processes):
    """(t, reference, per-rank results): one spawn per t, shared by the tests below."""
    t, inp = request.param, _inputs()
    return t, _reference(inp), run_spawned(_rank_checks, (inp,), t, backend="gloo", timeout_s=60)


def _block(x, t, r, dim):
    return x.chunk(t, dim=dim)[r]


@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
def test_column_weight_gradients_are_this_ranks_rows_of_the_full_gradient(ranks, strategy):
    t, ref, results = ranks
    for r, res in enumerate(results):
        torch.testing.assert_close(res[strategy]["w1"], _block(ref["w1"], t, r, 0), **TOL)
        torch.testing.assert_close(res[strategy]["b1"], _block(ref["b1"], t, r, 0), **TOL)


@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
def test_row_weight_gradients_are_this_ranks_columns_of_the_full_gradient(ranks, strategy):
    t, ref, results = ranks
    for r, res in enumerate(results):
        torch.testing.assert_close(res[strategy]["w2"], _block(ref["w2"], t, r, 1), **TOL)


def test_tp_gives_every_rank_the_full_output_input_gradient_and_row_bias_gradient(ranks):
    _, ref, results = ranks
    for res in results:
        for name in ("out", "x", "b2"):
            torch.testing.assert_close(res["tp"][name], ref[name], **TOL)


def test_tp_sp_gives_each_rank_its_sequence_block_of_output_and_input_gradient(ranks):
    t, ref, results = ranks
    for r, res in enumerate(results):
        torch.testing.assert_close(res["tp-sp"]["out"], _block(ref["out"], t, r, 0), **TOL)
        torch.testing.assert_close(res["tp-sp"]["x"], _block(ref["x"], t, r, 0), **TOL)


def test_tp_sp_row_bias_gradients_are_partial_sums_over_sequence_blocks(ranks):
    _, ref, results = ranks
    torch.testing.assert_close(sum(res["tp-sp"]["b2"] for res in results), ref["b2"], **TOL)


def test_tp_column_saves_the_callers_full_input_itself(ranks):
    for res in ranks[2]:
        activations = [(math.prod(shape), shares) for shape, is_param, shares in res["tp"]["saved"] if not is_param]
        assert activations == [(S * B * H, True)]


def test_tp_sp_column_saves_only_the_callers_sequence_shard(ranks):
    t = ranks[0]
    for res in ranks[2]:
        activations = [s for s in res["tp-sp"]["saved"] if not s[1]]
        assert activations == [((S // t, B, H), False, True)]


def test_tp_sp_column_gathers_its_input_again_in_backward(ranks):
    for res in ranks[2]:
        assert res["gathers"] == (1, 1)


def test_column_rejects_an_output_size_t_does_not_divide():
    with pytest.raises(ProbeError, match="out_features=10 is not divisible by t=4"):
        run_fake(lambda tp: ColumnParallelLinear(H, 10, tp, sequence_parallel=False), (), t=4)


def test_load_shard_of_rejects_a_full_weight_of_the_wrong_shape():
    with pytest.raises(ProbeError, match=r"full weight has shape \(4, 4\), expected \(8, 32\)"):
        run_fake(lambda tp: RowParallelLinear(4 * H, H, tp, False).load_shard_of(torch.zeros(4, 4)), (), t=2)


def test_same_seed_gives_the_same_full_model_for_any_t():
    def column_weight_block(tp):
        return ColumnParallelLinear(H, 4 * H, tp, sequence_parallel=False, seed=7).weight.detach().clone()

    whole = run_fake(column_weight_block, (), t=1)
    assert torch.equal(run_fake(column_weight_block, (), t=4, rank=2), whole.chunk(4)[2])


def test_only_a_whole_bias_under_sp_is_marked_for_summing_gradients_across_ranks():
    def marks(tp):
        return [
            RowParallelLinear(4 * H, H, tp, sequence_parallel=True).bias.sequence_parallel,
            RowParallelLinear(4 * H, H, tp, sequence_parallel=False).bias.sequence_parallel,
            ColumnParallelLinear(H, 4 * H, tp, sequence_parallel=True).bias.sequence_parallel,
        ]

    assert run_fake(marks, (), t=2) == [True, False, False]
