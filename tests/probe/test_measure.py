"""What real layers save for backward agrees with `estimate --exact`, to the byte and the
per-rank shape, for every strategy and every knob value: on two real gloo ranks (every
rank compared) and as rank 0 of eight through torch's fake group."""

import itertools

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")
torch = pytest.importorskip("torch")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.probe import measure as measure_module  # noqa: E402
from memcalc.probe.launch import Mode, run  # noqa: E402
from memcalc.probe.measure import Launch, choose_launch, compare, measure, measure_on_rank  # noqa: E402
from memcalc.probe.overlap import NO_OVERLAP  # noqa: E402
from memcalc.probe.recorder import SavedStorage  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from tests.helpers import TINY, make_config  # noqa: E402

# Together these take every value of every knob at least once (GQA: half the heads' groups).
COVER = [
    {},
    {"mlp": "swiglu", "norm": "rmsnorm", "attention": "flash", "gqa": True, "dtype": "fp16"},
    {"gqa": True, "dropout": 0.0, "recompute": "selective", "dtype": "fp32"},
    {"attention": "flash", "recompute": "selective", "norm": "rmsnorm"},
    {"mlp": "swiglu", "recompute": "full", "ffn_hidden_size": 96},
    {"mlp": "swiglu", "bias_activation_fusion": True, "gqa": True},
    {"attention": "flash", "dropout": 0.0, "gqa": True, "recompute": "full", "dtype": "fp32"},
]
# The knobs that shape the attention core, in every combination; the MLP-side knobs in every
# combination too, dealt out over those (each twice), so every knob value meets many others.
CORE_KNOBS = {
    "attention": ["eager", "flash"], "gqa": [False, True], "dropout": [0.0, 0.1],
    "recompute": ["none", "selective", "full"],
}
MLP_SIDE_KNOBS = {
    "mlp": ["gelu", "swiglu"], "norm": ["layernorm", "rmsnorm"], "dtype": ["bf16", "fp16", "fp32"],
    "bias_activation_fusion": [False, True],
}
KNOBS = CORE_KNOBS | MLP_SIDE_KNOBS


def _combinations(knobs):
    return [dict(zip(knobs, values)) for values in itertools.product(*knobs.values())]


def _matrix():
    core, mlp_side = _combinations(CORE_KNOBS), _combinations(MLP_SIDE_KNOBS)
    return [knobs | mlp_side[i % len(mlp_side)] for i, knobs in enumerate(core)]


def _case(t, gqa_groups, knobs):
    """A COVER or matrix entry at `t`: its `gqa` asks for gqa_groups K/V groups."""
    groups = {"num_query_groups": gqa_groups} if knobs.get("gqa") else {}
    return make_config(TINY, t=t, **{k: v for k, v in knobs.items() if k != "gqa"}, **groups)


def _mismatches(cases, per_rank):
    """Every (rank, strategy, config, row) where the measurement differs from the prediction."""
    bad = []
    for rank, results in enumerate(per_rank):
        for (config, name, _, _), result in zip(cases, results):
            assert (result.rank, result.strategy, result.device) == (rank, name, "cpu")
            prediction = estimate(config, STRATEGIES[name], Accounting(exact=True, device="cpu"))
            bad += [(rank, name, config.as_dict(exclude_none=True), row)
                    for row in compare(prediction, result.saved) if not row.matches]
    return bad


@pytest.mark.parametrize("cases", [COVER, _matrix()], ids=["cover", "matrix"])
def test_the_cases_take_every_value_of_every_knob(cases):
    defaults = {name: values[0] for name, values in KNOBS.items()} | {"dropout": 0.1}
    for knob, values in KNOBS.items():
        assert {(defaults | case)[knob] for case in cases} == set(values), knob


@pytest.mark.procs
def test_two_gloo_ranks_save_what_the_ledger_predicts_on_every_rank():
    cases = tuple((_case(2, 4, knobs), name, "memcalc", NO_OVERLAP) for knobs in COVER for name in ("tp", "tp-sp"))
    per_rank = run(measure_on_rank, (cases,), mode="spawn", t=2, backend="gloo", timeout_s=240)
    assert len(per_rank) == 2 and all(r.group == "gloo" for results in per_rank for r in results)
    assert _mismatches(cases, per_rank) == []


@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
def test_rank_0_of_8_in_the_fake_group_saves_what_the_ledger_predicts_across_the_knob_matrix(strategy):
    cases = tuple((_case(8, 8, knobs), strategy, "memcalc", NO_OVERLAP) for knobs in _matrix())
    per_rank = run(measure_on_rank, (cases,), mode="fake", t=8)
    assert [r.group for r in per_rank[0]] == ["fake"] * len(cases)
    assert _mismatches(cases, per_rank) == []


def test_no_parallelism_in_one_process_saves_what_the_ledger_predicts():
    cases = tuple((_case(1, 4, knobs), "none", "memcalc", NO_OVERLAP) for knobs in COVER)
    assert _mismatches(cases, run(measure_on_rank, (cases,), mode="single")) == []


# QK norms on heads of kv_channels (narrower and wider than h/a), with one and several query heads per K/V group.
QK_NORMS = [
    {"qk_layernorm": True, "kv_channels": 4},
    {"qk_layernorm": True, "kv_channels": 12, "gqa": True, "norm": "rmsnorm"},
    {"qk_layernorm": True, "kv_channels": 20, "gqa": True, "recompute": "selective", "s": 14, "b": 1},
    {"qk_layernorm": True, "kv_channels": 12, "gqa": True, "attention": "flash", "recompute": "full", "b": 1},
]


@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
def test_the_own_layer_with_qk_norms_saves_what_the_ledger_predicts(strategy):
    cases = tuple((_case(2, 4, knobs), strategy, "memcalc", NO_OVERLAP) for knobs in QK_NORMS)
    assert _mismatches(cases, run(measure_on_rank, (cases,), mode="fake", t=2)) == []


# -- the comparison -------------------------------------------------------------------


def test_compare_shows_missing_unexpected_and_unlabelled_storages_as_differences():
    config = build_config(TINY | {"recompute": "full"})
    prediction = estimate(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))  # layer/input only
    (expected,) = prediction.tensors
    saved = (
        SavedStorage("mlp/gelu_in", 100, (2, 25), "bfloat16"),
        SavedStorage(None, 64, (32,), "float32"),
    )
    rows = {row.name: row for row in compare(prediction, saved)}
    assert (rows["layer/input"].predicted, rows["layer/input"].measured) == (expected.bytes, 0)
    assert (rows["mlp/gelu_in"].predicted, rows["mlp/gelu_in"].measured) == (0, 100)
    assert rows["unlabelled float32 storage"].measured == 64
    assert not any(row.matches for row in rows.values())


def test_the_same_bytes_in_another_shape_is_a_difference():
    config = build_config(TINY | {"recompute": "full"})
    prediction = estimate(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    (expected,) = prediction.tensors
    sequence_first = (expected.shape[1], expected.shape[0], *expected.shape[2:])
    (row,) = compare(prediction, (SavedStorage("layer/input", expected.bytes, sequence_first, "bfloat16"),))
    assert not row.matches and "shape" in row.describe()


# -- choosing how ranks run, and refusing before any rank starts --------------------------


@pytest.mark.parametrize(
    "t, backend, launch, expected",
    [
        (1, None, "auto", Launch(Mode.SINGLE, 1)),
        (1, "gloo", "auto", None),  # a backend with nothing to spawn is refused
        (2, "gloo", "auto", Launch(Mode.SPAWN, 2, "gloo")),
        (8, None, "auto", Launch(Mode.FAKE, 8)),
        (2, None, "spawn", Launch(Mode.SPAWN, 2, "gloo")),
        (2, None, "fake", Launch(Mode.FAKE, 2)),
    ],
)
def test_auto_launch_spawns_when_a_backend_is_named_and_fakes_otherwise(t, backend, launch, expected):
    if expected is None:
        with pytest.raises(ConfigError, match="--backend gloo applies to spawned ranks"):
            choose_launch(t, "cpu", backend, launch)
    else:
        assert choose_launch(t, "cpu", backend, launch) == expected


def test_auto_launch_under_torchrun_joins_it(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert choose_launch(2, "cpu", None).mode is Mode.TORCHRUN
    with pytest.raises(ConfigError, match="t=4, but torchrun started WORLD_SIZE=2"):
        choose_launch(4, "cpu", None)


@pytest.mark.parametrize(
    "fields, device, backend, launch, message",
    [
        ({"s": 15, "t": 2}, "cpu", "gloo", "auto", "s=15 is not divisible by t=2"),
        ({"t": 2}, "cpu", "nccl", "auto", "--backend nccl runs on GPUs only"),
        ({"t": 2}, "cpu", None, "single", "--launch single runs one rank, but t=2"),
        ({"t": 2}, "cpu", None, "torchrun", "needs torchrun's environment"),
        ({"t": 2, "attention": "flash", "cp": 2}, "cpu", None, "auto", "without context parallelism"),
    ],
)
def test_measure_refuses_what_cannot_run_before_starting_any_rank(monkeypatch, fields, device, backend, launch, message):
    monkeypatch.setattr(measure_module, "run", lambda *a, **k: pytest.fail("a rank was started"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=message):
        measure(build_config(TINY | fields), ["none", "tp", "tp-sp"], device, backend, launch, 10, "memcalc")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="torch sees no GPU"):
        choose_launch(1, "cuda", None)
