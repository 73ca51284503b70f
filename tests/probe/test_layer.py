"""The probe's transformer layer computes the right thing on any t, and keeps what a
Megatron layer keeps: no full-sequence tensor in the SP region, no s x s tensor under
flash attention, and recomputation that changes memory but not gradients."""

import math
from functools import partial


import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from memcalc.model import ledger  # noqa: E402
from memcalc.model.impls import IMPLEMENTATIONS  # noqa: E402
from memcalc.model.ledger import Region  # noqa: E402
from memcalc.probe.attention import FlashAttention, FusedCausalSoftmax, Softmax, eager_core, flash_core  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake, run_spawned  # noqa: E402
from memcalc.probe.layer import DTYPES, TransformerLayer  # noqa: E402
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from memcalc.probe.mlp import MLP, rank_interleaved  # noqa: E402
from memcalc.probe.norm import Norm  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder  # noqa: E402
from tests.helpers import TINY, make_config  # noqa: E402

BY_NAME = IMPLEMENTATIONS["megatron"].by_name()  # the probe's layer keeps megatron's


def _input(config, dtype=torch.float32, seed=7):
    generator = torch.Generator().manual_seed(seed)
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
    config, t = make_config(TINY, t=4, **knobs), 4
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
    config = make_config(TINY, t=4)
    saved = run_fake(_saved_by_layer, (config, False), 4)
    sequence = [s for s in saved if BY_NAME[s.name].region is Region.SEQUENCE]
    assert sequence and all(s.shape[1] == config.s for s in sequence)


# -- the layer on t ranks is the same function as on one ---------------------------

# Between them the two knob sets take every operator path: both MLPs, both norms, both
# attention cores and both recomputations (which rerun collectives in backward), GQA with
# a/g = 2 query heads per K/V group (g = 4, divisible by t = 2 and 4), and a row-parallel
# linear with and without bias. fp32, and dropout 0: masks drawn on t ranks would differ
# from one process's.
EQUIVALENCE_KNOBS = {
    "swiglu-rmsnorm-eager-selective": {
        "mlp": "swiglu", "norm": "rmsnorm", "attention": "eager", "recompute": "selective",
    },
    "gelu-layernorm-flash-full": {
        "mlp": "gelu", "norm": "layernorm", "attention": "flash", "recompute": "full",
        "add_bias_linear": False, "add_qkv_bias": True,
    },
}
# Absolute only: every value compared is below about 5, where fp32's spacing is 5e-7, and a
# rank's result differs from one process's by the rounding of a different summation order.
EQUIVALENCE_TOL = {"atol": 1e-5, "rtol": 0}


def _equivalence_config(knobs, t=1):
    return make_config(TINY, t=t, num_query_groups=4, dtype="fp32", dropout=0.0, **knobs)


def _how_gradients_combine(layer):
    """Per parameter name: the dim of the full gradient this rank holds a block of, else "whole" or "partial".

    Read off the modules as they load a full model (`load_shard_of`): a parallel linear's
    weight is cut along its `shard_dim`, its bias along 0 when `bias_is_split`. Any other
    parameter is whole on every rank; its gradient is this rank's partial sum over its own
    tokens when it is marked `sequence_parallel`, as Megatron marks the parameters whose
    gradients it all-reduces under SP.
    """
    cut = {}
    for prefix, module in layer.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            cut[f"{prefix}.weight"] = module.shard_dim
            if module.bias is not None and module.bias_is_split:
                cut[f"{prefix}.bias"] = 0
    return {
        name: "gated" if getattr(p, "gated_halves", False)
        else cut.get(name, "partial" if getattr(p, "sequence_parallel", False) else "whole")
        for name, p in layer.named_parameters()
    }


def _layer_results(tp, config, sequence_parallel):
    """Output, input and parameter gradients of this rank's layer, fed its part of one input and upstream."""
    torch.manual_seed(0)
    layer = TransformerLayer(config, tp, sequence_parallel)
    # The upstream gradient at a quarter of a normal's scale keeps the weight and bias gradients,
    # sums over b*s = 32 tokens, below about 5, where fp32's spacing is under 1e-6.
    x, upstream = _input(config), _input(config, seed=8) / 4
    if sequence_parallel:
        x, upstream = (tp.block(v, 0, "sequence length").clone() for v in (x, upstream))
    x.requires_grad_()
    y = layer(x)
    y.backward(upstream)
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return {"out": y.detach(), "x": x.grad, "grads": grads, "combine": _how_gradients_combine(layer)}


def _results_on_rank(tp):
    """Per-rank fn: both knob sets, each under tp and tp-sp."""
    torch.set_num_threads(1)  # t ranks share the machine's cores: more threads each only contend
    results = {}
    for name, knobs in EQUIVALENCE_KNOBS.items():
        config = _equivalence_config(knobs, tp.size)
        results[name] = {strategy: _layer_results(tp, config, strategy == "tp-sp") for strategy in ("tp", "tp-sp")}
    return results


def _assembled(ranks, reference, sequence_parallel):
    """(what, the ranks' pieces put together as the one-process tensor, that tensor) for every tensor compared.

    tp: every rank has the whole output and input gradient; tp-sp: each has its sequence block.
    """
    t = len(ranks)
    for key in ("out", "x"):
        if sequence_parallel:
            yield key, torch.cat([rank[key] for rank in ranks]), reference[key]
        else:
            yield from ((f"{key} on rank {r}", rank[key], reference[key]) for r, rank in enumerate(ranks))
    assert all(rank["grads"].keys() == reference["grads"].keys() for rank in ranks)
    assert all(grad is not None for grad in reference["grads"].values()), "every parameter takes part"
    for name, full in reference["grads"].items():
        combine = ranks[0]["combine"][name]
        if combine == "partial":
            yield f"{name} (sum over ranks)", sum(rank["grads"][name] for rank in ranks), full
            continue
        if combine == "gated":  # SwiGLU's fc1: rank r holds [gate_r; up_r] of the full [gate; up]
            full, combine = rank_interleaved(full, t), 0
        for r, rank in enumerate(ranks):
            want = full if combine == "whole" else full.chunk(t, combine)[r]
            yield f"{name} on rank {r}", rank["grads"][name], want


@pytest.mark.procs
@pytest.mark.parametrize("t", [2, 4], ids=lambda t: f"t={t}")
def test_tp_and_tp_sp_on_gloo_ranks_compute_the_outputs_and_gradients_one_process_computes(t):
    per_rank = run_spawned(_results_on_rank, (), t, timeout_s=120)
    for name, knobs in EQUIVALENCE_KNOBS.items():
        reference = _layer_results(single(), _equivalence_config(knobs), False)
        for strategy in ("tp", "tp-sp"):
            ranks = [rank[name][strategy] for rank in per_rank]
            for what, got, want in _assembled(ranks, reference, strategy == "tp-sp"):
                where = f"{name}, {strategy}, {what}"
                torch.testing.assert_close(got, want, **EQUIVALENCE_TOL, msg=lambda m: f"{where}: {m}")


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
    torch_softmax = Softmax(fused_everywhere=False, fusion=False, in_fp32=False)  # float64: no kernel runs anyway
    for core in (partial(eager_core, softmax=torch_softmax), flash_core):
        out = core(q, k, v, 0.0)
        torch.testing.assert_close(out, reference)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want)


def test_the_fused_causal_softmax_is_the_masked_softmax_and_passes_gradcheck():
    scores = torch.randn(3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    reference = torch.softmax((scores * 0.5).masked_fill(future, float("-inf")), dim=-1)
    torch.testing.assert_close(FusedCausalSoftmax.apply(scores, 0.5), reference)
    assert torch.autograd.gradcheck(lambda x: FusedCausalSoftmax.apply(x, 0.5), (scores,), fast_mode=True)


def test_the_fused_causal_softmax_keeps_its_16_bit_output_alone():
    scores = torch.randn(2, 7, 7).to(torch.bfloat16).requires_grad_()
    with SavedTensorRecorder() as recorder:
        probs = FusedCausalSoftmax.apply(scores, 0.25)
    assert [(x.dtype, x.shape) for x in recorder.saved] == [("bfloat16", (2, 7, 7))]
    assert probs.dtype == torch.bfloat16


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


# -- the MLP ------------------------------------------------------------------------------


def test_fused_and_unfused_swiglu_compute_silu_gate_times_up_and_its_gradients():
    def results(fused):
        config = make_config(TINY, mlp="swiglu", dtype="fp32", dropout=0.0, bias_activation_fusion=fused)
        mlp = MLP(config, single(), False, torch.float32)
        x = _input(config).requires_grad_()
        out = mlp(x)
        return out, torch.autograd.grad((out * out).sum(), (x, *mlp.parameters()))

    mlp = MLP(make_config(TINY, mlp="swiglu", dtype="fp32"), single(), False, torch.float32)
    x = _input(make_config(TINY))
    gate, up = mlp.fc1(x).chunk(2, dim=-1)
    reference = mlp.fc2(F.silu(gate) * up)
    (fused, fused_grads), (unfused, unfused_grads) = results(True), results(False)
    torch.testing.assert_close(fused, reference)
    torch.testing.assert_close(unfused, reference)
    for a, b in zip(fused_grads, unfused_grads):
        torch.testing.assert_close(a, b)


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

    kept = grads(make_config(TINY, dtype="fp32", dropout=0.2))
    recomputed = grads(make_config(TINY, dtype="fp32", dropout=0.2, recompute=recompute))
    for a, b in zip(kept, recomputed):
        torch.testing.assert_close(a, b)
