"""Sweeps: many configurations evaluated at once, from the ledger, with numpy.

Each of b, s, h, a, t, L takes a list or a range of values (`parse_values`);
every combination is a point of a grid, and every point is evaluated under
every chosen strategy. The bytes come from the code a single estimate uses,
`evaluate.dim_sizes` and `evaluate.rank_shape`, applied to numpy arrays that lie
along separate axes: broadcasting builds each tensor's bytes over the whole
grid in a few array operations, with no Python loop over points and no second
copy of any formula.

A point that breaks a divisibility rule gets no number. It is dropped, and the
drops are counted by rule (`Skip`), each with an example worded the way
`memcalc.config.schema` words it. Bytes are exact int64; a sweep whose bytes could
pass 2^63 is refused before anything is computed, never wrapped.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from math import prod
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from memcalc.config.schema import (
    AS_USED, DIVISIBILITY, SEQUENCE_SPLIT, SIZES, ModelConfig, Rule, build_knobs, check_layout, field_default,
    field_names, validate_fields,
)
from memcalc.errors import ConfigError
from memcalc.text import short_repr
from memcalc.model.evaluate import dim_sizes, rank_shape
from memcalc.model.impls import layer_tensors, plan, size_rule
from memcalc.model.knobs import MLA_KNOBS, Accounting, Knobs, element_bytes
from memcalc.model.ledger import SavedTensor
from memcalc.model.strategy import Strategy

# The grid's axes are SIZES, in that order.
MAX_SIZE = 2**40  # far above any model; keeps 4h and every per-rank dimension exact in int64
MAX_DIGITS = 40  # a value longer than this is refused unread; shorter ones are checked against MAX_SIZE
MAX_ROWS = 10_000_000  # points x strategies; about 1 GB of arrays at the peak
INT64_MAX = 2**63 - 1

RANGE_SYNTAX = "a list 1024,2048, a range start:stop[:step] (stop included) or start:stop:xK"


# --- Values of one size -------------------------------------------------------

def parse_values(text: str) -> Sequence[int]:
    """The values a flag like `--s` stands for, in order.

    '1024,2048' -> (1024, 2048); '1:64' -> 1..64; '64:640000:64' -> 64, 128, ..,
    640000; '1024:32768:x2' -> 1024, 2048, .., 32768. A stop is included when
    the steps land on it. Arithmetic ranges stay lazy `range` objects, so a long
    one costs nothing until the sweep lays it out.
    """
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
        return _geometric(start, stop, factor)
    return range(start, stop + 1, _whole(step, text, what="step"))


def _whole(part: str, text: str, what: str = "value") -> int:
    """A positive whole number, or an error naming the part of `text` that is not one."""
    part = part.strip()
    if not re.fullmatch(r"[0-9]+", part):
        hint = "" if part else f"; expected {RANGE_SYNTAX}"
        raise ConfigError(f"{short_repr(text)}: {what} {short_repr(part)} is not a positive whole number{hint}")
    digits = len(part.lstrip("0"))
    if digits > MAX_DIGITS:  # before int(): Python refuses to read 4300 digits and more
        raise ConfigError(f"{short_repr(text)}: {what} of {digits} digits is too large (at most 2^40 = {MAX_SIZE})")
    if int(part) == 0:
        raise ConfigError(f"{short_repr(text)}: {what} must be positive (got 0)")
    return int(part)


def _geometric(start: int, stop: int, factor: int) -> tuple[int, ...]:
    values = [start]
    while values[-1] * factor <= stop:
        values.append(values[-1] * factor)
    return tuple(values)


# --- What to sweep ------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """What to evaluate: the values of each size, the knobs, strategies, accounting."""

    values: dict[str, Sequence[int]]  # every name in SIZES, in that order
    knobs: Knobs
    strategies: tuple[Strategy, ...]
    accounting: Accounting
    name: str | None = None

    @property
    def rows(self) -> int:
        """Configurations before skipping: points times strategies."""
        return prod(len(v) for v in self.values.values()) * len(self.strategies)


def make_sweep(
    fields: dict[str, Any], ranges: dict[str, Sequence[int]], strategies: Sequence[Strategy], accounting: Accounting
) -> Sweep:
    """A checked sweep: `ranges` give swept sizes, `fields` (a config's keys) the rest.

    Knobs are validated once, by the same schema as any config; the
    sizes are positive whole numbers by construction or checked here. Rules
    between sizes are left to `evaluate_sweep`, which applies them per point.
    The layout fields of a config (pp, vpp, dp, vocab_size, ...) do not change
    one layer's activations and are not read; context parallelism would (each
    rank keeps s/cp tokens), so a config with cp > 1 is refused.
    """
    # Knobs, and unknown keys so that validation names them; sizes and layout fields are not knobs.
    knobs = build_knobs({
        k: v for k, v in fields.items() if k in field_names(Knobs) or k not in field_names()
    })
    if fields.get("cp", 1) != 1:
        raise ConfigError(f"sweeps do not model context parallelism (cp={fields['cp']}); use memcalc estimate for it")
    if fields.get("ep", 1) != 1 or knobs.moe_layer_freq != 1 or knobs.moe_first_dense_layers:
        raise ConfigError(f"sweeps model every layer as one MoE layer on one expert-parallel rank (ep={fields.get('ep', 1)},"
                          f" moe_layer_freq={knobs.moe_layer_freq}, moe_first_dense_layers="
                          f"{knobs.moe_first_dense_layers}); use memcalc estimate for these")
    values = {name: ranges[name] if name in ranges else (_fixed(name, fields),) for name in SIZES}
    # Sizes first: a range past MAX_SIZE may be too long for len() to count.
    largest = {n: v[-1] if isinstance(v, range) else max(v) for n, v in values.items()}  # a range is increasing
    largest |= {"ffn_hidden_size": knobs.ffn_hidden_size, "num_query_groups": knobs.num_query_groups}
    for name, value in largest.items():
        if value is not None and value > MAX_SIZE:
            raise ConfigError(f"{name}={value} is too large for a sweep (at most 2^40)")
    sweep = Sweep(values, knobs, tuple(plan(knobs, st) for st in strategies), accounting, fields.get("name"))
    if sweep.rows > MAX_ROWS:
        raise ConfigError(
            f"the sweep has {sweep.rows:,} configurations; at most {MAX_ROWS:,} fit in memory at once "
            "(narrow the ranges, or split the sweep)"
        )
    _check_layout(fields, values)  # after the row cap, which bounds how many values of L it reads
    return sweep


def _check_layout(fields: dict[str, Any], values: dict[str, Sequence[int]]) -> None:
    """Every field by the rules `memcalc estimate` applies, except the divisibility rules that
    `evaluate_sweep` applies point by point.

    One point stands for the sweep: the first value of each size, but s at its
    largest (a learned position table must hold every s) and L at a value that
    breaks the pipeline rule if any does (pp*vpp must divide every L).
    """
    point = {name: v[0] for name, v in values.items()}
    point["s"] = max(values["s"]) if not isinstance(values["s"], range) else values["s"][-1]
    config = validate_fields(fields | point)
    chunks = config.pp * (config.vpp or 1)
    if chunks > 1:
        point["L"] = next((L for L in values["L"] if L % chunks), point["L"])
        config = replace(config, L=point["L"])
    check_layout(config)


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
    """The six sizes as arrays along separate axes, so arithmetic broadcasts to every
    combination. It reads like the ModelConfig that `evaluate.dim_sizes` takes."""

    b: np.ndarray
    s: np.ndarray
    h: np.ndarray
    a: np.ndarray
    t: np.ndarray
    L: np.ndarray
    ffn_hidden_size: int | None
    num_query_groups: int | None
    knobs: Knobs  # the MoE knobs' sizes (experts, top-k, widths, the token bound) are read from these
    cp = 1  # make_sweep refuses context parallelism
    ep = 1  # experts are not split in a sweep: every point is one rank holding every expert
    vocab_size = None  # a layer keeps nothing vocabulary-wide

    # The config's own rules (4h unless set; a unless set), here on arrays.
    ffn = property(ModelConfig.ffn.fget)
    groups = property(ModelConfig.groups.fget)
    expert_ffn = property(ModelConfig.expert_ffn.fget)

    def __getattr__(self, name: str) -> Any:
        """A MoE knob (num_experts, moe_*) or a latent-attention width, as the sweep's knobs set it."""
        if name == "num_experts" or name.startswith("moe_") or name in MLA_KNOBS:
            return getattr(self.knobs, name)
        raise AttributeError(name)

    @classmethod
    def of(cls, sweep: Sweep) -> GridSizes:
        """Each size's values along an axis of its own, in the order of SIZES."""
        axes = {}
        for i, (name, values) in enumerate(sweep.values.items()):
            shape = [1] * len(SIZES)
            shape[i] = -1
            axes[name] = _array(values).reshape(shape)  # (1, .., n_i, .., 1)
        return cls(**axes, ffn_hidden_size=sweep.knobs.ffn_hidden_size, num_query_groups=sweep.knobs.num_query_groups,
                   knobs=sweep.knobs)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name).size for name in SIZES)

    def operand(self, name: str) -> Any:
        """A size as the divisibility rules name it, as used (ffn for ffn_hidden_size, groups for num_query_groups)."""
        return getattr(self, AS_USED.get(name, name))


def _array(values: Sequence[int]) -> np.ndarray:
    if isinstance(values, range):
        return np.arange(values.start, values.stop, values.step, dtype=np.int64)
    return np.array(values, dtype=np.int64)


def per_layer_bytes(grid: GridSizes, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> np.ndarray:
    """One rank's bytes for one layer at every point of the grid (broadcastable, L-free).

    Each tensor's per-rank dimensions come from `rank_shape`, exactly as for a
    single estimate; multiplying the smallest arrays first keeps most products
    small until the last factor spreads them over the grid. Where what a layer
    keeps depends on the point (K/V groups equal to the heads are multi-head
    attention, as `Knobs.of` reads a config; a kernel that runs only at some
    sizes), each point takes the set its config would.
    """
    if knobs.num_query_groups is not None:
        multi_head = _kernel_aware_bytes(grid, strategy, replace(knobs, num_query_groups=None), accounting)
        grouped = _kernel_aware_bytes(grid, strategy, knobs, accounting)
        return np.where(grid.a == knobs.num_query_groups, multi_head, grouped)
    return _kernel_aware_bytes(grid, strategy, knobs, accounting)


def _kernel_aware_bytes(grid: GridSizes, strategy: Strategy, knobs: Knobs, accounting: Accounting) -> np.ndarray:
    """The layer's bytes, taking the implementation's size rule's other set where its kernel does not run."""
    sizes = dim_sizes(grid)
    inside = _tensor_bytes(layer_tensors(knobs, accounting), strategy, sizes, grid.t, knobs, accounting)
    rule = size_rule(knobs)
    if rule is None:
        return inside
    outside = _tensor_bytes(rule.outside(knobs, accounting), strategy, sizes, grid.t, knobs, accounting)
    return np.where(rule.runs(sizes, grid.t if strategy.tensor_parallel else 1), inside, outside)


def _tensor_bytes(
    tensors: tuple[SavedTensor, ...], strategy: Strategy, sizes: dict, t: np.ndarray, knobs: Knobs,
    accounting: Accounting,
) -> np.ndarray:
    """The bytes of `tensors` on one rank at every point of the grid."""
    terms = (
        prod(sorted(rank_shape(x, strategy, sizes, t), key=np.size), start=element_bytes(x.kind, knobs, accounting))
        for x in strategy.kept(tensors)
    )
    return np.asarray(sum(terms))


def _kept_sets(knobs: Knobs, accounting: Accounting) -> list[tuple[SavedTensor, ...]]:
    """Every set of tensors some point of a sweep may keep (see per_layer_bytes)."""
    variants = [knobs] + ([replace(knobs, num_query_groups=None)] if knobs.num_query_groups is not None else [])
    sets = []
    for k in variants:
        rule = size_rule(k)
        sets += [layer_tensors(k, accounting)] + ([rule.outside(k, accounting)] if rule else [])
    return sets


def _check_int64(grid: GridSizes, sweep: Sweep, knobs: Knobs) -> None:
    """Refuse a sweep whose bytes could pass int64, before computing any.

    Every per-rank dimension grows with the sizes and shrinks with t, so each
    tensor's bytes are at most the product of its dimensions' largest values
    with the smallest t; the bound is worked out in Python integers.
    """
    largest = {d: int(np.max(v)) for d, v in dim_sizes(grid).items() if v is not None}
    t, layers = int(np.min(grid.t)), int(np.max(grid.L))
    sets = _kept_sets(knobs, sweep.accounting)
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

    rule: Rule
    count: int
    example: str


def _failures(grid: GridSizes, strategies: tuple[Strategy, ...]) -> Iterator[tuple[Rule, np.ndarray]]:
    """Each rule with where it fails, shaped (*grid, strategy) for broadcasting."""
    for rule in DIVISIBILITY:
        yield rule, np.asarray(grid.operand(rule.value) % grid.operand(rule.divisor) != 0)[..., None]
    splits_s = np.array([st.sequence_parallel for st in strategies])
    yield SEQUENCE_SPLIT, (grid.s % grid.t != 0)[..., None] & splits_s


def _apply_rules(grid: GridSizes, strategies: tuple[Strategy, ...]) -> tuple[np.ndarray, tuple[Skip, ...]]:
    """Which configurations keep their numbers, and what was dropped, rule by rule."""
    full = grid.shape + (len(strategies),)
    keep = np.ones(full, dtype=bool)
    skips = []
    for rule, fails in _failures(grid, strategies):
        hit = keep & fails
        count = int(np.count_nonzero(hit))
        if count:
            at = np.unravel_index(int(np.argmax(hit)), full)[:-1]  # the first dropped point
            value, divisor = (int(np.broadcast_to(grid.operand(n), grid.shape)[at]) for n in (rule.value, rule.divisor))
            skips.append(Skip(rule, count, rule.message(divisor, value)))
        keep &= ~fails
    return keep, tuple(skips)


# --- Evaluation ---------------------------------------------------------------

@dataclass(frozen=True)
class SweepResult:
    """Every kept configuration: one row per (point, strategy), points in grid order."""

    sweep: Sweep
    grid: GridSizes
    index: tuple[np.ndarray, ...]  # per row: the index into each of SIZES, then the strategy
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
        """Row `i` as the CSV columns (memcalc.sizing.sweep_output.CSV_COLUMNS) -> Python values."""
        sizes = {name: int(getattr(self.grid, name).ravel()[self.index[k][i]]) for k, name in enumerate(SIZES)}
        strategy = self.sweep.strategies[self.index[-1][i]].name
        bytes_ = {"per_layer_bytes": int(self.per_layer[i]), "total_bytes": int(self.total[i])}
        return {**sizes, "strategy": strategy, **bytes_}

    def along(self, name: str, per_layer: bool = False) -> dict[Strategy, np.ndarray]:
        """Bytes against the one swept size `name`: per strategy, one value per value
        of `name` (float, NaN where a rule dropped the point)."""
        others = [n for n in SIZES if n != name and len(self.sweep.values[n]) > 1]
        if others:
            raise ValueError(f"a series along {name} needs every other size fixed (several values for {others})")
        values = self.per_layer if per_layer else self.total
        at = self.index[SIZES.index(name)]
        series = {}
        for k, strategy in enumerate(self.sweep.strategies):
            mine = self.index[-1] == k
            line = np.full(len(self.sweep.values[name]), np.nan)
            line[at[mine]] = values[mine]
            series[strategy] = line
        return series


def evaluate_sweep(sweep: Sweep, advance: Callable[[int], None] = lambda rows: None) -> SweepResult:
    """Bytes for every configuration of the sweep that passes the divisibility rules.

    `advance` is told how many configurations each strategy's pass covered, for
    a progress bar.
    """
    knobs = Knobs.of(sweep.knobs)
    grid = GridSizes.of(sweep)
    _check_int64(grid, sweep, knobs)
    keep, skipped = _apply_rules(grid, sweep.strategies)
    if not keep.any():
        raise ConfigError(f"no configuration in the sweep passes the divisibility rules, e.g. {skipped[0].example}")
    layer_free = grid.shape[:-1] + (1,)
    columns = []
    for st in sweep.strategies:
        columns.append(np.broadcast_to(per_layer_bytes(grid, st, knobs, sweep.accounting), layer_free))
        advance(sweep.rows // len(sweep.strategies))
    per_layer = np.stack(columns, axis=-1)  # (b, s, h, a, t, 1, strategy)
    index = np.nonzero(keep)
    per_layer = per_layer[index[:-2] + (0, index[-1])]
    total = per_layer * grid.L.ravel()[index[-2]]
    return SweepResult(sweep, grid, index, per_layer, total, skipped)


def describe_skips(result: SweepResult) -> str | None:
    """One line on what was dropped and why, or None if nothing was."""
    if not result.skipped:
        return None
    parts = "; ".join(f"{s.count:,} because {s.rule.text}, e.g. {s.example}" for s in result.skipped)
    dropped = sum(s.count for s in result.skipped)
    return f"skipped {dropped:,} of {result.sweep.rows:,} configurations that break a divisibility rule: {parts}"
