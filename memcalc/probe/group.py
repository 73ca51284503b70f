"""Who this process is among the t tensor-parallel ranks, and how to cut a tensor for it.

Probe modules take a `TensorParallelGroup`, never torch.distributed's default group, so the same layer runs in one
process, in t processes, or as one rank of torch's fake group (`memcalc.probe.launch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memcalc.errors import ProbeError
from memcalc.probe import require_torch

torch = require_torch()

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place in a tensor-parallel group of `size` (the seed's t) ranks."""

    group: ProcessGroup | None  # None: one process, t = 1, no collectives
    rank: int
    size: int  # t
    mode: str  # "single", "gloo", "nccl" or "fake" (torch's fake group: one process acting as `rank` of `size`)
    device: torch.device

    def divide(self, n: int, what: str) -> int:
        """n / t, or a ProbeError naming the equation when t does not divide n."""
        if n % self.size:
            raise ProbeError(f"{what}={n} is not divisible by t={self.size}")
        return n // self.size

    def block(self, x: torch.Tensor, dim: int, what: str = "size") -> torch.Tensor:
        """This rank's contiguous block of x along dim: block `rank` of t equal ones (a view)."""
        n = self.divide(x.shape[dim], f"{what} (dim {dim})")
        return x.narrow(dim, self.rank * n, n)


def single(device: str | torch.device = "cpu") -> TensorParallelGroup:
    """The t = 1 group: one process, no process group, every TP operator an identity."""
    return TensorParallelGroup(group=None, rank=0, size=1, mode="single", device=torch.device(device))
