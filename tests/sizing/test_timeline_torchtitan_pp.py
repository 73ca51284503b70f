"""torchtitan's pipeline in the step timeline (memcalc.sizing.timeline.torchtitan_pp): torch's Schedule1F1B order,
what a stage keeps between steps and to the step's end, and what is refused. Against MemTracker:
tests/probe/libs/test_torchtitan_pp.py."""

import pytest

from memcalc.config.schema import load_config
from memcalc.errors import ConfigError
from memcalc.model.knobs import Accounting
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.pipeline import torchtitan_stages
from memcalc.sizing.timeline import ACTIVATIONS, timelines, timeline
from memcalc.sizing.timeline.torchtitan_pp import _Schedule, schedule
from memcalc.sizing.totals import per_gpu
from memcalc.sizing.verdict import need, step_peaks

from tests.helpers import TORCHTITAN_LLAMA3 as LLAMA3, make_config

CPU = Accounting(exact=True, device="cpu")


def _timeline(stage, strategy="none", **changes):
    return timeline(make_config(LLAMA3, **({"pp": 2} | changes)), STRATEGIES[strategy], CPU, stage)


def test_1f1b_runs_pp_minus_rank_forwards_then_a_backward_before_each_further_forward():
    assert schedule(3, 2, 0) == [(True, 0), (True, 1), (False, 0), (True, 2), (False, 1), (False, 2)]
    assert schedule(3, 2, 1) == [(True, 0), (False, 0), (True, 1), (False, 1), (True, 2), (False, 2)]


@pytest.mark.parametrize("strategy, split", [("none", 1), ("tp", 1), ("tp-sp", 2)])
@pytest.mark.parametrize("stage, buffers", [("first", 1), ("rank 1", 2), ("last", 1)])
def test_between_steps_a_stage_keeps_one_receive_buffer_per_micro_batch_each_way_it_receives(stage, buffers,
                                                                                              strategy, split):
    """Under tp-sp each is this rank's (b, s/t, h) shard of the stream, which torchtitan's TP plan passes on."""
    config = make_config(LLAMA3, pp=3, L=6, num_microbatches=3, t=2)
    steady = timeline(config, STRATEGIES[strategy], CPU, stage).steady
    assert steady.by_category()[ACTIVATIONS] == buffers * 3 * config.b * config.s * config.h * 2 // split


@pytest.mark.parametrize("strategy", ["none", "tp"])
def test_the_last_stage_keeps_each_micro_batchs_loss_to_the_optimizer(strategy):
    live = {x.name for x in _timeline("last", strategy, num_microbatches=3, t=2).moments[-1].live}
    assert {f"micro-batch {j}/loss/value" for j in range(3)} <= live


def test_under_tp_the_schedule_keeps_the_logits_and_the_count_the_vocabulary_parallel_loss_would_free():
    """The schedule's `output` holds its latest forward's logits; the trainer's count of valid tokens is the step's."""
    moments = _timeline("last", "tp-sp", num_microbatches=3, t=2).moments
    after_the_loss = next(x for x in moments if x.phase == "forward" and "micro-batch 0/loss/value" in
                          {y.name for y in x.live})
    assert {"micro-batch 0/lm_head/logits", "loss/valid tokens"} <= {x.name for x in after_the_loss.live}


@pytest.mark.parametrize("stage, received, sent", [("first", False, True), ("rank 1", True, True),
                                                   ("last", True, False)])
def test_under_tp_sp_the_stream_keeps_its_receive_buffers_layout_so_no_copy_makes_it_contiguous(stage, received,
                                                                                               sent):
    """A received input is batch-first, so no norm copies its fp32 output contiguous; a sent output's gradient is
    too, so no dY is copied contiguous before its all-gather."""
    labels = {x.label() for x in _timeline(stage, "tp-sp", pp=3, L=4, t=2).moments}
    assert any("attention_norm (made contiguous)" in x for x in labels) is not received
    assert any("(dY made contiguous)" in x for x in labels) is not sent


@pytest.mark.parametrize("strategy, changes", [("tp-sp", {"t": 2}), ("none", {"dp_replicate": 2})])
def test_pp_with_dp_shard_beside_tp_or_hsdp_is_refused_by_name(strategy, changes):
    with pytest.raises(ConfigError, match="pp with dp_shard beside tp, ep > 1 or dp_replicate"):
        _timeline("first", strategy, dp_shard=2, **changes)


def test_more_walked_layers_than_the_walk_takes_are_refused_counting_every_micro_batch():
    with pytest.raises(ConfigError, match="L/pp = 2/2 is 1, times 600 micro-batches"):
        _timeline("first", num_microbatches=600)


@pytest.mark.parametrize("L, pp, layers", [(8, 2, (4, 4)), (8, 4, (2, 3, 2, 1)), (6, 3, (2, 3, 1)),
                                           (4, 4, (1, 2, 1, 0))])
def test_torchtitans_split_counts_the_embedding_and_the_output_as_a_layer_each(L, pp, layers):
    assert tuple(x.layers for x in torchtitan_stages(L, pp, pp)) == layers


def test_with_pp_4_a_middle_stage_bounds_memory_where_megatrons_first_and_last_would_not_say():
    config = make_config(LLAMA3, pp=4, L=8)
    walked = timelines(config, STRATEGIES["none"], CPU)
    assert [x.stage for x in walked] == ["first", "rank 1", "rank 2", "last"]
    assert max(walked, key=lambda x: x.peak.bytes).stage == "rank 1"


def test_deepseek_v3_at_pp_16_holds_its_dense_layers_on_the_first_stage_and_peaks_on_the_second():
    """torchtitan's split of its 61 layers over 16 stages: 3, then 4 a rank, 2 on the last. The first stage's three
    are its dense ones (a MoE layer holds some 20 times a dense one's parameters), so rank 1, all MoE and one
    micro-batch fewer in flight, peaks highest; the verdict (estimate's and fit's), the per-GPU totals' worst stage and
    the step's walks all size that rank, each stage's walk of its own layers' kinds."""
    config = load_config("deepseek-v3", {"impl": "torchtitan", "pp": 16})
    held = [config.rank_chunks(r)[0] for r in range(16)]
    assert [(x.start, len(x)) for x in held[:2]] == [(0, 3), (3, 4)] and len(held[-1]) == 2
    assert [sum(map(config.is_moe_layer, x)) for x in held] == [0] + [4] * 14 + [2]
    per = per_gpu(config, STRATEGIES["none"])
    assert [x.params.get("moe/experts", 0) for x in per.stages[:2]] == [0, 4 * 256 * 3 * 7168 * 2048]
    walked = step_peaks(config, STRATEGIES["none"])
    assert [x.stage for x in walked] == [x.stage.name for x in per.stages]
    assert need(per, walked).stage == per.worst().stage.name == "rank 1"
    assert max(walked[1:], key=lambda x: x.peak.bytes).peak.bytes > 10 * walked[0].peak.bytes
    assert walked[0].peak.where.startswith("layers.2.") and walked[1].peak.where.startswith("layers.6.")


MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 24, "moe_tokens": "balanced"}


# under tp and tp-sp too: each stage's chunk on this rank's shards, a stage's stream in its buffers' layout
TP_MOE = MOE | {"moe_ffn_hidden_size": 32, "t": 2}
# under FSDP2: micro-batch 0's backward makes each accumulated gradient, a later one's finds it (in fp32 the .grad)
FSDP_CASES = [({"dp_shard": 2, "num_microbatches": 4, "recompute": "op"}, "cuda", "none"),
              ({"dp_shard": 3, "pp": 3, "L": 4, "num_microbatches": 5, "dtype": "fp32", "recompute": "full"}, "cpu",
               "none"),
              (MOE | {"dp_shard": 2, "L": 4, "moe_layer_freq": 2, "num_microbatches": 3}, "cpu", "none")]


@pytest.mark.parametrize("changes, device, strategy", [
    ({"num_microbatches": 5}, "cpu", "none"),
    ({"pp": 4, "L": 8, "num_microbatches": 6, "recompute": "op"}, "cuda", "none"),
    ({"pp": 3, "L": 6, "num_microbatches": 4, "recompute": "full", "dtype": "fp32"}, "cpu", "none"),
    ({"pp": 4, "L": 2, "b": 1, "s": 7, "recompute": "full"}, "cuda", "none"),  # 0, 1, 1, 0 layers
    (MOE | {"pp": 3, "L": 7, "moe_layer_freq": 2, "recompute": "op", "moe_shared_expert_intermediate_size": 48},
     "cuda", "none"),
    ({"pp": 3, "L": 6, "num_microbatches": 5, "t": 2}, "cpu", "tp-sp"),
    ({"pp": 4, "L": 8, "num_microbatches": 6, "recompute": "op", "t": 2}, "cuda", "tp"),
    (TP_MOE | {"pp": 3, "L": 4, "ep": 2, "recompute": "full", "num_microbatches": 4}, "cpu", "tp-sp"),
    *FSDP_CASES,
])
def test_each_micro_batch_replayed_makes_the_moments_and_tensors_its_own_walk_would(monkeypatch, changes, device,
                                                                                     strategy):
    config = make_config(LLAMA3, **({"pp": 2} | changes))
    accounting = Accounting(exact=True, device=device)
    replayed = timelines(config, STRATEGIES[strategy], accounting)
    walk, live_before = _Schedule._walk, set()

    def walk_anew(self, what, segments, names, backward=False, before=()):
        self.replays.done.clear()  # nothing to replay
        live = self.parts.tape.live
        if not before:  # a forward's first walk
            live_before.clear()
            live_before.update(live)
        done = walk(self, what, segments, names, backward, before)
        assert backward or done.made == [x for x in live if x not in live_before]
        return done
    monkeypatch.setattr(_Schedule, "_walk", walk_anew)
    walked = timelines(config, STRATEGIES[strategy], accounting)
    for ours, theirs in zip(replayed, walked, strict=True):
        assert ours.moments == theirs.moments
        assert [x.at for x in ours.moments] == [x.at for x in theirs.moments]
        assert ours.moments[-1].log == theirs.moments[-1].log  # every tensor made and freed, in order


@pytest.mark.parametrize("changes, device, strategy", [
    ({"pp": 3, "L": 6, "num_microbatches": 4, "recompute": "op"}, "cuda", "none"),
    ({"pp": 2, "L": 3, "num_microbatches": 3, "recompute": "full", "dtype": "fp32"}, "cpu", "none"),
    (MOE | {"pp": 2, "L": 4, "moe_layer_freq": 2, "recompute": "none", "moe_shared_expert_intermediate_size": 48},
     "cuda", "none"),
    ({"pp": 3, "L": 6, "num_microbatches": 4, "recompute": "op", "t": 2}, "cpu", "tp-sp"),
    (TP_MOE | {"pp": 2, "L": 4, "moe_shared_expert_intermediate_size": 48}, "cpu", "tp"),
    *FSDP_CASES,
])
def test_a_micro_batchs_walk_changes_the_tape_only_under_the_names_its_replay_is_keyed_on(monkeypatch, changes,
                                                                                          device, strategy):
    """The replay is exact only if a walk changes no tensor outside its own `names` and FSDP2's that walks traced
    before made (`fsdp_names`, all of which its key holds): every change its trace logs (a tensor made, freed or
    renamed) is under one of them."""
    config = make_config(LLAMA3, **({"pp": 2} | changes))
    walk, outside = _Schedule._walk, set()

    def walk_anew(self, what, segments, names, backward=False, before=()):
        self.replays.done.clear()  # every micro-batch walked, none replayed
        done = walk(self, what, segments, names, backward, before)
        logged = {x if isinstance(x, str) else x.name for x in done.log}
        outside.update(logged - set(names) - set(self.fsdp_names))
        return done
    monkeypatch.setattr(_Schedule, "_walk", walk_anew)
    timelines(config, STRATEGIES[strategy], Accounting(exact=True, device=device))
    assert not outside


def test_the_replay_is_keyed_on_the_tensors_found_so_a_walk_finding_others_is_walked_anew(monkeypatch):
    """A micro-batch whose walk finds other tensors under the stage's names than an earlier one's did is walked, not
    replayed (the moments would be the same here: what matters is that it is traced anew)."""
    config = make_config(LLAMA3, pp=2, L=2, num_microbatches=3)
    accounting = Accounting(exact=True, device="cpu")
    forward, keys = _Schedule.forward, []

    def forward_beside_a_stranger(self, j):
        if j == 1:  # a tensor under one of the stage's names (its backward's), live through micro-batch 1's forward
            self.parts.tape.add(self.sent, ACTIVATIONS, 7, "a stranger")
        forward(self, j)
        self.parts.tape.drop(self.sent)
        keys.append(len(self.replays.done))
    monkeypatch.setattr(_Schedule, "forward", forward_beside_a_stranger)
    replayed = timelines(config, STRATEGIES["none"], accounting)
    assert keys[0] < keys[1]  # micro-batch 1's forward was traced anew, not replayed from micro-batch 0's

    walk = _Schedule._walk

    def walk_anew(self, what, segments, names, backward=False, before=()):
        self.replays.done.clear()
        return walk(self, what, segments, names, backward, before)
    monkeypatch.setattr(_Schedule, "_walk", walk_anew)
    walked = timelines(config, STRATEGIES["none"], accounting)
    for ours, theirs in zip(replayed, walked, strict=True):
        assert ours.moments == theirs.moments
