"""What a strategy needs per GPU, for the fits/does-not-fit verdict: the step's peak where it is modelled
(a run goes out of memory at its peak, above states plus saved activations), else those totals, said so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.errors import ConfigError
from memcalc.model.knobs import Accounting
from memcalc.records import record

if TYPE_CHECKING:
    from memcalc.config.schema import ModelConfig
    from memcalc.model.strategy import Strategy
    from memcalc.sizing.timeline import Timeline
    from memcalc.sizing.totals import PerGpu

PEAK, SAVED = "the step's peak", "states + saved activations"
# What `fit` solves for, and what it counts against the budget (peak: the step's, where the timeline models it).
SOLVES = ("b", "s", "t", "pp", "cp", "ep", "dp_shard")
COUNTS = ("peak", "total", "activations")


@record
class Need:
    """The bytes one GPU needs, what they count (`PEAK` or `SAVED`), and the pipeline stage that needs them."""

    bytes: int
    basis: str
    stage: str

    def fits(self, budget: int) -> bool | None:
        """Whether these bytes fit `budget`: None (unknown) where only states + saved activations are known and they
        fit, for the step's peak lies above them by what the walk would have added."""
        if self.bytes > budget:
            return False
        return True if self.basis == PEAK else None


def step_peaks(config: ModelConfig, strategy: Strategy, device: str = "cuda") -> tuple[Timeline, ...] | str:
    """One step's timeline per bounding stage on `device`'s kernels, or why it is not modelled for this config."""
    from memcalc.sizing.timeline import timelines  # only the verdict pays for it

    try:
        return timelines(config, strategy, Accounting(exact=True, device=device))
    except ConfigError as exc:
        return str(exc)


def need(per: PerGpu, peaks: tuple[Timeline, ...] | str | None) -> Need:
    """The highest stage's step peak if the timeline models the config, else its per-GPU total."""
    if isinstance(peaks, tuple) and peaks:
        worst = max(peaks, key=lambda x: x.peak.bytes)
        return Need(worst.peak.bytes, PEAK, worst.stage)
    return Need(per.bytes(), SAVED, per.worst().stage.name)
