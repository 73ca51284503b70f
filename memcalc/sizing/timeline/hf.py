"""One training step of transformers' own `LlamaForCausalLM` (and its kin; `GPT2LMHeadModel`'s blocks and ends in
memcalc.sizing.timeline.hf_gpt2) on one rank (`--impl hf`), described once as ops.

The model's ends and the sharding's hooks around hf_layer's and hf_moe's layers: docs/timeline.md, "transformers'
models".
"""

from __future__ import annotations

import functools
from dataclasses import fields, replace
from typing import Any

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.evaluate import estimate, rotary_sizes
from memcalc.model.families import layer_family
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import Dim, RMSNormTensors
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import stages
from memcalc.sizing.timeline import hf_cohere as cohere
from memcalc.sizing.timeline import hf_gpt2 as gpt2
from memcalc.sizing.timeline import hf_layer as layer
from memcalc.sizing.timeline import hf_gpt_oss as oss
from memcalc.sizing.timeline import hf_mla as mla
from memcalc.sizing.timeline import hf_moe as moe
from memcalc.sizing.timeline import hf_ln as ln
from memcalc.sizing.timeline import hf_olmo as olmo
from memcalc.sizing.timeline.ends import model_states, optimizer_step
from memcalc.sizing.params import fuses_modules, norm_names
from memcalc.sizing.timeline.fsdp import ROOT, Fsdp
from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, GRAD_SEED, GRADIENTS, PARAMETERS, TEMPORARIES, Moments, Sizes, Tape, Timeline, bulk,
)
from memcalc.sizing.timeline import torch_ops
from memcalc.sizing.timeline.torch_ops import linear
from memcalc.sizing.timeline.walk import Checkpoint, HandOver, Made, Op, Step, Walk, kept
from memcalc.sizing.timeline.zero import LOSS_GRAD, Zero


def _norm_like_final(config: ModelConfig) -> RMSNormTensors | ledger.NormTensors:
    """A layer's norm of model.norm's class and shape: its input_layernorm, or OLMo 2's first post-norm."""
    return rules.POST_NORMS[config.norm][0] if config.post_norm else _norms(config)[0]


def _shared_tables(config: ModelConfig) -> tuple[ledger.SavedTensor, ...]:
    """The ledger's RoPE tables every layer keeps, the model's own (made once per forward by its rotary embedding:
    DeepSeek's (s, d_r) ones, Llama's (s, d), OLMo's fp32); none where each layer keeps tables of its own (GLM's
    interleaved ones, OLMo's cast by FSDP2 for each layer: the model's are then its locals)."""
    return () if rules.is_glm(config) or olmo.cast(config) else mla.TABLES if config.mla else rules.rope_tables(config)


def _model_tables(config: ModelConfig, z: Sizes) -> tuple[Made, ...]:
    """The (cos, sin) tables LlamaModel's rotary embedding makes once a forward and passes the layers: a pair for each
    kind of layer (Gemma 3's full layers get a pair of their own)."""
    pairs = dict.fromkeys(_table_names(config, j) for j in range(config.L))
    if shared := _shared_tables(config):
        return tuple(Made(name, 0, "made once per forward by the rotary embedding; the layers' RoPE keeps it", keeps=x)
                     for names in pairs for name, x in zip(names, shared))
    width = 4 if olmo.cast(config) else z.act  # OlmoRotaryEmbedding's fp32 ones
    return tuple(Made(name, width * z.s * _rotary(config, z), "LlamaModel's position_embeddings, a local until it"
                      " returns: each layer interleaves (OLMo's under FSDP2: is given) its own")
                 for names in pairs for name in names)


def _table_names(config: ModelConfig, j: int = 0) -> tuple[str, ...]:
    """The tape names of the (cos, sin) tables layer j reads: the ledger's where every layer keeps them, Gemma 3's full
    layers' a pair of their own (its rotary embedding's global base)."""
    names = tuple(x.name for x in _shared_tables(config)) or ("model/rope_cos", "model/rope_sin")
    full = layer_family(config).name == "gemma3_text" and not _slides(config, j)
    return tuple(f"{x} (full)" for x in names) if full else names


def _first_reader(config: ModelConfig, j: int) -> tuple[str, ...]:
    """The model's tables layer j is the first to read: the last to hold them, in backward (its frame, or its RoPE)."""
    names = _table_names(config, j)
    return names if all(_table_names(config, i) != names for i in range(j)) else ()


def _rotary(config: ModelConfig, z: Sizes) -> int:
    """The channels of each head RoPE rotates: d, or GLM's d_r (rotary_percent), DeepSeek's qk_rope_head_dim."""
    return config.qk_rope_head_dim if config.mla else rotary_sizes(config).get(Dim.DR, z.d)


def final_norm(config: ModelConfig) -> RMSNormTensors | ledger.NormTensors:
    """model.norm keeps what a layer's norm of its class keeps (`_norm_like_final`), under its own names."""
    ln1 = _norm_like_final(config)
    if isinstance(ln1, tuple):  # a LayerNorm's (OLMo's, StarCoder 2's, Cohere's)
        return type(ln1)(*(replace(x, name=f"final_norm/{x.name.partition('/')[2]}") for x in ln1))
    return replace(ln1, **{f.name: replace(x, name=f"final_norm/{x.name.partition('/')[2]}") for f in fields(ln1)
                           if (x := getattr(ln1, f.name)) is not None})


def _norms(config: ModelConfig) -> tuple[RMSNormTensors, RMSNormTensors] | tuple[ledger.NormTensors, ...]:
    """A layer's two norms: its LayerNorm family's (`_layer_norms`), or the RMSNorms of its norm."""
    family = _layer_norms(config)
    return family.NORMS if family else rules.PRE_NORMS[config.norm]


def _layer_norms(config: ModelConfig) -> Any:
    """The module that walks the family's LayerNorms (its NORMS and `layer_norm`, with hf_layer.rms_norm's arguments):
    OLMo's (memcalc.sizing.timeline.hf_olmo), nn.LayerNorm's (hf_ln) or Cohere's; None for RMSNorms."""
    return next((x for x in (olmo, ln, cohere) if x.walks(config)), None)


def hf_timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting) -> Timeline:
    """The moments of one training step of LlamaForCausalLM sized by `config`, on its one rank."""
    check_modelled(config, strategy)
    estimated = estimate(config, strategy, accounting)
    if config.recompute == "full":  # each layer's rerun keeps what a layer without it keeps: the walk sizes those
        estimated = replace(estimate(replace(config, recompute="none"), strategy, accounting),
                            strategy=estimated.strategy)
    unpadded = replace(config, make_vocab_size_divisible_by=1)  # transformers does not pad the vocabulary
    (stage,) = stages(config.L, config.pp, config.vpp, config.microbatches)
    kept = tuple((x.tensor, x.bytes) for x in estimated.tensors)
    dense = tuple((x.tensor, x.bytes) for x in estimated.dense)  # a dense layer's, among MoE ones
    return Timeline(estimated.strategy, _moments(unpadded, Sizes.of(unpadded, strategy), kept, dense), stage.name)


@functools.lru_cache(maxsize=2)
def _moments(config: ModelConfig, z: Sizes, kept: tuple[tuple[ledger.SavedTensor, int], ...],
             dense: tuple[tuple[ledger.SavedTensor, int], ...] = ()) -> Moments:
    """The step's moments on a rank of these sizes, keeping these of the ledger's tensors (and bytes; `dense`, a
    dense layer's among MoE ones): two strategies that give a rank the same (none and tp at t = 1) walk the same
    step, once."""
    sharding = Fsdp.of(config, z.t) if config.dp_shard is not None else Zero(config) if config.zero_stage else None
    (stage,) = stages(config.L, config.pp, config.vpp, config.microbatches)
    tape = Tape()
    if sharding is not None:
        sharding.states(tape)
    else:
        model_states(tape, config, stage, z)
    if not rules.is_gpt2(config):  # GPT-2's positions are a learned table (a parameter), no rotary buffers
        kinds = {_table_names(config, j) for j in range(config.L)}  # Gemma 3's: a pair for each kind of layer
        for name in (f"{kind}{x}" for kind in ("", "full_attention_")[:len(kinds)]
                     for x in ("inv_freq", "original_inv_freq")):
            tape.add(f"states/rotary_emb.{name}", PARAMETERS, 4 * (_rotary(config, z) // 2),
                     "LlamaRotaryEmbedding's buffer, fp32 in a bf16 model (an explicit float arange)")
    if scaled_embedding(config):
        tape.add("states/embed_tokens.embed_scale", PARAMETERS, z.act, "GemmaTextScaledWordEmbedding's sqrt(h), a 0-d"
                 " buffer that _from_config casts to the weights' dtype (its .to(dtype) in forward is then a no-op)")
    tape.mark("steady", "", "model states between steps")
    saved = {x.name: nbytes for x, nbytes in (*dense, *kept)}

    def hand_over(where: str, name: str, nbytes: int) -> None:
        """A weight's gradient handed to autograd: added into the fp32 buffer and dropped, or under FSDP2 kept as the
        unsharded parameter's .grad until its block's reduce-scatter (ZeRO: into its reduce bucket)."""
        tape.drop(name)
        if sharding is not None:
            sharding.keep_grad(tape, where, moe.weight_of(where, name), nbytes)
    if rules.is_gpt2(config):
        inputs, layers, outputs = _gpt2(tape, config, z, saved, hand_over)
    else:
        inputs, layers, outputs = _llama(tape, config, z, saved, hand_over, kept, dense, sharding is not None)
    with bulk():  # an eager MoE walk puts some hundred thousand tensors on the tape
        _step(tape, sharding, inputs, layers, outputs, (olmo.cast_inputs(),) if olmo.cast(config) else ())
    if isinstance(sharding, Zero):  # DeepSpeed's step makes the fp32 gradient partition first
        sharding.optimizer_step(tape)
    else:
        optimizer_step(tape, config)
    return tape.moments


Walked = tuple[Walk, tuple[Op, ...]]  # ops and the walk that puts them on the tape

# LlamaModel's locals, live until it returns: the first layer's input (inputs_embeds), the position ids and the masks
MODEL_LOCALS = ("layers.0/input", "model/position_ids", "model/causal_mask", "model/sliding_mask", "model/rope_cos",
                "model/rope_sin")


def _llama(tape: Tape, config: ModelConfig, z: Sizes, saved: dict[str, int], hand_over: HandOver,
           kept: tuple[tuple[ledger.SavedTensor, int], ...], dense: tuple[tuple[ledger.SavedTensor, int], ...],
           sharded: bool) -> tuple[Walked, list[Walked], Walked]:
    """LlamaForCausalLM's (and its kin's) embedding, layers and output as walks and ops."""
    ln1, final, rope = _norm_like_final(config), final_norm(config), _shared_tables(config)
    ends = {x.name: saved[x.name] for x in rope} | {ledger.OUTPUT_INPUT.name: z.full(z.h)} | {
        y.name: saved[x.name] for x, y in zip(ln1, final) if x.name in saved} | {
        ledger.LOGITS_SOFTCAP_TANH.name: z.act * z.b * z.s * config.vocab_size,
        ledger.EMBEDDING_DROPOUT_MASK.name: z.tokens(z.h)}  # a bool mask (StarCoder 2's, hf_ln)
    own = (*rope, *rules.OLMO_ROPE_CAST)  # the model's tables; the copies FSDP2 casts at a layer's pre-forward
    tensors = tuple(x for x, _ in kept if x not in own)  # every layer shares one description of these
    made, block = moe.kept_in_forward(tensors, config), moe.block_backward(z, config) if config.moe else ()
    saved |= moe.expert_bytes(saved, config) if config.moe else {}
    plain = moe.kept_in_forward(tuple(x for x, _ in dense if x not in own), config)  # a dense one's among MoE
    layers = [(Walk(tape, f"layers.{i}", f"model.layers.{i}", saved, hand_over, _checkpoint(i, config)),
               cohere.layer(i, z, config, saved, rope, made) if cohere.walks(config) else
               _layer(i, z, config, saved, made, block) if not config.moe or config.is_moe_layer(i) else
               _layer(i, z, config, saved, plain, ())) for i in range(config.L)]
    inputs = (Walk(tape, "", "", ends, hand_over), _embedding(z, config, sharded))
    outputs = (Walk(tape, "", "", ends, hand_over), _output(z, config))
    return inputs, layers, outputs


def _gpt2(tape: Tape, config: ModelConfig, z: Sizes, saved: dict[str, int], hand_over: HandOver
          ) -> tuple[Walked, list[Walked], Walked]:
    """GPT2LMHeadModel's front, blocks and ln_f (memcalc.sizing.timeline.hf_gpt2); its lm_head, loss and embedding's
    gradient are Llama's (one rank, unsharded)."""
    ends = gpt2.ends(z, saved)
    layers = [(Walk(tape, f"layers.{i}", f"transformer.h.{i}", saved, hand_over, gpt2.checkpoint(i, config)),
               gpt2.block(i, z, config, rules.MATH_Q.name in saved)) for i in range(config.L)]
    inputs = (Walk(tape, "", "", ends, hand_over),
              (_batch(z), *gpt2.embedding(z, config, _embedding_backward(z, config, False, False))))
    outputs = (Walk(tape, "", "", ends, hand_over), (gpt2.final_norm(z, config), *_head(z, config)))
    return inputs, layers, outputs


def _slides(config: ModelConfig, j: int) -> bool:
    """Whether layer j is a sliding-window layer (layer_types): Gemma 2's and gpt-oss's even layers, Gemma 3's all but
    every sixth."""
    family = layer_family(config).name
    return family in ("gemma2", "gpt_oss") and j % 2 == 0 or \
        family == "gemma3_text" and (j + 1) % rules.GEMMA3_FULL_EVERY != 0


def _layer_mask(config: ModelConfig, j: int) -> str:
    """The mask LlamaModel passes layer j: the sliding-window one to a sliding layer, else the causal one."""
    return "model/sliding_mask" if _slides(config, j) else "model/causal_mask"


def _unheld_masks(config: ModelConfig) -> tuple[str, ...]:
    """Under gradient checkpointing, LlamaModel's masks no layer's frame holds, gone as it returns: Qwen2-MoE's
    sliding-window mask, which no layer is given (Gemma 2's and 3's sliding layers are); the causal mask where every
    layer slides (Gemma 2's with one layer, Gemma 3's under six)."""
    held = {_layer_mask(config, j) for j in range(config.L)}
    return tuple(x for x in ("model/causal_mask", "model/sliding_mask") if x not in held)


def _checkpoint(i: int, config: ModelConfig) -> Checkpoint | None:
    """gradient_checkpointing_enable's non-reentrant checkpoint around layer i's forward, torch's early stop on. Its
    frame holds the layer's input and the keyword arguments LlamaModel passes (the position ids and RoPE's tables,
    which layer 0's frame is the last to hold; under FSDP2 OLMo's layers' own cast copies, hf_olmo.cast_inputs, as
    transformers checkpoints a layer's forward, FSDP2's hooks outside it; a mask, which the first layer given it is).
    The layer's own ops, its residual sums, rerun outside any module's forward: MemTracker's temporaries."""
    if config.recompute != "full":
        return None
    masks = [_layer_mask(config, j) for j in range(i + 1)]
    shared = (*(("model/position_ids",) if i == 0 else ()), *(olmo.cast_names(f"layers.{i}", config)
                                                              or _first_reader(config, i)),
              *((masks[i],) if masks.index(masks[i]) == i else ()))
    rerun = ACTIVATIONS if config.dp_shard is None else TEMPORARIES  # FSDPMemTracker's: in backward, no unit's forward
    return Checkpoint(f"layers.{i}/input", rerun=rerun, early_stop=True, own=TEMPORARIES, frame=shared)


def _step(tape: Tape, sharding: Fsdp | Zero | None, inputs: Walked, layers: list[Walked], outputs: Walked,
          cast: tuple[Op, ...] = ()) -> None:
    """Forward, each layer gathered around it under FSDP2 or ZeRO-3 (`cast`: FSDP2's pre-forward ops before its
    all-gather, hf_olmo.cast_inputs); loss.backward(), each layer gathered again under FSDP2 and its gradients
    reduce-scattered after it."""
    (front, (batch, *embedding)), (back, out) = inputs, outputs
    front.forward((batch,))
    if sharding is not None:  # the root's pre-forward: embedding, final norm and lm_head gathered
        sharding.copy_out(tape, ROOT, "forward", "")
    front.forward(tuple(embedding))
    for i, (walk, ops) in enumerate(layers):
        if sharding is not None:
            walk.forward(cast)
            sharding.copy_out(tape, f"layers.{i}", "forward", f"model.layers.{i}")
        walk.forward(ops)
        if sharding is not None:
            sharding.post_forward(tape, f"layers.{i}")
    back.forward(out)
    if sharding is not None:  # the root's post-forward, then its pre-backward: the last layer's all-gather
        sharding.forward_done(tape)
        sharding.pre_backward(tape, ROOT, "", f"layers.{len(layers) - 1}")
    back.backward(out)
    for i, (walk, ops) in reversed(list(enumerate(layers))):
        if sharding is not None:
            sharding.pre_backward(tape, f"layers.{i}", f"model.layers.{i}", f"layers.{i - 1}" if i else None)
        walk.backward(ops)
        if sharding is not None:  # transformers calls self_attn with keyword inputs: active to the end of backward
            sharding.post_backward(tape, f"layers.{i}", f"model.layers.{i}.self_attn")
    front.backward(tuple(embedding))
    if sharding is not None:  # the final callback, inside backward(): the root's post-backward (no module active),
        sharding.post_backward(tape, ROOT, "")  # then the last reduce-scatter waited on
    if isinstance(sharding, Fsdp):  # HSDP's all-reduce inputs let go
        sharding.finalize_backward(tape)
    tape.drop(f"fsdp/{ROOT} reduce-scatter", GRAD_SEED)


# The families whose model the walk follows, which --step builds (memcalc.probe.libs.hf_step).
WALKED = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "phi3", "gpt2",
          "olmo", "starcoder2", "cohere", "deepseek_v3", "olmo2", "gemma3_text", "glm", "glm4", "gpt_oss")


def check_modelled(config: ModelConfig, strategy: Strategy) -> None:
    """ConfigError naming the first thing the hf step timeline does not model yet."""
    family, tp = layer_family(config).name, strategy.tensor_parallel and config.t > 1
    sharded = config.dp_shard is not None or config.zero_stage is not None
    rerun = f"recompute {config.recompute} (gradient checkpointing) with"
    gpt2, gpt_oss = family == "gpt2", family == "gpt_oss"
    slots = config.moe_router_topk * config.b * config.s if config.moe else 0
    missing = [
        (family not in WALKED, f"{family}'s model (it walks {', '.join(WALKED)})"),
        # GPT2LMHeadModel's walk (memcalc.sizing.timeline.hf_gpt2); SDPA with dropout is the flash kernel's walk on
        # CUDA, which drops out inside (the ledger's FLASH_DROPOUT_LSE, read from torch's code), and on a CPU torch's
        # math kernel
        (gpt2 and tp, f"GPT-2's model under tp (t={config.t}): GPT2Config has no base_model_tp_plan"),
        (gpt2 and not config.add_bias_linear, "GPT-2 without add_bias_linear (its Conv1Ds always have biases)"),
        (gpt2 and config.position_embedding_type != "learned_absolute",
         f"GPT-2 with position_embedding_type {config.position_embedding_type} (GPT2Model learns its positions: wpe)"),
        (gpt2 and sharded, "GPT-2's model under dp_shard or zero_stage"),
        # GptOssForCausalLM's walk (memcalc.sizing.timeline.hf_gpt_oss) is measured without checkpointing, its experts
        # by grouped_mm, on one unsharded rank (its eager attention with sinks the config's validation requires)
        (gpt_oss and config.recompute != "none",
         f"recompute {config.recompute} (gradient checkpointing) in gpt-oss's model"),
        (gpt_oss and not moe.grouped(config), "gpt-oss's experts by the eager loop"),
        (gpt_oss and sharded, "gpt-oss's model under dp_shard or zero_stage"),
        # b = s = 1: the sinks' gradient is a strided view that AccumulateGrad copies (measured: 16 B filed as
        # gradients, not temporaries, at the scale's backward)
        (gpt_oss and config.b * config.s == 1, "one token (b = s = 1) in gpt-oss's model"),
        (config.sliding_window is not None and not _slides(config, 0),
         f"sliding_window={config.sliding_window} outside Gemma 2 and 3 and gpt-oss (it walks a window in their models"
         " only)"),
        # found by the step differential: with a window of s its SDPA masks are made (b=1 s=3 sliding_window=3:
        # 18 B more activations measured at the forward's peak)
        (family == "gemma3_text" and config.attention != "eager" and config.sliding_window is not None
         and config.sliding_window <= config.s,
         f"sliding_window={config.sliding_window} not above s={config.s} under SDPA in Gemma 3's model (its masks)"),
        (config.rotary_percent is not None and not rules.is_glm(config) and family != "starcoder2",
         "partial RoPE (rotary_percent) outside GLM's model"),
        (rules.is_glm(config) and rotary_sizes(config)[Dim.DR] == 0,
         f"GLM's RoPE on no channel (int(d * rotary_percent) = int({config.head_dim} * {config.rotary_percent}) = 0)"),
        (strategy.tensor_parallel and config.vocab_size % config.t != 0,
         f"vocab_size={config.vocab_size} that t={config.t} does not divide (DTensor pads uneven shards to gather"
         " the logits)"),
        (tp and sharded and config.tie_embeddings,
         "tied embeddings under tp with dp_shard or zero_stage (unmeasured: the probe loads a tied model over tp as"
         " from_pretrained does, unsharded)"),
        # transformers has no pipeline schedule: its config's base_model_pp_plan only names each stage's inputs and
        # outputs (read by torchtitan's experimental transformers backend), its Trainer never pipelines, and
        # accelerate's prepare_pippy splits a model for inference only
        (config.pp != 1, f"pp={config.pp} (transformers has no pipeline schedule of its own: its base_model_pp_plan"
                         " only names each stage's inputs and outputs, for torchtitan's experimental transformers"
                         " backend; --impl torchtitan walks torchtitan's Llama3 under its pipeline)"),
        (config.cp != 1, f"cp={config.cp}"),
        (config.add_bias_linear and family not in ("gpt2", "gpt_oss", "starcoder2"),
         "add_bias_linear (biases on every linear; Qwen2's q, k, v biases are add_qkv_bias)"),
        ((olmo.walks(config) or config.post_norm) and config.zero_stage is not None,
         f"{family}'s model under zero_stage (unmeasured)"),
        (fuses_modules(config) and (tp or sharded),
         f"{family}'s model under tp, dp_shard or zero_stage (unmeasured: t = 1 without sharding only)"),
        (config.post_norm and tp, f"{family}'s model under tp (unmeasured)"),
        (scaled_embedding(config) and sharded, f"{family}'s model under dp_shard or zero_stage (unmeasured)"),
        (ln.walks(config) and sharded, "StarCoder 2's model under dp_shard or zero_stage (FSDP2's units are Llama's"
                                       " modules)"),
        (cohere.walks(config) and (sharded or config.qk_layernorm),
         "Cohere's model under dp_shard or zero_stage, or with use_qk_norm (qk_layernorm)"),
        (config.position_embedding_type != "rope" and family != "gpt2",
         f"position_embedding_type {config.position_embedding_type}"),
        # stage3.py's _create_fp32_partitions: fp32_partitioned_groups_flat is the fp32 weights' own partition (no
        # master copy), which the walk's states would count twice; and MemTracker does not see ds_tensor (stage 3
        # unmeasured)
        (config.dtype == "fp32" and config.zero_stage == 3, "dtype fp32 with zero_stage=3 (stage3.py keeps the fp32"
                                                            " weights' partition as the master partition, no copy)"),
        # the probe gives DeepSpeed its bf16 section (or none, fp32); fp16's loss scaler and its FP16 optimizers are
        # neither walked nor measured
        (config.dtype == "fp16" and config.zero_stage is not None,
         f"dtype fp16 with zero_stage={config.zero_stage} (DeepSpeed's loss-scaled fp16 optimizer; bf16 and fp32 are"
         " walked)"),
        # the sparse MoE blocks' walk (memcalc.sizing.timeline.hf_moe): grouped_mm's tensors hold all k*b*s slots
        # whatever the counts, the eager loop's are per expert
        (config.moe and tp and not moe.grouped(config), f"the eager loop's experts under tp (t={config.t})"),
        (config.moe and config.ep != 1, f"ep={config.ep}"),
        (config.moe and config.moe_tokens != "balanced", f"moe_tokens {config.moe_tokens} (it walks the balanced"
                                                         " bound, kbs/E slots an expert, which the forced balanced"
                                                         " router gives)"),
        (config.moe and config.experts_implementation == "eager" and slots % config.num_experts != 0,
         f"k*b*s={slots} slots that E={config.num_experts} experts do not share evenly in the eager loop (balanced"
         " routing would give them unequal counts)"),
        (config.mla and config.recompute != "none", f"{rerun} latent attention"),
        (config.mla and config.zero_stage is not None, "zero_stage with latent attention (DeepSpeed's step on it"
                                                       " unmeasured)"),
        (config.mla and config.moe and config.dp_shard is not None,
         "DeepseekV3MoE under dp_shard (its router's fp32 weight in a 16-bit FSDP2 unit is not laid out)"),
        # the FSDP2 and ZeRO walks
        # bf16 with the model's gradient accumulation dtype and the Trainer's torch AdamW (no DeepSpeed FusedAdam):
        # engine._do_optimizer_sanity_check picks DDP_BFLOAT16, FP16_UnfusedOptimizer, which clones each parameter
        # in fp32 and at its step makes every fp32 .grad before AdamW; measured (h=64 L=2 dp=2, P=108,864): 1,524,244
        # B between steps, 2,177,544 at the peak, 20 B a parameter and AdamW's 0-d steps, where the walk has no
        # DeepSpeed buffers
        (config.zero_stage == 0, "zero_stage=0 (DeepSpeed's FP16_UnfusedOptimizer in bf16, its fp32 copy of each"
                                 " parameter; --totals counts its model states)"),
        # transformers' Trainer gives DeepSpeed tp through DeepSpeed's AutoTP (integrations/deepspeed.py deepspeed_init:
        # deepspeed.tp_model_init, tensor_parallel.autotp_size), whose LinearLayer and LinearAllreduce replace
        # nn.Linear: not the tp_plan the walk lays out
        (config.zero_stage is not None and tp,
         f"zero_stage={config.zero_stage} under tp (t={config.t}): the Trainer runs DeepSpeed's tp through its AutoTP"
         " modules, not transformers' tp_plan"),
        # measured at stages 1 and 2 (Mixtral on both paths, Qwen2-MoE's dense layers among sparse ones; gradient
        # checkpointing): the state between steps, the peak, its categories and moment exact; stage 3 is not measured
        # (MemTracker does not see the partition DeepSpeed keeps on each parameter, ds_tensor)
        (config.zero_stage == 3 and config.moe, "zero_stage=3 with experts"),
        (sharded and config.add_qkv_bias, "dp_shard or zero_stage with add_qkv_bias (its walks lay out one gradient a"
                                          " module, the weight's)"),
        # gradient checkpointing: each layer's forward op by op, rerun in backward
        (config.recompute != "none" and config.zero_stage == 3, f"{rerun} zero_stage=3"),
    ]
    for absent, what in missing:
        if absent:
            raise ConfigError(f"the step timeline for impl hf does not model {what} yet")


def _layer(i: int, z: Sizes, config: ModelConfig, saved: dict[str, int], made: Step, block: tuple[Op, ...]
           ) -> tuple[Op, ...]:
    """Decoder layer i as ops, its MLP LlamaMLP or a sparse `block`. Under a checkpoint its forward runs op by op;
    without, it is one moment (`made`, every kept tensor at once)."""
    p, tp, checkpointed = f"layers.{i}", z.t > 1, config.recompute == "full"
    out = f"grad/layers.{i - 1}/output" if i else ln.first_grad(config)
    mlp = moe.OUTPUT_GRAD if block else f"grad/{p}/ln2 output"
    sparse = moe.block_forward(p, z, config, checkpointed) if block else ()  # the sparse block's forward
    family = _layer_norms(config)
    norm_ops = family.layer_norm if family else layer.rms_norm  # Cohere's: cohere.layer
    rope, rotated = olmo.recorded(olmo.rope) if olmo.fp32_rope(config) and z.act != 4 else (None, [])
    # Gemma 2's sandwich norms (OLMo 2's post-norms): on the attention's output and on the MLP's, whose gradients are
    # then theirs; Phi-3's residual dropouts (p > 0) likewise on the branches' outputs, o_proj's and down_proj's
    resid, sandwich = config.fused_qkv and config.has_dropout, config.sandwich_norm or config.post_norm
    inner = ln.walks(config) and config.has_dropout  # StarCoder 2's F.dropout inside the attention (hf_ln)
    attn_out, mlp_out = (f"grad/{p}/attn output", f"grad/{p}/mlp output") if sandwich else (
        f"grad/{p}/attn dropped", f"grad/{p}/mlp dropped") if resid or inner else (None, None)
    post_attn, post_mlp = (  # each on its branch's output, which goes as the norm returns
        layer.rms_norm(name, p, norm, z, None, dx, output=Made(f"{p}/{branch} normed", z.full(z.h), "the branch's"
                                                                " output normalised"), gone=(f"{p}/{branch} output",),
                       x=f"{p}/{branch} output")
        for name, norm, dx, branch in zip(norm_names(config)[1::2],
                                          rules.POST_NORMS[config.norm], (attn_out, mlp_out), ("attn", "mlp"))
    ) if sandwich else (
        (torch_ops.dropout(f"resid_{branch}_dropout", p, mask, Made(f"{p}/{branch} output", z.full(z.h), "the"
                                                                    " branch's output dropped out"), dx,
                           z.full(z.h)),)  # the layer's variable holds the input to the residual sum
        for branch, mask, dx in (("attn", ledger.ATTN_OUT_DROPOUT_MASK, attn_out),
                                 ("mlp", ledger.MLP_DROPOUT_MASK, mlp_out))
    ) if resid else ((), ())
    proj = "proj" if resid or inner else "output"
    mid, output = layer.residuals(i, z, layer.returned_weights(z, config.attention == "eager", config.has_dropout))
    into = ((f"grad/{p}/mid", out), (f"grad/{p}/output", f"grad/{p}/mid")) if config.post_norm else (("", ""),) * 2
    names = norm_names(config)
    ln1, ln2 = (layer.unnormed(ledger.QKV_IN, f"{p}/input"), layer.unnormed(ledger.FC1_IN, f"{p}/mid")) \
        if config.post_norm else (
        norm_ops(names[0], p, _norms(config)[0], z, f"grad/{p}/ln1 output", out, f"grad/{p}/mid",
                 output=kept(p, ledger.QKV_IN), x=f"{p}/input"),
        norm_ops(names[2], p, _norms(config)[1], z, mlp, f"grad/{p}/mid", f"grad/{p}/output",
                 output=kept(p, ledger.MOE_IN if block else ledger.FC1_IN), x=f"{p}/mid"))
    attn = mla.attention(p, z, config, saved) if config.mla else ln.dropped_attention(layer.attention(
        p, z, config.attention == "eager", saved, config.groups != config.a, tp,
        () if checkpointed else (*_first_reader(config, i), *olmo.cast_names(p, config)),
        config.norm if config.qk_layernorm else "", config.has_dropout, rules.scores_capped(config), attn_out,
        config.fused_qkv, f"attn {proj}", into[0], rope, config.attention_sinks), p, z, config)
    ops = (
        *ln1,
        *attn,
        *post_attn,
        *((mid,) if checkpointed else ()),
        *ln2,
        *(sparse if checkpointed else ()),
        *(block or (ln.mlp(p, z, config) if ln.walks(config) else
                    layer.mlp(p, z, tp, rules.GATED[config.mlp], mlp_out, fuses_modules(config),
                              f"mlp {proj}", into[1]))),
        *post_mlp,
        *((output,) if checkpointed else ()),
    )
    if not checkpointed:
        core, later = mla.eager_forward(p, z, config, saved) if config.mla else oss.eager_forward(
            p, z, saved, config.has_dropout) if rules.is_gpt_oss(config) else \
            (layer.core_forward(attn, rotated), frozenset())
        ops = (*layer.layer_forward(i, z, made, core, sparse, resid, later,
                                    config.post_norm or ln.walks(config) or z.act == 4,
                                    down_proj=ln.DOWN if ln.walks(config) else layer.DOWN_PROJ,
                                    post_norm=post_mlp if sandwich else ()),
               *(replace(x, forward=()) if x.forward else x for x in ops))
    return tuple(replace(x, shadow=PHI3_SHADOWED.get(x.where, "")) for x in ops) if config.fused_qkv and not resid \
        else ops


# Phi-3's residual dropouts (resid_pdrop 0: nn.Dropout returns its input) take o_proj's and down_proj's outputs as
# their inputs, the same tensors: MemTracker reads the branch's backward inside the dropout, but for the modules that
# make outputs of their own (qkv_proj, gate_up_proj, the activation).
PHI3_SHADOWED = {"self_attn": "resid_attn_dropout", "self_attn.o_proj": "resid_attn_dropout",
                 "mlp": "resid_mlp_dropout", "mlp.down_proj": "resid_mlp_dropout"}


def _embedding(z: Sizes, config: ModelConfig, sharded: bool) -> tuple[Op, ...]:
    """The batch; the embedding (`embedding_rowwise` under tp: this rank's rows, the Partial sum all-reduced) and what
    LlamaModel makes once for all layers."""
    tp = z.t > 1
    lookup = (Made("embedding/partial", z.full(z.h), "this rank's rows looked up, the others' zeroed (DTensor's"
                   " MaskPartial), summed by all_reduce"),) if tp else ()
    eager, act, s = config.attention == "eager", z.act, z.s
    model = (
        Made("model/position_ids", s * 8, "arange(s) as (1, s) int64, live until LlamaModel returns"),
        *((Made("model/causal_mask", act * z.b * s * s, "create_causal_mask's additive (b, 1, s, s) mask, live until"
                " LlamaModel returns"),) if eager else ()),
        *((Made("model/sliding_mask", act * z.b * s * s if eager else s * s, "create_sliding_window_causal_mask's"
                " mask beside the causal one: Gemma 2's sliding layers read it (Qwen2MoeModel makes it too, though no"
                " layer slides; under SDPA Gemma 3's window, not below s, is causal: no mask)"),)
          if _qwen2_moe(config) or _slides(config, 0) and eager else ()),
    )
    tables = _model_tables(config, z)
    dropped = ln.embedding_dropout(z, config, Step("RoPE's tables", tables, moment=False))
    first = Made("model/inputs_embeds" if dropped else "layers.0/input", z.full(z.h), "the embedding lookup, the first"
                 " layer's input: LlamaModel's inputs_embeds, live until it returns")
    looked_up = (Step("the embedding lookup" + (", all-reduced" if tp else ""), (*lookup, first),
                      frees=("embedding/partial",)),)
    scaled: tuple[Step, ...] = ()
    if scaled_embedding(config):  # lookup * embed_scale (the buffer itself, kept by the product for its backward)
        looked_up = (replace(looked_up[0], makes=(*lookup, Made("embedding/lookup", z.full(z.h), "the lookup, before"
                                                                " its scale")), moment=False),
                     Step("the lookup scaled by sqrt(h)", (first,), frees=("embedding/lookup",)))
        scaled = (Step("the scale's backward", (Made("grad/embedding (scaled)", z.full(z.h), "dY * scale, the lookup's"
                                                     " gradient"),), frees=("grad/embedding output",), moment=False),)
    return (_batch(z), Op("model.embed_tokens", forward=(
        *looked_up, Step("what LlamaModel makes once for all layers", model + (() if dropped else tables),
                         moment=False),
    ), backward=(*scaled, *_embedding_backward(z, config, tp, sharded))), *dropped)


def _qwen2_moe(config: ModelConfig) -> bool:
    """Qwen2-MoE's model, known by its shared expert (DeepSeek-V3's, beside latent attention, is another block)."""
    return bool(config.moe_shared_expert_intermediate_size) and not config.mla


def _batch(z: Sizes) -> Op:
    """The micro-batch's token ids and labels, loaded inside the step."""
    return Op("", forward=(Step("the batch", (
        Made(ledger.EMBEDDING_INPUT_IDS.name, z.tokens(8), "the micro-batch's token ids (int64), live for the whole"
             " step; the embedding keeps them"),
        Made("batch/labels", z.tokens(8), "the micro-batch's labels (int64), live for the whole step")),
        moment=False),), backward=())


def scaled_embedding(config: ModelConfig) -> bool:
    """Gemma's models (GemmaRMSNorm's, norm rmsnorm_1p) scale the embedding by sqrt(h):
    GemmaTextScaledWordEmbedding multiplies the lookup by its embed_scale buffer."""
    return config.norm == "rmsnorm_1p"


def _embedding_backward(z: Sizes, config: ModelConfig, tp: bool, sharded: bool) -> tuple[Step, ...]:
    """The embedding's gradient, dY added into the rows the ids picked; tied, summed with lm_head's. Under tp it is the
    whole (v, h) table (DTensor gives the Shard(0) weight a Replicate gradient): without FSDP2 the weight's .grad, of
    which this rank's rows are copied out (under FSDP2 its post-backward lays it out, memcalc.sizing.timeline.fsdp);
    tied, the rows are copied out first, as DTensor adds them to lm_head's Shard(0) gradient: the sum is the rows."""
    table, tied = z.act * config.vocab_size * z.h, config.tie_embeddings
    rows = tp and not sharded
    out = (
        Step("the embedding's gradient", (Made("grad/embedding (lookup)", table, "embedding's backward: a (v, h) bf16"
                                               " gradient"),),
             frees=("grad/embedding (scaled)" if scaled_embedding(config) else "grad/embedding output",
                    *(("grad/embedding (lookup)",) if rows and not tied else ()))),
    )
    copied = Made("grad/embedding (rows)", z.weight(z.ends.word), "this rank's rows of it, copied out as the"
                  " weight's Shard(0) (DTensor's redistribute) to be added into the fp32 buffer, or (tied) to lm_head's"
                  " gradient")
    handed: tuple[str, ...] = () if rows else ("grad/embedding (lookup)",)
    if rows and not tied:
        out += (Step("this rank's rows of the embedding's gradient", (
            Made("grad/embedding (.grad)", table, "the embedding's gradient as the weight's .grad", category=GRADIENTS),
            copied), frees=("grad/embedding (.grad)", "grad/embedding (rows)")),)
    if tied:
        out += (*((Step("this rank's rows of the lookup's gradient", (copied,), moment=False),) if rows else ()),
                torch_ops.tied_sum(z.weight(z.ends.word) if rows else table))
        handed = ("grad/embedding (sum)",)
    # a tied weight's two gradients go as autograd sums them, before its accumulator runs (ZeRO's reduction there)
    summands = ("grad/embedding (lookup)", "grad/embedding (lm_head)", *((copied.name,) if rows and tied else ()))
    return out + (Step("", frees=tuple(x for x in summands if x not in handed), hands_over=handed),)


def _output(z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """model.norm, then lm_head and the loss."""
    last = f"layers.{config.L}/input"
    final = final_norm(config)
    locals_ = (*(MODEL_LOCALS if config.recompute != "full" else _unheld_masks(config)),  # the first layer's frame: the
               "model/inputs_embeds",  # rest; inputs_embeds, where a dropout made the first layer's input
               *(_table_names(config) if olmo.cast(config) else ()))  # the layers' frames hold their cast copies
    family = _layer_norms(config)
    # the norm keeps the last layer's output: nn.LayerNorm's, and in fp32 OLMo's and an RMSNorm's (x.to(float32) is x)
    kept_x = ln.walks(config) or (z.act == 4 and (olmo.walks(config) or not family))
    norm = (family.layer_norm if family else layer.rms_norm)(
        "model.norm", "", final, z, "grad/lm_head input", f"grad/layers.{config.L - 1}/output",
        output=kept("", ledger.OUTPUT_INPUT, "lm_head's input, which it keeps"),
        gone=(*(() if kept_x else (last,)), *locals_), x=last)
    if not family:  # one moment, at its widest, as it returns: the locals then alive, LlamaRMSNorm's variance and fp32
        # x * r, GemmaRMSNorm's fp32 product, Olmo2RMSNorm's variance and fp32 product (in fp32 the casts are no-ops:
        # x * r is the ledger's normed, the product lm_head's input)
        norm = layer.widest(norm, {norm[0].forward[-1].what: "RMSNorm at its widest: fp32 input and output, bf16"
                                                              " output"})
    return (*norm, *_head(z, config))


def _head(z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """lm_head (under tp its logits gathered), Gemma 2's soft-capping and ForCausalLMLoss, every family's."""
    tp = z.t > 1
    logits = z.act * z.b * z.s * config.vocab_size  # under tp gathered whole on every rank ("colwise_gather_output")
    local = z.act * z.b * z.s * z.v_t
    gather = (Made("lm_head/local logits", local, "this rank's columns of the logits (Shard(-1))"),
              Made("lm_head/gathered", z.t * local, "all_gather_into_tensor's (t*b, s, v/t) buffer")) if tp else ()
    head = linear("lm_head", ledger.OUTPUT_INPUT, None, z.weight(z.ends.head), "grad/lm_head input", z.full(z.h), "",
                  ("grad/lm_head local logits" if tp else "grad/logits",), reduced=tp,
                  dw="grad/embedding (lm_head)" if config.tie_embeddings else "", waits=config.tie_embeddings)
    columns = (Step("this rank's columns of the logits' gradient", (Made(
        "grad/lm_head local logits", local, "made contiguous"),), frees=("grad/logits",)),) if tp else ()
    lm_head = replace(head, forward=(Step("the gathered logits: this rank's columns, the gather's buffer, all", (
        *gather, Made("lm_head/logits", logits, "lm_head's bf16 logits; the output object holds them until it goes")),
        frees=("lm_head/local logits", "lm_head/gathered"), moment=tp),), backward=(*columns, *head.backward))
    return (lm_head, *_softcap(config, logits), *cohere.logit_scale(z, config), _loss(z, logits))


def _softcap(config: ModelConfig, logits: int) -> tuple[Op, ...]:
    """Gemma2ForCausalLM's final logit soft-capping after lm_head, each op's output replacing the one before."""
    if config.final_logit_softcapping is None:
        return ()
    tanh = ledger.LOGITS_SOFTCAP_TANH
    return (Op("", forward=(
        Step("the logits / c", (Made("softcap/scaled", logits, "logits / final_logit_softcapping"),),
             frees=("lm_head/logits",)),
        Step("tanh(logits / c), which tanh keeps", (kept("", tanh, "tanh's backward reads its output"),),
             frees=("softcap/scaled",)),
        Step("the capped logits: tanh(.) * c", (Made("lm_head/logits", logits, "the capped logits: the output"
                                                     " object holds them until it goes"),)),
    ), backward=(
        Step("(.) * c's backward", (Made("grad/softcap tanh", logits, "dY * c"),), frees=("grad/logits",)),
        Step("tanh's backward", (Made("grad/softcap scaled", logits, "dY * (1 - tanh^2)"),),
             frees=("grad/softcap tanh",), returns=True),
        Step("(.) / c's backward: lm_head's gradient", (Made("grad/logits", logits, "dY / c"),),
             frees=("grad/softcap scaled",)),
    ), saves=(tanh,)),)


def _loss(z: Sizes, logits: int) -> Op:
    """ForCausalLMLoss; in backward three fp32 (b*s, v) tensors at once. In fp32 logits.float() is the logits
    themselves, and log_softmax's backward makes their gradient (no cast back)."""
    shifted = (Made("loss/shift_labels", z.tokens(8), "labels[..., 1:].contiguous(): nll_loss keeps it as its target"),)
    wide, cast = 4 * logits // z.act, z.act != 4
    upcast = (Made("loss/logits fp32", wide, "logits.float(): the loss upcasts them"),) if cast else ()
    return Op("", forward=(
        Step("the loss: bf16 and fp32 logits and the fp32 log-softmax", (
            *upcast,
            Made("loss/padded labels", 8 * z.b * (z.s + 1), "labels padded by one ignore_index column, (b, s + 1)"),
            *(shifted if z.b > 1 else ()),  # with b = 1 the slice is contiguous already: a view
            Made("loss/log_softmax", wide, "the fp32 log_softmax: its backward and nll_loss's keep it"),
            Made("loss/value", 4, "the mean loss (a 0-d fp32 tensor) lives to the step's end"),
            Made("loss/total_weight", 4, "nll_loss's count of targets (0-d fp32), kept for its backward")),
             frees=("lm_head/logits", "loss/logits fp32", *(("loss/padded labels",) if z.b > 1 else ()))),
        Step("loss.backward() seeds autograd", (Made(GRAD_SEED, 4, "a 0-d ones tensor"),), moment=False),
    ), backward=(
        # a moment: in fp32 (no upcast copy in forward) at small sizes the step peaks here
        Step("nll_loss's backward", (Made("grad/log_softmax", wide, "-1/N at each target, zero elsewhere"),),
             frees=("loss/shift_labels", "loss/padded labels", "loss/total_weight", LOSS_GRAD)),
        Step("log_softmax's backward: three fp32 (b*s, v) tensors", (Made(
            "grad/logits fp32" if cast else "grad/logits", wide, "fp32"),),
             frees=("grad/log_softmax", "loss/log_softmax")),
        *((Step("the upcast's backward", (Made("grad/logits", logits, "the gradient cast back to bf16"),),
                frees=("grad/logits fp32",), moment=False),) if cast else ()),
    ))
