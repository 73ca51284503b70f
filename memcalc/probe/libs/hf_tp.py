"""transformers' own tensor parallelism, applied to what the probe builds (`--impl hf --strategy tp`).

How transformers lays a model over t ranks and what its styles keep: docs/probe.md, "Under tp: transformers' own
plan"; how the step's model is loaded (`loaded`, tied or not): "transformers' model under `--step`".
"""

from __future__ import annotations

from tempfile import TemporaryDirectory
from typing import Any

from memcalc.errors import ProbeError
from memcalc.probe import require_torch
from memcalc.probe.group import TensorParallelGroup
from memcalc.probe.libs.hf_shim import cuda_like_loading
from memcalc.probe.shims import patched

torch = require_torch()
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from transformers.distributed.configuration_utils import DistributedConfig  # noqa: E402
from transformers.distributed.mixin import DistributedMixin  # noqa: E402
from transformers.distributed.tensor_parallel import apply_tensor_parallelism  # noqa: E402
from transformers.utils import logging  # noqa: E402

_LAYER_RULES = ("layers.*.", "h.*.")  # a base model's plan names each decoder layer's modules under one (GPT-J: h)


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
    """`apply_tensor_parallelism` of the plan over a one-dimensional mesh of the probe's group: each rank keeps its
    block of each weight."""
    mesh = DeviceMesh.from_group(tp.group, tp.device.type, mesh_dim_names=("tp",))
    return apply_tensor_parallelism(module, mesh, plan)


def loaded(model: Any, dtype: Any, t: int) -> Any:
    """`model` saved, then loaded as `from_pretrained(distributed_config=DistributedConfig(tp_size=t))` loads a
    checkpoint for this rank: built untied on the meta device, laid out by `maybe_distribute_model` over the default
    group's mesh (the plan `model_plan` reads), then loaded and tied (a tied lm_head.weight becomes the embedding's
    Shard(0) DTensor), as on CUDA (`cuda_like_loading`); without the progress bars both print (disable_progress_bar's
    flag, put back after)."""
    with TemporaryDirectory() as checkpoint, cuda_like_loading(), patched(logging, _tqdm_active=False):
        model.save_pretrained(checkpoint)
        return type(model).from_pretrained(checkpoint, config=model.config, dtype=dtype,
                                           distributed_config=DistributedConfig(tp_size=t))
