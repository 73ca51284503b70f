"""One training step of transformers' own `LlamaForCausalLM` on one rank (`--impl hf`), described once as ops.

The decoder layer is memcalc.sizing.timeline.hf_layer's; this module adds the model's ends, as ops for the same walk
(memcalc.sizing.timeline.walk), and the sharding's hooks between segments:

    steady      bf16 weights and the rotary embedding's two fp32 inv_freq buffers, the fp32 gradient buffer, master
                weights, Adam's m and v (or FSDP2's and ZeRO's layouts)
    forward     the batch; the embedding lookup (under tp this rank's rows, the Partial sum all-reduced); position
                ids; the causal mask (eager attention: SDPA runs is_causal and needs none); RoPE's cos and sin, made
                once per forward and kept by every layer; the layers; the final RMSNorm at its widest; lm_head's bf16
                logits (under tp: this rank's v/t columns all-gathered into a (t*b, s, v/t) buffer and concatenated)
                and ForCausalLMLoss at its widest (fp32 logits, padded and shifted labels, the kept log-softmax)
    backward    the loss's fp32 gradients; lm_head (under tp its gradient's columns made contiguous first, its dX
                all-reduced); the final norm; the layers in reverse; the embedding's gradient (tied: summed with
                lm_head's, which waits in autograd's buffer; under tp the whole table, DTensor's Replicate gradient,
                of which the trainer copies this rank's rows into the fp32 buffer)
    optimizer   fused AdamW in place: nothing new

Sharded by FSDP2 (`dp_shard`, memcalc.sizing.timeline.fsdp) each layer is gathered before it runs and its weights'
bf16 gradients are kept to its reduce-scatter; under DeepSpeed ZeRO (`zero_stage` 1-3, memcalc.sizing.timeline.zero)
the same calls lay out DeepSpeed's buffers instead.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.evaluate import estimate
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import RMSNormTensors
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import stages
from memcalc.sizing.timeline import hf_layer as layer
from memcalc.sizing.timeline.ends import model_states
from memcalc.sizing.timeline.fsdp import ROOT, Fsdp
from memcalc.sizing.timeline.tape import GRADIENTS, PARAMETERS, Sizes, Tape, Timeline
from memcalc.sizing.timeline.walk import Made, Op, Step, Walk, kept
from memcalc.sizing.timeline.zero import Zero


def _final(x: ledger.SavedTensor) -> ledger.SavedTensor:
    return replace(x, name=f"final_norm/{x.name.partition('/')[2]}")


# model.norm keeps what a layer's LlamaRMSNorm keeps, under its own names
FINAL_NORM = RMSNormTensors(input_fp32=_final(rules.LN1_RMS.input_fp32), rstd=_final(rules.LN1_RMS.rstd),
                            normed=_final(rules.LN1_RMS.normed))


def ops_timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting) -> Timeline:
    """The moments of one training step of LlamaForCausalLM sized by `config`, on its one rank."""
    estimated = estimate(config, strategy, accounting)
    unpadded = replace(config, make_vocab_size_divisible_by=1)  # transformers does not pad the vocabulary
    z = Sizes.of(unpadded, strategy)
    sharding = Fsdp.of(config, z.t) if config.dp_shard is not None else Zero(config) if config.zero_stage else None
    (stage,) = stages(config.L, config.pp, config.vpp, config.microbatches)
    tape = Tape()
    if sharding is not None:
        sharding.states(tape)
    else:
        model_states(tape, unpadded, stage, z)
    for name in ("inv_freq", "original_inv_freq"):
        tape.add(f"states/rotary_emb.{name}", PARAMETERS, 4 * (z.d // 2),
                 "LlamaRotaryEmbedding's buffer, fp32 in a bf16 model (an explicit float arange)")
    tape.mark("steady", "", "model states between steps")
    saved = {x.tensor.name: x.bytes for x in estimated.tensors}
    hand_over = _hand_over(tape, sharding)
    ends = {x.name: saved[x.name] for x in layer.ROPE} | {
        FINAL_NORM.input_fp32.name: z.tokens(4 * z.h), FINAL_NORM.rstd.name: z.tokens(4),
        FINAL_NORM.normed.name: z.full(z.h), ledger.OUTPUT_INPUT.name: z.full(z.h)}
    front, back = Walk(tape, "", "", ends, hand_over), Walk(tape, "", "", ends, hand_over)
    tp = z.t > 1
    inputs, outputs = _embedding(z, config, tp, sharding is not None), _output(z, config, tp)
    tensors = tuple(x.tensor for x in estimated.tensors)
    layers = [(Walk(tape, f"layers.{i}", f"model.layers.{i}", saved, hand_over),
               _layer(i, z, config, tensors, saved, tp)) for i in range(config.L)]
    front.forward(inputs[:1])
    if sharding is not None:  # the root's pre-forward: embedding, final norm and lm_head gathered
        sharding.copy_out(tape, ROOT, "forward", "")
    front.forward(inputs[1:])
    for i, (walk, ops) in enumerate(layers):
        if sharding is not None:
            sharding.copy_out(tape, f"layers.{i}", "forward", f"model.layers.{i}")
        walk.forward(ops)
        if sharding is not None:
            sharding.post_forward(tape, f"layers.{i}")
    back.forward(outputs)
    if sharding is not None:  # the root's post-forward, then its pre-backward: the last layer's all-gather
        sharding.forward_done(tape)
        sharding.pre_backward(tape, ROOT, "", f"layers.{config.L - 1}")
    back.backward(outputs)
    for i, (walk, ops) in reversed(list(enumerate(layers))):
        if sharding is not None:
            sharding.pre_backward(tape, f"layers.{i}", f"model.layers.{i}", f"layers.{i - 1}" if i else None)
        walk.backward(ops)
        if sharding is not None:  # transformers calls self_attn with keyword inputs: active to the end of backward
            sharding.post_backward(tape, f"layers.{i}", f"model.layers.{i}.self_attn")
    front.backward(inputs[1:])
    if sharding is not None:  # the final callback, inside backward(): the root's post-backward (no module active),
        sharding.post_backward(tape, ROOT, "")  # then the last reduce-scatter waited on
    tape.drop(f"fsdp/{ROOT} reduce-scatter", "loss/grad seed")
    if isinstance(sharding, Zero):  # DeepSpeed's step makes the fp32 gradient partition first
        sharding.optimizer_step(tape)
    else:
        tape.mark("optimizer", "", "fused AdamW on the fp32 master weights, in place")
    return Timeline(estimated.strategy, tuple(tape.moments), stage.name)


def _hand_over(tape: Tape, sharding: Fsdp | Zero | None):
    """A weight's gradient handed to autograd: added into the fp32 buffer and dropped, or under FSDP2 kept as the
    unsharded parameter's .grad until its block's reduce-scatter (ZeRO: into its reduce bucket)."""
    def hand_over(where: str, name: str, nbytes: int) -> None:
        tape.drop(name)
        if sharding is not None:
            sharding.keep_grad(tape, sharding.block_of(where), where, nbytes)
    return hand_over


def _layer(i: int, z: Sizes, config: ModelConfig, tensors, saved: dict[str, int], tp: bool) -> tuple[Op, ...]:
    """Decoder layer i as ops, in forward order (memcalc.sizing.timeline.hf_layer)."""
    p = f"layers.{i}"
    out = f"grad/layers.{i - 1}/output" if i else "grad/embedding output"
    return (
        *layer.layer_forward(i, z, layer.kept_tensors(p, tensors)),
        *layer.rms_norm("input_layernorm", p, rules.LN1_RMS, z, f"grad/{p}/ln1 output", out, f"grad/{p}/mid"),
        *layer.attention(p, z, config.attention == "eager", saved, config.groups != config.a, tp, i == 0),
        *layer.rms_norm("post_attention_layernorm", p, rules.LN2_RMS, z, f"grad/{p}/ln2 output", f"grad/{p}/mid",
                        f"grad/{p}/output"),
        *layer.mlp(p, z, tp),
    )


# -- the model's two ends -----------------------------------------------------------------------------------------


def _embedding(z: Sizes, config: ModelConfig, tp: bool, sharded: bool) -> tuple[Op, ...]:
    """The batch; the embedding (`embedding_rowwise` under tp: this rank's rows looked up, the Partial sum
    all-reduced) and what LlamaModel makes once for all layers; in backward the embedding's gradient."""
    batch = Op("", forward=(Step("the batch", (
        Made(ledger.EMBEDDING_INPUT_IDS.name, z.tokens(8), "the micro-batch's token ids (int64), live for the whole"
             " step; the embedding keeps them"),
        Made("batch/labels", z.tokens(8), "the micro-batch's labels (int64), live for the whole step")),
        moment=False),), backward=())
    lookup = (Made("embedding/partial", z.full(z.h), "this rank's rows looked up, the others' zeroed (DTensor's"
                   " MaskPartial), summed by all_reduce"),) if tp else ()
    eager, act, s = config.attention == "eager", z.act, z.s
    model = (
        Made("model/position_ids", s * 8, "arange(s) as (1, s) int64, live until LlamaModel returns"),
        *((Made("model/causal_mask", act * z.b * s * s, "create_causal_mask's additive (b, 1, s, s) mask, live until"
                " LlamaModel returns"),) if eager else ()),
        *((Made("model/sliding_mask", act * z.b * s * s if eager else s * s, "Qwen2MoeModel makes"
                " create_sliding_window_causal_mask's mask beside the causal one, though no layer slides"),)
          if config.moe_shared_expert_intermediate_size else ()),
        *(kept("", x, "made once per forward by LlamaRotaryEmbedding; every layer's RoPE keeps it")
          for x in layer.ROPE),
    )
    return (batch, Op("model.embed_tokens", forward=(
        Step("the embedding lookup" + (", all-reduced" if tp else ""), (*lookup, Made(
            "layers.0/input", z.full(z.h), "the embedding lookup, the first layer's input: LlamaModel's inputs_embeds,"
            " live until it returns")), frees=("embedding/partial",)),
        Step("what LlamaModel makes once for all layers", model, moment=False),
    ), backward=_embedding_backward(z, config, tp, sharded)))


def _embedding_backward(z: Sizes, config: ModelConfig, tp: bool, sharded: bool) -> tuple[Step, ...]:
    """The embedding's gradient, dY added into the rows the ids picked; tied, summed with lm_head's. Under tp it is the
    whole (v, h) table (DTensor gives the Shard(0) weight a Replicate gradient): without FSDP2 the weight's .grad,
    of which this rank's rows are copied out (under FSDP2 its post-backward lays it out, memcalc.sizing.timeline.fsdp)."""
    table, tied = z.act * config.vocab_size * z.h, config.tie_embeddings
    rows = tp and not sharded
    out = (
        Step("the embedding's gradient", (Made("grad/embedding (lookup)", table, "embedding's backward: a (v, h) bf16"
                                               " gradient"),),
             frees=("grad/embedding output", *(("grad/embedding (lookup)",) if rows else ()))),
    )
    if rows:
        out += (Step("this rank's rows of the embedding's gradient", (
            Made("grad/embedding (.grad)", table, "the embedding's gradient as the weight's .grad", category=GRADIENTS),
            Made("grad/embedding (rows)", z.act * z.v_t * z.h, "this rank's rows of it, copied out as the weight's"
                 " Shard(0) (DTensor's redistribute) to be added into the fp32 buffer")),
            frees=("grad/embedding (.grad)", "grad/embedding (rows)")),)
    if tied:
        out += (Step("the tied weight's two gradients summed", (Made("grad/embedding (sum)", table, "autograd sums"
                                                                     " the tied weight's two gradients"),)),)
    handed = () if rows else ("grad/embedding (sum)" if tied else "grad/embedding (lookup)",)
    return out + (Step("", hands_over=handed), Step("", frees=("grad/embedding (lookup)", "grad/embedding (lm_head)")))


def _output(z: Sizes, config: ModelConfig, tp: bool) -> tuple[Op, ...]:
    """model.norm, lm_head and ForCausalLMLoss."""
    logits = z.act * z.b * z.s * config.vocab_size  # under tp gathered whole on every rank ("colwise_gather_output")
    local = z.act * z.b * z.s * z.v_t
    last = f"layers.{config.L}/input"
    norm = layer.rms_norm("model.norm", "", FINAL_NORM, z, "grad/lm_head input", f"grad/layers.{config.L - 1}/output",
                          forward=(Step("RMSNorm at its widest: fp32 input and output, bf16 output", (
                              kept("", FINAL_NORM.input_fp32),
                              Made("final_norm/variance", z.tokens(4), "pow(2).mean(-1): a local"),
                              kept("", FINAL_NORM.rstd),
                              Made("final_norm/normalised fp32", z.tokens(4 * z.h), "x * rsqrt(.): a local"),
                              kept("", FINAL_NORM.normed),
                              kept("", ledger.OUTPUT_INPUT, "weight * (.): lm_head's input, which it keeps")),
                              frees=("final_norm/variance", "final_norm/normalised fp32", last, "layers.0/input",
                                     "model/position_ids", "model/causal_mask", "model/sliding_mask")),))
    gather = (Made("lm_head/local logits", local, "this rank's columns of the logits (Shard(-1))"),
              Made("lm_head/gathered", z.t * local, "all_gather_into_tensor's (t*b, s, v/t) buffer")) if tp else ()
    head = layer.linear("lm_head", "", z.act * z.v_t * z.h, "grad/lm_head local logits" if tp else "grad/logits",
                        "grad/lm_head input", z.full(z.h), (ledger.OUTPUT_INPUT,), tp,
                        "grad/embedding (lm_head)" if config.tie_embeddings else "", config.tie_embeddings)
    columns = (Step("this rank's columns of the logits' gradient", (Made(
        "grad/lm_head local logits", local, "made contiguous"),), frees=("grad/logits",)),) if tp else ()
    lm_head = replace(head, forward=(Step("the gathered logits: this rank's columns, the gather's buffer, all", (
        *gather, Made("lm_head/logits", logits, "lm_head's bf16 logits; the output object holds them until it goes")),
        frees=("lm_head/local logits", "lm_head/gathered"), moment=tp),), backward=(*columns, *head.backward))
    shifted = (Made("loss/shift_labels", z.tokens(8), "labels[..., 1:].contiguous(): nll_loss keeps it as its target"),)
    loss = Op("", forward=(
        Step("the loss: bf16 and fp32 logits and the fp32 log-softmax", (
            Made("loss/logits fp32", 2 * logits, "logits.float(): the loss upcasts them"),
            Made("loss/padded labels", 8 * z.b * (z.s + 1), "labels padded by one ignore_index column, (b, s + 1)"),
            *(shifted if z.b > 1 else ()),  # with b = 1 the slice is contiguous already: a view
            Made("loss/log_softmax", 2 * logits, "the fp32 log_softmax: its backward and nll_loss's keep it"),
            Made("loss/value", 4, "the mean loss (a 0-d fp32 tensor) lives to the step's end"),
            Made("loss/total_weight", 4, "nll_loss's count of targets (0-d fp32), kept for its backward")),
             frees=("lm_head/logits", "loss/logits fp32", *(("loss/padded labels",) if z.b > 1 else ()))),
        Step("loss.backward() seeds autograd", (Made("loss/grad seed", 4, "a 0-d ones tensor"),), moment=False),
    ), backward=(
        Step("nll_loss's backward", (Made("grad/log_softmax", 2 * logits, "-1/N at each target, zero elsewhere"),),
             frees=("loss/shift_labels", "loss/padded labels", "loss/total_weight"), moment=False),
        Step("log_softmax's backward: three fp32 (b*s, v) tensors", (Made("grad/logits fp32", 2 * logits, "fp32"),),
             frees=("grad/log_softmax", "loss/log_softmax")),
        Step("the upcast's backward", (Made("grad/logits", logits, "the gradient cast back to bf16"),),
             frees=("grad/logits fp32",), moment=False),
    ))
    return (*norm, lm_head, loss)
