"""Megatron-core: the seed's layer, as megatron-core's own TransformerLayer keeps it.

Which ledger tensors the layer keeps, given its knobs; with GELU and multi-head attention exactly the seed's
sbh(34 + 5as/h) and its TP and TP+SP forms. Why GELU's tanh forms keep their input alone, and the places where
megatron-core 0.16.1 keeps other storages than the paper's layer (SwiGLU, grouped-query attention, QK norms, the
softmax outside its fused kernel's sizes), and what MoELayer and MLASelfAttention keep, as measured:
docs/impl-notes/megatron.md, rendered into docs/impl-megatron.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.impls.base import Implementation, Refusal, SizeCondition, SizeRule, drop_small
from memcalc.model.knobs import Accounting
from memcalc.model.rules import divides
from memcalc.model.ledger import BASD, BASS, BSF, Dim, Kind, Region, SavedTensor, in_pair, small_moe
from memcalc.model.tp_plan import ATTENTION, MLP, SHARED, Rule, Style, TPPlan, pair

K_EXPANDED = in_pair("attention/k_expanded", "DotProductAttention: key.repeat_interleave(a/g) before QK^T", BASD,
                     "QK^T reads K copied to every head of its group; dQ = dScores K needs the copy")
V_EXPANDED = in_pair("attention/v_expanded", "DotProductAttention: value.repeat_interleave(a/g) before weights x V",
                     BASD, "weights x V reads V copied to every head; dWeights = dOut V^T needs the copy")
QKV_QUERY_COLUMNS = in_pair("attention/qkv_q_columns", "checkpointed core attention (keeps K, V as views of the fused"
                            " QKV output)", BASD, "K and V are kept as views of the fused QKV output, which keeps its"
                            " query columns alive beside the query copy")
QUERY_COPY = in_pair("attention/q_copy", "QK^T under GQA: the query heads' copy (get_query_key_value_tensors'"
                     " query.reshape with several K/V groups per rank, else DotProductAttention's"
                     " query.reshape(sq, b*np, hn))", BASD,
                     "the gradient of K in QK^T is dScores^T Q: the query heads, folded into a copy")
QKV_OUT = in_pair("attention/qkv_out", "DotProductAttention at b = 1, one K/V group per rank: QK^T's query is a view of"
                  " the fused QKV output", (Dim.B, Dim.S, Dim.QKV, Dim.D),
                  "the gradient of K in QK^T is dScores^T Q: Q is read from the fused output it views, kept whole")
SWIGLU_UP_COPY = in_pair("mlp/up_plus_offset", "MLP glu(): SiLU(gate) * (up + glu_linear_offset)", BSF,
                         "`up + offset` is a new tensor (even for offset 0); the product's dSiLU needs it")
CAUSAL_MASK = SavedTensor(
    "attention/causal_mask", "FusedScaleMaskSoftmax.forward_torch_softmax: masked_fill_(causal mask)",
    (Dim.S, Dim.S), Kind.MASK, Region.REPLICATED,
    "without the fused softmax kernel (fp32, unfused, or outside its sizes), masked_fill_'s backward zeroes the"
    " masked gradient",
)

SOFTMAX_FP32 = SavedTensor(
    "attention/softmax_fp32", "FusedScaleMaskSoftmax.forward_torch_softmax: softmax of the fp32 scores",
    BASS, Kind.FP32, Region.TENSOR,
    "without the fused kernel the softmax runs in fp32 (attention_softmax_in_fp32) and its backward reads that"
    " output",
)

_BSK, _BSE = (Dim.B, Dim.S, Dim.K), (Dim.B, Dim.S, Dim.E)
TOPK_PROBS = small_moe(
    "topk_probs_fp32", "router: torch.softmax(top-k logits, dtype=float32)"
    " (moe_utils.topk_routing_with_score_function)", _BSK, Kind.FP32,
    "softmax backward needs its output: the k chosen experts' probabilities")
ALL_PROBS = small_moe(
    "probs_fp32", "router: torch.softmax(logits, dtype=float32) before top-k (moe_router_pre_softmax)", _BSE, Kind.FP32,
    "softmax backward needs its output: every expert's probability, of which top-k keeps k")
SIGMOID_SCORES = small_moe(
    "sigmoid_scores_fp32", "router: torch.sigmoid(logits.float()) (score_function sigmoid)", _BSE, Kind.FP32,
    "sigmoid's derivative is read from its output: every expert's score")
TOPK_SCORES = small_moe(
    "topk_scores", "router: the k chosen sigmoid scores / (their sum + 1e-20), k > 1", _BSK, Kind.ACTIVATION,
    "the division's gradient for its divisor reads the dividend")
TOPK_DENOMINATOR = replace(TOPK_SCORES, name="moe/topk_denominator", shape=(Dim.B, Dim.S),
                           why="the division's backward reads its divisor")
BIASED_CHOICE_SCORES = small_moe(
    "expert_bias_scores", "router: torch.gather(scores, 1, top-k of scores + expert_bias)"
    " (moe_router_enable_expert_bias)", _BSE, Kind.ACTIVATION, "gather's backward keeps its whole input (every"
    " expert's score, cast to the activation dtype), not only the k it picks")
AUX_SCORES = SavedTensor(
    "moe/aux_scores_fp32", "router: softmax over all E logits in fp32 (compute_routing_scores_for_aux_loss)",
    _BSE, Kind.FP32, Region.SEQUENCE,
    "the load-balancing loss's gradient flows through the softmax over every expert's score",
)
AUX_SIGMOID_SCORES = SavedTensor(
    "moe/aux_sigmoid_scores", "router: sigmoid(logits) / (its sum over E + 1e-20)"
    " (compute_routing_scores_for_aux_loss)", _BSE, Kind.ACTIVATION, Region.SEQUENCE,
    "the load-balancing loss's gradient flows through the sigmoid, whose derivative is read from its output, and"
    " the normalisation's division, which reads it as dividend",
)
AUX_SIGMOID_DENOMINATOR = replace(AUX_SIGMOID_SCORES, name="moe/aux_denominator", shape=(Dim.B, Dim.S),
                                  why="the division's backward reads its divisor", paper=False)
AUX_TOKENS_PER_EXPERT = small_moe(
    "aux_tokens_per_expert", "switch_load_balancing_loss_func: sum(scores, dim=0) * tokens_per_expert", (Dim.E,),
    Kind.INT64, "the product's gradient for the summed scores is each expert's token count (routing_map.sum(0),"
    " all-reduced over the tensor-parallel group)", Region.REPLICATED)
AUX_LOSS = small_moe(
    "aux_loss", "MoEAuxLossAutoScaler.forward: ctx.save_for_backward(aux_loss)", (), Kind.FP32, "attached to the"
    " routing probabilities, the loss (one fp32 number) is kept so that backward can start its gradient",
    Region.REPLICATED)
AUX_LOSS_SIGMOID = small_moe(
    "aux_loss_sigmoid", "MoEAuxLossAutoScaler.forward: ctx.save_for_backward(aux_loss), over sigmoid scores", (),
    Kind.ACTIVATION, "the loss over the activation-dtype sigmoid scores (one number in that dtype) is kept so that"
    " backward can start its gradient", Region.REPLICATED)
CAPACITY_MASK = small_moe(
    "capacity_mask", "router: probs * kept map (apply_router_token_dropping)", _BSE, Kind.MASK,
    "the product's gradient for the probabilities is dY times the map of the slots within capacity")
ROUTING_MAP = small_moe(
    "routing_map", "permute: probs.T.masked_select(routing_map)", _BSE, Kind.MASK,
    "masked_select's backward scatters the gradient back through the same map")
PROBS_T = small_moe(
    "probs_t", "permute: probs.T.contiguous().masked_select(routing_map)", _BSE, Kind.ACTIVATION,
    "masked_select's backward reads its input (every expert's routing weight, zero where not chosen, in the"
    " activation dtype) to build the gradient in its shape")
PERMUTE_INDICES = small_moe(
    "permute_indices", "permute: tokens.index_select(sorted_indices); unpermute's scatter_add_", (Dim.RS,), Kind.INT64,
    "both the permutation's and the combine's backward move gradients by these indices (one a token-expert slot the"
    " rank's tokens keep: kbs/t, fewer where a capacity drops)")
PAD_PROBS_INDICES = small_moe(
    "pad_probs_indices", "permute (drop and pad): probs.T.view(-1).index_select(0, expert * n + kept token)",
    (Dim.RS,), Kind.INT64, "index_select's backward scatters the gradient back by its indices")
GATHERED_ROUTING_MAP = small_moe(
    "allgather_map", "all-gather dispatcher: local probs.T.masked_select(local map)", _BSE, Kind.MASK,
    "masked_select's backward scatters the gradient back through the same map: the local experts' E/ep columns of"
    " the ep*b*s tokens gathered over tp*ep", Region.REPLICATED)
GATHERED_PROBS_T = small_moe(
    "allgather_probs_t", "all-gather dispatcher: local probs.T.contiguous().masked_select(local map)", _BSE,
    Kind.ACTIVATION, "masked_select's backward reads its input: the local experts' routing weights for the ep*b*s"
    " gathered tokens, in the activation dtype", Region.REPLICATED)
GATHERED_PERMUTE_INDICES = small_moe(
    "allgather_indices", "all-gather dispatcher: gathered tokens.index_select(sorted_indices); unpermute's"
    " scatter_add_", (Dim.R,), Kind.INT64, "both the permutation's and the combine's backward move gradients by these"
    " indices, one a slot this rank's experts receive", Region.EXPERT)
EXPERT_UP_COPY = replace(SWIGLU_UP_COPY, name="moe/expert_up_plus_offset", shape=(Dim.R, Dim.FE), region=Region.EXPERT)
SHARED_UP_COPY = replace(SWIGLU_UP_COPY, name="moe/shared_up_plus_offset", shape=(Dim.B, Dim.S, Dim.U))
EXPERT_ACT_OUT = SavedTensor(
    "moe/expert_act_out", "MLP.activation_func_with_probs: activation(fc1) * probs", (Dim.R, Dim.FE),
    Kind.ACTIVATION, Region.EXPERT, "the gradient of the routing probability is sum(dY * activation)",
)
EXPERT_PROBS = small_moe("expert_probs", "MLP.activation_func_with_probs: activation(fc1) * probs", (Dim.R,),
                         Kind.ACTIVATION, "the gradient of the activation in the product is dY * probs", Region.EXPERT)


def _rope_table(part: str, fn: str, why: str) -> SavedTensor:
    return SavedTensor(
        f"mla/rope_{part}_{fn}", f"MLASelfAttention: apply_rotary_pos_emb on the {'query' if part == 'q' else 'key'}'s"
        f" RoPE part: {fn}(freqs) in the activation dtype", (Dim.S, Dim.DR), Kind.ACTIVATION, Region.REPLICATED,
        "RoPE's x * cos + rotate_half(x) * sin has gradient dY * cos + rotate_half^T(dY * sin): it keeps the cast"
        f" tables; {why}", paper=False,
    )


MLA_ROPE = tuple(_rope_table(part, fn, why) for part, why in (("q", "the query's own copy"),
                                                              ("k", "computed again for the key, a second copy"))
                 for fn in ("cos", "sin"))

MLA_KV_DOWN_VIEW = replace(
    ledger.MLA_KV_NORM.input, saved_by="kv_layernorm, on torch.split(kv_down output)[0]: a view of the whole output",
    shape=(Dim.B, Dim.S, Dim.KVD),
    why="the norm's backward reads its input, a view that keeps the key/value down projection's whole output"
    " (latent and the keys' RoPE part) alive; under SP the latent's sequence shard is a copy (r_kv wide)",
)
MLA_KV_DOWN_GATHERED = replace(
    MLA_KV_DOWN_VIEW, region=Region.REPLICATED,
    why="the norm's backward reads its input, a view that keeps the key/value down projection's whole output alive:"
    " under SP with one token a rank the latent's sequence shard is contiguous, scattering it is a view too",
)
MLA_Q_LATENT_GATHERED = replace(
    ledger.MLA_Q_NORM.input, saved_by="q_layernorm, on the query latent gathered over t (and under SP scattered"
    " back as a view)", region=Region.REPLICATED,
    why="the norm's backward reads its input; SP's scatter of the gathered latent is a view of it, so the whole"
    " sequence stays alive on every rank",
)
MLA_Q_NORM = ledger.MLA_Q_NORM._replace(input=MLA_Q_LATENT_GATHERED)
MLA_KV_NORM = ledger.MLA_KV_NORM._replace(input=MLA_KV_DOWN_VIEW)

TENSORS: tuple[SavedTensor, ...] = (  # megatron's own
    K_EXPANDED, V_EXPANDED, QUERY_COPY, QKV_OUT, QKV_QUERY_COLUMNS, SWIGLU_UP_COPY, CAUSAL_MASK, SOFTMAX_FP32,
    TOPK_PROBS, ALL_PROBS, SIGMOID_SCORES, TOPK_SCORES, TOPK_DENOMINATOR, BIASED_CHOICE_SCORES, AUX_SCORES,
    AUX_SIGMOID_SCORES, AUX_SIGMOID_DENOMINATOR, AUX_TOKENS_PER_EXPERT, AUX_LOSS, AUX_LOSS_SIGMOID, CAPACITY_MASK,
    ROUTING_MAP, PROBS_T, PERMUTE_INDICES, PAD_PROBS_INDICES, GATHERED_ROUTING_MAP, GATHERED_PROBS_T,
    GATHERED_PERMUTE_INDICES, EXPERT_UP_COPY, SHARED_UP_COPY, EXPERT_ACT_OUT, EXPERT_PROBS, *MLA_ROPE,
    MLA_KV_DOWN_VIEW, MLA_Q_LATENT_GATHERED, ledger.MLA_KV_UP_OUT,
)


def norm_block(norm: ledger.NormTensors, knobs: Any) -> tuple[SavedTensor, ...]:
    """LayerNorm keeps input, mean and rstd; RMSNorm has no mean."""
    if knobs.norm == "layernorm":
        return (norm.input, norm.mean, norm.rstd)
    return (norm.input, norm.rstd)


def core_attention(knobs: Any, fused_softmax: bool = True) -> tuple[SavedTensor, ...]:
    """What softmax(QK^T)V keeps beyond Q, K, V: s^2 terms if eager, statistics if flash.

    `fused_softmax`: whether the sizes let Megatron's fused causal kernel run (FUSED_SOFTMAX).
    """
    if knobs.recompute == "selective":
        return ()  # rebuilt from Q, K, V in backward (Korthikanti et al. 2022)
    if knobs.attention == "flash":
        return (ledger.SOFTMAX_LSE,)  # the dropout mask is regenerated from the RNG seed
    dropout = (ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT) if knobs.has_dropout else ()
    if fused_softmax and fused_softmax_kernel(knobs):
        return (ledger.SOFTMAX_OUT, *dropout)  # without dropout, weights x V saves the softmax output itself
    # forward_torch_softmax: masked_fill_ keeps the mask; an fp32 softmax of 16-bit scores is cast back, and what
    # follows keeps the cast (weights x V without dropout)
    if knobs.attention_softmax_in_fp32 and knobs.dtype != "fp32":
        return (CAUSAL_MASK, SOFTMAX_FP32, *(dropout or (ledger.SOFTMAX_OUT,)))
    return (CAUSAL_MASK, ledger.SOFTMAX_OUT, *dropout)


def query_key_value(knobs: Any) -> tuple[SavedTensor, ...]:
    """Q, K, V as the core keeps them: views of the fused QKV output, or (GQA) copies for every head.

    With qk_layernorm (get_query_key_value_tensors: q_layernorm(query), k_layernorm(key)) each norm keeps its input
    first, and the core keeps the norms' outputs as Q and K (K and V copied to every head under eager GQA).
    Multi-head, the norms' inputs are views of the fused QKV output, which V keeps too: that storage is the norms'
    input rows and V. Under GQA the query is a copy (the norm's input), and the key's view keeps the fused output
    whole, its query columns too (with one K/V group per rank, g = t, no copy is made: CONDITIONS)."""
    norms = (*norm_block(ledger.Q_NORM, knobs), *norm_block(ledger.K_NORM, knobs)) if knobs.qk_layernorm else ()
    if not knobs.gqa or knobs.attention == "flash":
        return (*norms, ledger.Q, ledger.K, ledger.V)
    if knobs.qk_layernorm:
        core = (ledger.Q, ledger.K) if knobs.recompute == "selective" else (ledger.Q, K_EXPANDED, V_EXPANDED)
        return (*norms, QKV_QUERY_COLUMNS, ledger.V, *core)
    if knobs.recompute == "selective":
        # The checkpoint's inputs, expanded in backward (with one K/V group per rank, Q, K, V alone: CONDITIONS).
        return (ledger.Q, ledger.K, ledger.V, QKV_QUERY_COLUMNS)
    return (QUERY_COPY, K_EXPANDED, V_EXPANDED)  # at b = 1 with g = t, the fused output in Q's place: CONDITIONS


def attention_block(knobs: Any, fused_softmax: bool = True) -> tuple[SavedTensor, ...]:
    """QKV input, Q/K/V, the core's terms, the projection input, the output mask."""
    mask = (ledger.ATTN_OUT_DROPOUT_MASK,) if knobs.has_dropout else ()
    core = core_attention(knobs, fused_softmax)
    if knobs.mla:
        return (*latent_attention(knobs), *core, ledger.MLA_PROJ_IN, *mask)
    return (ledger.QKV_IN, *query_key_value(knobs), *core, ledger.PROJ_IN, *mask)


def latent_attention(knobs: Any) -> tuple[SavedTensor, ...]:
    """MLASelfAttention up to the core: x (both down projections read it), each latent's norm (on views: the
    whole query sequence, the KV down projection's whole output) and up-projection input, RoPE's tables, and
    the per-head Q, K, V the core keeps (contiguous copies, one storage each)."""
    query = (*norm_block(MLA_Q_NORM, knobs), ledger.MLA_Q_UP_IN) if knobs.q_lora_rank is not None else ()
    latent = (*norm_block(MLA_KV_NORM, knobs), ledger.MLA_KV_UP_IN)
    return (ledger.QKV_IN, *query, *latent, *MLA_ROPE, ledger.MLA_Q, ledger.MLA_K, ledger.MLA_V)


# What an MLP's activation keeps, by MLP (the dense one, each expert, the shared experts): GELU's input; SwiGLU's gate,
# up, SiLU's output and the copy of up.
DENSE_ACT = (ledger.GELU_IN, ledger.SWIGLU_GATE, ledger.SWIGLU_UP, ledger.SWIGLU_SILU_OUT, SWIGLU_UP_COPY)
EXPERT_ACT = (ledger.EXPERT_GELU_IN, ledger.EXPERT_GATE, ledger.EXPERT_UP, ledger.EXPERT_SILU_OUT, EXPERT_UP_COPY)
SHARED_ACT = (ledger.SHARED_GELU_IN, ledger.SHARED_GATE, ledger.SHARED_UP, ledger.SHARED_SILU_OUT, SHARED_UP_COPY)


def activation(knobs: Any, mlp: tuple[SavedTensor, ...]) -> tuple[SavedTensor, ...]:
    """What `mlp`'s activation keeps: GELU its input (F.gelu, exact or tanh, openai_gelu, the fused bias_gelu);
    SwiGLU gate and up (the two halves of fc1's output), unfused also SiLU's output and a copy of up."""
    gelu_in, gate, up, silu_out, up_copy = mlp
    if knobs.mlp != "swiglu":
        return (gelu_in,)
    if knobs.bias_activation_fusion:
        return (gate, up)  # BiasSwiGLUFunction keeps its input alone
    return (gate, up, silu_out, up_copy)


def mlp_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """fc1 input, the activation's terms, fc2 input."""
    return (ledger.FC1_IN, *activation(knobs, DENSE_ACT), ledger.FC2_IN)


def moe_block(knobs: Any) -> tuple[SavedTensor, ...]:
    """MoELayer: the router, the permutation, each local expert's MLP on its slots, shared experts.

    The experts apply the routing probabilities inside the MLP (activation(fc1) * probs), so the product keeps
    the activation's output and the probabilities; fused (bias_activation_fusion), WeightedSwiGLUFunction keeps
    fc1's output and the probabilities alone. unpermute's scatter_add_ keeps only the permutation indices.
    """
    capacity = (CAPACITY_MASK,) if knobs.moe_expert_capacity_factor is not None else ()
    router = (ledger.MOE_IN, *router_scores(knobs), ledger.ROUTER_TOPK_INDICES, *capacity, *aux_loss(knobs),
              *dispatch(knobs))
    product = () if knobs.mlp == "swiglu" and knobs.bias_activation_fusion else (EXPERT_ACT_OUT,)
    experts = (ledger.EXPERT_IN, *activation(knobs, EXPERT_ACT), *product, EXPERT_PROBS, ledger.EXPERT_FC2_IN)
    return (*router, *experts, *shared_experts(knobs))


def router_scores(knobs: Any) -> tuple[SavedTensor, ...]:
    """topk_routing_with_score_function: the softmax over the top k (or, pre-softmax, over all E), or every
    expert's sigmoid (with the expert bias, gathered) and the chosen scores' renormalisation (k > 1)."""
    if knobs.moe_router_score_function == "sigmoid":
        # in fp32 the scores' cast to the activation dtype is a no-op: gather keeps the sigmoid's output itself
        biased = (BIASED_CHOICE_SCORES,) if knobs.moe_router_enable_expert_bias and knobs.dtype != "fp32" else ()
        return (SIGMOID_SCORES, *biased, *((TOPK_SCORES, TOPK_DENOMINATOR) if knobs.moe_router_topk > 1 else ()))
    return (ALL_PROBS,) if knobs.moe_router_pre_softmax else (TOPK_PROBS,)


def aux_loss(knobs: Any) -> tuple[SavedTensor, ...]:
    """The load-balancing loss: every expert's scores (fp32 softmax, or the normalised sigmoid in the activation
    dtype), the token counts per expert it multiplies them by, and the loss."""
    if not knobs.moe_aux_loss:
        return ()
    if knobs.moe_router_score_function == "sigmoid":
        return (AUX_SIGMOID_SCORES, AUX_SIGMOID_DENOMINATOR, AUX_TOKENS_PER_EXPERT, AUX_LOSS_SIGMOID)
    return (AUX_SCORES, AUX_TOKENS_PER_EXPERT, AUX_LOSS)


def dispatch(knobs: Any) -> tuple[SavedTensor, ...]:
    """The token dispatcher's permutation: the all-to-all's map, probabilities and indices over the rank's own
    tokens (padded to capacity: the probabilities' gather indices in place of the map); the all-gather's over the
    tp*ep group's gathered tokens."""
    if knobs.moe_token_dispatcher_type == "allgather":
        return (GATHERED_ROUTING_MAP, GATHERED_PROBS_T, GATHERED_PERMUTE_INDICES)
    if knobs.moe_pad_expert_input_to_capacity:
        return (PERMUTE_INDICES, PAD_PROBS_INDICES)
    return (ROUTING_MAP, PROBS_T, PERMUTE_INDICES)


def shared_experts(knobs: Any) -> tuple[SavedTensor, ...]:
    """SharedExpertMLP: a dense MLP of width u on every token; its fc1 reads the router's input (one storage)."""
    if not knobs.moe_shared_expert_intermediate_size:
        return ()
    return (*activation(knobs, SHARED_ACT), ledger.SHARED_FC2_IN)


def keeps(knobs: Any, accounting: Accounting, fused_softmax: bool = True) -> tuple[SavedTensor, ...]:
    """Every tensor one layer keeps for backward, in forward order (unless fully recomputed): the dense MLP's or the
    MoELayer's, then the dropout mask on its output."""
    mask = (ledger.MLP_DROPOUT_MASK,) if knobs.has_dropout else ()
    blocks = (
        norm_block(ledger.LN1, knobs) + attention_block(knobs, fused_softmax)
        + norm_block(ledger.LN2, knobs) + (moe_block(knobs) if knobs.moe else mlp_block(knobs)) + mask
    )
    return drop_small(blocks, accounting)


def sequence_parallel_forms(knobs: Any) -> tuple[SavedTensor, ...]:
    """Under SP the KV latent's sequence shard is scattered out of the gathered down projection output, a copy:
    the norm keeps the ledger's (b, s/t, r_kv), not the whole output's view (MLA_KV_DOWN_VIEW)."""
    return (ledger.MLA_KV_NORM.input,) if knobs.mla else ()


def fused_softmax_kernel(knobs: Any) -> bool:
    """Whether FusedScaleMaskSoftmax may run its fused kernel at all (within its window of sizes, `fused_softmax_runs`):
    masked_softmax_fusion on and 16-bit scores (is_kernel_available asks input_in_float16; fp32 runs torch's)."""
    return knobs.masked_softmax_fusion and knobs.dtype != "fp32"


def fused_softmax_runs(sizes: dict[Dim, Any], t: Any) -> Any:
    """FusedScaleMaskSoftmax.is_kernel_available for the causal kernel (fusions/fused_softmax.py), on numbers or arrays.

    16 < s <= 4096, s a multiple of 4, and the b * a/t attention batches a multiple of the
    kernel's batch per block: 8 for s <= 128, 4 above (Apex's scaled_masked_softmax.h,
    128 threads per block).
    """
    s, batches = sizes[Dim.S], sizes[Dim.B] * (sizes[Dim.A] // t)
    per_block = 4 + 4 * (s <= 128)
    return (16 < s) & (s <= 4096) & (s % 4 == 0) & (batches % per_block == 0)


def fused_softmax_misses(sizes: dict[Dim, Any], t: int) -> str:
    """Which of the fused kernel's conditions these sizes miss, with their values (numbers, not arrays)."""
    s, b, heads = sizes[Dim.S], sizes[Dim.B], sizes[Dim.A] // t
    per_block = 8 if s <= 128 else 4
    missed = [f"s={s} is not in 16 < s <= 4096"] if not 16 < s <= 4096 else []
    missed += [f"s={s} is not a multiple of 4"] if s % 4 else []
    missed += [f"b*a/t={b}*{heads * t}/{t}={b * heads} is not a multiple of {per_block}"] if b * heads % per_block else []
    return ", ".join(missed)


FUSED_SOFTMAX = SizeRule(
    "outside megatron-core's fused softmax window (16 < s <= 4096, s % 4 == 0, b*a/t a multiple of 8 for s <= 128,"
    " else of 4), the unfused softmax keeps the (s, s) causal mask and its output (fp32 with"
    " attention_softmax_in_fp32)",
    applies=lambda knobs: knobs.attention == "eager" and knobs.recompute not in ("selective", "full")
    and fused_softmax_kernel(knobs), runs=fused_softmax_runs,
    outside=lambda knobs, accounting: keeps(knobs, accounting, fused_softmax=False),
    misses=fused_softmax_misses,
    pattern={Dim.S: (4, (17, 129, 4097)), Dim.B: (8, ())},  # fused_softmax_runs' s % 4, b*a/t % 8 and its window
)


def check(knobs: Any) -> None:
    """ConfigError for knob values megatron-core's layer does not have."""
    if knobs.bias_activation_fusion and knobs.mlp != "swiglu" and not getattr(knobs, "add_bias_linear", True):
        raise ConfigError(
            f"impl megatron: bias_activation_fusion with {knobs.mlp} fuses fc1's bias; it needs add_bias_linear"
        )
    if knobs.recompute == "op":
        raise ConfigError("impl megatron: recompute op is torchtitan's op-level checkpointing; use selective or full")
    if knobs.attention == "flash" and (knobs.attention_softmax_in_fp32 or not knobs.masked_softmax_fusion):
        flag = "--attention-softmax-in-fp32" if knobs.attention_softmax_in_fp32 else "--no-masked-softmax-fusion"
        raise ConfigError(f"impl megatron: {flag} sets FusedScaleMaskSoftmax, which flash attention does not run;"
                          " drop it, or use --attention eager")
    if knobs.moe_router_score_function == "sigmoid" and knobs.moe_router_pre_softmax:
        raise ConfigError("impl megatron: with the sigmoid router, moe_router_pre_softmax changes nothing (it always"
                          " renormalises the top k); leave it unset")


# Found by the differential test (tests/probe/test_differential.py) at the edges of the sizes.
CONDITIONS = (
    SizeCondition(
        CAUSAL_MASK, "FusedScaleMaskSoftmax.forward_torch_softmax builds the causal mask only for sq > 1 (one query is"
        " its KV-cache case): at s = 1 masked_fill_ keeps none",
        kept=lambda sizes, t: sizes[Dim.S] > 1,
    ),
    SizeCondition(
        QKV_QUERY_COLUMNS, "with one K/V group per rank (g = t) the query heads lie side by side in the fused QKV"
        " output: get_query_key_value_tensors' reshape is a view, no query copy is made, and the query's columns are"
        " the query itself",
        kept=lambda sizes, t: sizes[Dim.G] // t > 1,
    ),
    SizeCondition(
        ledger.MLA_V, "MLASelfAttention's value.contiguous() copies V, a d_v-wide split of linear_kv_up_proj's (s, b,"
        " a/t, d_n + d_v) output, unless b = s = 1 with one head on the rank: V is then contiguous as it is, and the"
        " core keeps that view, with the whole output",
        kept=lambda sizes, t: (sizes[Dim.B] > 1) | (sizes[Dim.S] > 1) | (sizes[Dim.A] // t > 1),
        instead=(ledger.MLA_KV_UP_OUT,),  # found by the differential test
    ),
    SizeCondition(
        MLA_KV_DOWN_VIEW, "with one token a rank (b s/t = 1), scatter_to_sequence_parallel_region's chunk of the KV"
        " latent is contiguous as it is, so `.contiguous()` returns a view and kv_layernorm keeps the gathered down"
        " projection's whole (b, s, r_kv + d_r) output, not the (b, s/t, r_kv) copy SP keeps elsewhere",
        kept=lambda sizes, t: sizes[Dim.B] * sizes[Dim.S] // t > 1, instead=(MLA_KV_DOWN_GATHERED,),
    ),
    SizeCondition(
        QUERY_COPY, "with one K/V group per rank (g = t) and b = 1, DotProductAttention's query.reshape(sq, b*np, hn)"
        " of that query view is a view too (only b's stride stood in the way): QK^T keeps the whole fused QKV output"
        " in the query copy's place",
        kept=lambda sizes, t: (sizes[Dim.B] > 1) | (sizes[Dim.G] // t > 1), instead=(QKV_OUT,),
    ),
    SizeCondition(
        GATHERED_ROUTING_MAP, "with a capacity, the router's map is the one its product (probs * map) keeps; with"
        " tp*ep = 1 (nothing gathered) and one token or one expert, the all-gather dispatcher's"
        " local_map.T.contiguous() is a view of it, and masked_select keeps that same mask",
        kept=lambda sizes, t: (t > 1) | (sizes[Dim.E] > sizes[Dim.EL])
        | ((sizes[Dim.B] * sizes[Dim.S] > 1) & (sizes[Dim.E] > 1)),
        applies=lambda knobs: knobs.moe_expert_capacity_factor is not None,
    ),
)


# MoELayer.forward: `if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:
# raise ValueError(...)`. Refused for the knobs alone (any t): at t=1 tp lays out nothing that none does not.
MOE_WITHOUT_SP = Refusal(
    "tp", lambda knobs: knobs.moe, "with experts (num_experts set)",
    "megatron-core's MoELayer refuses tensor parallelism without sequence parallelism in training",
    "megatron-core 0.16.1, megatron/core/transformer/moe/moe_layer.py: MoELayer.forward raises ValueError;"
    " refused at any t, as tp at t=1 is none",
)


def tp_plan(knobs: Any) -> TPPlan:
    """megatron-core's layer as its classes split it (local spec): norms sequence-parallel, linear_qkv (latent
    attention's up projections, after its down projections, column-parallel with their outputs gathered) and
    linear_fc1 ColumnParallelLinear, linear_proj and linear_fc2 RowParallelLinear; with experts, MoELayer's shared
    experts a pair of their own, then its experts (etp = t, over ep)."""
    down, qkv = (), ("linear_qkv",)
    if knobs.mla:  # a query latent or not
        down, qkv = (("q", "kv"), ("linear_q_up_proj", "linear_kv_up_proj")) if knobs.q_lora_rank else \
            (("kv",), ("linear_q_proj", "linear_kv_up_proj"))
    shared = pair(SHARED, ("mlp.shared_experts.linear_fc1",), "mlp.shared_experts.linear_fc2") \
        if knobs.moe_shared_expert_intermediate_size else ()
    mlp = (*shared, Rule("mlp.experts", Style.EXPERTS)) if knobs.moe else \
        pair(MLP, ("mlp.linear_fc1",), "mlp.linear_fc2")
    return TPPlan((Rule("input_layernorm", Style.SEQUENCE),
                   *(Rule(f"self_attention.linear_{x}_down_proj", Style.COLWISE_GATHER_OUTPUT) for x in down),
                   *pair(ATTENTION, tuple(f"self_attention.{m}" for m in qkv), "self_attention.linear_proj"),
                   Rule("pre_mlp_layernorm", Style.SEQUENCE), *mlp))


def check_sizes(config: Any) -> None:
    """Expert tensor parallelism (etp = t) cuts each expert's MLP, and TP the shared experts' and latent attention's
    down projections, into t column shards: megatron-core's ColumnParallelLinear asserts that t divides their widths."""
    if config.mla:
        width = config.kv_lora_rank + config.qk_rope_head_dim
        divides(config.t, "t", width, f"kv_lora_rank+qk_rope_head_dim={config.kv_lora_rank}+"
                f"{config.qk_rope_head_dim}", "linear_kv_down_proj is column-parallel, gathered over t")
        if config.q_lora_rank is not None:
            divides(config.t, "t", config.q_lora_rank, "q_lora_rank", "linear_q_down_proj is column-parallel,"
                    " gathered over t")
    if not config.moe:
        return
    _check_expert_biases(config)
    _check_padded_all_to_all(config)
    divides(config.t, "t", config.expert_ffn, "moe_ffn_hidden_size", "expert tensor parallelism, etp = t, splits"
            " each expert's MLP into t column shards")
    if config.moe_shared_expert_intermediate_size:
        divides(config.t, "t", config.moe_shared_expert_intermediate_size, "moe_shared_expert_intermediate_size",
                "the shared experts' MLP is split into t column shards")


def _check_padded_all_to_all(config: Any) -> None:
    """megatron-core's all-to-all dispatcher, padded to capacity, views a router's permuted tokens as (E, capacity);
    where the capacity ceil(k*n/E * c) passes the n tokens a router sees, an expert keeps each token once (fewer
    than capacity) and the view fails ("shape '[4, 5]' is invalid for input of size 16"). Since n >= 1 is whole, that
    is k*c > E whatever b and s are."""
    k, c, e = config.moe_router_topk, config.moe_expert_capacity_factor, config.num_experts
    if config.moe_token_dispatcher_type == "alltoall" and config.moe_pad_expert_input_to_capacity and k * c > e:
        raise ConfigError(f"impl megatron: megatron-core's all-to-all dispatcher fails padded to a capacity past the"
                          f" tokens a router sees (moe_router_topk*moe_expert_capacity_factor={k}*{c}={k * c:g} >"
                          f" num_experts={e}: its permute views them as (E, capacity)); use"
                          f" moe_token_dispatcher_type allgather, or a capacity factor of at most E/k={e / k:g}")


def _check_expert_biases(config: Any) -> None:
    """megatron-core refuses biases in its experts at etp > 1 (TransformerConfig.__post_init__: "Bias in Moe is only
    supported when ETP==1") and in its shared experts at all (SharedExpertMLP.__init__ asserts add_bias_linear ==
    False); memcalc models etp = t."""
    shared = config.moe_shared_expert_intermediate_size is not None
    if config.add_bias_linear and (config.t > 1 or shared):
        where = "its shared experts" if shared else f"its experts at etp = t = {config.t} (only at etp = 1)"
        raise ConfigError(f"impl megatron: megatron-core refuses biases in {where}; give --no-bias-linear (or"
                          " add_bias_linear: false in the config; Megatron-LM's --disable-bias-linear)")


IMPLEMENTATION = Implementation(
    name="megatron", title="Megatron-core",
    measured_on="megatron-core 0.16.1 TransformerLayer and TransformerBlock (full recompute), local spec, on CPU",
    keeps=keeps, tp_plan=tp_plan, sequence_parallel_forms=sequence_parallel_forms, tensors=TENSORS,
    check=check, check_sizes=check_sizes, size_rule=FUSED_SOFTMAX, size_conditions=CONDITIONS,
    refuses=(MOE_WITHOUT_SP,),
)
