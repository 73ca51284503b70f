"""Megatron's f, f*, g, g* (seed, section 4) on real gloo groups of 2 and 4 processes.

Inputs are filled with rank ids (and sequence blocks with block ids), so every
expected value below is worked out by hand from what the collective does, not
by running the code under test another way.
"""

import pytest

torch = pytest.importorskip("torch")

from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_spawned  # noqa: E402
from memcalc.probe.mappings import (  # noqa: E402
    f_enter_tp,
    f_star_leave_tp,
    g_gather_seq,
    g_star_scatter_seq,
    split_seq,
)

ROWS = 2  # sequence rows per rank's shard
TAIL = (1, 3)  # (b, h) of every test tensor


def _filled(value: float, rows: int = ROWS) -> "torch.Tensor":
    return torch.full((rows, *TAIL), float(value), requires_grad=True)


def _blocks(values: list) -> "torch.Tensor":
    """(len(values) * ROWS, b, h): sequence block j filled with values[j]."""
    return torch.cat([torch.full((ROWS, *TAIL), float(v)) for v in values]).requires_grad_()


def _forward_backward(op, x, upstream, tp) -> tuple:
    y = op(x, tp)
    (grad,) = torch.autograd.grad(y, x, upstream)
    return y.detach(), grad


def _block_values(x: "torch.Tensor") -> list:
    """The single value filling each ROWS-row block of x (asserting it is uniform)."""
    blocks = x.reshape(-1, ROWS * TAIL[0] * TAIL[1])
    assert bool((blocks == blocks[:, :1]).all()), "block is not uniform"
    return blocks[:, 0].tolist()


def _operator_checks(tp) -> dict:
    """On each rank: every operator's forward and backward, as block values."""
    r, t = tp.rank, tp.size
    out = {}
    for name, op, x, upstream in [
        ("f", f_enter_tp, _filled(r + 1), _filled(r + 1)),
        ("f*", f_star_leave_tp, _filled(r + 1), _filled(r + 1)),
        ("g", g_gather_seq, _filled(r + 1), _blocks([10 * r + j for j in range(t)])),
        ("g*", g_star_scatter_seq, _blocks([10 * r + j for j in range(t)]), _filled(r + 1)),
        ("split", split_seq, _blocks(list(range(t))), _filled(r + 1)),
    ]:
        y, grad = _forward_backward(op, x, upstream, tp)
        out[name] = (_block_values(y), _block_values(grad))
    # Conjugate pairs: the gradient each op passes back is its partner's forward of the upstream.
    z_shard, z_full = _blocks([r + 1]), _blocks([10 * r + j for j in range(t)])
    with torch.no_grad():
        out["conjugate"] = {
            "f": _block_values(f_star_leave_tp(z_shard, tp)),
            "f*": _block_values(f_enter_tp(z_shard, tp)),
            "g": _block_values(g_star_scatter_seq(z_full, tp)),
            "g*": _block_values(g_gather_seq(z_shard, tp)),
        }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda t: f"t={t}")
def ranks(request, starts_processes):
    """(t, per-rank results of _operator_checks): one spawn per t, shared by the tests below."""
    t = request.param
    return t, run_spawned(_operator_checks, (), t, backend="gloo", timeout_s=60)


def test_f_forward_is_identity_and_backward_sums_over_ranks(ranks):
    t, results = ranks
    for r, res in enumerate(results):
        assert res["f"] == ([r + 1], [t * (t + 1) / 2])


def test_f_star_forward_sums_over_ranks_and_backward_is_identity(ranks):
    t, results = ranks
    for r, res in enumerate(results):
        assert res["f*"] == ([t * (t + 1) / 2], [r + 1])


def test_g_gathers_shards_in_rank_order_and_backward_reduce_scatters(ranks):
    t, results = ranks
    for r, res in enumerate(results):
        forward, backward = res["g"]
        assert forward == [q + 1 for q in range(t)]
        # rank q sent 10q + r for block r; the sum over q lands on rank r
        assert backward == [10 * t * (t - 1) / 2 + t * r]


def test_g_star_reduce_scatters_and_backward_gathers(ranks):
    t, results = ranks
    for r, res in enumerate(results):
        forward, backward = res["g*"]
        assert forward == [10 * t * (t - 1) / 2 + t * r]
        assert backward == [q + 1 for q in range(t)]


def test_split_keeps_this_ranks_block_and_backward_gathers(ranks):
    t, results = ranks
    for r, res in enumerate(results):
        assert res["split"] == ([r], [q + 1 for q in range(t)])


@pytest.mark.parametrize("op", ["f", "f*", "g", "g*"])
def test_each_operators_backward_is_its_partners_forward(ranks, op):
    _, results = ranks
    for res in results:
        assert res[op][1] == res["conjugate"][op]


@pytest.mark.parametrize("op", [f_enter_tp, f_star_leave_tp, g_gather_seq, g_star_scatter_seq, split_seq])
def test_operators_are_identities_when_t_is_1(op):
    x = _filled(3.0)
    assert op(x, single()) is x


def test_split_shard_owns_storage_of_its_own_size():
    """A recorder that sizes tensors by storage must see s/t rows, not the full sequence."""
    from memcalc.probe.mappings import copy_seq_shard
    from memcalc.probe.launch import run_fake

    def shard_storage_bytes(tp):
        full = torch.zeros(8 * ROWS, *TAIL)
        return copy_seq_shard(full, tp).untyped_storage().nbytes()

    assert run_fake(shard_storage_bytes, (), t=8) == ROWS * TAIL[0] * TAIL[1] * 4
