"""Megatron's region operators f, f*, g, g* (seed, section 4) as autograd functions.

A tensor-parallel layer enters and leaves the region where h is split (inside the column/row-parallel pair) through one
of two conjugate pairs, each op's backward being its partner's forward:

    f  (enter TP, no SP)     forward identity             backward all-reduce
    f* (leave TP, no SP)     forward all-reduce           backward identity
    g  (enter TP from SP)    forward all-gather along s   backward reduce-scatter along s
    g* (leave TP into SP)    forward reduce-scatter on s  backward all-gather along s

Layout is sequence-first, as in Megatron: hidden states are (s, b, h), so "along s" means dim 0 and a rank's sequence
shard is one contiguous block of rows.

Read top-down like Megatron's core/tensor_parallel/mappings.py: collective primitives, then one autograd class per
operator, then the public wrappers, which are identities when t = 1. Collectives use the `*_single` names: torch 2.13
deprecates `all_gather_into_tensor` and `reduce_scatter_tensor` in their favour (same semantics), and gloo supports all
three collectives used here natively, so no emulation is needed.
"""

from __future__ import annotations

from typing import Callable

from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)

# -- collective primitives: plain functions, no autograd (linear.py's fused SP GEMM uses them too) --


def all_reduce(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Sum of x over the ranks, in a new tensor (an autograd input is never changed in place)."""
    total = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(total, group=tp.group)
    return total


def all_gather_seq(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """Every rank's x stacked along dim 0 in rank order: (s/t, ...) -> (s, ...)."""
    full = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(full, x.contiguous(), group=tp.group)
    return full


def reduce_scatter_seq(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's block of dim 0 of the sum of x over the ranks: (s, ...) -> (s/t, ...)."""
    rows = tp.divide(x.shape[0], "sequence length (dim 0)")
    shard = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(shard, x.contiguous(), group=tp.group)
    return shard


def copy_seq_shard(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's block of dim 0, copied so that it owns storage of its own size.

    A view would keep the whole tensor's storage alive behind the shard, and
    anything that measures a tensor by its storage would see the full sequence.
    """
    return tp.block(x, 0, "sequence length").clone(memory_format=torch.contiguous_format)


# -- one autograd function per operator; backward calls the partner's forward --


def _identity(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return x


def _operator(name: str, doc: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function running forward(x, tp) forward and backward(grad, tp) backward."""

    def run_forward(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def run_backward(ctx, grad):
        return backward(grad, ctx.tp), None

    body = {"__doc__": doc, "forward": staticmethod(run_forward), "backward": staticmethod(run_backward)}
    return type(name, (torch.autograd.Function,), body)


_EnterTensorRegion = _operator(
    "_EnterTensorRegion", "f: forward identity, backward all-reduce (conjugate of f*).", _identity, all_reduce)
_LeaveTensorRegion = _operator(
    "_LeaveTensorRegion", "f*: forward all-reduce, backward identity (conjugate of f).", all_reduce, _identity)
_GatherSequence = _operator(
    "_GatherSequence", "g: forward all-gather along s, backward reduce-scatter along s (conjugate of g*).",
    all_gather_seq, reduce_scatter_seq)
_ScatterSequence = _operator(
    "_ScatterSequence", "g*: forward reduce-scatter along s, backward all-gather along s (conjugate of g).",
    reduce_scatter_seq, all_gather_seq)
_SplitSequence = _operator(
    "_SplitSequence", "Entering SP from a replicated tensor: forward split along s, backward all-gather along s.",
    copy_seq_shard, all_gather_seq)


# -- public wrappers: identities when t = 1 -----------------------------------


def f_enter_tp(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """f: enter the TP region from a replicated tensor (forward identity, backward all-reduce)."""
    return x if tp.size == 1 else _EnterTensorRegion.apply(x, tp)


def f_star_leave_tp(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """f*: leave the TP region by summing partial results (forward all-reduce, backward identity)."""
    return x if tp.size == 1 else _LeaveTensorRegion.apply(x, tp)


def g_gather_seq(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """g: enter the TP region from SP (forward all-gather along s, backward reduce-scatter along s)."""
    return x if tp.size == 1 else _GatherSequence.apply(x, tp)


def g_star_scatter_seq(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """g*: leave the TP region into SP (forward reduce-scatter along s, backward all-gather along s)."""
    return x if tp.size == 1 else _ScatterSequence.apply(x, tp)


def split_seq(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's sequence shard of a full (s, b, h) tensor, to build SP inputs (backward all-gather)."""
    return x if tp.size == 1 else _SplitSequence.apply(x, tp)
