"""torchtitan's and transformers' own layers issue, call by call and in order, the collectives the communication
ledger lists (memcalc.model.comm, derived from each implementation's TP plan): torchtitan's block gathers once at
each block's entry and its SelectiveAC and FullAC rerun every forward collective after the output's backward one;
transformers wraps each colwise linear's input on its own (an all-reduce each in backward), gathers the blocks its
plan gathers, and its checkpoint's rerun stops before the layer's last collective (after it, where a dropout or a norm
there keeps a tensor).

Each runs as rank 0 of torch's fake group, where a call is logged with the sizes it is given (DTensor's functional
collectives as aten ops): the log is exact though nothing moves.
"""

import pytest

pytest.importorskip("torch")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.comm import layer_collectives  # noqa: E402
from memcalc.model.evaluate import dim_sizes  # noqa: E402
from memcalc.model.knobs import DTYPE_BYTES  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.collectives import compare_collectives  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from tests.cli import memcalc_cli  # noqa: E402

TORCHTITAN = {"impl": "torchtitan", "b": 1, "s": 18, "h": 48, "a": 6, "num_query_groups": 2, "ffn_hidden_size": 80,
              "mlp": "swiglu", "norm": "rmsnorm", "position_embedding_type": "rope", "add_bias_linear": False,
              "tie_embeddings": False, "dropout": 0.0, "L": 1, "vocab_size": 128}
HF = {"impl": "hf", "b": 1, "s": 9, "h": 64, "a": 8, "ffn_hidden_size": 40, "mlp": "swiglu", "norm": "rmsnorm",
      "dropout": 0.0}
FAMILIES = {  # each family's layer (memcalc.model.families) with its knobs, and its plan's shape
    "llama, grouped-query: an f for each of q, k, v, gate and up": {"num_query_groups": 4},
    "qwen3, heads of kv_channels": {"family": "qwen3", "kv_channels": 16, "qk_layernorm": True, "num_query_groups": 4},
    "phi3: both blocks gathered, fused qkv and gate_up": {"family": "phi3", "fused_qkv": True, "attention": "eager"},
    "olmo2: attention gathered, q, k, v each": {"family": "olmo2", "norm": "rmsnorm_fp32w", "post_norm": True,
                                                "qk_layernorm": True, "num_query_groups": 4},
    "glm: the mlp gathered": {"family": "glm", "rotary_percent": 0.5, "kv_channels": 16, "num_query_groups": 4},
    "gemma3_text: q_norm and k_norm after v_proj, their all-reduces before its f": {
        "family": "gemma3_text", "norm": "rmsnorm_1p", "mlp": "geglu_tanh", "sandwich_norm": True, "qk_layernorm": True,
        "attention": "eager", "num_query_groups": 4},
}


def _logged(tp, config, strategy):
    import importlib

    calls = []
    importlib.import_module(f"memcalc.probe.libs.{config.impl}").run_layer(tp, config, STRATEGIES[strategy],
                                                                           collectives=calls)
    return tuple(calls)


def _routed(tp, config, strategy):
    import importlib

    calls = []
    importlib.import_module(f"memcalc.probe.libs.{config.impl}").run_layer(
        tp, config, STRATEGIES[strategy], route="balanced" if config.moe else None, collectives=calls)
    return tuple(calls)


def _rows(config, strategy):
    """Rank 0's collectives against the ledger's, in order (experts routed balanced)."""
    calls = run(_routed, (config, strategy), mode="fake", t=config.t, backend="gloo", timeout_s=240)[0]
    predicted = layer_collectives(config, STRATEGIES[strategy], t=config.t, ep=config.ep)
    return compare_collectives(predicted, dim_sizes(config), config.t, DTYPE_BYTES[config.dtype], calls, config.ep)


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "h": 64, "a": 4, "num_query_groups": 2}
SHARED = MOE | {"moe_shared_expert_intermediate_size": 32}
# DeepSeek-V3's latent attention (DeepSeekV3TransformerBlock's own): heads of d_n + d_r = 8 + 4, values of d_v = 12
LATENT = {"num_query_groups": None, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}
Q_LATENT = LATENT | {"q_lora_rank": 16}


@pytest.mark.parametrize("recompute", ["none", "op", "full"])
@pytest.mark.parametrize("strategy", ["tp", "tp-sp"])
@pytest.mark.parametrize("block", [{}, MOE, SHARED, SHARED | Q_LATENT],
                         ids=["dense", "experts", "shared experts too", "deepseek-v3: latent attention, experts"])
def test_torchtitans_block_issues_the_ledgers_collectives_in_order(block, strategy, recompute):
    """Its MoE at ep = 1 enters like a dense block; the experts' and the shared experts' outputs leave summed under
    tp, each through its own reduce-scatter under tp-sp, and then the rerun starts after the first one's gather."""
    pytest.importorskip("torchtitan")
    config = build_config(TORCHTITAN | block | {"t": 2, "recompute": recompute})
    rows = _rows(config, strategy)
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]


LATENT_LAYOUTS = {  # s odd where the layout lets it (SP splits s by t)
    "tp t=2, b=2, s=5": ("tp", {"t": 2, "b": 2, "s": 5}),
    "tp t=4, b=1, s=9": ("tp", {"t": 4, "b": 1, "s": 9}),
    "tp-sp t=2, b=1, s=12": ("tp-sp", {"t": 2, "b": 1, "s": 12}),
    "tp-sp t=4, b=2, s=12": ("tp-sp", {"t": 4, "b": 2, "s": 12}),
}


@pytest.mark.parametrize("strategy, layout", LATENT_LAYOUTS.values(), ids=LATENT_LAYOUTS.keys())
@pytest.mark.parametrize("query", [LATENT, Q_LATENT], ids=["no query latent", "a query latent"])
def test_torchtitans_latent_attention_enters_once_at_x_and_leaves_at_wo(query, strategy, layout):
    """DeepSeek-V3's Attention under its plan: x gathered at its entry (one f or g), kept by wq (or wq_b) and wkv_b;
    wq_a, wkv_a and the latents' norms replicated, issuing nothing; wo leaves through f* or g*."""
    pytest.importorskip("torchtitan")
    config = build_config(TORCHTITAN | query | layout | {"a": 8, "recompute": "none"})
    rows = _rows(config, strategy)
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]
    assert [r.name for r in rows if r.name.startswith("attention")] == ["attention/f*", "attention/f"] \
        if strategy == "tp" else ["attention/g", "attention/g*", "attention/g*", "attention/g"]


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("family", FAMILIES.values(), ids=FAMILIES.keys())
def test_transformers_layers_issue_the_ledgers_collectives_in_order(family, t, recompute):
    pytest.importorskip("transformers")
    rows = _rows(build_config(HF | family | {"t": t, "recompute": recompute}), "tp")
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]


RESID_DROPOUT = {  # families whose MLP's output is dropped out after its exit (resid_dropout)
    "phi3: resid_mlp_dropout": {"family": "phi3", "fused_qkv": True, "attention": "eager", "num_query_groups": 4},
    "starcoder2: the MLP's residual_dropout": {"family": "starcoder2", "norm": "layernorm", "mlp": "gelu",
                                               "rotary_percent": 1.0, "num_query_groups": 4},
    "gptj: the MLP's dropout": {"family": "gptj", "norm": "layernorm", "mlp": "gelu_tanh", "rotary_percent": 0.5,
                                "parallel_residual": True, "single_norm": True},
}


@pytest.mark.parametrize("family", RESID_DROPOUT.values(), ids=RESID_DROPOUT.keys())
def test_a_dropout_after_the_layers_exit_keeps_the_checkpoints_rerun_going_through_it(family):
    """The mask of a dropout on the MLP's output is the layer's last saved tensor: under gradient checkpointing the
    rerun stops there, after the MLP's all-reduce (found at b = 1, s = 5, dropout 0.1: Phi-3's rerun issued one more
    h-wide all-reduce than the ledger, every backward collective after it one place late)."""
    pytest.importorskip("transformers")
    rows = _rows(build_config(HF | family | {"t": 2, "b": 1, "s": 5, "recompute": "full", "dropout": 0.1}), "tp")
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]


def test_measure_comm_lists_transformers_own_collectives_beside_the_ledgers():
    pytest.importorskip("transformers")
    run = memcalc_cli("measure", "--config", "tiny", "--impl", "hf", "--strategy", "tp", "--launch", "fake", "--comm")
    assert run.code == 0, run.err
    rows = [line for line in run.out.splitlines() if "all-reduce backward" in line]
    assert len(rows) == 5 and all(line.count("all-reduce backward") == 2 for line in rows)  # ledger's, issued
    assert "transformers' own layer" in run.out and "match: every tensor agrees to the byte" in run.out


HF_MOE = {"num_query_groups": 4, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "a": 4}
HF_EXPERTS = {
    "mixtral: fp32 routing weights": {"family": "mixtral"},
    "mixtral's eager loop, top-3 of 8, b=2": {"family": "mixtral", "experts_implementation": "eager", "num_experts": 8,
                                                "moe_router_topk": 3, "b": 2, "s": 7},
    "qwen2-moe: weights in the activation dtype, a shared expert after the experts":
        {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 24},
    "qwen3-moe, qk norms, multi-head": {"family": "qwen3_moe", "qk_layernorm": True, "num_query_groups": None},
}


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("family", HF_EXPERTS.values(), ids=HF_EXPERTS.keys())
def test_transformers_experts_issue_the_ledgers_collectives_in_order(family, t, recompute):
    """moe_tp_experts: the experts' output all-reduced in forward, their inputs' gradients (the routing weights', then
    the hidden states') in backward; under checkpointing the rerun stops before the experts' all-reduce unless
    Qwen2-MoE's shared expert runs after it."""
    pytest.importorskip("transformers")
    config = build_config(HF | HF_MOE | family | {"t": t, "recompute": recompute})
    rows = _rows(config, "tp")
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]
    assert any(r.name == "moe/f*" for r in rows)


def test_transformers_expert_parallel_plan_is_refused_naming_ep():
    config = build_config(HF | HF_MOE | {"family": "mixtral", "t": 2, "ep": 2})
    with pytest.raises(ConfigError, match="^impl hf: ep=2: transformers' expert-parallel plan"):
        layer_collectives(config, STRATEGIES["tp"], ep=2)


@pytest.mark.parametrize("recompute", ["none", "op", "full"])
@pytest.mark.parametrize("block", [MOE, SHARED, SHARED | LATENT],
                         ids=["experts", "shared experts too", "deepseek-v3: after latent attention"])
@pytest.mark.parametrize("t", [2, 4])
def test_torchtitans_moe_at_ep_t_exchanges_each_ranks_own_slots_in_order(t, block, recompute):
    """ep = t under tp-sp: each rank routes its own sequence shard, the counts and the slots exchanged over ep by
    spmd_types' all_to_all; the shared experts enter and leave through their own g and g*."""
    pytest.importorskip("torchtitan")
    config = build_config(TORCHTITAN | block | {"t": t, "ep": t, "s": 16, "num_experts": 4, "num_query_groups": 4,
                                                "recompute": recompute})
    rows = _rows(config, "tp-sp")
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]
    assert [r.name for r in rows if r.name.startswith("moe/")][:3] == ["moe/counts", "moe/dispatch", "moe/combine"]


@pytest.mark.parametrize("recompute", ["none", "op", "full"])
@pytest.mark.parametrize("layout", [{"ep": 2, "dp_shard": 2}, {"ep": 2, "dp_shard": 4},
                                    {"ep": 4, "dp_shard": 4, "num_experts": 8}], ids=str)
@pytest.mark.parametrize("block", [MOE, SHARED, SHARED | LATENT],
                         ids=["experts", "shared experts too", "deepseek-v3: after latent attention"])
def test_torchtitans_moe_with_ep_over_the_fsdp2_ranks_exchanges_each_ranks_own_tokens_in_order(block, layout,
                                                                                              recompute):
    """t = 1, the ep ranks dp_shard's (its efsdp mesh): each rank's b*s tokens' counts and slots exchanged over ep by
    spmd_types' all_to_all and returned, each reversed in backward (under checkpointing rerun first: SelectiveAC
    caches no collective of spmd_types); nothing else (the shared experts run whole)."""
    pytest.importorskip("torchtitan")
    config = build_config(TORCHTITAN | block | layout | {"t": 1, "s": 16, "num_query_groups": 4,
                                                         "recompute": recompute})
    rows = _rows(config, "none")
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]
    assert {r.name for r in rows} == {"moe/counts", "moe/dispatch", "moe/combine"}


def test_torchtitans_moe_at_ep_under_tp_without_sp_is_refused_naming_the_layout():
    config = build_config(TORCHTITAN | MOE | {"t": 2, "ep": 2, "s": 16})
    with pytest.raises(ConfigError, match="^impl torchtitan: ep=2 under tp: its MoE slices the replicated input"):
        layer_collectives(config, STRATEGIES["tp"], ep=2)
