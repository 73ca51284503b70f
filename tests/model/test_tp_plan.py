"""Each implementation's TP plan (memcalc.model.tp_plan) is the library's own, and what it implies follows from it:
the tensors a layout keeps whole, and each column/row-parallel pair's collectives."""

import pytest

from memcalc.config.hf import read_hf_config
from memcalc.config.schema import build_config
from memcalc.model import ledger
from memcalc.model.comm import layer_collectives
from memcalc.model.families import FAMILIES
from memcalc.model.impls import IMPLEMENTATIONS, plan as layout
from memcalc.model.strategy import TP, TP_SP
from memcalc.model.tp_plan import ATTENTION, MLP, SHARED, Style

GPT = dict(b=2, s=64, h=128, a=8, t=4, L=2)
LLAMA = GPT | {"norm": "rmsnorm", "mlp": "swiglu", "dropout": 0.0}
_STYLES = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce"}
SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}


def _plan(fields):
    config = build_config(fields)
    return IMPLEMENTATIONS[config.impl].tp_plan(config)


@pytest.mark.parametrize("family, extra", [
    ("llama", {}), ("qwen3", {}), ("gemma", {}), ("olmo", {}), ("cohere", {}), ("starcoder2", {}), ("glm", {}),
    ("glm4", {}), ("olmo2", {}), ("phi3", {}), ("gptj", {"rotary_dim": 4}), ("mixtral", {}), ("qwen2_moe", {}),
    ("qwen3_moe", {}),
])
def test_transformers_plan_names_the_linears_its_config_classs_base_model_tp_plan_does(family, extra, tmp_path):
    """Every colwise and rowwise rule of the family's decoder layer (and a norm replicated in a pair), by module and style; in a sparse layer the dense
    MLP's rules (Qwen2MoeMLP's) and the experts' (packed_colwise, moe_tp_experts) are not its pairs."""
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, FAMILIES[family].config_class)
    config_class(**SMALL, **extra).save_pretrained(tmp_path)
    config = build_config({**read_hf_config(tmp_path / "config.json").fields, "s": 8, "impl": "hf",
                           "attention": "eager", "t": 2})
    mine = {r.module: r.style.value for r in IMPLEMENTATIONS["hf"].tp_plan(config).rules if r.pair is not None}
    theirs = {name.split(".", 2)[2]: style for name, style in config_class.base_model_tp_plan.items()
              if style in _STYLES and ".experts" not in name and not (config.moe and ".mlp." in name)}
    assert mine == theirs


def test_torchtitans_colwise_linears_keep_the_inputs_they_gathered_so_sequence_parallelism_gathers_nothing_again():
    plan = _plan(LLAMA | {"impl": "torchtitan"})
    # wo's and w2's outputs, where SelectiveAC saves them, are partial sums before the reduce-scatter
    assert plan.kept_whole() == {"attention/qkv_in", "attention/wo_out", "mlp/fc1_in", "mlp/fc2_out"}
    assert not plan.unsharded()
    assert plan.pairs() == {ATTENTION: Style.COLWISE_KEEPS_INPUT, MLP: Style.COLWISE_KEEPS_INPUT}
    collectives = layer_collectives(build_config(LLAMA | {"impl": "torchtitan"}), TP_SP)
    assert not [c for c in collectives if c.moves.endswith("again")]


def test_megatrons_colwise_linears_keep_a_sequence_shard_so_each_pair_gathers_its_input_again():
    plan = _plan(GPT)
    assert not plan.kept_whole() and plan.pairs() == {ATTENTION: Style.COLWISE, MLP: Style.COLWISE}
    again = [c.name for c in layer_collectives(build_config(GPT), TP_SP) if c.moves.endswith("again")]
    assert again == ["mlp/g", "attention/g"]  # backward meets the MLP first


def test_a_pairs_entry_and_exit_are_the_operators_named_for_its_block():
    names = [c.name for c in layer_collectives(build_config(GPT), TP)]
    assert names == ["attention/f*", "mlp/f*", "mlp/f", "attention/f"]


def test_megatrons_shared_experts_are_a_pair_of_their_own_beside_the_experts():
    moe = GPT | {"num_experts": 4, "moe_shared_expert_intermediate_size": 64, "add_bias_linear": False}
    plan = _plan(moe)
    assert list(plan.pairs()) == [ATTENTION, SHARED] and plan.rules[-1].style is Style.EXPERTS
    assert {c.name.split("/")[0] for c in layer_collectives(build_config(moe), TP_SP)} >= {"attention", "shared"}


def test_a_block_transformers_plan_gathers_is_whole_on_every_rank_but_the_rowwise_linears_input():
    """OLMo 2's attention ("colwise_gather_output" q, k, v; "rowwise_split_input" o_proj): tp splits only o_proj's
    input there, and nothing of it under SP, which transformers does not run."""
    olmo2 = LLAMA | {"impl": "hf", "family": "olmo2", "post_norm": True, "qk_layernorm": True,
                     "norm": "rmsnorm_fp32w", "attention": "eager"}
    plan = _plan(olmo2)
    assert {ledger.Q.name, ledger.K.name, ledger.V.name} <= plan.unsharded()
    assert ledger.PROJ_IN.name not in plan.unsharded() and not plan.kept_whole()
    tp = layout(build_config(olmo2), TP)
    assert tp.split_dim(ledger.Q) is None and tp.split_dim(ledger.PROJ_IN) is not None
