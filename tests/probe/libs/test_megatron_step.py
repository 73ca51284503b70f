"""One whole training step of memcalc's GPT whose MLPs are megatron-core's own MoELayer (`--impl megatron` with
num_experts), its router forced balanced or all-to-one, under torch's MemTracker, against the step timeline
(memcalc.sizing.timeline.megatron_moe): every moment the timeline names is MemTracker's reading after some op, in
order, to the byte; the peak is reached where the timeline says, with the bytes it says, at t = 1 and under tp-sp
(rank 0 of t = 2 and 4 through the fake group); what the walk does not model is refused in one line."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.errors import ConfigError, ProbeError  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs.megatron_step import inside_megatron, warmed_up  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import make_config  # noqa: E402

from ..step_readings import assert_moments_in_order, readings_after_every_op  # noqa: E402

CPU = Accounting(exact=True, device="cpu")
NONE = STRATEGIES["none"]
# Mixtral-style: SwiGLU experts, RMSNorm, two K/V groups, RoPE, no biases (megatron's MoE has none here), untied.
MOE = dict(
    impl="megatron", b=2, s=24, h=64, a=8, L=2, vocab_size=250, mlp="swiglu", ffn_hidden_size=176, norm="rmsnorm",
    num_query_groups=2, position_embedding_type="rope", add_bias_linear=False, dropout=0.0, tie_embeddings=False,
    attention="flash", num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
)
# The forced route and the bound it pins: the balanced route kbs/E slots each expert, all-to-one n slots to each of
# the first k experts and none to the others (the worst bound at ep = 1).
ROUTES = {"balanced": {}, "all-to-one": {"moe_tokens": "worst"}}
SHAPES = [
    (route, changes) for route in ROUTES for changes in (
        {},
        {"b": 1, "s": 7, "num_experts": 2},  # b = 1, odd s: 14 slots, 7 an expert (all-to-one: every expert 7)
        {"b": 1, "s": 7, "moe_router_topk": 4, "dropout": 0.1},  # every expert takes every token; dropout masks
        {"mlp": "gelu", "ffn_hidden_size": 100, "b": 3, "s": 10, "num_experts": 6, "attention": "eager",
         "norm": "layernorm"},  # GELU experts, eager attention, 10 slots an expert (all-to-one: 30 to two of six)
        {"num_experts": 5, "moe_router_pre_softmax": True},  # 96 slots: 20 to the first expert, 19 to the others;
        # the softmax over all E before the top k
        {"b": 1, "s": 7, "num_experts": 7, "moe_router_topk": 3, "moe_shared_expert_intermediate_size": 24,
         "dropout": 0.1},  # shared experts (Qwen-MoE's), which read the dropout's gradient after the routed ones
        {"mlp": "gelu", "ffn_hidden_size": 100, "moe_shared_expert_intermediate_size": 40,
         "moe_router_pre_softmax": True},  # GELU shared experts
        {"L": 3, "moe_layer_freq": 2, "b": 1, "s": 7},  # layers 0 and 2 MoE, layer 1 the probe's dense MLP
        {"L": 3, "moe_first_dense_layers": 2, "num_experts": 3, "dropout": 0.1,
         "moe_shared_expert_intermediate_size": 24},  # DeepSeek's first dense layers, then one MoE layer
        {"moe_router_score_function": "sigmoid", "b": 1, "s": 7, "num_experts": 6, "moe_router_topk": 3},  # the
        # sigmoid router: the k chosen scores renormalised (a division by their sum), top-k, the fp32 sigmoid
        {"moe_router_score_function": "sigmoid", "moe_router_topk": 1, "num_experts": 3,
         "moe_shared_expert_intermediate_size": 24},  # k = 1: the chosen score as it is, no renormalisation
        {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "b": 1, "s": 7,
         "num_experts": 6, "moe_router_topk": 3},  # the expert bias picks: gather keeps every expert's score; the
        # router's two fp32 (E,) buffers sit with the parameters
    )
]


def _readings(tp, config, strategy, route):
    with inside_megatron(tp, config, route):
        return readings_after_every_op(warmed_up(tp, config, strategy))


def _assert_every_moment_in_order(config, strategy, route):
    st = STRATEGIES[strategy]
    moments = timeline(config, st, CPU).moments[1:]
    assert any(".mlp.experts" in m.where for m in moments)  # under full recomputation the rerun's alone
    if st.tensor_parallel:  # rank 0 of t through the fake group
        readings = run_fake(_readings, (config, st, route), config.t)
    else:
        readings = _readings(single(), config, st, route)
    assert_moments_in_order(moments, readings, places=())  # a forward moment names a layer, not its op


@pytest.mark.parametrize("route, changes", SHAPES, ids=str)
def test_every_moment_of_a_megatron_moe_step_happens_in_order_with_its_bytes(one_thread, route, changes):
    """The router's, the dispatcher's and each expert's backward, op by op: MemTracker's reading after some op."""
    _assert_every_moment_in_order(make_config(MOE, **ROUTES[route], **changes), "none", route)


# Qwen3-MoE's attention (heads of kv_channels, wider or narrower than h/a = 8, normed per head) before the experts.
QWEN3 = [
    ("none", {"qk_layernorm": True, "kv_channels": 12, "b": 1, "s": 7}),
    ("none", {"qk_layernorm": True, "kv_channels": 4, "num_query_groups": 1, "attention": "eager", "b": 1, "s": 9}),
    ("none", {"qk_layernorm": True, "kv_channels": 20, "num_query_groups": 8, "dropout": 0.1, "b": 1, "s": 7}),
    ("tp-sp", {"qk_layernorm": True, "kv_channels": 12, "num_query_groups": 4, "attention": "eager", "t": 2,
               "b": 1, "s": 14}),
    ("tp-sp", {"qk_layernorm": True, "kv_channels": 6, "num_query_groups": 4, "t": 4, "s": 12}),
    ("none", {"qk_layernorm": True, "kv_channels": 12, "num_query_groups": 4, "attention": "eager", "ep": 2, "dp": 2,
              "b": 1, "s": 12}),  # rank 0 of ep = 2
    ("none", {"qk_layernorm": True, "kv_channels": 16, "a": 16, "num_query_groups": 2, "num_experts": 16,
              "moe_router_topk": 8, "moe_ffn_hidden_size": 24, "b": 1, "s": 9}),  # Qwen3-30B-A3B in small: a/g = 8,
    # heads 4 h/a wide, the top 8 of 16 experts
]


@pytest.mark.parametrize("strategy, changes", QWEN3, ids=str)
def test_with_qwen3s_attention_every_moment_of_a_megatron_moe_step_happens_in_order_with_its_bytes(
        one_thread, strategy, changes):
    _assert_every_moment_in_order(make_config(MOE, **changes), strategy, "balanced")


# Expert tensor parallelism (etp = t) under SP: each rank routes its s/t tokens; the dispatcher all-gathers the t
# ranks' slots for the experts, each expert f_e/t wide, and reduce-scatters their output (gradients the other way).
TP_SHAPES = [
    ("balanced", {"t": 2}),
    ("balanced", {"t": 2, "b": 1, "s": 14, "moe_router_topk": 4, "dropout": 0.1, "moe_router_pre_softmax": True}),
    ("balanced", {"t": 2, "num_experts": 5, "mlp": "gelu", "ffn_hidden_size": 100, "moe_ffn_hidden_size": 40}),
    ("all-to-one", {"t": 2, "b": 1, "s": 14, "num_experts": 3}),
    ("balanced", {"t": 4, "b": 1, "s": 20, "num_query_groups": 4}),
    ("all-to-one", {"t": 2, "b": 1, "s": 14, "L": 3, "moe_first_dense_layers": 1, "dropout": 0.1}),
    ("balanced", {"t": 2, "b": 1, "s": 14, "num_experts": 6, "moe_router_topk": 3,
                  "moe_router_score_function": "sigmoid"}),
    # shared experts: megatron's MLP under SP (fc1 on the input gathered into the global memory buffer, its dX
    # reduce-scattered and summed with the routed path's before its weight's gradient is handed over)
    ("balanced", {"t": 2, "b": 1, "s": 14, "moe_shared_expert_intermediate_size": 24, "dropout": 0.1}),
    ("all-to-one", {"t": 4, "b": 1, "s": 20, "num_query_groups": 4, "mlp": "gelu", "ffn_hidden_size": 100,
                    "moe_shared_expert_intermediate_size": 40}),
    # shared experts: tp-sp's MLP on every token, fc1 all-gathering its input into megatron's global memory buffer
    ("balanced", {"t": 2, "moe_shared_expert_intermediate_size": 32}),
    ("all-to-one", {"t": 2, "b": 1, "s": 14, "num_experts": 3, "moe_shared_expert_intermediate_size": 24,
                    "dropout": 0.1, "moe_router_pre_softmax": True}),
    ("balanced", {"t": 2, "mlp": "gelu", "ffn_hidden_size": 100, "moe_shared_expert_intermediate_size": 40,
                  "attention": "eager", "norm": "layernorm"}),
    ("balanced", {"t": 4, "b": 1, "s": 20, "num_query_groups": 4, "moe_shared_expert_intermediate_size": 48}),
]


# Expert parallelism at t = 1 (rank 0 of ep through megatron's own fake group): all-to-alls in place of the gathers.
EP_SHAPES = [
    ("balanced", {"ep": 2, "dp": 2}),
    ("all-to-one", {"ep": 2, "dp": 2, "num_experts": 8}),
    ("balanced", {"ep": 2, "dp": 2, "b": 1, "s": 12, "num_experts": 6, "moe_router_pre_softmax": True, "dropout": 0.1}),
    ("balanced", {"ep": 2, "dp": 2, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}),
    ("all-to-one", {"ep": 2, "dp": 2, "num_experts": 8, "moe_shared_expert_intermediate_size": 40, "dropout": 0.1}),
    ("balanced", {"ep": 2, "dp": 2, "mlp": "gelu", "ffn_hidden_size": 100, "moe_shared_expert_intermediate_size": 40,
                  "moe_router_pre_softmax": True}),  # shared experts beside the all-to-alls
]


# Expert parallelism beside tp-sp (etp = t): the all-to-all over ep, then the all-gather over t (and back the other
# way); rank 0 of t through the launch's fake group inside megatron's fake one of t*ep.
EP_SHAPES += [
    ("balanced", {"t": 2, "ep": 2, "dp": 2}),
    ("all-to-one", {"t": 2, "ep": 2, "dp": 2, "num_experts": 8}),
    ("balanced", {"t": 2, "ep": 2, "dp": 2, "b": 1, "s": 24, "num_experts": 6, "moe_router_topk": 3,
                  "moe_shared_expert_intermediate_size": 24, "dropout": 0.1}),
    ("all-to-one", {"t": 2, "ep": 2, "dp": 2, "b": 1, "s": 14, "moe_shared_expert_intermediate_size": 24,
                    "attention": "eager"}),
    ("balanced", {"t": 2, "ep": 4, "dp": 4, "num_experts": 8, "moe_router_pre_softmax": True, "recompute": "selective",
                  "mlp": "gelu", "ffn_hidden_size": 100}),
]

# E not dividing a rank's kbs slots, ep dividing them: the forced route deals them round the ranks, kbs/ep each, and
# each rank's first experts take one more.
EP_SHAPES += [
    ("balanced", {"ep": 2, "dp": 2, "b": 1, "s": 7, "num_experts": 6}),
    ("balanced", {"t": 2, "ep": 2, "dp": 2, "b": 1, "s": 14, "moe_shared_expert_intermediate_size": 24}),
    ("balanced", {"ep": 4, "dp": 4, "num_experts": 12, "b": 1, "s": 10, "recompute": "selective",
                  "attention": "eager"}),
]

# One expert a rank (E = ep): SequentialMLP runs it on the dispatched slots themselves; the dispatcher neither sorts
# nor unsorts them, nor keeps the per-expert counts.
EP_SHAPES += [
    ("balanced", {"ep": 2, "dp": 2, "num_experts": 2}),
    ("balanced", {"ep": 4, "dp": 4, "b": 1, "s": 10, "moe_shared_expert_intermediate_size": 24, "dropout": 0.1}),
    ("all-to-one", {"ep": 4, "dp": 4, "b": 1, "s": 7, "moe_router_topk": 1, "moe_router_pre_softmax": True,
                    "mlp": "gelu", "ffn_hidden_size": 100}),  # every token to rank 0's expert, from each of 4 ranks
    ("balanced", {"t": 2, "ep": 2, "dp": 2, "num_experts": 2, "b": 1, "s": 14, "dropout": 0.1,
                  "moe_shared_expert_intermediate_size": 24}),  # the gathered slots are the expert's input
    ("all-to-one", {"t": 2, "ep": 4, "dp": 4, "b": 1, "s": 14, "moe_router_score_function": "sigmoid"}),
]


@pytest.mark.parametrize("route, changes", EP_SHAPES, ids=str)
def test_under_ep_every_moment_of_a_megatron_moe_step_happens_in_order_with_its_bytes(one_thread, route, changes):
    config = make_config(MOE, **ROUTES[route], **changes)
    _assert_every_moment_in_order(config, "tp-sp" if config.t > 1 else "none", route)


@pytest.mark.parametrize("route, changes", TP_SHAPES, ids=str)
def test_under_tp_sp_every_moment_of_a_megatron_moe_step_happens_in_order_with_its_bytes(one_thread, route, changes):
    _assert_every_moment_in_order(make_config(MOE, **ROUTES[route], **changes), "tp-sp", route)


# Recomputation, at t = 1, over ep and under tp-sp: selective reruns the attention core inside backward, the MoE
# layer untouched; full reruns the whole layer there (router, dispatcher, experts), after a first forward without
# autograd whose MoELayer holds its locals alone, and the dispatcher's probabilities keep the rerun's graph, with the
# checkpoint's detached input and its gradient, to the next forward.
RECOMPUTE_SHAPES = [
    ("balanced", {"recompute": "selective", "attention": "eager", "dropout": 0.1}, "none"),
    ("all-to-one", {"recompute": "selective", "b": 1, "s": 7, "num_experts": 2, "attention": "eager"}, "none"),
    ("balanced", {"recompute": "selective", "b": 1, "s": 7, "num_experts": 7, "moe_router_topk": 3,
                  "moe_shared_expert_intermediate_size": 24, "attention": "eager"}, "none"),
    ("balanced", {"recompute": "selective", "ep": 2, "dp": 2, "b": 1, "s": 12, "num_experts": 6}, "none"),
    ("balanced", {"recompute": "selective", "ep": 4, "dp": 4, "num_experts": 8, "b": 1, "s": 16,
                  "moe_shared_expert_intermediate_size": 24}, "none"),
    ("all-to-one", {"recompute": "selective", "t": 2, "b": 1, "s": 14, "num_experts": 3, "attention": "eager"},
     "tp-sp"),
    ("balanced", {"recompute": "selective", "t": 2, "moe_router_topk": 4, "dropout": 0.1}, "tp-sp"),
    ("balanced", {"recompute": "full"}, "none"),
    ("all-to-one", {"recompute": "full", "b": 1, "s": 7, "num_experts": 2, "dropout": 0.1, "attention": "eager"},
     "none"),
    ("balanced", {"recompute": "full", "b": 1, "s": 7, "num_experts": 7, "moe_router_topk": 3,
                  "moe_shared_expert_intermediate_size": 24, "dropout": 0.1}, "none"),
    ("all-to-one", {"recompute": "full", "mlp": "gelu", "ffn_hidden_size": 100, "b": 3, "s": 10, "num_experts": 6,
                    "attention": "eager", "norm": "layernorm"}, "none"),
    ("all-to-one", {"recompute": "full", "t": 2, "b": 1, "s": 14, "num_experts": 3}, "tp-sp"),
    ("balanced", {"recompute": "full", "t": 2, "dropout": 0.1, "moe_router_topk": 4, "moe_router_pre_softmax": True},
     "tp-sp"),
    ("balanced", {"recompute": "full", "t": 2, "moe_shared_expert_intermediate_size": 32, "dropout": 0.1}, "tp-sp"),
    ("balanced", {"recompute": "full", "ep": 2, "dp": 2, "b": 1, "s": 12, "num_experts": 6, "dropout": 0.1}, "none"),
    ("all-to-one", {"recompute": "full", "ep": 2, "dp": 2, "num_experts": 8}, "none"),
    ("balanced", {"recompute": "full", "t": 2, "ep": 2, "dp": 2, "moe_shared_expert_intermediate_size": 24}, "tp-sp"),
    # each kind of layer its own rerun: dense layers among MoE ones, below and above them
    ("all-to-one", {"recompute": "full", "L": 3, "moe_first_dense_layers": 1, "dropout": 0.1, "b": 1, "s": 7}, "none"),
    ("balanced", {"recompute": "full", "L": 3, "moe_layer_freq": 2, "b": 1, "s": 7}, "none"),
    # top-1 beside shared experts: unpermute's output and the shared experts' sum outgrow the experts' concatenation
    ("balanced", {"recompute": "full", "moe_router_topk": 1, "moe_router_pre_softmax": True, "num_experts": 2,
                  "moe_shared_expert_intermediate_size": 24, "vocab_size": 16}, "none"),
    ("balanced", {"recompute": "selective", "L": 3, "moe_first_dense_layers": 1, "attention": "eager", "b": 1,
                  "s": 7}, "none"),
    ("balanced", {"recompute": "full", "t": 2, "L": 3, "moe_first_dense_layers": 1, "b": 1, "s": 14,
                  "moe_shared_expert_intermediate_size": 24}, "tp-sp"),
    ("balanced", {"recompute": "full", "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                  "b": 1, "s": 7, "num_experts": 6, "moe_router_topk": 3}, "none"),  # the sigmoid router's rerun
    # one expert a rank: the first forward's expert holds its fc2's input until it returns
    ("balanced", {"recompute": "full", "ep": 4, "dp": 4, "b": 1, "s": 10, "mlp": "gelu", "ffn_hidden_size": 100,
                  "moe_shared_expert_intermediate_size": 24}, "none"),
    ("all-to-one", {"recompute": "full", "ep": 4, "dp": 4, "b": 1, "s": 7, "dropout": 0.1}, "none"),
    ("balanced", {"recompute": "full", "t": 2, "ep": 2, "dp": 2, "num_experts": 2, "b": 1, "s": 14}, "tp-sp"),
    ("balanced", {"recompute": "selective", "t": 2, "ep": 2, "dp": 2, "num_experts": 2, "attention": "eager"},
     "tp-sp"),
]


# fp32, as Megatron trains it without master weights: the router's casts are no-ops (autograd runs none), and with
# the expert bias gather keeps the sigmoid's output itself.
FP32_SHAPES = [
    ("balanced", {"b": 1, "s": 7, "num_experts": 2}, "none"),
    ("all-to-one", {"b": 1, "s": 7, "moe_router_topk": 4, "dropout": 0.1, "attention": "eager"}, "none"),
    ("balanced", {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "b": 1, "s": 7,
                  "num_experts": 6, "moe_router_topk": 3}, "none"),
    ("balanced", {"num_experts": 5, "moe_router_pre_softmax": True, "recompute": "selective", "attention": "eager"},
     "none"),
    ("balanced", {"t": 2, "b": 1, "s": 14, "moe_shared_expert_intermediate_size": 24, "dropout": 0.1}, "tp-sp"),
    ("balanced", {"ep": 2, "dp": 2, "b": 1, "s": 12, "num_experts": 6, "recompute": "full"}, "none"),
]


@pytest.mark.parametrize("route, changes, strategy", FP32_SHAPES, ids=str)
def test_in_fp32_every_moment_of_a_megatron_moe_step_happens_in_order_with_its_bytes(
        one_thread, route, changes, strategy):
    _assert_every_moment_in_order(make_config(MOE, **ROUTES[route], **changes, dtype="fp32"), strategy, route)


@pytest.mark.parametrize("route, changes, strategy", RECOMPUTE_SHAPES, ids=str)
def test_under_recomputation_every_moment_of_a_megatron_moe_step_happens_in_order_with_its_bytes(
        one_thread, route, changes, strategy):
    _assert_every_moment_in_order(make_config(MOE, **ROUTES[route], **changes), strategy, route)


# Experts wide beside a small vocabulary: the peak moves into the MoE's backward; many slots of a wide h: its forward.
PEAKS = [
    ({}, "forward loss"),
    ({"moe_ffn_hidden_size": 512, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.experts.local_experts.3.linear_fc2"),
    ({"moe_ffn_hidden_size": 256, "vocab_size": 20, "s": 48, "num_experts": 2},
     "backward layers.1.mlp.experts.local_experts.1"),  # the probability's gradient beside the product's two
    ({"moe_ffn_hidden_size": 64, "h": 256, "vocab_size": 20, "s": 48, "num_experts": 8, "moe_router_topk": 4},
     "forward layers.1.mlp.experts"),  # the permuted tokens, the experts' outputs and their cat, (R, h) each
]
PEAKS = [("balanced", changes, where) for changes, where in PEAKS] + [
    ("all-to-one", {"moe_ffn_hidden_size": 512, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.experts.local_experts.1"),  # the second of the two experts that take every token
    ("all-to-one", PEAKS[-1][0], "forward layers.1.mlp.experts"),
]


PEAKS += [
    ("balanced", {"moe_ffn_hidden_size": 512, "vocab_size": 20, "s": 48, "moe_router_score_function": "sigmoid"},
     "backward layers.1.mlp.experts.local_experts.3.linear_fc2"),  # beside layer 0's sigmoid router's tensors
    # a wide dense MLP in the first layer, before two MoE layers: the peak moves into its SwiGLU's backward
    ("balanced", {"L": 3, "moe_first_dense_layers": 1, "ffn_hidden_size": 2048, "vocab_size": 20, "s": 48},
     "backward layers.0.mlp"),
]
PEAKS += [  # under tp-sp at t = 2: rank 0 of two through the fake group
    ("balanced", {"t": 2, "moe_ffn_hidden_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.experts.local_experts.3.linear_fc2"),
    ("balanced", {"t": 2, **PEAKS[3][1]}, "forward layers.1.mlp"),  # the unsorted output's reduce-scatter beside
    # both concatenations
    ("balanced", {"recompute": "selective", "attention": "eager", "s": 48, "vocab_size": 20, "moe_ffn_hidden_size": 16},
     "backward layers.1.attention"),  # the core's rerun: the eager scores beside the checkpoint's inputs
    ("balanced", {"recompute": "full", **PEAKS[3][1]}, "backward layers.1.mlp.experts"),  # the rerun's experts
    ("all-to-one", {"recompute": "full", **PEAKS[1][1]}, "backward layers.1"),  # MemTracker reads the rerun's
    # backward in the layer alone: the checkpoint's backward runs outside the modules' backward hooks
    ("balanced", {"recompute": "full", "t": 2, **PEAKS[3][1]}, "backward layers.1.mlp"),  # the rerun's reduce-scatter
    ("balanced", {"t": 2, "moe_shared_expert_intermediate_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.shared_experts"),  # the shared experts' SwiGLU on the whole sequence, u/t wide
    ("balanced", {"t": 2, "moe_shared_expert_intermediate_size": 2048, "vocab_size": 20, "s": 48, "mlp": "gelu",
                  "ffn_hidden_size": 100}, "backward layers.1.mlp.shared_experts.linear_fc2"),  # beside dY gathered
    ("balanced", {"ep": 2, "dp": 2, "moe_shared_expert_intermediate_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.shared_experts"),  # over ep: rank 0 of two through megatron's fake group
    ("balanced", {"t": 2, "ep": 2, "dp": 2, **PEAKS[3][1]}, "forward layers.1.mlp"),  # the reduce-scatter before
    # the all-to-all back, beside both concatenations
    ("balanced", {"t": 2, "ep": 2, "dp": 2, "moe_ffn_hidden_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.experts.local_experts.1"),
    ("balanced", {"ep": 2, "dp": 2, **PEAKS[3][1]}, "forward layers.1.mlp"),  # over ep the unsort's chunk sizes,
    # a copy, beside its output and the experts' (as many bytes as their list): above the concatenation
    ("balanced", {"recompute": "full", "ep": 2, "dp": 2, **PEAKS[3][1]}, "backward layers.1.mlp"),  # in the rerun
    ("balanced", {"recompute": "full", "moe_router_topk": 1, "moe_router_pre_softmax": True, "num_experts": 2,
                  "moe_shared_expert_intermediate_size": 24, "vocab_size": 16, "s": 28}, "backward layers.1.mlp"),
    # top-1 beside shared experts at t = 1: the rerun's unpermute and shared sum, above the experts' concatenation
]
PEAKS += [  # one expert a rank: its output all-to-all'd back beside it, unsorted; its own backward
    ("balanced", {"ep": 4, "dp": 4, **PEAKS[3][1], "num_experts": 4}, "forward layers.1.mlp"),
    ("balanced", {"t": 2, "ep": 2, "dp": 2, **PEAKS[3][1], "num_experts": 2, "moe_router_topk": 2},
     "forward layers.1.mlp"),  # the reduce-scatter beside the expert's output
    ("balanced", {"ep": 2, "dp": 2, "num_experts": 2, "moe_ffn_hidden_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.1.mlp.experts.local_experts.0"),
    ("all-to-one", {"recompute": "full", "ep": 4, "dp": 4, "moe_ffn_hidden_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.1"),
]


@pytest.mark.parametrize("route, changes, where", PEAKS, ids=str)
def test_a_megatron_moe_step_peaks_where_the_timeline_says_to_the_byte(one_thread, route, changes, where):
    config = make_config(MOE, **ROUTES[route], **changes)
    (r,) = measure_step(config, ["tp-sp" if config.t > 1 else "none"], route=route)
    assert r.measured.moment == r.predicted_moment == where
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.model == f"memcalc's own GPT with megatron-core's MoELayer, router forced {route}"


@pytest.mark.parametrize("route, bound", [(None, "balanced"), ("all-to-one", "balanced"), ("balanced", "worst")])
def test_a_megatron_moe_step_is_measured_only_under_the_route_that_pins_the_walks_bound(route, bound):
    with pytest.raises(ConfigError, match="needs --route balanced with moe_tokens balanced"):
        measure_step(make_config(MOE, moe_tokens=bound), ["none"], route=route)


def test_a_megatron_moe_step_with_biased_experts_is_refused_in_one_line_not_a_traceback():
    # megatron-core's expert adds fc2's bias in place to the output of a one-rank reduce, which autograd refuses
    with pytest.raises(ProbeError, match="set add_bias_linear: false") as err:
        measure_step(make_config(MOE, add_bias_linear=True), ["none"], route="balanced")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("changes, strategy, words", [
    ({"num_experts": 1, "moe_router_topk": 1, "moe_router_pre_softmax": True}, "none", "a single routed expert"),
    ({"ep": 2, "dp": 2, "b": 1, "s": 7, "num_experts": 6, "moe_router_topk": 3}, "none",
     "a rank's k*b*s=21 slots that ep=2 does not divide"),
    ({"moe_aux_loss": True}, "none", "the load-balancing loss"),
    ({"moe_token_dispatcher_type": "allgather"}, "none", "the allgather token dispatcher"),
    ({"moe_expert_capacity_factor": 1.0, "moe_tokens": "capacity"}, "none", "a capacity factor"),
    # measured at b=1 s=28 h=32 E=2 L=1: MemTracker's peak 1,792 B (one (s, b, h) bf16 tensor) above the walk's
    ({"moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_shared_expert_intermediate_size": 24,
      "recompute": "full", "ep": 2, "dp": 2, "num_experts": 2}, "none",
     "top-1 routing beside shared experts under recompute full over ep"),
], ids=str)
def test_what_the_moe_walk_does_not_model_is_refused_in_one_line(changes, strategy, words):
    with pytest.raises(ConfigError, match="does not model") as err:
        timeline(make_config(MOE, **changes), STRATEGIES[strategy], CPU)
    assert words in str(err.value) and "\n" not in str(err.value)


# DeepSeek-V3's layers, small: megatron-core's MLASelfAttention (eager: the local DotProductAttention) beside its
# MoELayer with the sigmoid router, a shared expert and the first layer dense.
DEEPSEEK = MOE | dict(
    L=3, attention="eager", num_query_groups=None, kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=12, v_head_dim=10, num_experts=6, moe_router_topk=3, moe_router_score_function="sigmoid",
    moe_shared_expert_intermediate_size=24, moe_first_dense_layers=1,
)
DEEPSEEK_SHAPES = [
    ("none", {}),
    ("none", {"b": 1, "s": 7, "dropout": 0.1}),  # torch's softmax keeps the causal mask; dropout masks
    ("none", {"q_lora_rank": None, "moe_first_dense_layers": 2, "moe_router_score_function": "softmax"}),
    ("none", {"moe_router_enable_expert_bias": True, "dropout": 0.1}),  # DeepSeek-V3's aux-loss-free balancing
    ("tp-sp", {"t": 2, "b": 1, "s": 14}),
    ("tp-sp", {"t": 4, "s": 28, "dropout": 0.1, "moe_router_enable_expert_bias": True}),
    ("none", {"recompute": "selective", "b": 1, "s": 7}),  # the latent core's rerun beside the experts' pieces
    ("tp-sp", {"t": 2, "b": 1, "s": 14, "recompute": "selective"}),
    ("none", {"recompute": "full", "b": 1, "s": 7, "dropout": 0.1, "moe_router_enable_expert_bias": True}),  # each
    # layer rerun: the latent attention's and the experts'
    ("none", {"recompute": "full", "ep": 2, "dp": 2, "b": 1, "s": 12}),
    ("tp-sp", {"t": 2, "b": 1, "s": 14, "recompute": "full"}),
]


@pytest.mark.parametrize("strategy, changes", DEEPSEEK_SHAPES, ids=str)
def test_every_moment_of_a_step_with_latent_attention_and_experts_happens_in_order_with_its_bytes(
        one_thread, strategy, changes):
    _assert_every_moment_in_order(make_config(DEEPSEEK, **changes), strategy, "balanced")


@pytest.mark.parametrize("strategy, changes, where", [
    ("none", {}, "forward loss"),
    ("none", {"moe_ffn_hidden_size": 512, "vocab_size": 20, "s": 48, "moe_router_enable_expert_bias": True},
     "backward layers.2.mlp.experts.local_experts.5.linear_fc2"),  # the last expert's, beside layer 1's router's
    ("tp-sp", {"t": 2, "moe_ffn_hidden_size": 1024, "vocab_size": 20, "s": 48},
     "backward layers.2.mlp.experts.local_experts.5.linear_fc2"),
], ids=str)
def test_a_step_with_latent_attention_and_experts_peaks_where_the_timeline_says_to_the_byte(
        one_thread, strategy, changes, where):
    (r,) = measure_step(make_config(DEEPSEEK, **changes), [strategy], route="balanced")
    assert r.measured.moment == r.predicted_moment == where
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.model == ("memcalc's own GPT with megatron-core's MLASelfAttention and MoELayer, router forced"
                       " balanced")
