"""The configs many test modules start from, declared once, and the one way they build a config from them."""

from __future__ import annotations

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


# torchtitan's Llama3-style model as the step tests run it: SwiGLU (f = 176), RMSNorm, two K/V groups for eight heads,
# RoPE, no biases, untied, no recomputation.
TORCHTITAN_LLAMA3 = dict(
    impl="torchtitan", b=2, s=24, h=64, a=8, L=2, vocab_size=250, ffn_hidden_size=176, num_query_groups=2,
    position_embedding_type="rope", add_bias_linear=False, tie_embeddings=False, recompute="none",
)


def make_config(base: dict[str, Any], **changes: Any) -> ModelConfig:
    """`base` with `changes` laid over it, validated as any config is."""
    return build_config(base | changes)


def yaml_file(tmp_path: Path, text: str, name: str = "model.yaml") -> str:
    """A config file holding `text` under `tmp_path`, as `--config` takes it."""
    path = tmp_path / name
    path.write_text(text)
    return str(path)
