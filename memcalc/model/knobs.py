"""The knobs: every choice that changes what a layer saves, declared once in `KNOBS`.

A knob is a vocabulary word: its name, its choices (an enum), its default, its
help, the symbol a formula writes for it, the words that describe it, and what
each non-default value changes. Everything else is generated from this table:
the `Knobs` dataclass (and so the config schema, which extends it), the CLI
flags, the sweep's CSV columns, the one-line description of a model, and the
variants in docs/model.md. `tests/model/test_knobs.py` checks that every
consumer covers every knob.

Choice values are `str` enums, so `knobs.mlp == "swiglu"` reads naturally and
JSON writes them as their text.
"""

from __future__ import annotations

from dataclasses import field, replace
from enum import Enum
from functools import partial
from typing import Any, Callable

from memcalc.model.ledger import Kind
from memcalc.records import record


class Choice(str, Enum):
    """A knob's value: compares equal to, prints as, and serialises as its text."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # as its text, so a member and its string are one dict key
        return str.__hash__(self)


class Impl(Choice):
    MEGATRON = "megatron"
    TORCHTITAN = "torchtitan"
    HF = "hf"
    PAPER = "paper"  # Korthikanti et al. 2022's accounting itself (the seed's layer, no library)


class Mlp(Choice):
    GELU = "gelu"
    SWIGLU = "swiglu"
    GELU_TANH = "gelu_tanh"  # tanh-approximated GELU: HF gelu_new, gelu_pytorch_tanh, gelu_fast; Megatron bias_gelu
    GEGLU_TANH = "geglu_tanh"  # gated: torch's tanh GELU(gate) * up (Gemma's gelu_pytorch_tanh); transformers only
    # gpt-oss's experts: gate and up interleaved, clamped at swiglu_limit, (up + 1) * gate * sigmoid(alpha * gate)
    SWIGLU_CLAMPED = "swiglu_clamped"  # transformers only (GptOssExperts._apply_gate)


GATED = (Mlp.SWIGLU, Mlp.GEGLU_TANH, Mlp.SWIGLU_CLAMPED)  # activation(gate) * up: fc1 makes both gate and up


class Attention(Choice):
    EAGER = "eager"
    FLASH = "flash"


class Norm(Choice):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"
    RMSNORM_1P = "rmsnorm_1p"  # Gemma's: (1 + w) * RMSNorm(x), all in fp32 and cast after; transformers only
    LAYERNORM_NP = "layernorm_np"  # OLMo's: LayerNorm without weight or bias, in fp32 and cast after; transformers only
    RMSNORM_FP32W = "rmsnorm_fp32w"  # OLMo 2's: w * RMSNorm(x) with the product in fp32, cast after; transformers only
    LAYERNORM_NB = "layernorm_nb"  # Cohere's: w * LayerNorm(x) without bias, written out in fp32, cast after; hf only


class Recompute(Choice):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OP = "op"  # torchtitan's op-level selective checkpointing: keeps chosen ops' outputs, reruns the rest


class MoeTokens(Choice):
    """Which bound on the tokens an expert receives every MoE number uses (the count depends on the data)."""

    BALANCED = "balanced"  # the router spreads the load evenly: k*b*s/E tokens per expert
    CAPACITY = "capacity"  # each expert keeps at most ceil(c*k*b*s/E) tokens (moe_expert_capacity_factor c)
    WORST = "worst"  # no capacity: every token's k experts on this rank


class ScoreFunction(Choice):
    """How the router turns each expert's logit into a score (Megatron-LM's moe_router_score_function)."""

    SOFTMAX = "softmax"  # Mixtral, Qwen2-MoE: a softmax over the experts
    SIGMOID = "sigmoid"  # DeepSeek-V3: each expert's own sigmoid, the top k renormalised


class Dispatcher(Choice):
    """How a MoE layer moves tokens to the ranks of their experts (Megatron-LM's moe_token_dispatcher_type)."""

    ALLTOALL = "alltoall"  # the ranks' chosen tokens all-to-all over ep (Megatron-LM's MoE recipes)
    ALLGATHER = "allgather"  # every rank gathers the tp*ep group's tokens and picks its experts' (megatron-core's default)


class ExpertsImplementation(Choice):
    """How transformers runs a MoE block's experts (its config's experts_implementation; --impl hf only)."""

    GROUPED_MM = "grouped_mm"  # transformers 5.24's default: the slots sorted by expert, one torch._grouped_mm each
    EAGER = "eager"  # a Python loop over the experts hit, each on the slots it received


class Dtype(Choice):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


DTYPE_BYTES = {Dtype.BF16: 2, Dtype.FP16: 2, Dtype.FP32: 4}


@record
class Knob:
    """One knob: what it is called, what it may be, and how it reads everywhere.

    `kind` is "choice" (one of `choices`), "name" (a name from a table a floor above, or None: the family,
    checked by memcalc.model.families), "size" (a positive integer, or None for
    the default that depends on other sizes), "count" (a whole number, 0 or more, or None for the default),
    "probability" (0 <= p < 1),
    "factor" (a positive number, or None for none) or "flag" (a boolean). `describe` gives the words of the model's one-line
    description from a config or knob set (None: another knob's words carry it).
    """

    name: str
    kind: str
    default: Any
    help: str
    describe: Callable[[Any], str | None]
    choices: type[Choice] | None = None
    symbol: str | None = None  # the formula symbol for a set value (f, g)
    # (a non-default value, or a mapping of knob values to set together, and what it changes), for docs/model.md
    effects: tuple[tuple[Any, str], ...] = ()
    impls: tuple[str, ...] = ()  # the implementations that have this setting (empty: every one)
    source: str = ""  # where its default comes from, in the library's code (for a setting only `impls` have)

    def variants(self) -> tuple[tuple[dict[str, Any], str], ...]:
        """Each effect as the knob values it sets and what it changes."""
        return tuple((v if isinstance(v, dict) else {self.name: v}, meaning) for v, meaning in self.effects)

    @property
    def flag(self) -> str:
        """The command-line flag: --num-query-groups for num_query_groups."""
        return "--" + self.name.replace("_", "-")

    @property
    def values(self) -> tuple[str, ...]:
        """A choice knob's values, default first."""
        assert self.choices is not None, self.name
        return (self.default.value, *(c.value for c in self.choices if c is not self.default))


def _ffn(k: Any) -> str:
    return str(getattr(k, "ffn", None) or k.ffn_hidden_size or "4h")


def _moe(k: Any) -> str | None:
    """'MoE 8 experts top-2 (expert ffn 14336, shared 5632), capacity 1.25, every 2nd layer, tokens balanced'."""
    if k.num_experts is None:
        return None
    parts = [f"MoE {k.num_experts} experts top-{k.moe_router_topk} (expert ffn {k.moe_ffn_hidden_size or _ffn(k)}"
             + (f", shared {k.moe_shared_expert_intermediate_size})" if k.moe_shared_expert_intermediate_size
                else ")")]
    if k.moe_expert_capacity_factor is not None:
        parts.append(f"capacity {k.moe_expert_capacity_factor:g}"
                     + (" (padded)" if k.moe_pad_expert_input_to_capacity else ""))
    if k.moe_layer_freq != 1:
        parts.append(f"MoE every {k.moe_layer_freq} layers")
    if k.moe_first_dense_layers:
        first = k.moe_first_dense_layers
        parts.append(f"first {first} layer{'s' if first != 1 else ''} dense")
    if k.moe_router_score_function != ScoreFunction.SOFTMAX:
        parts.append(f"{k.moe_router_score_function} router"
                     + (" with expert bias" if k.moe_router_enable_expert_bias else ""))
    if k.moe_token_dispatcher_type != Dispatcher.ALLTOALL:
        parts.append(f"{k.moe_token_dispatcher_type} dispatcher")
    if k.moe_aux_loss:
        parts.append("aux loss")
    if k.moe_router_pre_softmax:
        parts.append("pre-softmax router")
    if k.impl == Impl.HF or k.experts_implementation != ExpertsImplementation.GROUPED_MM:  # transformers' choice
        parts.append(f"{k.experts_implementation} experts")
    return ", ".join([*parts, f"tokens {k.moe_tokens}"])


def _said_alone(owner: str, name: str) -> Callable[[Any], str | None]:
    """A knob that means something only with `owner` (num_experts, kv_lora_rank), set without it: said, so that a
    description never hides it (the checks refuse it)."""
    return lambda k: (None if getattr(k, owner) is not None or getattr(k, name) == BY_NAME[name].default
                      else f"{name} {getattr(k, name)}")


_moe_knob, _mla_knob = partial(_said_alone, "num_experts"), partial(_said_alone, "kv_lora_rank")


def _heads(k: Any) -> str:
    """What attention's heads are: '8 K/V groups', or with latent attention its widths in place of K/V groups,
    'MLA: q latent 1536, kv latent 512, heads 128+64, v 128'."""
    if k.kv_lora_rank is None:
        groups = getattr(k, "groups", None) or k.num_query_groups or "a"
        return f"{groups} K/V groups" + (f", heads of {k.kv_channels}" if head_dim_set(k) else "")
    query = f"q latent {k.q_lora_rank}" if k.q_lora_rank is not None else "no q latent"
    return (f"MLA: {query}, kv latent {k.kv_lora_rank}, heads {k.qk_nope_head_dim}+{k.qk_rope_head_dim},"
            f" v {k.v_head_dim}")


def head_dim_set(k: Any) -> bool:
    """Whether heads are kv_channels wide where that is not h/a (a config's) or is set at all (a knob set's)."""
    h, a = getattr(k, "h", None), getattr(k, "a", None)
    return k.kv_channels is not None and not (h is not None and a is not None and k.kv_channels * a == h)


def _hf(family: str, norm: Norm, mlp: Mlp = Mlp.GELU, **knobs: Any) -> dict[str, Any]:
    """A transformers family's layer, eager, as knob values (docs/model.md's variants)."""
    return {"impl": Impl.HF, "family": family, "norm": norm, "mlp": mlp, "attention": Attention.EAGER, **knobs}


# The knob values that turn latent attention on, in symbols (docs/model.md's variants).
_MLA_ON = {"kv_lora_rank": 1, "qk_rope_head_dim": 1, "qk_nope_head_dim": 1, "v_head_dim": 1}

KNOBS: tuple[Knob, ...] = (
    Knob(
        "impl", "choice", Impl.MEGATRON,
        "whose code runs the layer: megatron (Megatron-core), torchtitan, hf (Hugging Face transformers), paper"
        " (Korthikanti et al.'s accounting itself)",
        lambda k: None if k.impl == Impl.MEGATRON else f"impl {k.impl}", Impl,
    ),
    Knob(
        "family", "name", None, "the transformers family whose decoder layer --impl hf runs (config.json's"
        " model_type, one of `memcalc hf-families`; default: Llama's for RMSNorm and SwiGLU, GPT-2's for LayerNorm"
        " and GELU)", lambda k: None if k.family is None else f"{k.family} family",
    ),
    Knob(
        "mlp", "choice", Mlp.GELU, "MLP activation (gelu_tanh: GELU's tanh approximation)",
        lambda k: f"{k.mlp} (ffn {_ffn(k)})", Mlp,
        effects=(({"mlp": Mlp.SWIGLU, "ffn_hidden_size": 1}, "SwiGLU computes SiLU(gate) * up: backward needs the gate (for SiLU's derivative)"
                  " and both factors of the product, three (b, s, f) tensors where GELU kept one."),),
    ),
    Knob(
        "ffn_hidden_size", "size", None, "MLP hidden size (default 4h)", lambda k: None, symbol="f",
        effects=((1, "An MLP width f other than 4h changes only the two tensors of that width."),),
    ),
    Knob(
        "attention", "choice", Attention.EAGER, "core attention: eager (op by op) or flash (a fused kernel)",
        lambda k: f"{k.attention} attention ({_heads(k)})", Attention,
        effects=((Attention.FLASH, "A fused kernel never materialises the s x s scores: backward rebuilds them"
                  " from Q, K and V, and regenerates the dropout mask from the RNG seed."),),
    ),
    Knob(
        "num_query_groups", "size", None, "K/V groups (default a, multi-head)", lambda k: None, symbol="g",
        effects=((1, "Grouped-query attention keeps K and V for g groups of heads instead of a."),),
    ),
    Knob(
        "kv_channels", "size", None, "channels of each attention head (Megatron-LM's kv_channels, transformers'"
        " head_dim; default h/a)", lambda k: None, symbol="d",
        effects=((1, "Heads of d channels where a*d need not be h (Qwen3: h 2048, 32 heads of 128): Q, K, V and the"
                  " output projection's input are a*d (K and V g*d) wide; the layer's input and output stay h."),),
    ),
    Knob(
        "qk_layernorm", "flag", False, "normalise each query and key head over its d channels before QK^T"
        " (Megatron-LM's qk_layernorm; Qwen3's q_norm and k_norm), with the layer's norm",
        lambda k: "QK norm" if k.qk_layernorm else None,
        effects=((True, "A norm on each query head and each key head (Qwen3's q_norm, k_norm) keeps its input, a"
                  " second copy of Q and K, and each head's statistics."),
                 (_hf("cohere", Norm.LAYERNORM_NB, Mlp.SWIGLU, parallel_residual=True, single_norm=True,
                      qk_layernorm=True),
                  "Cohere's use_qk_norm (Command R+): a CohereLayerNorm on each query and key head, keeping per head"
                  " what the layer's norm keeps (x - mean twice, rstd, the normalised input, all fp32), and its"
                  " (heads, d) weight's fp32 copy. Under tp transformers' plan leaves that weight whole and fails."),),
    ),
    Knob(
        "norm", "choice", Norm.LAYERNORM, "normalisation", lambda k: f"{k.norm}", Norm,
        effects=((Norm.RMSNORM, "RMSNorm subtracts no mean; under the paper's accounting nothing changes"
                  " (see the exact variant)."),),
    ),
    Knob(
        "dropout", "probability", 0.1, "dropout probability; 0 saves no masks", lambda k: f"dropout {k.dropout}",
        effects=((0.0, "Without dropout there are no masks, and the weights x V matmul reads the softmax output"
                  " itself."),),
    ),
    Knob(
        "recompute", "choice", Recompute.NONE, "activation recomputation", lambda k: f"recompute {k.recompute}",
        Recompute,
        effects=(
            (Recompute.SELECTIVE, "Selective recomputation (Korthikanti et al. 2022) reruns the attention core in"
             " backward, so none of its s x s tensors is kept."),
            (Recompute.FULL, "Full recomputation keeps only the layer's input and reruns the whole forward in"
             " backward."),
        ),
    ),
    Knob(
        "dtype", "choice", Dtype.BF16, "activation dtype", lambda k: f"{k.dtype}", Dtype,
        effects=((Dtype.FP32, "Activations take the wider dtype; dropout masks stay one byte."),),
    ),
    Knob(
        "bias_activation_fusion", "flag", False,
        "megatron: fused bias + activation kernel (bias_activation_fusion; keeps the fc1 output only)",
        lambda k: "fused bias-activation" if k.bias_activation_fusion else None,
        effects=(({"mlp": Mlp.SWIGLU, "ffn_hidden_size": 1, "bias_activation_fusion": True},
                  "Megatron's fused bias-SwiGLU (BiasSwiGLUFunction) keeps only fc1's 2f-wide output; unfused, the"
                  " layer also keeps SiLU's output and a copy of up."),),
    ),
    # -- Megatron's softmax: its defaults are what Megatron-LM's pretrain_gpt.py runs unless a flag says otherwise
    # (megatron/training/arguments.py; see docs/impl-megatron.md), not TransformerConfig's dataclass defaults.
    Knob(
        "attention_softmax_in_fp32", "flag", False,
        "megatron: run the unfused attention softmax in fp32 (Megatron-LM's --attention-softmax-in-fp32, off unless"
        " given); changes what is kept only where the fused kernel does not run",
        lambda k: "softmax in fp32" if k.attention_softmax_in_fp32 else None,
        effects=(({"attention_softmax_in_fp32": True, "masked_softmax_fusion": False},
                  "The unfused softmax runs in fp32 (Megatron-LM's --attention-softmax-in-fp32): it keeps its fp32"
                  " output, four bytes an element, where the 16-bit softmax kept two, and the (s, s) causal mask."),),
        impls=(Impl.MEGATRON,),
        source="Megatron-LM megatron/training/arguments.py, _add_mixed_precision_args:"
        " `group.add_argument('--attention-softmax-in-fp32', action='store_true', help='Run attention masking and"
        " softmax in fp32.')`, so off unless given (only --apply-query-key-layer-scaling turns it on); not"
        " TransformerConfig's dataclass default, `attention_softmax_in_fp32: bool = True` (megatron-core 0.16.1,"
        " megatron/core/transformer/transformer_config.py:343), which pretrain_gpt.py overrides from the arguments."
        " What it changes: megatron/core/fusions/fused_softmax.py:313-340, FusedScaleMaskSoftmax.forward_torch_softmax"
        " casts the scores to fp32 only `if self.input_in_float16 and self.softmax_in_fp32`",
    ),
    Knob(
        "masked_softmax_fusion", "flag", True,
        "megatron: the fused scale-mask-softmax kernel (Megatron-LM's default; --no-masked-softmax-fusion turns it"
        " off), which runs for 16 < s <= 4096, s % 4 == 0 and b*a/t a multiple of its batch per block",
        lambda k: None if k.masked_softmax_fusion else "unfused softmax",
        effects=(({"masked_softmax_fusion": False},
                  "Without the fused softmax (--no-masked-softmax-fusion) FusedScaleMaskSoftmax runs torch's: its"
                  " masked_fill_ keeps the (s, s) causal mask at every size, beside the softmax output."),),
        impls=(Impl.MEGATRON,),
        source="Megatron-LM megatron/training/arguments.py, _add_training_args:"
        " `group.add_argument('--no-masked-softmax-fusion', action='store_false', help='Disable fusion of"
        " query_key_value scaling, masking, and softmax.', dest='masked_softmax_fusion')`, so on unless"
        " --no-masked-softmax-fusion is given; not TransformerConfig's dataclass default, `masked_softmax_fusion:"
        " bool = False` (megatron-core 0.16.1, megatron/core/transformer/transformer_config.py:357). What it changes:"
        " megatron/core/fusions/fused_softmax.py:238-270, FusedScaleMaskSoftmax.is_kernel_available (the window)",
    ),
    # -- Megatron's pipeline split (memcalc.config.schema.megatron_chunk_layers): where each pipeline rank's layers
    # are; no layer keeps anything else, so each variant's layer is the seed's.
    *(Knob(
        f"num_layers_in_{end}_pipeline_stage", "size", None,
        f"megatron: the {end} pipeline stage holds this many layers, the stages between an equal share of the rest"
        f" (megatron-core's num_layers_in_{end}_pipeline_stage, Megatron-LM's --decoder-{end}-pipeline-num-layers;"
        " default: L/pp a stage)",
        lambda k, end=end: (None if getattr(k, f"num_layers_in_{end}_pipeline_stage") is None
                            else f"{end} pipeline stage {getattr(k, f'num_layers_in_{end}_pipeline_stage')} layers"),
        effects=(({f"num_layers_in_{end}_pipeline_stage": 3},
                  f"No layer keeps anything else: the {end} pipeline stage holds three layers (per GPU: --totals)."),),
        impls=(Impl.MEGATRON, Impl.PAPER),
        source=f"megatron-core 0.16.1, megatron/core/transformer/transformer_config.py:62-68 (`num_layers_in_{end}"
        "_pipeline_stage: Optional[int] = None`); placed by transformer_block.py get_num_layers_to_build and"
        " transformer_layer.py get_transformer_layer_offset",
    ) for end in ("first", "last")),
    *(Knob(
        f"account_for_{end}_in_pipeline_split", "flag", False,
        f"megatron: the {end} counts as a layer when the layers are split over the pipeline stages, so the"
        f" {stage} stage holds one layer fewer (megatron-core's account_for_{end}_in_pipeline_split)",
        lambda k, end=end: f"{end} counted in the pipeline split" if getattr(k, f"account_for_{end}_in_pipeline_split")
        else None,
        effects=(({f"account_for_{end}_in_pipeline_split": True},
                  f"No layer keeps anything else: the {stage} pipeline stage holds one layer fewer (per GPU:"
                  " --totals)."),),
        impls=(Impl.MEGATRON, Impl.PAPER),
        source=f"megatron-core 0.16.1, megatron/core/transformer/transformer_config.py:96-102 (`account_for_{end}"
        "_in_pipeline_split: bool = False`); placed by transformer_block.py get_num_layers_to_build",
    ) for end, stage in (("embedding", "first"), ("loss", "last"))),
    Knob(
        "num_experts", "size", None, "routed experts in a mixture-of-experts MLP (default: none, a dense MLP)",
        _moe, symbol="E",
        effects=(({"num_experts": 8}, "A mixture-of-experts MLP: a router scores each token against E experts and"
                  " sends it to its top k; each expert's MLP keeps its activations for the r token slots this rank's"
                  " experts receive (r = kbs when the load is balanced, the default bound)."),),
    ),
    Knob(
        "moe_router_topk", "size", 2, "experts each token is routed to (top-k)", _moe_knob("moe_router_topk"),
        symbol="k",
        effects=(({"num_experts": 8, "moe_router_topk": 4}, "k experts per token: r = kbs token slots when balanced."),),
    ),
    Knob(
        "moe_ffn_hidden_size", "size", None, "one expert's MLP hidden size (default: the MLP's, f or 4h)",
        _moe_knob("moe_ffn_hidden_size"), symbol="e",
        effects=(({"num_experts": 8, "moe_ffn_hidden_size": 1}, "An expert width e other than the dense MLP's."),),
    ),
    Knob(
        "moe_shared_expert_intermediate_size", "size", None,
        "shared experts' total MLP hidden size, run on every token (default: no shared experts)",
        _moe_knob("moe_shared_expert_intermediate_size"), symbol="u",
        effects=(({"num_experts": 8, "moe_shared_expert_intermediate_size": 1},
                  "Shared experts run a dense MLP of width u on every token beside the routed ones."),),
    ),
    Knob(
        "moe_expert_capacity_factor", "factor", None,
        "each expert keeps at most ceil(c*k*b*s/E) tokens (default: no capacity, no dropping)",
        _moe_knob("moe_expert_capacity_factor"), symbol="c",
        effects=(({"num_experts": 8, "moe_expert_capacity_factor": 1.0, "moe_tokens": MoeTokens.CAPACITY},
                  "With a capacity factor c each expert drops the tokens beyond ceil(ckbs/E): the capacity bound,"
                  " r = ckbs (the formula leaves out the rounding up)."),),
    ),
    Knob(
        "moe_pad_expert_input_to_capacity", "flag", False,
        "megatron: pad each expert's tokens to its capacity, so every expert gets exactly ceil(c*k*b*s/E)"
        " (Megatron-LM's moe_pad_expert_input_to_capacity; needs moe_expert_capacity_factor)",
        _moe_knob("moe_pad_expert_input_to_capacity"),
        effects=(({"num_experts": 8, "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True,
                   "moe_tokens": MoeTokens.CAPACITY},
                  "Padded to capacity, every expert receives exactly ceil(ckbs/E) slots whatever the route, so the"
                  " capacity bound is what is kept; the permutation gathers the probabilities by index, keeping the"
                  " indices in place of the routing map and the transposed probabilities."),),
    ),
    Knob(
        "moe_token_dispatcher_type", "choice", Dispatcher.ALLTOALL,
        "megatron: how tokens reach their experts: alltoall (over ep, as Megatron-LM's MoE recipes set it) or"
        " allgather (every rank gathers the tp*ep group's tokens; megatron-core's own default)",
        _moe_knob("moe_token_dispatcher_type"), Dispatcher,
        effects=(({"num_experts": 8, "moe_token_dispatcher_type": Dispatcher.ALLGATHER},
                  "The all-gather dispatcher gathers every token of the tp*ep group on each rank: the routing map and"
                  " transposed probabilities it keeps are its local experts' columns of the ep*b*s gathered tokens"
                  " (b*s*E, whole under SP), and its permutation indices the r slots its experts receive."),),
    ),
    Knob(
        "moe_layer_freq", "size", 1, "one MoE layer every this many layers, dense MLPs between (layer i is MoE"
        " when i % freq == 0; impl hf: (i + 1) % freq, its decoder_sparse_step)", _moe_knob("moe_layer_freq"),
        effects=(({"num_experts": 8, "moe_layer_freq": 2},
                  "Every second layer is a MoE layer and the rest keep the dense MLP: per layer is the MoE layer's"
                  " formula; all L layers add ceil(L/2) of these and the rest dense."),),
    ),
    Knob(
        "moe_first_dense_layers", "size", None, "the first this many layers keep a dense MLP, MoE layers from there"
        " (DeepSeek's first_k_dense_replace; Megatron-LM's --moe-layer-freq ([0]*k+[1]*(L-k)))",
        _moe_knob("moe_first_dense_layers"),
        effects=(({"num_experts": 8, "moe_first_dense_layers": 3},
                  "The first three layers keep the dense MLP: per layer is the MoE layer's formula; all L layers add"
                  " the MoE layers from layer 3 on and three dense ones."),),
    ),
    Knob(
        "moe_router_score_function", "choice", ScoreFunction.SOFTMAX,
        "the router's score: softmax over the experts, or each expert's sigmoid (DeepSeek-V3)",
        _moe_knob("moe_router_score_function"), ScoreFunction,
        effects=(({"num_experts": 8, "moe_router_score_function": ScoreFunction.SIGMOID},
                  "A sigmoid router keeps every expert's sigmoid score (its backward reads its output) and the"
                  " renormalisation's divisor and chosen scores, in place of the softmax over the top k."),),
    ),
    Knob(
        "moe_router_enable_expert_bias", "flag", False,
        "megatron: the sigmoid router picks the top k on scores plus a per-expert bias (DeepSeek-V3's aux-loss-free"
        " balancing; Megatron-LM's moe_router_enable_expert_bias)", _moe_knob("moe_router_enable_expert_bias"),
        effects=(({"num_experts": 8, "moe_router_score_function": ScoreFunction.SIGMOID,
                   "moe_router_enable_expert_bias": True},
                  "With the expert bias the top k are picked on biased scores and the unbiased ones gathered: the"
                  " gather keeps every expert's score, cast to the activation dtype."),),
    ),
    Knob(
        "moe_tokens", "choice", MoeTokens.BALANCED,
        "which bound on the tokens an expert receives: balanced (k*b*s/E each), capacity (the capacity factor's),"
        " worst (no capacity: every token's k experts on one rank)",
        _moe_knob("moe_tokens"), MoeTokens,
        effects=(({"num_experts": 8, "moe_tokens": MoeTokens.WORST},
                  "The worst case without capacity: every token of the ep ranks that share experts routes its k"
                  " experts to this rank, r = ep*kbs (while k*ep <= E; else Ebs)."),),
    ),
    Knob(
        "moe_aux_loss", "flag", False, "an auxiliary load-balancing loss (Switch Transformer) on each MoE layer's"
        " router", _moe_knob("moe_aux_loss"),
        effects=(({"num_experts": 8, "moe_aux_loss": True},
                  "The load-balancing loss keeps the softmax over all E experts' scores for its gradient."),),
    ),
    Knob(
        "moe_router_pre_softmax", "flag", False, "the routing weights are the softmax over all E experts, not"
        " renormalised over the top k (Megatron-LM's moe_router_pre_softmax; transformers' norm_topk_prob false)",
        _moe_knob("moe_router_pre_softmax"),
        effects=(({"num_experts": 8, "moe_router_pre_softmax": True},
                  "The top-k probabilities are used as they are: no sum over the k chosen experts is divided by,"
                  " so none is kept."),),
    ),
    Knob(
        "experts_implementation", "choice", ExpertsImplementation.GROUPED_MM,
        "hf: how transformers runs the experts (config.json's experts_implementation): grouped_mm (its default, on"
        " CPU and CUDA alike: the slots sorted by expert, one grouped matmul per projection) or eager (a loop over"
        " the experts)", _moe_knob("experts_implementation"), ExpertsImplementation,
        effects=((_hf("mixtral", Norm.RMSNORM, Mlp.SWIGLU, num_experts=8,
                      experts_implementation=ExpertsImplementation.EAGER),
                  "transformers' eager experts loop over the experts one at a time: each keeps its slots' (token,"
                  " top-k slot) pairs and index_add_'s source, a second (r, h) copy of the weighted output, where"
                  " the default grouped_mm keeps three int64 permutations of the r slots and E int32 offsets"
                  " (shown against Megatron's default layer: every term of transformers' MoE layer)."),),
    ),
    Knob(
        "kv_lora_rank", "size", None, "multi-head latent attention (DeepSeek-V2/V3): the key/value latent's width"
        " (default: none, plain attention; needs qk_rope_head_dim, qk_nope_head_dim, v_head_dim)", lambda k: None,
        symbol="r_kv",
        effects=((_MLA_ON | {"q_lora_rank": 1},
                  "Multi-head latent attention: the layer keeps the query and key/value latents (r_q, r_kv per"
                  " token) with their norms and the up projections' inputs, and the core keeps per-head Q and K"
                  " of d_n + d_r channels (K's RoPE part is one head's, copied to all) and V of d_v."),
                 (_MLA_ON, "Without a query latent (q_lora_rank unset, DeepSeek-V2-Lite) the query comes from x"
                  " itself: no query norm, no q_up input."),),
    ),
    # latent attention's other widths: (name, what it is, symbol), each said alone without kv_lora_rank
    *(Knob(name, "size", None, f"latent attention: {what}", _mla_knob(name), symbol=symbol) for name, what, symbol in (
        ("q_lora_rank", "the query latent's width (default: none, Q projected from x)", "r_q"),
        ("qk_rope_head_dim", "each query/key head's RoPE channels", "d_r"),
        ("qk_nope_head_dim", "each query/key head's channels without RoPE", "d_n"),
        ("v_head_dim", "each value head's channels", "d_v"),
    )),
    # -- what transformers' decoder families add (memcalc.model.families.FAMILIES) --
    Knob(
        "sliding_window", "size", None, "each query attends to the last W keys only (Mistral's sliding_window;"
        " default: full causal attention); kept bytes are full causal's: counted at s > W under --impl hf"
        " --attention eager only, which keeps the (s, s) probabilities whatever the mask",
        lambda k: None if k.sliding_window is None else f"sliding window {k.sliding_window}",
        effects=((4096, "A sliding window keeps what full causal attention keeps where memcalc counts it: for s <= W"
                  " it masks nothing, and transformers' eager attention adds its mask to the whole (s, s) scores."),),
    ),
    Knob(
        "sandwich_norm", "flag", False, "hf: a norm also on the attention's and the MLP's output, before each residual"
        " add (Gemma 2/3's post_attention_layernorm and post_feedforward_layernorm)",
        lambda k: "sandwich norms" if k.sandwich_norm else None,
        effects=((_hf("gemma2", Norm.RMSNORM_1P, Mlp.GEGLU_TANH, sandwich_norm=True),
                  "Four norms a layer: the two output norms keep what the input norms keep, on the attention's and"
                  " the MLP's (b, s, h) outputs."),),
    ),
    Knob(
        "attn_logit_softcapping", "factor", None, "hf: attention scores become c * tanh(scores / c) before the softmax"
        " (Gemma 2's attn_logit_softcapping; eager only)",
        lambda k: None if k.attn_logit_softcapping is None else f"softcap {k.attn_logit_softcapping:g}",
        effects=((_hf("gemma2", Norm.RMSNORM_1P, Mlp.GEGLU_TANH, sandwich_norm=True, attn_logit_softcapping=50.0),
                  "Soft-capping keeps tanh's (b, a, s, s) output, whose derivative 1 - tanh^2 backward reads."),),
    ),
    Knob(
        "final_logit_softcapping", "factor", None, "hf: the logits become c * tanh(logits / c) before the loss (Gemma"
        " 2's final_logit_softcapping): tanh keeps its (b, s, v) output beside the loss's, outside the layers",
        lambda k: None if k.final_logit_softcapping is None else f"logits softcap {k.final_logit_softcapping:g}",
        effects=((_hf("gemma2", Norm.RMSNORM_1P, Mlp.GEGLU_TANH, sandwich_norm=True, final_logit_softcapping=30.0),
                  "The layer keeps what Gemma 2's keeps: the logits are soft-capped after lm_head, where the output"
                  " end keeps tanh's (b, s, v) output in the activation dtype beside the loss's logits (--totals)."),),
    ),
    Knob(
        "loss_chunks", "count", None, "torchtitan: its ChunkedLossWrapper splits the final norm's output into this"
        " many sequence chunks, each run through lm_head, the loss and their backward in turn (its model configs'"
        " loss; default 8, its num_chunks); 0: its plain CrossEntropyLoss over the whole logits (its *_ce_loss"
        " configs)",
        lambda k: None if k.loss_chunks is None else "plain loss" if k.loss_chunks == 0 else
        f"loss in {k.loss_chunks} chunks", impls=(Impl.TORCHTITAN,),
        source="torchtitan 0.3.0 components/loss.py, ChunkedLossWrapper.Config: `num_chunks: int = 8`; every model"
        " config of its config_registry.py sets `loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(...))`"
        " but llama3_debugmodel_ce_loss, whose `loss=CrossEntropyLoss.Config()` is the plain loss",
    ),
    Knob(
        "parallel_residual", "flag", False, "hf: attention and MLP both read the layer's input: each through its own"
        " norm with rotary_percent (GPT-NeoX's use_parallel_residual), without it Falcon's parallel_attn (RoPE on"
        " whole heads) through one norm (single_norm, Falcon-7B's) or ln_attn and ln_mlp (new_decoder_architecture)", lambda k: "parallel residual" if k.parallel_residual else None,
        effects=((_hf("gpt_neox", Norm.LAYERNORM, rotary_percent=0.25, fused_qkv=True, parallel_residual=True),
                  "Both norms read the layer's input: the second norm keeps no input of its own (the first's is the"
                  " same storage), only its statistics."),
                 (_hf("falcon", Norm.LAYERNORM, dropout=0.0, parallel_residual=True, single_norm=True,
                      num_query_groups=1),
                  "FalconDecoderLayer (multi_query): one norm, whose output both the attention and the MLP read (no"
                  " second norm, no MLP input of its own); matmul broadcasts the one K/V head to every query head, a"
                  " copy each, and indexing keeps the two one-element indices that picked them; the softmax stays in"
                  " the activation dtype."),),
    ),
    Knob(
        "rotary_percent", "factor", None, "hf: RoPE on this fraction of each head's channels (GPT-NeoX's rotary_pct,"
        " StarCoder 2's 1; default: RoPE on all of them, or none in a LayerNorm layer, GPT-2's)",
        lambda k: None if k.rotary_percent is None else f"rotary {k.rotary_percent:g}", symbol="d_r",
        effects=((_hf("gpt_neox", Norm.LAYERNORM, rotary_percent=0.25, fused_qkv=True),
                  "GPTNeoXLayer: RoPE's cos and sin tables are d_r = d * rotary_pct channels wide, Llama's fp32"
                  " softmax is kept, and Q, K (rotated and concatenated) and V are the core's."),
                 (_hf("starcoder2", Norm.LAYERNORM, rotary_percent=1.0, num_query_groups=2),
                  "Starcoder2DecoderLayer: a LayerNorm layer whose separate q, k and v (under GQA too) are rotated"
                  " whole (s, d) tables; Llama's fp32 softmax and its cast, and the attention's and the MLP's"
                  " outputs dropped out with dropout > 0. Its tp plan is the paper's: LayerNorms whole, the rest"
                  " split by t."),),
    ),
    Knob(
        "post_norm", "flag", False, "hf: the norms on the attention's and the MLP's outputs only, before each residual"
        " add, none on their inputs (OLMo 2's post_attention_layernorm and post_feedforward_layernorm)",
        lambda k: "post-norms" if k.post_norm else None,
        effects=((_hf("olmo2", Norm.RMSNORM_FP32W, Mlp.SWIGLU, qk_layernorm=True, post_norm=True),
                  "Olmo2DecoderLayer: no norm before the attention or the MLP (q, k, v and gate, up read the residual"
                  " stream itself); its two norms keep an fp32 copy of the attention's and the MLP's outputs, the"
                  " fp32 rstd and the fp32 normalised output; q_norm and k_norm run over the whole projection width"
                  " (a*d and g*d), one rstd a token. Under tp its plan gathers q, k and v (colwise_gather_output):"
                  " every rank keeps all heads' attention."),),
    ),
    Knob(
        "fused_qkv", "flag", False, "hf: Q, K and V sliced from one fused projection's output: Phi-3's qkv_proj (and"
        " gate and up chunked from one gate_up_proj output), GPT-NeoX's query_key_value (set with rotary_percent),"
        " Falcon's new_decoder_architecture (with parallel_residual and no rotary_percent: per K/V group a/g query"
        " heads, one key, one value)",
        lambda k: None if not k.fused_qkv else "fused qkv_proj and gate_up_proj" if k.mlp == "swiglu"
        else "fused query_key_value",
        effects=((_hf("phi3", Norm.RMSNORM, Mlp.SWIGLU, fused_qkv=True),
                  "Q, K and V are views of one (b, s, (a+2g)d) output: where eager attention's matmul takes V as it"
                  " is (b = 1, one K/V group) it keeps that whole output; gate and up are two halves of one storage."
                  " Under tp transformers' Phi-3 plan gathers both fused outputs (colwise_gather_output), so every"
                  " rank keeps all heads' attention and the whole gate, up and SiLU; only o_proj's and down_proj's"
                  " inputs are split (rowwise_split_input)."),
                 (_hf("falcon", Norm.LAYERNORM, dropout=0.0, parallel_residual=True, fused_qkv=True,
                      num_query_groups=2),
                  "FalconDecoderLayer with new_decoder_architecture (Falcon-40B/180B): ln_attn and ln_mlp both read"
                  " the layer's input (the second keeps only its statistics, and dense_h_to_4h its own output);"
                  " _split_heads indexes each group's key and value (two one-element indices kept) and broadcasts"
                  " them to every head, so RoPE's K and eager matmul's (or SDPA's) V are a heads wide, except V at"
                  " b = 1 with one group (eager) or with one group (SDPA, its default), a view of the (b, s, 1, 1, d)"
                  " index output; the softmax stays in the activation dtype."),),
    ),
    Knob(
        "alibi", "flag", False, "hf: ALiBi: a per-head linear bias on the attention scores in place of position"
        " embeddings (BLOOM's; the bias is built once per model and keeps nothing in a layer)",
        lambda k: "ALiBi" if k.alibi else None,
        effects=((_hf("bloom", Norm.LAYERNORM, Mlp.GELU_TANH, alibi=True),
                  "BloomBlock: baddbmm adds the bias to QK^T and keeps only Q and K^T (the bias needs no gradient);"
                  " the softmax runs in fp32 and is cast back, as Llama's eager core; BLOOM's tanh GELU, a custom"
                  " autograd function, keeps its input alone."),),
    ),
    Knob(
        "single_norm", "flag", False, "hf: with parallel_residual, one norm before both the attention and the MLP,"
        " whose output both read (GPT-J's ln_1, Cohere's and Falcon's input_layernorm: Falcon-7B's always,"
        " new_decoder_architecture's with num_ln_in_parallel_attn 1)",
        lambda k: "one norm" if k.single_norm else None,
        effects=((_hf("gptj", Norm.LAYERNORM, Mlp.GELU_TANH, rotary_percent=0.25, parallel_residual=True,
                      single_norm=True),
                  "GPTJBlock: one LayerNorm, whose output q, k, v and fc_in all read (kept once); the eager core"
                  " upcasts Q and K to fp32 before QK^T (matmul keeps both fp32), and RoPE's interleaved tables are"
                  " repeated for Q and for K, four (s, d_r) tables kept a layer."),
                 (_hf("cohere", Norm.LAYERNORM_NB, Mlp.SWIGLU, parallel_residual=True, single_norm=True),
                  "CohereDecoderLayer: one CohereLayerNorm (LayerNorm without bias, written out in fp32), whose output"
                  " q, k, v, gate and up all read (kept once); it keeps x - mean twice in fp32 (pow(2) and the"
                  " product by rstd each compute it), the fp32 rstd, the fp32 weight and the fp32 normalised input."
                  " RoPE, the core and SwiGLU are Llama's; its tp plan is the paper's, the norm whole."),),
    ),
    Knob(
        "attention_sinks", "flag", False, "hf: a learned logit per head joined to each query's scores before the"
        " softmax and dropped after it (gpt-oss's sinks; eager only)",
        lambda k: "attention sinks" if k.attention_sinks else None,
        effects=((_hf("gpt_oss", Norm.RMSNORM_FP32W, Mlp.SWIGLU_CLAMPED, dropout=0.0, num_experts=8,
                      attention_sinks=True),
                  "GptOssDecoderLayer: the sink column widens the scores to s + 1 keys; max's int64 indices (the"
                  " logits less their row maximum) and the softmax's (b, a, s, s + 1) output in the activation dtype"
                  " are kept, and weights x V reads the first s columns of that output as a view, so no fp32 softmax"
                  " and no cast are kept. Its experts' clamped GLU keeps gate_up's output, the clamped gate, the"
                  " sigmoid, up + 1 and the GLU, five e-wide tensors a slot beside the down projection's input;"
                  " grouped_mm's bias gather keeps the sorted expert ids."),),
    ),
)
BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


LOSS_CHUNKS = 8  # torchtitan's ChunkedLossWrapper.Config.num_chunks, its loss unless loss_chunks says otherwise
MLA_KNOBS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def is_moe(knob: Knob) -> bool:
    """A mixture-of-experts knob: num_experts and the moe_* knobs that mean something only with it."""
    return knob.name in ("num_experts", "experts_implementation") or knob.name.startswith("moe_")


def _knobs_namespace() -> dict[str, Any]:
    """The properties every knob set (and so every config) has, beside its fields."""

    def of(cls: type, config: Any) -> Any:
        """The knobs of a config (or another knob set), alone: a small, hashable key.

        K/V groups equal to the heads are multi-head attention, and heads of h/a channels plain heads, as if unset.
        """
        values = {k.name: getattr(config, k.name) for k in KNOBS}
        if values["num_query_groups"] == getattr(config, "a", None):
            values["num_query_groups"] = None
        if not head_dim_set(config):  # heads of h/a, as if unset
            values["kv_channels"] = None
        return Knobs(**values)

    return {
        "__doc__": "The choices that decide which tensors a layer saves; defaults are the seed's model (KNOBS).",
        "of": classmethod(of),
        "has_dropout": property(lambda self: self.dropout > 0, doc="any dropout at all: masks are kept only when p > 0"),
        "ffn_set": property(lambda self: self.ffn_hidden_size is not None, doc="formulas write f, not 4h"),
        "gqa": property(lambda self: self.num_query_groups is not None, doc="formulas write g, not a"),
        "head_dim_set": property(head_dim_set, doc="formulas write d, not h/a (a config's heads are not h/a wide)"),
        "moe": property(lambda self: self.num_experts is not None, doc="the MLP is a mixture of experts"),
        "loss_chunk_count": property(lambda self: LOSS_CHUNKS if self.loss_chunks is None else self.loss_chunks,
                                     doc="the chunks torchtitan's loss runs in (0: its plain loss)"),
        "mla": property(lambda self: self.kv_lora_rank is not None, doc="attention is multi-head latent attention"),
        "dense": property(lambda self: replace(self, **{k.name: k.default for k in KNOBS if is_moe(k)}),
                          doc="these knobs with a dense MLP (every MoE knob at its default)"),
    }


_TYPES = {"choice": str, "name": "str | None", "size": "int | None", "count": "int | None", "probability": float,
          "factor": "float | None", "flag": bool}

Knobs = record(type("Knobs", (), _knobs_namespace() | {  # __module__: for pickling across the probe's processes
    "__module__": __name__, "__annotations__": {k.name: k.choices or _TYPES[k.kind] for k in KNOBS},
    **{k.name: field(default=k.default, metadata={"knob": k, "help": k.help}) for k in KNOBS},  # for the config schema
}), kw_only=True)


@record
class Accounting:
    """How strictly to count (the paper's terms only, or every saved byte), and the run's facts beyond the layer's
    knobs that decide what it keeps.

    `device` matters only for exact accounting: LayerNorm statistics are fp32
    on CUDA but kept in the activation dtype on CPU, and an implementation may
    keep other tensors where a CPU kernel is not its CUDA twin.
    `layer_inputs_cast` is the config's layout, not a choice: `estimate` sets it
    from the config's (ModelConfig.layer_inputs_cast) for every caller.
    """

    exact: bool = False
    device: str = "cuda"
    # FSDP2's mixed precision (dp_shard set) casts every floating tensor a sharded layer is called with to the
    # activation dtype: a table the model hands its layers in fp32 (OLMo's RoPE) reaches each layer as its own copy
    layer_inputs_cast: bool = False


FIXED_BYTES = {Kind.MASK: 1, Kind.INT64: 8, Kind.INDEX_PAIR: 16, Kind.FP32: 4, Kind.INT32: 4}  # not the dtype's width


def element_bytes(kind: Kind, knobs: Any, accounting: Accounting) -> int:
    """Bytes per element of a tensor of this kind."""
    if kind is Kind.NORM_STATS and accounting.device == "cuda":
        return 4
    return FIXED_BYTES.get(kind) or DTYPE_BYTES[knobs.dtype]
