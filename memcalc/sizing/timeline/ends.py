"""The model's two ends in the step (embedding; final norm, output layer and loss), and the model states."""

from __future__ import annotations

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.evaluate import rank_shape
from memcalc.model.knobs import Accounting, element_bytes
from memcalc.model.ledger import Dim, Kind, Region, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import Stage
from memcalc.sizing.states import ROUTER_BUFFERS_WHY, group_params, router_buffer_bytes, state_bytes
from memcalc.sizing.timeline.megatron import INPUT, INPUT_GRAD, OUTPUT_GRAD
from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Sizes, Tape, prod,
)
from memcalc.sizing.totals import end_sizes, end_tensors

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


def model_states(tape: Tape, config: ModelConfig, stage: Stage, z: Sizes) -> None:
    """Weights, the gradient buffer and the optimizer's states of `stage`, as `memcalc.sizing.states` counts them."""
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
    if config.moe_router_enable_expert_bias:  # buffers, which MemTracker files with the parameters
        tape.add("states/router buffers", PARAMETERS, router_buffer_bytes(config, stage), ROUTER_BUFFERS_WHY)


class Ends:
    """Embedding, final norm, output layer and loss: their saved tensors (ledger) and their gradients."""

    def __init__(self, config: ModelConfig, strategy: Strategy, accounting: Accounting, z: Sizes, stage: Stage) -> None:
        self.z, self.stage = z, stage
        # With pp > 1 the last stage's output layer holds its own copy of a tied embedding: untied in backward.
        self.tied = config.tie_embeddings and stage.has_embedding and stage.has_output
        sizes = end_sizes(config, strategy)
        tp = z.t > 1
        extra = (
            *((VOCAB_MASK,) if tp else ()),
            *((POSITION_IDS,) if z.positions else ()),
            TARGET_MASK, MASKED_TARGET,
        )
        kept = (*end_tensors(config, accounting, "first"), *end_tensors(config, accounting, "last"), *extra)
        self.saved = {
            x.name: element_bytes(x.kind, config, accounting) * prod(rank_shape(x, strategy, sizes, config.t))
            for x in kept
        }
        self.why = {x.name: x.why for x in kept}
        # At t = 1 the embedding keeps the batch's token ids themselves; under TP it keeps a shifted copy.
        self.ids_are_tokens = not tp

    def _saved(self, tape: Tape, *tensors: SavedTensor) -> None:
        for x in tensors:
            if x.name in self.saved:
                tape.add(x.name, ACTIVATIONS, self.saved[x.name], self.why[x.name])

    def _labels(self, tape: Tape) -> None:
        """Only the stage that computes the loss loads the labels."""
        if self.stage.has_output:
            tape.add("batch/labels", ACTIVATIONS, self.z.tokens(8),
                     "the micro-batch's labels (int64), live for the whole step")

    def embedding_bytes(self) -> int:
        """What one micro-batch's embedding keeps until its backward (none on a stage without the embedding)."""
        if not self.stage.has_embedding:
            return 0
        kept = (ledger.EMBEDDING_INPUT_IDS, VOCAB_MASK, POSITION_IDS, ledger.EMBEDDING_DROPOUT_MASK)
        return sum(self.saved.get(x.name, 0) for x in kept)

    def forward_in(self, tape: Tape) -> None:
        """The embedding, or the previous stage's output received as this stage's input."""
        z = self.z
        if not self.stage.has_embedding:
            self._labels(tape)
            tape.add(INPUT, ACTIVATIONS, z.seq(z.h),
                     "the previous stage's output, received (p2p) as this stage's input; the first layer keeps it")
            tape.mark("forward", "", "the input received from the previous stage")
            return
        tokens = ledger.EMBEDDING_INPUT_IDS.name if self.ids_are_tokens else "batch/tokens"
        tape.add(tokens, ACTIVATIONS, z.tokens(8), "the micro-batch's token ids (int64), live for the whole step")
        self._labels(tape)
        if not self.ids_are_tokens:
            self._saved(tape, ledger.EMBEDDING_INPUT_IDS, VOCAB_MASK)
        self._saved(tape, POSITION_IDS, ledger.EMBEDDING_DROPOUT_MASK)
        tape.add(INPUT, ACTIVATIONS, z.seq(z.h), ledger.WHY_NORM_INPUT)
        tape.mark("forward", "embedding", "word and position embeddings, dropout")

    def forward_out(self, tape: Tape) -> None:
        """The final norm, output layer and loss, or the output sent to the next stage."""
        if not self.stage.has_output:
            # Megatron frees the sent output's data at once (deallocate_pipeline_outputs): the next stage keeps it.
            tape.drop(INPUT)
            return
        z = self.z
        tape.add(ledger.FINAL_NORM.input.name, ACTIVATIONS, tape.live.pop(INPUT).bytes, ledger.WHY_NORM_INPUT)
        self._saved(tape, ledger.FINAL_NORM.mean, ledger.FINAL_NORM.rstd, ledger.OUTPUT_INPUT)
        tape.mark("forward", "final_norm", "the norm before the output layer")
        tape.add("output/logits", ACTIVATIONS, z.act * z.s * z.b * z.v_t,
                 "the output layer's logits (s, b, v/t) in the training dtype")
        # Megatron's _VocabParallelCrossEntropy.forward, at its widest: right after the per-token loss.
        self._saved(tape, ledger.LOSS_LOGITS, TARGET_MASK, MASKED_TARGET)
        for name, width, why in LOSS_WORKING_SET:
            if name != "loss/target" or min(z.b, z.s) > 1:  # b = 1 or s = 1: the transposed labels are contiguous
                tape.add(name, ACTIVATIONS, z.tokens(width), why)
        tape.mark("forward", "loss", "fp32 logits and the per-token vectors of the cross-entropy")
        tape.drop("output/logits", *(name for name, _, _ in LOSS_WORKING_SET))
        tape.add("loss/value", ACTIVATIONS, 4, "the mean loss (a 0-d fp32 tensor) lives to the step's end")

    def backward_out(self, tape: Tape) -> None:
        """The loss and output layer's backward, or the output's gradient received from the next stage."""
        z = self.z
        if not self.stage.has_output:
            tape.add(OUTPUT_GRAD, TEMPORARIES, z.seq(z.h),
                     "the gradient of this stage's output, received (p2p) from the next stage")
            tape.mark("backward", "", "the output's gradient received from the next stage")
            return
        tape.add("loss/grad seed", ACTIVATIONS, 4,
                 "loss.backward() starts from a 0-d ones tensor, made before autograd runs")
        tape.add("grad/logits", TEMPORARIES, z.act * z.s * z.b * z.v_t,
                 "the loss's fp32 gradient is the saved softmax, changed in place; autograd casts it to bf16")
        tape.mark("backward", "loss", "the logits' gradient cast to the training dtype")
        tape.drop(ledger.LOSS_LOGITS.name, TARGET_MASK.name, MASKED_TARGET.name)
        weight, dx = z.act * z.v_t * z.h, "grad/output input"
        embedding_grad = "grad/embedding (output layer)" if self.tied else "grad/output weight"
        why = ("the tied embedding's gradient from the output layer waits in autograd's input buffer until the"
               " embedding's own gradient is added to it" if self.tied else "the output layer's bf16 weight gradient")
        handed = () if self.tied else (embedding_grad,)  # autograd hands it to the weight, the hook adds it in
        if z.sp:  # memcalc.probe.linear._GatheredInputLinear: X gathered again, dX reduce-scattered, then dW
            gathered, partial = "grad/output_layer input gathered", "grad/output_layer partial dX"
            tape.add(gathered, TEMPORARIES, z.full(z.h), "forward kept only the input's shard: backward all-gathers it")
            tape.add(partial, TEMPORARIES, z.full(z.h), "dX = dY W on the whole sequence, this rank's partial sum")
            tape.add(dx, TEMPORARIES, z.seq(z.h), "the reduce-scatter's output: this rank's shard of dX")
            tape.mark("backward", "output_layer", "re-gathered input, partial dX and its reduce-scatter")
            tape.drop(partial)
            tape.add(embedding_grad, TEMPORARIES, weight, why)
            tape.mark("backward", "output_layer", "dW and the bias's gradient beside the re-gathered input")
            tape.drop(gathered, "grad/logits", ledger.OUTPUT_INPUT.name, *handed)
        else:
            tape.add(embedding_grad, TEMPORARIES, weight, why)
            tape.add(dx, TEMPORARIES, z.full(z.h), "dX of the output layer, (s, b, h)")
            tape.mark("backward", "output_layer", "GEMMs: dW and dX")
            tape.drop("grad/logits", ledger.OUTPUT_INPUT.name, *handed)
        if z.t > 1 and not z.sp:  # f's backward: dX all-reduced into a copy (an autograd op's input is never changed)
            tape.add(f"{dx} (all-reduced)", TEMPORARIES, z.full(z.h), "f's backward all-reduces dX into a copy")
            tape.mark("backward", "output_layer", "all-reduce of dX (f's backward)")
            tape.drop(dx)
            tape.rename(f"{dx} (all-reduced)", dx)
        # the final norm's backward, one kernel: dX and its weight's (and LayerNorm's bias's) gradients beside dY
        tape.add(OUTPUT_GRAD, TEMPORARIES, z.seq(z.h), "the norm's dX")
        tape.add("grad/final_norm weights", TEMPORARIES, z.norm_vectors * z.act * z.h,
                 "the norm's weight (and bias) gradients")
        tape.mark("backward", "final_norm", "the norm: dX, dweight" + (", dbias" if z.norm_vectors == 2 else ""))
        tape.drop(*(x.name for x in ledger.FINAL_NORM), dx, "grad/final_norm weights")

    def backward_in(self, tape: Tape) -> None:
        """The embedding's backward, or the input's gradient sent to the previous stage."""
        if not self.stage.has_embedding:
            tape.drop(INPUT_GRAD)  # sent: the previous stage receives it
            return
        z = self.z
        grad = INPUT_GRAD
        if ledger.EMBEDDING_DROPOUT_MASK.name in self.saved:
            grad = "grad/embedding dropout"
            tape.add(grad, TEMPORARIES, z.seq(z.h), "dropout's backward: dY times the mask, a new tensor")
            tape.mark("backward", "embedding", "dropout")
            tape.drop(ledger.EMBEDDING_DROPOUT_MASK.name, INPUT_GRAD)
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
        tape.drop(grad, *(() if self.ids_are_tokens else (ledger.EMBEDDING_INPUT_IDS.name,)))
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

