"""torchtitan's own Llama3Model sharded by its own parallelize_llama (apply_fsdp_to_decoder: `fully_shard` on
tok_embeddings, each block, [norm, lm_head] and the model; bf16 parameters, fp32 reduce; its "default" reshard policy
or "never") over dp_shard = 2 and 4 ranks of the fake group, trained with its trainer's zero_grad(set_to_none=False),
under torch's FSDPMemTracker, against the torchtitan step timeline with FSDP2's units as data
(memcalc.sizing.timeline.fsdp): the peak, each category at it and the state between steps to the byte, the peak's
moment, and every moment in order; also under its FullAC and SelectiveAC."""

from dataclasses import replace

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.hf_fsdp import FsdpMomentTracker  # noqa: E402
from memcalc.probe.libs.torchtitan_step import data_parallel, warmed_up_sharded  # noqa: E402
from memcalc.probe.step import categories, measure_step  # noqa: E402
from memcalc.sizing.pipeline import stage_rank  # noqa: E402
from memcalc.sizing.timeline import GRADIENTS, OPTIMIZER, PARAMETERS, timeline  # noqa: E402
from memcalc.sizing.totals import per_gpu  # noqa: E402

from tests.helpers import TORCHTITAN_LLAMA3, make_config  # noqa: E402

from ..step_readings import assert_moments_in_order, torchtitan_fsdp_readings  # noqa: E402

# As the step tests' Llama3, with a vocabulary and an ffn width dp_shard = 4 pads.
LLAMA3 = TORCHTITAN_LLAMA3 | {"ffn_hidden_size": 102}
CPU = Accounting(exact=True, device="cpu")
SHARDS = [2, 4]
RESHARD = [True, False]


@pytest.fixture(scope="module")
def measured(one_thread):
    return {(n, reshard): measure_step(make_config(LLAMA3, dp_shard=n, reshard_after_forward=reshard), ["none"])[0]
            for n in SHARDS for reshard in RESHARD}


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("n", SHARDS)
def test_the_peak_every_category_and_the_steady_state_are_fsdpmemtrackers_to_the_byte(measured, n, reshard):
    r = measured[n, reshard]
    assert r.model == "torchtitan's Llama3Model"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.matches and r.moment_matches, (r.predicted_moment, r.measured.moment)


def test_the_chosen_sizes_put_the_peak_at_a_gather_in_backward_and_in_the_loss(measured):
    """Resharded, the peak is the last block's all-gather prefetched beside the final norm's backward; unsharded
    blocks stay from forward on, and the loss's fp32 backward is higher."""
    assert {r.measured.moment.split(" (")[0] for r in measured.values()} == {"backward norm", "backward"}


@pytest.mark.parametrize("n", SHARDS)
def test_between_steps_each_rank_holds_each_padded_parameter_over_dp_shard_four_times_in_fp32(measured, n):
    """fp32 shards, their gradients (zeroed in place, not freed), AdamW's m and v, a 4-byte step per parameter
    tensor; each block's RoPE table (complex64, s by d/2) a buffer. Counted from the config, dim 0 padded to n."""
    c = make_config(LLAMA3, dp_shard=n)
    pad = lambda rows: -(-rows // n) * n  # noqa: E731
    qkv = (c.a + 2 * c.groups) * c.head_dim
    block = (pad(qkv) + pad(c.h) + 2 * pad(c.ffn)) * c.h + pad(c.h) * c.ffn + 2 * pad(c.h)  # wqkv wo w1 w3, w2, norms
    shard = (c.L * block + 2 * pad(c.vocab_size) * c.h + pad(c.h)) // n
    steady = measured[n, True].measured.steady
    assert steady[PARAMETERS] == 4 * shard + c.L * 8 * c.s * (c.head_dim // 2)
    assert steady[GRADIENTS] == 4 * shard
    assert steady[OPTIMIZER] == 8 * shard + 4 * (7 * c.L + 3)


def test_at_dp_shard_3_its_state_between_steps_is_the_totals_padded_model_states(one_thread):
    """fully_shard pads each parameter's dim 0 to a multiple of dp_shard (h 250 over 5 heads, v 509, f 701: none
    divides by 3): the measured fp32 shards, their gradients and AdamW's m and v are --totals' (which split the
    parameters' sum: 11,084 B of each too few), beside the RoPE tables and a 0-d step per parameter."""
    c = make_config(LLAMA3, dp_shard=3, b=1, s=5, h=250, a=5, num_query_groups=5, vocab_size=509,
                    ffn_hidden_size=701)
    steady = measure_step(c, ["none"])[0].measured.steady
    states = {x.name: x.bytes for x in per_gpu(c, STRATEGIES["none"]).worst().terms}
    assert steady[PARAMETERS] == states["states/weights"] + c.L * 8 * c.s * (c.head_dim // 2)
    assert steady[GRADIENTS] == states["states/grads"]
    assert steady[OPTIMIZER] == states["states/adam_m"] + states["states/adam_v"] + 4 * (7 * c.L + 3)


def test_at_dp_shard_3_tied_its_sharded_states_are_the_totals_padded_ones_counting_the_shared_weight_once(one_thread):
    """Tied, lm_head is tok_embeddings' weight, one parameter that fully_shard pads once: the measured fp32 shards,
    their gradients and AdamW's m and v are --totals' (which split the parameters' sum evenly: 6,752 B of each too
    few), beside a 0-d step per parameter."""
    c = make_config(LLAMA3, dp_shard=3, b=1, s=5, h=250, a=5, num_query_groups=5, vocab_size=509, ffn_hidden_size=701,
                    tie_embeddings=True)
    measured, tensors = run_fake(_sharded_states, (c,), 3)
    states = {x.name: x.bytes for x in per_gpu(c, STRATEGIES["none"]).worst().terms}
    assert measured["weights"] == states["states/weights"] and measured["grads"] == states["states/grads"]
    assert measured["adam"] == states["states/adam_m"] + states["states/adam_v"] + 4 * tensors


def _sharded_states(tp, config) -> tuple[dict[str, int], int]:
    """FSDPMemTracker's sharded parameters, gradients and optimizer states between steps under torchtitan's own
    parallelize_llama, and the parameters' count."""
    strategy = STRATEGIES["none"]
    with data_parallel(tp, config, strategy) as dims:
        trainer = warmed_up_sharded(tp, config, strategy, dims)
        tracker = FsdpMomentTracker(trainer.model, trainer.optimizer)
        with tracker:
            steady = categories(tracker.get_tracker_snapshot("current"),
                                {"Sharded Param": "weights", "Sharded Grad": "grads", "OptState": "adam"})
        return steady, len(list(trainer.model.parameters()))


@pytest.mark.parametrize("n, reshard, recompute", [(2, True, "none"), (2, False, "none"), (4, True, "none"),
                                                    (2, True, "full"), (4, False, "op")])
def test_every_moment_the_fsdp_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, n, reshard,
                                                                                         recompute):
    """Each unit's all-gather and copy-out, [norm, lm_head]'s two post-backwards (lm_head's gradient reduced after
    its backward, the unit gathered again for the norm's), the reduce-scatters added into the sharded gradients; under
    torchtitan's FullAC and SelectiveAC (passed to its parallelize_llama) each block's rerun inside its unit, which
    FSDPMemTracker reads as temporaries."""
    config = make_config(LLAMA3, dp_shard=n, reshard_after_forward=reshard, recompute=recompute)
    predicted = timeline(config, STRATEGIES["none"], CPU)
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, "none"))


@pytest.mark.parametrize("changes", [
    {"dp_shard": 2, "recompute": "full"},
    {"dp_shard": 4, "recompute": "op", "reshard_after_forward": False},
    {"dp_shard": 4, "recompute": "full", "b": 1, "s": 7},  # b = 1, odd s: the first block's norm in backward
], ids=str)
def test_under_its_activation_checkpointing_the_peak_is_fsdpmemtrackers_to_the_byte(one_thread, changes):
    (r,) = measure_step(make_config(LLAMA3, **changes), ["none"])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


@pytest.mark.parametrize("reshard, recompute", [(True, "none"), (False, "full")])
def test_as_hsdp_each_units_all_reduce_input_is_held_to_its_next_post_backward_and_every_moment_is_fsdpmemtrackers(
        one_thread, reshard, recompute):
    """HSDP (dp_replicate 2 x dp_shard 2, parallelize_llama's ["dp_replicate", "fsdp"] mesh): each reduce-scatter's
    output, all-reduced across replicas, is held by its unit (AllReduceState) after it has been added into the sharded
    gradients, until the unit's next post-backward (norm and lm_head's) or the end of backward (every block's)."""
    config = make_config(LLAMA3, dp_shard=2, dp_replicate=2, reshard_after_forward=reshard, recompute=recompute)
    predicted = timeline(config, STRATEGIES["none"], CPU)
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, "none"))
    (r,) = measure_step(config, ["none"])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


# With experts: its Qwen3 MoE layers, each block one FSDP2 unit at ep = 1, the experts sharded on dim 0 while the
# data-parallel ranks are no more than E, else on dim 1 (Shard(1): chunk-cat out of temporaries, and each gradient
# laid out on dim 0 for the reduce-scatter)
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_tokens": "balanced"}
MOE_CASES = [
    {"dp_shard": 2, "b": 1, "s": 7},
    {"dp_shard": 4, "reshard_after_forward": False, "moe_shared_expert_intermediate_size": 48},
    {"dp_shard": 2, "recompute": "full", "b": 1, "s": 7},
    {"dp_shard": 4, "recompute": "op", "moe_shared_expert_intermediate_size": 48, "s": 9},
    {"dp_shard": 2, "recompute": "op", "moe_layer_freq": 2, "L": 3},  # dense blocks beside MoE ones
    {"dp_shard": 8, "b": 1, "s": 7},  # Shard(1)
    {"dp_shard": 8, "recompute": "op", "moe_shared_expert_intermediate_size": 48},
    {"dp_shard": 8, "recompute": "full", "reshard_after_forward": False, "s": 9},  # the peak at a chunk-cat
    {"dp_shard": 4, "num_experts": 2, "moe_router_topk": 1, "moe_layer_freq": 2, "L": 3},
    {"dp_shard": 2, "dp_replicate": 2, "num_experts": 2, "moe_router_topk": 1},  # HSDP: 4 ranks, Shard(1)
    {"dp_shard": 2, "dp_replicate": 2, "recompute": "op"},  # HSDP, Shard(0)
]


@pytest.mark.parametrize("changes", MOE_CASES, ids=str)
def test_with_experts_the_peak_is_fsdpmemtrackers_to_the_byte(one_thread, changes):
    """Each MoE block gathered whole (its grouped experts' (E, ...) weights among its parameters), each grouped
    weight's gradient kept as its own unsharded .grad to the block's reduce-scatter."""
    (r,) = measure_step(make_config(LLAMA3, **(MOE | changes)), ["none"], route="balanced")
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


@pytest.mark.parametrize("changes", MOE_CASES[1::2], ids=str)
def test_with_experts_every_moment_is_fsdpmemtrackers(one_thread, changes):
    config = make_config(LLAMA3, **(MOE | changes))
    predicted = timeline(config, STRATEGIES["none"], CPU)
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, "none", "all-to-one"))


@pytest.mark.parametrize("changes, strategy, named", [
    ({"dp_shard": 2, "t": 2}, "tp", "dp_shard with tp"),
    ({"dp_shard": 2, "reduce_dtype": "bf16"}, "none", "reduce_dtype bf16"),
])
def test_what_the_fsdp_walk_does_not_model_is_refused_by_name(changes, strategy, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(LLAMA3, **changes), STRATEGIES[strategy], CPU)


# fp32: mixed_precision_param float32, which FSDP2 clamps to None: no shard is cast before its all-gather
@pytest.mark.parametrize("changes, strategy", [
    ({"dp_shard": 2, "b": 1, "s": 7}, "none"),
    ({"dp_shard": 3, "reshard_after_forward": False, "b": 1, "s": 9, "num_query_groups": 8}, "none"),
    ({"dp_shard": 2, "dp_replicate": 2}, "none"),  # HSDP
    ({"dp_shard": 2, "t": 2, "b": 1, "s": 10}, "tp-sp"),  # its 2-D mesh
    ({"dp_shard": 2, "recompute": "full", "b": 1, "s": 7}, "none"),  # FullAC inside each unit
    ({"dp_shard": 2, "recompute": "op", "reshard_after_forward": False}, "none"),  # SelectiveAC
], ids=str)
def test_in_fp32_every_moment_happens_in_order_and_the_peak_is_fsdpmemtrackers(one_thread, changes, strategy):
    config = make_config(LLAMA3, dtype="fp32", **changes)
    assert_moments_in_order(timeline(config, STRATEGIES[strategy], CPU).moments[1:],
                            torchtitan_fsdp_readings(config, strategy))
    (r,) = measure_step(config, [strategy])
    assert r.measured.moment == r.predicted_moment
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


# Pipeline stages under FSDP2: h 24 over 6 heads in 3 K/V groups, v 53, f 26, L not divisible by pp; experts under
# tp (each rank's f_e/t and u/t), and on dim 1 (dp_shard above E, f_e and h dividing it)
STAGE_CASES = [
    ({"pp": 2, "L": 3, "dp_shard": 3}, "none"),
    ({"pp": 4, "L": 2, "dp_shard": 5}, "none"),  # 0, 1, 1, 0 layers
    ({"pp": 3, "L": 7, "dp_shard": 3, "ffn_hidden_size": 40} | MOE | {"moe_layer_freq": 2, "moe_ffn_hidden_size": 16},
     "none"),
    ({"pp": 2, "L": 3, "dp_shard": 3, "t": 2, "num_query_groups": 2, "ffn_hidden_size": 26} | MOE
     | {"moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 10}, "tp-sp"),
    ({"pp": 2, "L": 3, "dp_shard": 3} | MOE | {"num_experts": 2, "moe_router_topk": 1, "moe_ffn_hidden_size": 48},
     "none"),
    # its fsdp mesh is dp_shard*cp: 4 ranks above 2 experts shard them on dim 1 (memcalc padded E 2 -> 4: 3,450
    # elements, measured 2,586)
    ({"dp_shard": 2, "cp": 2, "attention": "flash", "s": 16} | MOE | {"num_experts": 2, "moe_router_topk": 1,
                                                                     "moe_ffn_hidden_size": 24}, "none"),
]


@pytest.mark.parametrize("changes, strategy", STAGE_CASES, ids=str)
def test_on_each_pipeline_stage_the_totals_shards_are_fully_shards_of_that_stages_own_parameters(changes, strategy):
    """Each rank's chunk as torchtitan's pipeline_llm cuts it (_split_module), laid out by its own parallelize_llama
    over dp_shard (its fsdp mesh dp_shard*cp; under tp on its 2-D mesh): the elements of this rank's shards, each
    parameter's dim 0 padded, are --totals' weights (which split a stage's sum evenly before, short by the padding)."""
    c = make_config(LLAMA3, **({"h": 24, "a": 6, "num_query_groups": 3, "vocab_size": 53, "ffn_hidden_size": 26,
                                "b": 1, "s": 8} | changes))
    for stage in per_gpu(c, STRATEGIES[strategy]).stages:
        terms = {x.name: x.bytes for x in stage.terms}
        shards = run_fake(_stage_shards, (c, stage_rank(stage.stage.name, c.pp), strategy), c.dp_shard * c.cp * c.t)
        assert 4 * shards == terms["states/weights"] == terms["states/adam_m"], stage.stage.name


def _stage_shards(group, config, rank: int, strategy: str) -> int:
    """Elements of this rank's FSDP2 shards of pipeline rank `rank`'s chunk, on the meta device."""
    import torch
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import pipeline_parallel
    from torchtitan.models.llama3.parallelize import parallelize_llama

    from memcalc.probe.libs import torchtitan as titan
    from memcalc.probe.libs.torchtitan_step import on_meta

    whole = replace(config, pp=1)  # the fake group's world is this stage's dp_shard x cp x t
    with data_parallel(group, whole, STRATEGIES[strategy]) as dims:
        model = on_meta(whole, STRATEGIES[strategy].sequence_parallel, "balanced" if config.moe else None, False,
                        torch.float32)
        names = pipeline_parallel._generate_llm_fqn_per_model_part(config.pp, config.L, 1, 1)
        chunk = pipeline_parallel._split_module(model, names[rank])
        parallelize_llama(chunk, parallel_dims=dims, compile_config=CompileConfig(), ac_config=titan.ac_config(whole),
                          dump_folder="", training=TrainingConfig(), parallelism=ParallelismConfig(
                              spmd_backend=dims.spmd_backend))
        return sum(x.to_local().numel() for x in chunk.parameters())


def test_experts_sharded_unevenly_on_dim_1_are_refused_in_one_line_as_fully_shard_refuses_them():
    """dp_shard above E shards the experts on dim 1 (apply_fsdp_to_decoder), whose f_e = 24 FSDP2 cannot split over 16
    ranks: memcalc refuses the config, as torchtitan's own layout raises."""
    with pytest.raises(ConfigError, match="dp_shard.cp=16 ranks above num_experts=4: .* on dim 1 .f_e/t=24, h=64"):
        make_config(LLAMA3, **MOE, dp_shard=16)
    c = replace(make_config(LLAMA3, **MOE, dp_shard=4), dp_shard=16)
    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        run_fake(_stage_shards, (replace(c, pp=1), 0, "none"), 16)


# torchtitan's ChunkedLossWrapper under FSDP2: lm_head's unit resharded as the model's forward returns, unshard() for
# the loop, each chunk's post-backward without gradient sync but the last (reduce-scattered, kept unsharded), each
# chunk's final callback resharding the other units (kept by reshard_after_forward off) and clearing the order backward
# prefetches by, the unit resharded after the loop
CHUNKED = [
    ({"dp_shard": 2, "loss_chunks": 2}, "none"),
    ({"dp_shard": 4, "loss_chunks": 4, "reshard_after_forward": False, "recompute": "op"}, "none"),
    ({"dp_shard": 2, "loss_chunks": 3, "b": 1, "s": 9, "recompute": "full"}, "none"),
    ({"dp_shard": 2, "loss_chunks": 2, "dtype": "fp32"}, "none"),
    ({"dp_shard": 2, "loss_chunks": 2, "t": 2}, "tp-sp"),
]


@pytest.mark.parametrize("changes, strategy", CHUNKED, ids=str)
def test_under_the_chunked_loss_every_moment_and_the_peak_are_fsdpmemtrackers(one_thread, changes, strategy):
    config = make_config(LLAMA3, **changes)
    (r,) = measure_step(config, [strategy])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.matches and r.moment_matches, (r.predicted_moment, r.measured.moment)
    predicted = timeline(config, STRATEGIES[strategy], CPU)
    assert_moments_in_order(predicted.moments[1:], torchtitan_fsdp_readings(config, strategy))
