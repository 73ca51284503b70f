"""Each implementation's parameters, tensor by tensor: module path, shape on one rank of t and group, in registration
order. Everything that counts parameters reads these: the groups' counts (memcalc.sizing.states.group_params, summed
over one layer of each kind), Megatron's buffers (states.megatron_chunks), FSDP2's and ZeRO-3's per-parameter padding
(memcalc.sizing.timeline.fsdp, .zero) and the Trainer's group without weight decay.

Each group says why tensor parallelism does or does not split it; the vocabulary is padded as Megatron-LM pads it.
Expert parameters are replicated only over the expert data-parallel group, t*cp*dp/(ep*etp) ranks, which is what the
distributed optimizer shards their states over.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod
from typing import NamedTuple

from memcalc.config.schema import ModelConfig
from memcalc.model.families import layer_family
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import GATED


@dataclass(frozen=True)
class ParamGroup:
    """Weights that sit together, where they live, and why a rank holds the share of them it does."""

    name: str
    # "layer" (every layer), "dense" (every layer with a dense MLP), "moe" (every MoE layer),
    # "first" (with the embedding) or "last" (with the output layer)
    where: str
    why: str
    expert: bool = False  # replicated over the expert data-parallel group only (the distributed optimizer's shards)


QKV = ParamGroup("attention/qkv", "layer", "column-parallel: each rank holds its heads' Q and its groups' K, V"
                 " (latent attention: the down and up projections split by t, the latent norms whole)")
PROJ = ParamGroup("attention/proj", "layer", "row-parallel: the weight is split by t, its bias is whole")
SINKS = ParamGroup("attention/sinks", "layer", "gpt-oss's learned sink logit, one a head: each rank its heads'")
FC1 = ParamGroup("mlp/fc1", "dense", "column-parallel: each rank holds f/t columns (2f/t: SwiGLU's gate and up)")
FC2 = ParamGroup("mlp/fc2", "dense", "row-parallel: the weight is split by t, its bias is whole")
ROUTER = ParamGroup("moe/router", "moe", "whole on every rank: each rank scores its own tokens against all E experts"
                    " (gpt-oss's router, and megatron-core's with add_bias_linear, add a bias an expert)")
EXPERTS = ParamGroup("moe/experts", "moe", "E/ep experts a rank, each fc1 and fc2 split by etp = t (torchtitan at"
                     " ep > 1: whole)", expert=True)
SHARED = ParamGroup("moe/shared_experts", "moe", "one MLP of width u on every token, split by t as the dense MLP"
                    " (transformers' Qwen2-MoE: whole on every rank, as its tp plan names it not, with an h -> 1 gate)")
NORMS = ParamGroup("layer/norms", "layer", "two norms per layer (one with single_norm, four with sandwich_norm), and"
                   " with qk_layernorm the query's and the key's over one head's d channels (shared by every head;"
                   " Cohere's use_qk_norm weighs each head apart, OLMo 2's norms the whole projection), whole on every"
                   " rank (LayerNorm: weight and bias; RMSNorm: weight)")
WORD = ParamGroup("embedding/word", "first", "vocabulary-parallel: each rank holds v/t rows")
EMBEDDING_NORM = ParamGroup("embedding/norm", "first", "BLOOM's word_embeddings_layernorm on the embedding's output,"
                            " whole")
POSITION = ParamGroup("embedding/position", "first", "a learned table (one row per position) is whole on every rank;"
                      " RoPE has no weights")
FINAL_NORM = ParamGroup("final_norm", "last", "the norm before the output layer, whole")
OUTPUT = ParamGroup("output/weight", "last", "vocabulary-parallel; tied to the embedding it costs nothing with one"
                    " stage, but pipelining keeps a copy on the last stage (its gradient is all-reduced with the first"
                    " stage's)")
PARAM_GROUPS: tuple[ParamGroup, ...] = (QKV, PROJ, SINKS, FC1, FC2, ROUTER, EXPERTS, SHARED, NORMS, WORD,
                                        EMBEDDING_NORM, POSITION, FINAL_NORM, OUTPUT)


class Param(NamedTuple):
    """One parameter: its module's path (a bias `path.bias`), its shape on this rank (before FSDP2 shards it), its
    group."""

    module: str
    shape: tuple[int, ...]
    group: ParamGroup


PARTS = ("first", "dense", "moe", "last")  # with the embedding, a dense layer, a MoE layer, with the output layer


class EndModules(NamedTuple):
    """An implementation's modules at the model's two ends, by their paths in the inventory (`part`)."""

    word: str  # the word table
    position: str | None  # the learned position table (None: the implementation has none)
    norm: str  # the final norm
    head: str  # the output layer (tied with one stage: no parameter of its own, the word table's)


def end_modules(c: ModelConfig) -> EndModules:
    """The modules at the two ends of `c`'s implementation (the paper's model: megatron-core's)."""
    return _PARTS.get(c.impl, _PARTS["megatron"])[2]


def padded_vocab(config: ModelConfig, t: int) -> int:
    """v as Megatron-LM pads it (`_vocab_size_with_padding`): up to a multiple of make_vocab_size_divisible_by
    * t (GEMM tiles); the padded rows are real weights, gradients and logits. Other libraries train v as it is."""
    if config.impl != "megatron":
        return config.vocab_size
    step = config.make_vocab_size_divisible_by * t
    return -(-config.vocab_size // step) * step


def vocab_shard(config: ModelConfig, t: int) -> int:
    """Rows of the padded vocabulary one of t ranks holds: the most any holds (torchtitan's DTensor: uneven)."""
    return -(-padded_vocab(config, t) // t)


def expert_tp(config: ModelConfig) -> int:
    """Expert tensor parallelism: etp = t, but torchtitan's experts at ep > 1, whole on each of its expert-parallel
    ranks (which are its TP ranks: memcalc.model.impls.torchtitan.splits)."""
    return 1 if config.impl == "torchtitan" and config.ep > 1 else config.etp or config.t


def etp(c: ModelConfig, t: int) -> int:
    """What splits an expert's linears on a rank of t: t, or 1 where the experts are whole (`expert_tp`)."""
    return t if expert_tp(c) > 1 else 1


def part(c: ModelConfig, t: int, which: str) -> tuple[Param, ...]:
    """One of the model's `PARTS` on a rank of t, as its implementation registers it (the paper's model as
    megatron-core's); a layer's under layer 0's path."""
    layer, path, (word, position, norm, head) = _PARTS.get(c.impl, _PARTS["megatron"])
    if which in ("dense", "moe"):
        return layer(c, t, path, which == "moe")
    rows = vocab_shard(c, t)
    if which == "first":  # the word table, a learned position table, BLOOM's word_embeddings_layernorm
        positions = (Param(position, (c.positions, c.h), POSITION),) \
            if c.position_embedding_type == "learned_absolute" else ()
        normed = _norm(c, "model.word_embeddings_layernorm", group=EMBEDDING_NORM) if c.alibi else ()
        return (Param(word, (rows, c.h), WORD), *positions, *normed)
    # the final norm and the output layer: tied, none with one stage but a copy on the last stage with several;
    # GPT-J's bias, tied or not
    weight = (Param(head, (rows, c.h), OUTPUT),) if not c.tie_embeddings or c.pp > 1 else ()
    bias = (Param(f"{head}.bias", (rows,), OUTPUT),) if c.impl == "hf" and layer_family(c).head_bias else ()
    return (*_norm(c, norm, group=FINAL_NORM), *weight, *bias)


@lru_cache(maxsize=64)
def layer_elements(c: ModelConfig, t: int) -> dict[str, int]:
    """Each parameter of a layer (a dense one's and a MoE one's) by its path below the layer's ("self_attn.q_proj", a
    bias "self_attn.q_proj.bias"): its elements on a rank of t, which the step walks' weight gradients read (kept:
    a walk asks for every linear of every layer kind)."""
    layer, path = _PARTS.get(c.impl, _PARTS["megatron"])[:2]
    return {p.module.removeprefix(f"{path}."): prod(p.shape) for moe in (False, True) if c.moe or not moe
            for p in layer(c, t, path, moe)}


def _linear(m: str, out: int, features: int, bias: bool, group: ParamGroup) -> tuple[Param, ...]:
    """nn.Linear's weight (out, in) and its bias (out,) where it has one (named `m.bias`)."""
    weight = Param(m, (out, features), group)
    return (weight, Param(f"{m}.bias", (out,), group)) if bias else (weight,)


def _norm(c: ModelConfig, m: str, shape: tuple[int, ...] | None = None, group: ParamGroup = NORMS) -> tuple[Param, ...]:
    """A norm's parameters over `shape` (h unless given): LayerNorm's weight and bias, OLMo's LayerNorm (layernorm_np)
    none, RMSNorm and Cohere's LayerNorm (layernorm_nb) a weight."""
    names = () if c.norm == "layernorm_np" else (m, f"{m}.bias") if c.norm == "layernorm" else (m,)
    return tuple(Param(n, shape or (c.h,), group) for n in names)


def _head_norms(c: ModelConfig, q: str, k: str) -> tuple[Param, ...]:
    """With qk_layernorm, the query's and the key's norms `q` and `k`, each over one head's d channels (shared by
    every head); none without it."""
    return tuple(x for m in (q, k) if c.qk_layernorm for x in _norm(c, m, (c.head_dim,)))


# Megatron-core's GPTModel on its local spec (and the paper's model, which counts as it does).

def megatron_layer_params(c: ModelConfig, t: int, m: str, moe: bool) -> tuple[Param, ...]:
    """A TransformerLayer's parameters in registration order: input_layernorm, linear_proj (row-parallel: its bias
    whole), linear_qkv (column-parallel) and the q and k layernorms over one head (latent attention: `_latent`'s),
    pre_mlp_layernorm, then linear_fc1 and linear_fc2 (each weight, then bias) or a MoELayer's router, its
    SequentialMLP's E/ep experts (their linears split by etp) and the shared experts (split by t as the dense MLP)."""
    a = f"{m}.self_attention"
    qkv = (c.a + 2 * c.groups) * c.head_dim // t  # Q heads plus K and V groups, d (h/a unless set) channels each
    attention = _latent(c, t, a) if c.mla else (
        *_linear(f"{a}.linear_qkv", qkv, c.h, c.add_bias_linear or c.add_qkv_bias, QKV),
        *_head_norms(c, f"{a}.q_layernorm", f"{a}.k_layernorm"))
    width = c.a * (c.v_head_dim if c.mla else c.head_dim) // t  # a heads of d (latent attention: of d_v)
    return (*_norm(c, f"{m}.input_layernorm"), *_linear(f"{a}.linear_proj", c.h, width, c.add_bias_linear, PROJ),
            *attention, *_norm(c, f"{m}.pre_mlp_layernorm"),
            *(_megatron_moe(c, t, f"{m}.mlp") if moe else _megatron_mlp(c, f"{m}.mlp", c.ffn, t, (FC1, FC2))))


def _megatron_mlp(c: ModelConfig, m: str, f: int, t: int, groups: tuple[ParamGroup, ParamGroup]) -> tuple[Param, ...]:
    """An MLP of width f on a rank of t: linear_fc1 column-parallel (a gated MLP's makes both gate and up), linear_fc2
    row-parallel (its bias whole)."""
    fc1 = _linear(f"{m}.linear_fc1", f * (2 if c.mlp in GATED else 1) // t, c.h, c.add_bias_linear, groups[0])
    return (*fc1, *_linear(f"{m}.linear_fc2", c.h, f // t, c.add_bias_linear, groups[1]))


def _megatron_moe(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """A MoELayer's: TopKRouter's (E, h) weight, whole, with a bias under add_bias_linear; SequentialMLP's E/ep
    experts of width e, their linears split by etp (each expert's own, registered expert by expert: listed once, with
    the E/ep experts as a leading dimension, `local_experts.*`); the shared experts of width u, split by t."""
    router = _linear(f"{m}.router", c.num_experts, c.h, c.add_bias_linear and c.impl == "megatron", ROUTER)
    one = _megatron_mlp(c, f"{m}.experts.local_experts.*", c.expert_ffn, etp(c, t), (EXPERTS, EXPERTS))
    experts = (p._replace(shape=(c.num_experts // c.ep, *p.shape)) for p in one)
    u = c.moe_shared_expert_intermediate_size
    shared = _megatron_mlp(c, f"{m}.shared_experts", u, t, (SHARED, SHARED)) if u else ()
    return (*router, *experts, *shared)


def _latent(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """Latent attention as megatron-core's local spec builds it (MLASelfAttention, all without biases), its parameters
    in registration order: q_down (h -> r_q) then q_up (r_q -> a(d_n + d_r)), or q_proj (h -> a(d_n + d_r)) without
    a query latent; kv_down (h -> r_kv + d_r) and kv_up (r_kv -> a(d_n + d_v)), all column-parallel (the down
    projections' outputs gathered); the latent norms whole. (Transformer Engine's spec duplicates the down
    projections instead.)"""
    r_q, r_kv, query_heads = c.q_lora_rank, c.kv_lora_rank, c.a * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    query = _linear(f"{m}.linear_q_proj", query_heads // t, c.h, False, QKV) if r_q is None else (
        *_linear(f"{m}.linear_q_down_proj", r_q // t, c.h, False, QKV),
        *_linear(f"{m}.linear_q_up_proj", query_heads // t, r_q, False, QKV))
    kv = (*_linear(f"{m}.linear_kv_down_proj", (r_kv + c.qk_rope_head_dim) // t, c.h, False, QKV),
          *_linear(f"{m}.linear_kv_up_proj", c.a * (c.qk_nope_head_dim + c.v_head_dim) // t, r_kv, False, QKV))
    norms = (*(_norm(c, f"{m}.q_layernorm", (r_q,), QKV) if r_q is not None else ()),
             *_norm(c, f"{m}.kv_layernorm", (r_kv,), QKV))
    return (*query, *kv, *norms)


# transformers' models, under their tp_plan.

def hf_layer_params(c: ModelConfig, t: int, m: str, moe: bool) -> tuple[Param, ...]:
    """A decoder layer's parameters in registration order, as this rank of t holds them (transformers' tp_plan: q, k,
    v, gate, up colwise, o and down rowwise, the norms whole): its attention (latent attention in
    DeepseekV3DecoderLayer), its MLP (a sparse block's experts), then its norms (one with single_norm, four with
    sandwich_norm, OLMo 2's post-norms in place of Llama's; OLMo's LayerNorm none; GLM-4's in forward order, though it
    registers its third before its second, all (h,)); GPT-NeoX's and GPT-J's norms first, GPT-2's and BLOOM's each
    before its sublayer. GPT-2's Conv1D keeps each weight as (in, out)."""
    attention = _latent_attention(c, f"{m}.self_attn") if c.mla else _attention(c, t, f"{m}.self_attn")
    mlp = _hf_moe(c, t, f"{m}.mlp") if moe else _mlp(c, t, f"{m}.mlp")
    places = norm_names(c)
    names = places[:1] if c.single_norm else places[1::2] if c.post_norm else tuple(n for n in places if n)
    norms = tuple(x for n in names for x in _norm(c, f"{m}.{n}"))
    if rules.is_neox(c) or rules.is_gptj(c):
        return (*norms, *attention, *mlp)
    if not rules.is_gpt2(c) and not c.alibi:
        return (*attention, *mlp, *norms)
    params = (*norms[:len(norms) // 2], *attention, *norms[len(norms) // 2:], *mlp)
    return tuple(p._replace(shape=p.shape[::-1]) if len(p.shape) == 2 and not c.alibi else p for p in params)


# A layer's norms' module names, in forward order (before the attention, on its output, before the MLP, on its output):
# Llama's two, Gemma 2's (and 3's) four, OLMo 2's post-norms (Gemma 2's second and fourth), GLM-4's four
NORM_NAMES = {"llama": ("input_layernorm", "", "post_attention_layernorm", ""),
              "gemma2": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"),
              "glm4": ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")}


def norm_names(c: ModelConfig) -> tuple[str, str, str, str]:
    """A transformers layer's norms' module names in their four places (`NORM_NAMES`, "" where it has none): its
    family's, or Llama's or Gemma 2's places (one norm, single_norm: the first)."""
    return NORM_NAMES.get(layer_family(c).name, NORM_NAMES["gemma2" if c.sandwich_norm or c.post_norm else "llama"])


def _attention(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """q, k, v (one module: Phi-3's qkv_proj, Falcon's query_key_value, GPT-2's c_attn) with add_qkv_bias's or
    add_bias_linear's biases, o_proj, gpt-oss's sinks, and the QK norms: over one head's d channels (Qwen3, Gemma 3),
    OLMo 2's over the whole projections, Cohere's (heads, d) weights (whole under tp: their tp_plans name none)."""
    q, kv, bias = c.a * c.head_dim // t, c.groups * c.head_dim // t, c.add_qkv_bias or c.add_bias_linear
    fused = c.fused_qkv or rules.is_gpt2(c) or rules.is_falcon(c) or c.alibi  # Falcon-7B's multi-query one too
    qkv = _linear(f"{m}.qkv_proj", q + 2 * kv, c.h, bias, QKV) if fused else tuple(
        x for n, w in zip("qkv", (q, kv, kv)) for x in _linear(f"{m}.{n}_proj", w, c.h, bias, QKV))
    qk = () if not c.qk_layernorm else ((c.a * c.head_dim,), (c.groups * c.head_dim,)) if c.post_norm else (
        (c.a, c.head_dim), (c.groups, c.head_dim)) if rules.is_cohere(c) else ((c.head_dim,),) * 2
    sinks = (Param(f"{m}.sinks", (c.a // t,), SINKS),) if c.attention_sinks else ()
    o = _linear(f"{m}.o_proj", c.h, q, c.add_bias_linear, PROJ)
    projections = (*o, *qkv) if rules.is_phi3(c) else (*qkv, *o)  # Phi3Attention registers o_proj first
    return (*sinks, *projections, *(x for n, shape in zip("qk", qk) for x in _norm(c, f"{m}.{n}_norm", shape)))


def _mlp(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """A dense MLP: gate and up (one gate_up_proj in Phi-3's and GLM's) and down, or the ungated fc and proj (with
    biases in GPT-NeoX's and GPT-J's whatever add_bias_linear says)."""
    f, bias = c.ffn // t, c.add_bias_linear or layer_family(c).mlp_bias
    if c.mlp not in GATED:
        return (*_linear(f"{m}.c_fc", f, c.h, bias, FC1), *_linear(f"{m}.c_proj", c.h, f, bias, FC2))
    gate_up = _linear(f"{m}.gate_up_proj", 2 * f, c.h, bias, FC1) if fuses_modules(c) else (
        *_linear(f"{m}.gate_proj", f, c.h, bias, FC1), *_linear(f"{m}.up_proj", f, c.h, bias, FC1))
    return (*gate_up, *_linear(f"{m}.down_proj", c.h, f, bias, FC2))


def fuses_modules(c: ModelConfig) -> bool:
    """Whether transformers' layer fuses q, k and v into one module (fused_qkv: Phi-3's qkv_proj) or gate and up
    (Phi-3's and GLM's gate_up_proj)."""
    return c.fused_qkv or rules.is_glm(c)


def _latent_attention(c: ModelConfig, m: str) -> tuple[Param, ...]:
    """DeepseekV3Attention's parameters in registration order (t = 1): the query's latent (or q_proj), the key/value
    latent with k_rot, their norms and up projections, o_proj."""
    a, dq, dv, qr, kvr = c.a, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
    query = (Param(f"{m}.q_proj", (a * dq, c.h), QKV),) if qr is None else (
        Param(f"{m}.q_a_proj", (qr, c.h), QKV), Param(f"{m}.q_a_layernorm", (qr,), QKV),
        Param(f"{m}.q_b_proj", (a * dq, qr), QKV))
    return (*query, Param(f"{m}.kv_a_proj_with_mqa", (kvr + c.qk_rope_head_dim, c.h), QKV),
            Param(f"{m}.kv_a_layernorm", (kvr,), QKV),
            Param(f"{m}.kv_b_proj", (a * (c.qk_nope_head_dim + dv), kvr), QKV),
            Param(f"{m}.o_proj", (c.h, a * dv), PROJ))


def _hf_moe(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """A sparse MoE block's parameters in registration order (Qwen3-MoE registers its experts first), as this rank of
    t holds them: E/ep experts, their gate_up_proj packed_colwise and down_proj rowwise (their expert_ffn/t channels),
    the router and the shared expert whole. The experts' two weights are one module's: each is named by its own path
    (memcalc.sizing.timeline.hf_moe.weight_of)."""
    f, e, x = c.expert_ffn // t, c.num_experts // c.ep, f"{m}.experts"
    if c.attention_sinks:  # GptOssMLP: a router with a bias; GptOssExperts' (E, in, out) weights with (E, out) biases
        return (*_linear(f"{m}.router", c.num_experts, c.h, True, ROUTER),
                Param(f"{x}.gate_up_proj", (e, c.h, 2 * f), EXPERTS),
                Param(f"{x}.gate_up_proj_bias", (e, 2 * f), EXPERTS), Param(f"{x}.down_proj", (e, f, c.h), EXPERTS),
                Param(f"{x}.down_proj_bias", (e, c.h), EXPERTS))
    router = (Param(f"{m}.gate", (c.num_experts, c.h), ROUTER),)
    experts = (Param(f"{x}.gate_up_proj", (e, 2 * f, c.h), EXPERTS), Param(f"{x}.down_proj", (e, c.h, f), EXPERTS))
    u = c.moe_shared_expert_intermediate_size
    gate = () if c.mla else (Param(f"{m}.shared_expert_gate", (1, c.h), SHARED),)  # DeepseekV3MoE's have none
    s = f"{m}.shared_experts" if c.mla else f"{m}.shared_expert"  # DeepseekV3MoE's name, Qwen2MoeSparseMoeBlock's
    shared = (Param(f"{s}.gate_proj", (u, c.h), SHARED), Param(f"{s}.up_proj", (u, c.h), SHARED),
              Param(f"{s}.down_proj", (c.h, u), SHARED), *gate) if u else ()
    # Qwen3-MoE's and DeepSeek-V3's experts come before their router
    return (*experts, *router, *shared) if c.qk_layernorm or c.mla else (*router, *experts, *shared)


# torchtitan's Llama3Model, under its TP plan (set_llama3_sharding_config): wo and w2 split on dim 1, the norms whole,
# the rest on dim 0.

GROUPED_WEIGHTS = {"w1": "w1_EFD", "w2": "w2_EDF", "w3": "w3_EFD"}  # GroupedExperts' three, by their shapes' names


def torchtitan_layer_params(c: ModelConfig, t: int, m: str, moe: bool) -> tuple[Param, ...]:
    """A TransformerBlock's parameters in registration order: wqkv and wo (with qk_layernorm Qwen3's q_norm and
    k_norm, one head's d channels each), the feed-forward's w1, w2, w3 (or the MoE's), the two norms; no biases
    (Llama3 has none: impl torchtitan refuses them). DeepSeek-V3's block registers its latent attention
    (`_torchtitan_latent`), then its norms, then its feed-forward."""
    qkv, o, f = (c.a + 2 * c.groups) * c.head_dim // t, c.a * c.head_dim // t, c.ffn // t
    mlp = _torchtitan_moe(c, t, f"{m}.moe") if moe else (
        Param(f"{m}.feed_forward.w1", (f, c.h), FC1), Param(f"{m}.feed_forward.w2", (c.h, f), FC2),
        Param(f"{m}.feed_forward.w3", (f, c.h), FC1))
    attention = (Param(f"{m}.attention.qkv_linear.wqkv", (qkv, c.h), QKV), Param(f"{m}.attention.wo", (c.h, o), PROJ),
                 *_head_norms(c, f"{m}.attention.q_norm", f"{m}.attention.k_norm"))
    norms = (*_norm(c, f"{m}.attention_norm"), *_norm(c, f"{m}.ffn_norm"))
    if c.mla:
        return (*_torchtitan_latent(c, t, f"{m}.attention"), *norms, *mlp)
    return (*attention, *mlp, *norms)


def _torchtitan_latent(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """DeepSeek-V3's Attention in registration order: wq, or wq_a, q_norm and wq_b; wkv_a, kv_norm, wkv_b, wo. Under
    its plan (set_deepseek_v3_sharding_config) the down projections and the latents' norms are replicated (whole),
    wq, wq_b and wkv_b split on dim 0, wo on dim 1."""
    r_q, r_kv, query_heads = c.q_lora_rank, c.kv_lora_rank, c.a * (c.qk_nope_head_dim + c.qk_rope_head_dim) // t
    query = (Param(f"{m}.wq", (query_heads, c.h), QKV),) if r_q is None else (
        Param(f"{m}.wq_a", (r_q, c.h), QKV), *_norm(c, f"{m}.q_norm", (r_q,), QKV),
        Param(f"{m}.wq_b", (query_heads, r_q), QKV))
    return (*query, Param(f"{m}.wkv_a", (r_kv + c.qk_rope_head_dim, c.h), QKV), *_norm(c, f"{m}.kv_norm", (r_kv,), QKV),
            Param(f"{m}.wkv_b", (c.a * (c.qk_nope_head_dim + c.v_head_dim) // t, r_kv), QKV),
            Param(f"{m}.wo", (c.h, c.a * c.v_head_dim // t), PROJ))


def _torchtitan_moe(c: ModelConfig, t: int, m: str) -> tuple[Param, ...]:
    """torchtitan's MoE's parameters in registration order, GroupedExperts' three one module's, each named by its own
    path: E/ep experts, their width split by etp; the router's gate whole; the shared experts split by t."""
    e, f, u = c.num_experts // c.ep, c.expert_ffn // etp(c, t), (c.moe_shared_expert_intermediate_size or 0) // t
    shared = tuple(Param(f"{m}.shared_experts.{n}", (c.h, u) if n == "w2" else (u, c.h), SHARED)
                   for n in GROUPED_WEIGHTS) if u else ()
    return (*(Param(f"{m}.routed_experts.inner_experts.{name}", (e, c.h, f) if n == "w2" else (e, f, c.h), EXPERTS)
              for n, name in GROUPED_WEIGHTS.items()), Param(f"{m}.router.gate", (c.num_experts, c.h), ROUTER), *shared)


# Each implementation's layer, its path, and its ends' modules: the word and position tables, the final norm, the
# output layer (megatron's for the paper's model). transformers' embed_tokens: v/t rows under tp (rank 0 of an uneven
# DTensor holds the most); torchtitan's tied lm_head is tok_embeddings' weight (it refuses tied embeddings with pp).
_PARTS = {
    "megatron": (megatron_layer_params, "decoder.layers.0", EndModules("embedding.word_embeddings",
                                                                "embedding.position_embeddings",
                                                                "decoder.final_layernorm", "output_layer")),
    "hf": (hf_layer_params, "model.layers.0", EndModules("model.embed_tokens", "model.wpe", "model.norm", "lm_head")),
    "torchtitan": (torchtitan_layer_params, "layers.0", EndModules("tok_embeddings", None, "norm", "lm_head")),
}
