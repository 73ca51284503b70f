"""One training step of transformers' LlamaForCausalLM under DeepSpeed's own engine (memcalc.probe.libs.hf_zero,
rank 0 of dp through the fake group), against the ZeRO walk (memcalc.sizing.timeline.zero): at stages 1 and 2 the
state between steps and the peak, category by category, and its moment are MemTracker's to the byte, with experts,
gradient checkpointing and in fp32 too (hf_zero.ZeroTracker files DeepSpeed's buffers as the walk does), and every
moment of the walk is MemTracker's reading after some op, in order."""

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

import torch  # noqa: E402

from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.libs.hf_step import causal_lm  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import OPTIMIZER, PARAMETERS, timeline  # noqa: E402
from memcalc.sizing.totals import per_gpu  # noqa: E402
from tests.helpers import LLAMA_HF as LLAMA, make_config  # noqa: E402

from .test_hf_fsdp import AT_3, PADDED_FAMILIES  # noqa: E402
from ..step_readings import assert_moments_in_order, readings_after_every_op  # noqa: E402

MIXTRAL = {"family": "mixtral", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}
# Qwen2-MoE's shared expert, a dense layer before each sparse one (decoder_sparse_step 2)
QWEN2_MOE = MIXTRAL | {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 40, "moe_layer_freq": 2}


def _step(stage: int, **changes):
    """The step at `stage` (dp 2 unless changed) with the walk's and MemTracker's bytes; experts under the balanced
    route."""
    config = make_config(LLAMA, **{"zero_stage": stage, "dp": 2} | changes)
    (r,) = measure_step(config, ["none"], route="balanced" if config.moe else None)
    return r


@pytest.mark.parametrize("stage,changes", [
    (1, {"b": 1, "s": 7}),
    (2, {"b": 3, "s": 5, "num_query_groups": 1}),
    (2, {"b": 1, "s": 9, "a": 4, "num_query_groups": 4}),
    (1, {"b": 3, "s": 5, "recompute": "full"}),
    (2, {"b": 1, "s": 7, "recompute": "full", "num_query_groups": 8}),
    (2, {"b": 1, "s": 6, **MIXTRAL}),
    (1, {"b": 3, "s": 4, **MIXTRAL, "experts_implementation": "eager"}),
    (2, {"b": 1, "s": 5, **QWEN2_MOE}),
    (2, {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3, "ffn_hidden_size": 100}),
    # fp32: no flat copy to cast; the peak at stage 2 in the first group's clip factors (a wide gradient held to the
    # next reduction, grads_in_partition made by the first into it)
    (2, {"b": 3, "s": 5, "num_query_groups": 1, "dtype": "fp32"}),
    (2, {"b": 1, "s": 9, "a": 4, "num_query_groups": 4, "dtype": "fp32"}),
    (2, {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3, "ffn_hidden_size": 100, "dtype": "fp32"}),
    (2, {"b": 1, "s": 6, **MIXTRAL, "dtype": "fp32"}),
    # the embedding's gradient covers rank 0's partition of the weights (dp = 4): get_grad_norm_direct's float64
    # copy of it (8 bytes an element) is the step's peak, and flattening the one gradient is a view of it, no copy
    # (the walk had neither: 1,728 B short in bf16; in fp32 the peak's moment elsewhere; found by a drawn run)
    (2, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 64,
         "dp": 4, "attention": "eager"}),
    (2, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 64,
         "dp": 4, "attention": "eager", "dtype": "fp32"}),
])
def test_deepspeeds_step_holds_what_the_zero_walk_holds_between_steps_and_at_its_peak(one_thread, stage, changes):
    """Between steps: bf16 weights whole, this rank's fp32 master partition, Adam's moments and the two groups' steps;
    at the peak, in DeepSpeed's step (the optimizer's moment): the first group's flat bf16 and fp32 gradient
    partitions (in fp32 one, and the clip factors) and the gradient norm (temporaries) beside grads_in_partition
    (gradients), each category exact."""
    r = _step(stage, **changes)
    _exact(r)
    assert r.predicted_moment == "optimizer"


def _exact(r) -> None:
    """Every category between steps and at the peak, and the peak's moment, MemTracker's."""
    for at in ("steady", "peak"):
        assert all(row.predicted == row.measured for row in r.rows(at)), r.rows(at)
    assert (r.predicted_moment, r.measured.group) == (r.measured.moment, "fake")
    assert r.rows("peak")[-1].measured == r.measured.peak_bytes


@pytest.mark.parametrize("stage,changes,moment", [
    (1, {"b": 3, "s": 65, "a": 4, "num_query_groups": 4}, "backward"),
    (2, {"b": 3, "s": 61, "vocab_size": 1000, "num_query_groups": 1}, "backward"),
    (2, {"b": 3, "s": 63, "recompute": "full"}, "backward model.layers.0.mlp"),
    (2, {"b": 1, "s": 65, "dp": 3}, "backward"),
    (1, {"b": 3, "s": 7, "dp": 3, "h": 48, "a": 6, "num_query_groups": 3, "ffn_hidden_size": 100}, "backward"),
    # small and checkpointed: grads_in_partition made by the first reduction into rank 0's partition, in layer 0 (the
    # walk made it at the first reduction: its peak a layer early, 376 B over)
    (2, {"b": 3, "s": 4, "h": 16, "a": 4, "ffn_hidden_size": 12, "vocab_size": 14, "recompute": "full",
         "attention": "eager"}, "backward model.layers.0.post_attention_layernorm"),
    # fp32: no flat copy to cast, so stage 1's reductions after backward are its peak
    (1, {"b": 1, "s": 7, "dtype": "fp32"}, "backward"),
    (1, {"b": 3, "s": 5, "recompute": "full", "dtype": "fp32"}, "backward"),
    # stage 1 at dp = 4 with the embedding narrower than the bucket: reduce_gradients copies its gradient into the
    # bucket (freeing its own) before the first reduction allocates grads_in_partition (the walk held every gradient
    # to that allocation: 256 B over; found by a drawn run, with Mixtral and Qwen3-MoE too)
    (1, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 8, "dp": 4,
         "attention": "eager"}, "backward"),
    # tied, the embedding's gradient the first into rank 0's partition (dp = 4): autograd frees the tied weight's two
    # gradients as it sums them, before the reduction allocating grads_in_partition (the walk held both there: 6,432 B
    # over in bf16, 12,864 in fp32)
    (2, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 200,
         "dp": 4, "tie_embeddings": True, "attention": "eager"}, "backward model.embed_tokens"),
    # allreduce_and_scatter flattens the bucket's slices for several ranks into one copy before the all-reduce: in fp32
    # with one K/V group the copy beside o_proj's new gradient is the peak (the walk had no copy: 2,560 B short)
    (2, {"b": 1, "s": 4, "h": 40, "a": 5, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 4, "vocab_size": 6, "dp": 4,
         "attention": "eager", "dtype": "fp32"}, "backward model.layers.0.self_attn.o_proj"),
])
def test_a_peak_in_backward_holds_the_scaled_loss_and_the_reduce_buckets_state(one_thread, stage, changes, moment):
    """Long sequences put the peak in backward: engine.backward's scaled copy of the loss is live; a gradient wider
    than the bucket stays in its .grad until the next reduction; grads_in_partition is allocated at the first
    reduction of a gradient reaching into this rank's partition (the last layer's are the other rank's). At dp = 3
    each group's flat buffer is padded to 2*dp elements, and stage 1's peak is its reduction after loss.backward()
    returns (the engine's, in its backward)."""
    r = _step(stage, **changes)
    _exact(r)
    assert r.predicted_moment == moment


@pytest.mark.parametrize("stage", [1, 2])
def test_at_dp_3_deepspeeds_state_between_steps_is_the_totals_padded_model_states(one_thread, stage):
    """Each of the Trainer's two groups' flat buffer padded to a multiple of 2*dp elements (120,064 weights' elements
    to 120,066, 320 norms' to 324): DeepSpeed's optimizer states are --totals' fp32 master weights, m and v, and
    AdamW's two 0-d steps; its parameters --totals' bf16 weights beside LlamaRotaryEmbedding's buffers (--totals had
    12 B of weights and 8 B of each fp32 state too few)."""
    r = _step(stage, dp=3, b=1, s=5)
    config = make_config(LLAMA, zero_stage=stage, dp=3, b=1, s=5)
    states = {x.name: x.bytes for x in per_gpu(config, STRATEGIES["none"]).worst().terms}
    buffers = sum(x.bytes for x in r.predicted.steady.live if x.name.startswith("states/rotary_emb."))
    assert r.measured.steady[PARAMETERS] == states["states/weights"] + buffers
    fp32 = ("states/master_weights", "states/adam_m", "states/adam_v")
    assert r.measured.steady[OPTIMIZER] == sum(states[x] for x in fp32) + 4 * 2


@pytest.mark.parametrize("family", PADDED_FAMILIES)
def test_at_dp_3_zero3s_partitions_are_the_totals_padded_states_on_each_familys_own_parameters(family):
    """DeepSpeed's Init pads each of the family's parameters to a multiple of dp (its own _padding_size, on the shapes
    of transformers' model) and keeps those of stage3_param_persistence_threshold elements or fewer (the Trainer's
    "auto": 10h) whole beside their partitions: --totals' fp32 states are the partitions, its bf16 weights both (it
    split the parameters' sum evenly on every family but Llama's)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    config = make_config(LLAMA | AT_3 | PADDED_FAMILIES[family], zero_stage=3, dp=3)
    model, _ = causal_lm(config, "balanced" if config.moe else None, torch.float32, torch.device("meta"))
    sizes = [x.numel() for x in model.parameters()]
    init = SimpleNamespace(_partition_world_size=lambda param: 3)  # the partition group's ranks: dp
    part = sum((n + Init._padding_size(init, SimpleNamespace(ds_numel=n))) // 3 for n in sizes)
    states = {x.name: x.bytes for x in per_gpu(config, STRATEGIES["none"]).worst().terms}
    assert [states[x] for x in ("states/master_weights", "states/adam_m", "states/adam_v")] == [4 * part] * 3
    assert states["states/weights"] == 2 * (part + sum(n for n in sizes if n <= 10 * config.h))


def _readings_after_every_op(config) -> list[tuple[str, dict[str, int]]]:
    """MemTracker's place and bytes per category after each op of one step under DeepSpeed's engine
    (hf_zero.ZeroTracker), experts under the balanced route."""
    from memcalc.probe.launch import run_fake
    from memcalc.probe.libs.hf_zero import ZeroTracker, warmed_up_zero

    def on_rank(tp):
        return readings_after_every_op(warmed_up_zero(tp, config, "balanced" if config.moe else None), ZeroTracker)

    return run_fake(on_rank, (), config.dp)


@pytest.mark.parametrize("stage,changes", [
    (1, {"b": 1, "s": 7, "dtype": "fp32"}),
    (2, {"b": 3, "s": 5, "num_query_groups": 1, "dtype": "fp32"}),
    (1, {"b": 3, "s": 5, "num_query_groups": 1}),
    (2, {"b": 1, "s": 7}),
    (2, {"b": 1, "s": 7, "recompute": "full", "num_query_groups": 8, "dtype": "fp32"}),
    (2, {"b": 1, "s": 6, **MIXTRAL, "dtype": "fp32"}),
    (1, {"b": 1, "s": 9, "a": 4, "num_query_groups": 4}),
    (2, {"b": 3, "s": 5, "h": 48, "a": 6, "num_query_groups": 3, "ffn_hidden_size": 100}),
    (2, {"b": 3, "s": 5, **QWEN2_MOE}),
    # the eager loop: each expert's select sums, the router's weight handed over before its dX is summed (reshape's
    # view between them), the wide experts' gradients making a reduction of each later hand-over
    (2, {"b": 1, "s": 6, **MIXTRAL, "experts_implementation": "eager"}),
    # the bucket's slices for several ranks flattened at each reduction (a wide gradient across two ranks' partitions
    # too), in backward and after it
    (2, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 64}),
    (2, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "vocab_size": 2, **MIXTRAL, "num_experts": 2,
         "moe_router_topk": 1, "moe_ffn_hidden_size": 8, "attention": "eager", "dtype": "fp32"}),
    # the tied embedding alone in rank 0's partition of the weights: its float64 copy for the norm, its flatten a view
    (2, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 200,
         "tie_embeddings": True, "attention": "eager", "dtype": "fp32"}),
    (1, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "ffn_hidden_size": 8, "vocab_size": 200,
         "tie_embeddings": True, "attention": "eager"}),
    # stage 1's reductions after backward, in bit16_groups' order through the bucket: the experts' gate_up_proj, wider
    # than the bucket and another rank's, left in its .grad to the end of backward
    (1, {"b": 1, "s": 1, "h": 16, "a": 1, "num_query_groups": 1, "L": 1, "vocab_size": 5, **MIXTRAL,
         "num_experts": 2, "moe_router_topk": 1, "moe_ffn_hidden_size": 8, "attention": "eager"}),
])
def test_every_moment_of_the_zero_walk_is_memtrackers_reading_after_some_op_in_order(one_thread, stage, changes):
    """engine.backward's scaled loss and the loss's gradient through it, the reduce bucket from the first gradient, a
    norm's dY gone before its weight's gradient is reduced, a wide gradient held to the next reduction,
    grads_in_partition made by the first reduction into it, each group's fp32 gradient and clip factors in turn; each
    category and MemTracker's module exact. gate_proj's and up_proj's input gradients (q's, k's and v's) are summed
    before the weight's gradient reaches ZeRO's hook (the walk handed it over first: 896 B of temporaries too many in
    the reductions it set off at b = 1, s = 7, the total the same)."""
    config = make_config(LLAMA, zero_stage=stage, dp=2, **changes)
    moments = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu")).moments[1:]
    assert_moments_in_order(moments, _readings_after_every_op(config))


def test_deepspeeds_comm_backend_starts_without_the_shm_op_it_would_jit_compile(one_thread):
    """The probe's DeepSpeed runs without the shared-memory all-reduce op its CPU accelerator builds (a minute of
    compiling on a fresh machine): only inference_all_reduce calls it, and the step's bytes are the walk's without
    it."""
    from deepspeed.comm import comm

    _exact(_step(1, b=1, s=3))
    assert comm.cdb.shm_comm_op is None
