"""megatron-core's own TransformerLayer keeps, tensor by tensor, what memcalc's megatron rules
predict (bytes and per-rank shape): as rank 0 of t in torch's fake group and on two gloo ranks."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ProbeError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import megatron as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402

# b*a/t is a multiple of 8 and 16 < s <= 4096 for t <= 4: the fused causal softmax runs.
SIZES = {"b": 2, "s": 32, "h": 64, "a": 16}
GQA = {"num_query_groups": 8}  # two K/V groups per rank at t = 4: the query heads are copied
SWIGLU = {"mlp": "swiglu", "bias_activation_fusion": False}
FUSED_SWIGLU = {"mlp": "swiglu", "bias_activation_fusion": True}
QK = {"qk_layernorm": True, "kv_channels": 8}  # Qwen3's attention: heads of 8 channels (a*d = 128, not h = 64)
MLA = {"kv_lora_rank": 24, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10,
       "norm": "rmsnorm", "dropout": 0.1}  # DeepSeek-V3's shape, small: latents r_q, r_kv; heads d_n + d_r, d_v

CASES = {
    "gelu mha, the seed's layer": ("none", 1, {"dropout": 0.1}),
    "gelu mha tp, no dropout": ("tp", 2, {"dropout": 0.0}),
    "gelu mha tp-sp": ("tp-sp", 4, {"dropout": 0.1}),
    "tanh gelu tp: F.gelu's tanh form keeps its input, as exact gelu": (
        "tp", 2, {"mlp": "gelu_tanh", "dropout": 0.0}),
    "fused tanh gelu tp-sp: bias_gelu keeps fc1's output": (
        "tp-sp", 2, {"mlp": "gelu_tanh", "bias_activation_fusion": True, "dropout": 0.1}),
    "fused swiglu gqa tp: fc1's output only": ("tp", 2, FUSED_SWIGLU | GQA | {"dropout": 0.0}),
    "unfused swiglu gqa tp-sp: up's copy, expanded k and v": ("tp-sp", 2, SWIGLU | GQA | {"dropout": 0.1}),
    "gqa rmsnorm tp-sp t=4": ("tp-sp", 4, GQA | {"norm": "rmsnorm", "dropout": 0.1}),
    "full recompute swiglu tp-sp: the input alone": ("tp-sp", 2, SWIGLU | {"recompute": "full", "dropout": 0.1}),
    "full recompute gelu tp t=4": ("tp", 4, {"recompute": "full", "dropout": 0.0}),
    "fp32 gqa tp: no fused softmax, so masked_fill_ keeps the causal mask": (
        "tp", 2, GQA | {"dtype": "fp32", "dropout": 0.1}),
    "selective recompute gqa: the query copy beside the qkv output": (
        "tp-sp", 2, GQA | {"recompute": "selective", "dropout": 0.1}),
    "kv_channels gqa tp: q, k, v and the projection's input a*d wide": (
        "tp", 2, GQA | {"kv_channels": 8, "dropout": 0.0}),
    "qk_layernorm mha: the norms' inputs are views of the qkv output, v's too": ("none", 1, QK | {"dropout": 0.1}),
    "qk_layernorm mha rmsnorm tp-sp": ("tp-sp", 2, QK | {"norm": "rmsnorm", "dropout": 0.1}),
    "qk_layernorm gqa tp-sp: the query's copy is normed, the key's view keeps the qkv output": (
        "tp-sp", 2, QK | GQA | SWIGLU | {"dropout": 0.1}),
    "qk_layernorm gqa selective: the checkpoint keeps the normed q and k": (
        "tp-sp", 2, QK | GQA | {"recompute": "selective", "dropout": 0.1}),
    "qk_layernorm mha selective tp": ("tp", 2, QK | {"recompute": "selective", "dropout": 0.0}),
    "qk_layernorm fp32 gqa tp": ("tp", 2, QK | GQA | {"dtype": "fp32", "dropout": 0.1}),
    "latent attention: the kv norm keeps the down projection's whole output": ("none", 1, MLA),
    "latent attention tp: the kv output is gathered, then viewed": ("tp", 2, MLA | SWIGLU),
    "latent attention tp-sp: the query latent whole, the kv latent a shard's copy": ("tp-sp", 2, MLA),
    "latent attention without a query latent, layernorm tp-sp t=4": (
        "tp-sp", 4, MLA | {"q_lora_rank": None, "norm": "layernorm", "dropout": 0.0}),
    # issue 18, found by tests/probe/test_differential.py: CONDITIONS in memcalc/model/impls/megatron.py
    "s=1: one query, no causal mask for masked_fill_": ("none", 1, {"s": 1, "b": 1, "dropout": 0.0}),
    "selective gqa with one K/V group per rank (g = t): no query copy": (
        "tp", 2, {"num_query_groups": 2, "recompute": "selective", "dropout": 0.1}),
    "qk_layernorm gqa with one K/V group per rank: the query is a view": (
        "tp-sp", 2, QK | {"num_query_groups": 2, "dropout": 0.1}),
    "latent attention tp-sp at b = 1, s = t: one token a rank, the scattered kv latent a view of the whole output": (
        "tp-sp", 2, MLA | {"b": 1, "s": 2, "dropout": 0.0}),
    "latent attention at b = s = 1, one head per rank: V is a view of the kv up projection's output": (
        "tp", 2, MLA | {"b": 1, "s": 1, "a": 2, "dropout": 0.0}),
    # found by the random audit: the checkpointed core runs without grad, so its inputs are named where made
    "latent attention selective, b = 3, s = 6: the checkpoint keeps the contiguous q, k, v": (
        "none", 1, MLA | {"b": 3, "s": 6, "a": 2, "recompute": "selective", "dropout": 0.0}),
    "latent attention selective tp-sp": ("tp-sp", 2, MLA | {"recompute": "selective"}),
    "latent attention selective at b = s = 1, one head per rank: V a view": (
        "tp", 2, MLA | {"b": 1, "s": 1, "a": 2, "recompute": "selective", "dropout": 0.0}),
}


def _measured(tp, config, strategy):
    return runner.run_layer(tp, config, STRATEGIES[strategy])


def _differences(config, strategy, saved):
    prediction = estimate(config, STRATEGIES[strategy], Accounting(exact=True, device="cpu"))
    return [row.describe() for row in compare(prediction, saved) if not row.matches]


@pytest.mark.parametrize("case", list(CASES))
def test_megatrons_layer_as_rank_0_keeps_what_the_megatron_rules_predict(case):
    strategy, t, knobs = CASES[case]
    config = build_config(SIZES | knobs | {"t": t})
    mode = "single" if t == 1 else "fake"
    (saved,) = run(_measured, (config, strategy), mode=mode, t=t)
    assert _differences(config, strategy, saved) == []


@pytest.mark.procs
def test_two_gloo_ranks_of_megatrons_layer_each_keep_what_the_rules_predict():
    config = build_config(SIZES | SWIGLU | GQA | {"t": 2, "dropout": 0.1})
    per_rank = run(_measured, (config, "tp-sp"), mode="spawn", t=2, backend="gloo", timeout_s=240)
    assert [_differences(config, "tp-sp", saved) for saved in per_rank] == [[], []]


WINDOW = {"inside": {}, "s=16": {"s": 16}, "b*a=12, not a multiple of 8": {"b": 3, "a": 4}}
SOFTMAX = {  # Megatron-LM's default first: fused, and the unfused softmax in 16 bits
    "default": {}, "softmax in fp32": {"attention_softmax_in_fp32": True},
    "unfused": {"masked_softmax_fusion": False},
    "unfused, in fp32": {"masked_softmax_fusion": False, "attention_softmax_in_fp32": True},
}


@pytest.mark.parametrize("softmax", list(SOFTMAX))
@pytest.mark.parametrize("window", list(WINDOW))
def test_megatrons_softmax_keeps_what_its_two_knobs_say_inside_and_outside_the_fused_window(window, softmax):
    """The fused kernel runs where masked_softmax_fusion is on and the sizes fit it, keeping its bf16 output alone;
    elsewhere forward_torch_softmax keeps masked_fill_'s (s, s) mask and its softmax: fp32 with
    attention_softmax_in_fp32, else bf16. Both knobs reach megatron's TransformerConfig, and the rules agree."""
    config = build_config(SIZES | WINDOW[window] | SOFTMAX[softmax] | {"dropout": 0.0})
    (saved,) = run(_measured, (config, "none"), mode="single", t=1)
    fused = config.masked_softmax_fusion and window == "inside"
    b, a, s = config.b, config.a, config.s
    fp32 = [(x.nbytes, x.name) for x in saved if x.dtype == "float32"]
    wide = not fused and config.attention_softmax_in_fp32
    assert fp32 == ([(b * a * s * s * 4, "attention/softmax_fp32")] if wide else [])
    assert [x.shape for x in saved if x.dtype == "bool"] == ([] if fused else [(s, s)])  # masked_fill_'s mask
    assert _differences(config, "none", saved) == []


def test_flash_attention_is_refused_for_the_local_spec():
    config = build_config(SIZES | {"attention": "flash"})
    with pytest.raises(ProbeError, match="Transformer Engine"):
        run(_measured, (config, "none"), mode="single", t=1)


@pytest.mark.parametrize("again", [("other", 1234), ("model-parallel-rng", 99)], ids=["seed", "name"])
def test_the_cpu_rng_tracker_keeps_megatrons_refusal_of_a_seed_or_name_added_twice(again):
    """The shim's tracker adds through megatron's own CudaRNGStatesTracker.add (on the CPU generator), so its checks
    still run: a seed or a state name added twice raises as on a GPU; a state added once forks to its own seed's."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    from memcalc.probe.libs.megatron_shim import cpu_megatron

    with cpu_megatron():
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("model-parallel-rng", 1234)
        with pytest.raises(Exception, match="already exists"):
            tracker.add(*again)
        with tracker.fork("model-parallel-rng"):
            drawn = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(drawn, torch.rand(3))
