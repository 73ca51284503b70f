"""One training step on one rank, over time: what is live at each moment, and the peak.

`memcalc.sizing.totals` adds model states and the activations a stage keeps; a run goes
out of memory at its peak, a moment when short-lived tensors sit on top of those. This
module walks one step of one micro-batch (pp = 1) the way autograd runs it, tensor by
tensor, and records what is live at every moment where memory can peak:

    steady state        bf16 weights, the fp32 gradient buffer, master weights, Adam's m and v
    forward             the batch; each block's saved tensors (the ledger's) as it finishes
    loss                the bf16 logits, their fp32 copy and the per-token vectors of the
                        vocabulary-parallel cross-entropy, all at once
    backward            block by block, in reverse: each op's new gradients on top of what is
                        still saved; an op's saved tensors and its incoming gradient are freed
                        when it returns; a weight's bf16 gradient is added into the fp32
                        buffer as soon as autograd finishes it
    optimizer step      fused AdamW updates in place: nothing new

The saved tensors are the ledger's (`memcalc.model.evaluate.estimate`, and `END_TENSORS`
at the model's ends), so the per-layer terms follow every implementation rule there.
What the ledger does not hold is named here with its reason: the gradients each op
makes in backward, the loss's working set, and four small tensors the model's ends keep
(`STEP_TENSORS`).

Categories are MemTracker's (`memcalc.probe.step`): a tensor made in forward is an
activation until freed, one made in backward a temporary, a weight's bf16 gradient a
temporary until autograd hands it to the parameter (a moment later it is added into the
buffer and dropped), the fp32 buffer a gradient, master weights and Adam's moments
optimizer states.

Exact for the probe's own model (`memcalc measure --step`): one rank of Megatron's GPT
(tied embeddings, learned positions) with Megatron's vocabulary-parallel cross-entropy and
mixed-precision optimizer, without gradient-accumulation fusion, which on CUDA writes
each fp32 weight gradient straight into the buffer (no bf16 weight gradient at all). A
real run differs further in what an allocator adds: CUDA's caching allocator rounds each
block up to 512 bytes (2 MiB segments for large ones) and fragments; cuBLAS keeps a
workspace per stream; NCCL keeps its buffers. None of those is a tensor, and none is here.

Modelled so far: pp = 1 and cp = 1 (none, tp, tp-sp at any t), the Megatron
implementation's layer with GELU or SwiGLU (fused or not), eager attention with a K/V
group per head or grouped-query (Megatron's fused softmax, or its fp32 torch softmax
outside the kernel's sizes), LayerNorm or RMSNorm, no recomputation, dropout and biases
on or off, tied or untied embeddings, learned positions or RoPE, bf16 or fp16. A fused
kernel's backward (the norms', the fused SwiGLU's) allocates its outputs alone, as on a
GPU; the probe runs them as one op each for that reason (memcalc.probe.kernels).
Everything else raises ConfigError naming what is missing. Within a layer's forward only the end of
each block is a moment: a forward op's transients are smaller than the gradients the same
op makes in backward, when the same saved tensors are live.
"""

from __future__ import annotations

from dataclasses import replace

from memcalc.config.schema import ModelConfig
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import Strategy
from memcalc.sizing.timeline.ends import STEP_TENSORS, Ends, model_states
from memcalc.sizing.timeline.layer import LAYER_NAMES, layer_backward, layer_forward
from memcalc.sizing.timeline.tape import (
    ACTIVATIONS, CATEGORIES, GRADIENTS, OPTIMIZER, PARAMETERS, TEMPORARIES, Live, Moment, Sizes, Tape, Timeline,
)

__all__ = [
    "ACTIVATIONS", "CATEGORIES", "GRADIENTS", "OPTIMIZER", "PARAMETERS", "STEP_TENSORS", "TEMPORARIES", "Live",
    "Moment", "Timeline", "timeline",
]


def timeline(config: ModelConfig, strategy: Strategy, accounting: Accounting = Accounting(exact=True)) -> Timeline:
    """The moments of one training step of `config` under `strategy`, on one rank of the only stage."""
    accounting = replace(accounting, exact=True)  # a timeline counts every byte
    layer = estimate(config, strategy, accounting)
    _check_modelled(config, strategy, tuple(x.tensor.name for x in layer.tensors))
    z = Sizes.of(config, strategy)
    tape = Tape()
    model_states(tape, config, strategy, z)
    tape.mark("steady", "", "model states between steps")
    ends = Ends(config, strategy, accounting, z)
    ends.forward_embedding(tape)
    saved = {x.tensor.name: x.bytes for x in layer.tensors}
    for i in range(config.L):
        layer_forward(tape, i, saved, z)
    ends.forward_output_and_loss(tape, config.L)
    ends.backward_loss_and_output(tape, config.L)
    for i in reversed(range(config.L)):
        layer_backward(tape, i, saved, z, config)
    ends.backward_embedding(tape)
    tape.mark("optimizer", "", "fused AdamW on the fp32 master weights, in place")
    return Timeline(layer.strategy, tuple(tape.moments))


def _check_modelled(config: ModelConfig, strategy: Strategy, names: tuple[str, ...]) -> None:
    """ConfigError naming the first thing this timeline does not model yet."""
    missing = [
        (config.impl != "megatron", f"impl {config.impl} (the timeline follows Megatron's layer)"),
        (config.pp != 1, f"pp={config.pp} (one micro-batch on the only stage)"),
        (config.cp != 1, f"cp={config.cp}"),
        (config.recompute != "none", f"recompute {config.recompute}"),
        (config.attention != "eager", f"attention {config.attention}"),
        (config.dtype == "fp32", "dtype fp32 (Megatron trains fp32 without master weights)"),
    ]
    unknown = [n for n in names if n not in LAYER_NAMES]
    if unknown:
        missing.append((True, f"a layer that keeps {', '.join(unknown)}"))
    for absent, what in missing:
        if absent:
            raise ConfigError(f"the step timeline does not model {what} yet")
