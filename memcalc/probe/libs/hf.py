"""transformers' own decoder layers, recorded under ledger names (`memcalc measure --impl hf`).

`run_layer` builds the layer memcalc's knobs describe (memcalc.model.impls.hf):
`LlamaDecoderLayer` (`Qwen2DecoderLayer` when the config asks for a QKV bias;
`MistralDecoderLayer` is the same layer and the tests run it too) or `GPT2Block`,
from a config object sized from memcalc's config: nothing is downloaded. The
layer runs in training mode with `attn_implementation` "eager" or "sdpa" (memcalc's
eager or flash), fed as transformers' own model feeds it: a batch-first input,
the causal mask from `create_causal_mask` (None under SDPA, which then runs
`is_causal`), and for Llama the `(cos, sin)` its rotary embedding module makes
from position ids (1, s). Recompute "full" is transformers' gradient
checkpointing, enabled as `activation_checkpointing_enable()` does it:
torch.utils.checkpoint, non-reentrant. Its own saved-tensor hooks shadow the
recorder's inside the layer, which is right: what they hold is freed, and the
recorder sees what the checkpoint keeps, the layer's input.

Tensors made inside one torch op (matmul's contiguous copies of Q, K^T and V,
LayerNorm's mean and rstd, the dropout mask, SDPA's log-sum-exp and its math
kernel's fp32 copies) are no call's result: a rule's `view` reaches them through
the result's autograd graph (`_kept`). The rules name every tensor the layer may
keep; only those the prediction lists for this config are applied, so a storage
two names could describe (fp32: softmax's output and its no-op cast) gets the
predicted one, and a storage the rules did not predict stays unlabelled.

GPT-2 under SDPA keeps q, k and v as views of the one c_attn output: that storage
is labelled with a private marker and reported as the ledger's Q, K and V, a
third of its bytes each (`_attributed`), as the Megatron runner does.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from functools import partial
from typing import Any, Callable

from memcalc.config.schema import ModelConfig
from memcalc.errors import ProbeError
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.ledger import Kind, Region, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.layer import DTYPES
from memcalc.probe.libs.hf_shim import NOTES as SHIM_NOTES
from memcalc.probe.libs.hf_shim import cuda_like_dropout
from memcalc.probe.libs.labels import Labels, Rule
from memcalc.probe.measure import INPUT_SEED
from memcalc.probe.recorder import SavedStorage, SavedTensorRecorder, label

torch = require_torch()
import transformers  # noqa: E402  (memcalc[hf]; measure.runner names it when missing)
from torch.utils.checkpoint import checkpoint  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402

NOTES: tuple[str, ...] = SHIM_NOTES

# A storage holding three ledger tensors side by side; never reported under this name.
_QKV_OUT = SavedTensor("attention/c_attn_out", "GPT2Attention.c_attn", (), Kind.ACTIVATION, Region.TENSOR,
                       "split into q, k, v")
_QKV_PARTS = (ledger.Q, ledger.K, ledger.V)  # each h columns wide (GPT-2 has no GQA)


def run_layer(tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy) -> tuple[SavedStorage, ...]:
    """Build the layer, record one forward pass under ledger names, run backward once."""
    return record_layer(tp, config, strategy)


def record_layer(
    tp: TensorParallelGroup, config: ModelConfig, strategy: Strategy, family: str | None = None
) -> tuple[SavedStorage, ...]:
    """`run_layer`, with the Llama-family class choosable ("llama", "mistral", "qwen2") for the tests."""
    if strategy.tensor_parallel or strategy.sequence_parallel or tp.size != 1:
        raise ProbeError(f"impl hf runs no tensor parallelism: measure strategy none with t=1 (got {strategy.name})")
    rules.check(config)
    family = family or _family(config)
    layer, extra = _build(config, family, tp.device)
    accounting = Accounting(exact=True, device=tp.device.type)
    expected = {t.name for t in rules.layer_tensors(Knobs.of(config), accounting)}
    label_rules = tuple(r for r in label_rules_for(config) if r.tensor.name in expected or r.tensor is _QKV_OUT)
    x = _layer_input(config, tp.device)
    with cuda_like_dropout():
        with SavedTensorRecorder(layer.parameters()) as recorder, Labels(layer, label_rules):
            y = layer(x, **extra(x, "attention/rope_cos" in expected))
        y.backward(torch.ones_like(y))  # inside the shim: a checkpoint's recompute must drop out alike
    return _attributed(recorder.saved, config)


def _family(config: ModelConfig) -> str:
    if not rules.is_llama(config):
        return "gpt2"
    return "qwen2" if config.add_qkv_bias else "llama"


def _layer_input(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """The probe's seeded input, batch-first (b, s, h), requiring grad as a layer's input past the embedding does."""
    generator = torch.Generator().manual_seed(INPUT_SEED)
    x = torch.randn(config.b, config.s, config.h, generator=generator).to(DTYPES[config.dtype])
    return x.to(device).requires_grad_()


# -- building the layer -----------------------------------------------------------------


def _build(config: ModelConfig, family: str, device: torch.device) -> tuple[Any, Callable[..., dict]]:
    """The layer in training mode, and a function giving its keyword inputs for an input x."""
    if family == "gpt2":
        hf_config = transformers.GPT2Config(
            n_embd=config.h, n_head=config.a, n_inner=config.ffn, n_layer=1, n_positions=config.s,
            vocab_size=config.vocab_size, attn_pdrop=config.dropout, resid_pdrop=config.dropout,
            embd_pdrop=config.dropout, activation_function="gelu_new" if config.mlp == "gelu_tanh" else "gelu",
            attn_implementation=attention_implementation(config),
        )
        module = transformers.models.gpt2.modeling_gpt2
        layer_class, rotary = module.GPT2Block, None
    else:
        config_class, module = _llama_family(family)
        hf_config = llama_config(config, family)
        layer_class = getattr(module, f"{config_class.__name__.removesuffix('Config')}DecoderLayer")
        rotary = getattr(module, f"{config_class.__name__.removesuffix('Config')}RotaryEmbedding")(hf_config)
    torch.manual_seed(INPUT_SEED)  # the weights, as the layer initialises them
    layer = layer_class(hf_config, layer_idx=0).to(device=device, dtype=DTYPES[config.dtype]).train()
    if config.recompute == "full":
        _checkpointing(layer)
    return layer, partial(_inputs, hf_config, rotary)


def llama_config(config: ModelConfig, family: str = "llama") -> Any:
    """A Llama-family config object sized from memcalc's: L layers, GQA, SwiGLU, RMSNorm, RoPE, tied or not.

    The attention implementation is memcalc's knob: "sdpa" for flash, "eager" for eager.
    """
    config_class, _ = _llama_family(family)
    return config_class(
        hidden_size=config.h, num_attention_heads=config.a, num_key_value_heads=config.groups,
        intermediate_size=config.ffn, hidden_act="silu", attention_dropout=config.dropout, num_hidden_layers=config.L,
        max_position_embeddings=config.s, vocab_size=config.vocab_size, tie_word_embeddings=config.tie_embeddings,
        attn_implementation=attention_implementation(config),
    )


def attention_implementation(config: ModelConfig) -> str:
    """transformers' `attn_implementation` for memcalc's attention knob."""
    return "sdpa" if config.attention == "flash" else "eager"


def _llama_family(family: str) -> tuple[type, Any]:
    models = transformers.models
    return {
        "llama": (transformers.LlamaConfig, models.llama.modeling_llama),
        "mistral": (transformers.MistralConfig, models.mistral.modeling_mistral),
        "qwen2": (transformers.Qwen2Config, models.qwen2.modeling_qwen2),
    }[family]


def _checkpointing(layer: Any) -> None:
    """Gradient checkpointing as `activation_checkpointing_enable()` sets it up (non-reentrant by default)."""
    enable = transformers.PreTrainedModel._set_gradient_checkpointing
    enable(layer, enable=True, gradient_checkpointing_func=partial(checkpoint, use_reentrant=False))


def _inputs(hf_config: Any, rotary: Any, x: torch.Tensor, label_rope: bool) -> dict:
    """What transformers' model passes its layers: the causal mask, and for Llama (cos, sin) and position ids."""
    position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, s), as LlamaModel makes them
    mask = create_causal_mask(
        config=hf_config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=position_ids
    )
    if rotary is None:
        return {"attention_mask": mask}
    cos, sin = rotary.to(x.device)(x, position_ids)  # (1, s, d) each, in x's dtype
    if label_rope:
        label(cos[0], rules.ROPE_COS)
        label(sin[0], rules.ROPE_SIN)
    return {"attention_mask": mask, "position_embeddings": (cos, sin), "position_ids": position_ids}


# -- the labels ---------------------------------------------------------------------------


def _kept(node: str, saved: str, newest: int = 0, then: Callable[[Any], Any] | None = None) -> Callable[[Any], Any]:
    """A rule's view: the tensor autograd node `node` (fnmatch) saved as `saved`, for a call's result.

    The node is the `newest`-th newest of that name among the nodes the result's
    graph reaches (0: the one made last); `then` turns it into the ledger's axes.
    """

    def view(result: Any) -> Any:
        nodes = [n for n in _graph(result.grad_fn) if fnmatchcase(type(n).__name__, node)]
        nodes.sort(key=lambda n: n._sequence_nr(), reverse=True)
        if len(nodes) <= newest:
            return None
        tensor = getattr(nodes[newest], saved)
        return then(tensor) if then else tensor

    return view


def _graph(root: Any) -> list[Any]:
    """Every autograd node reachable from `root`."""
    seen, stack = {}, [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(seen.values())


def _heads(b: int) -> Callable[[Any], Any]:
    """(b * heads, s, d) as (b, heads, s, d)."""
    return lambda x: x.unflatten(0, (b, -1))


def _heads_t(b: int) -> Callable[[Any], Any]:
    """(b * heads, d, s), a transposed K, as (b, heads, s, d)."""
    return lambda x: x.unflatten(0, (b, -1)).transpose(-1, -2)


def _tokens(b: int) -> Callable[[Any], Any]:
    """(b * s, h), a Conv1D's flattened input, as (b, s, h)."""
    return lambda x: x.unflatten(0, (b, -1))


def _stats(x: Any) -> Any:
    """(b, s, 1) per-token statistics as (b, s)."""
    return x.squeeze(-1)


def label_rules_for(config: ModelConfig) -> tuple[Rule, ...]:
    """Where each tensor the layer may keep is made in transformers' code."""
    if config.recompute == "full":
        return (Rule("", "forward", ledger.LAYER_INPUT, arg=0),)
    if rules.is_llama(config):
        return (*_rms_rules("input_layernorm", rules.LN1_RMS), *_llama_attention_rules(config),
                *_rms_rules("post_attention_layernorm", rules.LN2_RMS), *_llama_mlp_rules())
    return (*_layer_norm_rules("ln_1", ledger.LN1), *_gpt2_attention_rules(config),
            *_layer_norm_rules("ln_2", ledger.LN2), *_gpt2_mlp_rules(config))


def _rms_rules(module: str, norm: rules.RMSNormTensors) -> tuple[Rule, ...]:
    return (
        Rule(module, "to", norm.input_fp32, nth=0),  # hidden_states.to(torch.float32)
        Rule(module, "rsqrt", norm.rstd, view=_stats),
        Rule(module, "to", norm.normed, nth=1),  # hidden_states.to(input_dtype)
    )


def _layer_norm_rules(module: str, norm: ledger.NormTensors) -> tuple[Rule, ...]:
    return (
        Rule(module, "layer_norm", norm.input, arg=0),
        Rule(module, "layer_norm", norm.mean, view=_kept("NativeLayerNormBackward0", "_saved_result1", then=_stats)),
        Rule(module, "layer_norm", norm.rstd, view=_kept("NativeLayerNormBackward0", "_saved_result2", then=_stats)),
    )


def _core_rules(attention: str, config: ModelConfig) -> tuple[Rule, ...]:
    """Eager, SDPA (flash kernel) and SDPA's CPU math kernel: the tensors inside `attention`.

    SDPA's q, k and v are the arguments it is passed: `_sdpa_inputs`.
    """
    b = config.b
    sdpa = "scaled_dot_product_attention"
    return (
        # eager: matmul copies q, k^T (k after repeat_kv) and v into contiguous storages and keeps those
        Rule(attention, "matmul", ledger.Q, nth=0, view=_kept("BmmBackward0", "_saved_self", then=_heads(b))),
        Rule(attention, "matmul", ledger.K, nth=0, view=_kept("BmmBackward0", "_saved_mat2", then=_heads_t(b))),
        Rule(attention, "matmul", rules.K_EXPANDED, nth=0,
             view=_kept("BmmBackward0", "_saved_mat2", then=_heads_t(b))),
        Rule(attention, "matmul", ledger.V, nth=1, view=_kept("BmmBackward0", "_saved_mat2", then=_heads(b))),
        Rule(attention, "matmul", rules.V_EXPANDED, nth=1,
             view=_kept("BmmBackward0", "_saved_mat2", then=_heads(b))),
        Rule(attention, "softmax", ledger.SOFTMAX_OUT),
        Rule(attention, "softmax", rules.SOFTMAX_FP32),
        Rule(attention, "to", rules.WEIGHTS),  # Llama's cast of the fp32 softmax back to bf16
        Rule(attention, "native_dropout", ledger.ATTN_DROPOUT_OUT),  # the shim's dropout
        Rule(attention, "native_dropout", ledger.ATTN_DROPOUT_MASK,
             view=_kept("NativeDropoutBackward0", "_saved_result1")),
        # SDPA, flash kernel: the log-sum-exp (and q, k, v as passed)
        Rule(attention, sdpa, ledger.SOFTMAX_LSE, view=_kept("ScaledDotProduct*Backward0", "_saved_logsumexp")),
        # SDPA, CPU math kernel (dropout): fp32 copies, two bmm, the softmax, dropout's mask
        Rule(attention, sdpa, rules.MATH_Q, view=_kept("BmmBackward0", "_saved_self", newest=1, then=_heads(b))),
        Rule(attention, sdpa, rules.MATH_K, view=_kept("BmmBackward0", "_saved_mat2", newest=1, then=_heads_t(b))),
        Rule(attention, sdpa, rules.MATH_SOFTMAX, view=_kept("SafeSoftmaxBackward0", "_saved_result")),
        Rule(attention, sdpa, rules.MATH_DROPOUT_MASK, view=_kept("MulBackward0", "_saved_other")),
        Rule(attention, sdpa, rules.MATH_DROPOUT_OUT, view=_kept("BmmBackward0", "_saved_self", then=_heads(b))),
        Rule(attention, sdpa, rules.MATH_V, view=_kept("BmmBackward0", "_saved_mat2", then=_heads(b))),
    )


def _sdpa_inputs(attention: str) -> tuple[Rule, ...]:
    """The flash kernel keeps q, k and v as they were passed."""
    sdpa = "scaled_dot_product_attention"
    return (Rule(attention, sdpa, ledger.Q, arg=0), Rule(attention, sdpa, ledger.K, arg=1),
            Rule(attention, sdpa, ledger.V, arg=2))


def _llama_attention_rules(config: ModelConfig) -> tuple[Rule, ...]:
    return (
        Rule("self_attn.q_proj", "linear", ledger.QKV_IN, arg=0),
        *_core_rules("self_attn", config),
        *_sdpa_inputs("self_attn"),
        Rule("self_attn.o_proj", "linear", ledger.PROJ_IN, arg=0),
    )


def _llama_mlp_rules() -> tuple[Rule, ...]:
    return (
        Rule("mlp.gate_proj", "linear", ledger.FC1_IN, arg=0),
        Rule("mlp.gate_proj", "linear", ledger.SWIGLU_GATE),
        Rule("mlp.up_proj", "linear", ledger.SWIGLU_UP),
        Rule("mlp.act_fn", "silu", ledger.SWIGLU_SILU_OUT),
        Rule("mlp.down_proj", "linear", ledger.FC2_IN, arg=0),
    )


def _gpt2_attention_rules(config: ModelConfig) -> tuple[Rule, ...]:
    flat = _tokens(config.b)
    return (
        Rule("attn.c_attn", "addmm", ledger.QKV_IN, arg=1, view=flat),
        *_core_rules("attn", config),
        # q, k, v are views of c_attn's output (b * s, 3h): its whole storage, split by _attributed
        Rule("attn", "scaled_dot_product_attention", _QKV_OUT, arg=0, view=lambda q: q._base),
        Rule("attn.c_proj", "addmm", ledger.PROJ_IN, arg=1, view=flat),
        Rule("attn.resid_dropout", "native_dropout", ledger.ATTN_OUT_DROPOUT_MASK,
             view=_kept("NativeDropoutBackward0", "_saved_result1")),
    )


def _gpt2_mlp_rules(config: ModelConfig) -> tuple[Rule, ...]:
    flat = _tokens(config.b)
    return (
        Rule("mlp.c_fc", "addmm", ledger.FC1_IN, arg=1, view=flat),
        Rule("mlp.act", "gelu", ledger.GELU_IN, arg=0),  # torch's GELU kernel
        Rule("mlp.act", "pow", ledger.GELU_IN, arg=0),  # gelu_new: torch.pow(x, 3.0)
        Rule("mlp.act", "mul", rules.HALF_X, nth=0),  # gelu_new: 0.5 * x (a scalar product reads as mul)
        Rule("mlp.act", "tanh", rules.TANH_OUT),
        Rule("mlp.act", "add", rules.ONE_PLUS_TANH, nth=1),  # gelu_new: 1.0 + tanh(.), after x + 0.044715 x^3
        Rule("mlp.c_proj", "addmm", ledger.FC2_IN, arg=1, view=flat),
        Rule("mlp.dropout", "native_dropout", ledger.MLP_DROPOUT_MASK,
             view=_kept("NativeDropoutBackward0", "_saved_result1")),
    )


# -- one storage, three ledger rows ---------------------------------------------------------


def _attributed(saved: tuple[SavedStorage, ...], config: ModelConfig) -> tuple[SavedStorage, ...]:
    """The storages as ledger rows: GPT-2's c_attn output split into Q, K and V, a third of its bytes each."""
    per_head = (config.b, config.a, config.s, config.h // config.a)
    rows: list[SavedStorage] = []
    for storage in saved:
        if storage.name != _QKV_OUT.name:
            rows.append(storage)
            continue
        rows += [SavedStorage(x.name, storage.nbytes // 3, per_head, storage.dtype) for x in _QKV_PARTS]
    return tuple(rows)
