"""The model's two ends in the step (embedding; final norm, output layer and loss), and the model states."""

from __future__ import annotations

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Dim, Kind, Region, SavedTensor
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import Stage
from memcalc.sizing.states import ROUTER_BUFFERS_WHY, group_params, router_buffer_bytes, state_bytes
from memcalc.sizing.timeline.megatron import INPUT, INPUT_GRAD, OUTPUT_GRAD, column_parallel
from memcalc.sizing.timeline.megatron_pieces import norm_kernel
from memcalc.sizing.timeline.tape import ACTIVATIONS, GRAD_SEED, GRADIENTS, OPTIMIZER, PARAMETERS, Sizes, Tape
from memcalc.sizing.timeline.torch_ops import tied_sum
from memcalc.sizing.timeline.walk import Made, Op, Step, kept
from memcalc.sizing.totals import end_bytes, end_tensors, per_parameter_shards

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
    """Weights, the gradient buffer and the optimizer's states of `stage`, as `memcalc.sizing.states` counts them
    (the distributed optimizer's padded buffers as --totals counts them: per_parameter_shards)."""
    held = sum(group_params(config, stage, z.t).values())
    states = state_bytes(config, held, per_parameter=per_parameter_shards(config, z.t, held, stage))
    for name, category, why in (
        ("states/weights", PARAMETERS, f"{held:,} parameters in the training dtype"),
        ("states/grads", GRADIENTS, "Megatron's contiguous fp32 main_grad buffer, allocated before the first step"),
        ("states/master_weights", OPTIMIZER, "the fp32 copy the optimizer updates"),
        ("states/adam_m", OPTIMIZER, "Adam's first moment, fp32"),
        ("states/adam_v", OPTIMIZER, "Adam's second moment, fp32"),
    ):
        tape.add(name, category, states.get(name, 0), why)
    tape.add("optimizer/step", OPTIMIZER, 4, "torch's AdamW counts steps in a 0-d fp32 tensor")
    # buffers (and fp32 weights), which MemTracker files as parameters; none without experts (the tape adds no 0 B)
    tape.add("states/router buffers", PARAMETERS, router_buffer_bytes(config, stage), ROUTER_BUFFERS_WHY)


def optimizer_step(tape: Tape, config: ModelConfig) -> None:
    """The optimizer's moment: fused AdamW in place, on the master weights, or in fp32 on the weights themselves
    (Megatron's FP32Optimizer: `memcalc.sizing.states` counts no master copy)."""
    on = "the fp32 weights themselves (no master copy)" if config.dtype == "fp32" else "the fp32 master weights"
    tape.mark("optimizer", "", f"fused AdamW on {on}, in place")


def end_saved(config: ModelConfig, strategy: Strategy, accounting: Accounting, z: Sizes) -> dict[str, int]:
    """The bytes of each tensor the model's ends keep for backward on this rank, by name."""
    extra = (*((VOCAB_MASK,) if z.t > 1 else ()), *((POSITION_IDS,) if z.positions else ()),
             TARGET_MASK, MASKED_TARGET)
    kept = (*end_tensors(config, accounting, "first"), *end_tensors(config, accounting, "last"), *extra)
    return {x.name: end_bytes(x, config, strategy, accounting) for x in kept}


class Ends:
    """Embedding, final norm, output layer and loss as ops for the generic walk (memcalc.sizing.timeline.walk):
    their saved tensors (ledger) and their gradients; on a middle stage, the input received and the output sent."""

    def __init__(self, config: ModelConfig, saved: dict[str, int], z: Sizes, stage: Stage) -> None:
        """`saved`: what the ends keep, by name (`end_saved`)."""
        self.z, self.stage, self.saved = z, stage, saved
        # With pp > 1 the last stage's output layer holds its own copy of a tied embedding: untied in backward.
        self.tied = config.tie_embeddings and stage.has_embedding and stage.has_output
        labels = (Made("batch/labels", z.tokens(8), "the micro-batch's labels (int64), live for the whole step"),
                  ) if stage.has_output else ()  # only the stage that computes the loss loads them
        received = Made(INPUT, z.seq(z.h), "the previous stage's output, received (p2p) as this stage's input; the"
                        " first layer keeps it")
        self.inputs = self._embedding(labels) if stage.has_embedding else (Op("", forward=(Step(
            "the input received from the previous stage", (*labels, received)),),
            backward=(Step("", frees=(INPUT_GRAD,)),)),)  # sent: the previous stage receives it
        # Megatron frees the sent output's data at once (deallocate_pipeline_outputs): the next stage keeps it.
        self.outputs = self._head() if stage.has_output else (Op("", forward=(Step("", frees=(INPUT,)),), backward=(
            Step("the output's gradient received from the next stage", (Made(
                OUTPUT_GRAD, z.seq(z.h), "the gradient of this stage's output, received (p2p) from the next stage"),)),
        )),)

    def embedding_bytes(self) -> int:
        """What one micro-batch's embedding keeps until its backward (none on a stage without the embedding)."""
        if not self.stage.has_embedding:
            return 0
        kept = (ledger.EMBEDDING_INPUT_IDS, VOCAB_MASK, POSITION_IDS, ledger.EMBEDDING_DROPOUT_MASK)
        return sum(self.saved.get(x.name, 0) for x in kept)

    def _embedding(self, labels: tuple[Made, ...]) -> tuple[Op, ...]:
        """Word and position embeddings and dropout; in backward dropout's, the split's all-gather (SP), the position
        table's gradient, the vocabulary mask (TP) and the table's gradient, summed with the output layer's if tied."""
        z, tp = self.z, self.z.t > 1
        # At t = 1 the embedding keeps the batch's token ids themselves; under TP it keeps a shifted copy.
        ids = (ledger.EMBEDDING_INPUT_IDS, VOCAB_MASK) if tp else ()
        forward = Step("word and position embeddings, dropout", (
            Made("batch/tokens" if tp else ledger.EMBEDDING_INPUT_IDS.name, z.tokens(8),
                 "the micro-batch's token ids (int64), live for the whole step"), *labels,
            *(kept("", x, x.why) for x in (*ids, POSITION_IDS, ledger.EMBEDDING_DROPOUT_MASK)),
            Made(INPUT, z.seq(z.h), ledger.WHY_NORM_INPUT)))
        backward, grad = [], INPUT_GRAD
        if ledger.EMBEDDING_DROPOUT_MASK.name in self.saved:
            backward.append(Step("dropout", (Made("grad/embedding dropout", z.seq(z.h), "dropout's backward: dY times"
                                                  " the mask, a new tensor"),),
                                 frees=(ledger.EMBEDDING_DROPOUT_MASK.name, grad)))
            grad = "grad/embedding dropout"
        if z.sp:
            backward.append(Step("all-gather of the gradient (split's backward)", (Made(
                "grad/embedding gathered", z.full(z.h), "the split into sequence shards: backward all-gathers the"
                " gradient, (s, b, h)"),), frees=(grad,)))
            grad = "grad/embedding gathered"
        if z.positions:
            backward.append(Step("the position table's gradient", (
                Made("grad/positions (s, h)", z.act * z.s * z.h, "the positions were added to every sequence of the"
                     " batch: their gradient is summed over b"),
                Made("grad/position table", z.weight(z.ends.position), "the position table's bf16 gradient")),
                frees=(POSITION_IDS.name, "grad/positions (s, h)", "grad/position table")))
        if tp:
            backward.append(Step("the vocabulary mask", (Made("grad/embedding masked", z.full(z.h), "rows outside"
                                                              " this rank's vocabulary get no gradient: dY masked, a"
                                                              " new tensor"),), frees=(VOCAB_MASK.name, grad)))
            grad = "grad/embedding masked"
        table = z.weight(z.ends.word)
        backward.append(Step("the embedding's gradient", (Made("grad/embedding (lookup)", table, "the embedding's bf16"
                                                               " gradient, dY added into the rows the ids picked"),),
                             frees=(grad, *((ledger.EMBEDDING_INPUT_IDS.name,) if tp else ()))))
        if self.tied:
            backward.append(tied_sum(table))
        backward.append(Step("", frees=("grad/embedding (output layer)", "grad/embedding (lookup)",
                                        "grad/embedding (sum)", GRAD_SEED)))  # backward is over
        return (Op("embedding", forward=(forward,), backward=tuple(backward)),)

    def _head(self) -> tuple[Op, ...]:
        """The final norm, the output layer (column-parallel, as megatron's layer's) and the loss."""
        z, norm = self.z, ledger.FINAL_NORM
        logits = z.act * z.s * z.b * z.v_t
        output_layer: list[Op] = []
        tied = Made("grad/embedding (output layer)", z.weight(z.ends.head), "the tied embedding's gradient from the"
                    " output layer waits in autograd's input buffer until the embedding's own gradient is added to it")
        # logits.float() copies 16-bit logits; fp32 ones are the loss's own, whose saved softmax (changed in place in
        # backward) is the logits' gradient: autograd has no cast to make
        cast = z.act != 4
        grad = "grad/logits" if cast else ledger.LOSS_LOGITS.name
        dx = column_parallel(output_layer, z, "output_layer", ledger.OUTPUT_INPUT, grad, "grad/output input",
                             tied if self.tied else None)
        dw = "grad/final_norm weights"
        final_norm = Op("final_norm", forward=(
            Step("", (Made(norm.input.name, z.seq(z.h), ledger.WHY_NORM_INPUT),), frees=(INPUT,), moment=False),
            Step("the norm before the output layer",
                 tuple(kept("", x, x.why) for x in (norm.mean, norm.rstd, ledger.OUTPUT_INPUT)))),
            backward=(norm_kernel(z, "final_norm", dx, OUTPUT_GRAD, z.seq(z.h), dw, hands_over=(dw,)),),
            saves=tuple(norm))
        # Megatron's _VocabParallelCrossEntropy.forward, at its widest: right after the per-token loss.
        working = tuple(Made(name, z.tokens(width), why) for name, width, why in LOSS_WORKING_SET
                        if name != "loss/target" or min(z.b, z.s) > 1)  # b = 1 or s = 1: contiguous already
        loss_kept = (ledger.LOSS_LOGITS, TARGET_MASK, MASKED_TARGET)
        logits_made = (Made("output/logits", logits, "the output layer's logits (s, b, v/t) in the training dtype"),
                       ) if cast else ()
        seed = Made(GRAD_SEED, 4, "loss.backward() starts from a 0-d ones tensor, made before autograd runs",
                    category=ACTIVATIONS)
        cast_back = (Made("grad/logits", logits, "the loss's fp32 gradient is the saved softmax, changed in place;"
                          " autograd casts it to the training dtype"),) if cast else ()
        loss = Op("loss", forward=(
            Step("fp32 logits and the per-token vectors of the cross-entropy", (
                *logits_made, *(kept("", x, x.why) for x in loss_kept), *working),
                frees=(*(x.name for x in logits_made), *(x.name for x in working))),
            Step("", (Made("loss/value", 4, "the mean loss (a 0-d fp32 tensor) lives to the step's end"),),
                 moment=False)),
            backward=(Step("the logits' gradient cast to the training dtype" if cast else "the loss's backward",
                           (seed, *cast_back)),),
            saves=loss_kept if cast else loss_kept[1:])  # fp32: the softmax lives on as the logits' gradient
        return (final_norm, *output_layer, loss)


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

