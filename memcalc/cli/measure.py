"""`memcalc measure`: run real layers, and put what each rank saved next to the ledger."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from memcalc.cli import python_collection, signals_end_at_once
from memcalc.cli.compare import add_total, comparison_table, document, print_header, print_outcome, report
from memcalc.cli.options import model_from, model_options, sharding_options, strategies_at, strategy_option
from memcalc.cli.types import POSITIVE, Real
from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError, ProbeError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting
from memcalc.model.overlap import DEFAULT_SPLITS
from memcalc.model.rules import divides
from memcalc.model.strategy import STRATEGIES
from memcalc.probe import LAYERS, ROUTES, check_worst_route, routing_fixed

if TYPE_CHECKING:  # torch: only when the command runs
    from rich.table import Table

    from memcalc.probe.measure import Row, StrategyMeasurement

# memcalc.probe.launch.Mode's values, plus auto; spelled out so --help needs no torch.
LAUNCHES = ("auto", "single", "spawn", "fake", "torchrun")


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: torch's timedelta and any real run stay far inside it


@click.command("measure")
@model_options
@sharding_options
@strategy_option
@click.option(
    "--device", type=click.Choice(["cpu", "cuda", "meta"]), default="cpu", show_default=True,
    help="Where the layers run; the prediction counts that device's kernels, with CUDA's dropout on every device"
    " (the CPU shims emulate it). meta: shapes and dtypes without data, so full-size layers take seconds;"
    " compared with CUDA's accounting.",
)
@click.option(
    "--backend", type=click.Choice(["gloo", "nccl"]), default=None,
    help="Start t processes with real collectives (gloo on CPUs, nccl on GPUs)"
    " [default: nccl when there are t GPUs, else rank 0 of t through torch's fake group].",
)
@click.option(
    "--launch", type=click.Choice(LAUNCHES), default="auto", show_default=True,
    help="How the t ranks run: this process (single), t processes (spawn), torch's fake group, or torchrun's ranks.",
)
@click.option(
    "--timeout", "timeout_s", type=Real(above=0, most=MAX_TIMEOUT_S), default=300.0,
    show_default=True, help="Seconds the ranks get before they are stopped.",
)
@click.option(
    "--layer", type=click.Choice(LAYERS), default=None,
    help="library: the implementation's own code (--impl; needs the extra megatron, torchtitan or hf);"
    " memcalc: memcalc's own Megatron-style layer (--impl megatron or paper; needs the extra probe: torch)"
    " [default: library; memcalc with --impl paper, on --device meta and with --overlap, which only it runs].",
)
@click.option(
    "--comm", is_flag=True,
    help="Also show every collective the layer issued next to the communication ledger's.",
)
@click.option(
    "--overlap", default=None, metavar="METHODS",
    help="Run memcalc's own tp-sp layer with its forward collectives overlapped: a comma list of ring-ag, ring-rs,"
    " pipelined-rs (with --comm, every ring hop and chunk is compared with the ledger).",
)
@click.option("--num-splits", type=POSITIVE, default=DEFAULT_SPLITS, show_default=True,
              help="Chunks of a pipelined reduce-scatter.")
@click.option(
    "--step", is_flag=True,
    help="Run one whole training step per strategy instead (memcalc's own small GPT, or with --impl hf"
    " transformers' LlamaForCausalLM, tp under its own tp_plan, sharded by torch's fully_shard with --dp-shard (under"
    " FSDPMemTracker), or MixtralForCausalLM with --route balanced; with --impl torchtitan its Llama3Model, tp under"
    " its own plan; AdamW on fp32 master weights) under torch's MemTracker on the CPU, and compare its peak, each"
    " category and the moment with the step timeline; exits 1 beyond 1%.",
)
@click.option(
    "--route", type=click.Choice(ROUTES), default=None,
    help="Force the library's MoE router (--impl hf, megatron or torchtitan, with num_experts) so each expert's tokens"
    " are known: balanced (kbs/E slots each) or all-to-one (every token to experts 0..k-1) [default: the real router].",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
def command(strategy: str, device: str, backend: str | None, launch: str, timeout_s: float, layer: str | None,
            comm: bool, overlap: str | None, num_splits: int, step: bool, route: str | None, as_json: bool,
            **params: Any) -> None:
    """Run one real transformer layer per strategy, record every tensor each rank
    saves for backward, and compare it, tensor by tensor, with `memcalc estimate
    --exact` for the device it ran on. Exits 1 if any tensor differs.

    \b
    Example: memcalc measure --config tiny --t 2 --backend gloo
             memcalc measure --config tiny --t 8 --strategy tp-sp
             torchrun --nproc-per-node 8 -m memcalc measure --config tiny --t 8 --device cuda
    """
    python_collection()
    config = model_from(params)
    names = strategies_at(strategy, config)  # once: "all" names on stderr a layout left out for these knobs
    if step:
        from memcalc.cli.measure_step import run_step

        with signals_end_at_once():  # torch and the library run here: a signal ends the process where it lands
            return run_step(config, names, device=device, launch=launch, backend=backend,
                            layer=layer, comm=comm, overlap=overlap, as_json=as_json, route=route)
    experts_over_dp_shard = config.impl == "torchtitan" and config.ep > 1  # check_moe: at t = 1, ep dividing dp_shard
    if config.zero_stage is not None or config.dp_shard is not None and not experts_over_dp_shard:
        raise ConfigError("--dp-shard and --zero-stage shard a whole step's states: give --step (a layer's saved"
                          " tensors do not depend on them; torchtitan's experts at ep > 1 take their ranks from"
                          " --dp-shard)")
    if layer is None:
        layer = "memcalc" if device == "meta" or overlap or config.impl == "paper" else "library"
    check_worst_route(config, route, [STRATEGIES[name] for name in names])
    if route == "balanced" and config.moe_tokens != "balanced":
        _check_balanced_pins(config, names)
    if comm and layer != "memcalc":
        _check_library_comm(config, names, route)
    from memcalc.probe.footprint import check_fits

    # The ranks on this machine at once: t when spawned here, else one (fake; torchrun's one a process).
    spawned = launch == "spawn" or (launch == "auto" and backend is not None)
    check_fits(config, names, device, config.t if spawned else 1)  # nothing to check on meta, which allocates none
    with signals_end_at_once():  # torch and the library run here: a signal ends the process where it lands
        results = _measure(config, names, device, backend, launch, timeout_s, layer, overlap, num_splits, route)
    if not results:
        return  # a torchrun rank other than 0: rank 0 reports for the job
    report(results, as_json, lambda: to_json(config, results), lambda: print_measurements(config, results, comm),
           "measured bytes differ from the ledger")


def _measure(config: ModelConfig, names: list[str], device: str, backend: str | None, launch: str, timeout_s: float,
             layer: str, overlap: str | None, num_splits: int, route: str | None) -> list[StrategyMeasurement]:
    """Each strategy's layer run and recorded (`memcalc.probe.measure.measure`), with --overlap read first."""
    from memcalc.probe.measure import measure  # needs torch: a one-line ProbeError without it
    from memcalc.probe.overlap import NO_OVERLAP, Method, Overlap

    methods = [m.strip() for m in overlap.split(",")] if overlap else []
    try:
        chosen = Overlap.of(*methods, num_splits=num_splits) if methods else NO_OVERLAP
    except ProbeError as exc:  # a bad --overlap is bad input
        raise ConfigError(f"--overlap: {exc}") from None
    if Method.PIPELINED_RS in chosen.methods:  # bad input too, found before any rank starts
        divides(num_splits, "num_splits", config.h, "h", "the pipelined reduce-scatter cuts each row linear's h"
                " output features into num_splits blocks")
    return measure(config, names, device, backend, launch, timeout_s, layer, chosen, route)


def to_json(config: ModelConfig, results: list[StrategyMeasurement]) -> dict:
    """Totals (summed over the strategies run) and every tensor with its strategy; each strategy in detail."""
    strategies = {m.strategy.name: _strategy_json(m) for m in results}
    return document(
        config, results,
        predicted_bytes=sum(m.predicted_bytes for m in results),
        measured_bytes=sum(m.measured_bytes for m in results),
        tensors=[{"strategy": name, **row} for name, st in strategies.items() for row in st["tensors"]],
        strategies=strategies,
    )


def _strategy_json(m: StrategyMeasurement) -> dict:
    """How one strategy ran, its totals, and each tensor on rank 0."""
    return {
        "layer": m.layer,
        "cuda_like": list(m.notes),
        "launch": m.launch.mode.value,
        "group": m.ranks[0].group,
        "device": m.ranks[0].device,
        "t": m.launch.t,
        "ranks_compared": len(m.ranks),
        "how": m.how(),
        "predicted_bytes": m.predicted_bytes,
        "measured_bytes": m.measured_bytes,
        "match": m.matches,
        "differences": m.differences(),
        "tensors": [
            {
                "name": row.name, "predicted": row.predicted, "measured": row.measured,
                "predicted_shape": _list(row.predicted_shape), "measured_shape": _list(row.measured_shape),
                "match": row.matches,
            }
            for row in m.rows[0]
        ],
        "cuda": None if m.ranks[0].cuda is None else vars(m.ranks[0].cuda),
        "collectives": [
            {"name": c.name, "predicted": list(c.predicted or ()), "measured": list(c.measured or ()),
             "match": c.matches}
            for c in (m.comm[0] if m.comm else ())
        ],
    }


def _list(shape: tuple[int, ...] | None) -> list[int] | None:
    return None if shape is None else list(shape)


def _check_balanced_pins(config: ModelConfig, names: list[str]) -> None:
    """--route balanced makes the balanced bound's slots (the ledger's moe_tokens balanced, to the byte): another
    bound is compared with it only where it counts the same (a capacity every expert fills, say), else refused."""
    def kept(c: ModelConfig, name: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(x.tensor.name, x.shape) for x in estimate(c, STRATEGIES[name], Accounting(exact=True)).tensors]

    for name in names:
        if kept(config, name) != kept(replace(config, moe_tokens="balanced"), name):
            raise ConfigError(f"--route balanced makes the balanced bound's slots, which moe_tokens {config.moe_tokens}"
                              f" does not count at these sizes (under {name} its saved tensors' shapes differ from"
                              " the balanced bound's); measure with --moe-tokens balanced")


def _check_library_comm(config: ModelConfig, names: list[str], route: str | None) -> None:
    """--comm on a library's layer: the ledger must model its collectives and the route fix their bytes."""
    from memcalc.model.comm import layer_comm

    for name in names:
        layer_comm(config, STRATEGIES[name], 1)  # a ConfigError where the ledger does not model them
    if not routing_fixed(config, route):
        raise ConfigError(f"--comm compares a MoE layer's collectives where their bytes are the ledger's: add --route"
                          f" balanced with moe_tokens balanced (not {route or 'the real router'}, {config.moe_tokens})")


def print_measurements(config: ModelConfig, results: list[StrategyMeasurement], comm: bool) -> None:
    """A table per strategy, how it ran, and whether it matched."""
    from memcalc.cli.render import console
    from memcalc.units import human_bytes

    print_header(config, "one layer, bytes one rank saves for backward; predicted by `estimate --exact`")
    for m in results:
        console.print(_table(m))
        if comm and m.comm and m.comm[0]:
            console.print(_comm_table(m))
        cuda = m.ranks[0].cuda
        seen = [] if cuda is None else [
            f"torch.cuda on rank 0: forward left {human_bytes(cuda.kept)} allocated (saved tensors, the layer's"
            f" output, allocator rounding) and peaked {human_bytes(cuda.peak)} above its start"]
        print_outcome(f"{m.layer}, {m.how()}", m.notes, m.matches, "every tensor agrees to the byte", *seen)


def _table(m: StrategyMeasurement) -> Table:
    table = comparison_table(f"{m.strategy.name} ({m.strategy.title}): rank 0 of t={m.launch.t}", "tensor", "shape")
    for row in m.rows[0]:
        table.add_row(row.name, _shape_cell(row), f"{row.predicted:,}", f"{row.measured:,}", _difference(row))
    total = m.measured_bytes - m.predicted_bytes
    add_total(table, m.predicted_bytes, m.measured_bytes, f"{total:+,}" if total else "0", "")
    return table


def _shape_cell(row: Row) -> str:
    """The predicted shape, and the measured one beside it when they differ (batch-first, per rank)."""
    shape = row.predicted_shape if row.predicted_shape is not None else row.measured_shape
    text = _compact(shape)
    if row.predicted_shape is not None and row.measured_shape != row.predicted_shape:
        text += f" [red]measured {_compact(row.measured_shape)}[/red]"
    return text


def _compact(shape: tuple[int, ...] | None) -> str:
    """(2,16,64): a shape without spaces, so the table fits 80 columns."""
    return "none" if shape is None else f"({','.join(map(str, shape))})"


def _difference(row: Row) -> str:
    if row.measured != row.predicted:
        return f"[red]{row.measured - row.predicted:+,}[/red]"
    return "0" if row.matches else "[red]shape[/red]"


def _comm_table(m: StrategyMeasurement) -> Table:
    """Rank 0's collectives, in order, next to the communication ledger's: kind, pass and bytes sent."""
    from memcalc.cli.render import new_table

    table = new_table(f"{m.strategy.name}: collectives on rank 0, bytes sent (ring)",
                      ("collective", "predicted", "measured"))
    for c in m.comm[0]:
        cells = [" ".join(map(str, x)) if x else "none" for x in (c.predicted, c.measured)]
        table.add_row(c.name, cells[0], cells[1] if c.matches else f"[red]{cells[1]}[/red]")
    return table
