"""The configs many test modules start from, declared once, and the one way they build a config from them."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

from memcalc.config.schema import ModelConfig, build_config

# The probe's tiny layer (memcalc's own, Megatron-style): small enough to run at every t.
TINY = {"b": 2, "s": 16, "h": 64, "a": 8}
# Llama-style, as transformers' LlamaForCausalLM is built by the hf step's tests: SwiGLU (f = 176), RMSNorm, two K/V
# groups for eight heads, RoPE, no biases, no dropout, untied.
LLAMA_HF = dict(
    impl="hf", b=2, s=24, h=64, a=8, L=2, vocab_size=250, mlp="swiglu", ffn_hidden_size=176, norm="rmsnorm",
    num_query_groups=2, position_embedding_type="rope", add_bias_linear=False, dropout=0.0, tie_embeddings=False,
)

# transformers' GPT2LMHeadModel as the hf step's tests build it: gelu_new (f = 2h), LayerNorm, biases, learned
# positions, tied, eager, no dropout (GPT2Config's 0.1 is a case of its own).
GPT2_HF = dict(
    impl="hf", family="gpt2", b=2, s=5, h=16, a=2, L=2, vocab_size=50, mlp="gelu_tanh", ffn_hidden_size=32,
    norm="layernorm", position_embedding_type="learned_absolute", add_bias_linear=True, dropout=0.0,
    tie_embeddings=True, attention="eager",
)


# torchtitan's Llama3-style model as the step tests run it: SwiGLU (f = 176), RMSNorm, two K/V groups for eight heads,
# RoPE, no biases, untied, no recomputation.
TORCHTITAN_LLAMA3 = dict(
    impl="torchtitan", b=2, s=24, h=64, a=8, L=2, vocab_size=250, ffn_hidden_size=176, num_query_groups=2,
    position_embedding_type="rope", add_bias_linear=False, tie_embeddings=False, recompute="none",
    loss_chunks=0,  # its plain CrossEntropyLoss (its *_ce_loss configs); the chunked loss's cases set their count
)


# SEED.md section 3 written out by hand, the oracle every formula test checks against.
SEED_TEXT = {"none": "sbh(34 + 5as/h)", "tp": "sbh(10 + 24/t + 5as/(ht))", "tp-sp": "sbh(34/t + 5as/(ht))"}


def seed_bytes(strategy: str, b: Any, s: Any, h: Any, a: Any, t: Any, recompute: str = "none") -> Any:
    """Bytes one GPU keeps for one layer by SEED_TEXT (selective drops the 5as/h terms; full keeps the layer's input,
    2sbh, split by t under SP): a Fraction for whole sizes, an expression for sympy symbols."""
    ratio = lambda x, y: Fraction(x, y) if isinstance(y, int) else x / y  # noqa: E731
    sbh, core = s * b * h, ratio(0 if recompute == "selective" else 5 * a * s, h)
    if recompute == "full":
        return sbh * (ratio(2, t) if strategy == "tp-sp" else 2)
    return sbh * {"none": 34 + core, "tp": 10 + ratio(24, t) + core / t, "tp-sp": ratio(34, t) + core / t}[strategy]


def make_config(base: dict[str, Any], **changes: Any) -> ModelConfig:
    """`base` with `changes` laid over it, validated as any config is."""
    return build_config(base | changes)


def yaml_file(tmp_path: Path, text: str, name: str = "model.yaml") -> str:
    """A config file holding `text` under `tmp_path`, as `--config` takes it."""
    path = tmp_path / name
    path.write_text(text)
    return str(path)
