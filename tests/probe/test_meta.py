"""On torch's meta device the probe measures full-size layers in seconds: the recorder tells
storages apart without data, layers are built without drawing weights, backward runs, and
what is saved agrees with `estimate --exact` for CUDA, whose widths meta's kernels keep."""

import resource
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memcalc.config.schema import build_config, load_config  # noqa: E402
from memcalc.config.shipped import locate  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model import ledger  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.probe import measure as measure_module  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.layer import TransformerLayer  # noqa: E402
from memcalc.probe.linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from memcalc.probe.measure import choose_launch, measure  # noqa: E402
from memcalc.probe.norm import Norm  # noqa: E402
from memcalc.probe.overlap import Overlap  # noqa: E402
from memcalc.probe.recorder import SavedTensorRecorder, label  # noqa: E402
from tests.helpers import TINY  # noqa: E402

STRATEGY_NAMES = ["none", "tp", "tp-sp"]


def _meta(*shape, dtype=torch.bfloat16, requires_grad=True):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)


# -- the recorder ------------------------------------------------------------------


def test_two_meta_storages_count_as_two_although_neither_has_a_data_address():
    x, y = _meta(4, 8), _meta(4, 8)
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() == 0
    with SavedTensorRecorder() as recorder:
        x * y  # keeps both factors
    assert [(s.nbytes, s.shape) for s in recorder.saved] == [(4 * 8 * 2, (4, 8))] * 2


def test_a_saved_meta_view_counts_its_whole_storage_once():
    big = _meta(10, 8)
    with SavedTensorRecorder() as recorder:
        torch.nn.functional.gelu(big[:2]) + torch.nn.functional.gelu(big[5:7])  # two views, one storage
    assert [s.nbytes for s in recorder.saved] == [10 * 8 * 2]


def test_meta_parameters_are_left_out_and_meta_activations_are_not():
    linear = torch.nn.Linear(8, 16, device="meta")
    with SavedTensorRecorder(linear.parameters()) as recorder:
        linear(_meta(3, 8, dtype=torch.float32))
    assert [(s.nbytes, s.shape) for s in recorder.saved] == [(3 * 8 * 4, (3, 8))]


def test_labels_on_two_meta_storages_name_each_its_own():
    def two_labelled(x, y):
        label(x, ledger.GELU_IN)
        label(y, ledger.FC2_IN)
        return x * y

    with SavedTensorRecorder() as recorder:
        two_labelled(_meta(4, 8), _meta(4, 8))
    assert sorted(s.name for s in recorder.saved) == ["mlp/fc2_in", "mlp/gelu_in"]


# -- building on meta ----------------------------------------------------------------


@pytest.mark.parametrize("linear", [ColumnParallelLinear, RowParallelLinear])
def test_a_meta_linear_takes_empty_full_weights_on_meta_not_seeded_ones_on_the_cpu(linear):
    layer = linear(64, 256, single("meta"), False, dtype=torch.bfloat16)
    full_weight, full_bias = layer.seeded_full_weights(0)
    assert (full_weight.device.type, tuple(full_weight.shape)) == ("meta", (256, 64))
    assert (full_bias.device.type, tuple(full_bias.shape)) == ("meta", (256,))
    assert {p.device.type for p in layer.parameters()} == {"meta"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_layernorm_keeps_its_statistics_in_fp32_as_cuda_does(dtype):
    # Why a meta run is held up against CUDA's accounting (measure.ACCOUNTED_AS): the CPU kernel
    # keeps mean and rstd in the input's dtype; CUDA's, and meta's, in fp32.
    norm = Norm("layernorm", 8, ledger.LN1, dtype, torch.device("meta"))
    with SavedTensorRecorder(norm.parameters()) as recorder:
        norm(_meta(5, 2, 8, dtype=dtype))
    dtypes = {s.name: s.dtype for s in recorder.saved}
    assert dtypes == {"ln1/input": str(dtype).removeprefix("torch."), "ln1/mean": "float32", "ln1/rstd": "float32"}


@pytest.mark.parametrize("knobs", [{}, {"mlp": "swiglu", "norm": "rmsnorm", "num_query_groups": 4}])
def test_backward_runs_on_meta_and_reaches_every_parameter_and_the_input(knobs):
    layer = TransformerLayer(build_config(TINY | knobs), single("meta"), sequence_parallel=False)
    x = _meta(16, 2, 64)
    y = layer(x)
    y.backward(torch.ones_like(y))
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is not None and p.grad.shape == p.shape for p in layer.parameters())


# -- measuring on meta ---------------------------------------------------------------


def test_meta_runs_none_in_this_process_and_tp_as_rank_0_through_the_fake_group():
    assert choose_launch(1, "meta", None).mode.value == "single"
    assert choose_launch(8, "meta", None).mode.value == "fake"


@pytest.mark.parametrize(
    "backend, launch, layer, message",
    [
        ("gloo", "auto", "memcalc", "--backend gloo moves real data, and --device meta has none"),
        (None, "spawn", "memcalc", "nothing for spawn ranks to exchange"),
        (None, "auto", "library", "--device meta runs memcalc's own layer only: add --layer memcalc"),
    ],
)
def test_meta_refuses_real_ranks_and_library_layers_before_any_rank_starts(monkeypatch, backend, launch, layer, message):
    monkeypatch.setattr(measure_module, "run", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(ConfigError, match=message):
        measure(build_config(TINY | {"t": 2}), STRATEGY_NAMES, "meta", backend, launch, 10, layer)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"mlp": "swiglu", "norm": "rmsnorm", "attention": "flash", "num_query_groups": 4, "dropout": 0.0},
        {"num_query_groups": 4, "recompute": "selective", "dtype": "fp32"},
        {"mlp": "swiglu", "recompute": "full", "bias_activation_fusion": True, "dtype": "fp16"},
        {"attention": "flash", "dropout": 0.1},
    ],
)
def test_a_meta_run_saves_what_the_ledger_predicts_for_cuda(knobs):
    config = build_config(TINY | {"t": 2} | knobs)
    for m in measure(config, STRATEGY_NAMES, "meta", None, "auto", 60, "memcalc"):
        assert m.ranks[0].device == "meta"
        assert m.prediction == estimate(config, m.strategy, Accounting(exact=True, device="cuda"))
        assert m.differences() == []


def test_an_overlapped_ring_is_refused_on_meta_where_the_fake_group_has_no_point_to_point():
    config = build_config(TINY | {"t": 2})
    with pytest.raises(ConfigError, match="ring-ag on meta"):
        measure(config, ["tp-sp"], "meta", None, "auto", 60, "memcalc", Overlap.of("ring-ag"))


def test_a_pipelined_reduce_scatter_runs_on_meta():
    config = build_config(TINY | {"t": 2})
    (m,) = measure(config, ["tp-sp"], "meta", None, "auto", 60, "memcalc", Overlap.of("pipelined-rs", num_splits=2))
    assert m.differences() == []


def test_a_full_size_gpt3_175b_layer_on_meta_matches_cuda_to_the_byte_without_materialising_anything():
    """The real size (h=12288, t=8): seconds and no memory on meta, where the CPU takes minutes and 10 GB."""
    config = load_config(locate(Path("gpt3-175b")), {})
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results = measure(config, STRATEGY_NAMES, "meta", None, "auto", 120, "memcalc")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert [m.strategy.name for m in results] == STRATEGY_NAMES
    for m in results:
        assert m.prediction == estimate(config, m.strategy, Accounting(exact=True, device="cuda"))
        assert m.differences() == [] and m.measured_bytes == m.predicted_bytes
    # fc1's full weight alone would be 4.8 GB on the CPU; the whole run stays far below 1 GB
    assert grown < 2**30, f"peak memory grew by {grown:,} bytes"
