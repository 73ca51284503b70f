"""`memcalc estimate`: the numbers, per strategy and per tensor."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import click

from memcalc.cli import echo_json, json_document
from memcalc.cli.options import (
    LAYOUT_FLAGS, accounting_options, device_options, layout_model_options, model_from, strategies_at,
)
from memcalc.config.gpus import Budget, budget_for
from memcalc.config.schema import ModelConfig
from memcalc.errors import DoesNotFit
from memcalc.model.departures import PaperComparison, compare_with_paper
from memcalc.model.evaluate import LayerEstimate, TensorBytes, estimate
from memcalc.model.impls import strategies_of
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES

if TYPE_CHECKING:  # per-GPU totals, the timeline and the verdict load only when --totals asks for them
    from memcalc.sizing.timeline import Timeline
    from memcalc.sizing.totals import PerGpu
    from memcalc.sizing.verdict import Need

# Flags that matter only for per-GPU totals, so giving one asks for them (cp splits the layer's activations too).
TOTALS_FLAGS = (*(flag for flag in LAYOUT_FLAGS if flag != "cp"), "gpu", "device_memory", "reserve")


@click.command("estimate")
@layout_model_options
@accounting_options
@click.option("--breakdown", is_flag=True, help="Add the per-tensor table.")
@click.option(
    "--totals", is_flag=True,
    help="Add per-GPU totals (layers, embedding, output and loss, model states) and a fits/does-not-fit verdict"
    " against the GPU's memory less --reserve; on whenever a flag that only totals use (--gpu, --gpus, --pp, --vpp,"
    " --dp, --vocab-size, ...) is given.",
)
@device_options
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")
def command(
    strategy: str, exact: bool, device: str, breakdown: bool, totals: bool, gpu: str | None,
    device_memory: int | None, reserve: int | None, as_json: bool, **params: Any,
) -> None:
    """Activation bytes one GPU keeps for backward: per layer, for all L layers,
    and as a ratio to no parallelism; with --totals, everything one GPU holds.
    Exits 3 when --totals finds that no strategy fits (2 is bad input).

    \b
    Example: memcalc estimate --b 1 --s 2048 --h 12288 --a 96 --t 8 --L 96
             memcalc estimate --config gpt3-175b --breakdown
             memcalc estimate --config gpt3-175b --pp 8 --vpp 3 --recompute selective
    """
    config = model_from(params)
    accounting = Accounting(exact=exact, device=device)
    # no parallelism: where the library's expert ranks are its TP ranks (torchtitan's), without ep too
    alone = config if "none" in strategies_of(config) else replace(config, ep=1)
    baseline = estimate(alone, STRATEGIES["none"], accounting)
    names = strategies_at(strategy, config)
    results = [baseline if n == "none" else estimate(config, STRATEGIES[n], accounting) for n in names]
    comparisons = [compare_with_paper(config, r, accounting) for r in results]
    per = peaks = None
    budget = budget_for(gpu, device_memory, reserve)
    given = params | {"gpu": gpu, "device_memory": device_memory, "reserve": reserve}
    if totals or any(given.get(k) is not None for k in TOTALS_FLAGS):
        from memcalc.sizing.totals import per_gpu
        from memcalc.sizing.verdict import step_peaks

        per = [per_gpu(config, r.strategy, accounting) for r in results]
        peaks = {r.strategy.name: step_peaks(config, r.strategy, device) for r in results}
    if as_json:
        echo_json(to_json(config, accounting, results, baseline, per, budget, peaks, comparisons))
    else:
        from memcalc.cli import render  # rich, only for people

        render.print_estimates(config, accounting, results, baseline, breakdown, comparisons)
        if per is not None:
            render.print_totals(config, per, budget, peaks)
    if per is not None:
        from memcalc.sizing.verdict import need  # the verdict loads only with totals

        if not any(need(p, peaks.get(p.strategy.name)).bytes <= budget.bytes for p in per):
            click.get_current_context().exit(DoesNotFit.exit_code)  # printed the verdict; only the code says no


def to_json(
    config: ModelConfig, accounting: Accounting, results: list[LayerEstimate], baseline: LayerEstimate,
    per: list[PerGpu] | None, budget: Budget, peaks: dict | None, comparisons: list[PaperComparison],
) -> dict:
    """The config, the accounting, each strategy's numbers beside the paper's (and departures), totals if asked."""
    doc = json_document(
        config, accounting={"exact": accounting.exact, "device": accounting.device, "impl": str(config.impl)},
        strategies={
            r.strategy.name: {
                "per_layer_bytes": r.per_layer_bytes,
                "total_bytes": r.total_bytes,
                "ratio_to_none": r.per_layer_bytes / baseline.per_layer_bytes,
                "tensors": _tensors_json(r.tensors),
                "paper": _paper_json(c),
            }
            for r, c in zip(results, comparisons)
        },
    )
    if per is not None:
        doc["per_gpu"] = per_gpu_json(config, per, budget, peaks or {})
    return doc


def _tensors_json(tensors: tuple[TensorBytes, ...]) -> list[dict]:
    return [
        {"name": x.tensor.name, "bytes": x.bytes, "shape": list(x.shape), "saved_by": x.tensor.saved_by}
        for x in tensors
    ]


def _paper_json(c: PaperComparison) -> dict:
    """The paper's numbers at the same inputs and each departure from them, or why the paper has none."""
    if c.paper is None:
        return {"not_modelled": c.not_modelled}
    return {
        "per_layer_bytes": c.paper.per_layer_bytes,
        "tensors": _tensors_json(c.paper.tensors),
        "departures": [
            {"rule": d.rule, "bytes": d.bytes, "tensors": [{"name": n, "bytes": b} for n, b in d.tensors]}
            for d in c.departures
        ],
    }


def per_gpu_json(config: ModelConfig, per: list[PerGpu], device: Budget, peaks: dict) -> dict:
    """Per strategy: the verdict, each bounding stage term by term, and its step's peak (or why not modelled)."""
    from memcalc.sizing.params import padded_vocab
    from memcalc.sizing.states import total_params
    from memcalc.sizing.verdict import need

    budget = device.bytes
    return {
        "gpu": device.source,
        "device_memory_bytes": device.device_bytes,
        "reserve_bytes": device.reserve_bytes,
        "budget_bytes": budget,
        "gpus": config.gpus,
        "microbatches": config.microbatches,
        "padded_vocab": padded_vocab(config, config.t),
        "parameters": total_params(config),
        "strategies": {
            p.strategy.name: {
                "total_bytes": p.bytes(),
                **_verdict_json(need(p, peaks.get(p.strategy.name)), budget),
                "stages": [
                    {
                        "stage": st.stage.name,
                        "layers": st.stage.layers,
                        "layer_activations_kept": st.stage.layer_slots,
                        "total_bytes": st.bytes(),
                        "parameters": sum(st.params.values()),
                        "parameter_groups": st.params,
                        "terms": [
                            {"name": x.name, "group": x.group, "bytes": x.bytes, "note": x.note} for x in st.terms
                        ],
                        **_peak_json(peaks.get(p.strategy.name), st.stage.name),
                    }
                    for st in p.stages
                ],
            }
            for p in per
        },
    }


def _verdict_json(needed: Need, budget: int) -> dict:
    """What the strategy needs, on what basis (the peak, or states + saved activations), and the verdict."""
    return {
        "worst_stage": needed.stage, "needed_bytes": needed.bytes, "needed_basis": needed.basis,
        "fits": needed.fits(budget), "headroom_bytes": budget - needed.bytes,
    }


def _peak_json(peaks: tuple[Timeline, ...] | str | None, stage: str) -> dict:
    """The step's peak and steady state for a stage's JSON, or why they are not modelled."""
    if peaks is None:
        return {}
    if isinstance(peaks, str):
        return {"peak_not_modelled": peaks}
    from memcalc.sizing.timeline.words import in_words

    (peak,) = (x for x in peaks if x.stage == stage)
    return {
        "peak_bytes": peak.peak.bytes, "peak_moment": peak.peak.label(), "peak_in_words": in_words(peak.peak),
        "peak_by_category": peak.peak.by_category(),
        "steady_bytes": peak.steady.bytes,
    }
