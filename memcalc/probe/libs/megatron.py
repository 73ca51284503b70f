"""megatron-core's own layer on one tensor-parallel rank, recorded under ledger names.

How the layer is built and run, which training arguments decide its kernels, and how shared storages and experts
are reported: docs/probe.md, "megatron-core's own layer".
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model import ledger
from memcalc.model.evaluate import dim_sizes
from memcalc.model.impls import megatron as rules
from memcalc.model.ledger import Kind, Region, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.collectives import CollectiveLog, LoggedCollective
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.launch import world_of
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs.labels import Labels, Part, Rule, merged_rows, split_rows
from memcalc.probe.libs.megatron_shim import NOTES as SHIM_NOTES
from memcalc.probe.libs.megatron_shim import cpu_megatron, forced_routing, layer_spec, seed_rng_tracker
from memcalc.probe.libs.megatron_shim import route_note as route_note  # measure prints it for --route
from memcalc.probe.measure import INPUT_SEED, _layer_input
from memcalc.probe.recorder import SavedStorage, SavedTensorRecorder, batch_first

torch = require_torch()
from torch.nn import functional as F  # noqa: E402

WEIGHT_SEED = 5678  # the same full weights on every rank; megatron cuts each rank's block from them

NOTES: tuple[str, ...] = (
    *SHIM_NOTES,
    "not counted: 1-element tensors megatron keeps in host memory on CUDA (fused softmax scale, attn_mask_type)",
    "not counted under full recompute: bias-dropout-add's masks, freed when megatron's checkpoint returns",
)

# Markers for storages that hold several ledger tensors; never reported under these names.
_QKV_OUT = SavedTensor("attention/qkv_out", "linear_qkv", (), Kind.ACTIVATION, Region.TENSOR, "split into q, k, v")
_HOST = SavedTensor("host/scalar", "torch.tensor([...])", (), Kind.FP32, Region.TENSOR, "host memory, not on the GPU")
_FREED = SavedTensor("layer/freed_mask", "bias-dropout-add", (), Kind.MASK, Region.SEQUENCE, "freed after forward")
# An MLP's fc1 output under SwiGLU (the dense one's, an expert's, the shared experts'): gate and up side by side.
_FC1_OUT = SavedTensor("mlp/fc1_out", "linear_fc1", (), Kind.ACTIVATION, Region.TENSOR, "split into gate, up")
_EXPERT_FC1_OUT = SavedTensor("moe/expert_fc1_out", "linear_fc1", (), Kind.ACTIVATION, Region.EXPERT, "gate, up")
_SHARED_FC1_OUT = SavedTensor("moe/shared_fc1_out", "linear_fc1", (), Kind.ACTIVATION, Region.TENSOR, "gate, up")
_HALVES = {out.name: keeps[1:3] for out, keeps in (  # gate, up
    (_FC1_OUT, rules.DENSE_ACT), (_EXPERT_FC1_OUT, rules.EXPERT_ACT), (_SHARED_FC1_OUT, rules.SHARED_ACT))}


def run_layer(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, route: str | None = None, dense: bool = False,
    collectives: list[LoggedCollective] | None = None,
) -> tuple[SavedStorage, ...]:
    """Build megatron's layer for this rank, record one forward under labels, run backward once; what it saved.

    `route` forces a MoE router's assignment (megatron_shim.forced_routing). A MoE model's layer is its first
    MoE layer as megatron's decoder block spec places them; `dense`: its first dense layer (`layer_index`).
    `collectives`: a list that gets every collective forward and backward issue (memcalc.probe.collectives). A MoE
    layer counts only what a live node still holds (kept_only): the aux loss's top-k saves indices for values nobody
    reads, freed as the router returns."""
    _check(config, tp)
    layer = config.dense if dense else config  # the knobs the built layer has: a mix's dense layer, no experts
    # megatron-core refuses sequence parallelism without tensor parallelism; at t = 1 it splits nothing anyway
    sequence_parallel = strategy.sequence_parallel and tp.size > 1
    with inside_megatron(tp, config, route):
        torch.manual_seed(WEIGHT_SEED)
        root = _build(config, tp, sequence_parallel, dense)
        seed_rng_tracker(INPUT_SEED, tp.rank)
        x = _layer_input(config, tp, sequence_parallel)
        recorder = SavedTensorRecorder(root.parameters(), kept_only=config.moe)
        from megatron.core.tensor_parallel import layers, mappings

        # megatron's mappings and linears bind all_gather_into_tensor and reduce_scatter_tensor as they are imported
        with CollectiveLog(aliases=(mappings, layers)) as log:
            with recorder, Labels(root, label_rules(layer, tp.size)):
                y = root(hidden_states=x, attention_mask=None)
            y = y[0] if isinstance(y, tuple) else y  # a block returns its output alone
            log.backward(y, collectives)
    return merged_rows(_attributed(recorder.saved, layer, tp.size), rules.IMPLEMENTATION)


@contextmanager
def inside_megatron(tp: TensorParallelGroup, config: ModelConfig, route: str | None) -> Iterator[None]:
    """megatron's CPU shim, its parallel_state on the probe's group and the forced route (none: the real router), for
    building and running its layer, or building and stepping the GPT (memcalc.probe.libs.megatron_step)."""
    with warnings.catch_warnings():
        _quiet()  # before the shim imports megatron, which warns as it is imported
        # megatron's torch softmax (latent attention) calls a torch.nn.Softmax made in forward, gone by backward:
        # MemTracker's module hooks find it dead and say so (what it measures is unchanged)
        warnings.filterwarnings("ignore", "Module is None", UserWarning)
        routing = forced_routing(route, config.moe_router_topk, config.ep) if route else nullcontext()
        with cpu_megatron(), _model_parallel(tp, config.ep), routing:
            yield


def _quiet() -> None:
    """Megatron warns that Apex and Transformer Engine are missing (and more), torch that c10d names are deprecated."""
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _check(config: ModelConfig, tp: TensorParallelGroup) -> None:
    """ProbeError for what megatron's local layer cannot run here (each its own line): experts with biases; ep > 1
    outside a fake group of t*ep ranks, which only the fake and single launches can make (MoELayer's refusal of TP
    without SP is the implementation's: `plan` refuses tp first); flash attention."""
    check_expert_biases(config)
    if config.moe and config.ep > 1 and tp.mode not in ("single", "fake"):
        raise ProbeError(f"ep={config.ep} runs as rank 0 of t*ep={tp.size * config.ep} ranks in torch's fake"
                         f" group only; measure with --launch fake (not {tp.mode})")
    if config.attention == "flash":
        raise ProbeError(
            "impl megatron: the local spec's core attention is DotProductAttention (eager); flash attention"
            " is Transformer Engine's, which needs CUDA; measure with --attention eager"
        )


def check_expert_biases(config: ModelConfig) -> None:
    """MoELayer's experts cannot train with biases here, in the layer probe and the step alike."""
    if config.moe and config.add_bias_linear:
        raise ProbeError("impl megatron: megatron-core's MoE has no biases with expert tensor parallelism or"
                         " shared experts, and without them its expert adds fc2's bias in place to the output of a"
                         " one-rank reduce (a view autograd refuses); set add_bias_linear: false in the config")


def fake_world(config: ModelConfig, t: int) -> str | None:
    """The ranks `_model_parallel` makes in torch's fake group beyond the launch's, in words for measure's "ran as"
    line: t*ep of them with expert parallelism (None without)."""
    if config.num_experts is None or config.ep == 1:
        return None
    return (f"t*ep={t}*{config.ep}={t * config.ep} ranks (tensor parallel t={t}, expert parallel ep={config.ep},"
            f" expert tensor parallel t)")


@contextmanager
def _model_parallel(tp: TensorParallelGroup, ep: int = 1) -> Iterator[None]:
    """megatron's parallel_state over the probe's group (tensor parallel t, expert parallel ep, expert tensor
    parallel t); a fake group of t*ep ranks where the probe has none, or a fake one of t while ep > 1."""
    from megatron.core import parallel_state

    with world_of(tp.size * ep, tp):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp.size, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp.size,
            create_gloo_process_groups=False,
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


# -- the layer --------------------------------------------------------------------


def transformer_config(config: ModelConfig, t: int, sequence_parallel: bool) -> Any:
    """megatron's TransformerConfig (MLATransformerConfig with kv_lora_rank) for memcalc's config on t ranks."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    recompute = {"none": {}, "selective": {"recompute_granularity": "selective"}}.get(
        config.recompute, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    )
    return (MLATransformerConfig if config.mla else TransformerConfig)(
        **_heads(config), num_layers=config.L if config.moe else 1, hidden_size=config.h,
        num_attention_heads=config.a, num_query_groups=config.groups, ffn_hidden_size=config.ffn,
        gated_linear_unit=config.mlp == "swiglu", activation_func=_activation(config),
        normalization="RMSNorm" if config.norm == "rmsnorm" else "LayerNorm",
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        hidden_dropout=config.dropout, attention_dropout=config.dropout,
        bias_activation_fusion=config.bias_activation_fusion, masked_softmax_fusion=config.masked_softmax_fusion,
        attention_softmax_in_fp32=config.attention_softmax_in_fp32,
        tensor_model_parallel_size=t, sequence_parallel=sequence_parallel,
        params_dtype=DTYPES[config.dtype], bf16=config.dtype == "bf16", fp16=config.dtype == "fp16",
        use_cpu_initialization=True, **recompute, **_experts(config, t),
    )


def _experts(config: ModelConfig, t: int) -> dict[str, Any]:
    """TransformerConfig's MoE fields: the knobs' dispatcher, experts over ep ranks and etp = t; an aux loss
    coefficient of 1e-2 (Megatron-LM's suggested start) when moe_aux_loss is on, else 0 (its default); the MoE
    layers of the L (num_layers) placed as memcalc places them (`moe_layer_pattern`)."""
    if not config.moe:
        return {}
    return dict(
        num_moe_experts=config.num_experts, moe_layer_freq=moe_layer_pattern(config),
        moe_router_topk=config.moe_router_topk, moe_ffn_hidden_size=config.expert_ffn,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_expert_capacity_factor=config.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=config.moe_pad_expert_input_to_capacity,
        moe_router_pre_softmax=config.moe_router_pre_softmax,
        moe_router_score_function=str(config.moe_router_score_function),
        moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
        moe_aux_loss_coeff=1e-2 if config.moe_aux_loss else 0.0,
        moe_token_dispatcher_type=str(config.moe_token_dispatcher_type),
        expert_model_parallel_size=config.ep, expert_tensor_parallel_size=t,
    )


def moe_layer_pattern(config: ModelConfig) -> int | list[int]:
    """memcalc's MoE layers as Megatron-LM's --moe-layer-freq says them: the int freq (layer i is MoE when
    i % freq == 0), or with first dense layers the list of 0 (dense) and 1 (MoE) per layer, as Megatron-LM's
    DeepSeek recipes write `([0]*k+[1]*(L-k))`."""
    if not config.moe_first_dense_layers:
        return config.moe_layer_freq
    return [int(config.is_moe_layer(i)) for i in range(config.L)]


def layer_index(config: ModelConfig, dense: bool = False) -> int:
    """The layer the probe builds (0-based): a MoE model's first MoE layer, or with `dense` its first dense one
    (ProbeError if every layer is MoE), as `moe_layer_pattern` tells megatron to place them."""
    if not config.moe:
        return 0
    pattern = [int(config.is_moe_layer(i)) for i in range(config.L)]  # as moe_layer_pattern places them
    if (0 if dense else 1) not in pattern:
        raise ProbeError(f"impl megatron: every one of the L={config.L} layers is a MoE layer (moe_layer_freq 1, no"
                         " first dense layers): there is no dense layer to measure")
    return pattern.index(0 if dense else 1)


def built_layer(config: ModelConfig) -> str | None:
    """Which of a dense + MoE mix's L layers `run_layer` builds (its first MoE layer), in words for measure's
    "ran as" line; None where every layer is alike."""
    if not config.moe or config.moe_layers == config.L:
        return None
    pattern = moe_layer_pattern(config)
    placed = pattern if isinstance(pattern, int) else f"[{','.join(map(str, pattern))}]"
    return f"layer {layer_index(config)} of L={config.L}, its first MoE layer by megatron's block spec (moe_layer_freq" \
        f" {placed})"


def _heads(config: ModelConfig) -> dict[str, Any]:
    """Plain attention's head width (kv_channels, h/a unless set) and QK norm; or MLATransformerConfig's widths, which
    always norms its latents, with plain RoPE (DeepSeek's YaRN scales cos and sin, which keeps the same tensors)."""
    if not config.mla:
        return {"kv_channels": config.head_dim, "qk_layernorm": config.qk_layernorm}
    return dict(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_nope_head_dim,
                qk_pos_emb_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, rope_type="rope",
                qk_layernorm=True)


def _activation(config: ModelConfig) -> Any:
    """megatron's activation_func for memcalc's mlp. Fused, F.gelu selects the bias_gelu kernel, which is the
    tanh approximation already; unfused, gelu_tanh is F.gelu's own tanh form (see the megatron rules on why
    not openai_gelu, which the shim would run eagerly)."""
    if config.mlp == "swiglu":
        return F.silu
    if config.mlp == "gelu_tanh" and not config.bias_activation_fusion:
        return partial(F.gelu, approximate="tanh")
    return F.gelu


def _build(config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool, dense: bool = False) -> Any:
    """TransformerLayer from the spec megatron's decoder block gives it (dense or MoE), or a TransformerBlock of
    that one layer (no final norm) for full recomputation."""
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer

    megatron_config = transformer_config(config, tp.size, sequence_parallel)
    index = layer_index(config, dense)
    spec = layer_spec(megatron_config, index)
    if config.recompute == "full":
        root = TransformerBlock(megatron_config, TransformerBlockSubmodules(layer_specs=[spec]), post_layer_norm=False)
    else:
        root = TransformerLayer(megatron_config, spec.submodules, layer_number=index + 1)
    return root.to(tp.device)


# -- the labels -------------------------------------------------------------------


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(s, b, heads, d) -> (b, heads, s, d), the ledger's order for per-head tensors."""
    return x.permute(1, 2, 0, 3)


def _host_scale(probs: torch.Tensor) -> torch.Tensor:
    """The scale tensor the fused softmax's autograd node keeps, or an empty tensor if it did not run."""
    node = probs.grad_fn.next_functions[0][0] if probs.grad_fn is not None else None
    if node is None or type(node).__name__ != "ScaledUpperTriangMaskedSoftmaxBackward":
        return probs.new_empty(0)
    return node.saved_tensors[1]


def label_rules(config: ModelConfig, t: int) -> tuple[Rule, ...]:
    """Where each ledger tensor is made in megatron's code, for this config's knobs."""
    if config.recompute == "full":
        return (
            Rule("", "forward", ledger.LAYER_INPUT, arg="hidden_states", view=batch_first),
            Rule("layers.0", "view_as", _FREED, nth=None),  # the shim's dropout masks (see _attributed)
        )
    return (*_attention_rules(config, t), *(_moe_rules(config, t) if config.moe else _mlp_rules(config)))


def _query_copied(config: ModelConfig, t: int) -> bool:
    """Whether get_query_key_value_tensors copies the query heads: with several K/V groups per rank,
    each group's a/g query heads sit between other groups' keys and values in the QKV output."""
    return config.groups != config.a and config.groups // t > 1


def _query_views_qkv(config: ModelConfig, t: int) -> bool:
    """Whether eager QK^T's query is a view of the QKV output under GQA: get_query_key_value_tensors' query is one
    (one K/V group per rank), no norm copies it, and DotProductAttention's reshape(sq, b*np, hn) keeps it one, as
    there is one token (b = 1) whose a+2g-head stride would stand in the way."""
    return (config.groups != config.a and config.attention == "eager" and config.recompute == "none"
            and not config.qk_layernorm and not _query_copied(config, t) and config.b == 1)


def _latent_rules(config: ModelConfig, t: int) -> list[Rule]:
    """MLASelfAttention: x, the up projections' inputs, RoPE's four cast tables, the contiguous Q, K, V, the
    projection input (the latent norms label themselves: SequenceParallelNorm)."""
    heads, core = config.a // t, _core_inputs(config)
    rope = [Rule("*self_attention", "to", table, nth=i, view=lambda x: x.flatten(1)) for i, table in
            enumerate(rules.MLA_ROPE)]  # cos_, sin_ of the query's RoPE part, then of the key's: (s, 1, 1, d_r)
    return [
        Rule("*linear_kv_down_proj", "forward", ledger.QKV_IN, arg=0, view=batch_first),  # q's down proj reads x too
        Rule("*linear_q_up_proj", "forward", ledger.MLA_Q_UP_IN, arg=0, view=batch_first),
        Rule("*linear_kv_up_proj", "forward", ledger.MLA_KV_UP_IN, arg=0, view=batch_first),
        *rope,
        *(core(i, x, _heads_first) for i, x in enumerate((ledger.MLA_Q, ledger.MLA_K))),  # contiguous q, k
        core(2, ledger.MLA_V, lambda v: _heads_first(v) if v._base is None else None),  # a copy unless a view
        core(2, ledger.MLA_KV_UP_OUT,  # what V, left a view by contiguous(), keeps
             lambda v: None if v._base is None else batch_first(v._base.view(*v.shape[:3], -1))),
        Rule("*linear_proj", "forward", ledger.MLA_PROJ_IN, arg=0,
             view=lambda x: batch_first(x).unflatten(-1, (heads, -1))),
    ]


def _core_inputs(config: ModelConfig) -> Callable[[int, SavedTensor, Any], Rule]:
    """A rule naming the latent core's i-th input (query, key, value) as the core gets it; under selective
    recomputation, where MLASelfAttention makes it (the core then runs in megatron's checkpoint without grad, where
    labels are ignored): the i-th distinct 4-D tensor its contiguous() calls return (the gathers before are 3-D,
    forward's own contiguous() hands the same three back)."""
    if config.recompute != "selective":
        return lambda i, tensor, view: Rule("*core_attention", "forward", tensor, arg=i, view=view)
    seen: list[int] = []  # one rule set per layer run

    def nth(x: Any) -> int | None:
        if x.dim() == 4 and id(x) not in seen:
            seen.append(id(x))
        return seen.index(id(x)) if id(x) in seen else None

    return lambda i, tensor, view: Rule("*self_attention", "contiguous", tensor, nth=None,
                                        view=lambda x: view(x) if nth(x) == i else None)


def _attention_rules(config: ModelConfig, t: int) -> tuple[Rule, ...]:
    gqa = config.groups != config.a
    rules_ = [
        *(_latent_rules(config, t) if config.mla else (
            Rule("*linear_qkv", "forward", ledger.QKV_IN, arg=0, view=batch_first),
            Rule("*linear_qkv", "forward", _QKV_OUT),  # q, k, v are views of it: split by _attributed
        )),
        Rule("*scale_mask_softmax", "forward", ledger.SOFTMAX_OUT),
        Rule("*scale_mask_softmax", "masked_fill_", rules.CAUSAL_MASK, arg=1),  # fp32: scores.masked_fill_(mask)
        Rule("*scale_mask_softmax", "forward", _HOST, view=_host_scale),
        Rule("*self_attention", "tensor", _HOST),  # selective: the checkpoint keeps attn_mask_type as a tensor
        *(() if config.mla else (Rule("*linear_proj", "forward", ledger.PROJ_IN, arg=0,
                                      view=lambda x: batch_first(x).unflatten(-1, (-1, config.head_dim))),)),
    ]
    if config.qk_layernorm and not config.mla:  # the norms' outputs are the core's Q and K (the checkpoint's too)
        rules_ += [Rule("*q_layernorm", "forward", ledger.Q, view=_heads_first),
                   Rule("*k_layernorm", "forward", ledger.K, view=_heads_first)]
    if _query_copied(config, t) and (config.qk_layernorm or config.recompute == "selective"):
        # the query heads' copy: q_layernorm's input, or Q, which the checkpoint keeps beside the whole QKV output
        rules_.append(Rule("*self_attention", "reshape", ledger.Q_NORM.input if config.qk_layernorm else ledger.Q,
                           view=_heads_first))
    if gqa and (config.recompute != "selective" or config.qk_layernorm):
        # QK^T keeps a query copy (or the QKV output it views), the core expands K and V to every head
        rules_ += [
            *((Rule("*core_attention", "reshape", rules.QUERY_COPY,
                    view=lambda q: _heads_first(q.unflatten(1, (config.b, -1)))),)
              if not config.qk_layernorm and not _query_views_qkv(config, t) else ()),  # the norm labels its output
            Rule("*core_attention", "repeat_interleave", rules.K_EXPANDED, nth=0, view=_heads_first),
            Rule("*core_attention", "repeat_interleave", rules.V_EXPANDED, nth=1, view=_heads_first),
        ]
    if _fp32_softmax(config, t):  # forward_torch_softmax's fp32 softmax, cast back to 16 bits after
        rules_.append(Rule("*scale_mask_softmax", "softmax", rules.SOFTMAX_FP32))
    if config.dropout > 0:  # with p = 0 the dropout returns the softmax output itself
        rules_ += [
            Rule("*attention_dropout", "view_as", ledger.ATTN_DROPOUT_MASK),  # the shim's mask
            Rule("*attention_dropout", "forward", ledger.ATTN_DROPOUT_OUT),
            Rule("", "view_as", ledger.ATTN_OUT_DROPOUT_MASK, nth=0, view=batch_first),  # bias-dropout-add
            Rule("", "view_as", ledger.MLP_DROPOUT_MASK, nth=1, view=batch_first),
        ]
    return tuple(rules_)


def _fp32_softmax(config: ModelConfig, t: int) -> bool:
    """Whether FusedScaleMaskSoftmax runs torch's softmax on 16-bit scores cast up to fp32 (and keeps that): eager
    attention, not rerun, attention_softmax_in_fp32, and the fused kernel off or outside its sizes."""
    fused = rules.fused_softmax_kernel(config) and rules.fused_softmax_runs(dim_sizes(config), t)
    return (config.attention == "eager" and config.recompute == "none" and config.attention_softmax_in_fp32
            and config.dtype != "fp32" and not fused)


def _mlp_rules(config: ModelConfig) -> tuple[Rule, ...]:
    return (Rule("*linear_fc1", "forward", ledger.FC1_IN, arg=0, view=batch_first),
            Rule("*linear_fc2", "forward", ledger.FC2_IN, arg=0, view=batch_first),
            *_activation_rules(config, "*mlp", rules.DENSE_ACT, _FC1_OUT, batch_first))


def _tokens(b: int) -> Any:
    """(s*b, ...) tokens, sequence first -> (b, s, ...): the ledger's order."""
    return lambda x: x.unflatten(0, (-1, b)).transpose(0, 1)


def _moe_rules(config: ModelConfig, t: int) -> tuple[Rule, ...]:
    """MoELayer: the router (module mlp.router), the permutation (the dispatcher runs in mlp's frame), the
    experts' input and probabilities as SequentialMLP receives them, each expert's MLP, the shared experts."""
    swiglu = config.mlp == "swiglu"
    expert = "*local_experts.*"
    return (
        _ROUTER("forward", ledger.MOE_IN, arg=0, view=batch_first),
        *_router_rules(config),
        _ROUTER("scatter", ledger.ROUTER_TOPK_INDICES, nth=0, arg=2, view=_tokens(config.b)),  # zeros.scatter(1, i, p)
        *_dispatch_rules(config, t),
        Rule("*mlp.experts", "forward", ledger.EXPERT_IN, arg=0),
        Rule("*mlp.experts", "forward", rules.EXPERT_PROBS, arg=2),
        *_activation_rules(config, expert, rules.EXPERT_ACT, _EXPERT_FC1_OUT, lambda x: x),
        Rule(expert, "mul", rules.EXPERT_ACT_OUT, nth=1 if swiglu else 0, arg=0),  # activation * probs, unfused
        Rule(f"{expert}.linear_fc2", "forward", ledger.EXPERT_FC2_IN, arg=0),
        # SharedExpertMLP, a dense MLP of width u (its fc1 reads the router's input: no rule of its own)
        *((*_activation_rules(config, "*shared_experts", rules.SHARED_ACT, _SHARED_FC1_OUT, batch_first),
           Rule("*shared_experts.linear_fc2", "forward", ledger.SHARED_FC2_IN, arg=0, view=batch_first))
          if config.moe_shared_expert_intermediate_size else ()),
    )


_ROUTER = partial(Rule, "*mlp.router")  # a rule for a tensor TopKRouter makes


def _router_rules(config: ModelConfig) -> tuple[Rule, ...]:
    """TopKRouter.routing: the scores (softmax, or sigmoid with the expert bias's gather and the top k's
    renormalisation), the capacity's kept map (`probs * map`), the aux loss (its scores; then
    switch_load_balancing_loss_func's sum(scores, 0) * tokens_per_expert and that sum * a number)."""
    tokens = _tokens(config.b)
    per_token = lambda x: tokens(x).squeeze(-1)  # noqa: E731  (a (s*b, 1) denominator as (b, s))
    rules_: list[Rule] = []
    sigmoid = config.moe_router_score_function == "sigmoid"
    if sigmoid:  # torch.sigmoid(logits.float()); gather(scores, 1, biased top-k); top-k scores / (sum + 1e-20)
        rules_.append(_ROUTER("sigmoid", rules.SIGMOID_SCORES, nth=0, view=tokens))
        if config.moe_router_enable_expert_bias and config.dtype != "fp32":  # fp32: the sigmoid's output, above
            rules_.append(_ROUTER("gather", rules.BIASED_CHOICE_SCORES, nth=0, arg=0, view=tokens))
        if config.moe_router_topk > 1:
            rules_ += [_ROUTER("div", rules.TOPK_SCORES, nth=0, arg=0, view=tokens),
                       _ROUTER("div", rules.TOPK_DENOMINATOR, nth=0, arg=1, view=per_token)]
    else:
        probs = rules.ALL_PROBS if config.moe_router_pre_softmax else rules.TOPK_PROBS
        rules_.append(_ROUTER("softmax", probs, nth=0, view=tokens))
    capacity = config.moe_expert_capacity_factor is not None
    if capacity:  # apply_router_token_dropping: probs * kept map, the router's first product
        rules_.append(_ROUTER("mul", rules.CAPACITY_MASK, nth=0, arg=1, view=tokens))
    if not config.moe_aux_loss:
        return tuple(rules_)
    if sigmoid:  # sigmoid(logits) / (sum + 1e-20): the second sigmoid, and the division after the top k's
        rules_ += [_ROUTER("sigmoid", rules.AUX_SIGMOID_SCORES, nth=1, view=tokens),
                   _ROUTER("div", rules.AUX_SIGMOID_DENOMINATOR, nth=int(config.moe_router_topk > 1), arg=1,
                           view=per_token)]
    else:
        rules_.append(_ROUTER("softmax", rules.AUX_SCORES, nth=1, view=tokens))
    loss = rules.AUX_LOSS_SIGMOID if sigmoid else rules.AUX_LOSS
    return (*rules_, _ROUTER("mul", rules.AUX_TOKENS_PER_EXPERT, nth=capacity, arg=1),
            _ROUTER("mul", loss, nth=capacity + 1))


def _dispatch_rules(config: ModelConfig, t: int) -> tuple[Rule, ...]:
    """The dispatcher's permute (in MoELayer's frame): masked_select's map and transposed probabilities (the
    second masked_select; the first picks token indices), then the tokens' index_select indices. Padded to
    capacity the probabilities are gathered by index_select first. The all-gather dispatcher's map and
    probabilities are its E/ep local experts' columns of the gathered tokens, (E/ep, ep*s*b): b*s*E elements,
    shown in the ledger's (b, s, E); with a capacity and nothing gathered (t*ep = 1), a view of the map is one of
    the router's capacity mask (labelled there)."""
    tokens, b, experts = _tokens(config.b), config.b, config.num_experts
    mask_viewed = config.moe_expert_capacity_factor is not None and t * config.ep == 1
    if config.moe_token_dispatcher_type == "allgather":
        return (
            Rule("*mlp", "masked_select", rules.GATHERED_ROUTING_MAP, nth=1, arg=1,
                 view=lambda m: None if mask_viewed and m._base is not None else m.view(b, -1, experts)),
            Rule("*mlp", "masked_select", rules.GATHERED_PROBS_T, nth=1, arg=0,
                 view=lambda p: p.view(b, -1, experts)),
            Rule("*mlp", "index_select", rules.GATHERED_PERMUTE_INDICES, nth=0, arg=2),
        )
    if config.moe_pad_expert_input_to_capacity:
        return (Rule("*mlp", "index_select", rules.PAD_PROBS_INDICES, nth=0, arg=2),
                Rule("*mlp", "index_select", rules.PERMUTE_INDICES, nth=1, arg=2))
    return (
        Rule("*mlp", "masked_select", rules.ROUTING_MAP, nth=1, arg=1, view=lambda m: tokens(m.T)),  # (E, tokens)
        Rule("*mlp", "masked_select", rules.PROBS_T, nth=1, arg=0, view=lambda p: tokens(p.T)),
        Rule("*mlp", "index_select", rules.PERMUTE_INDICES, nth=0, arg=2),
    )


def _activation_rules(config: ModelConfig, module: str, keeps: tuple[SavedTensor, ...], fc1_out: SavedTensor,
                      view: Any) -> tuple[Rule, ...]:
    """An MLP's activation (the dense one's, an expert's or the shared experts'), `keeps` as rules.activation reads
    them: GELU's input (fused, bias_gelu's: fc1's output before its bias); or SwiGLU's fc1 output (gate and up,
    chunked), SiLU's output and glu's `up + offset` copy (the add after `fc1 + bias`, if any); fused, fc1's output
    before its bias, which (Bias|Weighted)SwiGLUFunction keeps."""
    gelu_in, _, _, silu_out, up_copy = keeps
    fused = config.bias_activation_fusion  # experts never: their GELU has no bias (`check_expert_biases`)
    if config.mlp != "swiglu":
        return (Rule(f"{module}.linear_fc1", "forward", gelu_in, view=view) if fused else
                Rule(module, "gelu", gelu_in, arg=0, view=view),)
    if fused:
        return (Rule(f"{module}.linear_fc1", "forward", fc1_out, view=view),)
    return (Rule(module, "chunk", fc1_out, arg=0, view=view), Rule(module, "silu", silu_out, view=view),
            Rule(module, "add", up_copy, nth=int(config.add_bias_linear), view=view))


# -- one storage, several ledger rows ---------------------------------------------------------


def _splits(config: ModelConfig, t: int) -> dict[str, tuple[Part, ...]]:
    """For each marker: (ledger tensor, its share of the storage's columns, its per-rank shape)."""
    b, s, d = config.b, config.s, config.head_dim
    heads, groups = config.a // t, config.groups // t
    copied = (config.recompute == "selective" or config.qk_layernorm) and _query_copied(config, t)
    normed = config.qk_layernorm and not config.mla  # the norms' inputs are views of the QKV output
    # the query columns: the copy's (Q, or q_layernorm's input) dead source, or Q itself (q_layernorm's input)
    query = rules.QKV_QUERY_COLUMNS if copied else ledger.Q_NORM.input if normed else ledger.Q
    key = ledger.K_NORM.input if normed else ledger.K
    per_head = (b, heads, s, d)
    return {
        _QKV_OUT.name: ((rules.QKV_OUT, heads + 2 * groups, (b, s, heads + 2 * groups, d)),)
        if _query_views_qkv(config, t) else (
            (query, heads, per_head), (key, groups, (b, groups, s, d)), (ledger.V, groups, (b, groups, s, d)),
        ),
    }


def _attributed(saved: tuple[SavedStorage, ...], config: ModelConfig, t: int) -> tuple[SavedStorage, ...]:
    """The storages as ledger rows: markers split into their tensors; host scalars and masks freed under full
    recomputation (docs/probe.md, "megatron-core's own layer") left out."""
    kept = tuple(x for x in saved if x.name not in (_HOST.name, _FREED.name))
    return split_rows(kept, _splits(config, t), _HALVES)
