"""transformers' LayerNorm decoder layers on Llama's walk (Starcoder2ForCausalLM): nn.LayerNorm and a GELU MLP with
biases, GPT-2's ops (memcalc.sizing.timeline.hf_gpt2), beside Llama's attention with biases.

What differs from Llama's walk: docs/timeline.md, "transformers' LayerNorm layers".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.sizing.timeline import hf_gpt2 as gpt2
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import module_returns
from memcalc.sizing.timeline.walk import Made, Op, Step, kept_name

NORMS = (ledger.LN1, ledger.LN2)


def walks(config: ModelConfig) -> bool:
    """Whether the config is a LayerNorm layer this module walks: StarCoder 2's."""
    return rules.is_starcoder2(config)


def layer_norm(where: str, p: str, norm: ledger.NormTensors, z: Sizes, dy: str, out: str,
               residual: str | None = None, output: Made | None = None, gone: tuple[str, ...] = (),
               x: str = "") -> tuple[Op, ...]:
    """nn.LayerNorm as Llama's walk calls a norm (hf_layer.rms_norm's arguments): GPT-2's one kernel each way
    (hf_gpt2.layer_norm), keeping its input `x` itself (the layer's input, the stream after attention, the last
    layer's output) as the ledger's norm.input; `output`, `gone`: its forward, for a checkpoint's walk or the final
    norm."""
    op = gpt2.layer_norm(where, p, norm, z, output or Made("", 0, ""), dy, out, residual, gone)
    if output is None:
        return (replace(op, forward=()),)
    keep = Step("", (Made(x, 0, "the norm's input, which it keeps", keeps=norm.input, alias=True),))
    return (replace(op, forward=(keep, *op.forward)),)


def mlp(p: str, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """Starcoder2MLP: GPT2MLP's ops (c_fc, torch's tanh GELU or gelu_new, c_proj), its dropout F.dropout's; its
    input, the layer's variable, goes as it returns (the layer rebinds it)."""
    return module_returns(gpt2.mlp(p, z, config, drop=None), kept_name(p, ledger.FC1_IN))
