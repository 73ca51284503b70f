"""The step timeline as a model: model states stay put through the step, the saved activations at the loss are
exactly the ones `totals` counts, backward leaves nothing behind, later layers' backward sits on more saved
tensors, and the peak lies above `totals`' states + activations. Against MemTracker: tests/probe/test_step.py."""

import pytest

from memcalc.config.schema import build_config, load_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing import totals
from memcalc.sizing.timeline.ends import LOSS_WORKING_SET
from memcalc.sizing.verdict import need, step_peaks
from memcalc.sizing.timeline import (
    ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMETERS, STEP_TENSORS, TEMPORARIES, timeline, timelines,
)

# b*a/t = 8 and 16 < s <= 128 with s a multiple of 4: Megatron's fused softmax runs.
STEP = dict(b=2, s=24, h=64, a=8, t=2, L=3, vocab_size=250)
LAYOUTS = ["none", "tp", "tp-sp"]
CPU = Accounting(exact=True, device="cpu")
STATES = (PARAMETERS, GRADIENTS, OPTIMIZER)
# Live at the loss beside the saved tensors: the batch, the logits, the cross-entropy's working set, and the
# small tensors the model's ends keep that the ledger's END_TENSORS leaves out.
NOT_IN_TOTALS = {
    "batch/tokens", "batch/labels", "output/logits", *(name for name, _, _ in LOSS_WORKING_SET),
    *(x.name for x in STEP_TENSORS),
}


def _timeline(strategy: str, **changes):
    config = build_config(STEP | changes)
    return config, timeline(config, STRATEGIES[strategy], CPU)


def _moment(tl, phase: str, where: str):
    return next(m for m in tl.moments if (m.phase, m.where) == (phase, where))


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_model_states_are_the_same_at_every_moment(strategy):
    _, tl = _timeline(strategy)
    steady = {c: tl.steady.by_category()[c] for c in STATES}
    assert all(steady.values())
    for moment in tl.moments:
        assert {c: moment.by_category()[c] for c in STATES} == steady, moment.label()


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_between_steps_only_the_model_states_totals_counts_and_adams_step_counter_are_live(strategy):
    config, tl = _timeline(strategy)
    (only,) = totals.per_gpu(config, STRATEGIES[strategy], CPU).stages
    counter = next(x.bytes for x in tl.steady.live if x.name == "optimizer/step")
    assert tl.steady.bytes == only.bytes(totals.STATES) + counter


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_at_the_loss_the_saved_activations_are_the_ones_totals_counts(strategy):
    config, tl = _timeline(strategy)
    (only,) = totals.per_gpu(config, STRATEGIES[strategy], CPU).stages
    loss = _moment(tl, "forward", "loss")
    saved = sum(x.bytes for x in loss.live if x.category == ACTIVATIONS and x.name not in NOT_IN_TOTALS)
    assert saved == only.bytes(totals.ACTIVATIONS)


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_backward_leaves_only_the_batch_and_the_loss_for_the_optimizer_step(strategy):
    _, tl = _timeline(strategy)
    last = tl.moments[-1]
    assert last.phase == "optimizer"
    assert last.by_category()[TEMPORARIES] == 0
    left = {x.name for x in last.live if x.category == ACTIVATIONS}
    assert left <= {"batch/tokens", "batch/labels", "embedding/input_ids", "loss/value"}, left


def test_a_later_layers_backward_sits_on_more_saved_tensors_so_the_last_layer_peaks_highest():
    _, tl = _timeline("tp")
    highest = [
        max(m.bytes for m in tl.moments if m.phase == "backward" and m.where.startswith(f"layers.{i}."))
        for i in range(STEP["L"])
    ]
    assert highest == sorted(highest) and len(set(highest)) == len(highest)


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_the_peak_lies_above_states_plus_saved_activations(strategy):
    """Issue 8's finding: `totals` leaves out what is short-lived at the worst moment."""
    config, tl = _timeline(strategy)
    (only,) = totals.per_gpu(config, STRATEGIES[strategy], CPU).stages
    peak = tl.peak.by_category()
    assert tl.peak.bytes > only.bytes()
    assert peak[TEMPORARIES] > 0


def test_sequence_parallelism_lowers_the_peak():
    assert _timeline("tp-sp")[1].peak.bytes < _timeline("tp")[1].peak.bytes


def test_a_larger_vocabulary_moves_the_peak_to_the_loss():
    small, large = (_timeline("tp", vocab_size=v)[1].peak for v in (250, 4000))
    assert (small.phase, small.where) != ("forward", "loss")
    assert (large.phase, large.where) == ("forward", "loss")


@pytest.mark.parametrize("changes, named", [
    ({"cp": 2, "attention": "flash"}, "cp=2"),
])
def test_what_is_not_modelled_yet_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=f"does not model {named}"):
        _timeline("tp", **changes)


def test_full_recomputation_reads_the_rerun_eager_core_at_the_cast_the_dropout_and_the_projections_input():
    """The rerun's fp32 softmax is cast back beside the scores and their fp32 copy, which then goes; the dropout
    frees the cast; the projection's input is copied beside the bmm's output (found by the step differential: once
    refused, at b=1 s=16 h=10 its rerun held 640 B more than the walk read)."""
    _, tl = _timeline("tp", recompute="full", dropout=0.1, attention_softmax_in_fp32=True, masked_softmax_fusion=False,
                      num_query_groups=2)
    core = [m for m in tl.moments if m.where == "layers.1.attention" and m.phase == "backward"][:3]
    live = [{x.name for x in m.live} for m in core]
    assert [m.what for m in core] == ["the softmax cast back", "attention dropout",
                                      "weights x V, made contiguous: the projection's input"]
    local = "attention/recomputed "
    assert {local + x for x in ("scores", "scores fp32", "softmax cast", "k", "v")} <= live[0]
    assert local + "scores fp32" not in live[1] and local + "softmax cast" in live[1]
    assert {local + "context", "attention/proj_in"} <= live[2] - live[1] and local + "scores" in live[2]
    assert local + "softmax cast" not in live[2]


def test_in_fp32_the_step_keeps_no_master_copy_and_the_logits_are_the_losss_own():
    """Megatron trains fp32 without master weights (FP32Optimizer); logits.float() is a no-op, so the loss's fp32
    softmax is the output layer's logits, and in backward their gradient (no cast)."""
    config, tl = _timeline("tp", dtype="fp32")
    (only,) = totals.per_gpu(config, STRATEGIES["tp"], CPU).stages
    steady = {x.name: x.bytes for x in tl.steady.live}
    assert steady.get("states/master_weights", 0) == 0
    assert steady["states/adam_m"] == steady["states/weights"] == steady["states/grads"]
    assert tl.steady.bytes == only.bytes(totals.STATES) + steady["optimizer/step"]
    names = {x.name for m in (_moment(tl, "forward", "loss"), _moment(tl, "backward", "loss")) for x in m.live}
    assert "loss/logits_fp32" in names and not names & {"output/logits", "grad/logits"}


LATENT = {"kv_lora_rank": 24, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10}


@pytest.mark.parametrize("changes, named", [
    ({"attention": "flash"}, "latent attention with flash attention"),
    ({"impl": "hf", "family": "deepseek_v3", "attention": "eager", "add_bias_linear": False, "tie_embeddings": False,
      "recompute": "full"}, "recompute full \\(gradient checkpointing\\) with latent attention"),
])
def test_latent_attention_is_walked_as_megatron_cores_and_transformers_eager_modules_only(changes, named):
    with pytest.raises(ConfigError, match=named):
        _timeline("tp", **LATENT | changes)


# megatron-core's latent attention at b = 1, odd s, one layer: the peak is the causal mask's CopySlices (torch's softmax)
SMALL_LATENT = {"impl": "megatron", "mlp": "swiglu", "attention": "eager", "add_bias_linear": False, "kv_lora_rank": 12,
                "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5, "norm": "layernorm", "L": 1, "b": 1,
                "h": 10, "a": 5, "ffn_hidden_size": 1, "vocab_size": 2}


@pytest.mark.parametrize("dropout, s, module", [
    (0.0, 29, "attention_dropout"),  # nn.Dropout returns its input: ModTracker leaves it before it enters it
    (0.1, 63, "scale_mask_softmax"),  # its input masked in place: the hook that would leave it never runs
])
def test_latent_attentions_core_backward_is_named_inside_the_module_modtracker_never_leaves(dropout, s, module):
    """Measured by the step differential (tests/probe/test_step_differential.py, FINDINGS) and every backward moment
    of tests/probe/libs/test_megatron_mla_step.py."""
    config = build_config(SMALL_LATENT | {"dropout": dropout, "s": s})
    peak = timeline(config, STRATEGIES["none"], CPU).peak
    assert peak.what.startswith("the causal mask: CopySlices")
    assert peak.where == f"layers.0.attention.core_attention.{module}"


MIXED = {"num_experts": 4, "moe_layer_freq": 2, "mlp": "swiglu", "add_bias_linear": False}  # MoE layers: the even ones


def test_among_moe_layers_each_dense_layer_keeps_the_dense_ledgers_tensors_and_no_dispatcher():
    config, tl = _timeline("tp-sp", **MIXED, L=4)
    live = {x.name: x.bytes for x in _moment(tl, "forward", "loss").live}
    layer = estimate(config, STRATEGIES["tp-sp"], CPU)
    assert [live[f"layers.{i}/saved"] for i in (1, 3)] == [layer.dense_layer_bytes] * 2
    assert layer.dense_layer_bytes < layer.per_layer_bytes
    assert [f"layers.{i}/moe dispatcher" in live for i in range(4)] == [True, False, True, False]


def test_1f1b_keeps_the_other_micro_batches_moe_and_dense_layers_each_at_their_own_bytes():
    (config, (mixed, _)), (_, (dense, _)) = (_pipelined("tp-sp", **x) for x in (MIXED, {"mlp": "swiglu",
                                                                                      "add_bias_linear": False}))
    mixed, dense = (next(x.bytes for x in tl.peak.live if x.name == "pipeline/other micro-batches")
                    for tl in (mixed, dense))
    layer = estimate(config, STRATEGIES["tp-sp"], CPU)  # L = 8, pp = 4: a MoE and a dense layer a stage
    embeddings = dense - 3 * 2 * layer.dense_layer_bytes  # 1F1B keeps four micro-batches on the first stage
    assert mixed == 3 * (layer.per_layer_bytes + layer.dense_layer_bytes) + embeddings


def _pipelined(strategy, **changes):
    config = build_config(STEP | {"L": 8, "pp": 4} | changes)
    return config, timelines(config, STRATEGIES[strategy], CPU)


@pytest.mark.parametrize("strategy", LAYOUTS)
def test_with_a_pipeline_each_bounding_stage_holds_its_own_model_states_between_steps(strategy):
    config, (first, last) = _pipelined(strategy)
    per = totals.per_gpu(config, STRATEGIES[strategy], CPU)
    for stage, x in zip(per.stages, (first, last)):
        states = stage.bytes(totals.STATES)
        assert (x.stage, x.steady.bytes) == (stage.stage.name, states + 4)  # and Adam's step counter


def test_with_first_dense_layers_a_middle_stage_walks_its_own_moe_layers_and_holds_its_own_states():
    """Megatron's 1F1B over chunks of two layers (L = 8, pp = 4) with three dense layers first: rank 0's dense, rank
    1's one dense and one MoE, the rest MoE; ranks 1 and 2, whose layers' kinds differ from the rank's before, are
    walked too (neither the embedding nor the loss), each on its own layers, with its own states between steps."""
    config, walked = _pipelined("tp-sp", **MIXED | {"moe_layer_freq": 1, "moe_first_dense_layers": 3})
    per = totals.per_gpu(config, STRATEGIES["tp-sp"], CPU)
    assert [x.stage for x in walked] == [x.stage.name for x in per.stages] == ["first", "rank 1", "rank 2", "last"]
    for stage, x in zip(per.stages, walked):
        assert x.steady.bytes == stage.bytes(totals.STATES) + 4  # and Adam's step counter
    dispatchers = [{y.name for y in x.peak.live if y.name.endswith("/moe dispatcher")} for x in walked]
    assert dispatchers == [set(), {"layers.3/moe dispatcher"}, {"layers.4/moe dispatcher", "layers.5/moe dispatcher"},
                           {"layers.6/moe dispatcher", "layers.7/moe dispatcher"}]
    assert not {m.where for x in walked[1:3] for m in x.moments} & {"embedding", "loss"}


def test_deepseek_v3_under_megatrons_1f1b_peaks_on_the_rank_after_its_dense_layers():
    """Megatron-LM's even split (DeepSeek-V3's 61 layers as 64, over pp 16): rank 0 holds its 3 dense layers and a
    MoE one, rank 1 four MoE layers (each some 20 times a dense one's parameters) with one micro-batch fewer in
    flight: rank 1 peaks, its walk on its own layers 4 to 7; the verdict (estimate's and fit's) and the per-GPU
    totals' worst stage size it."""
    config = load_config("deepseek-v3", {"impl": "megatron", "L": 64, "pp": 16})
    per, walked = totals.per_gpu(config, STRATEGIES["none"]), step_peaks(config, STRATEGIES["none"])
    assert [x.stage for x in walked] == [x.stage.name for x in per.stages] == ["first", "rank 1", "last"]
    assert [x.stage.layer_slots for x in per.stages] == [4 * 16, 4 * 15, 4]
    assert [x.peak.where.split(".")[1] for x in walked] == ["3", "7", "63"]  # each stage's last layer's backward
    assert need(per, walked).stage == per.worst().stage.name == "rank 1"


@pytest.mark.parametrize("microbatches, in_flight", [(None, 4), (2, 2)])
def test_the_first_stage_walks_one_micro_batch_beside_the_others_1f1b_keeps_in_flight(microbatches, in_flight):
    config, (first, _) = _pipelined("tp", num_microbatches=microbatches)
    others = next(x for x in first.peak.live if x.name == "pipeline/other micro-batches")
    kept = totals.per_gpu(config, STRATEGIES["tp"], CPU).stages[0].bytes(totals.ACTIVATIONS)
    # and two small tensors of the embedding that totals does not list: the vocabulary mask and position ids
    kept += in_flight * (config.b * config.s + 8 * config.s)
    assert others.bytes * in_flight == kept * (in_flight - 1)


def test_only_the_first_stage_runs_the_embedding_and_only_the_last_the_loss():
    _, (first, last) = _pipelined("tp-sp")
    assert {m.where for m in first.moments} & {"loss", "output_layer"} == set()
    assert {m.where for m in last.moments} & {"embedding"} == set()
    assert any(m.where == "loss" for m in last.moments)


def test_interleaved_the_first_stage_walks_one_chunk_beside_the_chunk_micro_batches_the_schedule_keeps():
    config, (first, last) = _pipelined("tp-sp", vpp=2)  # L = 8, pp = 4: chunks of one layer
    stage = totals.per_gpu(config, STRATEGIES["tp-sp"], CPU).stages[0]
    slots, embeddings = stage.stage.layer_slots, stage.stage.embedding_in_flight
    per_layer = estimate(config, STRATEGIES["tp-sp"], CPU).per_layer_bytes
    per_embedding = (stage.bytes(totals.ACTIVATIONS) - slots * per_layer) // embeddings
    per_embedding += config.b * config.s + 8 * config.s  # and the vocabulary mask and position ids totals leaves out
    others = next(x for x in first.peak.live if x.name == "pipeline/other micro-batches")
    assert others.bytes == (slots - 1) * per_layer + (embeddings - 1) * per_embedding
    assert [m.where for m in first.moments if m.phase == "forward" and m.where.startswith("layers.")] == ["layers.0"]
    assert [m.where for m in last.moments if m.phase == "forward" and m.where.startswith("layers.")] == ["layers.7"]


# Megatron-LM's functional test gpt3_7b_tp1_pp4_memory_speed (tests/functional_tests/test_cases/gpt/, its
# model_config.yaml): 32 layers of h 4096, 32 heads in 8 query groups, s 8192, micro-batch 1, global batch 8 over
# dp 2 (4 micro-batches), pp 4 with one layer per virtual stage (vpp 8), untied vocabulary 131073, distributed
# optimizer, bf16, Transformer Engine's fused attention. Its mem-max-allocated-bytes, published as the golden value
# for DGX H100 (golden_values_dev_dgx_h100.json, every step from the second), is logged by the last rank: the last
# pipeline stage's peak.
MEGATRON_7B_PP4_VPP8 = dict(b=1, s=8192, h=4096, a=32, num_query_groups=8, L=32, pp=4, vpp=8, dp=2,
                            distributed_optimizer=True, vocab_size=131073, tie_embeddings=False, num_microbatches=4,
                            attention="flash")
MEGATRON_7B_PP4_VPP8_LAST_STAGE_PEAK = 60_518_293_504


def test_megatrons_published_7b_pp4_vpp8_last_stage_peak_is_within_two_percent():
    """Regression (issue 18): with 4 = pp micro-batches the last stage keeps (vpp-1)*pp + 1 chunks and one
    micro-batch's logits, not all 32 chunks and 4 logits (1.046x the golden before)."""
    config = build_config(MEGATRON_7B_PP4_VPP8)
    _, last = timelines(config, STRATEGIES["none"], Accounting(exact=True, device="cuda"))
    assert last.peak.bytes == pytest.approx(MEGATRON_7B_PP4_VPP8_LAST_STAGE_PEAK, rel=0.02)


def test_experts_between_two_of_as_many_slots_are_walked_without_moments_and_the_peak_stays_the_first_experts():
    # 16 experts of 6 slots each (kbs = 96): the first and the last walked mark moments, the fourteen between do not
    _, tl = _timeline("none", **MIXED | {"t": 1, "L": 1, "num_experts": 16, "moe_ffn_hidden_size": 512,
                                         "vocab_size": 20})
    walked = {int(m.where.split(".")[5]) for m in tl.moments if ".local_experts." in m.where}
    assert walked == {0, 15}
    assert tl.peak.where.startswith("layers.0.mlp.experts.local_experts.15.")  # wide experts: the first walked peaks
