"""transformers' LayerNorm decoder layers on Llama's walk (Starcoder2ForCausalLM): nn.LayerNorm and a GELU MLP,
GPT-2's ops (memcalc.sizing.timeline.hf_gpt2), beside Llama's attention; every linear with a bias under use_bias.

What differs from Llama's walk: docs/timeline.md, "transformers' LayerNorm layers".
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.model import ledger
from memcalc.model.impls import hf as rules
from memcalc.sizing.timeline import hf_gpt2 as gpt2
from memcalc.sizing.timeline.tape import Sizes
from memcalc.sizing.timeline.torch_ops import dropout, module_returns
from memcalc.sizing.timeline.walk import Made, Op, Step, kept_name

NORMS = (ledger.LN1, ledger.LN2)
DOWN = "mlp.c_proj"  # the MLP's rowwise projection under tp


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
    """Starcoder2MLP: GPT2MLP's ops (c_fc, torch's tanh GELU or gelu_new, c_proj; under tp c_fc colwise, c_proj
    rowwise), its dropout F.dropout's; its input, the layer's variable, goes as it returns (the layer rebinds it)."""
    return module_returns(gpt2.mlp(p, z, config, drop=None, tp=z.t > 1), kept_name(p, ledger.FC1_IN))


def dropped_attention(ops: tuple[Op, ...], p: str, z: Sizes, config: ModelConfig) -> tuple[Op, ...]:
    """Starcoder2Attention's ops (`ops`, hf_layer.attention's, o_proj's output made as "attn proj" and its gradient
    "attn dropped") with dropout > 0: F.dropout on o_proj's output inside the attention (the probe's shim runs
    native_dropout: its output and bool mask), o_proj's output going as it returns, the attention's locals after it,
    as the module returns (o_proj's input at once, rebound to its output)."""
    if not (walks(config) and config.has_dropout):
        return ops
    *before, o_proj = ops
    gemm, proj_in = o_proj.forward[-1], kept_name(p, ledger.PROJ_IN)
    own = {x.name for x in gemm.makes}  # under tp its partial sum (hf_layer.rowwise), gone as o_proj returns
    returns = Step("", frees=tuple(x for x in gemm.frees if x not in own),
                   reads_last=tuple(x for x in gemm.reads_last if x != proj_in))
    o_proj = replace(o_proj, forward=(*o_proj.forward[:-1], replace(gemm, frees=tuple(
        x for x in gemm.frees if x in own), reads_last=tuple(x for x in gemm.reads_last if x == proj_in))))
    return (*before, o_proj, dropout("self_attn", p, ledger.ATTN_OUT_DROPOUT_MASK, Made(
        f"{p}/attn output", z.full(z.h), "o_proj's output dropped out"), f"grad/{p}/attn dropped",
        z.full(z.h), gone=(f"{p}/attn proj",), then=returns))


def embedding_dropout(z: Sizes, config: ModelConfig, tables: Step) -> tuple[Op, ...]:
    """Starcoder2Model's F.dropout on inputs_embeds (the lookup, "model/inputs_embeds", live until the model returns)
    with dropout > 0: its output, the first layer's input, and its bool mask; then the RoPE `tables` it makes after.
    Its backward makes the lookup's gradient from the first layer's input's (`first_grad`), read inside the first
    layer's self_attn, which transformers calls with keyword inputs: active to the end of backward."""
    if not (walks(config) and config.has_dropout):
        return ()
    op = dropout("model", "", ledger.EMBEDDING_DROPOUT_MASK, Made("layers.0/input", z.full(z.h), "inputs_embeds"
                                                                  " dropped out: the first layer's input"),
                 "grad/embedding output", z.full(z.h), frees=(gpt2.FIRST_GRAD,), then=tables)
    return (replace(op, shadow="model.layers.0.self_attn"),)


def first_grad(config: ModelConfig) -> str:
    """The first layer's input gradient: the embedding's output's, or its dropout's."""
    return gpt2.FIRST_GRAD if walks(config) and config.has_dropout else "grad/embedding output"
