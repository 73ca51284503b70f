"""megatron-core's own layer on one tensor-parallel rank, recorded under ledger names.

`run_layer` builds `TransformerLayer` from megatron's local GPT spec (no
Transformer Engine), or a one-layer `TransformerBlock` for full recomputation
(Megatron checkpoints whole layers from the block), with a `TransformerConfig`
sized from memcalc's config, under megatron's `parallel_state` on the probe's
process group (fake, gloo, nccl or torchrun; a one-rank fake group when t = 1).
It runs inside `megatron_shim.cpu_megatron()`, whose `NOTES` say what was
patched to run on a CPU as on CUDA.

Megatron-LM's training arguments, not TransformerConfig's defaults, decide two
choices: `masked_softmax_fusion` on (the fused causal softmax keeps bf16), and
`bias_activation_fusion`, which memcalc's knob of that name sets.

Two storages hold several ledger tensors side by side: the fused QKV output
(q, k and v are views of it) and, under SwiGLU, fc1's output (gate and up). Each
is labelled with a private marker and reported as one row per ledger tensor,
its bytes divided by the columns each tensor spans (`_SPLITS`), so the table
reads row by row as the ledger does and the bytes add up to the storage's.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from functools import partial
from typing import Any, Iterator

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model import ledger
from memcalc.model.evaluate import dim_sizes
from memcalc.model.impls import megatron as rules
from memcalc.model.ledger import Kind, Region, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs.labels import Labels, Rule
from memcalc.probe.libs.megatron_shim import NOTES as SHIM_NOTES
from memcalc.probe.libs.megatron_shim import cpu_megatron, local_spec, seed_rng_tracker
from memcalc.probe.measure import INPUT_SEED, _layer_input
from memcalc.probe.recorder import SavedStorage, SavedTensorRecorder, batch_first

torch = require_torch()
import torch.distributed as dist  # noqa: E402  (after the install check above)
from torch.nn import functional as F  # noqa: E402

WEIGHT_SEED = 5678  # the same full weights on every rank; megatron cuts each rank's block from them

NOTES: tuple[str, ...] = (
    *SHIM_NOTES,
    "not counted: 1-element tensors megatron keeps in host memory on CUDA (fused softmax scale, attn_mask_type)",
    "not counted under full recompute: bias-dropout-add's masks, freed when megatron's checkpoint returns",
)

# Markers for storages that hold several ledger tensors; never reported under these names.
_QKV_OUT = SavedTensor("attention/qkv_out", "linear_qkv", (), Kind.ACTIVATION, Region.TENSOR, "split into q, k, v")
_FC1_OUT = SavedTensor("mlp/fc1_out", "linear_fc1", (), Kind.ACTIVATION, Region.TENSOR, "split into gate, up")
_HOST = SavedTensor("host/scalar", "torch.tensor([...])", (), Kind.FP32, Region.TENSOR, "host memory, not on the GPU")
_FREED = SavedTensor("layer/freed_mask", "bias-dropout-add", (), Kind.MASK, Region.SEQUENCE, "freed after forward")


def run_layer(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> tuple[SavedStorage, ...]:
    """Build megatron's layer for this rank, record one forward, run backward once; what it saved."""
    _check(config)
    with warnings.catch_warnings():
        _quiet()  # before the shim imports megatron, which warns as it is imported
        return _recorded(tp, config, strategy)


def _recorded(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> tuple[SavedStorage, ...]:
    with cpu_megatron(), _model_parallel(tp):
        torch.manual_seed(WEIGHT_SEED)
        root = _build(config, tp, strategy.sequence_parallel)
        seed_rng_tracker(INPUT_SEED, tp.rank)
        x = _layer_input(config, tp, strategy.sequence_parallel)
        with SavedTensorRecorder(root.parameters()) as recorder, Labels(root, label_rules(config, tp.size)):
            y, _ = _forward(root, x)
        y.backward(torch.ones_like(y))
    return _attributed(recorder.saved, config, tp.size)


def _quiet() -> None:
    """Megatron warns that Apex and Transformer Engine are missing (and more), torch that c10d names are deprecated."""
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _check(config: ModelConfig) -> None:
    if config.attention == "flash":
        raise ProbeError(
            "impl megatron: the local spec's core attention is DotProductAttention (eager); flash attention"
            " is Transformer Engine's, which needs CUDA; measure with --attention eager"
        )


@contextmanager
def _model_parallel(tp: TensorParallelGroup) -> Iterator[None]:
    """megatron's parallel_state over the probe's group; a one-rank fake group when there is none."""
    from megatron.core import parallel_state

    own_group = not dist.is_initialized()
    if own_group:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers backend "fake"

        dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp.size, create_gloo_process_groups=False)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


# -- the layer --------------------------------------------------------------------


def transformer_config(config: ModelConfig, t: int, sequence_parallel: bool) -> Any:
    """megatron's TransformerConfig (MLATransformerConfig with kv_lora_rank) for memcalc's config on t ranks."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    swiglu = config.mlp == "swiglu"
    recompute = {"none": {}, "selective": {"recompute_granularity": "selective"}}.get(
        config.recompute, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    )
    return (MLATransformerConfig if config.mla else TransformerConfig)(
        **_latent(config), num_layers=1, hidden_size=config.h, num_attention_heads=config.a, num_query_groups=config.groups,
        ffn_hidden_size=config.ffn, gated_linear_unit=swiglu, activation_func=_activation(config),
        normalization="RMSNorm" if config.norm == "rmsnorm" else "LayerNorm",
        add_bias_linear=config.add_bias_linear, add_qkv_bias=config.add_qkv_bias,
        hidden_dropout=config.dropout, attention_dropout=config.dropout,
        bias_activation_fusion=config.bias_activation_fusion, masked_softmax_fusion=True,
        tensor_model_parallel_size=t, sequence_parallel=sequence_parallel,
        params_dtype=DTYPES[config.dtype], bf16=config.dtype == "bf16", fp16=config.dtype == "fp16",
        use_cpu_initialization=True, **recompute,
    )


def _latent(config: ModelConfig) -> dict[str, Any]:
    """MLATransformerConfig's widths; plain RoPE (DeepSeek's YaRN scales cos and sin, which keeps the same tensors)."""
    if not config.mla:
        return {}
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


def _build(config: ModelConfig, tp: TensorParallelGroup, sequence_parallel: bool) -> Any:
    """TransformerLayer, or a one-layer TransformerBlock (no final norm) for full recomputation."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    megatron_config = transformer_config(config, tp.size, sequence_parallel)
    spec = local_spec(megatron_config.normalization, latent=config.mla)
    if config.recompute == "full":
        root = TransformerBlock(megatron_config, spec, post_layer_norm=False)
    else:
        root = TransformerLayer(megatron_config, spec.submodules, layer_number=1)
    return root.to(tp.device)


def _forward(root: Any, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(output, context): a block returns its output alone."""
    out = root(hidden_states=x, attention_mask=None)
    return out if isinstance(out, tuple) else (out, None)


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
    return (*_attention_rules(config, t), *_mlp_rules(config))


def _query_copied(config: ModelConfig, t: int) -> bool:
    """Whether get_query_key_value_tensors copies the query heads: with several K/V groups per rank,
    each group's a/g query heads sit between other groups' keys and values in the QKV output."""
    return config.groups != config.a and config.groups // t > 1


def _latent_rules(config: ModelConfig, t: int) -> list[Rule]:
    """MLASelfAttention: x, the up projections' inputs, RoPE's four cast tables, the contiguous Q, K, V, the
    projection input (the latent norms label themselves: SequenceParallelNorm)."""
    heads = config.a // t
    rope = [Rule("*self_attention", "to", table, nth=i, view=lambda x: x.flatten(1)) for i, table in
            enumerate(rules.MLA_ROPE)]  # cos_, sin_ of the query's RoPE part, then of the key's: (s, 1, 1, d_r)
    return [
        Rule("*linear_kv_down_proj", "forward", ledger.QKV_IN, arg=0, view=batch_first),  # q's down proj reads x too
        Rule("*linear_q_up_proj", "forward", ledger.MLA_Q_UP_IN, arg=0, view=batch_first),
        Rule("*linear_kv_up_proj", "forward", ledger.MLA_KV_UP_IN, arg=0, view=batch_first),
        *rope,
        *(Rule("*core_attention", "forward", x, arg=i, view=_heads_first)  # the contiguous query, key, value
          for i, x in enumerate((ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V))),
        Rule("*linear_proj", "forward", ledger.MLA_PROJ_IN, arg=0,
             view=lambda x: batch_first(x).unflatten(-1, (heads, -1))),
    ]


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
        *(() if config.mla else (Rule("*linear_proj", "forward", ledger.PROJ_IN, arg=0, view=batch_first),)),
    ]
    if gqa and config.recompute == "selective":
        if _query_copied(config, t):  # the checkpoint keeps the query copy beside the whole QKV output
            rules_.append(Rule("*self_attention", "reshape", ledger.Q, view=_heads_first))
    elif gqa:  # QK^T keeps a query copy, the core expands K and V to every head
        rules_ += [
            Rule("*core_attention", "reshape", ledger.Q, view=lambda q: _heads_first(q.unflatten(1, (config.b, -1)))),
            Rule("*core_attention", "repeat_interleave", rules.K_EXPANDED, nth=0, view=_heads_first),
            Rule("*core_attention", "repeat_interleave", rules.V_EXPANDED, nth=1, view=_heads_first),
        ]
    fused = rules.FUSED_SOFTMAX
    if fused.applies(config) and not fused.runs(dim_sizes(config), t):  # forward_torch_softmax's fp32 softmax
        rules_.append(Rule("*scale_mask_softmax", "softmax", rules.SOFTMAX_FP32))
    if config.dropout > 0:  # with p = 0 the dropout returns the softmax output itself
        rules_ += [
            Rule("*attention_dropout", "view_as", ledger.ATTN_DROPOUT_MASK),  # the shim's mask
            Rule("*attention_dropout", "forward", ledger.ATTN_DROPOUT_OUT),
            Rule("", "view_as", ledger.ATTN_OUT_DROPOUT_MASK, nth=0, view=batch_first),  # bias-dropout-add
            Rule("", "view_as", ledger.MLP_DROPOUT_MASK, nth=1, view=batch_first),
        ]
    return tuple(rules_)


def _mlp_rules(config: ModelConfig) -> tuple[Rule, ...]:
    fused = config.bias_activation_fusion
    rules_ = [
        Rule("*linear_fc1", "forward", ledger.FC1_IN, arg=0, view=batch_first),
        Rule("*linear_fc2", "forward", ledger.FC2_IN, arg=0, view=batch_first),
    ]
    if config.mlp != "swiglu":
        if fused:  # bias_gelu keeps fc1's output, before its bias
            return (*rules_, Rule("*linear_fc1", "forward", ledger.GELU_IN, view=batch_first))
        return (*rules_, Rule("*mlp", "gelu", ledger.GELU_IN, arg=0, view=batch_first))
    if fused:  # BiasSwiGLUFunction keeps fc1's output, before its bias
        return (*rules_, Rule("*linear_fc1", "forward", _FC1_OUT))
    offset_add = 1 if config.add_bias_linear else 0  # after `fc1 + bias`, glu's `up + offset`
    return (
        *rules_,
        Rule("*mlp", "chunk", _FC1_OUT, arg=0),  # SiLU keeps the gate, a view of the whole fc1 output
        Rule("*mlp", "silu", ledger.SWIGLU_SILU_OUT, view=batch_first),
        Rule("*mlp", "add", rules.SWIGLU_UP_COPY, nth=offset_add, view=batch_first),
    )


# -- one storage, several ledger rows ---------------------------------------------------------


def _splits(config: ModelConfig, t: int) -> dict[str, tuple[tuple[SavedTensor, int, tuple[int, ...]], ...]]:
    """For each marker: (ledger tensor, its share of the storage's columns, its per-rank shape)."""
    b, s, d = config.b, config.s, config.h // config.a
    heads, groups, ffn = config.a // t, config.groups // t, config.ffn // t
    copied = config.recompute == "selective" and _query_copied(config, t)
    query = rules.QKV_QUERY_COLUMNS if copied else ledger.Q  # then Q is the copy beside it
    per_head = (b, heads, s, d)
    return {
        _QKV_OUT.name: (
            (query, heads, per_head), (ledger.K, groups, (b, groups, s, d)), (ledger.V, groups, (b, groups, s, d)),
        ),
        _FC1_OUT.name: ((ledger.SWIGLU_GATE, 1, (b, s, ffn)), (ledger.SWIGLU_UP, 1, (b, s, ffn))),
    }


def _attributed(saved: tuple[SavedStorage, ...], config: ModelConfig, t: int) -> tuple[SavedStorage, ...]:
    """The storages as ledger rows: markers split into their tensors; host scalars and freed masks left out.

    Under full recomputation TransformerLayer runs bias-dropout-add under torch.enable_grad
    (its `bias_dropout_add_exec_handler`), even inside CheckpointFunction's no-grad forward,
    so autograd packs the two dropout masks; but the graph holding them hangs only from the
    checkpoint's inner output, whose history CheckpointFunction replaces when forward
    returns, and they are freed there (checked with weak references): not kept for backward.
    """
    splits = _splits(config, t)
    rows: list[SavedStorage] = []
    for storage in saved:
        if storage.name in (_HOST.name, _FREED.name):
            continue
        parts = splits.get(storage.name or "")
        if parts is None:
            rows.append(storage)
            continue
        columns = sum(share for _, share, _ in parts)
        rows += [
            SavedStorage(tensor.name, storage.nbytes * share // columns, shape, storage.dtype)
            for tensor, share, shape in parts
        ]
    return tuple(rows)
