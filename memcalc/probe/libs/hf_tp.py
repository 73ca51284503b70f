"""transformers' own tensor parallelism, applied to what the probe builds (`--impl hf --strategy tp`).

transformers 5.24 lays a model over t ranks with DTensor (transformers/distributed/tensor_parallel.py): a plan
maps module names to registered styles, and `apply_tensor_parallelism(model, tp_mesh, tp_plan)` shards each
named parameter (`distribute_tensor` of this rank's block: a storage of its own) and wraps each named module's
forward. `from_pretrained(tp_plan="auto")` takes the plan from the model: the config class's
`base_model_tp_plan` (Llama: q, k, v, gate and up "colwise", o and down "rowwise"), the embedding "embedding_rowwise"
(added by `init_parallel_plans` when the plan is not empty) and the causal-LM class's `_tp_plan` (lm_head
"colwise_gather_output"); `_resolve_parallel_plans` expands its `*` into the model's layer numbers. Here the
same functions do the same: `layer_plan` for one decoder layer built alone (the base plan's `layers.*.` rules,
rooted at the layer), `model_plan` for a whole model; the mesh is one dimension over the probe's group (the
fake group's t ranks, or t real gloo ranks).

In training (grad enabled, plain nn.Linear) the styles run DTensor's ops, and the layer's residual stream stays a
plain tensor between them:
- "colwise" wraps its input as a Replicate DTensor without copying it (`DTensor.from_local`), so the three q/k/v
  projections, and gate and up, keep one shared whole (b, s, h) input, as the paper's TP keeps it; the weight is
  Shard(0) and the output, this rank's columns, is handed on as a local tensor (`use_local_output`). Backward:
  the input's Partial gradient is all-reduced (the paper's f), once per linear.
- "rowwise" wraps its input, this rank's columns, as Shard(-1); its Partial output is all-reduced (g) and handed
  on as a local tensor.
Attention, RoPE and SwiGLU between them run on plain local tensors of a/t heads, g/t K/V groups and f/t columns.

The MoE plans (Mixtral's, Qwen2-MoE's, Qwen3-MoE's) name the experts' 3-D weights as parameters (their styles
only shard them) and the experts module itself: "packed_colwise" keeps each rank's F_E/t rows of gate and of up
(`_StridedShard`, so the local (E, 2F_E/t, h) block still chunks into gate and up), "rowwise" the matching F_E/t
columns of down_proj, and "moe_tp_experts" runs the experts (grouped_mm or the eager loop) on those local blocks:
its input and routing weights pass through as they are (their gradients all-reduced in backward), its output is
all-reduced in forward.
No rule names the router, so every rank routes every token alike and each expert gathers the same tokens on every
rank; nor Qwen2-MoE's shared expert (mlp.shared_expert: the plan's mlp.gate_proj rules are a dense layer's), so
every rank runs it whole.
"""

from __future__ import annotations

from typing import Any

from memcalc.errors import ProbeError
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup

torch = require_torch()
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from transformers.distributed.configuration_utils import DistributedConfig  # noqa: E402
from transformers.distributed.mixin import DistributedMixin  # noqa: E402
from transformers.distributed.tensor_parallel import apply_tensor_parallelism  # noqa: E402

_LAYER_RULES = ("layers.*.", "h.*.")  # a base model's plan names each decoder layer's modules under one (GPT-J: h)


def mesh(tp: TensorParallelGroup) -> DeviceMesh:
    """The TP mesh: one dimension over the probe's group, on the rank's device."""
    return DeviceMesh.from_group(tp.group, tp.device.type, mesh_dim_names=("tp",))


def layer_plan(layer: Any, config_class: type) -> dict[str, str]:
    """The config class's `base_model_tp_plan`, its `layers.*.` rules rooted at one decoder layer, expanded over
    the layer's modules and parameters as `_resolve_parallel_plans` expands a model's (parameters, then module)."""
    base = config_class.base_model_tp_plan or {}
    rules = {name.split(".*.", 1)[1]: style for name, style in base.items() if name.startswith(_LAYER_RULES)}
    if not rules:
        raise ProbeError(f"transformers' {config_class.__name__} has no tensor-parallel plan for its layers")
    return DistributedMixin._expand_parallel_plan(layer, rules)


def model_plan(model: Any, t: int) -> dict[str, str]:
    """The whole model's plan as `from_pretrained(tp_plan="auto")` resolves it for tp_size t: the base plan, the
    embedding's "embedding_rowwise", the causal-LM head's `_tp_plan`, expanded over the layers."""
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=t, tp_plan="auto"))
    return tp_plan


def apply(module: Any, plan: dict[str, str], tp: TensorParallelGroup) -> Any:
    """`apply_tensor_parallelism` of the plan over the probe's group: each rank keeps its block of each weight."""
    return apply_tensor_parallelism(module, mesh(tp), plan)
