"""One training step on one rank, over time: what is live at each moment, and the peak.

`memcalc.sizing.totals` adds model states and the activations a stage keeps; a run goes
out of memory at its peak, a moment when short-lived tensors sit on top of those. This
module walks one step of one micro-batch (pp = 1) the way autograd runs it, tensor by
tensor, and records what is live at every moment where memory can peak:

    steady state        bf16 weights, the fp32 gradient buffer, master weights, Adam's m and v
    forward             the batch; each block's saved tensors (the ledger's) as it finishes
    loss                the bf16 logits, their fp32 copy and the per-token vectors of the
                        vocabulary-parallel cross-entropy, all at once
    backward            block by block, in reverse: each op's new gradients on top of what is
                        still saved; an op's saved tensors and its incoming gradient are freed
                        when it returns; a weight's bf16 gradient is added into the fp32
                        buffer as soon as autograd finishes it
    optimizer step      fused AdamW updates in place: nothing new

The saved tensors are the ledger's (`memcalc.model.evaluate.estimate`, and `END_TENSORS`
at the model's ends), so the per-layer terms follow every implementation rule there.
What the ledger does not hold is named here with its reason: the gradients each op
makes in backward, the loss's working set, and four small tensors the model's ends keep
(`STEP_TENSORS`).

Categories are MemTracker's (`memcalc.probe.step`): a tensor made in forward is an
activation until freed, one made in backward a temporary, a weight's bf16 gradient a
temporary until autograd hands it to the parameter (a moment later it is added into the
buffer and dropped), the fp32 buffer a gradient, master weights and Adam's moments
optimizer states.

Exact for the probe's own model (`memcalc measure --step`): one rank of Megatron's GPT
(tied embeddings, learned positions) with Megatron's vocabulary-parallel cross-entropy and
mixed-precision optimizer, without gradient-accumulation fusion, which on CUDA writes
each fp32 weight gradient straight into the buffer (no bf16 weight gradient at all). A
real run differs further in what an allocator adds: CUDA's caching allocator rounds each
block up to 512 bytes (2 MiB segments for large ones) and fragments; cuBLAS keeps a
workspace per stream; NCCL keeps its buffers. None of those is a tensor, and none is here.

Modelled so far: pp = 1 and cp = 1 (none, tp, tp-sp at any t), the Megatron
implementation's layer with GELU, eager multi-head attention (Megatron's fused softmax, or
its fp32 torch softmax outside the kernel's sizes), LayerNorm, no recomputation, dropout
and biases on or off, tied or untied embeddings, learned or no position table, bf16 or
fp16. Everything else raises ConfigError naming what is missing. Within a layer's forward only the end of
each block is a moment: a forward op's transients are smaller than the gradients the same
op makes in backward, when the same saved tensors are live.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.evaluate import estimate, rank_shape
from memcalc.model.impls import megatron
from memcalc.model.knobs import DTYPE_BYTES, Accounting, element_bytes
from memcalc.model.ledger import Dim, Kind, Region, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import stages
from memcalc.sizing.states import group_params, state_bytes, vocab_shard
from memcalc.sizing.totals import end_sizes, end_tensors

PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES = (
    "parameters", "gradients", "optimizer states", "activations", "temporaries",
)
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, TEMPORARIES)

# -- tensors the model's ends keep that the ledger's END_TENSORS does not list ----------------------

VOCAB_MASK = SavedTensor(
    "embedding/vocab_mask", "vocabulary-parallel embedding: rows outside this rank zeroed", (Dim.B, Dim.S),
    Kind.MASK, Region.REPLICATED, "the zeroed rows get no gradient: backward masks dY with the same mask",
    paper=False, stage="first",
)
POSITION_IDS = SavedTensor(
    "embedding/position_ids", "learned position embedding lookup", (Dim.S,), Kind.INT64, Region.REPLICATED,
    "the position table's gradient adds dY into the rows the positions picked", paper=False, stage="first",
)
TARGET_MASK = SavedTensor(
    "loss/target_mask", "cross-entropy (vocabulary-parallel)", (Dim.B, Dim.S), Kind.MASK, Region.REPLICATED,
    "targets outside this rank's rows get no one-hot term in backward", paper=False, stage="last",
)
MASKED_TARGET = SavedTensor(
    "loss/masked_target", "cross-entropy (vocabulary-parallel)", (Dim.B, Dim.S), Kind.INT64, Region.REPLICATED,
    "backward subtracts one at each target's row, indexed by the targets shifted to this rank", paper=False,
    stage="last",
)
STEP_TENSORS: tuple[SavedTensor, ...] = (VOCAB_MASK, POSITION_IDS, TARGET_MASK, MASKED_TARGET)

# The layer tensors this module knows when each is freed; a layer that keeps another one is not modelled yet.
_LAYER_NAMES = frozenset(x.name for x in (
    *ledger.LN1, *ledger.LN2, ledger.QKV_IN, ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_OUT,
    ledger.ATTN_DROPOUT_MASK, ledger.ATTN_DROPOUT_OUT, ledger.PROJ_IN, ledger.ATTN_OUT_DROPOUT_MASK,
    ledger.FC1_IN, ledger.GELU_IN, ledger.FC2_IN, ledger.MLP_DROPOUT_MASK, megatron.CAUSAL_MASK, megatron.SOFTMAX_FP32,
))


# -- what a timeline is ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Live:
    """One tensor (or one block's saved tensors together) live at a moment."""

    name: str
    category: str  # one of CATEGORIES
    bytes: int
    why: str


@dataclass(frozen=True)
class Moment:
    """What is live right after one op allocates its outputs, before anything it frees is freed."""

    phase: str  # "steady", "forward", "backward" or "optimizer"
    where: str  # the probe's module path ("layers.1.mlp.fc2"), or "" outside any module
    what: str  # the op, in words
    live: tuple[Live, ...]

    @property
    def bytes(self) -> int:
        return sum(x.bytes for x in self.live)

    def by_category(self) -> dict[str, int]:
        """Bytes per category, every category present (0 where none)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for x in self.live:
            out[x.category] += x.bytes
        return out

    def label(self) -> str:
        """`backward layers.1.mlp.fc2 (GEMM: dW and dX)`: the moment in words."""
        where = f" {self.where}" if self.where else ""
        return f"{self.phase}{where} ({self.what})"


@dataclass(frozen=True)
class Timeline:
    """One step on one rank: every moment in order."""

    strategy: Strategy
    moments: tuple[Moment, ...]

    @property
    def steady(self) -> Moment:
        """Between steps: model states alone."""
        return self.moments[0]

    @property
    def peak(self) -> Moment:
        """The moment with the most bytes live (the first, on a tie)."""
        return max(self.moments, key=lambda m: m.bytes)


# -- per-rank sizes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Sizes:
    """Element counts one rank works with, and the widths of its tensors."""

    b: int
    s: int  # the whole sequence: inside the column/row-parallel pair
    s_seq: int  # the sequence outside the pair: s/t under SP
    h: int
    h_t: int  # hidden columns inside the pair (a/t heads of d)
    f_t: int
    a_t: int
    d: int
    qkv_t: int  # QKV output columns on this rank
    v_t: int  # vocabulary rows on this rank (padded)
    positions: int  # rows of the learned position table (0 with RoPE)
    t: int  # ranks that split the weights (1 without TP)
    sp: bool
    act: int  # activation and bf16 weight width

    @classmethod
    def of(cls, config: ModelConfig, strategy: Strategy) -> _Sizes:
        t = strategy.weight_shards(config.t)
        sp = strategy.sequence_parallel and t > 1
        d = config.h // config.a
        return cls(
            b=config.b, s=config.s, s_seq=config.s // t if sp else config.s, h=config.h, h_t=config.h // t,
            f_t=config.ffn // t, a_t=config.a // t, d=d, qkv_t=(config.a + 2 * config.groups) * d // t,
            v_t=vocab_shard(config, t), t=t, sp=sp, act=DTYPE_BYTES[config.dtype],
            positions=config.positions if config.position_embedding_type == "learned_absolute" else 0,
        )

    def seq(self, width: int) -> int:
        """Bytes of an activation-dtype (s, b, width) tensor outside the pair: (s/t, b, width) under SP."""
        return self.act * self.s_seq * self.b * width

    def full(self, width: int) -> int:
        """Bytes of an activation-dtype (s, b, width) tensor with the whole sequence."""
        return self.act * self.s * self.b * width

    def tokens(self, width: int) -> int:
        """Bytes of one `width`-byte value per token of the micro-batch, (b, s)."""
        return width * self.b * self.s


# -- the tape: live tensors, and the moments they make --------------------------------------------------


class _Tape:
    def __init__(self) -> None:
        self.live: dict[str, Live] = {}
        self.moments: list[Moment] = []

    def add(self, name: str, category: str, nbytes: int, why: str) -> None:
        if name in self.live:
            raise AssertionError(f"{name} is live twice")
        if nbytes:
            self.live[name] = Live(name, category, nbytes, why)

    def drop(self, *names: str) -> None:
        for name in names:
            self.live.pop(name, None)

    def mark(self, phase: str, where: str, what: str) -> None:
        self.moments.append(Moment(phase, where, what, tuple(self.live.values())))


# -- the step ------------------------------------------------------------------------------------------


def timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting(exact=True)) -> Timeline:
    """The moments of one training step of `config` under `strategy`, on one rank of the only stage."""
    accounting = replace(accounting, exact=True)  # a timeline counts every byte
    layer = estimate(config, strategy, accounting)
    _check_modelled(config, strategy, tuple(x.tensor.name for x in layer.tensors))
    z = _Sizes.of(config, strategy)
    tape = _Tape()
    _model_states(tape, config, strategy, z)
    tape.mark("steady", "", "model states between steps")
    ends = _Ends(config, strategy, accounting, z)
    ends.forward_embedding(tape)
    saved = {x.tensor.name: x.bytes for x in layer.tensors}
    for i in range(config.L):
        _layer_forward(tape, i, saved, z)
    ends.forward_output_and_loss(tape, config.L)
    ends.backward_loss_and_output(tape, config.L)
    for i in reversed(range(config.L)):
        _layer_backward(tape, i, saved, z, config)
    ends.backward_embedding(tape)
    tape.mark("optimizer", "", "fused AdamW on the fp32 master weights, in place")
    return Timeline(layer.strategy, tuple(tape.moments))


def _check_modelled(config: ModelConfig, strategy: Strategy, names: tuple[str, ...]) -> None:
    """ConfigError naming the first thing this timeline does not model yet."""
    missing = [
        (config.impl != "megatron", f"impl {config.impl} (the timeline follows Megatron's layer)"),
        (config.pp != 1, f"pp={config.pp} (one micro-batch on the only stage)"),
        (config.cp != 1, f"cp={config.cp}"),
        (config.recompute != "none", f"recompute {config.recompute}"),
        (config.mlp != "gelu", f"mlp {config.mlp}"),
        (config.attention != "eager", f"attention {config.attention}"),
        (config.norm != "layernorm", f"norm {config.norm}"),
        (config.groups != config.a, "grouped-query attention"),
        (config.dtype == "fp32", "dtype fp32 (Megatron trains fp32 without master weights)"),
    ]
    unknown = [n for n in names if n not in _LAYER_NAMES]
    if unknown:
        missing.append((True, f"a layer that keeps {', '.join(unknown)}"))
    for absent, what in missing:
        if absent:
            raise ConfigError(f"the step timeline does not model {what} yet")


def _model_states(tape: _Tape, config: ModelConfig, strategy: Strategy, z: _Sizes) -> None:
    """Weights, the gradient buffer and the optimizer's states, as `memcalc.sizing.states` counts them."""
    (stage,) = stages(config.L, config.pp, config.vpp)
    held = sum(group_params(config, stage, z.t).values())
    states = state_bytes(config, held)
    for name, category, why in (
        ("states/weights", PARAMETERS, f"{held:,} parameters in the training dtype"),
        ("states/grads", GRADIENTS, "Megatron's contiguous fp32 main_grad buffer, allocated before the first step"),
        ("states/master_weights", OPTIMIZER, "the fp32 copy the optimizer updates"),
        ("states/adam_m", OPTIMIZER, "Adam's first moment, fp32"),
        ("states/adam_v", OPTIMIZER, "Adam's second moment, fp32"),
    ):
        tape.add(name, category, states.get(name, 0), why)
    tape.add("optimizer/step", OPTIMIZER, 4, "torch's AdamW counts steps in a 0-d fp32 tensor")


# -- the model's two ends ---------------------------------------------------------------------------------


class _Ends:
    """Embedding, final norm, output layer and loss: their saved tensors (ledger) and their gradients."""

    def __init__(self, config: ModelConfig, strategy: Strategy, accounting: Accounting, z: _Sizes) -> None:
        self.z = z
        self.tied = config.tie_embeddings
        sizes = end_sizes(config, strategy)
        tp = z.t > 1
        extra = (
            *((VOCAB_MASK,) if tp else ()),
            *((POSITION_IDS,) if z.positions else ()),
            TARGET_MASK, MASKED_TARGET,
        )
        kept = (*end_tensors(config, accounting, "first"), *end_tensors(config, accounting, "last"), *extra)
        self.saved = {
            x.name: element_bytes(x.kind, config, accounting) * _prod(rank_shape(x, strategy, sizes, config.t))
            for x in kept
        }
        self.why = {x.name: x.why for x in kept}
        # At t = 1 the embedding keeps the batch's token ids themselves; under TP it keeps a shifted copy.
        self.ids_are_tokens = not tp

    def _saved(self, tape: _Tape, *tensors: SavedTensor) -> None:
        for x in tensors:
            if x.name in self.saved:
                tape.add(x.name, ACTIVATIONS, self.saved[x.name], self.why[x.name])

    def forward_embedding(self, tape: _Tape) -> None:
        z = self.z
        tokens = ledger.EMBEDDING_INPUT_IDS.name if self.ids_are_tokens else "batch/tokens"
        tape.add(tokens, ACTIVATIONS, z.tokens(8), "the micro-batch's token ids (int64), live for the whole step")
        tape.add("batch/labels", ACTIVATIONS, z.tokens(8), "the micro-batch's labels (int64), live for the whole step")
        if not self.ids_are_tokens:
            self._saved(tape, ledger.EMBEDDING_INPUT_IDS, VOCAB_MASK)
        self._saved(tape, POSITION_IDS, ledger.EMBEDDING_DROPOUT_MASK)
        tape.add("layers.0/ln1/input", ACTIVATIONS, z.seq(z.h), ledger.WHY_NORM_INPUT)
        tape.mark("forward", "embedding", "word and position embeddings, dropout")

    def forward_output_and_loss(self, tape: _Tape, layers: int) -> None:
        z = self.z
        tape.add(ledger.FINAL_NORM.input.name, ACTIVATIONS, tape.live.pop(f"layers.{layers}/ln1/input").bytes,
                 ledger.WHY_NORM_INPUT)
        self._saved(tape, ledger.FINAL_NORM.mean, ledger.FINAL_NORM.rstd, ledger.OUTPUT_INPUT)
        tape.mark("forward", "final_norm", "the norm before the output layer")
        logits = z.act * z.s * z.b * z.v_t
        tape.add("output/logits", ACTIVATIONS, logits, "the output layer's logits (s, b, v/t) in the training dtype")
        # Megatron's _VocabParallelCrossEntropy.forward, at its widest: right after the per-token loss.
        self._saved(tape, ledger.LOSS_LOGITS, TARGET_MASK, MASKED_TARGET)
        for name, width, why in LOSS_WORKING_SET:
            if name != "loss/target" or z.b > 1:  # with b = 1 the transposed labels are contiguous: no copy
                tape.add(name, ACTIVATIONS, z.tokens(width), why)
        tape.mark("forward", "loss", "fp32 logits and the per-token vectors of the cross-entropy")
        tape.drop("output/logits", *(name for name, _, _ in LOSS_WORKING_SET))
        tape.add("loss/value", ACTIVATIONS, 4, "the mean loss (a 0-d fp32 tensor) lives to the step's end")

    def backward_loss_and_output(self, tape: _Tape, layers: int) -> None:
        z = self.z
        tape.add("loss/grad seed", ACTIVATIONS, 4,
                 "loss.backward() starts from a 0-d ones tensor, made before autograd runs")
        dlogits = z.act * z.s * z.b * z.v_t
        tape.add("grad/logits", TEMPORARIES, dlogits,
                 "the loss's fp32 gradient is the saved softmax, changed in place; autograd casts it to bf16")
        tape.mark("backward", "loss", "the logits' gradient cast to the training dtype")
        tape.drop(ledger.LOSS_LOGITS.name, TARGET_MASK.name, MASKED_TARGET.name)
        weight = z.act * z.v_t * z.h
        embedding_grad = "grad/embedding (output layer)" if self.tied else "grad/output weight"
        why = ("the tied embedding's gradient from the output layer waits in autograd's input buffer until the"
               " embedding's own gradient is added to it" if self.tied else "the output layer's bf16 weight gradient")
        dx = "grad/output input"
        if z.sp:
            _gathered_linear_backward(tape, z, "output_layer", "grad/logits", embedding_grad, weight, why, dx)
        else:
            tape.add(embedding_grad, TEMPORARIES, weight, why)
            tape.add(dx, TEMPORARIES, z.full(z.h), "dX of the output layer, (s, b, h)")
            tape.mark("backward", "output_layer", "GEMMs: dW and dX")
            tape.drop("grad/logits", ledger.OUTPUT_INPUT.name)
            if not self.tied:  # autograd hands it to the weight at once, and the hook adds it into the buffer
                tape.drop(embedding_grad)
            _enter_tp_backward(tape, z, "output_layer", dx)
        tape.drop(ledger.OUTPUT_INPUT.name)
        if not self.tied:
            tape.drop(embedding_grad)
        _norm_backward(tape, z, "final_norm", dx, ledger.FINAL_NORM, None, f"grad/layers.{layers - 1}/output")
        tape.drop("grad/final_norm weight and bias")

    def backward_embedding(self, tape: _Tape) -> None:
        z = self.z
        incoming = "grad/layers.0/ln1/input"
        dropout = ledger.EMBEDDING_DROPOUT_MASK.name in self.saved
        grad = incoming
        if dropout:
            grad = "grad/embedding dropout"
            tape.add(grad, TEMPORARIES, z.seq(z.h), "dropout's backward: dY times the mask, a new tensor")
            tape.mark("backward", "embedding", "dropout")
            tape.drop(ledger.EMBEDDING_DROPOUT_MASK.name, incoming)
        if z.sp:
            tape.add("grad/embedding gathered", TEMPORARIES, z.full(z.h),
                     "the split into sequence shards: backward all-gathers the gradient, (s, b, h)")
            tape.mark("backward", "embedding", "all-gather of the gradient (split's backward)")
            tape.drop(grad)
            grad = "grad/embedding gathered"
        if z.positions:
            tape.add("grad/positions (s, h)", TEMPORARIES, z.act * z.s * z.h,
                     "the positions were added to every sequence of the batch: their gradient is summed over b")
            tape.add("grad/position table", TEMPORARIES, z.act * z.positions * z.h,
                     "the position table's bf16 gradient")
            tape.mark("backward", "embedding", "the position table's gradient")
            tape.drop(POSITION_IDS.name, "grad/positions (s, h)", "grad/position table")
        if not self.ids_are_tokens:
            tape.add("grad/embedding masked", TEMPORARIES, z.full(z.h),
                     "rows outside this rank's vocabulary get no gradient: dY masked, a new tensor")
            tape.mark("backward", "embedding", "the vocabulary mask")
            tape.drop(VOCAB_MASK.name, grad)
            grad = "grad/embedding masked"
        tape.add("grad/embedding (lookup)", TEMPORARIES, z.act * z.v_t * z.h,
                 "the embedding's bf16 gradient, dY added into the rows the ids picked")
        tape.mark("backward", "embedding", "the embedding's gradient")
        tape.drop(grad)
        if not self.ids_are_tokens:
            tape.drop(ledger.EMBEDDING_INPUT_IDS.name)
        if self.tied:
            tape.add("grad/embedding (sum)", TEMPORARIES, z.act * z.v_t * z.h,
                     "autograd sums the tied weight's two gradients into a new tensor")
            tape.mark("backward", "embedding", "the tied weight's two gradients summed")
        tape.drop("grad/embedding (output layer)", "grad/embedding (lookup)", "grad/embedding (sum)")
        tape.drop("loss/grad seed")  # backward is over


# Megatron's cross-entropy at its widest (core/tensor_parallel/cross_entropy.py): per-token vectors beside the
# logits. (name, bytes per token, why)
LOSS_WORKING_SET: tuple[tuple[str, int, str], ...] = (
    ("loss/target", 8, "the labels made sequence-first, (s, b) int64, as the logits are"),
    ("loss/logits_max", 4, "each token's largest logit, subtracted for a stable exp (fp32)"),
    ("loss/arange", 8, "row indices that pick each token's target logit (int64)"),
    ("loss/predicted", 4, "each token's target logit (fp32)"),
    ("loss/sum_exp", 4, "each token's sum of exp(logits) (fp32)"),
    ("loss/log_sum_exp", 4, "log of the sum, an operand of the subtraction that makes the loss (fp32)"),
    ("loss/per_token", 4, "each token's loss (fp32)"),
)


# -- one transformer layer -----------------------------------------------------------------------------------


def _layer_forward(tape: _Tape, i: int, saved: dict[str, int], z: _Sizes) -> None:
    """The layer's saved tensors (all but its input, live already) as one term, and its output."""
    own = sum(n for name, n in saved.items() if name != ledger.LN1.input.name)
    tape.add(f"layers.{i}/saved", ACTIVATIONS, own, "what the layer keeps for backward (the ledger), but its input")
    tape.add(f"layers.{i + 1}/ln1/input", ACTIVATIONS, z.seq(z.h), "the layer's output, the next block's input")
    tape.mark("forward", f"layers.{i}", "the layer's saved tensors")


def _layer_backward(tape: _Tape, i: int, saved: dict[str, int], z: _Sizes, config: ModelConfig) -> None:
    """The layer's backward, op by op, as autograd runs memcalc's own layer (memcalc.probe.layer)."""
    p = f"layers.{i}"
    tape.drop(f"{p}/saved")
    for name, n in saved.items():
        if name != ledger.LN1.input.name:
            tape.add(f"{p}/{name}", ACTIVATIONS, n, _WHY_SAVED)
    grad = f"grad/{p}/output"

    def release(*tensors: SavedTensor) -> None:
        tape.drop(*(f"{p}/{x.name}" for x in tensors))

    bias = config.add_bias_linear
    # MLP half: dropout, fc2 (row-parallel), GELU, fc1 (column-parallel), ln2, the residual sum.
    branch = _dropout_backward(tape, z, p, grad, ledger.MLP_DROPOUT_MASK, saved, release, "the MLP")
    dx = f"grad/{p}/fc2 input"
    _row_parallel_backward(tape, z, f"{p}.mlp.fc2", branch, grad, z.h * z.f_t, z.full(z.f_t), dx)
    release(ledger.FC2_IN)
    tape.add(f"grad/{p}/gelu input", TEMPORARIES, z.full(z.f_t), "GELU's backward: dY times GELU'(x)")
    tape.mark("backward", f"{p}.mlp", "GELU")
    release(ledger.GELU_IN)
    tape.drop(dx)
    dx = f"grad/{p}/fc1 input"
    _column_parallel_backward(
        tape, z, f"{p}.mlp.fc1", f"grad/{p}/gelu input", z.f_t * z.h, z.f_t if bias else 0, dx,
        f"{p}/{ledger.FC1_IN.name}",
    )
    after_norm = f"grad/{p}/ln2 input (norm)"
    _norm_backward(tape, z, f"{p}.ln2", dx, ledger.LN2, p, after_norm)
    mid = f"grad/{p}/ln2 input"
    _residual_sum(tape, z, f"{p}.ln2", grad, after_norm, mid)
    # Attention half: dropout, the projection (row-parallel), the core, QKV (column-parallel), ln1, the sum.
    branch = _dropout_backward(tape, z, p, mid, ledger.ATTN_OUT_DROPOUT_MASK, saved, release, "attention")
    dx = f"grad/{p}/proj input"
    _row_parallel_backward(tape, z, f"{p}.attention.proj", branch, mid, z.h * z.h_t, z.full(z.h_t), dx)
    release(ledger.PROJ_IN)
    dqkv = _core_attention_backward(tape, z, p, dx, saved, release)
    dx = f"grad/{p}/qkv input"
    qkv_bias = z.qkv_t if config.add_bias_linear or config.add_qkv_bias else 0
    _column_parallel_backward(
        tape, z, f"{p}.attention.qkv", dqkv, z.qkv_t * z.h, qkv_bias, dx, f"{p}/{ledger.QKV_IN.name}",
    )
    after_norm = f"grad/{p}/ln1 input (norm)"
    _norm_backward(tape, z, f"{p}.ln1", dx, ledger.LN1, p, after_norm)
    out = f"grad/{p}/ln1 input"
    _residual_sum(tape, z, f"{p}.ln1", mid, after_norm, out)
    if i > 0:
        tape.live[f"grad/layers.{i - 1}/output"] = replace(tape.live.pop(out), name=f"grad/layers.{i - 1}/output")
    else:
        tape.live["grad/layers.0/ln1/input"] = replace(tape.live.pop(out), name="grad/layers.0/ln1/input")


_WHY_SAVED = "kept for backward (the ledger); freed when the op that keeps it has run backward"
_Release = Callable[..., None]  # frees this layer's saved tensors, given their ledger entries


def _dropout_backward(
    tape: _Tape, z: _Sizes, p: str, grad: str, mask: SavedTensor, saved: dict[str, int], release: _Release,
    what: str,
) -> str:
    """dY times the mask, a new tensor beside dY (which the residual path still needs); none without dropout."""
    if mask.name not in saved:
        return grad
    branch = f"grad/{p}/{what} dropout"
    tape.add(branch, TEMPORARIES, z.seq(z.h), "dropout's backward: dY times the mask, a new tensor")
    tape.mark("backward", p, f"dropout after {what}")
    release(mask)
    return branch


def _row_parallel_backward(
    tape: _Tape, z: _Sizes, where: str, grad: str, keep: str, weight: int, dx_bytes: int, dx: str,
) -> None:
    """fc2 or the projection: under SP g* all-gathers dY first; then dW and dX beside dY.

    The bias's gradient (a sum over tokens) is made and added into the buffer before the GEMMs.
    """
    if z.sp:
        gathered = f"grad/{where} gathered"
        tape.add(gathered, TEMPORARIES, z.full(z.h), "g*'s backward all-gathers dY along s: (s, b, h)")
        tape.mark("backward", where, "all-gather of dY (g*'s backward)")
        if grad != keep:
            tape.drop(grad)
        grad = gathered
    tape.add(f"grad/{where} weight", TEMPORARIES, z.act * weight, "the weight's bf16 gradient, dW = dY^T X")
    tape.add(dx, TEMPORARIES, dx_bytes, "dX = dY W, the input's gradient")
    tape.mark("backward", where, "GEMMs: dW and dX")
    tape.drop(f"grad/{where} weight")
    if grad != keep:
        tape.drop(grad)


def _column_parallel_backward(
    tape: _Tape, z: _Sizes, where: str, grad: str, weight: int, bias: int, dx: str, saved_input: str,
) -> None:
    """QKV or fc1: dX, dW and the bias's gradient beside dY, then the saved input goes; under SP the input is
    all-gathered again and dX reduce-scattered; under TP without SP, f's backward all-reduces dX into a copy."""
    if z.sp:
        _gathered_linear_backward(tape, z, where, grad, f"grad/{where} weight", z.act * weight,
                                  "the weight's bf16 gradient, dW = dY^T X", dx, bias)
        tape.drop(f"grad/{where} weight", saved_input)
        return
    tape.add(dx, TEMPORARIES, z.full(z.h), "dX = dY W, the input's gradient")
    tape.add(f"grad/{where} weight", TEMPORARIES, z.act * weight, "the weight's bf16 gradient, dW = dY^T X")
    tape.add(f"grad/{where} bias", TEMPORARIES, z.act * bias, "the bias's gradient, dY summed over tokens")
    tape.mark("backward", where, "GEMMs: dX, dW and the bias's gradient")
    tape.drop(grad, f"grad/{where} weight", f"grad/{where} bias", saved_input)
    _enter_tp_backward(tape, z, where, dx)


def _gathered_linear_backward(
    tape: _Tape, z: _Sizes, where: str, grad: str, weight_name: str, weight_bytes: int, weight_why: str, dx: str,
    bias: int = 0,
) -> None:
    """A column-parallel GEMM under SP (memcalc.probe.linear._GatheredInputLinear): gather X again,
    dX as a partial (s, b, h) reduce-scattered to (s/t, b, h), then dW and the bias's gradient."""
    gathered = f"grad/{where} input gathered"
    partial = f"grad/{where} partial dX"
    tape.add(gathered, TEMPORARIES, z.full(z.h), "forward kept only the input's shard: backward all-gathers it")
    tape.add(partial, TEMPORARIES, z.full(z.h), "dX = dY W on the whole sequence, this rank's partial sum")
    tape.add(dx, TEMPORARIES, z.seq(z.h), "the reduce-scatter's output: this rank's shard of dX")
    tape.mark("backward", where, "re-gathered input, partial dX and its reduce-scatter")
    tape.drop(partial)
    tape.add(weight_name, TEMPORARIES, weight_bytes, weight_why)
    tape.add(f"grad/{where} bias", TEMPORARIES, z.act * bias, "the bias's gradient, dY summed over tokens")
    tape.mark("backward", where, "dW and the bias's gradient beside the re-gathered input")
    tape.drop(gathered, grad, f"grad/{where} bias")


def _enter_tp_backward(tape: _Tape, z: _Sizes, where: str, dx: str) -> None:
    """f's backward under TP: all-reduce dX into a new tensor (the input of an autograd op is never changed)."""
    if z.t == 1:
        return
    reduced = f"{dx} (all-reduced)"
    tape.add(reduced, TEMPORARIES, z.full(z.h), "f's backward all-reduces dX into a copy")
    tape.mark("backward", where, "all-reduce of dX (f's backward)")
    tape.drop(dx)
    tape.live[dx] = replace(tape.live.pop(reduced), name=dx)


def _norm_backward(
    tape: _Tape, z: _Sizes, where: str, grad: str, norm: ledger.NormTensors, p: str | None, dx: str,
) -> None:
    """LayerNorm's backward: dX and the weight's and bias's gradients beside dY; then its saved tensors go."""
    tape.add(dx, TEMPORARIES, z.seq(z.h), "the norm's dX")
    tape.add(f"grad/{where} weight and bias", TEMPORARIES, 2 * z.act * z.h, "the norm's weight and bias gradients")
    tape.mark("backward", where, "LayerNorm: dX, dweight, dbias")
    tape.drop(*(f"{p}/{x.name}" if p else x.name for x in norm))
    tape.drop(grad)


def _residual_sum(tape: _Tape, z: _Sizes, where: str, residual: str, branch: str, out: str) -> None:
    """The residual stream's two gradients summed into a new tensor, as soon as the branch's returns.

    Autograd does it inside the norm's backward window (MemTracker files it under the norm).
    """
    tape.add(out, TEMPORARIES, z.seq(z.h), "the residual stream's gradient: the two paths' gradients summed")
    tape.mark("backward", where, "the residual stream's gradients summed")
    tape.drop(residual, branch, f"grad/{where} weight and bias")


def _core_attention_backward(
    tape: _Tape, z: _Sizes, p: str, dcontext: str, saved: dict[str, int], release: _Release,
) -> str:
    """softmax(QK^T / sqrt(d)) V backward, op by op (memcalc.probe.attention.eager_core); returns dQKV's name."""
    where = f"{p}.attention"
    bass = z.act * z.b * z.a_t * z.s * z.s  # (b, a/t, s, s)
    basd = z.act * z.b * z.a_t * z.s * z.d  # (b, a/t, s, d)
    g = f"grad/{p}"
    tape.add(f"{g}/v", TEMPORARIES, basd, "weights x V's backward: dV = weights^T dY")
    tape.add(f"{g}/attention weights", TEMPORARIES, bass, "weights x V's backward: dWeights = dY V^T")
    tape.mark("backward", where, "weights x V: dV and dWeights")
    if ledger.ATTN_DROPOUT_OUT.name in saved:
        release(ledger.V, ledger.ATTN_DROPOUT_OUT)
    elif megatron.SOFTMAX_FP32.name in saved:
        release(ledger.V, ledger.SOFTMAX_OUT)  # the fp32 softmax's 16-bit cast: weights x V alone keeps it
    else:
        release(ledger.V)  # the softmax output: the softmax keeps it too
    tape.drop(dcontext)
    weights = f"{g}/attention weights"
    if ledger.ATTN_DROPOUT_MASK.name in saved:
        tape.add(f"{g}/softmax output", TEMPORARIES, bass, "attention dropout's backward: dY times the mask")
        tape.mark("backward", where, "attention dropout")
        release(ledger.ATTN_DROPOUT_MASK)
        tape.drop(weights)
        weights = f"{g}/softmax output"
    fused = megatron.CAUSAL_MASK.name not in saved
    if not fused:
        _unfused_softmax_backward(tape, z, where, g, weights, saved, release)
    else:
        tape.add(f"{g}/scores", TEMPORARIES, bass, "softmax's backward: S' * (dY - sum(dY * S'))")
        tape.mark("backward", where, "softmax")
        release(ledger.SOFTMAX_OUT)
        tape.drop(weights)
    tape.add(f"{g}/q", TEMPORARIES, basd, "QK^T's backward: dQ = dScores K, then scaled (a new tensor)")
    tape.add(f"{g}/k unscaled", TEMPORARIES, basd, "QK^T's backward: dK = dScores^T Q")
    tape.add(f"{g}/k", TEMPORARIES, basd, "dK scaled by 1/sqrt(d), a new tensor")
    tape.mark("backward", where, "QK^T: dQ and dK")
    release(ledger.Q, ledger.K)
    tape.drop(f"{g}/scores", f"{g}/k unscaled")
    dqkv = f"{g}/qkv output"
    tape.add(dqkv, TEMPORARIES, z.full(z.qkv_t),
             "q, k and v were split from one QKV output: their gradients concatenated")
    tape.mark("backward", where, "dQ, dK, dV concatenated into the QKV output's gradient")
    tape.drop(f"{g}/q", f"{g}/k", f"{g}/v")
    return dqkv


def _unfused_softmax_backward(
    tape: _Tape, z: _Sizes, where: str, g: str, grad: str, saved: dict[str, int], release: _Release,
) -> None:
    """Megatron's forward_torch_softmax backward (outside the fused kernel's sizes, or in fp32): the gradient
    cast up to fp32, softmax's backward in fp32, masked_fill's (a new tensor), the cast back down."""
    bass = z.b * z.a_t * z.s * z.s
    sixteen_bit = megatron.SOFTMAX_FP32.name in saved
    if sixteen_bit:
        tape.add(f"{g}/softmax fp32 output", TEMPORARIES, 4 * bass, "the cast's backward: dY up to fp32")
        tape.mark("backward", where, "the softmax output's cast")
        tape.drop(grad)
        grad = f"{g}/softmax fp32 output"
    width = 4 if sixteen_bit else z.act
    tape.add(f"{g}/masked scores", TEMPORARIES, width * bass, "softmax's backward: S' * (dY - sum(dY * S'))")
    tape.mark("backward", where, "softmax")
    release(megatron.SOFTMAX_FP32 if sixteen_bit else ledger.SOFTMAX_OUT)
    tape.drop(grad)
    tape.add(f"{g}/wide scores", TEMPORARIES, width * bass, "masked_fill's backward: the masked gradient zeroed")
    tape.mark("backward", where, "the causal mask")
    release(megatron.CAUSAL_MASK)
    tape.drop(f"{g}/masked scores")
    if sixteen_bit:
        tape.add(f"{g}/scores", TEMPORARIES, z.act * bass, "the scores' cast to fp32: its backward casts back")
        tape.mark("backward", where, "the scores' cast")
        tape.drop(f"{g}/wide scores")
    else:
        tape.live[f"{g}/scores"] = replace(tape.live.pop(f"{g}/wide scores"), name=f"{g}/scores")


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out
