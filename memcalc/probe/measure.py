"""Run the probe's layer under each strategy and hold what it saved up against the ledger.

Each rank runs forward inside a `SavedTensorRecorder` (on CUDA, between allocator readings), then backward once to
show the graph is whole; the prediction is `estimate` with exact accounting for the device it ran on, compared
name by name in bytes and per-rank shape. Launch modes and --device meta: docs/probe.md, "Launch modes".
"""

from __future__ import annotations

import importlib
import os
from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError, ProbeError
from memcalc.model.comm import check_even_parts, layer_collectives
from memcalc.model.evaluate import LayerEstimate, check_strategy, dim_sizes, estimate, routers
from memcalc.model.knobs import DTYPE_BYTES, Accounting
from memcalc.probe import require_torch, routing_fixed
from memcalc.probe.collectives import CollectiveLog, CommRow, LoggedCollective, compare_collectives
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.launch import Mode, run, under_torchrun
from memcalc.probe.layer import DTYPES, TransformerLayer
from memcalc.probe.mappings import copy_seq_shard
from memcalc.probe.overlap import NO_OVERLAP, Overlap
from memcalc.probe.recorder import SavedStorage, SavedTensorRecorder
from memcalc.model.strategy import STRATEGIES, Strategy

torch = require_torch()

INPUT_SEED = 1234

# The device whose accounting (`estimate --exact --device`) a run on each device is held up against.
# Meta's kernels keep what CUDA's keep: native_layer_norm's meta kernel returns fp32 mean and rstd
# for a bf16 input, as CUDA's does (the CPU kernel keeps them in bf16), and native_dropout a bool mask.
ACCOUNTED_AS = {"cpu": "cpu", "cuda": "cuda", "meta": "cuda"}
META_NOTE = (
    "; meta holds shapes and dtypes, no values (weights, input and dropout masks are empty),"
    " and is compared with CUDA's accounting, whose widths meta's kernels keep (LayerNorm statistics in fp32)"
)


# -- on each rank ---------------------------------------------------------------


@dataclass(frozen=True)
class CudaMemory:
    """torch.cuda's allocator around the forward pass, in bytes above where it started."""

    kept: int  # still allocated after forward: saved tensors and the layer's output, in allocator blocks
    peak: int  # the most allocated at any moment during forward


@dataclass(frozen=True)
class RankResult:
    """What one rank saved for backward: plain values, so it pickles home from a worker."""

    strategy: str
    rank: int
    group: str  # the group's mode: single, gloo, nccl or fake
    device: str  # cpu, cuda or meta: decides the width of norm statistics (ACCOUNTED_AS)
    saved: tuple[SavedStorage, ...]
    cuda: CudaMemory | None
    collectives: tuple[LoggedCollective, ...] = ()  # every collective the layer issued


# The runner module of each implementation's library (each imports its library only when loaded).
# The install extra is the implementation's name: memcalc[megatron], memcalc[torchtitan], memcalc[hf].
RUNNERS = {
    "megatron": ("memcalc.probe.libs.megatron", "megatron-core"),
    "torchtitan": ("memcalc.probe.libs.torchtitan", "torchtitan"),
    "hf": ("memcalc.probe.libs.hf", "transformers"),
}


# The implementations memcalc's own layer runs: Megatron's, and the paper's (its fused softmax at every shape).
OWN_LAYER_IMPLS = ("megatron", "paper")
# config, strategy name, layer (LAYERS), overlap (own layer only)[, forced route (library runners only, ROUTES)]
Case = tuple[ModelConfig, str, str, Overlap] | tuple[ModelConfig, str, str, Overlap, "str | None"]


def measure_on_rank(tp: TensorParallelGroup, cases: tuple[Case, ...]) -> list[RankResult]:
    """The per-rank entry point for `launch.run`: each case in turn (without a route, the router routes)."""
    return [measure_layer(tp, config, STRATEGIES[name], layer, overlap, *route)
            for config, name, layer, overlap, *route in cases]


def measure_layer(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, layer: str, overlap: Overlap = NO_OVERLAP,
    route: str | None = None,
) -> RankResult:
    """Build the layer (the library's, or memcalc's own), record one forward pass, run backward once."""
    torch.manual_seed(INPUT_SEED + tp.rank)  # dropout masks; weights are seeded by the linears
    if layer == "library":
        logged: list[LoggedCollective] = []  # every runner can force its MoE router (`run_layer(..., route=)`)
        saved, cuda = runner(config.impl).run_layer(tp, config, strategy, route=route, collectives=logged), None
        collectives = tuple(logged)
    else:
        saved, cuda, collectives = _run_own_layer(tp, config, strategy, overlap)
    return RankResult(strategy.name, tp.rank, tp.mode, tp.device.type, saved, cuda, collectives)


def runner(impl: str) -> ModuleType:
    """The runner module for an implementation's library, or ProbeError saying what to install."""
    module, package = RUNNERS[impl]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ProbeError(
            f"--impl {impl} runs {package}'s own layer, which is not installed ({err});"
            f" install the extra {impl!r} (in a checkout: pip install -e '.[{impl}]')"
        ) from err


def _run_own_layer(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, overlap: Overlap
) -> tuple[tuple[SavedStorage, ...], CudaMemory | None, tuple[LoggedCollective, ...]]:
    """memcalc's Megatron-style layer: what it saves, torch.cuda's readings around forward, its collectives."""
    if config.mla:
        raise ProbeError("--layer memcalc has no latent attention (kv_lora_rank); measure MLA with --impl megatron"
                         " or --impl hf, which run the libraries' own MLA layers")
    sequence_parallel = strategy.sequence_parallel
    layer = TransformerLayer(config, tp, sequence_parallel, overlap if sequence_parallel else NO_OVERLAP)
    x = _layer_input(config, tp, sequence_parallel)
    start = _cuda_start(tp.device)
    with CollectiveLog() as log:
        with SavedTensorRecorder(layer.parameters()) as recorder:
            y = layer(x)
        cuda = _cuda_end(tp.device, start)
        log.backward(y)
    return recorder.saved, cuda, tuple(log.calls)


def _layer_input(config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool) -> torch.Tensor:
    """The same full input on every rank, or this rank's sequence shard of it, in a storage of its own; it
    requires grad, as every layer's input past the embedding does."""
    if tp.device.type == "meta":  # nothing to draw; a shard of the same shape as on a real device
        full = torch.empty(config.s, config.b, config.h, dtype=DTYPES[config.dtype], device="meta")
    else:
        generator = torch.Generator().manual_seed(INPUT_SEED)
        full = torch.randn(config.s, config.b, config.h, generator=generator).to(DTYPES[config.dtype])
    x = copy_seq_shard(full, tp) if sequence_parallel else full
    return x.to(tp.device).requires_grad_()


def _cuda_start(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _cuda_end(device: torch.device, start: int | None) -> CudaMemory | None:
    if start is None:
        return None
    torch.cuda.synchronize(device)
    return CudaMemory(torch.cuda.memory_allocated(device) - start, torch.cuda.max_memory_allocated(device) - start)


# -- prediction next to measurement ----------------------------------------------


@dataclass(frozen=True)
class Row:
    """One tensor: the ledger's bytes and shape next to the measured ones (0 and None when absent)."""

    name: str
    predicted: int
    measured: int
    predicted_shape: tuple[int, ...] | None
    measured_shape: tuple[int, ...] | None

    @property
    def matches(self) -> bool:
        return self.predicted == self.measured and self.predicted_shape == self.measured_shape

    def describe(self) -> str:
        """What differs, for a one-line error."""
        if self.predicted != self.measured:
            return f"{self.name} ({self.measured - self.predicted:+,} B)"
        return f"{self.name} (shape {self.measured_shape}, expected {self.predicted_shape})"


def compare(prediction: LayerEstimate, saved: tuple[SavedStorage, ...]) -> tuple[Row, ...]:
    """Rows in ledger order, then labelled tensors the ledger did not predict, then unlabelled storages."""
    measured: dict[str, list[SavedStorage]] = defaultdict(list)
    for storage in saved:
        if storage.name is not None:
            measured[storage.name].append(storage)
    rows = [_row(p.tensor.name, p.bytes, p.shape, measured.pop(p.tensor.name, [])) for p in prediction.tensors]
    rows += [_row(name, 0, None, storages) for name, storages in measured.items()]
    rows += [
        Row(f"unlabelled {s.dtype} storage", 0, s.nbytes, None, s.shape) for s in saved if s.name is None
    ]
    return tuple(rows)


def _row(name: str, predicted: int, shape: tuple[int, ...] | None, storages: list[SavedStorage]) -> Row:
    """A ledger name's row; two storages under one name show as their sum and no single shape."""
    measured_shape = storages[0].shape if len(storages) == 1 else None
    return Row(name, predicted, sum(s.nbytes for s in storages), shape, measured_shape)


# -- launching -------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How a strategy's ranks run: the launch mode, t, and for spawn the backend."""

    mode: Mode
    t: int
    backend: str | None = None


def choose_launch(t: int, device: str, backend: str | None, launch: str = "auto") -> Launch:
    """The launch for t ranks (see the module docstring), or ConfigError if the flags cannot work here."""
    _check_device(device, backend)
    if launch != "auto":
        mode = Mode(launch)
    elif under_torchrun():
        mode = Mode.TORCHRUN
    elif t == 1:
        mode = Mode.SINGLE
    elif backend is not None or (device == "cuda" and torch.cuda.device_count() >= t):
        mode = Mode.SPAWN
    else:
        mode = Mode.FAKE
    if device == "meta" and mode in (Mode.SPAWN, Mode.TORCHRUN):
        raise ConfigError(
            f"--device meta holds no data, so there is nothing for {mode.value} ranks to exchange;"
            " it runs rank 0 of t through torch's fake group (--launch auto or fake)"
        )
    if mode is Mode.SINGLE and t != 1:
        raise ConfigError(f"--launch single runs one rank, but t={t}; use spawn, fake or torchrun")
    if mode is Mode.TORCHRUN and not under_torchrun():
        raise ConfigError("--launch torchrun needs torchrun's environment; start with torchrun -m memcalc measure ...")
    if mode is Mode.TORCHRUN and (world := int(os.environ["WORLD_SIZE"])) != t:
        raise ConfigError(f"t={t}, but torchrun started WORLD_SIZE={world} ranks; under torchrun t is the world size")
    if mode is Mode.SPAWN:
        backend = backend or ("nccl" if device == "cuda" else "gloo")
        if device == "cuda" and torch.cuda.device_count() < t:
            raise ConfigError(f"t={t} spawned ranks need {t} GPUs, but torch sees {torch.cuda.device_count()}")
    elif backend is not None and mode is not Mode.TORCHRUN:
        raise ConfigError(f"--backend {backend} applies to spawned ranks, but this run is {mode.value}")
    return Launch(mode, t, backend)


def _check_device(device: str, backend: str | None) -> None:
    if device == "meta" and backend is not None:
        raise ConfigError(f"--backend {backend} moves real data, and --device meta has none; drop --backend")
    if backend == "nccl" and device != "cuda":
        raise ConfigError("--backend nccl runs on GPUs only; add --device cuda, or use --backend gloo")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no GPU (this torch build or machine has no CUDA)")


# -- the whole measurement -------------------------------------------------------


@dataclass(frozen=True)
class StrategyMeasurement:
    """One strategy: how it ran, the prediction, and each rank's rows (rank 0 first)."""

    strategy: Strategy
    launch: Launch
    layer: str  # whose layer ran: the implementation's library's name, or memcalc's own
    notes: tuple[str, ...]  # what the library's CPU shim changed to make the run CUDA-like
    prediction: LayerEstimate
    ranks: tuple[RankResult, ...]
    rows: tuple[tuple[Row, ...], ...]  # per rank, in rank order
    comm: tuple[tuple[CommRow, ...], ...] = ()  # per rank: the collectives issued against the ledger's (own layer)
    world: str | None = None  # the fake world a library's runner made itself (megatron's t*ep ranks), in words

    @property
    def matches(self) -> bool:
        return all(row.matches for rows in (*self.rows, *self.comm) for row in rows)

    @property
    def predicted_bytes(self) -> int:
        return self.prediction.per_layer_bytes

    @property
    def measured_bytes(self) -> int:
        return sum(s.nbytes for s in self.ranks[0].saved)

    def how(self) -> str:
        """Which way the ranks ran, in words, for output."""
        mode, t, group, device = self.launch.mode, self.launch.t, self.ranks[0].group, self.ranks[0].device
        if mode is Mode.FAKE or mode is Mode.SINGLE and self.world is not None:
            world = self.world or f"t={t}"
            how = f"one process as rank 0 of {world} through torch's fake process group on {device} (no data moves)"
        elif mode is Mode.SINGLE:
            how = f"one process (t=1) on {device}"
        elif mode is Mode.SPAWN:
            ranks = "1 process" if t == 1 else f"{t} processes"
            how = f"{ranks} started here, real {group} collectives on {device}; every rank compared"
        else:
            how = f"torchrun: t={t} ranks, real {group} collectives on {device}; rank 0 compared"
        return how + (META_NOTE if device == "meta" else "")

    def differences(self) -> list[str]:
        """Each tensor (or collective) that differs, prefixed with its rank when it is not rank 0."""
        comm = self.comm or ((),) * len(self.ranks)
        return [
            f"{'' if result.rank == 0 else f'rank {result.rank}: '}{text}"
            for result, rows, comm_rows in zip(self.ranks, self.rows, comm)
            for text in [row.describe() for row in rows if not row.matches]
            + [f"collective {c.name} (issued {c.measured}, ledger {c.predicted})" for c in comm_rows if not c.matches]
        ]


def measure(
    config: ModelConfig, strategies: list[str], device: str, backend: str | None, launch: str, timeout_s: float,
    layer: str = "library", overlap: Overlap = NO_OVERLAP, route: str | None = None,
) -> list[StrategyMeasurement]:
    """Measure each strategy on `layer` (memcalc.probe.LAYERS), everything checked before any rank starts; `route`
    forces a library's MoE router. Returns nothing on a torchrun rank other than 0."""
    if config.cp != 1:
        raise ConfigError(f"cp={config.cp}: the probe runs one layer without context parallelism; measure with cp=1")
    # meta first: else the two checks below send --impl hf on meta from --layer memcalc to library and back
    if device == "meta" and (layer == "library" or config.impl not in OWN_LAYER_IMPLS):
        raise ConfigError(
            "--device meta runs memcalc's own layer only: add --layer memcalc, with --impl"
            f" {' or '.join(OWN_LAYER_IMPLS)} (the libraries' runners build their layers on the CPU, or read values"
            " that meta tensors do not have)"
        )
    if layer == "memcalc" and config.impl not in OWN_LAYER_IMPLS:
        raise ConfigError(f"--layer memcalc is memcalc's own Megatron-style layer; with --impl {config.impl} use --layer library")
    if layer == "library" and config.impl not in RUNNERS:
        raise ConfigError(f"impl {config.impl} has no library: its layer is memcalc's own (--layer memcalc)")
    if layer == "library":
        runner(config.impl)  # a missing library is named before any rank starts
    if route is not None and (layer != "library" or config.num_experts is None):  # every library's runner routes
        raise ConfigError(f"--route {route} forces a library's MoE router: it needs --impl {', '.join(sorted(RUNNERS))}"
                          " and num_experts")
    if overlap and (layer != "memcalc" or "tp-sp" not in strategies):
        raise ConfigError("--overlap runs in memcalc's own layer under tp-sp: add --layer memcalc --strategy tp-sp")
    rings = sorted(m.value for m in overlap.methods if m.value.startswith("ring"))
    if device == "meta" and rings:
        raise ConfigError(
            f"--overlap {','.join(rings)} on meta: torch's fake group has no point-to-point backend for meta"
            " tensors; run the rings with --device cpu (pipelined-rs runs on meta)"
        )
    plans = {name: _plan(config, STRATEGIES[name], device, backend, launch) for name in strategies}
    by_launch: dict[Launch, list[str]] = defaultdict(list)
    for name, plan in plans.items():
        by_launch[plan].append(name)
    ranks: dict[str, list[RankResult]] = {}
    # Ranks under torchrun first: rank 0 must not keep the others waiting while it runs "none" alone.
    for plan in sorted(by_launch, key=lambda p: p.mode is not Mode.TORCHRUN):
        if plan.mode is Mode.SINGLE and under_torchrun() and int(os.environ["RANK"]) != 0:
            return []
        cases = tuple((config, name, layer, overlap, route) for name in by_launch[plan])
        per_rank = run(measure_on_rank, (cases,), mode=plan.mode, t=plan.t, backend=plan.backend or "gloo",
                       device=device, timeout_s=timeout_s)
        if not per_rank:  # a torchrun rank other than 0
            return []
        for index, name in enumerate(by_launch[plan]):
            ranks[name] = [results[index] for results in per_rank]
    return [_compared(STRATEGIES[name], plans[name], config, ranks[name], layer, overlap, route)
            for name in strategies]


def _plan(config: ModelConfig, strategy: Strategy, device: str, backend: str | None, launch: str) -> Launch:
    """The launch for one strategy; "none" always runs in this process, as t = 1."""
    check_strategy(config, strategy)
    if strategy.tensor_parallel:
        return choose_launch(config.t, device, backend, launch)
    _check_device(device, backend)
    return Launch(Mode.SINGLE, 1)


def _compared(
    strategy: Strategy, plan: Launch, config: ModelConfig, ranks: list[RankResult], layer: str, overlap: Overlap,
    route: str | None,
) -> StrategyMeasurement:
    prediction = estimate(config, strategy, Accounting(exact=True, device=ACCOUNTED_AS[ranks[0].device]))
    rows = tuple(compare(prediction, result.saved) for result in ranks)
    logged = layer == "memcalc" or comm_modelled(config, strategy, route)
    comm = tuple(_compared_comm(config, strategy, r, overlap) for r in ranks) if logged else ()
    if layer == "library":
        package = RUNNERS[config.impl][1]
        possessive = f"{package}'" if package.endswith("s") else f"{package}'s"  # transformers', torchtitan's
        built = getattr(runner(config.impl), "built_layer", lambda config: None)(config)
        whose = f"{possessive} own layer" + (f", {built}" if built else "")
        notes = tuple(runner(config.impl).NOTES) + ((runner(config.impl).route_note(route),) if route else ())
        world = getattr(runner(config.impl), "fake_world", lambda config, t: None)(config, plan.t)
    else:
        whose, notes, world = "memcalc's own Megatron-style layer", (), None
        if config.impl == "paper":
            whose += ", in the paper's accounting (its fused causal softmax at every shape keeps its 16-bit output)"
    return StrategyMeasurement(strategy, plan, whose, notes, prediction, tuple(ranks), rows, comm, world)


def comm_modelled(config: ModelConfig, strategy: Strategy, route: str | None) -> bool:
    """Whether a library layer's collectives can be compared with the ledger: it models them (not the
    allgather dispatcher's, not transformers' ep plan, not uneven all-to-alls) and their bytes do not hang on the
    routing (`routing_fixed`)."""
    try:
        layer_collectives(config, strategy, ep=config.ep)
        check_even_parts(config, strategy)
    except ConfigError:
        return False
    return routing_fixed(config, route)


def _compared_comm(
    config: ModelConfig, strategy: Strategy, result: RankResult, overlap: Overlap
) -> tuple[CommRow, ...]:
    """The collectives one rank issued against the communication ledger's, in order. A collective over a group
    of one rank (t = 1, or ep = 1) sends nothing, and neither memcalc's mappings nor megatron's issue it."""
    t = strategy.weight_shards(config.t)
    methods = frozenset(m.value for m in overlap.methods) if strategy.sequence_parallel else frozenset()
    predicted = tuple(c for c in layer_collectives(config, strategy, methods, t, overlap.num_splits, config.ep)
                      if c.group.size(t, config.ep) > 1)
    return compare_collectives(predicted, dim_sizes(config, routers(config, strategy)), t, DTYPE_BYTES[config.dtype],
                               result.collectives, config.ep)
