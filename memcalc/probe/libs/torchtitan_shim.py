"""What torchtitan 0.3.0 needs to run its Llama3 and MoE blocks on a CPU, and to run them as CUDA does (`--device
cuda` with `--step`), patched at run time; no library file is edited.

Each patch is a record of memcalc.probe.shims (`NOTES`, the `shim:` lines `memcalc measure` prints), tabled with its
reason in docs/probe.md, "What the shims change", with the details the table leaves out.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator

from memcalc.probe import require_torch, shims
from memcalc.probe.libs.hf_shim import DEALT, lead, route_lead
from memcalc.probe.shims import patched

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


def mesh_device(device_type: str) -> Any:
    """While building a mesh: torchtitan's device type is the rank's, not its "cuda" fallback."""
    from torchtitan.distributed import parallel_dims

    return patched(parallel_dims, device_type=device_type)


@contextmanager
def every_rank_routes_alike() -> Iterator[None]:
    """On the fake group, every rank routes as this one: the token counts' all-to-all still runs, then leaves this
    rank's own counts; the chunks an uneven all-to-all cannot copy are zeroed (docs/probe.md, "What the table leaves
    out")."""
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
        with torch.autograd._unsafe_preserve_version_counter(received):  # SelectiveAC caches the all-to-all's output
            received.copy_(mine.expand(ep, -1))  # (on DTensor funcol's) and refuses a version bumped in between
        return received

    with patched(AllToAllTokenDispatcher, _token_count_exchange=exchanged):
        with patched(torch.distributed, all_to_all=uneven):
            yield


@contextmanager
def flex_on_cpu() -> Iterator[None]:
    """While inside: torchtitan's compiled flex attention runs SDPA's CPU flash kernel (causal; the probe's positions
    are one document a row, so its block mask says the same), and its compiled create_block_mask runs as one op."""
    from torchtitan.models.common import attention, decoder

    with patched(attention.FlexAttention, compiled_flex_attn=staticmethod(_flash)):
        with patched(decoder, create_attention_mask=_block_mask):
            yield


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None, enable_gqa: bool,
           **flex: Any) -> tuple[torch.Tensor, Any]:
    """Causal attention by SDPA's flash kernel, which keeps what compiled flex keeps: q, k, v, out, lse."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import AuxOutput

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=enable_gqa)
    return out, AuxOutput()


def _block_mask(*args: Any, **kwargs: Any) -> Any:
    """torch's create_block_mask as torch.compile runs it: only its tensors are made (eagerly its (b, 1, s, s)-sized
    intermediates would be, which the compiled kernel never materialises): run unseen, its tensors copied in."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        mask = create_block_mask(*args, **kwargs)
    for name, value in vars(mask).items():
        if isinstance(value, torch.Tensor):
            setattr(mask, name, value.clone())
    return mask


def fused_norms(model: torch.nn.Module) -> None:
    """Each nn.RMSNorm of `model` runs as torch's CUDA _fused_rms_norm (one op each way, keeping its input and rstd),
    for the life of `model` (before its TP plan, which wraps the forward it finds); on a CPU torch runs rms_norm's
    composite."""
    from memcalc.probe.kernels import FusedRMSNorm

    _fused_norm_sharding()
    for norm in [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]:
        norm.forward = _fused(norm, FusedRMSNorm)


@functools.cache
def _fused_norm_sharding() -> None:
    """DTensor's rules for the probe's fused norm ops (FSDP2 beside tp runs the TP plan on DTensor), as it has them
    for _fused_rms_norm: sharded along any dim but the normalised one, the weight replicated and its gradient a
    Partial sum, or all replicated."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.memcalc.rms_norm.default)
    def forward(x: Any, weight: Any, eps: float) -> list:
        return [([Replicate(), Replicate()], [Replicate(), Replicate(), None]),
                *(([Shard(d), Shard(d)], [Shard(d), Replicate(), None]) for d in range(x.ndim - 1))]

    @register_sharding(torch.ops.memcalc.rms_norm_backward.default)
    def backward(grad_y: Any, x: Any, weight: Any, rstd: Any) -> list:
        return [([Replicate(), Replicate()], [Replicate()] * 4),
                *(([Shard(d), Partial()], [Shard(d), Shard(d), Replicate(), Shard(d)]) for d in range(x.ndim - 1))]


def _fused(norm: torch.nn.RMSNorm, kernel: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return kernel.apply(x, norm.weight, torch.finfo(x.dtype).eps if norm.eps is None else norm.eps)
    return forward


def cuda_like_op_checkpointing() -> Any:
    """SelectiveAC saves the CPU flash-attention kernel's outputs too, as it saves its CUDA twins'."""
    from torchtitan.distributed import activation_checkpoint

    original = activation_checkpoint._get_default_save_ops
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    return patched(activation_checkpoint, _get_default_save_ops=lambda: original() | {cpu_flash})


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

    with patched(activation_checkpoint, create_selective_checkpoint_contexts=recording):
        yield caches


def cached_tensors(caches: list[dict]) -> list[torch.Tensor]:
    """Every tensor the caches hold (outputs torch.utils.checkpoint keeps until the recompute in backward)."""
    leaves = torch.utils._pytree.tree_leaves([calls for cache in caches for calls in cache.values()])
    values = [getattr(leaf, "val", None) for leaf in leaves]  # each output is wrapped to catch mutation
    return [v for v in values if isinstance(v, torch.Tensor)]


def route_note(route: str) -> str:
    """The `shim:` line a forced route prints."""
    dealt = DEALT if route == "balanced" else ""
    lead = route_lead(route)
    return f"torchtitan: the router is forced ({route}): its gate's logits get {lead}{dealt}; the rest as written"


def route_gates(block: torch.nn.Module, route: str | None, k: int, ep: int = 1) -> None:
    """Hooks that make each MoE gate of `block` run as under CUDA's autocast(float32), its logits led by `route`
    (balanced: dealt round the `ep` ranks first, as megatron's), in forward and in a checkpoint's rerun in backward
    alike, for the life of `block`."""
    from torchtitan.models.common.moe import TokenChoiceTopKRouter

    found: list[tuple[bool, Any]] = []  # the CPU autocast state each running gate found

    def fp32_on_cpu(module: torch.nn.Module, args: tuple) -> None:
        if args[0].device.type == "cpu":  # what torch.autocast refuses on a CPU and runs on CUDA
            found.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            torch.set_autocast_dtype("cpu", torch.float32)
            torch.set_autocast_enabled("cpu", True)

    def restored(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        if found:  # the CPU autocast state as it was; off, its cache of casts (the gate's fp32 weight) goes too
            enabled, dtype = found.pop()
            torch.set_autocast_enabled("cpu", enabled)
            torch.set_autocast_dtype("cpu", dtype)
            if not enabled:
                torch.clear_autocast_cache()
        return logits if route is None else logits + lead(logits.flatten(0, -2), route, k, ep).view_as(logits)

    for gate in [m.gate for m in block.modules() if isinstance(m, TokenChoiceTopKRouter)]:
        gate.register_forward_pre_hook(fp32_on_cpu)
        gate.register_forward_hook(restored)


@contextmanager
def pipeline_on_fake_group() -> Iterator[None]:
    """Each pipeline stage's warm-up vote is its own: on the fake group a receive leaves its buffer as it was, so the
    peers' votes read 0 and every stage would fall back to inferring shapes over P2P, whose received sizes are
    garbage; the probe gives every stage its shapes, as the peers' votes would then say. Each receive buffer is made
    zeroed, so what a stage is sent is zeros, not whatever its storage held: garbage would make the weights NaN after
    the first step, and a router's NaN logits route no token as forced (at ep > 1 the counts set the all-to-all's
    bytes)."""
    from torch.distributed.pipelining import stage
    from torch.distributed.pipelining.stage import InferenceMode

    def own_vote(self: Any, has_backward: bool, received_acc: Any = None) -> torch.Tensor:
        static = not InferenceMode.needs_dynamic(self._user_meta, has_backward)
        return torch.tensor([int(static)], dtype=torch.int32, device=self.device)

    made = stage._make_tensor_from_meta
    with patched(stage.PipelineStage, _warmup_forward_vote=own_vote,
                 _warmup_backward_result=lambda self, received_result=None: received_result), \
            patched(stage, _make_tensor_from_meta=lambda meta, device: made(meta, device).zero_()):
        yield
