"""What transformers' layers need to keep on a CPU what they keep on CUDA (dropout, a tp model's loaded shards),
and a forced router.

Why each patch, and how a forced route assigns the experts: docs/probe.md, "Dropout and forced routing
(hf_shim)".
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager, nullcontext
from types import MethodType
from typing import Any, ContextManager, Iterator
from memcalc.probe import require_torch, shims
from memcalc.probe.shims import patched

torch = require_torch()

NOTES: tuple[str, ...] = shims.notes("hf")  # every shim below, one line each (memcalc.probe.shims)


@contextmanager
def cuda_like_dropout() -> Iterator[None]:
    """While inside, F.dropout in training keeps a bool mask on every device, as CUDA's native_dropout does."""
    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):  # noqa: A002  (torch's own parameter name)
        if training and 0 < p < 1 and not inplace and input.device.type == "cpu":
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    with patched(torch.nn.functional, dropout=dropout):
        yield


def dropout_in_rerun() -> tuple[ContextManager[None], ContextManager[None]]:
    """torch.utils.checkpoint's `context_fn`: a gradient checkpoint's rerun, inside backward and so outside the forward
    that `cuda_like_dropout` wraps, drops out as its forward did (else the CPU's mask, another saved tensor, fails
    the checkpoint's metadata check). The forward's own context is the caller's."""
    return nullcontext(), cuda_like_dropout()


_LEAD = 100.0  # far above any logit of the probe's small, normal(0, 0.02) router, yet exact in bf16


def route_note(route: str) -> str:
    """The `shim:` line a forced route prints."""
    return f"hf: the router is forced ({route}): its logits get {route_lead(route)}; its scores and top-k run as written"


# a balanced route's words where it deals over ep ranks (`lead`): megatron's and torchtitan's shims print them
DEALT = " (over ep, residue m = q ep + r on rank r's expert q)"


def route_lead(route: str) -> str:
    """What a forced route adds to the logits, in words (megatron's shim forces its router the same way)."""
    where = "experts (ik + j) mod E for token i, slot j" if route == "balanced" else "experts 0..k-1 for every token"
    return f"+{_LEAD:g} on {where}"


def force_routers(model: Any, router_classes: tuple[type, ...], route: str, k: int) -> None:
    """Each router of `model` picks the experts `route` assigns (`lead`) for the model's life: its forward, and a
    gradient checkpoint's rerun of it inside backward (a context around the forward would miss it)."""
    for module in model.modules():
        if isinstance(module, router_classes):
            module.forward = MethodType(_leading(type(module).forward, route, k), module)


def _leading(original: Any, route: str, k: int) -> Any:
    """A router forward whose logits (its one F.linear) lead on the assigned experts."""

    def forward(self: Any, hidden_states: Any) -> Any:
        linear = torch.nn.functional.linear

        def led(input, weight, bias=None):  # noqa: A002  (torch's own parameter name)
            logits = linear(input, weight, bias)  # (tokens, E)
            return logits + lead(logits, route, k)

        with patched(torch.nn.functional, linear=led):
            return original(self, hidden_states)

    return forward


def lead(logits: Any, route: str, k: int, ep: int = 1) -> Any:
    """(tokens, E): +_LEAD on each token's assigned experts (dealt round the `ep` ranks first, E/ep experts each, when
    balanced), 0 elsewhere; a constant, so nothing is saved for it."""
    tokens, experts = logits.shape
    slots = torch.arange(tokens * k, device=logits.device).view(tokens, k)  # slot j of token i is ik + j
    chosen = slots % experts if route == "balanced" else slots % k
    if route == "balanced" and ep > 1:  # residue m = q ep + r to rank r's expert q, by a table: no product or
        # quotient in the router's frame, whose rules count those (memcalc.probe.libs.megatron)
        dealt = [m % ep * (experts // ep) + m // ep for m in range(experts)]
        chosen = torch.tensor(dealt, device=logits.device)[chosen]
    offsets = torch.zeros(tokens, experts, dtype=logits.dtype, device=logits.device)
    return offsets.scatter_(1, chosen, _LEAD)


def without_shm_comm_op() -> ContextManager[None]:
    """DeepSpeed's comm backend started without the shared-memory all-reduce op its CPU accelerator JIT-compiles (a
    minute on a fresh machine): only inference_all_reduce calls it, so ZeRO's step never makes or holds its tensors."""
    comm = importlib.import_module("deepspeed.comm.torch")  # the attribute deepspeed.comm.torch is torch (import *)
    return patched(comm, build_shm_op=lambda: None)


@contextmanager
def cuda_like_loading() -> Iterator[None]:
    """While inside, from_pretrained(distributed_config=...) loads on a CPU what it loads on CUDA: each rank's shard is
    copied out of the checkpoint's weight (on a CPU a Shard(0) slice stays a view of the whole, as .to('cpu') copies
    nothing; CUDA's .to(device) copies the shard alone), and its check that accelerate is installed passes (with one
    device a rank it runs no accelerate code)."""
    sharding = importlib.import_module("transformers.distributed.sharding_utils").DtensorShardOperation
    shard_tensor = sharding.shard_tensor

    def copied(self: Any, *args: Any, **kwargs: Any) -> Any:
        shard = shard_tensor(self, *args, **kwargs)
        return None if shard is None else shard.clone()

    accelerate = importlib.import_module("transformers.integrations.accelerate")
    with patched(sharding, shard_tensor=copied), patched(accelerate, is_accelerate_available=lambda: True):
        yield
