"""`memcalc estimate`: the numbers, per strategy and per tensor."""

from __future__ import annotations

import json
from typing import Any

import click

from memcalc.cli.options import accounting_options, model_options, model_from, strategy_names, strategy_option
from memcalc.config import ModelConfig
from memcalc.evaluate import LayerEstimate, estimate
from memcalc.layer import Accounting
from memcalc.strategy import STRATEGIES


@click.command("estimate")
@model_options
@strategy_option
@accounting_options
@click.option("--breakdown", is_flag=True, help="Add the per-tensor table.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
def command(strategy: str, exact: bool, device: str, breakdown: bool, as_json: bool, **params: Any) -> None:
    """Activation bytes one GPU keeps for backward: per layer, for all L layers,
    and as a ratio to no parallelism.

    \b
    Example: memcalc estimate --b 1 --s 2048 --h 12288 --a 96 --t 8 --L 96
             memcalc estimate --config configs/gpt3-175b.yaml --breakdown
    """
    config = model_from(params)
    accounting = Accounting(exact=exact, device=device)
    baseline = estimate(config, STRATEGIES["none"], accounting)
    results = [baseline if n == "none" else estimate(config, STRATEGIES[n], accounting) for n in strategy_names(strategy)]
    if as_json:
        click.echo(json.dumps(to_json(config, accounting, results, baseline), indent=2))
        return
    from memcalc.cli import render  # rich, only for people

    render.print_estimates(config, accounting, results, baseline, breakdown)


def to_json(config: ModelConfig, accounting: Accounting, results: list[LayerEstimate], baseline: LayerEstimate) -> dict:
    """The JSON document: the config, how bytes were counted, and each strategy's numbers."""
    return {
        "config": config.model_dump(exclude_none=True) | {"ffn_hidden_size": config.ffn, "num_query_groups": config.groups},
        "accounting": {"exact": accounting.exact, "device": accounting.device},
        "strategies": {
            r.strategy.name: {
                "per_layer_bytes": r.per_layer_bytes,
                "total_bytes": r.total_bytes,
                "ratio_to_none": r.per_layer_bytes / baseline.per_layer_bytes,
                "tensors": [
                    {"name": x.tensor.name, "bytes": x.bytes, "shape": list(x.shape), "saved_by": x.tensor.saved_by}
                    for x in r.tensors
                ],
            }
            for r in results
        },
    }
