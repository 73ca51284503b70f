"""Pipeline stages: the closed forms in memcalc.sizing.pipeline against a step-by-step run of Megatron-LM's schedules,
and against the paper's statements (Korthikanti et al. 2022, section 4.2.3)."""

from fractions import Fraction

import pytest

from memcalc.config.schema import build_config
from memcalc.sizing.pipeline import pipeline_stages, stage_rank, stages


def _simulate(p: int, m: int | None, rank: int, microbatches: int) -> list[dict[int, int]]:
    """Chunk-micro-batches in flight on `rank` after every forward, by replaying the schedule's order.

    Plain 1F1B (m None): rank r runs p - r - 1 warm-up forwards, then one forward and one backward per step.
    Interleaved: forward k runs chunk (k mod pm) // p, backward k runs chunk m - 1 - (k mod pm) // p, and
    rank r warms up with 2(p - r - 1) + (m - 1)p forwards (Megatron-LM's interleaved schedule).
    """
    chunks = m or 1
    total = microbatches * chunks
    warmup = min(p - rank - 1 if m is None else 2 * (p - rank - 1) + (m - 1) * p, total)
    def forward_chunk(k: int) -> int:
        return 0 if m is None else (k % (p * m)) // p

    def backward_chunk(k: int) -> int:
        return 0 if m is None else m - 1 - (k % (p * m)) // p

    live, history = dict.fromkeys(range(chunks), 0), []
    for k in range(warmup):
        live[forward_chunk(k)] += 1
        history.append(dict(live))
    for i in range(total - warmup):
        live[forward_chunk(warmup + i)] += 1
        history.append(dict(live))
        live[backward_chunk(i)] -= 1
    return history


LAYOUTS = [(p, m) for p in (2, 3, 4, 8) for m in (None, 2, 3, 4)]
# Micro-batches per step, as multiples of p (interleaving needs p | n): the steady state, and a step of only p,
# where rank 0 runs every forward as warm-up and the last rank still reaches 1F1B.
STEPS = (4, 2, 1)


@pytest.mark.parametrize("n_per_p", STEPS)
@pytest.mark.parametrize("p,m", LAYOUTS)
def test_first_and_last_stage_counts_match_a_replay_of_the_schedule(p, m, n_per_p):
    L, n = 2 * p * (m or 1), n_per_p * p  # two layers per model chunk
    first, last = stages(L, p, m, n)
    per_chunk = L // (p * (m or 1))
    peak_first = max(_simulate(p, m, 0, n), key=lambda live: (sum(live.values()), live[0]))
    assert first.layer_slots == per_chunk * sum(peak_first.values())
    assert first.embedding_in_flight == peak_first[0]  # chunk 0 holds the embedding, counted at the same peak
    peak_last = max(_simulate(p, m, p - 1, n), key=lambda live: sum(live.values()))
    assert last.layer_slots == per_chunk * sum(peak_last.values())
    assert last.output_in_flight == max(live[(m or 1) - 1] for live in _simulate(p, m, p - 1, n))
    assert first.layers == last.layers == L // p


def test_interleaved_step_of_p_micro_batches_keeps_the_last_stage_in_1f1b():
    """Regression (issue 18): with n = p the last rank warms up with (vpp-1)p forwards, not all n*vpp, and keeps
    one micro-batch's output-layer chunk (Megatron's 7B tp1 pp4 vpp8 functional test runs n = p = 4)."""
    first, last = stages(32, 4, 8, 4)
    assert (first.layer_slots, first.embedding_in_flight) == (32, 4)
    assert (last.layer_slots, last.output_in_flight) == (7 * 4 + 1, 1)


@pytest.mark.parametrize("p,m", LAYOUTS)
def test_no_middle_stage_keeps_more_than_the_first(p, m):
    L = 2 * p * (m or 1)
    first = stages(L, p, m)[0]
    per_chunk = L // (p * (m or 1))
    for rank in range(1, p - 1):
        assert per_chunk * max(sum(live.values()) for live in _simulate(p, m, rank, 4 * p)) <= first.layer_slots


@pytest.mark.parametrize("p", [2, 4, 8, 35])
def test_1f1b_first_stage_keeps_L_layers_whatever_p(p):
    """Section 4.2.3: the first stage stores p micro-batches of L/p layers, L layers in all."""
    L = 3 * p
    first, last = stages(L, p, None)
    assert (first.layer_slots, first.embedding_in_flight) == (L, p)
    assert (last.layer_slots, last.output_in_flight) == (L // p, 1)


@pytest.mark.parametrize("p,m", [(8, 3), (35, 3), (4, 2), (2, 5)])
def test_interleaved_first_stage_keeps_the_papers_factor(p, m):
    """Section 4.2.3: interleaving with m stages scales the first stage's activations by 1 + (p-1)/(pm)."""
    L = 3 * p * m
    assert stages(L, p, m)[0].layer_slots == L * (1 + Fraction(p - 1, p * m))


def test_without_pipelining_one_stage_holds_everything_once():
    (only,) = stages(24, 1, None)
    assert (only.name, only.layers, only.layer_slots, only.embedding_in_flight, only.output_in_flight) == (
        "only", 24, 24, 1, 1,
    )


MOE = dict(impl="megatron", s=16, h=32, a=4, L=8, pp=4, num_experts=4, moe_router_topk=2, mlp="swiglu", norm="rmsnorm",
           position_embedding_type="rope", add_bias_linear=False)


@pytest.mark.parametrize("dense, names", [
    (None, ["first", "last"]),  # every rank's layers alike: rank 0 keeps the most in flight
    (2, ["first", "rank 1", "last"]),  # rank 0's chunk dense, the others MoE: rank 1 the first of them
    (3, ["first", "rank 1", "rank 2", "last"]),  # rank 1's chunk one dense layer and one MoE
])
def test_megatrons_middle_ranks_bound_memory_where_their_layers_kinds_change(dense, names):
    """Megatron-LM's even chunks of L/pp = 2 layers under 1F1B (rank r keeps pp - r micro-batches): with first dense
    layers a middle rank may hold more states than the first; of ranks whose layers are alike the lowest keeps the
    most in flight, so only the first of each kind is a stage that can bound memory."""
    found = pipeline_stages(build_config(MOE | {"moe_first_dense_layers": dense}))
    assert [x.name for x in found] == names
    assert [x.layer_slots for x in found] == [2 * (4 - stage_rank(x.name, 4)) for x in found]
    assert [(x.has_embedding, x.has_output) for x in found[1:-1]] == [(False, False)] * (len(names) - 2)


DENSE = dict(impl="megatron", s=16, h=32, a=4)


@pytest.mark.parametrize("split, held", [
    # DeepSeek-V3's 61 layers over 16 stages (3 + 14*4 + 2): rank 1 holds 4 layers at 15 micro-batches in flight
    ({"L": 61, "pp": 16, "num_layers_in_first_pipeline_stage": 3, "num_layers_in_last_pipeline_stage": 2},
     {"first": (3, 3 * 16), "rank 1": (4, 4 * 15), "last": (2, 2)}),
    # the first stage alone set: the last holds the others' share
    ({"L": 10, "pp": 4, "num_layers_in_first_pipeline_stage": 1}, {"first": (1, 4), "rank 1": (3, 9), "last": (3, 3)}),
    # a first stage holding more than the rest: the ranks after it alike, none between bounds memory
    ({"L": 10, "pp": 4, "num_layers_in_first_pipeline_stage": 4}, {"first": (4, 16), "rank 1": (2, 6), "last": (2, 2)}),
    # the embedding and the loss each counted as a layer: (L + 2)/pp = 3 a rank, one fewer on either end
    ({"L": 10, "pp": 4, "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     {"first": (2, 8), "rank 1": (3, 9), "last": (2, 2)}),
    # interleaved: each rank's layers in vpp chunks of equal size, (in flight) chunk-micro-batches of a chunk's layers
    ({"L": 10, "pp": 3, "vpp": 2, "num_layers_in_first_pipeline_stage": 2, "num_microbatches": 3},
     {"first": (2, 1 * 6), "rank 1": (4, 2 * 6), "last": (4, 2 * 4)}),
])
def test_megatrons_uneven_split_sizes_each_rank_whose_layer_count_changes(split, held):
    """Megatron's num_layers_in_first/last_pipeline_stage and account_for_*_in_pipeline_split: each stage holds its
    rank's own layers (`ModelConfig.rank_chunks`) with its schedule's micro-batches in flight (the split changes no
    warm-up), and the first middle rank whose layer count differs from the rank's before it is sized beside the ends."""
    found = pipeline_stages(build_config(DENSE | split))
    assert {x.name: (x.layers, x.layer_slots) for x in found} == held
