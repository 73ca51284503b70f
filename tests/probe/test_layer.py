"""The probe's transformer layer computes the right thing on any t, and keeps what a
Megatron layer keeps: no full-sequence tensor in the SP region, no s x s tensor under
flash attention, and recomputation that changes memory but not gradients."""

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from memcalc import ledger  # noqa: E402
from memcalc.config import build_config  # noqa: E402
from memcalc.ledger import BY_NAME, Region  # noqa: E402
from memcalc.probe.attention import FlashAttention, eager_core, flash_core  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake, run_spawned  # noqa: E402
from memcalc.probe.layer import DTYPES, TransformerLayer  # noqa: E402
from memcalc.probe.norm import Norm  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder  # noqa: E402

TINY = {"b": 2, "s": 16, "h": 64, "a": 8}


def _config(**knobs):
    return build_config(TINY | knobs)


def _input(config, dtype=torch.float32):
    generator = torch.Generator().manual_seed(7)
    return torch.randn(config.s, config.b, config.h, generator=generator, dtype=dtype)


def _saved_by_layer(tp, config, sequence_parallel):
    """Per-rank fn: what one forward of the layer keeps, fed the whole sequence or this rank's block."""
    layer = TransformerLayer(config, tp, sequence_parallel)
    x = _input(config, DTYPES[config.dtype])
    if sequence_parallel:
        x = x.narrow(0, tp.rank * config.s // tp.size, config.s // tp.size).clone()
    with SavedTensorRecorder(layer.parameters()) as recorder:
        layer(x.requires_grad_())
    return recorder.saved


# -- sequence parallelism: nothing of full sequence length outside the TP region --


@pytest.mark.parametrize("knobs", [{}, {"mlp": "swiglu", "norm": "rmsnorm"}, {"recompute": "full"}])
def test_sp_layer_keeps_no_full_sequence_tensor_in_the_sequence_region(knobs):
    config, t = _config(t=4, **knobs), 4
    saved = run_fake(_saved_by_layer, (config, True), t)
    assert all(s.name is not None for s in saved), "every saved storage is a ledger tensor"
    in_sp_region = [s for s in saved if BY_NAME[s.name].region is Region.SEQUENCE]
    assert in_sp_region
    for s in in_sp_region:  # batch-first: (b, s, ...)
        assert s.shape[1] == config.s // t, (s.name, s.shape)
        # and the shard owns its storage: it is not a view into a full-sequence tensor
        assert s.nbytes == math.prod(s.shape) * getattr(torch, s.dtype).itemsize, s.name


def test_tp_layer_without_sp_does_keep_full_sequence_tensors_there():
    """The check above can fail: the same layer without SP keeps the whole sequence."""
    config = _config(t=4)
    saved = run_fake(_saved_by_layer, (config, False), 4)
    sequence = [s for s in saved if BY_NAME[s.name].region is Region.SEQUENCE]
    assert sequence and all(s.shape[1] == config.s for s in sequence)


# -- the layer on t ranks is the same function as on one ---------------------------


def _outputs_on_rank(tp, config):
    """Per-rank fn: output and input gradient without SP, then with SP (this rank's sequence block)."""
    results = []
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        layer = TransformerLayer(config, tp, sequence_parallel)
        x = _input(config)
        if sequence_parallel:
            x = x.narrow(0, tp.rank * config.s // tp.size, config.s // tp.size).clone()
        x.requires_grad_()
        y = layer(x)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), x.grad))
    return results


def test_tp_and_tp_sp_on_two_gloo_ranks_compute_what_one_process_computes():
    # dropout 0: masks drawn on different ranks would differ from one process's
    config = _config(t=2, num_query_groups=2, dtype="fp32", dropout=0.0, mlp="swiglu")
    (y1, grad1), _ = _outputs_on_rank(single(), config)
    rank0, rank1 = run_spawned(_outputs_on_rank, (config,), 2, timeout_s=120)
    tp_sp = (torch.cat([rank0[1][0], rank1[1][0]]), torch.cat([rank0[1][1], rank1[1][1]]))  # sequence blocks
    for y, grad in (rank0[0], rank1[0], tp_sp):
        torch.testing.assert_close(y, y1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, grad1, rtol=1e-4, atol=1e-5)


# -- attention ----------------------------------------------------------------------


def _qkv(groups=2, heads=4, s=6, d=8):
    generator = torch.Generator().manual_seed(3)
    make = lambda n: torch.randn(2, n, s, d, generator=generator, dtype=torch.float64, requires_grad=True)  # noqa: E731
    return make(heads), make(groups), make(groups)  # (b, heads, s, d), (b, groups, s, d) twice


def test_eager_and_flash_attention_match_torchs_causal_sdpa_with_gqa():
    q, k, v = _qkv()
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (b, a, s, d)
    reference = reference.permute(2, 0, 1, 3).reshape(6, 2, -1)  # (s, b, a*d), the cores' layout
    expected = torch.autograd.grad((reference * reference).sum(), (q, k, v))
    for core in (eager_core, flash_core):
        out = core(q, k, v, 0.0)
        torch.testing.assert_close(out, reference)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)


def test_flash_attention_backward_with_dropout_passes_gradcheck():
    q, k, v = _qkv(groups=1, heads=2, s=4, d=4)
    # one fixed seed: the same mask in every call gradcheck makes
    fn = lambda q, k, v: FlashAttention.apply(q, k, v, 0.3, 1234)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_flash_attention_keeps_q_k_v_output_and_lse_but_nothing_of_size_s_squared():
    q, k, v = (x.detach().float().requires_grad_() for x in _qkv(s=32))
    with SavedTensorRecorder() as recorder:
        out, lse = FlashAttention.apply(q, k, v, 0.1, 99)
    by_size = sorted(s.nbytes for s in recorder.saved)
    assert by_size == sorted([lse.numel() * 4, k.numel() * 4, v.numel() * 4, q.numel() * 4, out.numel() * 4])
    assert lse.dtype == torch.float32


# -- norms and recomputation -----------------------------------------------------------


def test_rmsnorm_matches_torchs_and_keeps_only_input_and_rstd():
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    norm = Norm("rmsnorm", 8, ledger.LN1, torch.float64, torch.device("cpu"))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    with SavedTensorRecorder(norm.parameters()) as recorder:
        y = norm(x)
    reference = F.rms_norm(x, (8,), norm.weight, eps=1e-5)
    torch.testing.assert_close(y, reference)
    got = torch.autograd.grad(y.sum(), (x, norm.weight))
    want = torch.autograd.grad(reference.sum(), (x, norm.weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert sorted((s.name, s.shape) for s in recorder.saved) == [("ln1/input", (2, 5, 8)), ("ln1/rstd", (2, 5))]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_reproduces_the_gradients_dropout_included(recompute):
    def grads(config):
        torch.manual_seed(0)
        layer = TransformerLayer(config, single(), False)
        x = _input(config).requires_grad_()
        torch.manual_seed(1)  # the dropout masks
        (layer(x) ** 2).sum().backward()
        return [x.grad, *(p.grad for p in layer.parameters())]

    kept = grads(_config(dtype="fp32", dropout=0.2))
    recomputed = grads(_config(dtype="fp32", dropout=0.2, recompute=recompute))
    for a, b in zip(kept, recomputed):
        torch.testing.assert_close(a, b)
