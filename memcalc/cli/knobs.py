"""Knobs for the commands that need no sizes (formula, explain): the knob flags, or a --config file's (whose
sizes are then validated too).
"""

from __future__ import annotations

from typing import Any

from memcalc.cli.options import KNOB_FLAGS, model_from
from memcalc.config.schema import build_knobs
from memcalc.model.knobs import Knobs


def knobs_from(params: dict[str, Any]) -> Knobs:
    """Knobs from --config (if any) with knob flags laid over, else from flags alone."""
    if params.get("config_path") is not None:
        return Knobs.of(model_from(params))
    return Knobs.of(build_knobs({k: params[k] for k in KNOB_FLAGS if params.get(k) is not None}))
