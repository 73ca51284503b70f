"""The ledger: every tensor a transformer layer keeps for backward, described once.

Each `SavedTensor` names one activation, its shape in the model's dimensions,
what decides its bytes per element, which region of the layer it lives in (and so
how TP and SP split it), and why backward needs it. The derivations follow the
seed (shared/SEED.md, section 1): a tensor is an activation exactly when some
op's backward reads it.

Everything else is derived from these objects: numbers (`memcalc.model.evaluate`),
symbolic formulas (`memcalc.model.formula`), tables, docs, and the probe's labels.
The layer is Megatron's pre-norm block:

    x -> norm1 -> [QKV -> core attention -> out-proj] -> dropout -> +x
      -> norm2 -> [fc1 -> GELU | SwiGLU -> fc2]        -> dropout -> +

where [...] is the column-/row-parallel pair that tensor parallelism splits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields, replace
from enum import Enum
from typing import NamedTuple

from memcalc.records import record


class Dim(Enum):
    """A dimension of a saved tensor; the value is its symbol in formulas."""

    B = "b"  # micro-batch
    S = "s"  # sequence
    H = "h"  # hidden
    A = "a"  # attention heads
    G = "g"  # K/V groups (= a for multi-head attention)
    D = "d"  # head dimension: kv_channels, h/a unless set
    F = "f"  # MLP hidden size (= 4h unless set)
    V = "v"  # vocabulary (padded to a multiple of t where split)
    QKV = "a+2g"  # heads of a fused QKV projection's output: a query, g key and g value heads
    E = "E"  # routed experts (num_experts)
    K = "k"  # experts each token is routed to (top-k)
    FE = "e"  # one expert's MLP hidden size (moe_ffn_hidden_size, = f unless set)
    U = "u"  # the shared experts' MLP hidden size (moe_shared_expert_intermediate_size)
    R = "r"  # token-expert slots this rank's experts receive: k*b*s balanced, else the bound asked for
    RS = "r_s"  # token-expert slots a tensor-parallel group's own tokens keep: k*b*s, fewer where a capacity drops
    EL = "E/ep"  # the routed experts on one rank (num_experts / ep)
    QR = "r_q"  # multi-head latent attention: the query latent's width (q_lora_rank)
    KVR = "r_kv"  # the key/value latent's width (kv_lora_rank)
    KVD = "r_kv+d_r"  # the key/value down projection's output: the latent and the keys' RoPE part side by side
    DR = "d_r"  # the RoPE part of each query/key head (qk_rope_head_dim), shared by every head for keys
    QK = "d_n+d_r"  # one query/key head: its no-RoPE part (qk_nope_head_dim) and its RoPE part
    DV = "d_v"  # one value head (v_head_dim)
    NV = "d_n+d_v"  # one head of the key/value up projection's output: its keys' no-RoPE part and its value
    S1 = "s+1"  # the keys and one more column: gpt-oss's attention sink joined to each query's scores
    HALF_D = "d/2"  # half a head: gpt-oss's RoPE tables, one channel of each rotated pair


class Region(Enum):
    """Where in the layer a tensor lives, which decides who may split it."""

    SEQUENCE = "sequence"  # outside the column/row-parallel pair: SP splits s
    TENSOR = "tensor"  # inside the pair: TP splits heads, groups, ffn, hidden (or the vocabulary)
    REPLICATED = "replicated"  # whole on every rank under every layout (the token ids)
    EXPERT = "expert"  # the tokens a rank's experts receive (r, counted per rank): TP splits only the expert width


class Kind(Enum):
    """What decides a tensor's bytes per element."""

    ACTIVATION = "activation dtype"
    MASK = "bool mask (1 byte)"
    NORM_STATS = "norm statistics (fp32 on CUDA, activation dtype on CPU)"
    FP32 = "fp32"
    INT64 = "int64 (8 bytes)"
    INT32 = "int32 (4 bytes)"
    INDEX_PAIR = "two int64 indices (16 bytes)"


@record
class SavedTensor:
    """One activation kept for backward, with the reason it is kept."""

    name: str
    saved_by: str
    shape: tuple[Dim, ...]
    kind: Kind
    region: Region
    why: str
    paper: bool = True  # False: a small term the paper leaves out (shown with exact accounting)
    stage: str = "layer"  # "layer": in every transformer layer; "first"/"last": beside the embedding/output layer;
    # "model": made once per forward by the model and kept by every layer (RoPE's tables; `model_wide`)

    @property
    def model_wide(self) -> bool:
        """One storage that every layer keeps: a layer's bytes count it, all L layers' once per model chunk."""
        return self.stage == "model"

    @property
    def block(self) -> str:
        """The block a tensor belongs to: the part of its name before '/'."""
        return self.name.split("/", 1)[0]


class NormTensors(NamedTuple):
    """What one normalisation layer saves."""

    input: SavedTensor
    mean: SavedTensor
    rstd: SavedTensor


@record(kw_only=True)
class RMSNormTensors:
    """What one RMSNorm keeps, by role: each library's norm keeps some of them (the rest None). Iterating gives the
    kept ones in the order of the fields, the order the norm's ops make them."""

    input: SavedTensor | None = None  # x itself (CUDA's fused kernel)
    input_fp32: SavedTensor | None = None  # x upcast to fp32 (an eager norm, or CPU's composite)
    rstd: SavedTensor  # 1/sqrt(mean(x^2) + eps), fp32
    weight_plus_one: SavedTensor | None = None  # Gemma's (1 + w) in fp32
    normed: SavedTensor | None = None  # x * rstd cast back to x's dtype
    normed_fp32: SavedTensor | None = None  # x * rstd in fp32

    def __iter__(self) -> Iterator[SavedTensor]:
        kept = (getattr(self, f.name) for f in fields(self))
        return (x for x in kept if x is not None)


# Reasons that several tensors share, here and at the model's ends (memcalc.sizing.totals).
WHY_NORM_INPUT = "the norm's backward rebuilds the normalised input from x itself"
WHY_NORM_MEAN = "LayerNorm keeps each token's mean so backward need not recompute it"
WHY_NORM_RSTD = "the norm keeps each token's 1/sqrt(variance + eps) for backward"
WHY_DROPOUT_MASK = "dropout's backward multiplies the gradient by the same mask"
WHY_GATHERED_INPUT = "dW = X^T dY needs the input; under SP only its sequence shard is kept and re-gathered"


def _norm_tensors(stem: str, by: str, rows: tuple[Dim, ...], width: Dim, region: Region) -> NormTensors:
    """A norm's input, `rows` of `width` channels, and a mean and an rstd a row; every norm differs only in these."""
    return NormTensors(
        SavedTensor(f"{stem}input", by, (*rows, width), Kind.ACTIVATION, region, WHY_NORM_INPUT),
        SavedTensor(f"{stem}mean", by, rows, Kind.NORM_STATS, region, WHY_NORM_MEAN, paper=False),
        SavedTensor(f"{stem}rstd", by, rows, Kind.NORM_STATS, region, WHY_NORM_RSTD, paper=False),
    )


def _norm(prefix: str, before: str, width: Dim = Dim.H) -> NormTensors:
    """The tensors of the norm in front of `before` over `width` channels, one row a token.

    `prefix` is a block ("ln1": ln1/input) or a block and a stem ("mla/q_norm_": mla/q_norm_input).
    """
    stem = prefix if "/" in prefix else f"{prefix}/"
    return _norm_tensors(stem, f"norm before {before}", (Dim.B, Dim.S), width, Region.SEQUENCE)


def _mask(name: str, saved_by: str, shape: tuple[Dim, ...], region: Region, stage: str = "layer") -> SavedTensor:
    """A dropout's one-byte mask: every dropout keeps one, for the same reason."""
    return SavedTensor(name, saved_by, shape, Kind.MASK, region, WHY_DROPOUT_MASK, stage=stage)


# Shapes many tensors share, here and in each implementation's module.
BSH = (Dim.B, Dim.S, Dim.H)
BSF = (Dim.B, Dim.S, Dim.F)
BASS = (Dim.B, Dim.A, Dim.S, Dim.S)
BASD = (Dim.B, Dim.A, Dim.S, Dim.D)


def in_pair(name: str, saved_by: str, shape: tuple[Dim, ...], why: str) -> SavedTensor:
    """An activation-dtype tensor inside the column/row-parallel pair, which TP splits (its heads or its width)."""
    return SavedTensor(name, saved_by, shape, Kind.ACTIVATION, Region.TENSOR, why)


def _linear_input(name: str, saved_by: str, shape: tuple[Dim, ...] = BSH, stage: str = "layer") -> SavedTensor:
    """A column-parallel linear's input, kept for its weight's gradient: outside the pair, so SP keeps its sequence
    shard and re-gathers it (`WHY_GATHERED_INPUT`)."""
    return SavedTensor(name, saved_by, shape, Kind.ACTIVATION, Region.SEQUENCE, WHY_GATHERED_INPUT, stage=stage)


LAYER_INPUT = SavedTensor(
    "layer/input", "full-layer checkpoint", BSH, Kind.ACTIVATION, Region.SEQUENCE,
    "full recomputation keeps only the layer's input and reruns its forward in backward",
)

LN1 = _norm("ln1", "attention")
LN2 = _norm("ln2", "the MLP")


def _head_norm(which: str, heads: Dim) -> NormTensors:
    """A QK norm's tensors (qk_layernorm): one norm over each of `heads` heads' d channels, before QK^T, inside the
    column/row-parallel pair (TP splits its heads); `which` is "q" or "k". Its output is the core's Q (or K)."""
    by = f"{which.upper()} norm (qk_layernorm), over each {'query' if which == 'q' else 'key'} head's d channels"
    return _norm_tensors(f"attention/{which}_norm_", by, (Dim.B, heads, Dim.S), Dim.D, Region.TENSOR)


QKV_IN = _linear_input("attention/qkv_in", "QKV linear (column-parallel)")
Q = in_pair("attention/q", "core attention (QK^T or flash kernel)", BASD, "the gradient of K in QK^T is dScores^T Q")
K = in_pair("attention/k", "core attention (QK^T or flash kernel)", (Dim.B, Dim.G, Dim.S, Dim.D),
            "the gradient of Q in QK^T is dScores K")
V = in_pair("attention/v", "core attention (weights x V or flash kernel)", (Dim.B, Dim.G, Dim.S, Dim.D),
            "the gradient of the attention weights is dOut V^T")
Q_NORM = _head_norm("q", Dim.A)
K_NORM = _head_norm("k", Dim.G)
SOFTMAX_OUT = in_pair("attention/softmax_out", "softmax", BASS,
                      "softmax backward, diag(S') - S'S'^T, needs its output, not its input")
ATTN_DROPOUT_MASK = _mask("attention/dropout_mask", "attention dropout", BASS, Region.TENSOR)
ATTN_DROPOUT_OUT = in_pair("attention/dropout_out", "weights x V matmul", BASS,
                           "the gradient of V is (dropped-out weights)^T dOut")
SOFTMAX_LSE = SavedTensor(
    "attention/softmax_lse", "flash attention kernel", (Dim.B, Dim.A, Dim.S), Kind.FP32, Region.TENSOR,
    "flash attention rebuilds the softmax in backward from Q, K and each row's log-sum-exp", paper=False,
)
PROJ_IN = in_pair("attention/proj_in", "output projection (row-parallel), on a heads of d",
                  (Dim.B, Dim.S, Dim.A, Dim.D),
                  "dW = X^T dY needs the input (flash attention saves this same tensor as its output)")
ATTN_OUT_DROPOUT_MASK = _mask("attention/out_dropout_mask", "dropout after attention", BSH, Region.SEQUENCE)

FC1_IN = _linear_input("mlp/fc1_in", "fc1 (column-parallel)")
GELU_IN = in_pair("mlp/gelu_in", "GELU", BSF, "GELU's derivative is evaluated at its input")
SWIGLU_GATE = in_pair("mlp/gate", "SiLU", BSF, "SiLU's derivative is evaluated at its input, the gate projection")
SWIGLU_UP = in_pair("mlp/up", "SiLU(gate) * up", BSF, "the gradient of SiLU(gate) in the product is dY * up")
SWIGLU_SILU_OUT = in_pair("mlp/silu_out", "SiLU(gate) * up", BSF,
                          "the gradient of up in the product is dY * SiLU(gate)")
FC2_IN = in_pair("mlp/fc2_in", "fc2 (row-parallel)", BSF, "dW = X^T dY needs the input")
MLP_DROPOUT_MASK = _mask("mlp/dropout_mask", "dropout after the MLP", BSH, Region.SEQUENCE)

# -- A mixture-of-experts layer: its MLP is a router, E expert MLPs and (optionally) shared experts ----------------
# A router scores each token against the E experts and sends it to its top k; each expert runs its MLP on the
# tokens it receives, and the outputs are combined weighted by the routing probabilities. The tokens an expert
# receives depend on the data: r, the token-expert slots a rank's experts receive, is k*b*s when the router
# balances the load and up to the bound `moe_tokens` names (memcalc.model.evaluate.routed_slots).
WHY_EXPERT_TOKENS = "the tokens an expert receives depend on the router: r is the bound named in the output"


def small_moe(name: str, saved_by: str, shape: tuple[Dim, ...], kind: Kind, why: str,
              region: Region = Region.SEQUENCE) -> SavedTensor:
    """One of a MoE layer's small tensors (`moe/<name>`: routing scores, maps, indices), which the paper leaves out."""
    return SavedTensor(f"moe/{name}", saved_by, shape, kind, region, why, paper=False)


MOE_IN = SavedTensor(
    "moe/input", "router (gating linear)", BSH, Kind.ACTIVATION, Region.SEQUENCE,
    "the router's weight gradient dW = X^T dLogits needs its input; experts gather their tokens from it by index",
)
ROUTER_TOPK_INDICES = small_moe(
    "topk_indices", "router top-k", (Dim.B, Dim.S, Dim.K), Kind.INT64,
    "the gradient of the top-k values is scattered back to the experts each token chose")
EXPERT_IN = SavedTensor(
    "moe/expert_in", "each expert's fc1", (Dim.R, Dim.H), Kind.ACTIVATION, Region.EXPERT,
    "each expert's dW = X^T dY needs the tokens it received; " + WHY_EXPERT_TOKENS,
)


_MLP_TENSORS = (GELU_IN, SWIGLU_GATE, SWIGLU_UP, SWIGLU_SILU_OUT, FC2_IN)  # each expert's and the shared experts' too


def _for_each_expert(dense: SavedTensor) -> SavedTensor:
    """The dense MLP's tensor `dense` as each expert keeps it (mlp/gate as moe/expert_gate): for the r token slots
    its experts receive, of the expert width e, split as experts are (memcalc.model.strategy)."""
    return replace(dense, name=f"moe/expert_{dense.name.split('/')[1]}", shape=(Dim.R, Dim.FE), region=Region.EXPERT,
                   saved_by=f"each expert's {dense.saved_by.split(' (')[0]}",
                   why=f"{dense.why}, for each token an expert received")


EXPERT_GELU_IN, EXPERT_GATE, EXPERT_UP, EXPERT_SILU_OUT, EXPERT_FC2_IN = map(_for_each_expert, _MLP_TENSORS)
SHARED_GELU_IN, SHARED_GATE, SHARED_UP, SHARED_SILU_OUT, SHARED_FC2_IN = (  # mlp/gate as moe/shared_gate, u wide
    replace(x, name=f"moe/shared_{x.name.split('/')[1]}", saved_by=f"shared experts' {x.saved_by}",
            shape=(Dim.B, Dim.S, Dim.U))
    for x in _MLP_TENSORS
)

MOE_TENSORS: tuple[SavedTensor, ...] = (
    MOE_IN, ROUTER_TOPK_INDICES, EXPERT_IN, EXPERT_GELU_IN, EXPERT_GATE, EXPERT_UP, EXPERT_SILU_OUT, EXPERT_FC2_IN,
    SHARED_GELU_IN, SHARED_GATE, SHARED_UP, SHARED_SILU_OUT, SHARED_FC2_IN,
)

# -- Multi-head latent attention (DeepSeek-V2/V3): Q, K and V come up from low-rank latents ---------------------
# x -> q_down -> q_norm -> q_up -> per-head [q_nope | q_rope]  (or x -> q_proj when q_lora_rank is unset)
# x -> kv_down -> [latent | k_rope] ; latent -> kv_norm -> kv_up -> per-head [k_nope | v] ; RoPE(k_rope), one head
# The core attends with heads of d_n+d_r (K is [k_nope | k_rope copied to every head]) and values of d_v. The
# latents are whole per token (TP splits only the up projections' heads); under SP they are sequence shards,
# each up projection gathering its input as the QKV linear does. The RoPE key part is not kept: RoPE keeps
# only its cos/sin tables (they need no gradient), and the concatenation into K copies it.
MLA_Q_NORM = _norm("mla/q_norm_", "the query up projection", Dim.QR)
MLA_KV_NORM = _norm("mla/kv_norm_", "the key/value up projection", Dim.KVR)
MLA_Q_UP_IN = _linear_input("mla/q_up_in", "query up projection (column-parallel), on the normalised query latent",
                            (Dim.B, Dim.S, Dim.QR))
MLA_KV_UP_IN = _linear_input("mla/kv_up_in", "key/value up projection (column-parallel), on the normalised KV latent",
                             (Dim.B, Dim.S, Dim.KVR))
MLA_Q = replace(Q, name="mla/q", saved_by=f"{Q.saved_by}: [q_nope | RoPE(q_rope)] per head",
                shape=(Dim.B, Dim.A, Dim.S, Dim.QK))
MLA_K = replace(K, name="mla/k", saved_by=f"{K.saved_by}: [k_nope | RoPE(k_rope) copied to every head]",
                shape=(Dim.B, Dim.A, Dim.S, Dim.QK))
MLA_V = replace(V, name="mla/v", saved_by=f"{V.saved_by}: values up-projected from the latent",
                shape=(Dim.B, Dim.A, Dim.S, Dim.DV))
# V is a d_v-wide split of each head of the key/value up projection's output: where the core keeps it as that view (a
# size condition of the implementation's says where), the whole output is kept in V's place.
MLA_KV_UP_OUT = in_pair(
    "mla/kv_up_out", "core attention (weights x V) where V is a view of it: the key/value up projection's output",
    (Dim.B, Dim.S, Dim.A, Dim.NV),
    "the gradient of the attention weights is dOut V^T: V is read from the output it views")
MLA_PROJ_IN = replace(PROJ_IN, name="mla/proj_in", saved_by="output projection (row-parallel), on a heads of d_v",
                      shape=(Dim.B, Dim.S, Dim.A, Dim.DV))
MLA_TENSORS: tuple[SavedTensor, ...] = (
    *MLA_Q_NORM, MLA_Q_UP_IN, *MLA_KV_NORM, MLA_KV_UP_IN, MLA_Q, MLA_K, MLA_V, MLA_PROJ_IN,
)

ALL_TENSORS: tuple[SavedTensor, ...] = (
    LAYER_INPUT, *LN1, QKV_IN, *Q_NORM, *K_NORM, Q, K, V, SOFTMAX_OUT, ATTN_DROPOUT_MASK, ATTN_DROPOUT_OUT,
    SOFTMAX_LSE, PROJ_IN, ATTN_OUT_DROPOUT_MASK, *MLA_TENSORS, *LN2, FC1_IN, GELU_IN, SWIGLU_GATE,
    SWIGLU_UP, SWIGLU_SILU_OUT, FC2_IN, MLP_DROPOUT_MASK, *MOE_TENSORS,
)


# -- The model's two ends: kept once per micro-batch on the first and the last pipeline stage -----------------
# After Korthikanti et al. 2022, section 4.3: the dropout after the embedding keeps a mask of sbh bytes, the
# norm before the output layer and the output layer keep 2sbh each, and the cross-entropy keeps the logits in
# fp32, 4sbv; with sequence parallelism the first three are split by t along s, and the logits are split by t
# along the vocabulary under either tensor-parallel layout. A product of the logits by a number (Cohere's
# logit_scale) keeps nothing: its backward scales dY by the same number.

EMBEDDING_INPUT_IDS = SavedTensor(
    "embedding/input_ids", "word embedding lookup", (Dim.B, Dim.S), Kind.INT64, Region.REPLICATED,
    "the embedding's weight gradient adds dY into the rows the token ids picked", paper=False, stage="first",
)
EMBEDDING_DROPOUT_MASK = _mask("embedding/dropout_mask", "dropout after the embedding", BSH, Region.SEQUENCE, "first")
FINAL_NORM = NormTensors(*(replace(x, stage="last") for x in _norm("final_norm", "the output layer")))
OUTPUT_INPUT = _linear_input("output/input", "output layer (column-parallel over the vocabulary)", stage="last")
LOSS_LOGITS = SavedTensor(
    "loss/logits_fp32", "cross-entropy (vocabulary-parallel)", (Dim.B, Dim.S, Dim.V), Kind.FP32, Region.TENSOR,
    "the loss's gradient is softmax(logits) - onehot(target), from the fp32 softmax kept in forward", stage="last",
)
# Gemma 2's final_logit_softcapping c (transformers' Gemma2ForCausalLM.forward): logits / c, tanh, then * c, which the
# loss reads. Dividing and multiplying by a number keep nothing; tanh keeps its output, whole on every rank (the
# model's tp plan gathers the logits before it).
LOGITS_SOFTCAP_TANH = SavedTensor(
    "loss/softcap_tanh", "final logit soft-capping: tanh(logits / c)", (Dim.B, Dim.S, Dim.V), Kind.ACTIVATION,
    Region.REPLICATED, "tanh's derivative, 1 - tanh^2, is read from its output", stage="last",
)
END_TENSORS: tuple[SavedTensor, ...] = (
    EMBEDDING_INPUT_IDS, EMBEDDING_DROPOUT_MASK, *FINAL_NORM, OUTPUT_INPUT, LOGITS_SOFTCAP_TANH, LOSS_LOGITS,
)
BY_NAME: dict[str, SavedTensor] = {t.name: t for t in (*ALL_TENSORS, *END_TENSORS)}
