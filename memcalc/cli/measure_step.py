"""`memcalc measure --step`: one whole training step per strategy, the timeline's peak next to MemTracker's.

Not a command of its own: `memcalc.cli.measure` hands over here when --step is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.cli.compare import add_total, comparison_table, document, print_header, print_outcome, report
from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError

if TYPE_CHECKING:  # torch: only when the command runs
    from rich.table import Table

    from memcalc.probe.step import StepComparison

TOP_TERMS = 6  # the largest activations and temporaries live at the predicted peak, shown under each table


def run_step(
    config: ModelConfig, strategies: list[str], *, device: str, launch: str, backend: str | None,
    layer: str | None, comm: bool, overlap: str | None, as_json: bool, route: str | None,
) -> None:
    """Measure one step per strategy (`route` forces a MoE router) and print it; ProbeError beyond the tolerance."""
    _check_flags(device, launch, backend, layer, comm, overlap)
    if config.zero_stage == 3:  # measured at h=64 L=2 dp=2: 225,600 B of the walk's 879,496 between steps unseen
        raise ConfigError("--step does not compare DeepSpeed's ZeRO-3 step: MemTracker does not see the partition"
                          " DeepSpeed keeps on each parameter (ds_tensor, no module's parameter; docs/limitations.md);"
                          " see the walk with estimate --totals")
    from memcalc.probe.step import TOLERANCE, measure_step  # needs torch: a one-line ProbeError without it

    results = measure_step(config, strategies, route, device)
    report(results, as_json, lambda: to_json(config, results), lambda: print_steps(config, results, TOLERANCE),
           f"the step's measured memory differs from the timeline by more than {TOLERANCE:.0%}")


def _check_flags(device: str, launch: str, backend: str | None, layer: str | None, comm: bool,
                 overlap: str | None) -> None:
    """--step runs on the CPU in this process (rank 0 of t through the fake group), with --device cuda as CUDA runs
    (torchtitan's model); other flags do not apply."""
    if device == "meta":
        raise ConfigError("--step measures with MemTracker on the CPU; --device meta is not supported with it")
    given = [flag for flag, value in (
        ("--launch", launch != "auto"), ("--backend", backend), ("--comm", comm), ("--overlap", overlap),
        ("--layer library", layer == "library"),
    ) if value]
    if given:
        raise ConfigError(
            f"--step runs memcalc's own model in this process (rank 0 of t through torch's fake group);"
            f" {', '.join(given)} does not apply to it"
        )


def to_json(config: ModelConfig, results: list[StepComparison]) -> dict[str, Any]:
    """The config, and per strategy: how it ran, the moment of the peak, and each category predicted and measured."""
    return document(config, results, strategies={_name(r): _strategy_json(r) for r in results})


def _name(r: StepComparison) -> str:
    """The strategy, and under pipelining the stage: "none", "none (first stage)"."""
    return r.strategy.name if r.predicted.stage == "only" else f"{r.strategy.name} ({r.predicted.stage} stage)"


def _strategy_json(r: StepComparison) -> dict[str, Any]:
    peak, steady = r.rows("peak"), r.rows("steady")
    return {
        "launch": r.launch.value,
        "t": r.measured.t,
        "how": r.how(),
        "match": r.matches,
        "differences": r.differences(),
        "moment": {"predicted": r.predicted_moment, "measured": r.measured.moment, "match": r.moment_matches,
                   "what": r.predicted.peak.what},
        "peak_bytes": {"predicted": peak[-1].predicted, "measured": peak[-1].measured},
        "steady_bytes": {"predicted": steady[-1].predicted, "measured": steady[-1].measured},
        "peak": {row.category: {"predicted": row.predicted, "measured": row.measured} for row in peak[:-1]},
        "steady": {row.category: {"predicted": row.predicted, "measured": row.measured} for row in steady[:-1]},
        "live_at_peak": [
            {"name": x.name, "category": x.category, "bytes": x.bytes, "why": x.why} for x in r.predicted.peak.live
        ],
    }


def print_steps(config: ModelConfig, results: list[StepComparison], tolerance: float) -> None:
    """Per strategy: the peak by category, the moment, the steady state, the largest tensors live at the peak."""
    from memcalc.cli.render import console
    from memcalc.probe.shims import notes
    from memcalc.sizing.timeline import ACTIVATIONS, TEMPORARIES
    from memcalc.text import for_rich
    from memcalc.units import human_bytes

    print_header(config, "one training step on one rank (warm-up step first), bytes at the peak; predicted by the"
                 " step timeline, measured by torch's MemTracker")
    for r in results:
        console.print(_table(r))
        peak = r.predicted.peak
        moment = "[green]same moment[/green]" if r.moment_matches else "[red]another moment[/red]"
        console.print(f"peak: predicted at {for_rich(peak.label())}; MemTracker at {r.measured.moment} ({moment})")
        steady = r.rows("steady")[-1]
        console.print(f"steady state before the step: predicted {steady.predicted:,}, measured {steady.measured:,}"
                      f" ({human_bytes(steady.measured)})")
        transient = [x for x in peak.live if x.category in (ACTIVATIONS, TEMPORARIES)]
        largest = sorted(transient, key=lambda x: -x.bytes)[:TOP_TERMS]
        console.print("largest activations and temporaries at the peak: " + ", ".join(
            f"{for_rich(x.name)} {human_bytes(x.bytes)}" for x in largest))
        shims = (*(notes(config.impl, cuda_step=True) if r.device == "cuda" else ()),
                 *(notes(config.impl, pp_step=True) if config.pp > 1 else ()),
                 *(notes(config.impl, zero_step=True) if config.zero_stage is not None else ()),
                 *(notes(config.impl, tp_step=True) if r.strategy.tensor_parallel and config.t > 1
                   and config.dp_shard is None and config.zero_stage is None else ()))
        print_outcome(f"{r.model}, {r.how()}", shims, r.matches, f"the peak and every category within {tolerance:.0%}")


def _table(r: StepComparison) -> Table:
    ranks = f"rank 0 of {r.world or 't=1'}" if r.predicted.stage == "only" else r.how().split(" (")[0].split("as ")[1]
    table = comparison_table(f"{_name(r)} ({r.strategy.title}): {ranks}, one step", "at the peak")
    *rows, total = r.rows("peak")
    for row in rows:
        table.add_row(row.category, f"{row.predicted:,}", f"{row.measured:,}", _difference(row))
    add_total(table, total.predicted, total.measured, _difference(total))
    return table


def _difference(row: Any) -> str:
    """0, a difference within the tolerance, or one beyond it in red."""
    if row.difference == 0:
        return "0"
    text = f"{row.difference:+,}"
    return text if row.within else f"[red]{text}[/red]"
