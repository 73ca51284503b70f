"""The probe: a real transformer layer run under torch, to check the ledger's bytes.

Everything torch-related in memcalc lives in this package, and even here torch is imported only when a submodule is
loaded: importing `memcalc.probe` itself stays cheap. Each submodule begins with `torch = require_torch()`, so a missing
torch surfaces as a one-line `ProbeError` saying how to install it, not an ImportError.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from memcalc.errors import ProbeError, debugging

# Named here so that the CLI offers them without importing torch: which code builds the layer `memcalc measure` runs
# (the implementation's own library, or memcalc's own Megatron-style layer), and the assignments `--route` forces a
# MoE router to (memcalc.probe.libs.hf_shim).
LAYERS = ("library", "memcalc")
ROUTES = ("balanced", "all-to-one")


def routing_fixed(config: Any, route: str | None) -> bool:
    """Whether the collectives a layer issues are the ledger's to the byte: a dense layer's always; a MoE layer's
    only when its router is forced balanced (`route`) and the ledger takes the balanced bound (moe_tokens), since
    the bytes its dispatcher moves follow the routing."""
    return not config.moe or (route == "balanced" and config.moe_tokens == "balanced")


def capacity_caps_worst(config: Any) -> bool:
    """Whether a capacity factor, not padded, caps the worst bound at every expert full (`routed_slots`): an upper
    bound, which the all-to-one route does not make (it fills only the k experts it sends every token to), so that
    route no longer pins moe_tokens worst."""
    return config.moe_expert_capacity_factor is not None and not config.moe_pad_expert_input_to_capacity

INSTALL_HINT = "pip install torch==2.13.0 (in a checkout: pip install -e '.[probe]')"


def require_torch() -> ModuleType:
    """Return the torch module, or raise ProbeError saying how to install it.

    torch's C++ log (a rank that cannot reach MASTER_ADDR logs each retry, a hundred lines before memcalc's
    one) is kept to fatal messages, in this process and the workers it starts: memcalc reports every failure in
    its own line. TORCH_CPP_LOG_LEVEL set by the user, or MEMCALC_DEBUG, keeps torch's own level. It is read
    once, when torch is first imported.
    """
    if not debugging():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    try:
        import torch
    except ImportError as err:
        message = f"the probe needs PyTorch, which is not installed ({err}); install it with: {INSTALL_HINT}"
        raise ProbeError(message) from err
    return torch
