"""megatron-core's own DistributedDataParallel (use_distributed_optimizer) around its GPTModel, on torch's fake group:
the buffers it lays out hold what --totals counts, to the element: every buffer's elements, padding included (the
weights and gradients every rank holds), and the most elements any rank's optimizer shard holds (its fp32 master
weights and Adam moments), at odd shapes where the padding is not zero."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.probe.libs.megatron_ddp import ddp_buffers, fullest  # noqa: E402
from memcalc.sizing.pipeline import pipeline_stages, stage_rank  # noqa: E402
from memcalc.sizing.states import group_params  # noqa: E402
from memcalc.sizing.totals import per_parameter_shards  # noqa: E402

from tests.helpers import make_config  # noqa: E402

# h 250, v 509 (padded to 512 a rank of t = 1): no parameter is a multiple of 64 elements but the embeddings
ODD = dict(impl="megatron", h=250, a=5, L=2, s=64, b=1, vocab_size=509, dp=3, distributed_optimizer=True)
LLAMA = dict(mlp="swiglu", norm="rmsnorm", num_query_groups=2, a=10, position_embedding_type="rope",
             add_bias_linear=False, tie_embeddings=False)
MOE = dict(LLAMA, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=90, attention="flash")
MLA = dict(LLAMA, num_query_groups=None, kv_lora_rank=24, q_lora_rank=18, qk_rope_head_dim=6, qk_nope_head_dim=12,
           v_head_dim=10)

SHAPES = {
    "gpt, learned positions, tied, dp 3": {},
    "llama-like at t 2, dp 3": LLAMA | {"t": 2},
    "qk layernorm, qkv bias, dp 5": LLAMA | {"qk_layernorm": True, "add_qkv_bias": True, "dp": 5, "L": 3},
    "fp32 weights, dp 7": {"dtype": "fp32", "dp": 7},
    "h 256: most parameters multiples of 64, fc1's not": {"h": 256, "a": 8, "ffn_hidden_size": 700},
    "one rank: buckets padded to 128": {"dp": 1},
    "cp 2 at dp 3: shards over dp*cp 6": {"cp": 2, "attention": "flash"},
    "latent attention at t 2": MLA | {"t": 2},
    "latent attention without a query latent, layernorm": MLA | {"q_lora_rank": None, "norm": "layernorm"},
    "experts: a buffer of their own": MOE,
    "biases at ep 2, dp 4: the router's too": MOE | {"add_bias_linear": True, "ep": 2, "dp": 4},
    "experts at ep 2, t 2, dp 6, shared experts, every other layer dense": MOE | {
        "ep": 2, "t": 2, "dp": 6, "moe_shared_expert_intermediate_size": 70, "moe_layer_freq": 2, "L": 4},
    "experts at ep 4 of dp 4 (one rank an expert data-parallel group), pp 2": MOE | {"ep": 4, "dp": 4, "pp": 2, "L": 4},
    "pp 2, tied: the embedding in a bucket of its own on each end": {"pp": 2, "L": 4},
    "pp 2, untied": LLAMA | {"pp": 2, "L": 4},
    "vpp 2: a buffer per model chunk": {"pp": 2, "vpp": 2, "L": 8, "num_microbatches": 4},
    # DeepSeek-V3's first dense layers on the first stages (Megatron-LM's --moe-layer-freq list): each stage's own
    "first dense layers over pp 4: rank 0 dense, rank 1 dense and MoE, no expert buffer on rank 0": MOE | {
        "pp": 4, "L": 8, "moe_first_dense_layers": 3, "ep": 2, "dp": 4},
    "a first dense layer at pp 3, shared experts, t 2": MOE | {"pp": 3, "L": 6, "moe_first_dense_layers": 1, "t": 2,
                                                              "moe_shared_expert_intermediate_size": 70},
    # Megatron's uneven split (num_layers_in_first/last_pipeline_stage, account_for_*_in_pipeline_split): each rank's
    "uneven over pp 4: 1 layer first, 3 last, 2 on each rank between": {
        "pp": 4, "L": 8, "num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3},
    "uneven under vpp 2: 2 layers first, 4 on the rank between and on the last": {
        "pp": 3, "vpp": 2, "L": 10, "num_layers_in_first_pipeline_stage": 2, "num_microbatches": 3},
    "the embedding and the loss counted as layers over pp 3: 2, 3 and 2 layers, untied": LLAMA | {
        "pp": 3, "L": 7, "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
    "first dense layers on an uneven split, ep 2: 3 layers first (2 dense), 2 on each other rank": MOE | {
        "pp": 4, "L": 9, "num_layers_in_first_pipeline_stage": 3, "moe_first_dense_layers": 2, "ep": 2, "dp": 4},
}


@pytest.mark.parametrize("changes", SHAPES.values(), ids=SHAPES.keys())
def test_the_distributed_optimizers_padded_buffers_are_megatrons_own(changes):
    config = make_config(ODD | changes)
    for stage in pipeline_stages(config):
        buffers = ddp_buffers(config, stage_rank(stage.name, config.pp))
        held = sum(group_params(config, stage, config.t).values())
        shard, whole = per_parameter_shards(config, config.t, held, stage)
        assert whole == sum(x.numel for x in buffers) > held
        assert shard == fullest(config, buffers, stage_rank(stage.name, config.pp))
