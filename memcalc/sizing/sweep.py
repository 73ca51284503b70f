"""Sweeps: every combination of swept sizes under every strategy, from the ledger, with numpy.

The bytes come from the code a single estimate uses (`evaluate.dim_sizes`, `evaluate.rank_shape`) applied to
arrays along separate axes, so broadcasting covers the grid with no loop over points and no second formula. A
point that breaks a divisibility rule is dropped and counted by rule (`Skip`). Bytes are exact int64; a sweep
that could pass 2^63 is refused before anything is computed.
"""

from __future__ import annotations

from collections import Counter
from itertools import product, takewhile
from dataclasses import dataclass, replace
from math import prod
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from memcalc.config.schema import (
    EXPERT_AXES, SIZES, ModelConfig, build_knobs, check_layout, field_default, field_names, validate_fields,
)
from memcalc.errors import ConfigError
from memcalc.text import short_repr, whole_number
from memcalc.model.evaluate import dim_sizes, rank_shape
from memcalc.model.impls import implementation, layer_tensors, plan, size_rule, strategies_of
from memcalc.model.knobs import BY_NAME as KNOB_NAMES
from memcalc.model.knobs import Accounting, Knobs, element_bytes
from memcalc.model.rules import AS_USED, DIVISIBILITY, EXPERT_RULES, SEQUENCE_SPLIT, Rule
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import STRATEGIES, Strategy

# The grid's axes are SIZES, in that order; with experts, E, k and ep (EXPERT_AXES) as well, before L (AXES).
AXES = (*SIZES[:-1], *EXPERT_AXES, SIZES[-1])
MAX_SIZE = 2**40  # far above any model; keeps 4h and every per-rank dimension exact in int64
MAX_ROWS = 10_000_000  # points x strategies; about 1 GB of arrays at the peak
INT64_MAX = 2**63 - 1

RANGE_SYNTAX = "a list 1024,2048, a range start:stop[:step] (stop included) or start:stop:xK"


# --- Values of one size -------------------------------------------------------

def parse_values(text: str) -> Sequence[int]:
    """The values a flag like `--s` stands for, in order: '1024,2048'; '1:64'; '64:640000:64' (a lazy `range`, the
    stop included when the steps land on it); '1024:32768:x2' (geometric)."""
    if ":" not in text:
        values = tuple(_whole(part, text) for part in text.split(","))
        repeated = sorted(v for v, n in Counter(values).items() if n > 1)
        if repeated:
            raise ConfigError(f"{short_repr(text)} repeats {', '.join(map(str, repeated))}; give each value once")
        return values
    parts = text.split(":")
    if len(parts) > 3:
        raise ConfigError(f"{short_repr(text)} has {len(parts) - 1} colons; expected {RANGE_SYNTAX}")
    start, stop = _whole(parts[0], text), _whole(parts[1], text)
    if start > stop:
        raise ConfigError(f"{short_repr(text)} is empty: start {start} is above stop {stop}")
    step = parts[2].strip() if len(parts) == 3 else "1"
    if step[:1] in ("x", "X"):
        factor = _whole(step[1:], text, what="factor")
        if factor < 2:
            raise ConfigError(f"{short_repr(text)}: a geometric factor must be at least 2 (got x{factor})")
        powers = [start]
        while powers[-1] * factor <= stop:
            powers.append(powers[-1] * factor)
        return tuple(powers)
    return range(start, stop + 1, _whole(step, text, what="step"))


def _whole(part: str, text: str, what: str = "value") -> int:
    """A positive whole number by `whole_number`'s rule (a flag's), or an error naming the part of `text` that is
    not one. Values up to MAX_INT_DIGITS digits are read; `make_sweep` checks them against MAX_SIZE."""
    if not part.strip():
        raise ConfigError(f"{short_repr(text)}: {what} {short_repr(part)} is empty; expected {RANGE_SYNTAX}")
    try:
        number = whole_number(part)
    except ConfigError as exc:
        raise ConfigError(str(exc) if part == text else f"{short_repr(text)}: {what}: {exc}") from None
    if number <= 0:
        raise ConfigError(f"{short_repr(text)}: {what} must be positive (got {number})")
    return number


# --- What to sweep ------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """What to evaluate: the values of each size, the knobs, strategies, accounting."""

    values: dict[str, Sequence[int]]  # every name in SIZES, in that order; with experts, every name in AXES
    knobs: Knobs  # with experts, E and k are the grid's (the knobs hold values every point's tensor set shares)
    strategies: tuple[Strategy, ...]
    accounting: Accounting
    name: str | None = None
    size_checks: SizeChecks | None = None  # the points the implementation's own size checks refuse

    @property
    def rows(self) -> int:
        """Configurations before skipping: points times strategies."""
        return prod(len(v) for v in self.values.values()) * len(self.strategies)

    @property
    def axes(self) -> tuple[str, ...]:
        """The grid's axes: SIZES, or AXES when the model has experts."""
        return tuple(self.values)

    @property
    def ep(self) -> int | None:
        """The expert-parallel size when one value of it is swept (1 without experts), else None."""
        values = self.values.get("ep", (1,))
        return values[0] if len(values) == 1 else None


def make_sweep(
    fields: dict[str, Any], ranges: dict[str, Sequence[int]], strategies: Sequence[Strategy] | None,
    accounting: Accounting,
) -> Sweep:
    """A checked sweep: `ranges` give swept sizes, `fields` (a config's keys) the rest; `strategies` None is every
    layout the implementation runs for the knobs. Rules between sizes are left to `evaluate_sweep`, per point;
    cp > 1 is refused (each rank would keep s/cp tokens)."""
    # Knobs, and unknown keys so that validation names them; sizes and layout fields are not knobs.
    knob_fields = _as_a_config_reads({k: v for k, v in fields.items()
                                      if k in field_names(Knobs) or k not in field_names()}, fields, ranges)
    knobs = build_knobs(knob_fields | _expert_knobs(ranges, fields))
    if fields.get("cp", 1) != 1:
        raise ConfigError(f"sweeps do not model context parallelism (cp={fields['cp']}); use memcalc estimate for it")
    axes = AXES if knobs.moe else SIZES
    values = {name: ranges[name] if name in ranges else (_fixed(name, fields),) for name in axes}
    _check_experts(fields, ranges, knobs, values)
    # Sizes first: a range past MAX_SIZE may be too long for len() to count.
    largest = {n: _largest(v) for n, v in values.items()}
    largest |= {"ffn_hidden_size": knobs.ffn_hidden_size, "num_query_groups": knobs.num_query_groups,
                "kv_channels": knobs.kv_channels}
    for name, value in largest.items():
        if value is not None and value > MAX_SIZE:
            raise ConfigError(f"{name}={value} is too large for a sweep (at most 2^40)")
    chosen = [STRATEGIES[n] for n in strategies_of(knobs)] if strategies is None else strategies
    sweep = Sweep(values, knobs, tuple(plan(knobs, st) for st in chosen), accounting, fields.get("name"))
    if sweep.rows > MAX_ROWS:
        raise ConfigError(
            f"the sweep has {sweep.rows:,} configurations; at most {MAX_ROWS:,} fit in memory at once "
            "(narrow the ranges, or split the sweep)"
        )
    config = _check_layout(fields, values)  # after the row cap, which bounds how many values of L it reads
    _check_ep_layout(config, values, sweep.strategies)
    return replace(sweep, size_checks=_size_checks(config, values))


def _check_ep_layout(config: ModelConfig, values: dict[str, Sequence[int]], planned: tuple[Strategy, ...]) -> None:
    """A sweep lays each strategy out once, at ep = 1 (the knobs hold no ep). An implementation that lays its experts
    out otherwise at ep > 1 (torchtitan's MoE routes each TP rank's own s/t tokens) is refused there, not priced as at
    ep = 1."""
    ep = next((e for e in values.get("ep", ()) if e > 1), None)
    if ep is not None and any(plan(replace(config, ep=ep), STRATEGIES[st.name]) != st for st in planned):
        raise ConfigError(f"impl {config.impl} lays its experts out differently at ep={ep} than at ep=1, and a sweep"
                          " lays each strategy out once, at ep=1: sweep ep 1, or use memcalc estimate for ep > 1")


def _as_a_config_reads(
    knob_fields: dict[str, Any], fields: dict[str, Any], ranges: dict[str, Sequence[int]]
) -> dict[str, Any]:
    """The knob fields without a group per head (num_query_groups = a) or heads of h/a channels (kv_channels = h/a)
    where a and h take one value: a config reads those as unset (`Knobs.of`), and so does `estimate`; the knobs
    alone, without a and h, cannot tell (DeepSeek's config.json says num_key_value_heads = heads, which latent
    attention refuses as K/V groups; impl paper refuses either as outside the seed's layer)."""
    a, h = _one_value("a", fields, ranges), _one_value("h", fields, ranges)
    unset = {"num_query_groups": a, "kv_channels": h // a if a and h and h % a == 0 else None}
    return {k: v for k, v in knob_fields.items() if not (k in unset and type(v) is int and v == unset[k])}


def _one_value(name: str, fields: dict[str, Any], ranges: dict[str, Sequence[int]]) -> int | None:
    """The one whole number a size takes in the sweep (the config's, or an axis of one value), None where it varies
    (or is not a whole number: validation names it later)."""
    values = ranges.get(name, (fields.get(name),))
    if type(values[0]) is not int:  # a list or a mapping in the config is unhashable: validation refuses it later
        return None
    one = values[0] == values[-1] and (isinstance(values, range) or len(set(values)) == 1)
    return values[0] if one else None


def _expert_knobs(ranges: dict[str, Sequence[int]], fields: dict[str, Any]) -> dict[str, int]:
    """Swept E and k as knob values that pass the knobs' own checks: the most experts, and the fewest picks they
    hold above one (megatron's softmax router refuses k = 1; the grid holds every value, and `per_layer_bytes` takes
    each k's tensor set)."""
    experts = _largest(ranges["num_experts"]) if "num_experts" in ranges else fields.get("num_experts") or 0
    knobs = {"num_experts": experts} if "num_experts" in ranges else {}
    if "moe_router_topk" in ranges:
        ks = ranges["moe_router_topk"]
        ordered = ks if isinstance(ks, range) else sorted(ks)
        knobs["moe_router_topk"] = next((k for k in takewhile(lambda k: k <= experts, ordered) if k > 1), ordered[0])
    return knobs


def _largest(values: Sequence[int]) -> int:
    """The largest value, without walking a range (a swept range may be too long to)."""
    return values[-1] if isinstance(values, range) else max(values)


def _check_experts(
    fields: dict[str, Any], ranges: dict[str, Sequence[int]], knobs: Knobs, values: dict[str, Sequence[int]]
) -> None:
    """The expert rules that hold at every point or none: E, k and ep are swept only with experts, the first
    dense layers leave every swept L a MoE layer, and etp (which memcalc models as t) is not fixed while t is
    swept. Between E, k and ep the rules are memcalc.model.rules' EXPERT_RULES, applied per point."""
    if not knobs.moe:
        if "ep" in ranges or fields.get("ep", 1) != 1:
            raise ConfigError("ep is given but num_experts is not (a dense MLP has no experts to split)")
        return
    first = knobs.moe_first_dense_layers or 0
    if first and min(values["L"]) <= first:
        raise ConfigError(f"moe_first_dense_layers={first} leaves none of L={min(values['L'])} layers a MoE layer;"
                          f" sweep L above {first}")
    if fields.get("etp") is not None and len(values["t"]) > 1:
        raise ConfigError(f"etp={fields['etp']} is fixed while t is swept; memcalc models etp = t, so leave etp out")


def _check_layout(fields: dict[str, Any], values: dict[str, Sequence[int]]) -> ModelConfig:
    """Every field by `memcalc estimate`'s rules but the per-point divisibility ones, at one point that stands for
    the sweep: the first values, but s at its largest (a position table must hold it) and an L that breaks the
    pipeline rule if any does."""
    point = {name: v[0] for name, v in values.items()}
    point["s"] = _largest(values["s"])
    if "num_experts" in point:  # a point the expert rules (applied per point) let through
        point |= _expert_knobs(values, fields) | {"ep": 1}
    config = validate_fields(fields | point)
    chunks = config.pp * (config.vpp or 1)
    if chunks > 1:
        point["L"] = next((L for L in values["L"] if L % chunks), point["L"])
        config = replace(config, L=point["L"])
    check_layout(config)
    return config


# The axes an implementation's own size checks may read (its check_sizes: widths against t, kernels' strides,
# SelectiveAC's gate-shaped matmuls), not b, s or L; a sweep runs them at every combination of these it sweeps.
_CHECKED_AXES, _MAX_CHECKED = ("h", "a", "t", "num_experts", "moe_router_topk", "ep"), 100_000


@dataclass(frozen=True)
class SizeChecks:
    """An implementation's own size checks as a sweep's rule: the points they refuse (a mask shaped as the grid, one
    along the axes they do not read) and the first refusal's words."""

    refused: np.ndarray
    first: str
    text = "the library's own size checks refuse it"
    operands = ()

    def message(self) -> str:
        return self.first


def _size_checks(config: ModelConfig, values: dict[str, Sequence[int]]) -> SizeChecks | None:
    """The implementation's check_sizes at every combination of the swept axes it may read (`_CHECKED_AXES`; the
    representative point passed `check_layout` already), None where it refuses none."""
    axes = {n: values[n] for n in _CHECKED_AXES if n in values and len(values[n]) > 1}
    if prod(len(v) for v in axes.values()) > _MAX_CHECKED:
        raise ConfigError(f"a sweep runs the library's own size checks at each combination of {', '.join(axes)}: at"
                          f" most {_MAX_CHECKED:,}; narrow them")
    check, first = implementation(config).check_sizes, None
    refused = np.zeros([len(values[n]) if n in axes else 1 for n in values], dtype=bool)
    for index in np.ndindex(*(len(v) for v in axes.values())):
        at = dict(zip(axes, index))  # the combination's place along each checked axis
        try:
            check(replace(config, **{n: axes[n][i] for n, i in at.items()}))
        except ConfigError as exc:
            refused[tuple(at.get(n, 0) for n in values)] = True
            first = first or str(exc)
    return SizeChecks(refused, first) if first else None


def _fixed(name: str, fields: dict[str, Any]) -> int:
    """A size that is not swept: from the config, else the config's default."""
    if name not in fields:
        default = field_default(name)
        if default is None:
            raise ConfigError(f"field '{name}' is required")
        return default
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"field '{name}': must be a positive whole number (got {short_repr(value)})")
    return value


# --- The grid -----------------------------------------------------------------

@dataclass(frozen=True)
class GridSizes:
    """The sweep's sizes as arrays along separate axes (six, or nine with experts), so arithmetic
    broadcasts to every combination. It reads like the ModelConfig that `evaluate.dim_sizes` takes."""

    b: np.ndarray
    s: np.ndarray
    h: np.ndarray
    a: np.ndarray
    t: np.ndarray
    L: np.ndarray
    knobs: Knobs  # every other knob (widths, the token bound, ...) is read from these
    num_experts: np.ndarray | None = None  # axes of their own with experts (EXPERT_AXES); None without
    moe_router_topk: np.ndarray | int = 2
    ep: np.ndarray | int = 1
    names: tuple[str, ...] = SIZES  # the axes, in order
    cp = 1  # make_sweep refuses context parallelism
    vocab_size = None  # a layer keeps nothing vocabulary-wide

    # The config's own rules (4h unless set; a unless set; which layers are MoE layers), here on arrays.
    ffn = property(ModelConfig.ffn.fget)
    groups = property(ModelConfig.groups.fget)
    expert_ffn = property(ModelConfig.expert_ffn.fget)
    head_dim = property(ModelConfig.head_dim.fget)
    moe_layers = property(ModelConfig.moe_layers.fget)

    def __getattr__(self, name: str) -> Any:
        """A knob that is not an axis of the grid, as the sweep's knobs set it."""
        if name in KNOB_NAMES:
            return getattr(self.knobs, name)
        raise AttributeError(name)

    @classmethod
    def of(cls, sweep: Sweep) -> GridSizes:
        """Each size's values along an axis of its own, in the order of the sweep's axes."""
        axes = {}
        for i, (name, values) in enumerate(sweep.values.items()):
            shape = [1] * len(sweep.values)
            shape[i] = -1
            axes[name] = _array(values).reshape(shape)  # (1, .., n_i, .., 1)
        if "num_experts" not in axes:
            axes |= {"num_experts": sweep.knobs.num_experts, "moe_router_topk": sweep.knobs.moe_router_topk}
        return cls(**axes, knobs=sweep.knobs, names=sweep.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name).size for name in self.names)

    def axis(self, name: str) -> int:
        """Where `name`'s values lie among the grid's axes."""
        return self.names.index(name)

    def at(self, name: str, value: int) -> GridSizes:
        """This grid with one value of the axis `name` (an axis of length 1)."""
        shape = [1] * len(self.names)
        return replace(self, **{name: np.array(value, dtype=np.int64).reshape(shape)})

    def operand(self, name: str) -> Any:
        """A size as the divisibility rules name it, as used (ffn for ffn_hidden_size, groups for num_query_groups)."""
        return getattr(self, AS_USED.get(name, name))


def _array(values: Sequence[int]) -> np.ndarray:
    if isinstance(values, range):
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    return np.array(values, dtype=np.int64)


def per_layer_bytes(grid: GridSizes, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> np.ndarray:
    """One rank's bytes for one layer at every point of the grid (broadcastable, L-free); where a swept top-k
    changes which tensors a layer keeps, each k's slice is evaluated with its own set (zeros for a k an expert rule
    refuses: its points are skipped)."""
    variants = _topk_variants(grid, knobs)
    if len({tuple(x.name for s in _kept_sets(k, accounting) for x in s) for k in variants if k}) == 1:
        return _same_set_bytes(grid, strategy, knobs, accounting)
    shape = grid.shape[:-1] + (1,)
    axis = grid.axis("moe_router_topk")
    one_k = shape[:axis] + (1,) + shape[axis + 1:]
    slices = [
        np.broadcast_to(_same_set_bytes(grid.at("moe_router_topk", k.moe_router_topk), strategy, k, accounting), one_k)
        if k else np.zeros(one_k, dtype=np.int64) for k in variants
    ]
    return np.concatenate(slices, axis=axis)


def model_wide_bytes(grid: GridSizes, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> np.ndarray:
    """The bytes of what every layer keeps of the model's one copy (RoPE's tables) at every point (L-free)."""
    shared = tuple(x for x in layer_tensors(knobs, accounting) if x.model_wide)
    sizes = dim_sizes(grid, grid.t if strategy.sequence_parallel else 1)
    return _tensor_bytes(shared, strategy, sizes, grid.t, knobs, accounting)


def _topk_variants(grid: GridSizes, knobs: Knobs) -> list[Knobs | None]:
    """The knobs at each value of a swept top-k, in the axis's order, None where an expert rule refuses that k at
    every E (megatron's softmax router at k = 1); else (or for a dense layer) the knobs alone."""
    if "moe_router_topk" not in grid.names or not knobs.moe:
        return [knobs]
    rules = [r for r in EXPERT_RULES[1:] if r.applies(knobs)]
    return [None if any(r.fails(knobs.num_experts, int(k)) for r in rules) else replace(knobs, moe_router_topk=int(k))
            for k in grid.moe_router_topk.ravel()]


def _same_set_bytes(grid: GridSizes, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> np.ndarray:
    """One layer's bytes where one top-k's tensor set holds at every point; a point whose K/V groups equal its
    heads takes multi-head attention's set, as `Knobs.of` reads a config."""
    if knobs.num_query_groups is not None:
        multi_head = _kernel_aware_bytes(grid, strategy, replace(knobs, num_query_groups=None), accounting)
        grouped = _kernel_aware_bytes(grid, strategy, knobs, accounting)
        return np.where(grid.a == knobs.num_query_groups, multi_head, grouped)
    return _kernel_aware_bytes(grid, strategy, knobs, accounting)


def _kernel_aware_bytes(grid: GridSizes, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> np.ndarray:
    """The layer's bytes, taking the implementation's size rule's other set where its kernel does not run."""
    sizes = dim_sizes(grid, grid.t if strategy.sequence_parallel else 1)  # under SP each of t ranks routes its own
    inside = _tensor_bytes(layer_tensors(knobs, accounting), strategy, sizes, grid.t, knobs, accounting)
    rule = size_rule(knobs)
    if rule is None:
        return inside
    outside = _tensor_bytes(rule.outside(knobs, accounting), strategy, sizes, grid.t, knobs, accounting)
    return np.where(rule.runs_at(knobs, sizes, grid.t if strategy.tensor_parallel else 1), inside, outside)


def _tensor_bytes(
    tensors: tuple[SavedTensor, ...], strategy: Strategy, sizes: dict, t: np.ndarray, knobs: Knobs,
    accounting: Accounting,
) -> np.ndarray:
    """The bytes of `tensors` on one rank at every point of the grid, each size condition's tensor replaced (or
    dropped) at the points where the sizes take the other branch (`memcalc.model.impls.tensors_at`)."""
    def one(x: SavedTensor) -> np.ndarray:
        return prod(sorted(rank_shape(x, strategy, sizes, t), key=np.size), start=element_bytes(x.kind, knobs,
                                                                                                accounting))

    conditions = {c.tensor.name: c for c in implementation(knobs).size_conditions if c.applies(knobs)}
    split = t if strategy.tensor_parallel else 1

    def term(x: SavedTensor) -> np.ndarray:
        condition = conditions.get(x.name)
        if condition is None:
            return one(x)
        # another tensor in x's place is kept where its own condition says (`memcalc.model.impls.tensors_at`)
        other = sum(term(y) if y.name != x.name else one(y) for y in strategy.kept(condition.instead))
        return np.where(condition.kept(sizes, split), one(x), other)

    return np.asarray(sum(term(x) for x in strategy.kept(tensors)))


def _kept_sets(knobs: Knobs, accounting: Accounting) -> list[tuple[SavedTensor, ...]]:
    """Every set of tensors some point of a sweep may keep (see per_layer_bytes)."""
    layers = [knobs] + ([knobs.dense] if _mixed(knobs) else [])
    variants = [v for k in layers for v in [k] + ([replace(k, num_query_groups=None)] if k.num_query_groups else [])]
    sets = []
    for k in variants:
        rule = size_rule(k)
        sets += [layer_tensors(k, accounting)] + ([rule.outside(k, accounting)] if rule else [])
    return sets


def _check_int64(grid: GridSizes, sweep: Sweep, knobs: Knobs) -> None:
    """Refuse a sweep whose bytes could pass int64, before computing any: each tensor's bytes are at most its
    dimensions' largest values with the smallest t, bounded in Python integers."""
    largest = {d: int(np.max(v)) for d, v in dim_sizes(grid).items() if v is not None}
    t, layers = int(np.min(grid.t)), int(np.max(grid.L))
    sets = [kept for k in _topk_variants(grid, knobs) if k for kept in _kept_sets(k, sweep.accounting)]
    bound = layers * max(
        sum(element_bytes(x.kind, knobs, sweep.accounting) * prod(rank_shape(x, st, largest, t)) for x in kept)
        for st in sweep.strategies for kept in sets
    )
    if bound > INT64_MAX:
        raise ConfigError(
            f"bytes in this sweep could reach {bound:.3g}, beyond 64-bit integers ({INT64_MAX:.3g}); narrow the ranges"
        )


# --- Divisibility, point by point ---------------------------------------------

@dataclass(frozen=True)
class Skip:
    """Configurations dropped because of one rule (the first each one breaks)."""

    rule: Rule | SizeChecks
    count: int
    example: str


def _failures(grid: GridSizes, strategies: tuple[Strategy, ...], size_checks: SizeChecks | None
              ) -> Iterator[tuple[Rule | SizeChecks, np.ndarray]]:
    """Each rule with where it fails, shaped (*grid, strategy) for broadcasting; the library's size checks last."""
    experts = EXPERT_RULES if "num_experts" in grid.names else ()
    for rule in (r for r in (*DIVISIBILITY, *experts) if r.applies(grid.knobs)):
        yield rule, np.asarray(rule.fails(*(grid.operand(n) for n in rule.operands)))[..., None]
    splits_s = np.array([st.sequence_parallel for st in strategies])
    yield SEQUENCE_SPLIT, (grid.s % grid.t != 0)[..., None] & splits_s
    if size_checks is not None:
        yield size_checks, size_checks.refused[..., None]


def _apply_rules(grid: GridSizes, strategies: tuple[Strategy, ...], size_checks: SizeChecks | None = None
                 ) -> tuple[np.ndarray, tuple[Skip, ...]]:
    """Which configurations keep their numbers, and what was dropped, rule by rule."""
    full = grid.shape + (len(strategies),)
    keep = np.ones(full, dtype=bool)
    skips = []
    for rule, fails in _failures(grid, strategies, size_checks):
        hit = keep & fails
        count = int(np.count_nonzero(hit))
        if count:
            at = np.unravel_index(int(np.argmax(hit)), full)[:-1]  # the first dropped point
            operands = (int(np.broadcast_to(grid.operand(n), grid.shape)[at]) for n in rule.operands)
            skips.append(Skip(rule, count, rule.message(*operands)))
        keep &= ~fails
    return keep, tuple(skips)


# --- Evaluation ---------------------------------------------------------------

@dataclass(frozen=True)
class SweepResult:
    """Every kept configuration: one row per (point, strategy), points in grid order."""

    sweep: Sweep
    grid: GridSizes
    index: tuple[np.ndarray, ...]  # per row: the index into each of the grid's axes, then the strategy
    per_layer: np.ndarray
    total: np.ndarray
    skipped: tuple[Skip, ...]

    @property
    def rows(self) -> int:
        return len(self.per_layer)

    def __repr__(self) -> str:
        """One line for a notebook: the generated repr would print the grid's arrays."""
        skipped = sum(s.count for s in self.skipped)
        strategies = ", ".join(st.name for st in self.sweep.strategies)
        name = f" {self.sweep.name}:" if self.sweep.name else ""
        return (f"<SweepResult{name} {self.rows:,} rows of {self.sweep.rows:,} configurations"
                f" ({skipped:,} skipped); strategies {strategies}>")

    def row(self, i: int) -> dict[str, Any]:
        """Row `i` as the CSV columns (memcalc.cli.sweep_output.CSV_COLUMNS) and, with experts, E, k and ep
        -> Python values."""
        sizes = {name: int(getattr(self.grid, name).ravel()[self.index[k][i]]) for k, name in enumerate(self.grid.names)}
        strategy = self.sweep.strategies[self.index[-1][i]].name
        bytes_ = {"per_layer_bytes": int(self.per_layer[i]), "total_bytes": int(self.total[i])}
        return {**sizes, "strategy": strategy, **bytes_}

    def along(self, name: str, per_layer: bool = False) -> dict[Strategy, np.ndarray]:
        """Bytes against the one swept size `name`: per strategy, one value per value
        of `name` (float, NaN where a rule dropped the point)."""
        others = [n for n in self.grid.names if n != name and len(self.sweep.values[n]) > 1]
        if others:
            raise ValueError(f"a series along {name} needs every other size fixed (several values for {others})")
        values = self.per_layer if per_layer else self.total
        at = self.index[self.grid.axis(name)]
        series = {}
        for k, strategy in enumerate(self.sweep.strategies):
            mine = self.index[-1] == k
            line = np.full(len(self.sweep.values[name]), np.nan)
            line[at[mine]] = values[mine]
            series[strategy] = line
        return series


def evaluate_sweep(sweep: Sweep, advance: Callable[[int], None] = lambda rows: None) -> SweepResult:
    """Bytes for every configuration of the sweep that passes the divisibility rules; `advance` is told how many
    configurations each strategy's pass covered (a progress bar)."""
    knobs = Knobs.of(sweep.knobs)
    grid = GridSizes.of(sweep)
    _check_int64(grid, sweep, knobs)
    keep, skipped = _apply_rules(grid, sweep.strategies, sweep.size_checks)
    if not keep.any():
        raise ConfigError(f"no configuration in the sweep passes the divisibility rules, e.g. {skipped[0].example}")
    index = np.nonzero(keep)
    at, layers = index[:-2] + (0, index[-1]), grid.L.ravel()[index[-2]]
    per_layer = _layer_columns(grid, sweep, knobs, per_layer_bytes, advance)[at]
    shared = _layer_columns(grid, sweep, knobs, model_wide_bytes)[at]  # in every layer's bytes, once in the model's
    once = shared * implementation(knobs).model_wide_copies(knobs, layers)
    if not _mixed(knobs):
        return SweepResult(sweep, grid, index, per_layer, (per_layer - shared) * layers + once, skipped)
    moe = grid.moe_layers.ravel()[index[-2]]
    dense = _layer_columns(grid, sweep, knobs.dense, per_layer_bytes)[at]
    total = (per_layer - shared) * moe + (dense - shared) * (layers - moe) + once
    return SweepResult(sweep, grid, index, per_layer, total, skipped)


def _mixed(knobs: Knobs) -> bool:
    """Some layers of the model are dense and some MoE (moe_layer_freq > 1, or first dense layers)."""
    return knobs.moe and (knobs.moe_layer_freq > 1 or bool(knobs.moe_first_dense_layers))


def _layer_columns(
    grid: GridSizes, sweep: Sweep, knobs: Knobs, bytes_of: Callable[..., np.ndarray],
    advance: Callable[[int], None] = lambda rows: None,
) -> np.ndarray:
    """`bytes_of` (one layer's, or its model-wide tensors') under each strategy, shaped (b, s, h, a, t, 1,
    strategy); both are L-free."""
    layer_free = grid.shape[:-1] + (1,)
    columns = []
    for st in sweep.strategies:
        columns.append(np.broadcast_to(bytes_of(grid, st, knobs, sweep.accounting), layer_free))
        advance(sweep.rows // len(sweep.strategies))
    return np.stack(columns, axis=-1)


def describe_skips(result: SweepResult) -> str | None:
    """One line on what was dropped and why, or None if nothing was."""
    if not result.skipped:
        return None
    parts = "; ".join(f"{s.count:,} because {s.rule.text}, e.g. {s.example}" for s in result.skipped)
    dropped = sum(s.count for s in result.skipped)
    return f"skipped {dropped:,} of {result.sweep.rows:,} configurations that break a divisibility rule: {parts}"
