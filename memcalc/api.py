"""memcalc from Python: the CLI's four questions as functions, for notebooks and scripts (docs/api.md, with examples).

Each takes an optional config (a shipped name or a YAML path) and its fields as keyword overrides, with the CLI's
rules and one-line ConfigError, and returns the typed result the CLI prints from. `import memcalc` stays cheap:
the package reaches these through a lazy `__getattr__`, and numpy is imported only by `sweep`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memcalc.config.schema import ModelConfig, build_config, load_yaml
from memcalc.errors import ConfigError, in_file
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES, Strategy
from memcalc.text import short_repr

if TYPE_CHECKING:
    from memcalc.model.evaluate import LayerEstimate
    from memcalc.sizing.fit import Fit
    from memcalc.sizing.sweep import SweepResult
    from memcalc.sizing.totals import PerGpu

__all__ = ["load", "estimate", "per_gpu", "fit", "sweep"]

DEFAULT_STRATEGY = "tp-sp"  # the paper's layout; with the default t=1 it is the same as "none"


def load(config: str | Path | None = None, **fields: Any) -> ModelConfig:
    """The checked ModelConfig that a config name or file and `fields` describe (fields win)."""
    path = Path(config) if config is not None else None
    base = load_yaml(path) if path is not None else {}
    with in_file(path):  # errors from the file's fields name the file, as the CLI's do
        return build_config(base | fields)


def estimate(
    config: str | Path | ModelConfig | None = None, *, strategy: str = DEFAULT_STRATEGY, exact: bool = False,
    device: str = "cuda", **fields: Any,
) -> LayerEstimate:
    """Activation bytes one GPU keeps for backward under `strategy`: per tensor, per layer, all L layers;
    `exact` counts every saved byte (norm statistics, LSE) as `device`'s kernels keep them."""
    from memcalc.model.evaluate import estimate as layer_estimate

    return layer_estimate(_config(config, fields), _strategy(strategy), _accounting(exact, device))


def per_gpu(
    config: str | Path | ModelConfig | None = None, *, strategy: str = DEFAULT_STRATEGY, exact: bool = False,
    device: str = "cuda", **fields: Any,
) -> PerGpu:
    """Everything one GPU holds, per pipeline stage that bounds memory: `memcalc estimate --totals`."""
    from memcalc.sizing.totals import per_gpu as totals

    return totals(_config(config, fields), _strategy(strategy), _accounting(exact, device))


def fit(
    config: str | Path | ModelConfig | None = None, *, budget: int | str, solve: str = "b",
    strategy: str = DEFAULT_STRATEGY, count: str = "peak", exact: bool = False, device: str = "cuda", **fields: Any,
) -> Fit:
    """The largest b or s, or the smallest t (`solve`), whose per-GPU bytes (`count`: "peak", "total" or
    "activations") fit `budget` (bytes, or text such as "80GiB"), for the config's recompute choice."""
    from memcalc.sizing.verdict import COUNTS, SOLVES
    from memcalc.sizing.fit import fit as solve_fit

    _one_of("solve", solve, SOLVES)
    _one_of("count", count, COUNTS)
    if solve == "t" and strategy == "none":
        raise ConfigError("strategy 'none' does not split by t, so there is no t to solve for")
    return solve_fit(
        _config(config, fields), _strategy(strategy), solve, _bytes(budget), _accounting(exact, device), count
    )


def sweep(
    config: str | Path | None = None, *, strategies: str | Iterable[str] = "all", exact: bool = False,
    device: str = "cuda", **fields: Any,
) -> SweepResult:
    """Every combination of the sizes given as several values, under each strategy: `memcalc sweep`.

    A size (b, s, h, a, t, L) may be an int, a list or range of ints, or the CLI's text ("1:8", "1024:32768:x2").
    Combinations that break a divisibility rule are counted in `skipped`; `result.row(i)` is one row as a dict.
    `strategies` "all" is every layout the implementation runs for the knobs; one it does not run is refused.
    """
    from memcalc.sizing.sweep import SIZES, evaluate_sweep, make_sweep, parse_values

    if isinstance(config, ModelConfig):
        raise ConfigError("sweep takes a config name or file, not a ModelConfig (its sizes would be one point)")
    path = Path(config) if config is not None else None
    base = load_yaml(path) if path is not None else {}
    ranges = {}
    for name in SIZES:
        value = fields.pop(name, None)
        if isinstance(value, str):
            ranges[name] = parse_values(value)
        elif isinstance(value, (range, list, tuple)):
            ranges[name] = _whole_numbers(name, value)
        elif value is not None:
            base[name] = value  # one value: checked like any field
    names = [strategies] if isinstance(strategies, str) else list(strategies)
    for n in names:
        if n != "all":
            _strategy(n)
    # "all": every layout the implementation runs for the knobs (result.sweep.strategies says which)
    chosen = None if "all" in names else [st for n, st in STRATEGIES.items() if n in names]
    with in_file(path):
        planned = make_sweep(base | fields, ranges, chosen, _accounting(exact, device))
    return evaluate_sweep(planned)


def _config(config: str | Path | ModelConfig | None, fields: dict[str, Any]) -> ModelConfig:
    """A ModelConfig as given (fields laid over it), or one built from a name or file and fields."""
    if isinstance(config, ModelConfig):
        return build_config(config.as_dict(exclude_none=True) | fields) if fields else config
    return load(config, **fields)


def _strategy(name: str) -> Strategy:
    _one_of("strategy", name, tuple(STRATEGIES))
    return STRATEGIES[name]


def _accounting(exact: bool, device: str) -> Accounting:
    _one_of("device", device, ("cuda", "cpu"))
    return Accounting(exact=bool(exact), device=device)


def _one_of(what: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{what}={short_repr(value)} is not one of {', '.join(allowed)}")


def _bytes(budget: int | str) -> int:
    """A budget in bytes: an int, or text such as "80GiB" read as the CLI reads --budget."""
    from memcalc.units import MAX_BYTES, parse_bytes

    if isinstance(budget, str):
        return parse_bytes(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 < budget <= MAX_BYTES:
        raise ConfigError(f"budget={short_repr(budget)} must be a positive number of bytes, or text such as 80GiB")
    return budget


def _whole_numbers(name: str, values: range | list | tuple) -> range | tuple[int, ...]:
    """A swept size's values: positive ints, each once, as the CLI's parser makes them."""
    if isinstance(values, range):
        if not values or values.start < 1 or values.step < 1:
            raise ConfigError(f"{name}={short_repr(values)}: a range of sizes must be non-empty, positive, increasing")
        return values
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ConfigError(f"{name}={short_repr(values)}: every value must be a positive whole number")
    if len(set(values)) < len(values):
        raise ConfigError(f"{name}={short_repr(values)} repeats a value; give each value once")
    return tuple(values)
