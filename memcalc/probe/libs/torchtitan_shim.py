"""What torchtitan 0.3.0 needs to run its Llama3 and MoE blocks on a CPU, patched at run time; no library file
is edited.

Each patch is a record of memcalc.probe.shims (`NOTES`, the `shim:` lines `memcalc measure` prints), tabled with its
reason in docs/probe.md, "What the shims change", with the details the table leaves out.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator

from memcalc.probe import require_torch, shims
from memcalc.probe.libs.hf_shim import lead, route_lead

torch = require_torch()

NOTES: tuple[str, ...] = shims.notes("torchtitan")  # every shim below, one line each (memcalc.probe.shims)

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def stub_triton_kernels() -> None:
    """Before torchtitan is imported: without triton, its MoE dispatcher's kernels module becomes a stub."""
    if importlib.util.find_spec("triton") is not None or _KERNELS in sys.modules:
        return
    stub = types.ModuleType(_KERNELS, "torchtitan's MinimalAsyncEP triton kernels, absent: triton is not installed")

    def missing(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"torchtitan's {name} is a triton kernel, and triton is not installed")

        return kernel

    stub.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[_KERNELS] = stub


@contextmanager
def mesh_device(device_type: str) -> Iterator[None]:
    """While building a mesh: torchtitan's device type is the rank's, not its "cuda" fallback."""
    from torchtitan.distributed import parallel_dims

    original = parallel_dims.device_type
    parallel_dims.device_type = device_type
    try:
        yield
    finally:
        parallel_dims.device_type = original


@contextmanager
def every_rank_routes_alike() -> Iterator[None]:
    """On the fake group, the EP dispatcher's all-to-all of token counts leaves each source rank's counts for this
    rank's experts as this rank's own: every rank routes as this one (so under a forced route, which each rank
    repeats on its own tokens). The all-to-all still runs; only the values it leaves are written. The fake group's
    list all-to-all copies each input chunk to the same rank's output chunk, which an uneven route (this rank's
    slots sent to itself alone, received from every rank) cannot: there it zeroes the chunks spmd_types allocated
    (uninitialised, they could hold NaNs that a step's update would write into the weights, and so into the route)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    original, all_to_all = AllToAllTokenDispatcher._token_count_exchange, torch.distributed.all_to_all

    def uneven(outputs: list, inputs: list, group: Any = None, **kwargs: Any) -> Any:
        if torch.distributed.get_backend(group) == "fake":
            for chunk in outputs:
                chunk.zero_()
            return None
        return all_to_all(outputs, inputs, group=group, **kwargs)

    def exchanged(self: Any, counts: torch.Tensor, group: Any, ep: int) -> torch.Tensor:
        received = original(self, counts, group, ep)
        if torch.distributed.get_backend(group) != "fake":
            return received
        received = torch.ops._c10d_functional.wait_tensor(received)  # (ep, E/ep): each source rank's counts
        mine = counts.view(ep, -1)[torch.distributed.get_rank(group)]
        received.copy_(mine.expand(ep, -1))
        return received

    AllToAllTokenDispatcher._token_count_exchange, torch.distributed.all_to_all = exchanged, uneven
    try:
        yield
    finally:
        AllToAllTokenDispatcher._token_count_exchange, torch.distributed.all_to_all = original, all_to_all


@contextmanager
def cuda_like_op_checkpointing() -> Iterator[None]:
    """SelectiveAC saves the CPU flash-attention kernel's outputs too, as it saves its CUDA twins'."""
    from torchtitan.distributed import activation_checkpoint

    original = activation_checkpoint._get_default_save_ops

    def save_ops() -> set:
        return original() | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    activation_checkpoint._get_default_save_ops = save_ops
    try:
        yield
    finally:
        activation_checkpoint._get_default_save_ops = original


@contextmanager
def op_checkpoint_caches() -> Iterator[list[dict]]:
    """The caches of op outputs that SelectiveAC's checkpoints fill during the block's forward."""
    from torchtitan.distributed import activation_checkpoint

    caches: list[dict] = []
    original = activation_checkpoint.create_selective_checkpoint_contexts

    def recording(*args: Any, **kwargs: Any) -> tuple:
        contexts = original(*args, **kwargs)
        caches.append(contexts[0].storage)  # the caching mode's storage: {op: {call index: outputs}}
        return contexts

    activation_checkpoint.create_selective_checkpoint_contexts = recording
    try:
        yield caches
    finally:
        activation_checkpoint.create_selective_checkpoint_contexts = original


def cached_tensors(caches: list[dict]) -> list[torch.Tensor]:
    """Every tensor the caches hold (outputs torch.utils.checkpoint keeps until the recompute in backward)."""
    leaves = [
        leaf
        for cache in caches
        for calls in cache.values()
        for outputs in calls.values()
        for leaf in torch.utils._pytree.tree_leaves(outputs)
    ]
    values = [getattr(leaf, "val", None) for leaf in leaves]  # each output is wrapped to catch mutation
    return [v for v in values if isinstance(v, torch.Tensor)]


def route_note(route: str) -> str:
    """The `shim:` line a forced route prints."""
    return f"torchtitan: the router is forced ({route}): its gate's logits get {route_lead(route)}; the rest as written"


def route_gates(block: torch.nn.Module, route: str | None, k: int) -> None:
    """Hooks that make each MoE gate of `block` run as under CUDA's autocast(float32), its logits led by `route`,
    in forward and in a checkpoint's rerun in backward alike, for the life of `block`."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    found: list[tuple[bool, Any]] = []  # the CPU autocast state each running gate found

    def fp32_on_cpu(module: torch.nn.Module, args: tuple) -> None:
        if args[0].device.type == "cpu":  # what torch.autocast refuses on a CPU and runs on CUDA
            found.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            torch.set_autocast_dtype("cpu", torch.float32)
            torch.set_autocast_enabled("cpu", True)

    def restored(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        if found:
            _restore_cpu_autocast(*found.pop())
        return logits if route is None else logits + lead(logits.flatten(0, -2), route, k).view_as(logits)

    for gate in [m.gate for m in block.modules() if isinstance(m, TokenChoiceTopKRouter)]:
        gate.register_forward_pre_hook(fp32_on_cpu)
        gate.register_forward_hook(restored)


def _restore_cpu_autocast(enabled: bool, dtype: Any) -> None:
    """The CPU autocast state as it was; off, its cache of casts (the gate's fp32 weight) is dropped too."""
    torch.set_autocast_enabled("cpu", enabled)
    torch.set_autocast_dtype("cpu", dtype)
    if not enabled:
        torch.clear_autocast_cache()
