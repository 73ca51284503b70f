"""The probe: a real transformer layer run under torch, to check the ledger's bytes.

Everything torch-related in memcalc lives in this package, and even here torch is imported only when a submodule is
loaded: importing `memcalc.probe` itself stays cheap. Each submodule begins with `torch = require_torch()`, so a missing
torch surfaces as a one-line `ProbeError` saying how to install it, not an ImportError.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Iterable

from memcalc.errors import ConfigError, ProbeError, debugging

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


def check_worst_route(config: Any, route: str | None, strategies: Iterable[Any]) -> None:
    """ConfigError where --route all-to-one is to pin moe_tokens capacity under an unpadded capacity factor, or worst
    where such a factor drops tokens at these sizes under a strategy: the capped bound (`routed_slots`) is then not
    what the route makes (its k experts full, the rest empty). An expert receives each token a router sees at most
    once, so a capacity of all of them drops none, and the route makes the worst bound itself."""
    capped = config.moe_expert_capacity_factor is not None and not config.moe_pad_expert_input_to_capacity
    if route != "all-to-one" or config.moe_tokens not in ("worst", "capacity") or not capped:
        return
    if config.moe_tokens == "capacity":  # every expert full: the route fills its k experts only
        raise ConfigError("--route all-to-one pins moe_tokens capacity only where no capacity caps it: with"
                          " moe_expert_capacity_factor unpadded that bound is every expert full, which the route does"
                          " not make; set moe_pad_expert_input_to_capacity, or leave the capacity factor unset")
    from memcalc.model.evaluate import capacity_slots, routers

    for strategy in strategies:
        n = routers(config, strategy)
        seen = config.b * (config.s // config.cp) // n  # the tokens one router sees
        kept = capacity_slots(config, n) // (config.num_experts * n)  # and those an expert keeps of them
        if kept < seen:
            raise ConfigError(
                f"--route all-to-one pins moe_tokens worst only where no capacity drops tokens: under {strategy.name}"
                f" an expert keeps ceil(k*n/E*c) = ceil({config.moe_router_topk}*{seen}/{config.num_experts}"
                f"*{config.moe_expert_capacity_factor:g}) = {kept} of the n = {seen} tokens a router sees, so the"
                " capped bound is not what the route makes (its k experts full, the rest empty); set"
                " moe_pad_expert_input_to_capacity, a larger capacity factor, or none")


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
