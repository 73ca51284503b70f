"""The least memory `memcalc measure` will allocate, checked against the machine before any rank starts.

A GPT-3 layer at full width, or `--s 1099511627776`, would make torch swap, meet the OOM killer or fail deep in a
worker; so the bytes are counted first and a run that cannot fit is refused in one line. The count is a lower
bound (saved activations plus the layer's weights and gradients, times the ranks here at once), so no run that
could fit is refused. torch is imported only to ask a GPU its size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import DTYPE_BYTES, Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.params import part
from memcalc.units import human_bytes


@dataclass(frozen=True)
class Footprint:
    """What one strategy's run needs at least: per rank, and how many ranks share this machine."""

    strategy: str
    per_rank: int
    ranks_here: int

    @property
    def bytes(self) -> int:
        return self.per_rank * self.ranks_here


def footprint(config: ModelConfig, strategy: str, device: str, ranks_here: int) -> Footprint:
    """The least bytes a rank allocates for `strategy`: saved activations, weights and their gradients."""
    st = STRATEGIES[strategy]
    t = st.weight_shards(config.t)
    activations = estimate(config, st, Accounting(exact=True, device=device)).per_layer_bytes
    mlp = "moe" if config.moe else "dense"  # the one layer measure builds: a MoE layer when the config has experts
    weights = sum(prod(p.shape) for p in part(config, t, mlp)) * DTYPE_BYTES[config.dtype]
    return Footprint(strategy, activations + 2 * weights, ranks_here if st.tensor_parallel else 1)


def check_fits(config: ModelConfig, strategies: list[str], device: str, ranks_here: int) -> None:
    """Refuse, in one line naming the bytes, a run whose least footprint exceeds what this machine has: the
    largest strategy (they run one after another), per GPU on GPUs; nothing on meta, which holds no data."""
    if device == "meta":
        return
    worst = max((footprint(config, name, device, ranks_here) for name in strategies), key=lambda f: f.bytes)
    have, what = available(device)
    need = worst.per_rank if device == "cuda" else worst.bytes
    if have is not None and need > have:
        ranks = f" x {worst.ranks_here} ranks" if worst.ranks_here > 1 else ""
        raise ConfigError(
            f"measure {worst.strategy} would allocate at least {need:,} bytes"
            f" ({human_bytes(worst.per_rank)} per rank{ranks}: saved activations, the layer's weights and gradients),"
            f" but {what} is {have:,} bytes ({human_bytes(have)}); choose smaller sizes"
        )


def available(device: str) -> tuple[int | None, str]:
    """Bytes the run may use on `device`, and what they are (None when it cannot be told)."""
    return _gpu_memory() if device == "cuda" else _free_memory()


def _free_memory() -> tuple[int | None, str]:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine's available memory (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's physical memory"
    except (OSError, ValueError, AttributeError):
        return None, "unknown"


def _gpu_memory() -> tuple[int | None, str]:
    """The first GPU's total memory (every rank gets a GPU of its own, of the same kind), if torch sees one."""
    try:
        import torch
    except ImportError:
        return None, "unknown"  # measure says how to install torch
    if not torch.cuda.is_available():
        return None, "unknown"  # measure says there is no GPU
    return torch.cuda.get_device_properties(0).total_memory, "one GPU's memory"
