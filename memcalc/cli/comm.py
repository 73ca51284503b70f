"""`memcalc comm`: the collectives tensor parallelism issues, and the bytes each rank sends."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import click

from memcalc.cli import echo_json, json_document
from memcalc.cli.options import layout_model_options, model_from, strategies_at
from memcalc.cli.types import POSITIVE, Real
from memcalc.config.schema import ModelConfig
from memcalc.model.comm import LayerComm, formula, layer_comm
from memcalc.model.knobs import DTYPE_BYTES
from memcalc.config.gpus import GPUS, Gpu
from memcalc.model.overlap import DEFAULT_SPLITS, buffer_bytes, chosen, exposed, pairings, resolve
from memcalc.model.strategy import STRATEGIES, TP_SP, Strategy


# TFLOPS and GB/s: far beyond any card both ways, and near enough that every time the model computes stays finite.
RATE = Real(least=1e-3, most=1e9)


@click.command("comm")
@layout_model_options
@click.option("--format", "fmt", type=click.Choice(["table", "latex"]), default="table", show_default=True,
              help="table: every collective; latex: the per-layer formula of each strategy.")
@click.option(
    "--overlap", default=None, metavar="METHODS",
    help="Model hiding TP communication behind GEMMs (tp-sp, megatron): 'default' (tp_comm_overlap's own set)"
    " or a comma list of ring-ag, ring-rs, pipelined-rs, bulk-dgrad, bulk-wgrad, rs-dgrad.",
)
@click.option("--gpu", type=click.Choice(list(GPUS)), default="h100-80gb", show_default=True,
              help="Peak 16-bit TFLOPS and link bandwidth preset for the timing model.")
@click.option("--peak-tflops", type=RATE, help="Override the preset's TFLOPS.")
@click.option("--link-gbps", type=RATE,
              help="Override the preset's link bandwidth, GB/s one way.")
@click.option("--num-splits", type=POSITIVE, default=DEFAULT_SPLITS, show_default=True,
              help="Chunks of a pipelined reduce-scatter.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
def command(strategy: str, fmt: str, overlap: str | None, gpu: str, peak_tflops: float | None,
            link_gbps: float | None, num_splits: int, as_json: bool, **params: Any) -> None:
    """What tensor parallelism sends: every collective of the f, f*, g, g* operators
    in one layer, forward and backward, and the bytes one rank sends (ring
    algorithm), per layer and per training step (of --num-microbatches
    micro-batches, or --global-batch-size's; 1 unless given).

    \b
    Example: memcalc comm --config gpt3-175b
             memcalc comm --config gpt3-175b --format latex
    """
    config = model_from(params)
    if overlap is not None:
        device = replace(GPUS[gpu], tflops=peak_tflops or GPUS[gpu].tflops, link_gb_s=link_gbps or GPUS[gpu].link_gb_s)
        methods = resolve(x.strip() for x in overlap.split(","))
        layout = TP_SP if strategy == "all" else STRATEGIES[strategy]  # pairings refuses any but tp-sp
        report = overlap_report(config, layout, methods, device, num_splits)
        echo_json(report) if as_json else _print_overlap(config, report)
        return
    microbatches = config.microbatches or 1  # --num-microbatches or --global-batch-size: each runs every layer once
    results = [layer_comm(config, STRATEGIES[n], microbatches) for n in strategies_at(strategy, config)]
    width = DTYPE_BYTES[config.dtype]
    if as_json:
        echo_json(to_json(config, results, microbatches, width))
    elif fmt == "latex":
        for r in results:
            click.echo(f"% {r.strategy.name}: {r.strategy.title}, bytes one rank sends per layer")
            click.echo(formula(config, r.strategy, width, config.ep)[1])
    else:
        _print(config, results, microbatches, width)


def to_json(config: ModelConfig, results: list[LayerComm], microbatches: int, width: int) -> dict:
    return json_document(config, microbatches=microbatches, strategies={
            r.strategy.name: {
                "per_layer_bytes": r.per_layer_bytes,
                "per_step_bytes": r.per_step_bytes,
                "pipeline_bytes": r.pipeline_bytes,
                "dense_layer_bytes": r.dense_layer_bytes,  # a dense layer's, where MoE layers alternate with dense
                "layers": dict(zip(("moe", "dense") if config.moe else ("dense",), r.layers)),  # on the stage counted
                "formula": formula(config, r.strategy, width, config.ep)[0],
                "collectives": [
                    {"name": c.name, "operator": c.operator, "op": c.op.value, "phase": c.phase, "over": c.group.value,
                     "moves": c.moves, "shape": [d.value for d in c.shape], "bytes_sent": n, "why": c.why}
                    for c, n in r.collectives
                ],
            }
            for r in results
        })


def _print(config: ModelConfig, results: list[LayerComm], microbatches: int, width: int) -> None:
    from memcalc.cli.render import console, describe, new_table
    from memcalc.units import human_bytes

    console.print(describe(config))
    for r in results:
        if not r.collectives:
            console.print(f"{r.strategy.name} ({r.strategy.title}): no tensor-parallel collectives")
            continue
        table = new_table(f"{r.strategy.name} ({r.strategy.title}): one layer, one micro-batch, per rank",
                          ("operator", "collective", "pass", "moves"), ["bytes sent"], wrap=True)
        for c, n in r.collectives:
            table.add_row(c.name, c.op.value, c.phase, c.moves, f"{n:,}")
        table.add_row("[bold]per layer[/bold]", "", "", formula(config, r.strategy, width, config.ep)[0],
                      f"[bold]{r.per_layer_bytes:,}[/bold]", end_section=True)
        console.print(table)
        moe, dense = r.layers
        layers = f"{moe} MoE layers + {dense} dense layers ({r.dense_layer_bytes:,} B each)" if dense else f"{moe} layers"
        pipe = f" + {human_bytes(r.pipeline_bytes)} between pipeline stages" if r.pipeline_bytes else ""
        console.print(f"per step: {layers} x {microbatches} micro-batch{'es' if microbatches > 1 else ''}{pipe}"
                      f" = {r.per_step_bytes:,} B ({human_bytes(r.per_step_bytes)}) sent by each rank")


def overlap_report(config: ModelConfig, strategy: Strategy, methods: frozenset[str], gpu: Gpu, splits: int) -> dict:
    """Per collective of one tp-sp layer: its GEMM, the method hiding it, the times, and the buffers."""
    rows = []
    for p in pairings(config, strategy, gpu):
        method = chosen(p.methods, methods)
        rows.append({
            "collective": p.collective, "gemm": p.gemm, "method": method, "bytes_sent": p.comm_bytes,
            "gemm_s": p.gemm_s, "comm_s": p.comm_s, "exposed_without_s": exposed(p, None, config.t, splits),
            "exposed_s": exposed(p, method, config.t, splits),
        })
    buffers = buffer_bytes(config, methods, config.t)
    return json_document(
        gpu=vars(gpu), methods=sorted(methods), num_splits=splits, collectives=rows,
        per_layer={k: sum(r[k] for r in rows) for k in ("gemm_s", "comm_s", "exposed_without_s", "exposed_s")},
        userbuffer_bytes=buffers, userbuffer_total_bytes=sum(buffers.values()),
        note="userbuffers are allocated once for the model, outside PyTorch's allocator: torch.cuda never sees them",
    )


def _print_overlap(config: ModelConfig, report: dict) -> None:
    from memcalc.cli.render import console, describe, new_table
    from memcalc.units import human_bytes

    console.print(describe(config))
    gpu = report["gpu"]
    title = f"tp-sp, one layer on {gpu['name']} ({gpu['tflops']:g} TFLOPS, {gpu['link_gb_s']:g} GB/s), microseconds"
    # without overlap all of comm is exposed
    table = new_table(title, ("collective", "GEMM", "method"), ("GEMM us", "comm us", "exposed"))
    us = lambda x: f"{x * 1e6:,.1f}"  # noqa: E731
    for r in report["collectives"]:
        name = r["collective"].replace(" forward", " fwd").replace(" backward", " bwd")
        table.add_row(name, r["gemm"], r["method"] or "-", us(r["gemm_s"]), us(r["comm_s"]), us(r["exposed_s"]))
    t = report["per_layer"]
    table.add_row("[bold]per layer[/bold]", "", "", us(t["gemm_s"]), us(t["comm_s"]), us(t["exposed_s"]),
                  end_section=True)
    console.print(table)
    console.print(
        f"userbuffers: {human_bytes(report['userbuffer_total_bytes'])} for the whole model"
        f" ({len(report['userbuffer_bytes'])} GEMMs), outside PyTorch's allocator: torch.cuda never counts them",
    )
