"""Activation recomputation as Megatron's reentrant CheckpointFunction does it.

    forward:  run f without autograd; keep only f's inputs (and the RNG state)
    backward: restore the RNG state, run f again with autograd, backprop through it

The inputs are kept with `ctx.save_for_backward`, so the recorder sees what a checkpoint costs (torch's non-reentrant
checkpoint hides them behind saved-tensor hooks of its own); the RNG state makes the rerun draw the same dropout masks.
"""

from __future__ import annotations

from typing import Callable

from memcalc.probe import require_torch

torch = require_torch()


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        ctx.run = run
        ctx.devices = sorted({x.device.index for x in inputs if x.is_cuda})
        ctx.rng_states = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.save_for_backward(*inputs)
        return run(*inputs)  # autograd is off inside forward: nothing of f is kept

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=ctx.devices):
            cpu, cuda = ctx.rng_states
            torch.set_rng_state(cpu)
            for device, state in zip(ctx.devices, cuda):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                output = ctx.run(*inputs)
        torch.autograd.backward(output, grad)
        return (None, *(x.grad if x.requires_grad else None for x in inputs))


def checkpoint(run: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """run(*inputs), keeping only `inputs` for backward and recomputing the rest there."""
    return _Checkpoint.apply(run, *inputs)
