"""DeepSpeed ZeRO's step on transformers' Llama (memcalc.sizing.timeline.zero), modelled from DeepSpeed 0.19.8's
sources (measured where deepspeed runs: tests/probe/libs/test_hf_zero_step.py): its steady state is the state layout's,
its optimizer step holds DeepSpeed's own estimate (estimate_zero2_model_states_mem_needs) beside the flattened copy
its step() makes, stage 3 gathers modules and stage 2 reduces in buckets of reduce_bucket_size."""


import pytest

from memcalc.config.hf import read_hf_config
from memcalc.config.schema import build_config, load_config
from memcalc.errors import ConfigError
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.pipeline import pipeline_stages
from memcalc.sizing.states import total_params
from memcalc.sizing.totals import no_decay_params, per_gpu
from memcalc.sizing.timeline import OPTIMIZER, PARAMETERS, timeline
from memcalc.sizing.timeline.zero import BUCKET, DEEPSPEED_AUTO, GATHERED, GRAD_NORM, PARTITION, Zero

LLAMA = dict(impl="hf", b=1, s=128, h=256, a=8, L=2, vocab_size=512, mlp="swiglu", ffn_hidden_size=704,
             norm="rmsnorm", num_query_groups=4, position_embedding_type="rope", add_bias_linear=False, dropout=0.0,
             tie_embeddings=False, attention="flash", dp=8)


def _walk(stage, **changes):
    config = build_config(LLAMA | {"zero_stage": stage} | changes)
    return config, timeline(config, STRATEGIES["none"])


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("changes", [{}, {"dp": 3}, {"dp": 5, "h": 250, "a": 5, "num_query_groups": 5},
                                     {"dp": 6, "vocab_size": 509, "ffn_hidden_size": 701}])
def test_between_steps_the_walk_holds_the_totals_weights_master_and_moments(stage, changes):
    """--totals' model states are the walk's between steps, padding included: at stages 1 and 2 each of the
    Trainer's two groups' flat buffer padded to a multiple of 2*dp elements (at dp = 3 the totals had 12 B of weights
    and 8 B of each fp32 state too few), at stage 3 each parameter to a multiple of dp, the persistent ones whole too
    (the totals split one sum: at dp = 3, 40 B of each fp32 state and 2,580 B of weights too few)."""
    config, walk = _walk(stage, **changes)
    live = {x.name: x.bytes for x in walk.steady.live}
    totals = {x.name: x.bytes for x in per_gpu(config, STRATEGIES["none"]).worst().terms}
    for name in ("states/weights", "states/master_weights", "states/adam_m", "states/adam_v"):
        assert live[name] == totals[name]


def test_zero2s_optimizer_step_holds_deepspeeds_estimate_beside_its_flattened_copy():
    """estimate_zero2_model_states_mem_needs: 2P + 18P/dp, of which 4P/dp the fp32 gradient partition; step() makes it
    group by group, each freed after its group's AdamW step (stage_1_and_2.py), and flattens each group's bf16
    partition before casting it: at the first group's cast, the estimate but the later groups' fp32 partitions, beside
    that group's flat copy. AdamW keeps a 0-d step per parameter group, the gradient norm two 0-d tensors, and
    grads_in_partition holds whole each gradient reaching into the partition (the estimator: 2P/dp)."""
    deepspeed = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    config, walk = _walk(2)
    params, zero = total_params(config), Zero(config)
    assert params % 8 == 0
    first = next(m for m in walk.moments if m.phase == "optimizer" and "fp32 gradient partition of group 0" in m.what)
    live = {x.name: x.bytes for x in first.live}
    _, estimate = deepspeed.estimate_zero2_model_states_mem_needs(params, 8, 1, cpu_offload=False)
    states = sum(n for name, n in live.items() if name.startswith(("states/", "zero/", "optimizer/"))
                 and not name.startswith("states/rotary_emb."))  # LlamaRotaryEmbedding's buffers: no parameters
    reaching = live[PARTITION] - 2 * params // 8
    assert reaching > 0, "a weight straddles the partition's end: it is held whole"
    later = 4 * sum(zero.partition(group) for group in zero.groups[1:])
    assert states == estimate - later + live["zero/flat grad partition"] + live["optimizer/step"] + live[GRAD_NORM] \
        + reaching


def test_zero2_reduces_a_bucket_of_reduce_bucket_size_before_it_overflows():
    """grads_in_partition is allocated at the first reduction of a gradient reaching into rank 0's partition:
    backward reduces the last layers' gradients, other ranks' partitions, first."""
    config, walk = _walk(2)
    reductions = [m for m in walk.moments if "reduce bucket reduced before" in m.what]
    assert reductions, "h^2 elements hold two of a layer's weights: some bucket fills up"
    held = [PARTITION in {x.name for x in m.live} for m in reductions]
    assert not held[0] and held[-1] and held == sorted(held), held
    for m in reductions:
        live = {x.name: x.bytes for x in m.live}
        assert live[BUCKET] == 2 * DEEPSPEED_AUTO["reduce_bucket_size"](config.h)
        assert live.get(PARTITION, 2 * Zero(config).in_partition) == 2 * Zero(config).in_partition


def test_zero2_keeps_a_gradient_wider_than_the_bucket_in_its_grad_until_the_next_reduction():
    """DeepSpeed puts a gradient wider than reduce_bucket_size alone in the bucket, uncopied, and reduces it when the
    next gradient arrives (stage_1_and_2.py: extra_large_param_to_reduce), that gradient (the final norm's) live too,
    not yet copied in."""
    config, walk = _walk(2)
    wide = "grad/lm_head"  # (v, h): wider than h^2 elements
    holding = [m for m in walk.moments if wide in {x.name for x in m.live}]
    assert holding and holding[-1].what == "the reduce bucket reduced before model.norm's gradient would overflow it"
    live = {x.name: x.bytes for x in holding[-1].live}
    assert (live[wide], live["grad/model.norm"]) == (2 * config.vocab_size * config.h, 2 * config.h)


def test_stages_1_and_2_pad_each_groups_flat_buffer_to_a_multiple_of_2dp_elements():
    """stage_1_and_2.py aligns each group's flat bf16 buffer to nccl_start_alignment_factor (2) * dp elements: at
    dp = 3 the norms' 1,280 elements are 1,284 (a partition of 428, not 427), the weights' 1,736,704 are 1,736,706;
    every rank holds the padded buffers whole."""
    config, walk = _walk(2, dp=3)
    zero = Zero(config)
    weights, norms = zero.groups
    assert (sum(weights), sum(norms)) == (1_736_704, 1_280)
    assert (zero.partition(weights), zero.partition(norms)) == (578_902, 428)
    assert {x.name: x.bytes for x in walk.steady.live}["states/weights"] == 2 * (1_736_706 + 1_284)


def test_zero1_allocates_the_reduce_bucket_at_backwards_first_gradient():
    """setup_buckets, at every stage: the bucket lives from lm_head's gradient to the end of backward."""
    config, walk = _walk(1)
    (gemms,) = [m for m in walk.moments if m.where == "model.norm" and m.phase == "backward"][:1]
    assert {x.name: x.bytes for x in gemms.live}[BUCKET] == 2 * DEEPSPEED_AUTO["reduce_bucket_size"](config.h)


def test_in_fp32_deepspeeds_flattened_gradient_partition_is_the_fp32_one():
    """step(): flat_grad_partition.to(fp32) returns the fp32 flat tensor itself; in bf16 a copy beside it."""
    for dtype, names in (("fp32", {"zero/fp32 grad partition 0"}),
                         ("bf16", {"zero/fp32 grad partition 0", "zero/flat grad partition"})):
        _, walk = _walk(2, dtype=dtype)
        cast = next(m for m in walk.moments if "fp32 gradient partition of group 0" in m.what)
        assert {x.name for x in cast.live if x.name.startswith(("zero/fp32", "zero/flat"))} == names


def test_each_groups_fp32_gradient_partition_goes_before_the_next_groups_is_made():
    """step() frees a group's fp32 gradient after its AdamW step; in fp32, with no flat copy to free first,
    unscale_and_clip_grads' four 0-d fp32 factors lie on the first group's (at small sizes the step's peak)."""
    _, walk = _walk(2, dtype="fp32")
    cast = next(m for m in walk.moments if "fp32 gradient partition of group 1" in m.what)
    assert "zero/fp32 grad partition 0" not in {x.name for x in cast.live}
    first, clipped = [m for m in walk.moments if "group 0" in m.what and "float64" not in m.what][:2]
    assert clipped.bytes - first.bytes == 4 * 4


def test_grads_in_partition_holds_each_weight_reaching_into_the_partition_whole():
    """Two layers of 8 KiB weights, the norms apart: rank 0's partition of the weights' group ends inside one."""
    config = build_config(LLAMA | {"zero_stage": 2})
    zero = Zero(config)
    weights, norms = zero.groups
    assert zero.in_partition > zero.partition(weights) + zero.partition(norms)


def test_zero3_partitions_the_weights_and_gathers_each_block_in_turn():
    """Every parameter keeps its partition (ds_tensor), those under stage3_param_persistence_threshold (10h: the
    norms) gathered whole beside it."""
    config, walk = _walk(3)
    params = total_params(config)
    norms = (2 * config.L + 1) * config.h
    assert walk.steady.by_category()[PARAMETERS] == 2 * (params // 8 + norms) + 4 * config.h // config.a
    gathered = {x.name for m in walk.moments for x in m.live if x.name.startswith(GATHERED)}
    assert gathered == {f"{GATHERED} {b}" for b in ("root", "layers.0", "layers.1")}
    assert walk.peak.by_category()[OPTIMIZER] == 12 * params // 8 + 8


def test_zero3_under_a_vocabulary_of_fewer_than_ten_rows_gathers_no_module_of_the_root():
    """The embedding and the output layer under stage3_param_persistence_threshold (10h) stay whole, so the root has
    no partitioned module to gather: only the prefetch bucket (a hostile draw found it: a ValueError, estimate
    --totals' exit 70)."""
    config, walk = _walk(3, vocab_size=6)
    roots = {x.bytes for m in walk.moments for x in m.live if x.name == f"{GATHERED} root"}
    assert roots == {2 * DEEPSPEED_AUTO["stage3_prefetch_bucket_size"](config.h)}


def _first_reduction_keeps(stage, **changes):
    """The bytes of stage 1's whole gradients at the reduction that allocates grads_in_partition."""
    config, walk = _walk(stage, **changes)
    first = next(m for m in walk.moments if PARTITION in {x.name for x in m.live})
    return config, sum(x.bytes for x in first.live if x.name.startswith("zero/grad "))


def test_zero1_keeps_every_bf16_gradient_to_the_end_of_backward():
    """The embedding, wider than the bucket, stays in its .grad to the first reduction: every gradient whole there."""
    config, kept = _first_reduction_keeps(1)
    assert kept == 2 * total_params(config)


def test_zero1_copies_a_gradient_narrower_than_the_bucket_into_it_before_the_first_reduction():
    """reduce_gradients puts every gradient through the bucket in bit16_groups' order: the embedding's (64 x 256, a
    quarter of the bucket) is copied in and its own storage freed before q_proj's overflows it."""
    config, kept = _first_reduction_keeps(1, vocab_size=64)
    assert kept == 2 * (total_params(config) - 64 * config.h)


@pytest.mark.parametrize("changes,needle", [
    ({"zero_stage": 0}, "zero_stage=0"),
    ({"zero_stage": 2, "t": 2, "dp": 4}, "under tp"),
    ({"zero_stage": 1, "dtype": "fp16"}, "dtype fp16 with zero_stage=1"),  # was walked as if bf16
])
def test_what_the_zero_walk_leaves_out_is_refused_by_name(changes, needle):
    config = build_config(LLAMA | changes)
    with pytest.raises(ConfigError, match=needle):
        timeline(config, STRATEGIES["tp" if config.t > 1 else "none"])


def test_zero3_keeps_a_parameter_of_exactly_the_persistence_threshold_whole():
    """mark_persistent_parameters keeps whole each parameter of stage3_param_persistence_threshold (10h) elements or
    fewer: k_proj and v_proj of one group of 10 channels are (10, h), kept whole beside their partitions and never
    gathered (the walk had their partitions alone: 20,480 B of weights too few at h = 256, L = 2)."""
    config, walk = _walk(3, num_query_groups=1, kv_channels=10)
    params = total_params(config)
    whole = (2 * config.L + 1) * config.h + 2 * config.L * 10 * config.h  # the norms, k_proj and v_proj
    assert walk.steady.by_category()[PARAMETERS] == 2 * (params // 8 + whole) + 4 * config.head_dim  # RoPE's buffers


def test_zero2s_gradient_norm_casts_each_gradient_of_the_partition_to_float64_and_one_gradient_flattens_to_a_view():
    """get_grad_norm_direct casts rank 0's part of each gradient in its partition to float64 (get_norm_dtype), one at
    a time; at dp = 64 the embedding (512 x 256) covers rank 0's partition of the weights, so the norm's cast is 8
    bytes an element of the partition, and flattening the one gradient is a view of it (torch's flatten of one tensor),
    no copy."""
    config, walk = _walk(2, dp=64)
    zero = Zero(config)
    part = zero.partition(zero.groups[0])
    assert part < config.vocab_size * config.h
    norm = next(m for m in walk.moments if "group 0's widest gradient" in m.what)
    assert {x.name: x.bytes for x in norm.live}["zero/norm cast"] == 8 * part + 8
    cast = next(m for m in walk.moments if "fp32 gradient partition of group 0" in m.what)
    assert "zero/flat grad partition" not in {x.name for x in cast.live}


@pytest.mark.parametrize("changes", [
    {}, {"tie_embeddings": True}, {"family": "qwen3", "qk_layernorm": True},
    {"family": "mixtral", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48},
    {"family": "qwen2_moe", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48,
     "moe_shared_expert_intermediate_size": 40, "moe_layer_freq": 2},
])
def test_the_walks_group_without_weight_decay_is_the_one_the_totals_pad(changes):
    """The walk splits the Trainer's two groups by the parameters' dimensions (norms are 1-D), `--totals` by
    get_decay_parameter_names' rule (totals.no_decay_params: norms and biases): on every family the ZeRO walk runs
    they are the same parameters, so each group is padded alike."""
    config = build_config(LLAMA | {"zero_stage": 2} | changes)
    (stage,) = pipeline_stages(config)
    assert sum(Zero(config).groups[1]) == no_decay_params(config, stage, 1)


@pytest.mark.parametrize("name, changes", [("gpt-oss-tiny", {}), ("cohere-tiny", {"qk_layernorm": True})])
def test_the_walks_group_without_weight_decay_goes_by_the_trainers_names_not_by_dimensions(name, changes):
    """gpt-oss's 1-D sinks decay and its (E, out) experts' biases do not; nor do Cohere's (heads, d) q_norm and k_norm
    (the walk put the 1-D parameters in the group without decay: 496 of gpt-oss-tiny's elements, not the Trainer's
    1,256)."""
    path = f"tests/data/hf/{name}.json"
    config = load_config(path, {"impl": "hf", "s": 8, "zero_stage": 1, "dp": 2} | changes,
                         base=read_hf_config(path).fields)
    (stage,) = pipeline_stages(config)
    assert sum(Zero(config).groups[1]) == no_decay_params(config, stage, 1)
