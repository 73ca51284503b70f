"""What transformers' layers need to keep on a CPU what they keep on CUDA: one patch, dropout.

`torch.nn.functional.dropout` on CUDA runs `native_dropout`, whose backward keeps
a 1-byte bool mask. On a CPU, torch's `at::dropout` takes its unfused path
(`is_fused_kernel_acceptable` accepts CUDA, XPU and a few others, not the CPU):
it draws the mask in the activation dtype, scales it by 1/(1-p) and keeps that,
2 bytes per element in bf16. `cuda_like_dropout()` routes the CPU call through
`torch.native_dropout` while a layer runs, so the bool mask is what the probe
sees. HF's eager attention (`nn.functional.dropout`) and `nn.Dropout` modules
(GPT-2's resid and MLP dropouts) both look the function up at call time, so
patching the attribute reaches them. No file of transformers is edited.

Not patched, because nothing on a CPU is CUDA's twin: SDPA with dropout.
torch's CPU flash kernel refuses dropout, so the call falls back to the math
kernel, which upcasts to fp32 and drops out inside C++ (`at::dropout`); the
rules model that per device (memcalc.model.impls.hf).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from memcalc.probe import require_torch

torch = require_torch()

NOTES: tuple[str, ...] = (
    "hf: torch.nn.functional.dropout runs torch.native_dropout on the CPU as on CUDA (a bool mask, not a bf16 one)",
)


@contextmanager
def cuda_like_dropout() -> Iterator[None]:
    """While inside, F.dropout in training keeps a bool mask on every device, as CUDA's native_dropout does."""
    functional = torch.nn.functional
    original = functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002  (torch's own parameter name)
        if training and 0 < p < 1 and not inplace and input.device.type == "cpu":
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = original
