"""What fits a memory budget: the largest micro-batch b or sequence s, or the smallest t, pp, cp, ep or dp_shard.

Every answer is an exact integer, found by evaluating what `memcalc estimate --totals` bases its verdict on (or
the totals, or the activations alone), never by rounding a formula: it fits by estimate's own numbers, the next
valid value does not, and no larger value fits. Why each search is sound: docs/guide-fit-totals.md, section 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd, lcm
from typing import Callable

from memcalc.config.schema import ModelConfig, build_config
from memcalc.errors import ConfigError
from memcalc.model.impls import size_rule
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import Dim
from memcalc.model.strategy import Strategy
from memcalc.sizing.divisors import divisors
from memcalc.sizing.totals import per_gpu
from memcalc.sizing.verdict import need, step_peaks
from memcalc.units import human_bytes

_SEARCH_LIMIT = 2**48  # a guard: no real budget fits this many tokens or micro-batches
# A guard on time: each divisor tried is a whole step walk (up to ~60 ms), and a size below 2^63 can have 161,280
# divisors (hours when nothing fits). Every size below 1,081,080 has at most 240.
_MOST_DIVISORS = 256


@dataclass(frozen=True)
class Candidate:
    """One candidate value and what it needs (None: the value makes an invalid config, `reason` says why)."""

    value: int
    bytes: int | None
    reason: str = ""
    basis: str = ""  # counting the peak: what the bytes are (memcalc.sizing.verdict), the step's peak or not

    def fits(self, budget: int) -> bool:
        return self.bytes is not None and self.bytes <= budget


@dataclass(frozen=True)
class Fit:
    """The answer for one strategy and recompute choice: `answer` fits (None if nothing does); `beyond` is the
    candidate just past it (the next larger b or s, the next smaller valid t; the cheapest when nothing fits)."""

    strategy: Strategy
    recompute: str
    solve: str
    answer: Candidate | None
    beyond: Candidate | None

    def __repr__(self) -> str:
        """One line for a notebook: the answer and the candidate past it, in bytes a person reads."""
        def shown(c: Candidate | None) -> str:
            if c is None:
                return "none"
            return f"{self.solve}={c.value} " + (f"needs {human_bytes(c.bytes)}" if c.bytes is not None else "invalid")

        return f"<Fit {self.strategy.name}, recompute {self.recompute}: {shown(self.answer)}; next {shown(self.beyond)}>"


def sequence_step(config: ModelConfig, strategy: Strategy) -> int:
    """s must be a multiple of this: 2*cp under context parallelism, and t*cp under sequence parallelism (the
    rules live in check_layout and check_sequence_split; the search only skips what they would refuse)."""
    step = 2 * config.cp if config.cp > 1 else 1
    return lcm(step, config.t * config.cp) if strategy.sequence_parallel else step


def fit(
    config: ModelConfig, strategy: Strategy, solve: str, budget: int,
    accounting: Accounting = Accounting(), count: str = "peak",
) -> Fit:
    """The largest b or s, or the smallest t, pp, cp or ep, whose per-GPU bytes (`count`) are at most `budget`."""
    def try_value(value: int) -> Candidate:
        try:
            fields = config.as_dict() | {solve: value}
            if config.gpus is not None:
                del fields["dp"]  # derived again from gpus/(t*pp*cp) for this candidate
            if config.dp_shard is not None or solve == "dp_shard":
                fields["dp_replicate"] = None  # HSDP's replicas derived again: dp/dp_shard
            return _measure(value, build_config(fields), strategy, accounting, count)
        except ConfigError as exc:
            return Candidate(value, None, str(exc))

    if solve in _SPLITS:
        name, size = _SPLITS[solve](config)
        answer, beyond = _smallest(solve, name, size, try_value, budget)
    else:
        step = sequence_step(config, strategy) if solve == "s" else 1
        answer, beyond = _largest(lambda k: try_value(k * step), budget, *_classes(config, solve, step))
    return Fit(strategy, config.recompute, solve, answer, beyond)


def _measure(value: int, config: ModelConfig, strategy: Strategy, accounting: Accounting, count: str) -> Candidate:
    """A valid candidate's bytes: the step's peak (or, where not modelled, the total, said so) or a per-GPU count."""
    per = per_gpu(config, strategy, accounting)  # raises ConfigError for an invalid candidate
    if count != "peak":
        return Candidate(value, per.bytes(count))
    needed = need(per, step_peaks(config, strategy))  # a valid config the timeline may not model
    return Candidate(value, needed.bytes, basis=needed.basis)


def _classes(config: ModelConfig, solve: str, step: int) -> tuple[int, tuple[int, ...]]:
    """The period and edges in k (value k * step) of the size rule's pattern in the solved size (its `pattern`, on
    one context rank's s/cp tokens): (1, ()) where bytes grow with k throughout, as without a size rule."""
    rule = size_rule(Knobs.of(config))
    dim, per_rank = {"s": (Dim.S, config.cp), "b": (Dim.B, 1)}[solve]
    if rule is None or dim not in rule.pattern:
        return 1, ()
    period, edges = rule.pattern[dim]
    period *= per_rank
    starts = {-(-edge * per_rank // step) for edge in edges}  # the first k at or past each edge
    return period // gcd(period, step), tuple(sorted(k for k in starts if k > 1))


def _largest(
    try_value: Callable[[int], Candidate], budget: int, period: int = 1, edges: tuple[int, ...] = ()
) -> tuple[Candidate | None, Candidate]:
    """The candidate of the largest k that fits (None if none does), and that of k + 1. Bytes grow with k within
    each piece (the first from 1, the next from each edge) and residue class mod `period`, where a size rule's kernel
    runs throughout or nowhere; an invalid k (past a learned position table) stays invalid above. The highest piece
    with a fit holds the answer: each of its classes is searched above the largest k found so far."""
    try_value = lru_cache(maxsize=None)(try_value)
    best = 0
    for start, stop in reversed(tuple(zip((1, *edges), (*edges, None)))):
        for residue in range(period):
            first = max(start, best + 1)
            first += (residue - first) % period
            if stop is None or first < stop:
                count = None if stop is None else (stop - 1 - first) // period + 1
                best = max(best, _last_fit(try_value, budget, first, period, count))
        if best:
            break
    return (try_value(best) if best else None), try_value(best + 1)


def _last_fit(
    try_value: Callable[[int], Candidate], budget: int, first: int, period: int, count: int | None
) -> int:
    """The largest k of first, first + period, ... (`count` of them; None: unbounded) that fits, 0 if none does:
    doubling the index n of k = first + (n - 1) * period until one does not fit, then bisecting, as bytes grow."""
    def k(n: int) -> int:
        return first + (n - 1) * period

    lo, hi = 0, 1
    while (count is None or hi <= count) and try_value(k(hi)).fits(budget):
        if k(hi) >= _SEARCH_LIMIT:
            raise ConfigError(f"every value up to {try_value(k(hi)).value} fits; is the budget right?")
        lo, hi = hi, 2 * hi
    hi = hi if count is None else min(hi, count + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if try_value(k(mid)).fits(budget) else (lo, mid)
    return k(lo) if lo else 0


# What each split must divide: t | a, pp | L, and cp | s/2 (each context rank takes two chunks of 2cp).
_SPLITS: dict[str, Callable[[ModelConfig], tuple[str, int]]] = {
    "t": lambda c: ("a", c.a),
    "pp": lambda c: ("L", c.L),
    "cp": lambda c: ("s/2", max(c.s // 2, 1)),
    "ep": lambda c: ("num_experts", _experts(c)),
    "dp_shard": lambda c: ("dp", c.dp),
}


def _experts(config: ModelConfig) -> int:
    """E, the experts ep splits; ConfigError for a dense model, which has no ep to solve for."""
    if config.num_experts is None:
        raise ConfigError("the model has no experts (num_experts is not set), so there is no ep to solve for")
    return config.num_experts


def _smallest(
    solve: str, name: str, size: int, try_value: Callable[[int], Candidate], budget: int
) -> tuple[Candidate | None, Candidate | None]:
    """The smallest valid divisor of `size` that fits, and the valid value just below it (or the cheapest, if
    none fits)."""
    candidates = divisors(size)
    if len(candidates) > _MOST_DIVISORS:
        raise ConfigError(f"{name}={size} has {len(candidates)} divisors, each a {solve} to try; fit tries at most"
                          f" {_MOST_DIVISORS} (a guard on its time): try the {solve} you mean with `memcalc estimate"
                          f" --{solve.replace('_', '-')} N`")
    valid: list[Candidate] = []
    for value in candidates:
        p = try_value(value)
        if p.bytes is None:
            continue
        if p.fits(budget):
            return p, (valid[-1] if valid else None)
        valid.append(p)
    if not valid:
        raise ConfigError(f"no {solve} that divides {name}={size} makes a valid config")
    return None, min(valid, key=lambda p: p.bytes)
