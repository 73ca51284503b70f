"""What megatron-core 0.16 needs to run its own layer on a CPU, as CUDA would run it.

megatron-core assumes a GPU in a few places that have nothing to do with what a layer keeps for backward;
`cpu_megatron()` patches them while a layer is built and run, and undoes every patch afterwards. No file of
megatron-core is edited. Each patch is a record of memcalc.probe.shims (`NOTES`, the `shim:` lines `memcalc measure`
prints), tabled with its reason in docs/probe.md, "What the shims change", with the details the table leaves out.
"""

from __future__ import annotations

import math
import sys
import types
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from memcalc.model import ledger
from memcalc.model.ledger import NormTensors
from memcalc.probe import require_torch, shims
from memcalc.probe.kernels import fused_causal_softmax, fused_causal_softmax_backward
from memcalc.probe.libs.hf_shim import DEALT, lead, route_lead
from memcalc.probe.norm import Norm
from memcalc.probe.recorder import batch_first, label
from memcalc.probe.shims import patched, patched_items

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

NOTES: tuple[str, ...] = shims.notes("megatron")  # every shim below, one line each (memcalc.probe.shims)

_SOFTMAX_EXTENSION = "scaled_upper_triang_masked_softmax_cuda"
_SOFTMAX_SIZES = "scaled_masked_softmax_cuda"  # only its get_batch_per_block is used for causal masks


@contextmanager
def cpu_megatron() -> Iterator[None]:
    """Every patch below, for the duration of the block; undone on exit."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    with ExitStack() as patches:
        enter = patches.enter_context
        enter(torch._dynamo.config.patch(disable=True))
        enter(patched(F, dropout=_cuda_like_dropout))
        enter(patched_items(sys.modules, **{_SOFTMAX_EXTENSION: _softmax_extension(), _SOFTMAX_SIZES: _sizes()}))
        enter(patched(fused_softmax, get_default_causal_mask=_causal_mask))
        if not torch.cuda.is_available():
            enter(patched(torch.cuda, current_device=lambda: torch.device("cpu")))
        enter(patched(mrandom, _get_cuda_rng_state=lambda *a, **k: torch.get_rng_state(),
                      _set_cuda_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
                      _CUDA_RNG_STATE_TRACKER=_cpu_rng_tracker(), _CUDA_RNG_STATE_TRACKER_INITIALIZED=True))
        enter(patched(multi_latent_attention, HAVE_TE=False))
        enter(patched(moe_utils, create=True, te_general_gemm=None))
        alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
        # cuda_dtoh_stream not None: __init__ makes no CUDA stream
        enter(patched(alltoall, cuda_dtoh_stream="cpu", _maybe_dtoh_and_synchronize=_cpu_dtoh))
        gather = token_dispatcher.gather_from_sequence_parallel_region
        enter(patched(token_dispatcher, gather_from_sequence_parallel_region=_every_rank_like_this_one(gather)))
        yield


@contextmanager
def cpu_buffers() -> Iterator[None]:
    """`cpu_megatron`, and a pipeline stage's tied embedding built without its all-reduce to the other end (which
    moves it to 'cuda' first), for DistributedDataParallel's buffers (memcalc.probe.libs.megatron_ddp)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    with cpu_megatron(), patched(LanguageModule, _is_in_embd_group=lambda self: False):
        yield


# -- dropout and the causal mask ---------------------------------------------------

_cpu_dropout = F.dropout


def _cuda_like_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
    """at::dropout as on CUDA: native_dropout (bool mask) for 0 < p < 1 while training."""
    if training and 0 < p < 1 and input.numel() > 0:
        out, mask = torch.native_dropout(input, p, True)
        mask.view_as(mask)  # a no-op view of the mask, so that `Labels` can name it (rule: "view_as")
        return input.copy_(out) if inplace else out
    return _cpu_dropout(input, p, training, inplace)


def _causal_mask(sq: int) -> torch.Tensor:
    """megatron's get_default_causal_mask, built on the CPU rather than on "cuda"."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


# -- the fused causal softmax ---------------------------------------------------------


def _softmax_extension() -> types.ModuleType:
    """A stand-in for the CUDA extension: forward(inputs, scale), backward(grads, softmax, scale), each one op."""
    module = types.ModuleType(_SOFTMAX_EXTENSION)
    module.forward = lambda inputs, scale: fused_causal_softmax(inputs, float(scale))
    module.backward = lambda grads, softmax, scale: fused_causal_softmax_backward(grads, softmax, float(scale))
    return module


def _sizes() -> types.ModuleType:
    module = types.ModuleType(_SOFTMAX_SIZES)
    module.get_batch_per_block = _batch_per_block
    return module


def _batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """The CUDA extension's rule (Apex csrc/megatron/scaled_masked_softmax.h): 128 threads per block."""
    next_power_of_two = 1 << math.ceil(math.log2(sk))
    warp_size = min(next_power_of_two, 32)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    return (128 // warp_size) * batches_per_warp


# -- mixture of experts ---------------------------------------------------------------


def _cpu_dtoh(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize on the CPU: at its copy point the split sizes
    become numpy arrays, as the CUDA path's copies make them; no stream to wait for."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            sizes = getattr(self, name)
            if torch.is_tensor(sizes):
                setattr(self, name, sizes.numpy().copy())  # host memory, as CUDA's copies: the tensor goes
    return tokens_per_expert


def _every_rank_like_this_one(gather: Any) -> Any:
    """The dispatchers' all-gather, which on the fake group gathers this rank's tensor from every rank: it still runs
    (its collectives are issued, as a CollectiveLog counts them), only the values it leaves there are overwritten."""

    def gathered(input_: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> torch.Tensor:
        out = gather(input_, *args, group=group, **kwargs)
        if group is None or group.size() == 1 or dist.get_backend(group) != "fake":
            return out
        if out._base is not None:  # the all-gather dispatcher's tokens land in megatron's global buffer, a view:
            out = out.clone()  # autograd forbids writing into a custom Function's view (clone keeps nothing)
        with torch.no_grad():  # (ranks * n, ...): every rank's n rows alike, copied in place (a cat would allocate)
            out.view(group.size(), *input_.shape).copy_(input_.expand(group.size(), *input_.shape))
        return out

    return gathered


@contextmanager
def forced_routing(route: str, k: int, ep: int) -> Iterator[None]:
    """While inside, TopKRouter's logits lead on the experts `route` assigns over `ep` ranks (hf_shim.lead), so its k
    are known."""
    from megatron.core.transformer.moe.router import TopKRouter

    gating = TopKRouter.gating

    def led(self: Any, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (megatron's own parameter name)
        logits = gating(self, input)  # (s, b, E)
        return logits + lead(logits.view(-1, logits.shape[-1]), route, k, ep).view_as(logits)

    with patched(TopKRouter, gating=led):
        yield


def route_note(route: str) -> str:
    """The `shim:` line a forced route prints."""
    dealt = DEALT if route == "balanced" else ""
    return f"the router is forced ({route}): TopKRouter.gating's logits get {route_lead(route)}{dealt}; softmax and" \
        " top-k run as written"


# -- the RNG tracker ----------------------------------------------------------------


def _cpu_rng_tracker() -> Any:
    """megatron's CudaRNGStatesTracker over torch's CPU generator: its own named states, each added by megatron's own
    add (which refuses a name or a seed added twice) with torch.cuda's generator calls the CPU's, and forked on the
    CPU (megatron's fork would warn that the CPU's state changed inside it)."""
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        def add(self, name: str, seed: int) -> None:
            with patched(torch.cuda, get_rng_state=torch.get_rng_state, manual_seed=torch.manual_seed):
                super().add(name, seed)

        @contextmanager
        def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            outside = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outside)

    return CpuRNGStatesTracker()


def seed_rng_tracker(seed: int, tp_rank: int) -> None:
    """model_parallel_cuda_manual_seed's states, on the CPU: data-parallel and tensor-parallel seeds."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


# -- the norm -----------------------------------------------------------------------


class SequenceParallelNorm(nn.Module):
    """The local spec's norm, accepting SP: memcalc's probe norm (docs/probe.md, "What the table leaves out"), built as
    megatron builds a norm, plus the ledger `names` it labels with and `heads` (qk_layernorm's, per head of (s, b,
    heads, d)), both spec params; megatron's eps and the rest go unread (the bytes do not depend on them)."""

    def __init__(
        self, config: Any, hidden_size: int, names: NormTensors, heads: bool = False, **_: Any,
    ) -> None:
        super().__init__()
        kind = "rmsnorm" if config.normalization == "RMSNorm" else "layernorm"
        self.norm = Norm(kind, hidden_size, names, config.params_dtype, torch.device("cpu"), heads=heads,
                         sequence_parallel=config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        # a view (MLA's latents) keeps its whole base alive: report the base's shape (a QK norm's input: its maker's)
        if x._base is not None and not self.norm.heads:
            label(batch_first(x._base), self.norm.names.input)
        return y


def layer_spec(config: Any, index: int) -> Any:
    """The spec megatron's GPT decoder block gives its layer `index` (0-based) of config.num_layers, without
    Transformer Engine (`get_gpt_decoder_layer_specs`: a dense or a MoE layer as config.moe_layer_freq places
    them, SequentialMLP experts), its norms swapped for SequenceParallelNorm: with qk_layernorm the query's and key's
    norms over each head; with multi_latent_attention, MLASelfAttention's two latent norms (qk_layernorm, as
    DeepSeek's q_a/kv_a norms), and `MlaDotProductAttention` for the core."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=config.normalization)[index]
    spec.submodules.input_layernorm = ModuleSpec(module=SequenceParallelNorm, params={"names": ledger.LN1})
    spec.submodules.pre_mlp_layernorm = ModuleSpec(module=SequenceParallelNorm, params={"names": ledger.LN2})
    attention = spec.submodules.self_attention.submodules
    if config.multi_latent_attention:
        attention.q_layernorm = ModuleSpec(module=SequenceParallelNorm, params={"names": ledger.MLA_Q_NORM})
        attention.kv_layernorm = ModuleSpec(module=SequenceParallelNorm, params={"names": ledger.MLA_KV_NORM})
        attention.core_attention = mla_core_attention()
    elif config.qk_layernorm:
        for name, names in (("q_layernorm", ledger.Q_NORM), ("k_layernorm", ledger.K_NORM)):
            setattr(attention, name, ModuleSpec(module=SequenceParallelNorm, params={"names": names, "heads": True}))
    return spec


def mla_core_attention() -> type:
    """The local DotProductAttention, taking TE's k_channels/v_channels: its context is a*v_channels/t wide.

    The base Attention builds one without them first (MLA then builds its own): that one keeps kv_channels.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MlaDotProductAttention(DotProductAttention):
        def __init__(self, config: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MlaDotProductAttention
