"""`memcalc fit`: the largest b or s, or the smallest t, that fits a per-GPU budget."""

from __future__ import annotations

from typing import Any

import click

from memcalc.cli import echo_json, json_document
from memcalc.cli.options import (
    BYTES, accounting_options, fit_device_options, layout_model_options, model_from, strategy_names,
)
from memcalc.config.gpus import budget_for
from memcalc.config.schema import ModelConfig, build_config, choices
from memcalc.errors import ConfigError, DoesNotFit
from memcalc.sizing.fit import Candidate, Fit, fit
from memcalc.sizing.verdict import COUNTS, SOLVES
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.verdict import PEAK, SAVED
from memcalc.units import human_bytes

RECOMPUTES = choices("recompute")  # none, selective, full
_WHAT = {
    "b": "largest micro-batch b", "s": "largest sequence length s", "t": "smallest tensor-parallel size t",
    "pp": "smallest pipeline-parallel size pp", "cp": "smallest context-parallel size cp",
    "ep": "smallest expert-parallel size ep", "dp_shard": "smallest FSDP2 shard group dp_shard",
}
_SHORT = {"peak": PEAK, "total": "total", "activations": "activations"}
_COUNTED = {
    "peak": "the step's peak on the most loaded pipeline stage (states + saved activations where the step timeline"
    " does not model the config, marked *)",
    "total": "the per-GPU total (activations + model states) of the most loaded pipeline stage",
    "activations": "activations only (layers, embedding, output and loss) of the most loaded pipeline stage",
}


@click.command("fit")
@layout_model_options
@accounting_options
@click.option(
    "--budget", type=BYTES, default=None,
    help="Bytes PyTorch's allocator may use on one GPU, e.g. 76GiB; or give --gpu (its memory less --reserve).",
)
@fit_device_options
@click.option("--solve", type=click.Choice(SOLVES), default="b", show_default=True, help="What to solve for.")
@click.option(
    "--count", type=click.Choice(COUNTS), default="peak", show_default=True,
    help="Count the step's peak (estimate's verdict), the per-GPU total (weights, gradients, Adam, saved"
    " activations) or activations only.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
def command(
    strategy: str, exact: bool, device: str, budget: int | None, gpu: str | None, device_memory: int | None,
    reserve: int | None, solve: str, count: str, as_json: bool, **params: Any,
) -> None:
    """For each strategy and recompute choice: the largest micro-batch b (or
    sequence length s) that fits --budget, or the smallest t, pp, cp, ep or FSDP2
    shard group dp_shard (HSDP replicating the rest); with what is left over. With
    --gpus, each candidate derives its own dp = gpus/(t*pp*cp). The layout's
    sharding (--dp-shard, --zero-stage) is counted as each stack keeps it.

    Answers are exact: the answer fits by `memcalc estimate --totals`, the next
    valid value does not, and no larger value fits. Recompute none, selective and
    full are each tried unless --recompute picks one.

    Exits 3 if nothing fits (2 is bad input).

    \b
    Example: memcalc fit --config gpt3-175b --budget 80GiB --solve b
             memcalc fit --config llama3-70b --gpus 64 --gpu h100-80gb --pp 4 --solve t
             memcalc fit --config llama3-70b --impl hf --s 2048 --gpus 64 --gpu h100-80gb
                 --t 8 --dp-shard 8 --strategy tp --recompute none --solve b
    """
    budget = _budget(budget, gpu, device_memory, reserve)
    config = model_from(params)
    accounting = Accounting(exact=exact, device=device)
    fits = _fit_all(config, strategy, params.get("recompute"), solve, budget, accounting, count)
    if not any(f.answer for f in fits):
        _nothing_fits(fits, solve, budget, count)
    if as_json:
        echo_json(to_json(config, solve, count, budget, fits))
        return
    _print(config, solve, count, budget, fits, strategy)


def _budget(budget: int | None, gpu: str | None, device_memory: int | None, reserve: int | None) -> int:
    """--budget as given (already what the allocator may use), or the GPU's memory less the reserve."""
    device = (gpu, device_memory, reserve)
    if budget is not None and any(x is not None for x in device):
        raise ConfigError("give --budget, or --gpu/--device-memory/--reserve, not both")
    if budget is None and all(x is None for x in device):
        raise ConfigError("give --budget SIZE or --gpu NAME (the memory one GPU offers)")
    return budget if budget is not None else budget_for(gpu, device_memory, reserve).bytes


def _fit_all(
    config: ModelConfig, strategy: str, recompute: str | None, solve: str, budget: int, accounting: Accounting,
    count: str,
) -> list[Fit]:
    """One answer per strategy and recompute choice ("none" left out when solving t: it does not split by t)."""
    names = [n for n in strategy_names(strategy, config) if not (solve == "t" and n == "none")]
    if not names:
        raise ConfigError("strategy 'none' does not split by t, so there is no t to solve for")
    configs = [build_config(config.as_dict() | {"recompute": recompute})] if recompute else _runnable(config)
    return [fit(c, STRATEGIES[n], solve, budget, accounting, count) for n in names for c in configs]


def _runnable(config: ModelConfig) -> list[ModelConfig]:
    """The config under each recompute choice its implementation runs (a library may lack one)."""
    configs = []
    for choice in RECOMPUTES:
        try:
            configs.append(build_config(config.as_dict() | {"recompute": choice}))
        except ConfigError:
            continue  # e.g. a library with no selective recomputation: not a candidate
    return configs


def _nothing_fits(fits: list[Fit], solve: str, budget: int, count: str) -> None:
    """One line: the cheapest candidate and by how much it is over (or why no candidate is valid)."""
    valid = [f for f in fits if f.beyond is not None and f.beyond.bytes is not None]
    if not valid:
        raise ConfigError(f"no valid {solve}: {fits[0].beyond.reason if fits[0].beyond else 'no candidate'}")
    cheapest = min(valid, key=lambda f: f.beyond.bytes)
    needs = cheapest.beyond.bytes
    raise DoesNotFit(
        f"nothing fits in {human_bytes(budget)} per GPU: the cheapest candidate, {cheapest.strategy.name} with"
        f" recompute {cheapest.recompute} at {solve}={cheapest.beyond.value}, needs {human_bytes(needs)}"
        f" ({human_bytes(needs - budget)} over, counting {_SHORT[count]})"
    )


def _candidate_json(p: Candidate | None) -> dict | None:
    if p is None:
        return None
    return {"value": p.value, "bytes": p.bytes, "invalid": p.reason or None, "basis": p.basis or None}


def to_json(config: ModelConfig, solve: str, count: str, budget: int, fits: list[Fit]) -> dict:
    """The JSON document: what was solved and counted, and each row's answer with the candidate past it."""
    return json_document(config, solve=solve, count=count, budget_bytes=budget, results=[
            {
                "strategy": f.strategy.name,
                "recompute": f.recompute,
                "answer": _candidate_json(f.answer),
                "left_over_bytes": budget - f.answer.bytes if f.answer else None,
                "beyond": _candidate_json(f.beyond),
            }
            for f in fits
        ])


def _bytes(c: Candidate) -> str:
    """A candidate's bytes, starred where the peak was asked for and not modelled (states + saved activations)."""
    return human_bytes(c.bytes) + ("*" if c.basis == SAVED else "")


def _print(config: ModelConfig, solve: str, count: str, budget: int, fits: list[Fit], strategy: str) -> None:
    """The model, what was solved, and a row per strategy and recompute choice (a section per strategy)."""
    from memcalc.cli.render import console, describe, describe_layout, new_table

    console.print(describe(config))
    console.print(describe_layout(config))
    console.print(f"The {_WHAT[solve]} that fits {human_bytes(budget)} per GPU, counting {_COUNTED[count]}.")
    if solve == "t" and strategy == "all":
        console.print("[dim]'none' keeps whole layers on one GPU, so t does not change it: left out.[/dim]")
    unanswered = any(f.answer is None for f in fits)
    caption = f"-: nothing fits; next {solve} is the cheapest candidate" if unanswered else None
    # no edge padding: seven columns fit 80 characters
    table = new_table(None, ("strategy", "recompute"), (solve, "needs", "left over", f"next {solve}", "it needs"),
                      caption=caption, pad_edge=False)
    for f, after in zip(fits, [*fits[1:], None]):
        a, n = f.answer, f.beyond
        cells = (str(a.value), _bytes(a), human_bytes(budget - a.bytes)) if a else ("-", "-", "-")
        nxt = ("-", "-") if n is None else (str(n.value), "invalid" if n.bytes is None else _bytes(n))
        last_of_strategy = after is None or after.strategy != f.strategy
        table.add_row(f.strategy.name, f.recompute, *cells, *nxt, end_section=last_of_strategy)
    console.print(table)
