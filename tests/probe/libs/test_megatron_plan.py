"""memcalc's megatron TP plan (memcalc.model.impls.megatron.tp_plan) names every column- and row-parallel linear of
the layer spec megatron-core's decoder block gives the probe, with its class: dense, MoE with shared experts, and
latent attention with and without a query latent."""

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.impls import IMPLEMENTATIONS  # noqa: E402
from memcalc.model.tp_plan import Style  # noqa: E402
from memcalc.probe.libs import megatron as runner  # noqa: E402
from memcalc.probe.libs.megatron_shim import layer_spec  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402

GPT = {"b": 2, "s": 8, "h": 64, "a": 4, "t": 2, "L": 1, "add_bias_linear": False}
MLA = GPT | {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "norm": "rmsnorm"}
_CLASS = {Style.COLWISE: ColumnParallelLinear, Style.COLWISE_GATHER_OUTPUT: ColumnParallelLinear,
          Style.ROWWISE: RowParallelLinear}


def _linears(spec, prefix=""):
    """Every ColumnParallelLinear and RowParallelLinear under a spec, by dotted path."""
    found, submodules = {}, getattr(spec, "submodules", None)
    for field in dataclasses.fields(submodules) if dataclasses.is_dataclass(submodules) else ():
        child = getattr(submodules, field.name)
        module = child if isinstance(child, type) else getattr(child, "module", None)
        if module in (ColumnParallelLinear, RowParallelLinear):
            found[prefix + field.name] = module
        found |= _linears(child, f"{prefix}{field.name}.")
    return found


@pytest.mark.parametrize("fields", [
    GPT, GPT | {"num_experts": 4, "moe_shared_expert_intermediate_size": 32, "mlp": "swiglu"},
    MLA, MLA | {"q_lora_rank": 24},
], ids=["dense", "moe with shared experts", "latent attention", "latent attention with a query latent"])
def test_the_plan_names_each_parallel_linear_of_megatrons_layer_spec_with_its_class(fields):
    config = build_config(fields)
    rules = IMPLEMENTATIONS["megatron"].tp_plan(config).rules
    experts = tuple(f"{r.module}." for r in rules if r.style is Style.EXPERTS)  # each expert's own linears (etp = t)
    spec = layer_spec(runner.transformer_config(config, config.t, True), 0)
    # MLASelfAttention builds one of the two query paths its spec offers: q_proj, or q_down_proj and q_up_proj
    other_query = ("linear_q_proj",) if config.q_lora_rank else ("linear_q_down_proj", "linear_q_up_proj")
    unbuilt = {f"self_attention.{name}" for name in other_query} if config.mla else set()
    linears = {path: module for path, module in _linears(spec).items()
               if not path.startswith(experts) and path not in unbuilt}
    assert linears == {r.module: _CLASS[r.style] for r in rules if r.style in _CLASS}
