"""Every place the probe changes what a library does, and why: one record each, each for one of the reasons in `Kind`
(docs/probe.md, "What the shims change": the rule, and the table `markdown` renders). `memcalc measure` prints each
record of the library it runs (`notes`), kind first, so that a device emulation is named where the measurement is shown.

Torch-free: the docs and the CLI read this table without importing any library. `patched` and `patched_items` are
the run-time patching the shim modules do it with (put back on exit).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator


class Kind(Enum):
    """Why a shim may change what a library does."""

    EMULATION = "device emulation"  # the CPU made to keep what CUDA keeps; memcalc counts CUDA's on every device
    STAND_IN = "CPU stand-in"  # a CUDA-only kernel replaced by the library's CPU alternative; counted per device
    RUNS = "runs on a CPU"  # CUDA-only plumbing made to run; keeps the same tensors
    MEASURES = "measurement"  # lets the recorder see or name a tensor, or fills the fake group's values
    BUILT = "built as the model builds it"  # the layer alone, as the library's whole model would make it
    KNOB = "knob"  # the path a knob selects; unset, the library's own default
    MODELLED = "the modelled path"  # the library's other path is not modelled (named, not hidden)


@dataclass(frozen=True)
class Shim:
    """One change to what a library does while the probe runs it."""

    library: str  # the --impl it applies to
    patched: str  # what is patched or set: a module attribute, a config field, a spec entry
    changes: str  # what it changes, in one line (printed by `memcalc measure`)
    why: str
    kind: Kind
    route: bool = False  # only under --route, which prints its own line (each runner's route_note)
    cuda_step: bool = False  # only where `measure --step --device cuda` runs the CPU as CUDA runs
    pp_step: bool = False  # only where `measure --step` runs a pipeline stage (pp > 1)
    zero_step: bool = False  # only where `measure --step` runs DeepSpeed's ZeRO engine (--zero-stage)
    tp_step: bool = False  # only where `measure --step` loads transformers' model over tp ranks (hf_tp.loaded)
    buffers: bool = False  # only where the probe builds megatron's DistributedDataParallel (megatron_ddp)

    def note(self) -> str:
        """The line `memcalc measure` prints under the table (after "shim: ")."""
        return f"{self.kind.value}: {self.changes}"


SHIMS: tuple[Shim, ...] = (
    # -- megatron-core 0.16.1 (memcalc.probe.libs.megatron_shim, megatron.py) --
    Shim("megatron", "torch.nn.functional.dropout",
         "dropout runs torch.native_dropout, keeping CUDA's 1-byte mask (CPU F.dropout keeps a mask in the"
         " activation dtype)",
         "CPU at::dropout takes its unfused path (noise in the activation dtype, scaled by 1/(1-p)); CUDA's"
         " native_dropout keeps a bool mask, which memcalc counts on every device", Kind.EMULATION),
    Shim("megatron", "sys.modules scaled_upper_triang_masked_softmax_cuda, scaled_masked_softmax_cuda",
         "the causal masked softmax runs a CPU twin of Apex's fused kernel (its bf16 output kept) where Megatron's"
         " size checks allow it (with masked_softmax_fusion); elsewhere Megatron's torch softmax runs (in fp32 with"
         " attention_softmax_in_fp32), as on CUDA",
         "Apex's kernel is CUDA-only; the knobs masked_softmax_fusion and attention_softmax_in_fp32 set megatron's"
         " TransformerConfig, at Megatron-LM's defaults",
         Kind.EMULATION),
    Shim("megatron", "spec: input_layernorm, pre_mlp_layernorm, q_layernorm, k_layernorm, kv_layernorm -> SequenceParallelNorm",
         "norms accept sequence parallelism as Apex's FusedLayerNorm does; RMSNorm keeps its input and rstd, as the"
         " fused CUDA kernel does (torch's CPU rms_norm keeps fp32 copies)",
         "the local spec's WrappedTorchNorm refuses SP; LayerNorm is torch's native_layer_norm, statistics counted"
         " per device", Kind.EMULATION),
    Shim("megatron", "get_gpt_decoder_layer_specs(use_transformer_engine=False)",
         "megatron-core's local spec runs (Transformer Engine's layers need CUDA)",
         "memcalc's megatron rules describe the local spec on every device; TE's fused layers are not modelled",
         Kind.MODELLED),
    Shim("megatron", "torch._dynamo.config.disable",
         "torch.compile (megatron's jit_fuser) runs eagerly",
         "the fused functions run inside autograd Functions under no_grad: compiling changes no saved tensor",
         Kind.RUNS),
    Shim("megatron", "torch.cuda.current_device, fused_softmax.get_default_causal_mask",
         "current_device() and the default causal mask use the CPU",
         "megatron's global memory buffer and causal mask are made on 'cuda'", Kind.RUNS),
    Shim("megatron", "tensor_parallel.random: _get_cuda_rng_state, _set_cuda_rng_state, _CUDA_RNG_STATE_TRACKER,"
         " _CUDA_RNG_STATE_TRACKER_INITIALIZED; torch.cuda.get_rng_state, torch.cuda.manual_seed (in its add)",
         "the CUDA RNG tracker's states are the CPU generator's (added by megatron's own add, checks and all)",
         "dropout inside get_cuda_rng_tracker().fork() and a checkpoint's RNG restore need a tracker", Kind.RUNS),
    Shim("megatron", "multi_latent_attention.HAVE_TE, core_attention -> MlaDotProductAttention",
         "latent attention runs the local DotProductAttention, taking MLA's k_channels/v_channels",
         "0.16.1 reads HAVE_TE True with TE's classes None, and only TE's core takes MLA's widths", Kind.RUNS),
    Shim("megatron", "moe_utils.te_general_gemm",
         "the MoE router's gating runs torch.mm",
         "0.16.1 reads Transformer Engine's te_general_gemm, undefined without TE; the same input and weight are"
         " saved either way", Kind.RUNS),
    Shim("megatron", "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, _maybe_dtoh_and_synchronize",
         "the all-to-all dispatcher's device-to-host copies of its split sizes run without a CUDA stream",
         "the dispatcher makes a CUDA stream for them", Kind.RUNS),
    Shim("megatron", "token_dispatcher.gather_from_sequence_parallel_region",
         "on the fake group every rank routes as rank 0",
         "nothing moves on torch's fake group: the gathered token counts would be uninitialised memory",
         Kind.MEASURES),
    Shim("megatron", "TopKRouter.gating (--route)",
         "--route: the router's logits lead on known experts; softmax and top-k run as written",
         "the tokens each expert receives, which the data decides, become known, so bytes can be exact",
         Kind.KNOB, route=True),
    Shim("megatron", "LanguageModule._is_in_embd_group (DistributedDataParallel's buffers)",
         "a pipeline stage's tied embedding is not all-reduced with the other end's at build",
         "it moves the weight to 'cuda' to copy values in place: the buffers' layout is the same", Kind.RUNS,
         buffers=True),
    # -- torchtitan 0.3.0 (memcalc.probe.libs.torchtitan_shim, torchtitan.py) --
    Shim("torchtitan", "sys.modules torchtitan.distributed.minimal_async_ep.kernels",
         "without triton, the EP dispatchers' triton kernels are stubbed (no block measured here calls them)",
         "torchtitan imports triton at import time; triton is GPU-only here", Kind.RUNS),
    Shim("torchtitan", "parallel_dims.device_type",
         "the DeviceMesh is built on the rank's device",
         "torchtitan falls back to 'cuda' on a machine without an accelerator", Kind.RUNS),
    Shim("torchtitan", "layers[0].attention.inner_attention = ScaledDotProductAttention.Config()",
         "attention is torchtitan's ScaledDotProductAttention, which keeps what compiled flex keeps (flex's positions"
         " and block mask aside)",
         "flex attention (torchtitan's default) has no CPU backward; compiled, it keeps what SDPA's flash kernel keeps",
         Kind.STAND_IN),
    Shim("torchtitan", "FlexAttention.compiled_flex_attn (--device cuda --step)",
         "flex attention's compiled kernel runs SDPA's CPU flash kernel, causal (the probe's positions are one"
         " document a row); the block mask is made and held as its trainer makes it",
         "torch.compile'd flex runs Triton kernels (no CPU backward); it saves q, k, v, out and the fp32"
         " log-sum-exp, as SDPA's flash kernel does (its row maxima are made and dropped inside)", Kind.STAND_IN,
         cuda_step=True),
    Shim("torchtitan", "decoder.create_attention_mask (--device cuda --step)",
         "the block mask is made as one op: torch's create_block_mask runs unseen, its tensors copied in",
         "torchtitan compiles create_block_mask, which then makes only its tensors; eagerly it makes (b, 1, s, s)-sized"
         " intermediates", Kind.EMULATION, cuda_step=True),
    Shim("torchtitan", "nn.RMSNorm forward (--device cuda --step)",
         "each norm runs as torch's CUDA _fused_rms_norm, one op each way, keeping its input and the fp32 rstd",
         "on a CPU rms_norm runs its composite, which keeps fp32 copies (derivatives.yaml: _fused_rms_norm keeps"
         " input and rstd)", Kind.EMULATION, cuda_step=True),
    Shim("torchtitan", "activation_checkpoint._get_default_save_ops",
         "op-level checkpointing also saves the CPU flash-attention kernel's outputs, as it saves CUDA's",
         "SelectiveAC's list has CUDA's attention ops only; on a CPU the attention would be recomputed",
         Kind.EMULATION),
    Shim("torchtitan", "TokenChoiceTopKRouter.gate (forward hooks: CPU autocast at fp32)",
         "the MoE gate runs under CPU autocast at fp32, as torch.autocast(float32) runs it on CUDA",
         "a CPU's autocast refuses fp32 (with a warning), leaving the router in bf16", Kind.EMULATION),
    Shim("torchtitan", "activation_checkpoint.create_selective_checkpoint_contexts",
         "the op outputs SelectiveAC caches are handed to the recorder",
         "torch.utils.checkpoint keeps them in a cache of its own, not as saved tensors", Kind.MEASURES),
    Shim("torchtitan", "AllToAllTokenDispatcher._token_count_exchange, torch.distributed.all_to_all",
         "on the fake group every rank routes as rank 0: the exchanged token counts are its own, and the uneven"
         " all-to-all zeroes what it receives",
         "nothing moves on torch's fake group: the counts and tokens an all-to-all received would be uninitialised"
         " memory (NaNs in the warm-up's weights, and so in the route)", Kind.MEASURES),
    Shim("torchtitan", "TokenChoiceTopKRouter.gate's logits (--route)",
         "--route: the gate's logits lead on known experts; scores, top-k and route_norm run as written",
         "the tokens each expert receives become known, so bytes can be exact", Kind.KNOB, route=True),
    Shim("torchtitan", "PipelineStage._warmup_forward_vote, _warmup_backward_result (--step with pp)",
         "each pipeline stage's warm-up vote is its own: static, as the probe gives every stage the shapes it receives"
         " and sends",
         "a receive on the fake group leaves its buffer as it was: the peers' votes would read 0, and every stage would"
         " infer shapes over P2P, whose received sizes are garbage", Kind.MEASURES, pp_step=True),
    Shim("torchtitan", "pipelining's _make_tensor_from_meta (--step with pp)",
         "each receive buffer is made zeroed, so what a stage is sent is zeros",
         "a receive on the fake group leaves its buffer as it was: garbage makes the weights NaN after the warm-up"
         " step, and a router's NaN logits route no token as forced (at ep > 1 the counts set the all-to-all's bytes)",
         Kind.MEASURES, pp_step=True),
    # -- transformers 5.24.0 (memcalc.probe.libs.hf_shim, hf.py) --
    Shim("hf", "torch.nn.functional.dropout",
         "dropout runs torch.native_dropout, keeping CUDA's 1-byte mask (CPU F.dropout keeps a mask in the"
         " activation dtype)",
         "as megatron's; SDPA's own dropout is not patched (the CPU's math kernel is counted under --device cpu)",
         Kind.EMULATION),
    Shim("hf", "config attn_implementation",
         "the attention implementation is --attention's: flash is sdpa, eager is eager",
         "a knob: unset, the family's own default (sdpa; eager where its class supports no other, as gpt-oss's)",
         Kind.KNOB),
    Shim("hf", "config experts_implementation",
         "MoE experts run --experts-implementation's path: grouped_mm or the eager loop",
         "a knob: unset, transformers' own default (grouped_mm)", Kind.KNOB),
    Shim("hf", "router forward, F.linear inside it (--route)",
         "--route: the router's logits lead on known experts; its softmax and top-k run as written",
         "the tokens each expert receives become known, so bytes can be exact", Kind.KNOB, route=True),
    Shim("hf", "_keep_in_fp32_modules_strict parameters, experts' and router's weights",
         "DeepSeek-V3's router weight and bias stay fp32, and the experts' and router's weights get the model's"
         " normal(0, initializer_range)",
         "the layer is built alone: as from_pretrained loads it and _init_weights fills it", Kind.BUILT),
    Shim("hf", "DtensorShardOperation.shard_tensor (tp step)",
         "under tp each rank's shard read from the checkpoint is copied out of the whole weight",
         "on a CPU a Shard(0) slice of the loaded weight stays a view of it (.to('cpu') copies nothing); CUDA's"
         " .to(device) copies the shard alone", Kind.EMULATION, tp_step=True),
    Shim("hf", "transformers.integrations.accelerate.is_accelerate_available (tp step)",
         "under tp from_pretrained's check that accelerate is installed passes",
         "with one device a rank from_pretrained(distributed_config=...) runs no accelerate code", Kind.RUNS,
         tp_step=True),
    # -- deepspeed 0.19.8 (memcalc.probe.libs.hf_shim, for hf_zero) --
    Shim("hf", "deepspeed.comm.torch.build_shm_op (--zero-stage)",
         "DeepSpeed's comm backend starts without its shared-memory all-reduce op, which its CPU accelerator would"
         " JIT-compile (a minute on a fresh machine)",
         "only inference_all_reduce calls the op: ZeRO's step never makes or holds its tensors", Kind.RUNS,
         zero_step=True),
)


def notes(library: str, cuda_step: bool = False, pp_step: bool = False, zero_step: bool = False,
          tp_step: bool = False) -> tuple[str, ...]:
    """The `shim:` lines `memcalc measure --impl <library>` prints, every change but the --route ones, which it
    prints with their route; with `cuda_step`, those `measure --step --device cuda` adds; with `pp_step`, those a
    pipeline stage's `measure --step` adds; with `zero_step`, those a ZeRO step's adds; with `tp_step`, those a
    step over tp ranks adds."""
    return tuple(s.note() for s in SHIMS if s.library == library and not s.route and s.cuda_step == cuda_step
                 and s.pp_step == pp_step and s.zero_step == zero_step and s.tp_step == tp_step and not s.buffers)


@contextmanager
def patched(owner: Any, create: bool = False, **values: Any) -> Iterator[None]:
    """While inside, `owner`'s attributes named in `values` hold them; on exit each is put back as the owner held it,
    or removed where the owner held none of its own (inherited from a class, or made here: only with `create`, so
    that a library's renamed attribute fails here rather than leaving the probe measuring unpatched code)."""
    missing = [name for name in values if not hasattr(owner, name)]
    if missing and not create:
        raise AttributeError(f"{owner!r} has no attribute {', '.join(missing)} to patch")
    with ExitStack() as undo:
        for name, value in values.items():
            own = name in vars(owner)
            before = vars(owner)[name] if own else None
            setattr(owner, name, value)  # first: an attribute that cannot be set fails with its own error
            undo.callback(*((setattr, owner, name, before) if own else (delattr, owner, name)))
        yield


@contextmanager
def patched_items(table: dict, **values: Any) -> Iterator[None]:
    """While inside, `table` holds `values` too (sys.modules: stand-in modules); on exit the table is as it was, so
    whatever was added to it inside (a module imported while the stand-ins were there) goes too."""
    before = dict(table)
    table.update(values)
    try:
        yield
    finally:
        table.clear()
        table.update(before)


def markdown() -> str:
    """docs/probe.md's table of every shim (tests/probe/test_shims.py keeps the page in step)."""
    rows = [
        "| library | shim | what it changes | why | kind |",
        "|---|---|---|---|---|",
        *(f"| {s.library} | `{s.patched}` | {s.changes} | {s.why} | {s.kind.value} |" for s in SHIMS),
    ]
    return "\n".join(rows)
