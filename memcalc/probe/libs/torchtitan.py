"""Run torchtitan's own Llama3 (or Qwen3) block under its own TP plan, and name what it keeps by the ledger.

The block, its TP plan and activation checkpointing, and how its tensors are named: docs/probe.md, "torchtitan's own
block".
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from itertools import chain
from typing import Any, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.evaluate import dim_sizes
from memcalc.model.impls import tensors_at
from memcalc.model.impls import torchtitan as rules
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.collectives import CollectiveLog, LoggedCollective
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.launch import world_of
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs import torchtitan_shim as shim
from memcalc.probe.libs.labels import Labels, ModuleFrames, Rule, head_columns, sdpa_inputs, statistics
from memcalc.probe.measure import INPUT_SEED
from memcalc.probe.recorder import HeldBy, SavedStorage, SavedTensorRecorder, label

torch = require_torch()
shim.stub_triton_kernels()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402  (after the install check above)
from torchtitan.distributed import activation_checkpoint  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.distributed.spmd_types import set_current_spmd_mesh, set_spmd_meshes  # noqa: E402
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models import llama3  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers  # noqa: E402
from torchtitan.models.llama3.sharding import set_llama3_sharding_config  # noqa: E402
from torchtitan.models.common.config_utils import make_ffn_config  # noqa: E402
from torchtitan.models.qwen3 import _build_qwen3_layers, _build_qwen3_moe_layers  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model  # noqa: E402
from torchtitan.models.qwen3.sharding import _GROUPED_EXPERTS_PARAM_LAYOUT, set_qwen3_sharding_config  # noqa: E402
from torchtitan.models.common.moe_sharding import set_moe_sharding_config  # noqa: E402
from torchtitan.models.deepseek_v3 import _build_dsv3_layers  # noqa: E402
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model  # noqa: E402
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config  # noqa: E402
from torchtitan.tools.utils import set_default_dtype  # noqa: E402

NOTES = shim.NOTES
route_note = shim.route_note  # measure prints it for --route
WEIGHT_SEED = 4321
SPMD_BACKEND = "spmd_types"  # torchtitan's default (ParallelismConfig.spmd_backend)
ROPE_THETA = 500000  # every Llama3 flavour's; the values do not change what is kept
QWEN3_ROPE_THETA = 1000000.0  # its flavours'
# DeepSeek-V3's flavours' RoPE (YaRN over a 4096-token original length) and attention scale; the values do not
# change what is kept
DSV3_ROPE = {"theta": 10000.0, "scaling": "yarn", "rope_factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_seq_len": 4096}
DSV3_MSCALE = 0.70


# -- building the block -----------------------------------------------------------


def block_config(config: ModelConfig, sequence_parallel: bool) -> Any:
    """torchtitan's Llama3 (qk_layernorm: Qwen3) block config at memcalc's sizes, with its TP plan filled in (with
    experts: its MoE layer)."""
    model = _decoder_config(config, sequence_parallel, layers=1, vocab_size=1)  # the two ends are built nowhere
    return moe_block_config(config, model.layers[0], sequence_parallel) if config.moe else model.layers[0]


def model_config(config: ModelConfig, sequence_parallel: bool, layers: int, vocab_size: int,
                 flex: bool = False) -> Any:
    """torchtitan's Llama3Model (qk_layernorm: Qwen3Model) config at memcalc's sizes (as its flavours build it, tied
    or not), TP plan filled in; with experts the layers `is_moe_layer` picks are its Qwen3 MoE decoder layers
    (`moe_block_config`). `flex`: its own attention, flex (CUDA's), which the shim runs on a CPU (flex_on_cpu); else
    the SDPA stand-in (flex has no CPU backward)."""
    model = _decoder_config(config, sequence_parallel, layers, vocab_size, flex)
    model.layers = [moe_block_config(config, block, sequence_parallel) if config.is_moe_layer(i) else block
                    for i, block in enumerate(model.layers)]
    return model


def _decoder_config(config: ModelConfig, sequence_parallel: bool, layers: int, vocab_size: int,
                    flex: bool = False) -> Any:
    """torchtitan's Llama3Model config, every block Llama3's, or with qk_layernorm its Qwen3Model's, every block
    Qwen3's dense one (heads of kv_channels, q_norm and k_norm, CosSinRoPE): its attention as `model_config` says,
    the ends Llama3's (their initialisation does not change what is kept), TP plan filled in."""
    qwen3, mla = config.qk_layernorm, config.mla
    blocks = _blocks(config, layers)
    for block in blocks if not flex else ():
        block.attention.inner_attention = ScaledDotProductAttention.Config()
    tied = config.tie_embeddings  # as its 1B and 3B flavours: the table is lm_head's weight, initialised as lm_head's
    model = (DeepSeekV3Model if mla else Qwen3Model if qwen3 else Llama3Model).Config(
        dim=config.h, vocab_size=vocab_size, layers=blocks, enable_weight_tying=tied,
        norm=RMSNorm.Config(normalized_shape=config.h, param_init=llama3._NORM_INIT),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=config.h,
                                        param_init=llama3._EMBEDDING_SKIP_INIT if tied else llama3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=config.h, out_features=vocab_size,
                              param_init=llama3._output_linear_init(config.h)),
    )
    if mla:
        set_deepseek_v3_sharding_config(model, enable_sp=sequence_parallel, enable_ep=config.ep > 1)
    elif qwen3:
        set_qwen3_sharding_config(model, enable_sp=sequence_parallel, enable_ep=config.ep > 1)
    else:
        set_llama3_sharding_config(model, enable_sp=sequence_parallel)
    return model


def _blocks(config: ModelConfig, layers: int) -> list[Any]:
    """`layers` dense block configs from torchtitan's own builder: Llama3's (ComplexRoPE), or with qk_layernorm
    Qwen3's (heads of kv_channels, q_norm and k_norm, CosSinRoPE)."""
    if config.mla:
        return _dsv3_blocks(config, layers)
    sizes = {"n_layers": layers, "dim": config.h, "n_heads": config.a, "n_kv_heads": config.groups,
             "hidden_dim": config.ffn, "fuse_qkv": True, "attn_backend": "flex"}
    if config.qk_layernorm:
        rope = CosSinRoPE.Config(dim=config.head_dim, max_seq_len=config.s, theta=QWEN3_ROPE_THETA)
        return _build_qwen3_layers(**sizes, head_dim=config.head_dim, rope=rope)
    rope = ComplexRoPE.Config(dim=config.head_dim, max_seq_len=config.s, theta=ROPE_THETA, scaling="llama")
    return _build_llama3_layers(**sizes, rope=rope)


def _dsv3_blocks(config: ModelConfig, layers: int) -> list[Any]:
    """`layers` DeepSeek-V3 blocks from torchtitan's own builder, every one dense (its MoE, where the knobs ask for
    one, is `moe_block_config`'s): its latent attention (wq, or with a query latent wq_a, q_norm and wq_b; wkv_a,
    kv_norm, wkv_b, ComplexRoPE on each head's d_r-wide RoPE part, wo), a FeedForward of ffn. Its attention's
    stand-ins on a CPU are SDPA's flash kernel, which refuses values narrower or wider than the heads."""
    if config.v_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim:
        raise ConfigError(f"measure, impl torchtitan: v_head_dim {config.v_head_dim} is not qk_nope_head_dim +"
                          f" qk_rope_head_dim = {config.qk_nope_head_dim + config.qk_rope_head_dim}: flex attention has"
                          " no CPU backward, and SDPA's CPU flash kernel, its stand-in (which keeps what compiled flex"
                          " keeps), needs one head width for q, k and v; pick v_head_dim equal to it")
    rope = ComplexRoPE.Config(dim=config.qk_rope_head_dim, max_seq_len=config.s, **DSV3_ROPE)
    return _build_dsv3_layers(
        n_layers=layers, n_dense_layers=layers, dim=config.h, n_heads=config.a, q_lora_rank=config.q_lora_rank or 0,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, mscale=DSV3_MSCALE,
        dense_hidden_dim=config.ffn, moe_hidden_dim=config.ffn, num_experts=1, num_shared_experts=0, router_top_k=1,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=rope,
    )


def moe_block_config(config: ModelConfig, dense_block: Any, sequence_parallel: bool) -> Any:
    """torchtitan's Qwen3 MoE decoder layer from its own builder (its MoE: the "standard" dispatcher, local at EP=1,
    and GroupedExperts), with `dense_block`'s attention and norms (Llama3's, or with qk_layernorm Qwen3's own); with
    kv_lora_rank DeepSeek-V3's own block, that MoE in its FeedForward's place. The knobs pick the router and the
    shared experts, a FeedForward initialised as `dense_block`'s."""
    layer = _build_qwen3_moe_layers(
        n_layers=1, dim=config.h, n_heads=config.a, n_kv_heads=config.groups, head_dim=config.head_dim,
        moe_hidden_dim=config.expert_ffn, num_experts=config.num_experts, top_k=config.moe_router_topk,
        attn_backend="flex", moe_comm_backend="standard", rope=dense_block.attention.rope,
    )[0]
    layer.attention, layer.attention_norm = dense_block.attention, dense_block.attention_norm
    layer.ffn_norm = dense_block.ffn_norm
    layer.moe.router.score_func = str(config.moe_router_score_function)
    layer.moe.router.route_norm = not config.moe_router_pre_softmax
    if config.moe_shared_expert_intermediate_size:
        ffn = dense_block.feed_forward
        layer.moe.shared_experts = make_ffn_config(
            dim=config.h, hidden_dim=config.moe_shared_expert_intermediate_size,
            w1_param_init=ffn.w1.param_init, w2w3_param_init=ffn.w2.param_init,
        )
    set_moe_sharding_config(layer.moe, enable_ep=config.ep > 1, enable_sp=sequence_parallel,
                            expert_param_layout=_GROUPED_EXPERTS_PARAM_LAYOUT)
    if config.mla:
        return replace(dense_block, feed_forward=None, moe=layer.moe)
    return layer


def build_block(config: ModelConfig, tp: TensorParallelGroup, strategy: Strategy, dims: ParallelDims | None) -> Any:
    """The block laid out by its plan, then initialised as torchtitan's trainer does it, in the activation dtype
    (docs/probe.md); the RoPE table stays as its RoPE computes it, Llama3's complex64 (`Module.to(bf16)` would
    discard its imaginary part), Qwen3's cos and sin in fp32."""
    with torch.device(tp.device), set_default_dtype(DTYPES[config.dtype]):
        block = block_config(config, strategy.sequence_parallel).build()
        if dims is not None:
            block.parallelize(dims)
        torch.manual_seed(WEIGHT_SEED)  # every rank draws the same full weights and keeps its shard of them
        block.init_states()
    policy = ac_config(config)
    return block if policy is None else policy.build()._wrap_block(block)


def ac_config(config: ModelConfig) -> Any:
    """torchtitan's activation checkpointing config object for `recompute` (its trainer's activation_checkpoint):
    full, FullAC's; op, SelectiveAC's; none, None."""
    policies = {"full": activation_checkpoint.FullAC.Config, "op": activation_checkpoint.SelectiveAC.Config,
                "none": lambda: None}
    return policies[config.recompute]()


@contextmanager
def tensor_parallel(group: TensorParallelGroup, ep: int = 1, pp: int = 1,
                    dp_shard: int = 1) -> Iterator[ParallelDims | None]:
    """torchtitan's TP runtime over the probe's group (the whole world: `pp` pipeline ranks, each of a TP group of
    the rest, as torchtitan's pp x tp mesh lays them out), its experts over `ep` of its ranks (the TP ranks, as
    torchtitan borrows them; with `dp_shard` > 1 the FSDP2 ranks of a world of dp_shard x the group, `world_of`), its
    collectives' deprecation warnings and the CPU's refusal of the MoE router's autocast(float32) (the shim runs it)
    silenced: None where the group is the pipeline's alone (t = 1) without dp_shard, which has no plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", DEPRECATED_COLLECTIVES, FutureWarning)
        warnings.filterwarnings("ignore", CPU_AUTOCAST_FP32, UserWarning)
        if group.size == pp and dp_shard == 1:
            yield None
            return
        dist_utils.set_spmd_backend(SPMD_BACKEND)
        with world_of(group.size * dp_shard, group):
            dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=group.size // pp, pp=pp, ep=ep,
                                world_size=group.size * dp_shard, spmd_backend=SPMD_BACKEND)
            with shim.mesh_device(group.device.type):
                dims.build_mesh()
            set_spmd_meshes(dense_mesh=dims.spmd_dense_mesh(), sparse_mesh=dims.spmd_sparse_mesh())
            try:
                with set_current_spmd_mesh(dims.spmd_dense_mesh()), shim.every_rank_routes_alike():
                    yield dims
            finally:
                set_spmd_meshes(dense_mesh=None, sparse_mesh=None)


def fake_world(config: ModelConfig, t: int) -> str | None:
    """The ranks `world_of` makes beyond the launch's, in words for measure's "ran as" line: dp_shard of them with
    experts over the FSDP2 ranks at t = 1 (None elsewhere)."""
    if config.num_experts is None or config.ep == 1 or config.dp_shard is None:
        return None
    return f"dp_shard={config.dp_shard} ranks (FSDP2's, expert parallel ep={config.ep} over them, t=1)"


def block_input(config: ModelConfig, tp: TensorParallelGroup, strategy: Strategy) -> torch.Tensor:
    """The probe's input, batch-first (b, s, h) as torchtitan takes it, or under SP this rank's s/t block.

    Copied into a storage of its own, as a real SP rank's input owns only its shard: `.contiguous()`
    would return the slice itself at b = 1 (a block of rows of (s, 1, h) is already contiguous) and
    the shard would keep the whole sequence's storage alive.
    """
    generator = torch.Generator().manual_seed(INPUT_SEED)
    full = torch.randn(config.s, config.b, config.h, generator=generator).to(DTYPES[config.dtype]).transpose(0, 1)
    x = tp.block(full, 1, "s") if strategy.sequence_parallel else full
    return x.clone(memory_format=torch.contiguous_format).to(tp.device).requires_grad_()


# -- naming what it keeps -----------------------------------------------------------


HEAD_NORMS = (("*attention.q_norm", rules.Q_NORM), ("*attention.k_norm", rules.K_NORM))  # Qwen3's, on each head
LATENT_NORMS = (("*attention.q_norm", rules.MLA_Q_NORM), ("*attention.kv_norm", rules.MLA_KV_NORM))  # DeepSeek-V3's


def library_rules(config: ModelConfig, t: int) -> tuple[Rule, ...]:
    """What torchtitan's Python passes to torch, named: the module it runs in, the call, the argument.

    Under a checkpoint the block's input is kept and nothing inside the block but
    SelectiveAC's op outputs; without one, the input is not kept (the norm keeps
    its fp32 upcast), except in fp32, where the upcast is the input itself. V is
    named as the rules predict it at these sizes on t ranks (a view at b = s = 1).
    DeepSeek-V3's latent attention is `latent_rules`' (under SelectiveAC `latent_outputs`').
    """
    d = config.head_dim
    predicted = tensors_at(Knobs.of(config), Accounting(exact=True), dim_sizes(config), t)
    q, k, v = sdpa_inputs("*attention.inner_attention")
    views = rules.V_IN_QKV_OUT in predicted  # V, and Qwen3's q and k, are views of wqkv's output
    if views:  # the view's base: wqkv's output, (b, s, (a+2g) d)
        v = replace(v, tensor=rules.V_IN_QKV_OUT, view=lambda x: head_columns(d)(x._base))
    # Qwen3's q_norm and k_norm: in fp32 their input is kept (as LN1's), unless it is a view of wqkv's output (V's)
    head_norms = [Rule(module, "rms_norm", norm.input_fp32, arg=0) for module, norm in HEAD_NORMS
                  if config.dtype == "fp32" and not views]
    proj_in, width = (ledger.MLA_PROJ_IN, config.v_head_dim) if config.mla else (ledger.PROJ_IN, d)
    wo = Rule("*attention.wo", "linear", proj_in, arg=0, view=head_columns(width))  # the attention kernel's output
    attention = (*latent_rules(config), wo) if config.mla else (
        *head_norms, Rule("*attention.qkv_linear.wqkv", "linear", rules.QKV_IN, arg=0), q, k, v, wo)
    gate = Rule("*feed_forward", "silu", ledger.SWIGLU_GATE, arg=0)  # w1's output
    if config.recompute != "none":  # of the MoE's: topk's second output (gather's index), the shared experts' w1, w3
        moe = (r for r in moe_rules() if r.tensor in (ledger.ROUTER_TOPK_INDICES, ledger.SHARED_GATE, ledger.SHARED_UP))
        return (
            Rule("", "forward", ledger.LAYER_INPUT, arg=0),
            Rule("*attention.qkv_linear.wqkv", "linear", rules.QKV_OUT, view=head_columns(d)), *latent_outputs(config),
            wo, Rule("*attention.wo", "linear", rules.WO_OUT), gate,
            Rule("*feed_forward", "mul", ledger.SWIGLU_UP, arg=1), Rule("*feed_forward.w2", "linear", rules.FC2_OUT),
            Rule("*moe.router", "topk", rules.MOE_TOPK_VALUES), *moe,
            Rule("*moe.shared_experts.w2", "linear", rules.SHARED_FC2_OUT),
        )
    return (
        Rule("*attention_norm", "rms_norm", rules.LN1.input_fp32, arg=0),  # fp32 only: bf16 is upcast (AtenLabels)
        Rule("*ffn_norm", "rms_norm", rules.LN2.input_fp32, arg=0),
        *attention,
        Rule("*feed_forward.w1", "linear", rules.FC1_IN, arg=0), gate,
        Rule("*feed_forward", "mul", ledger.SWIGLU_SILU_OUT, arg=0),
        Rule("*feed_forward", "mul", ledger.SWIGLU_UP, arg=1),
        Rule("*feed_forward.w2", "linear", ledger.FC2_IN, arg=0),
        *moe_rules(),
    )


def latent_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """DeepSeek-V3's Attention: x as wkv_a (and wq or wq_a) reads it, the up projections' inputs, Q and K as SDPA
    gets them (torch.cat's copies), V's base (wkv_b's whole output, its heads of d_n + d_v); the latents' norms are
    aten's (`aten_rules`)."""
    q, k, v = sdpa_inputs("*attention.inner_attention")
    up_out = head_columns(config.qk_nope_head_dim + config.v_head_dim)
    return (
        Rule("*attention.wkv_a", "linear", rules.MLA_IN, arg=0),
        Rule("*attention.wq_b", "linear", rules.MLA_Q_UP_IN, arg=0),
        Rule("*attention.wkv_b", "linear", rules.MLA_KV_UP_IN, arg=0),
        replace(q, tensor=ledger.MLA_Q), replace(k, tensor=ledger.MLA_K),
        replace(v, tensor=ledger.MLA_KV_UP_OUT, view=lambda x: up_out(x._base)),
    )


def latent_outputs(config: ModelConfig) -> tuple[Rule, ...]:
    """DeepSeek-V3's Attention's matmul outputs, of which SelectiveAC saves every other: wq's or wq_a's, wkv_a's,
    wkv_b's (its heads of d_n + d_v); none without kv_lora_rank."""
    if not config.mla:
        return ()
    return (
        Rule("*attention.wq", "linear", rules.MLA_WQ_OUT,
             view=head_columns(config.qk_nope_head_dim + config.qk_rope_head_dim)),
        Rule("*attention.wq_a", "linear", rules.MLA_WQ_A_OUT),
        Rule("*attention.wkv_a", "linear", rules.MLA_WKV_A_OUT),
        Rule("*attention.wkv_b", "linear", rules.MLA_WKV_B_OUT,
             view=head_columns(config.qk_nope_head_dim + config.v_head_dim)),
    )


def moe_rules() -> tuple[Rule, ...]:
    """The MoE block's tensors, named in torchtitan's code (the gate's fp32 casts are aten's: `aten_rules`).

    The dispatcher is no module: its calls run in `routed_experts`' frame, where the first indexing sorts the
    scores and the first product is combine's.
    """
    router, routed, experts, shared = "*moe.router", "*moe.routed_experts", "*inner_experts", "*moe.shared_experts"
    return (
        Rule(router, "softmax", rules.MOE_ROUTER_SCORES),
        Rule(router, "sigmoid", rules.MOE_ROUTER_SCORES),
        Rule(router, "gather", ledger.ROUTER_TOPK_INDICES, arg="index"),
        Rule(router, "div", rules.MOE_TOPK_SCORES, arg=0),
        Rule(router, "div", rules.MOE_TOPK_SUM, arg=1, view=statistics),
        Rule(routed, "argsort", rules.MOE_SORTED_SLOTS),
        Rule(routed, "__getitem__", rules.MOE_SORTED_SCORES),
        Rule(routed, "__floordiv__", rules.MOE_TOKEN_INDICES),
        Rule(routed, "mul", rules.MOE_EXPERT_OUT, arg=0),  # combine's upcast times the score
        Rule(routed, "sub", rules.MOE_PERMUTED_INDICES, nth=2),  # EP's _permute: its third subtraction
        Rule(experts, "forward", ledger.EXPERT_IN, arg=0),
        Rule(experts, "cumsum", rules.MOE_OFFSETS),
        Rule(experts, "silu", ledger.EXPERT_GATE, arg=0),
        Rule(experts, "silu", ledger.EXPERT_SILU_OUT),
        Rule(experts, "mul", ledger.EXPERT_UP, arg=1),
        Rule(experts, "mul", ledger.EXPERT_FC2_IN),
        Rule(f"{shared}.w1", "linear", rules.MOE_SHARED_IN, arg=0),
        Rule(shared, "silu", ledger.SHARED_GATE, arg=0),
        Rule(shared, "mul", ledger.SHARED_SILU_OUT, arg=0),
        Rule(shared, "mul", ledger.SHARED_UP, arg=1),
        Rule(f"{shared}.w2", "linear", ledger.SHARED_FC2_IN, arg=0),
    )


_LSE_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_cudnn_attention")


def aten_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """The norms' tensors (CPU composite, or CUDA's _fused_rms_norm; Qwen3's q_norm and k_norm, or DeepSeek-V3's on
    its latents, too), the attention kernel's log-sum-exp, and the MoE gate's fp32 copies of its weight and input
    (autocast's)."""
    norms = []
    inner = LATENT_NORMS if config.mla else HEAD_NORMS
    for module, norm in (("*attention_norm", rules.LN1), ("*ffn_norm", rules.LN2), *inner):
        norms += [
            Rule(module, "_to_copy", norm.input_fp32),  # input.to(float32); the last _to_copy casts back
            Rule(module, "rsqrt", norm.rstd, view=statistics),
            Rule(module, "mul", norm.normed_fp32),  # x * rstd; the second mul is by the weight
            Rule(module, "_fused_rms_norm", norm.input, arg=0),
            Rule(module, "_fused_rms_norm", norm.rstd, output=1, view=statistics),
        ]
    lse = [Rule("*attention.inner_attention", op, ledger.SOFTMAX_LSE, output=1) for op in _LSE_OPS]
    gate = [Rule("*moe.router.gate", "_to_copy", rules.MOE_ROUTER_WEIGHT),  # autocast casts the weight first
            Rule("*moe.router.gate", "_to_copy", rules.MOE_ROUTER_IN, nth=1)]
    return (*norms, *lse, *gate)


class AtenLabels(ModuleFrames, TorchDispatchMode):
    """Context manager: label tensors that aten ops make inside `root`'s modules (made inside a C++ composite), by
    rules whose function is the aten op's name without overload ("_to_copy", "rsqrt", "_fused_rms_norm")."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        return self._called(func.overloadpacket.__name__, args, kwargs, func(*args, **kwargs))


# -- the runner ---------------------------------------------------------------------

# spmd_types (torchtitan's TP backend) still calls these; torch 2.13 warns on every call.
# The MoE router's torch.autocast(float32), which the shim runs at fp32 on the CPU anyway (route_gates).
CPU_AUTOCAST_FP32 = "In CPU autocast, but the target dtype is not supported"
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def run_layer(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None,
    collectives: list[LoggedCollective] | None = None,
) -> tuple[SavedStorage, ...]:
    """torchtitan's block on this rank: one recorded forward (named by the ledger), then backward once; `route`
    forces a MoE router (memcalc.probe.ROUTES); `collectives` gets every collective forward and backward issue."""
    with ExitStack() as stack:
        dims = stack.enter_context(tensor_parallel(tp, config.ep, dp_shard=config.dp_shard or 1))
        stack.enter_context(shim.cuda_like_op_checkpointing())
        caches = stack.enter_context(shim.op_checkpoint_caches())
        block = build_block(config, tp, strategy, dims)
        x = block_input(config, tp, strategy)
        shim.route_gates(block, route, config.moe_router_topk, config.ep)
        state = chain(block.parameters(), block.buffers())  # buffers: the RoPE table is state, like a weight
        log = stack.enter_context(CollectiveLog())
        with SavedTensorRecorder(state) as recorder:
            with Labels(block, library_rules(config, tp.size)), AtenLabels(block, aten_rules(config)):
                y = block(x, None, None)
            cached = shim.cached_tensors(caches)  # the op outputs SelectiveAC keeps until backward's recompute
            if cached:
                HeldBy.apply(torch.zeros(0, requires_grad=True), *cached)
        log.backward(y, collectives)
    return recorder.saved
