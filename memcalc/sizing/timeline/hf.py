"""One training step of transformers' own `LlamaForCausalLM` on one rank (`--impl hf`), op by op.

`memcalc.probe.libs.hf_step` trains the model as memcalc's probe trains its GPT (Megatron's
fp32 gradient buffer, fp32 master weights, fused AdamW) with transformers' own loss; this
module walks the same step the way autograd runs it, and names every tensor MemTracker sees
(outputs of ops; what lives inside one kernel is no tensor). A moment is what is live right
after an op made its outputs: what an op frees goes when the next op runs.

    steady      bf16 weights and the rotary embedding's two fp32 inv_freq buffers, the fp32
                gradient buffer, master weights, Adam's m and v
    forward     the embedding lookup; position ids; the causal mask (eager attention: SDPA
                runs is_causal and needs none); RoPE's cos and sin, made once per forward and
                kept by every layer; each decoder layer's saved tensors (the hf ledger,
                `memcalc.model.impls.hf`, less the RoPE tables, shared here) at its second
                residual sum; the final RMSNorm at its widest; lm_head's bf16 logits and
                ForCausalLMLoss at its widest (fp32 logits, padded and shifted labels, the
                kept log-softmax)
    backward    the loss's fp32 gradients; lm_head; the eager RMSNorm's fp32 temporaries;
                SwiGLU; o_proj; the attention (eager: two bmm and an fp32 softmax; SDPA: one
                kernel); repeat_kv's sums under GQA; RoPE; q, k and v projections one by one,
                their input gradients summed as autograd accumulates them; the embedding's
                gradient (tied: summed with lm_head's, which waits in autograd's buffer)
    optimizer   fused AdamW in place: nothing new

With experts (num_experts) the model is MixtralForCausalLM, or Qwen2MoeForCausalLM with shared
experts: the same walk with each MLP a sparse MoE block (memcalc.sizing.timeline.hf_moe), at
t = 1, under the balanced bound that `--route balanced` forces; Qwen2MoeModel also makes a
sliding-window mask no layer uses, live through forward.

Every weight's bf16 gradient is added into the fp32 buffer and dropped as soon as autograd
hands it over (memcalc.probe.step.MainGrads), so none outlives its GEMM but a tied one.

Under tp (t > 1) the model is laid out by transformers' own plan (memcalc.probe.libs.hf_tp:
what from_pretrained(tp_plan="auto") resolves), and the walk is the same one on this rank's
shards (a/t heads, g/t K/V groups, f/t MLP columns) with what DTensor adds:

    forward     the embedding ("embedding_rowwise"): this rank's rows looked up, then the
                Partial sum all-reduced into a new tensor; each rowwise linear's output
                all-reduced likewise; lm_head ("colwise_gather_output"): this rank's v/t
                columns, all-gathered into a (t*b, s, v/t) buffer and concatenated into the
                whole (b, s, v) logits, so the loss is t = 1's on every rank
    backward    the logits' gradient's v/t columns made contiguous; each colwise linear's dX
                a partial sum, all-reduced into a new tensor by DTensor.from_local's backward
                (q's, k's and v's one by one, then summed); the embedding's gradient the whole
                (v, h) table (DTensor gives the Shard(0) weight a Replicate gradient), of which
                the trainer copies this rank's rows into the fp32 buffer

Sharded by FSDP2 (`dp_shard`, memcalc.probe.libs.hf_fsdp), the same walk runs with FSDP2's ops around each
block (memcalc.sizing.timeline.fsdp): the states are fp32 shards, each block is gathered before it runs and
its weights' bf16 gradients are kept to its reduce-scatter, instead of added into a gradient buffer at once;
exact at every moment at dp_shard 2, 4 and 8, and on a 2-D mesh with transformers' tp_plan (the embedding's
Replicate gradient laid out as its weight by FSDP2's post-backward, tests/probe/libs/test_hf_fsdp.py).
Under DeepSpeed ZeRO (`zero_stage` 1-3, t = 1) the same calls lay out DeepSpeed's buffers instead
(memcalc.sizing.timeline.zero: stage 3's gathers, the reduce bucket, the gradient partition, the fp32 gradient
partition of its optimizer step), modelled from DeepSpeed's sources, not measured.

Exact (to the byte, at every moment named here, tests/probe/libs/test_hf_step.py) for
LlamaForCausalLM from transformers 5.24 on torch 2.13's CPU kernels: no biases, no dropout,
bf16 or fp16, eager or SDPA attention, grouped or not, tied or not (untied under tp), t = 1
or transformers' tp_plan at t = 2 and 4 (rank 0 of the fake group), pp = 1, no
recomputation; `check_modelled` names everything else. On CUDA the same aten ops make the
same outputs, with three differences that are no op's output and so are neither here nor in
MemTracker: what a kernel allocates and frees inside itself (the embedding's backward sorts
the ids; cuBLAS's workspace), the caching allocator's rounding (512-byte blocks), and SDPA's
kernel choice (the flash kernel on both devices keeps what the ledger says; another CUDA
kernel would keep other tensors).
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model import ledger
from memcalc.model.evaluate import estimate
from memcalc.model.impls import hf as rules
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import Strategy
from memcalc.sizing.pipeline import stages
from memcalc.sizing.timeline import hf_moe as moe
from memcalc.sizing.timeline.ends import model_states
from memcalc.sizing.timeline.fsdp import ROOT, Fsdp
from memcalc.sizing.timeline.hf_walk import WHY_SAVED, HfWalk, norm_names
from memcalc.sizing.timeline.tape import GRADIENTS, PARAMETERS, Sizes, Tape, Timeline
from memcalc.sizing.timeline.zero import Zero

_ROPE = (rules.ROPE_COS.name, rules.ROPE_SIN.name)


def hf_timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting) -> Timeline:
    """The moments of one training step of LlamaForCausalLM sized by `config`, on its one rank."""
    check_modelled(config, strategy)
    if not config.moe:
        from memcalc.sizing.timeline.hf_ops import ops_timeline
        return ops_timeline(config, strategy, accounting)
    layer = estimate(config, strategy, accounting)
    # transformers does not pad the vocabulary: the embedding and lm_head have vocab_size rows.
    unpadded = replace(config, make_vocab_size_divisible_by=1)
    z = Sizes.of(unpadded, strategy)
    fsdp = Fsdp.of(config, z.t) if config.dp_shard is not None else Zero(config) if config.zero_stage else None
    step = _Step(Tape(), z, config, {x.tensor.name: x.bytes for x in layer.tensors}, fsdp=fsdp)
    (stage,) = stages(config.L, config.pp, config.vpp, config.microbatches)
    if fsdp is not None:
        fsdp.states(step.tape)
    else:
        model_states(step.tape, unpadded, stage, step.z)
    step.rotary_buffers()
    step.tape.mark("steady", "", "model states between steps")
    step.forward()
    step.backward()
    if isinstance(fsdp, Zero):  # DeepSpeed's step makes the fp32 gradient partition first
        fsdp.optimizer_step(step.tape)
    else:
        step.tape.mark("optimizer", "", "fused AdamW on the fp32 master weights, in place")
    return Timeline(layer.strategy, tuple(step.tape.moments), stage.name)


def check_modelled(config: ModelConfig, strategy: Strategy) -> None:
    """ConfigError naming the first thing the hf step timeline does not model yet."""
    missing = [
        ((config.norm, config.mlp) != ("rmsnorm", "swiglu"),
         f"norm {config.norm} with mlp {config.mlp} (another family's model; it walks Llama's)"),
        (config.sandwich_norm or config.attn_logit_softcapping is not None or config.sliding_window is not None,
         "a sliding window, or Gemma 2/3's sandwich norms or soft-capping (it walks Llama's)"),
        (config.fused_qkv, "Phi-3's fused qkv_proj and gate_up_proj (it walks Llama's)"),
        (config.rotary_percent is not None, "GLM's partial RoPE and fused gate_up (it walks Llama's)"),
        (strategy.tensor_parallel and config.vocab_size % config.t != 0,
         f"vocab_size={config.vocab_size} that t={config.t} does not divide (DTensor pads uneven shards to gather"
         " the logits)"),
        (strategy.tensor_parallel and config.t > 1 and config.tie_embeddings,
         "tied embeddings under tp (transformers' apply_tensor_parallelism looks lm_head.weight up among"
         " named_parameters(), which names a tied weight once: KeyError)"),
        (config.pp != 1, f"pp={config.pp}"),
        (config.cp != 1, f"cp={config.cp}"),
        (config.recompute != "none", f"recompute {config.recompute} (gradient checkpointing)"),
        (config.has_dropout, f"dropout {config.dropout}"),
        (config.add_bias_linear or config.add_qkv_bias, "biases (LlamaForCausalLM as built here has none)"),
        (config.position_embedding_type != "rope", f"position_embedding_type {config.position_embedding_type}"),
        (config.dtype == "fp32", "dtype fp32 (no master weights)"),
        *_experts_missing(config, strategy),
        *_sharding_missing(config, strategy),
    ]
    for absent, what in missing:
        if absent:
            raise ConfigError(f"the step timeline for impl hf does not model {what} yet")


def _sharding_missing(config: ModelConfig, strategy: Strategy) -> list[tuple[bool, str]]:
    """What the FSDP2 walk (memcalc.sizing.timeline.fsdp) and the ZeRO one (memcalc.sizing.timeline.zero) leave
    out."""
    sharded = config.dp_shard is not None or config.zero_stage is not None
    return [
        (config.zero_stage == 0, "zero_stage=0 (DeepSpeed's bf16 optimizer without ZeRO; --totals counts its model"
                                 " states)"),
        (config.zero_stage is not None and strategy.tensor_parallel and config.t > 1,
         f"zero_stage={config.zero_stage} under tp (t={config.t}): the Trainer runs DeepSpeed over data parallelism"),
        (sharded and config.moe, "dp_shard or zero_stage with experts"),
    ]


def _experts_missing(config: ModelConfig, strategy: Strategy) -> list[tuple[bool, str]]:
    """What the walk of Mixtral's and Qwen2-MoE's blocks (memcalc.sizing.timeline.hf_moe) leaves out: grouped_mm
    experts (it walks the eager loop), dense layers among them, experts under tp or ep, and any count of tokens per expert but the balanced one, kbs/E each. (Other
    blocks are refused before: latent attention, a QK norm.)"""
    if not config.moe:
        return []
    slots = config.moe_router_topk * config.b * config.s
    return [
        (config.experts_implementation != "eager", f"experts_implementation {config.experts_implementation}"
                                                   " (transformers' default; it walks the eager loop: pass"
                                                   " --experts-implementation eager)"),
        (config.moe_layer_freq != 1, f"moe_layer_freq={config.moe_layer_freq} (dense layers among MoE ones)"),
        (strategy.tensor_parallel and config.t > 1, f"experts under tp (t={config.t})"),
        (config.ep != 1, f"ep={config.ep}"),
        (config.moe_tokens != "balanced", f"moe_tokens {config.moe_tokens} (it walks the balanced bound, kbs/E slots"
                                          " an expert, which the forced balanced router gives)"),
        (slots % config.num_experts != 0, f"k*b*s={slots} slots that E={config.num_experts} experts do not share"
                                          " evenly (balanced routing would give them unequal counts)"),
    ]


class _Forward(HfWalk):
    """The rotary buffers among the steady states; forward: the batch, the embedding, the layers, the final norm,
    the loss."""

    # -- steady state -----------------------------------------------------------------------------

    def rotary_buffers(self) -> None:
        """LlamaRotaryEmbedding's inv_freq and original_inv_freq: d/2 fp32 each, made by a float arange."""
        for name in ("inv_freq", "original_inv_freq"):
            self.tape.add(f"states/rotary_emb.{name}", PARAMETERS, 4 * (self.z.d // 2),
                          "LlamaRotaryEmbedding's buffer, fp32 in a bf16 model (an explicit float arange)")

    # -- forward ----------------------------------------------------------------------------------

    def forward(self) -> None:
        """The batch, the embedding, what LlamaModel makes once for all layers, the layers, the norm, the loss."""
        z, add = self.z, self.add
        add(ledger.EMBEDDING_INPUT_IDS.name, z.tokens(8),
            "the micro-batch's token ids (int64), live for the whole step; the embedding keeps them")
        add("batch/labels", z.tokens(8), "the micro-batch's labels (int64), live for the whole step")
        if self.fsdp is not None:  # the root's pre-forward: embedding, final norm and lm_head gathered
            self.fsdp.copy_out(self.tape, ROOT, "forward", "")
        if self.tp:  # "embedding_rowwise": DTensor's vocabulary-parallel lookup, then its Partial sum all-reduced
            add("embedding/partial", z.full(z.h), "this rank's rows looked up, the others' zeroed (DTensor's"
                " MaskPartial; its mask and shifted ids are freed before the all-reduce), summed by all_reduce")
        add("layers.0/input", z.full(z.h),
            "the embedding lookup, the first layer's input: LlamaModel's inputs_embeds, live until it returns")
        self.tape.mark("forward", "model.embed_tokens", "the embedding lookup" + (", all-reduced" if self.tp else ""))
        self.tape.drop("embedding/partial")
        add("model/position_ids", z.s * 8, "arange(s) as (1, s) int64, live until LlamaModel returns")
        if self.eager:
            add("model/causal_mask", z.act * z.b * z.s * z.s,
                "create_causal_mask's additive (b, 1, s, s) mask, live until LlamaModel returns")
        if self.config.moe_shared_expert_intermediate_size:  # Qwen2MoeModel: a mask per layer type, used or not
            add("model/sliding_mask", z.act * z.b * z.s * z.s if self.eager else z.s * z.s,
                "Qwen2MoeModel makes create_sliding_window_causal_mask's mask beside the causal one, though no layer"
                " slides (measured: eager a second additive (b, 1, s, s) mask, SDPA a (1, 1, s, s) bool one)")
        for name in _ROPE:
            add(name, self.saved[name], "made once per forward by LlamaRotaryEmbedding; every layer's RoPE keeps it")
        for i in range(self.config.L):
            self.layer_forward(i)
        self.final_norm_forward()
        self.loss_forward()

    def layer_forward(self, i: int) -> None:
        """The layer's saved tensors (the ledger's, less RoPE's shared tables) at its second residual sum."""
        z, p = self.z, f"layers.{i}"
        if self.fsdp is not None:
            self.fsdp.copy_out(self.tape, p, "forward", f"model.layers.{i}")
        experts = self.config.num_experts or 1
        for name, nbytes in self.saved.items():
            if name in _ROPE or moe.made_after_experts(name):
                continue
            if moe.is_per_expert(name):  # one storage per expert, freed as its expert's backward runs
                for e in range(experts):
                    self.add(moe.kept(p, name, e), nbytes // experts, WHY_SAVED)
            else:
                self.add(f"{p}/{name}", nbytes, WHY_SAVED)
        self.add(f"{p}/mid", z.full(z.h), "the residual stream after attention: ln2's input and the MLP's residual")
        if self.config.moe:  # its widest moments, then what it returns
            moe.block_forward(self, p, f"model.layers.{i}")
        else:
            self.add(f"{p}/mlp output", z.full(z.h), "down_proj's output, summed into the residual stream")
        self.add(f"layers.{i + 1}/input", z.full(z.h), "the layer's output, the next layer's input")
        self.tape.mark("forward", f"model.layers.{i}", "the layer's saved tensors, at its second residual sum")
        self.tape.drop(f"{p}/mid", f"{p}/mlp output")
        if self.fsdp is not None:
            self.fsdp.post_forward(self.tape, p)
        if i:  # the caller rebinds its hidden_states; the first layer's input is inputs_embeds too
            self.tape.drop(f"{p}/input")

    def final_norm_forward(self) -> None:
        """model.norm at its widest: weight * x.to(bf16), with the fp32 locals not yet gone."""
        z, out = self.z, "final_norm"
        norm = norm_names(out)
        self.add(norm.input_fp32, self.fp32(z.h), WHY_SAVED)
        self.add(f"{out}/variance", z.tokens(4), "pow(2).mean(-1): a local, live until the norm returns")
        self.add(norm.rstd, z.tokens(4), WHY_SAVED)
        self.add(f"{out}/normalised fp32", self.fp32(z.h), "x * rsqrt(.): a local, live until the norm returns")
        self.add(norm.normed, z.full(z.h), WHY_SAVED)
        self.add(ledger.OUTPUT_INPUT.name, z.full(z.h), "weight * (.): lm_head's input, which it keeps")
        self.tape.mark("forward", "model.norm", "RMSNorm at its widest: fp32 input and output, bf16 output")
        layers = self.config.L
        self.tape.drop(f"{out}/variance", f"{out}/normalised fp32", f"layers.{layers}/input", "layers.0/input",
                       "model/position_ids", "model/causal_mask", "model/sliding_mask")  # LlamaModel returns

    def loss_forward(self) -> None:
        """lm_head's logits, then ForCausalLMLoss at its widest (right after nll_loss)."""
        z, logits = self.z, self.logits
        if self.tp:
            self.lm_head_gather()
        self.add("lm_head/logits", logits, "lm_head's bf16 logits; the output object holds them until it goes")
        if self.tp:
            self.tape.mark("forward", "lm_head", "the gathered logits: this rank's columns, the gather's buffer, all")
            self.tape.drop("lm_head/local logits", "lm_head/gathered")
        self.add("loss/logits fp32", 2 * logits, "logits.float(): the loss upcasts them")
        self.add("loss/padded labels", 8 * z.b * (z.s + 1), "labels padded by one ignore_index column, (b, s + 1)")
        if z.b > 1:  # with b = 1 the slice is contiguous already: the target is a view of the padded labels
            self.add("loss/shift_labels", z.tokens(8), "labels[..., 1:].contiguous(): nll_loss keeps it as its target")
        self.add("loss/log_softmax", 2 * logits, "the fp32 log_softmax: its backward and nll_loss's keep it")
        self.add("loss/value", 4, "the mean loss (a 0-d fp32 tensor) lives to the step's end")
        self.add("loss/total_weight", 4, "nll_loss's count of targets (0-d fp32), kept for its backward")
        self.tape.mark("forward", "", "the loss: bf16 and fp32 logits and the fp32 log-softmax")
        self.tape.drop("lm_head/logits", "loss/logits fp32", *(("loss/padded labels",) if z.b > 1 else ()))

    def lm_head_gather(self) -> None:
        """"colwise_gather_output": this rank's v/t columns, all-gathered into a (t*b, s, v/t) buffer (funcol
        gathers along dim 0), then concatenated along the vocabulary into (b, s, v)."""
        z = self.z
        local = z.act * z.b * z.s * z.v_t
        self.add("lm_head/local logits", local, "this rank's columns of the logits (ColwiseParallel, Shard(-1))")
        self.add("lm_head/gathered", z.t * local, "all_gather_into_tensor's (t*b, s, v/t) buffer")


class _LayerBackward(HfWalk):
    """One decoder layer's backward, op by op."""

    def layer_backward(self, i: int) -> None:
        """The layer's backward, op by op: the MLP, ln2 and its residual sum, attention, ln1 and its residual sum."""
        p, m = f"layers.{i}", f"model.layers.{i}"
        if self.fsdp is not None:
            self.fsdp.pre_backward(self.tape, p, m, f"layers.{i - 1}" if i else None)
        if self.config.moe:
            moe.moe_backward(self, p, m)
        else:
            self.mlp_backward(p, m)
        self.rms_norm_backward(f"{m}.post_attention_layernorm", f"{p}/ln2", f"grad/{p}/ln2 output",
                               f"grad/{p}/mid", residual=f"grad/{p}/output")
        self.attention_backward(p, m)
        out = f"grad/layers.{i - 1}/output" if i else "grad/embedding output"
        self.rms_norm_backward(f"{m}.input_layernorm", f"{p}/ln1", f"grad/{p}/ln1 output", out,
                               residual=f"grad/{p}/mid")
        if self.fsdp is not None:  # transformers calls self_attn with keyword inputs: active to the end of backward
            self.fsdp.post_backward(self.tape, p, f"{m}.self_attn")

    def mlp_backward(self, p: str, m: str) -> None:
        """down_proj, SiLU(gate) * up, up_proj, SiLU, gate_proj; gate's and up's input gradients summed."""
        z, f = self.z, self.z.f_t  # down_proj's dY is the layer's output gradient: ln2's residual sum needs it
        self.linear_backward(f"{m}.mlp.down_proj", None, z.act * f * z.h, f"grad/{p}/down_proj input", z.full(f),
                             f"{p}/{ledger.FC2_IN.name}")
        self.add(f"grad/{p}/up", z.full(f), "SiLU(gate) * up's backward: dY * SiLU(gate)")
        self.add(f"grad/{p}/silu", z.full(f), "SiLU(gate) * up's backward: dY * up")
        self.tape.mark("backward", f"{m}.mlp", "SiLU(gate) * up: its two gradients")
        self.tape.drop(f"grad/{p}/down_proj input", *(f"{p}/{x.name}" for x in (ledger.SWIGLU_UP,
                                                                                 ledger.SWIGLU_SILU_OUT)))
        self.linear_backward(f"{m}.mlp.up_proj", f"grad/{p}/up", z.act * f * z.h, f"grad/{p}/up_proj input",
                             z.full(z.h), None, reduced=self.tp)
        self.drop_partial(f"grad/{p}/up_proj input")
        self.add(f"grad/{p}/gate", z.full(f), "SiLU's backward, at its kept input")
        self.tape.drop(f"grad/{p}/silu", f"{p}/{ledger.SWIGLU_GATE.name}")
        self.linear_backward(f"{m}.mlp.gate_proj", f"grad/{p}/gate", z.act * f * z.h, f"grad/{p}/gate_proj input",
                             z.full(z.h), f"{p}/{ledger.FC1_IN.name}", reduced=self.tp)
        self.drop_partial(f"grad/{p}/gate_proj input")
        self.add(f"grad/{p}/ln2 output", z.full(z.h), "autograd sums gate_proj's and up_proj's input gradients")
        self.tape.drop(f"grad/{p}/up_proj input", f"grad/{p}/gate_proj input")

    def attention_backward(self, p: str, m: str) -> None:
        """o_proj, the core (eager or SDPA), RoPE, then v_proj, k_proj and q_proj, their dX summed as they come."""
        z, a = self.z, f"{m}.self_attn"
        # o_proj's dY is the stream's gradient (ln1's residual sum needs it); SDPA keeps o_proj's input as its output
        self.linear_backward(f"{a}.o_proj", None, z.act * self.q * z.h, f"grad/{p}/o_proj input", z.full(self.q),
                             f"{p}/{ledger.PROJ_IN.name}" if self.eager else None)
        if self.eager:
            self.eager_core_backward(p, a)
        else:
            self.sdpa_backward(p, a)
        self.rope_backward(p, "k", self.kv)
        self.rope_backward(p, "q", self.q)
        if p == "layers.0":
            self.tape.drop(*_ROPE)  # the last RoPE that keeps them has run
        summed = ""
        for name, width in (("v", self.kv), ("k", self.kv), ("q", self.q)):
            heads, tokens = f"grad/{p}/{name} heads", f"grad/{p}/{name} tokens"
            if width == z.d or z.s == 1:  # one head: (b, 1, s, d) transposed is (b, s, 1, d) already, no copy
                self.tape.rename(heads, tokens)
            else:
                self.add(tokens, z.full(width), f"{name}'s gradient made (b, s, heads * d) again: transpose's"
                         " backward, contiguous for the GEMM")
                self.tape.drop(heads)
            kept = f"{p}/{ledger.QKV_IN.name}" if name == "q" else None  # q_proj runs last: the input goes
            dx = f"grad/{p}/{name}_proj input"
            self.linear_backward(f"{a}.{name}_proj", tokens, z.act * width * z.h, dx, z.full(z.h), kept,
                                 reduced=self.tp)
            self.drop_partial(dx)
            if summed:
                self.add(f"{dx} + {summed}", z.full(z.h), "autograd sums q's, k's and v's input gradients as they come")
                self.tape.drop(dx, summed)
                dx = f"{dx} + {summed}"
            summed = dx
        self.tape.live[f"grad/{p}/ln1 output"] = replace(self.tape.live.pop(summed), name=f"grad/{p}/ln1 output")

    def eager_core_backward(self, p: str, a: str) -> None:
        """eager_attention_forward's backward: weights x V, the bf16 cast, the fp32 softmax, the cast, the scale,
        QK^T; then repeat_kv's sums over each group's heads (GQA)."""
        z, tape, add = self.z, self.tape, self.add
        add(f"grad/{p}/attn heads", z.full(self.q), "the context's gradient as (b, a, s, d), contiguous for bmm")
        tape.drop(f"grad/{p}/o_proj input")
        expanded = rules.K_EXPANDED.name in self.saved  # repeat_kv's copies (memcalc.model.impls.hf.REPEAT_KV)
        v, k = (rules.V_EXPANDED, rules.K_EXPANDED) if expanded else (ledger.V, ledger.K)
        add(f"grad/{p}/v expanded", z.full(self.q), "weights x V's backward: dV = weights^T dY, at a heads")
        add(f"grad/{p}/weights", self.scores(z.act), "weights x V's backward: dWeights = dY V^T")
        tape.mark("backward", a, "weights x V: dV and dWeights")
        tape.drop(f"grad/{p}/attn heads", f"{p}/{rules.WEIGHTS.name}", f"{p}/{v.name}")
        add(f"grad/{p}/softmax fp32", self.scores(4), "the cast to bf16's backward: the gradient up to fp32")
        tape.drop(f"grad/{p}/weights")
        add(f"grad/{p}/scores fp32", self.scores(4), "softmax's backward, in fp32")
        tape.mark("backward", a, "the fp32 softmax's backward")
        tape.drop(f"grad/{p}/softmax fp32", f"{p}/{rules.SOFTMAX_FP32.name}")
        add(f"grad/{p}/scores", self.scores(z.act), "the cast to fp32's backward: back to bf16")
        tape.drop(f"grad/{p}/scores fp32")
        add(f"grad/{p}/scaled scores", self.scores(z.act), "the scale's backward (the mask's passes dY on)")
        tape.drop(f"grad/{p}/scores")
        add(f"grad/{p}/q heads", z.full(self.q), "QK^T's backward: dQ = dScores K")
        add(f"grad/{p}/k expanded", z.full(self.q), "QK^T's backward: dK = dScores^T Q, at a heads")
        tape.mark("backward", a, "QK^T: dQ and dK")
        tape.drop(f"grad/{p}/scaled scores", f"{p}/{ledger.Q.name}", f"{p}/{k.name}")
        for name in ("v", "k"):
            self.repeat_kv_backward(p, name)

    def repeat_kv_backward(self, p: str, name: str) -> None:
        """repeat_kv's backward: each group's a/g heads summed (no copy without GQA)."""
        expanded, heads = f"grad/{p}/{name} expanded", f"grad/{p}/{name} heads"
        if self.config.groups == self.config.a:
            self.tape.live[heads] = replace(self.tape.live.pop(expanded), name=heads)
            return
        self.add(heads, self.z.full(self.kv), f"repeat_kv's backward: d{name} summed over each group's heads")
        self.tape.drop(expanded)

    def sdpa_backward(self, p: str, a: str) -> None:
        """SDPA's flash kernel backward: dQ, dK and dV (at g heads) from one kernel; then what it keeps goes."""
        z = self.z
        self.add(f"grad/{p}/q heads", z.full(self.q), "the flash kernel's backward: dQ")
        self.add(f"grad/{p}/k heads", z.full(self.kv), "the flash kernel's backward: dK, at g heads")
        self.add(f"grad/{p}/v heads", z.full(self.kv), "the flash kernel's backward: dV, at g heads")
        self.tape.mark("backward", a, "the SDPA kernel's backward: dQ, dK, dV")
        kept = (ledger.Q, ledger.K, ledger.V, ledger.SOFTMAX_LSE, ledger.PROJ_IN)  # PROJ_IN: the kernel's output
        self.tape.drop(f"grad/{p}/o_proj input", *(f"{p}/{x.name}" for x in kept))

    def rope_backward(self, p: str, name: str, width: int) -> None:
        """apply_rotary_pos_emb's backward for q or k: dY * cos plus rotate_half's backward of dY * sin."""
        z, tape, add = self.z, self.tape, self.add
        g, half = f"grad/{p}/{name}", z.full(width) // 2
        add(f"{g} rotated", z.full(width), "rotate_half(x) * sin's backward: dY * sin")
        add(f"{g} neg", half, "rotate_half's backward: the negated half's gradient, negated back")
        add(f"{g} slice 1", z.full(width), "rotate_half's backward: a half's gradient placed in a zero tensor")
        tape.drop(f"{g} neg")
        add(f"{g} slice 2", z.full(width), "rotate_half's backward: the other half, placed likewise")
        add(f"{g} rotate_half", z.full(width), "the two halves' gradients summed")
        tape.drop(f"{g} slice 1", f"{g} slice 2", f"{g} rotated")
        add(f"{g} cos", z.full(width), "x * cos's backward: dY * cos")
        add(f"{g} pre-rope", z.full(width), "x's two gradients summed")
        tape.drop(f"{g} cos", f"{g} rotate_half", f"{g} heads")
        tape.rename(f"{g} pre-rope", f"{g} heads")


class _Step(_Forward, _LayerBackward):
    """The whole step: forward, then loss.backward() from the loss through the layers to the embedding."""

    def backward(self) -> None:
        """loss.backward(): the loss, lm_head, the final norm, the layers in reverse, the embedding."""
        self.add("loss/grad seed", 4, "loss.backward() starts from a 0-d ones tensor, made before autograd runs")
        self.in_backward = True
        if self.fsdp is not None:  # the root's post-forward, then its pre-backward: the last layer's all-gather
            self.fsdp.forward_done(self.tape)
            self.fsdp.pre_backward(self.tape, ROOT, "", f"layers.{self.config.L - 1}")
        self.loss_backward()
        self.lm_head_backward()
        self.drop_partial("grad/lm_head input")
        last = f"grad/layers.{self.config.L - 1}/output"
        self.rms_norm_backward("model.norm", "final_norm", "grad/lm_head input", last)
        for i in reversed(range(self.config.L)):
            self.layer_backward(i)
        self.embedding_backward()
        if self.fsdp is not None:  # the final callback, inside backward(): the root's post-backward (no module
            self.fsdp.post_backward(self.tape, ROOT, "")  # active), then the last reduce-scatter waited on
            self.tape.drop(f"fsdp/{ROOT} reduce-scatter", "loss/grad seed")

    def loss_backward(self) -> None:
        """nll_loss's and log_softmax's fp32 gradients, then the upcast's: back to bf16."""
        logits = self.logits
        self.add("grad/log_softmax", 2 * logits, "nll_loss's backward: -1/N at each target, zero elsewhere (fp32)")
        self.tape.drop("loss/shift_labels", "loss/padded labels", "loss/total_weight")  # nll_loss's target
        self.add("grad/logits fp32", 2 * logits, "log_softmax's backward, in fp32")
        self.tape.mark("backward", "", "log_softmax's backward: three fp32 (b*s, v) tensors")
        self.tape.drop("grad/log_softmax", "loss/log_softmax")
        self.add("grad/logits", logits, "the upcast's backward: the gradient cast back to bf16")
        self.tape.drop("grad/logits fp32")

    def lm_head_backward(self) -> None:
        """lm_head's GEMMs; a tied weight's gradient waits in autograd's input buffer for the embedding's."""
        z, grad = self.z, "grad/logits"
        if self.tp:  # the gather's backward: this rank's columns of the whole gradient (Replicate -> Shard(-1))
            grad = "grad/lm_head local logits"
            self.add(grad, z.act * z.b * z.s * z.v_t, "this rank's columns of the logits' gradient, made contiguous")
            self.tape.mark("backward", "lm_head", "this rank's columns of the logits' gradient")
            self.tape.drop("grad/logits")
        self.linear_backward("lm_head", grad, z.act * z.v_t * z.h, "grad/lm_head input", z.full(z.h),
                             ledger.OUTPUT_INPUT.name, waits="grad/embedding (lm_head)" if self.tied else None,
                             reduced=self.tp)

    def embedding_backward(self) -> None:
        """The embedding's gradient, dY added into the rows the ids picked; tied, summed with lm_head's."""
        z, tape = self.z, self.tape
        table = z.act * self.config.vocab_size * z.h  # under tp too: DTensor's backward of the lookup is Replicate
        self.add("grad/embedding (lookup)", table, "embedding's backward: a (v, h) bf16 gradient"
                 + (", the whole table on every rank (DTensor gives the Shard(0) weight a Replicate gradient)"
                    if self.tp else ""))
        tape.mark("backward", "model.embed_tokens", "the embedding's gradient")
        tape.drop("grad/embedding output")
        if self.tp and self.fsdp is None:  # the whole table is the weight's .grad, which MemTracker files as such
            # (under FSDP2, its post-backward lays it out as the weight: memcalc.sizing.timeline.fsdp)
            tape.drop("grad/embedding (lookup)")
            tape.add("grad/embedding (.grad)", GRADIENTS, table, "the embedding's gradient as the weight's .grad")
            self.add("grad/embedding (rows)", z.act * z.v_t * z.h, "this rank's rows of it, copied out as the"
                     " weight's Shard(0) (DTensor's redistribute) to be added into the fp32 buffer")
            tape.mark("backward", "model.embed_tokens", "this rank's rows of the embedding's gradient")
        if self.config.tie_embeddings:
            self.add("grad/embedding (sum)", table, "autograd sums the tied weight's two gradients into a new tensor")
            tape.mark("backward", "model.embed_tokens", "the tied weight's two gradients summed")
        if self.fsdp is not None:  # the weight's .grad: the lookup's gradient, or tied the two summed
            self.hand_over("model.embed_tokens", "grad/embedding (sum)" if self.tied else "grad/embedding (lookup)",
                           table)
        tape.drop("grad/embedding (lookup)", "grad/embedding (.grad)", "grad/embedding (rows)",
                  "grad/embedding (lm_head)", "grad/embedding (sum)")
        if self.fsdp is None:  # under FSDP2 the final callback runs before backward() returns and frees it
            tape.drop("loss/grad seed")
