"""`memcalc comm`: the collectives tensor parallelism issues, and the bytes each rank sends."""

from __future__ import annotations

import json
from typing import Any

import click

from memcalc.cli.options import layout_options, model_from, model_options, strategy_names, strategy_option
from memcalc.config.schema import ModelConfig, config_record
from memcalc.model.comm import LayerComm, formula, layer_comm
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.model.strategy import STRATEGIES


@click.command("comm")
@model_options
@layout_options
@strategy_option
@click.option("--microbatches", type=click.IntRange(min=1), default=1, show_default=True,
              help="Micro-batches per step (each runs every layer's collectives once).")
@click.option("--format", "fmt", type=click.Choice(["table", "latex"]), default="table", show_default=True,
              help="table: every collective; latex: the per-layer formula of each strategy.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
def command(strategy: str, microbatches: int, fmt: str, as_json: bool, **params: Any) -> None:
    """What tensor parallelism sends: every collective of the f, f*, g, g* operators
    in one layer, forward and backward, and the bytes one rank sends (ring
    algorithm), per layer and per training step.

    \b
    Example: memcalc comm --config configs/gpt3-175b.yaml
             memcalc comm --config configs/gpt3-175b.yaml --format latex
    """
    config = model_from(params)
    results = [layer_comm(config, STRATEGIES[n], microbatches) for n in strategy_names(strategy, config)]
    width = DTYPE_BYTES[config.dtype]
    if as_json:
        click.echo(json.dumps(to_json(config, results, microbatches, width), indent=2))
    elif fmt == "latex":
        for r in results:
            click.echo(f"% {r.strategy.name}: {r.strategy.title}, bytes one rank sends per layer")
            click.echo(formula(config, r.strategy, width)[1])
    else:
        _print(config, results, microbatches, width)


def to_json(config: ModelConfig, results: list[LayerComm], microbatches: int, width: int) -> dict:
    return {
        "config": config_record(config),
        "microbatches": microbatches,
        "strategies": {
            r.strategy.name: {
                "per_layer_bytes": r.per_layer_bytes,
                "per_step_bytes": r.per_step_bytes,
                "pipeline_bytes": r.pipeline_bytes,
                "formula": formula(config, r.strategy, width)[0],
                "collectives": [
                    {"name": c.name, "operator": c.operator, "op": c.op.value, "phase": c.phase, "moves": c.moves,
                     "shape": [d.value for d in c.shape], "bytes_sent": n, "why": c.why}
                    for c, n in r.collectives
                ],
            }
            for r in results
        },
    }


def _print(config: ModelConfig, results: list[LayerComm], microbatches: int, width: int) -> None:
    from rich.table import Table

    from memcalc.cli.render import console, describe
    from memcalc.units import human_bytes

    console.print(describe(config), highlight=False)
    for r in results:
        if not r.collectives:
            console.print(f"{r.strategy.name} ({r.strategy.title}): no tensor-parallel collectives", highlight=False)
            continue
        table = Table(title=f"{r.strategy.name} ({r.strategy.title}): one layer, one micro-batch, per rank")
        for col in ("operator", "collective", "pass", "moves"):
            table.add_column(col)
        table.add_column("bytes sent", justify="right", no_wrap=True)
        for c, n in r.collectives:
            table.add_row(c.name, c.op.value, c.phase, c.moves, f"{n:,}")
        table.add_row("[bold]per layer[/bold]", "", "", formula(config, r.strategy, width)[0],
                      f"[bold]{r.per_layer_bytes:,}[/bold]", end_section=True)
        console.print(table)
        layers = config.L // config.pp
        pipe = f" + {human_bytes(r.pipeline_bytes)} between pipeline stages" if r.pipeline_bytes else ""
        console.print(
            f"per step: {layers} layers x {microbatches} micro-batch{'es' if microbatches > 1 else ''}{pipe}"
            f" = {r.per_step_bytes:,} B ({human_bytes(r.per_step_bytes)}) sent by each rank",
            highlight=False,
        )
