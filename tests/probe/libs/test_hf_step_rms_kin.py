"""transformers' RMSNorm families beyond Llama's layer, one difference each, in the hf step walk (`--impl hf`): OLMo 2's
post-norms and whole-width q/k norms, Gemma 3's per-head q/k norms in Gemma 2's layer, GLM's partial interleaved RoPE
and one gate_up_proj (GLM-4's with sandwich norms too). Each one's whole training step
under MemTracker against the walk: the peak's moment, every category at the peak and between steps to the byte, and
every moment the walk names among MemTracker's readings, in order; at b = 1 and 3, odd s, several head ratios, bf16
and fp32, with and without gradient checkpointing and attention dropout."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.families import FAMILIES  # noqa: E402
from memcalc.model.impls import hf as rules  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import LLAMA_HF as LLAMA, make_config  # noqa: E402

from .test_hf_step import CPU, WIDE, WIDE_HEADS, _exact_step  # noqa: E402

# Olmo2ForCausalLM: no norm before the attention or the MLP, an Olmo2RMSNorm (fp32 weight product) on each branch's
# output and on q_proj's and k_proj's whole outputs; OLMo's rotary tables stay fp32
OLMO2 = {"family": "olmo2", "norm": "rmsnorm_fp32w", "post_norm": True, "qk_layernorm": True}
# Gemma3ForCausalLM (gemma3_text): Gemma 2's layer, a GemmaRMSNorm on each query and key head once all three
# projections have run; five sliding layers to a full one (layer_types), each kind its own RoPE tables
GEMMA3 = {"family": "gemma3_text", "norm": "rmsnorm_1p", "mlp": "geglu_tanh", "sandwich_norm": True,
          "qk_layernorm": True}
# GlmForCausalLM: Llama's layer with q, k, v biases, RoPE on the first half of each head (its own interleaved tables,
# then concatenated with the rest) and one gate_up_proj; Glm4ForCausalLM adds a norm on each branch's output
GLM = {"family": "glm", "rotary_percent": 0.5, "add_qkv_bias": True}
GLM4 = GLM | {"family": "glm4", "sandwich_norm": True}
FP32, FULL, CAPPED = {"dtype": "fp32"}, {"recompute": "full"}, {"attn_logit_softcapping": 50.0}
STEPS = [
    ("olmo2", "flash", OLMO2),  # the loss's backward
    ("olmo2", "eager", OLMO2 | {"b": 1, "s": 13, "num_query_groups": 8}),  # a/g = 1
    ("olmo2", "eager", OLMO2 | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("olmo2", "flash", OLMO2 | {"vocab_size": 40}),  # the final Olmo2RMSNorm's backward
    ("olmo2", "flash", OLMO2 | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # the last SwiGLU's gradients
    ("olmo2", "eager", OLMO2 | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the fp32 softmax
    ("olmo2", "eager", OLMO2 | FP32 | {"b": 1, "s": 7}),  # every cast a no-op: the norms' inputs the branches' outputs
    ("olmo2", "flash", OLMO2 | FP32 | {"b": 3, "s": 9, "num_query_groups": 4}),
    ("olmo2", "flash", OLMO2 | FULL),  # each layer op by op, rerun in backward
    ("olmo2", "eager", OLMO2 | FULL | {"b": 1, "s": 11, "num_query_groups": 4}),
    ("olmo2", "eager", OLMO2 | FULL | FP32 | {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3}),
    ("olmo2", "eager", OLMO2 | {"dropout": 0.1, "b": 3, "s": 7}),  # attention dropout: native_dropout's mask
    ("olmo2", "flash", OLMO2 | FULL | {"dropout": 0.1, "b": 1, "s": 9}),  # SDPA's math kernel on a CPU, rerun
    # heads wider than h: the step peaks at RoPE's fp32 products and sums (hf_olmo.rope, OLMo's; the walk put the peak
    # at the layer's end, measured in RoPE's forward at b=3 s=16 h=64 a=2 kv_channels=256)
    *(("olmo2", attention, OLMO2 | WIDE | changes | {"recompute": recompute})
      for changes, attention, recompute in WIDE_HEADS),
    ("gemma3_text", "eager", GEMMA3),  # the loss's backward
    ("gemma3_text", "eager", GEMMA3 | {"b": 1, "s": 13, "kv_channels": 12, "num_query_groups": 4}),
    ("gemma3_text", "eager", GEMMA3 | CAPPED | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2,
                                               "tie_embeddings": True}),
    ("gemma3_text", "eager", GEMMA3 | {"vocab_size": 40}),
    ("gemma3_text", "eager", GEMMA3 | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),
    ("gemma3_text", "eager", GEMMA3 | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20,
                                       "sliding_window": 16}),  # a window shorter than s
    ("gemma3_text", "eager", GEMMA3 | FP32 | {"b": 1, "s": 7, "L": 3}),
    ("gemma3_text", "eager", GEMMA3 | FULL),
    ("gemma3_text", "eager", GEMMA3 | FULL | {"L": 1, "b": 1, "s": 11, "num_query_groups": 4}),  # causal mask: unheld
    ("gemma3_text", "eager", GEMMA3 | FULL | FP32 | CAPPED | {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3,
                                                             "sliding_window": 3}),
    ("gemma3_text", "eager", GEMMA3 | {"dropout": 0.1, "b": 3, "s": 7}),
    ("gemma3_text", "eager", GEMMA3 | {"L": 6, "b": 1, "s": 9}),  # the sixth layer full: a RoPE pair of its own
    ("gemma3_text", "flash", GEMMA3 | {"b": 3, "s": 9, "h": 48, "a": 6, "num_query_groups": 3}),  # SDPA: no masks
    ("gemma3_text", "flash", GEMMA3 | FULL | FP32 | {"L": 7, "b": 1, "s": 5}),
    ("gemma3_text", "flash", GEMMA3 | {"dropout": 0.1, "b": 3, "s": 7}),  # SDPA's math kernel on a CPU
    ("gemma3_text", "eager", GEMMA3 | FULL | FP32 | {"L": 7, "b": 3, "s": 5, "sliding_window": 3}),  # its frame's
    ("gemma3_text", "eager", GEMMA3 | FULL | {"dropout": 0.1, "b": 1, "s": 9}),
    ("glm", "flash", GLM),  # the loss's backward
    ("glm", "eager", GLM | {"b": 1, "s": 13, "num_query_groups": 8, "rotary_percent": 0.25}),  # a/g = 1
    ("glm", "flash", GLM | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True}),
    ("glm", "flash", GLM | {"vocab_size": 40}),
    ("glm", "eager", GLM | {"s": 95, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the fp32 softmax
    ("glm", "flash", GLM | FP32 | {"b": 1, "s": 7, "a": 1, "h": 16, "num_query_groups": 1}),  # one head: no copy
    ("glm", "flash", GLM | FULL | {"b": 3, "s": 9, "h": 48, "a": 6, "num_query_groups": 3}),
    ("glm", "eager", GLM | FULL | {"b": 1, "s": 5, "num_query_groups": 1}),
    # checkpointed in fp32: the norm's weight backward holds the rerun's y beside dY and both products (found by the
    # step differential at b=1 s=5 h=6 a=1 f=1 L=1: 140 B more activations, 120 B fewer temporaries, Phi-3's cause)
    ("glm", "eager", GLM | FULL | FP32 | {"b": 1, "s": 5, "h": 6, "a": 1, "num_query_groups": 1, "ffn_hidden_size": 1,
                                          "L": 1, "vocab_size": 2}),
    ("glm4", "flash", GLM4 | FULL | FP32 | {"dropout": 0.1, "b": 3, "s": 5}),
    ("glm", "flash", GLM | {"dropout": 0.1, "b": 3, "s": 7}),  # SDPA's math kernel: q, contiguous, folds as it is
    ("glm", "flash", GLM | FULL | {"dropout": 0.1, "b": 3, "s": 5, "num_query_groups": 1}),
    ("glm4", "flash", GLM4),
    ("glm4", "eager", GLM4 | {"b": 3, "s": 7, "h": 48, "a": 6, "num_query_groups": 2}),
    ("glm4", "flash", GLM4 | {"vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # the last SwiGLU's gradients
    ("glm4", "eager", GLM4 | FP32 | {"b": 1, "s": 5}),
    ("glm4", "flash", GLM4 | FULL),
    ("glm4", "eager", GLM4 | FULL | {"dropout": 0.1, "b": 1, "s": 5}),
]


def test_the_sizes_put_each_familys_peak_in_four_places_or_more():
    """What gives the next test its meaning: a family's cases peak at several different moments."""
    peaks = [(family, timeline(make_config(LLAMA, attention=a, **c), STRATEGIES["none"], CPU).peak.label())
             for family, a, c in STEPS]
    assert all(len({p for f, p in peaks if f == family}) >= 4 for family, _ in peaks), peaks


@pytest.mark.parametrize("family, attention, changes", STEPS, ids=str)
def test_each_familys_step_happens_in_order_and_peaks_where_the_timeline_says_to_the_byte(one_thread, family,
                                                                                           attention, changes):
    r = _exact_step(make_config(LLAMA, attention=attention, **changes), "none")
    assert r.model.startswith(f"transformers' {FAMILIES[family].architectures[0]}")


@pytest.mark.parametrize("changes, named", [
    (OLMO2 | {"t": 2}, "olmo2's model under tp"),  # its plan gathers the attention's projections: unmeasured
    (OLMO2 | {"zero_stage": 3}, "olmo2's model under zero_stage"),
    (GEMMA3 | {"attention": "flash", "b": 1, "s": 3, "h": 2, "a": 1, "num_query_groups": 1, "sliding_window": 3,
               "L": 1, "ffn_hidden_size": 1, "vocab_size": 2}, "sliding_window=3 not above s=3 under SDPA"),
    (GLM | {"t": 2}, "glm's model under tp"),  # its plan gathers gate_up_proj's output: unmeasured
    (GLM | {"h": 10, "a": 5, "num_query_groups": 5, "rotary_percent": 0.25}, "GLM's RoPE on no channel"),  # d = 2
], ids=str)
def test_what_the_walk_does_not_model_is_refused_by_name(changes, named):
    config = make_config(LLAMA, **changes)
    with pytest.raises(ConfigError, match=named):
        timeline(config, STRATEGIES["tp" if config.t > 1 else "none"], CPU)


def test_gemma_3s_attention_passes_no_softcap_so_its_layer_keeps_no_tanh_where_gemma_2s_does():
    """Gemma3Attention calls its attention without attn_logit_softcapping (measured: the layer probe found no tanh)."""
    capped = {"attention": "eager"} | CAPPED
    kept = {family: rules.keeps(make_config(LLAMA, **(fields | capped)), CPU)
            for family, fields in (("gemma3_text", GEMMA3), ("gemma2", GEMMA3 | {"family": "gemma2",
                                                                                "qk_layernorm": False}))}
    assert rules.SOFTCAP_TANH not in kept["gemma3_text"] and rules.SOFTCAP_TANH in kept["gemma2"]


# Gemma's, Gemma 2's and Gemma 3's models under transformers' tp_plan (rank 0 of t through the fake group): the
# post_feedforward_layernorm's tensors made after down_proj's all-reduce, whose output goes as the norm returns
GEMMA = {"family": "gemma", "norm": "rmsnorm_1p", "mlp": "geglu_tanh"}
GEMMA2 = GEMMA | {"family": "gemma2", "sandwich_norm": True}
TP_STEPS = [
    ("eager", GEMMA | {"b": 1, "s": 13, "a": 6, "h": 48, "num_query_groups": 2}),
    ("flash", GEMMA | {"b": 3, "s": 5, "dtype": "fp32", "dropout": 0.1}),
    ("eager", GEMMA | {"s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20}),  # the fp32 softmax's backward
    ("eager", GEMMA2 | CAPPED | {"b": 2, "s": 96, "h": 16, "ffn_hidden_size": 16, "vocab_size": 20,
                                 "sliding_window": 16}),  # the peak in the forward
    ("eager", GEMMA2 | FULL | FP32 | {"b": 3, "s": 5}),
    ("eager", GEMMA2 | {"b": 2, "s": 7, "vocab_size": 40, "h": 32, "ffn_hidden_size": 512}),  # down_proj's GEMMs
    ("eager", GEMMA3 | {"b": 1, "s": 9, "t": 4, "a": 4, "h": 32, "num_query_groups": 4, "ffn_hidden_size": 48}),
    ("flash", GEMMA3 | {"b": 3, "s": 33, "a": 6, "h": 48, "num_query_groups": 2}),
    ("eager", GEMMA3 | FULL | FP32 | {"b": 1, "s": 5, "L": 7}),
    ("eager", GEMMA3 | {"dropout": 0.1, "b": 3, "s": 7}),
]


@pytest.mark.parametrize("attention, changes", TP_STEPS, ids=str)
def test_under_tp_gemmas_steps_happen_in_order_and_peak_where_the_timeline_says_to_the_byte(one_thread, attention,
                                                                                            changes):
    _exact_step(make_config(LLAMA, attention=attention, **({"t": 2, "vocab_size": 8} | changes)), "tp")
