"""Hiding tensor-parallel communication behind GEMMs (SEED.md section 5): what each method costs and hides.

Under TP + SP every collective of a layer sits next to a GEMM that can run while
it moves (Transformer Engine's userbuffers, switched on in Megatron by
`tp_comm_overlap`). Each pairing below is TE's default (initialize_ub in
transformer_engine/pytorch/module/base.py):

    forward   g  all-gather     -> QKV / fc1 GEMM     ring-exchange (tp_comm_overlap_ag)
              g* reduce-scatter <- proj / fc2 GEMM    pipelined, 4 chunks (tp_comm_overlap_rs); or a ring
    backward  g* all-gather dY  -> proj / fc2 dgrad   ring-exchange (tp_comm_overlap_ag)
              re-gather of X    || QKV / fc1 dgrad    bulk (tp_comm_bulk_dgrad)
              g  reduce-scatter || QKV / fc1 wgrad    bulk (tp_comm_bulk_wgrad); or pipelined on the
                                                      dgrad GEMM (tp_comm_overlap_rs_dgrad, bulk off)

Timing (a model, stated as such): a GEMM takes its FLOPs over the GPU's peak
throughput, a collective the bytes one rank sends over the link bandwidth; no
latency, no contention for SMs, no kernel launch gaps. With c the collective's
time and g its GEMM's:

    none            exposed = c
    ring (t steps)  t - 1 exchanges, each beside a GEMM chunk: T = (t-1) max(c/(t-1), g/t) + g/t
    pipelined (k)   k chunks, each reduce-scattered while the next computes: T = g/k + (k-1) max(g/k, c/k) + c/k
    bulk            the collective runs beside the whole GEMM: T = max(c, g)
    exposed = T - g (never below 0)

Memory: each overlapped GEMM has a userbuffer of the layer input's global shape
(s*b, h), or (2t - 1)/t of it for a ring reduce-scatter (which keeps every
received chunk for the final sum). TE allocates them once for the whole model,
shared by every layer, with cudaMalloc/NVSHMEM outside PyTorch's caching
allocator: torch.cuda's counters never see them, so memcalc counts them apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from memcalc.errors import ConfigError
from memcalc.model.comm import layer_collectives, sent_bytes
from memcalc.model.evaluate import dim_sizes
from memcalc.model.knobs import DTYPE_BYTES, GATED
from memcalc.model.ledger import Dim

if TYPE_CHECKING:
    from memcalc.config.gpus import Gpu
    from memcalc.config.schema import ModelConfig
from memcalc.model.strategy import Strategy


@dataclass(frozen=True)
class Method:
    """One way of hiding a collective behind a GEMM, the flag that selects it, and its buffer."""

    name: str
    flag: str  # Megatron-LM's argument
    kind: str  # "ring", "pipelined" or "bulk"
    what: str


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ring-ag", "tp_comm_overlap_ag", "ring",
           "all-gather as t-1 ring exchanges, each beside the GEMM of the chunk a rank holds"),
    Method("ring-rs", "tp_comm_overlap_rs (ring_exchange)", "ring",
           "reduce-scatter ring: each partial-result buffer travels t-1 hops, summed on the way, to its owner"),
    Method("pipelined-rs", "tp_comm_overlap_rs", "pipelined",
           "the GEMM in num_splits chunks, each reduce-scattered while the next computes"),
    Method("bulk-dgrad", "tp_comm_bulk_dgrad", "bulk",
           "the re-gather of a column-parallel input beside the dgrad GEMM, which does not need it"),
    Method("bulk-wgrad", "tp_comm_bulk_wgrad", "bulk",
           "the reduce-scatter of dX beside the wgrad GEMM"),
    Method("rs-dgrad", "tp_comm_overlap_rs_dgrad", "pipelined",
           "the reduce-scatter of dX pipelined with the dgrad GEMM that makes it (turns both bulk overlaps off)"),
)}
DEFAULT = ("ring-ag", "pipelined-rs", "bulk-dgrad", "bulk-wgrad")  # tp_comm_overlap alone: TE's defaults
DEFAULT_SPLITS = 4


@dataclass(frozen=True)
class Pairing:
    """One collective of the layer beside its GEMM, and the method that may hide it."""

    collective: str  # the communication ledger's name and pass
    gemm: str  # Transformer Engine's GEMM name
    methods: tuple[str, ...]  # the methods that apply, first is the default's choice
    comm_s: float
    gemm_s: float
    comm_bytes: int


def gemm_flops(config: ModelConfig) -> dict[str, int]:
    """FLOPs of each forward GEMM on one rank (dgrad and wgrad cost the same each)."""
    c, sizes = config, dim_sizes(config)
    tokens = sizes[Dim.B] * sizes[Dim.S]  # per context-parallel rank
    width = {"qkv": (c.a + 2 * c.groups) * c.head_dim, "proj": c.h,
             "fc1": c.ffn * (2 if c.mlp in GATED else 1), "fc2": c.h}
    inner = {"qkv": c.h, "proj": c.a * c.head_dim, "fc1": c.h, "fc2": c.ffn}
    return {name: 2 * tokens * inner[name] * width[name] // c.t for name in width}


# (ledger collective name, pass, its index among equal names in that pass) -> (GEMM, methods that may hide it)
PAIRS = (
    ("attention/g", "forward", 0, "qkv_fprop", ("ring-ag",)),
    ("attention/g*", "forward", 0, "proj_fprop", ("pipelined-rs", "ring-rs")),
    ("mlp/g", "forward", 0, "fc1_fprop", ("ring-ag",)),
    ("mlp/g*", "forward", 0, "fc2_fprop", ("pipelined-rs", "ring-rs")),
    ("mlp/g*", "backward", 0, "fc2_dgrad", ("ring-ag",)),
    ("mlp/g", "backward", 0, "fc1_dgrad", ("bulk-dgrad",)),
    ("mlp/g", "backward", 1, "fc1_wgrad", ("bulk-wgrad", "rs-dgrad")),
    ("attention/g*", "backward", 0, "proj_dgrad", ("ring-ag",)),
    ("attention/g", "backward", 0, "qkv_dgrad", ("bulk-dgrad",)),
    ("attention/g", "backward", 1, "qkv_wgrad", ("bulk-wgrad", "rs-dgrad")),
)


def pairings(config: ModelConfig, strategy: Strategy, gpu: Gpu) -> tuple[Pairing, ...]:
    """Every collective of one layer (tp-sp) beside its GEMM, with their times on `gpu`."""
    if not strategy.sequence_parallel:
        raise ConfigError(f"overlap needs sequence parallelism (tp_comm_overlap runs with tp-sp), not {strategy.name}")
    if config.t < 2:
        raise ConfigError(f"overlap hides tensor-parallel collectives, and t={config.t} issues none (it needs t >= 2)")
    if config.impl != "megatron":
        raise ConfigError(f"overlap is Megatron's and Transformer Engine's (tp_comm_overlap); impl {config.impl} has none")
    if config.mla:
        raise ConfigError(f"kv_lora_rank={config.kv_lora_rank}: overlap pairs the dense layer's GEMMs with its"
                          " collectives; latent attention's are not paired")
    flops, sizes, width = gemm_flops(config), dim_sizes(config), DTYPE_BYTES[config.dtype]
    found: dict[tuple[str, str, int], int] = {}  # by name, pass and index among equal names in that pass
    seen: Counter = Counter()  # how many of each name and pass come before
    for c in layer_collectives(config, strategy):
        found[c.name, c.phase, seen[c.name, c.phase]] = sent_bytes(c, sizes, config.t, width)
        seen[c.name, c.phase] += 1
    out = []
    for name, phase, index, gemm, methods in PAIRS:
        sent = found.get((name, phase, index))
        if sent is None:
            continue  # an implementation without Megatron's re-gather has one collective fewer
        comm_s = sent / (gpu.link_gb_s * 1e9)
        gemm_s = flops[gemm.split("_")[0]] / (gpu.tflops * 1e12)
        out.append(Pairing(f"{name} {phase}", gemm, methods, comm_s, gemm_s, sent))
    return tuple(out)


def exposed(p: Pairing, method: str | None, t: int, splits: int = DEFAULT_SPLITS) -> float:
    """Seconds of communication not hidden behind the GEMM (the module docstring's model)."""
    c, g = p.comm_s, p.gemm_s
    if method is None:
        return c
    kind = METHODS[method].kind
    if kind == "ring":
        total = (t - 1) * max(c / (t - 1), g / t) + g / t
    elif kind == "pipelined":
        total = g / splits + (splits - 1) * max(g / splits, c / splits) + c / splits
    else:
        total = max(c, g)
    return max(total - g, 0.0)


def chosen(options: tuple[str, ...], methods: frozenset[str]) -> str | None:
    """The enabled method that hides a collective with these options, if any."""
    if "rs-dgrad" in methods and "rs-dgrad" in options:
        return "rs-dgrad"  # it turns the bulk overlaps off
    return next((m for m in options if m in methods), None)


def buffer_bytes(config: ModelConfig, methods: frozenset[str], t: int) -> dict[str, int]:
    """Userbuffers for the whole model, one per overlapped GEMM name (outside PyTorch's allocator)."""
    sizes = dim_sizes(config)
    whole = sizes[Dim.B] * sizes[Dim.S] * sizes[Dim.H] * DTYPE_BYTES[config.dtype]
    used = {gemm: chosen(options, methods) for *_, gemm, options in PAIRS}
    return {gemm: int((Fraction(2 * t - 1, t) if method == "ring-rs" else 1) * whole)
            for gemm, method in used.items() if method is not None}


def resolve(names: Any) -> frozenset[str]:
    """A comma list of methods ('default' is tp_comm_overlap's own set) as a checked set."""
    chosen_names = {m for name in names for m in (DEFAULT if name == "default" else (name,))}
    unknown = sorted(chosen_names - set(METHODS))
    if unknown:
        raise ConfigError(f"unknown overlap method {unknown[0]!r} (known: {', '.join(METHODS)}, or 'default')")
    return frozenset(chosen_names)
