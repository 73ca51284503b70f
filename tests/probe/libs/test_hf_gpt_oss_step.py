"""One training step of transformers' own GptOssForCausalLM (GptOssRMSNorm, q/k/v/o biases, RoPE on two halves, the
eager core with attention sinks (and dropout), sliding and full layers, GptOssTopKRouter's softmax over the top k, the clamped GLU
experts with biases under grouped_mm) against the hf step walk (memcalc.sizing.timeline.hf_gpt_oss): at sizes that put
the peak in twelve different places, every moment the walk names is MemTracker's reading after some op, in order, and
the peak, each category at it and between steps are MemTracker's to the byte."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from tests.helpers import make_config  # noqa: E402

from .test_hf_step import CPU, _exact_step  # noqa: E402

# tests/data/hf/gpt-oss-tiny.json as memcalc reads it (two layers, sliding then full, a window of 5); torch._grouped_mm
# wants 16-byte strides: h and the expert width multiples of 8 in bf16
GPT_OSS = {"impl": "hf", "family": "gpt_oss", "norm": "rmsnorm_fp32w", "mlp": "swiglu_clamped", "attention_sinks": True,
           "attention": "eager", "dropout": 0.0, "b": 1, "s": 7, "h": 32, "a": 4, "num_query_groups": 2, "L": 2,
           "kv_channels": 16, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "sliding_window": 5,
           "vocab_size": 64, "add_bias_linear": True, "tie_embeddings": False, "position_embedding_type": "rope"}
NARROW = {"h": 16, "vocab_size": 8}  # the layers' moments outweigh the ends

# each peaks in a different place: the comment says where
PEAKS = [
    {},  # gate_up_proj's grouped GEMMs
    {"b": 3, "s": 5},  # the loss's backward
    {"b": 3, "dtype": "fp32"},  # lm_head's GEMMs
    NARROW | {"b": 1, "s": 31, "a": 8},  # forward: (up + 1) * glu, the clamped up and the gate_up biases beside it
    NARROW | {"b": 1, "s": 31, "a": 2, "num_query_groups": 1, "kv_channels": 8, "moe_ffn_hidden_size": 8},  # slot order
    NARROW | {"b": 1, "s": 9, "moe_ffn_hidden_size": 64, "num_experts": 8, "moe_router_topk": 4},  # down_proj's GEMMs
    NARROW | {"b": 1, "s": 3, "a": 16, "kv_channels": 64},  # o_proj's bias
    # one slot a token: the final norm's backward, and forward; the core's maxima subtracted, its output, QK^T's backward
    *(NARROW | {"b": 1, "s": s, "a": a, "num_query_groups": g, "kv_channels": d, "moe_ffn_hidden_size": 8,
                "moe_router_topk": 1} for s, a, g, d in ((5, 2, 1, 8), (31, 2, 1, 8), (31, 8, 1, 8), (31, 8, 2, 64),
                                                         (31, 8, 1, 64))),
]


def test_the_sizes_put_the_peak_in_twelve_different_places():
    peaks = {timeline(make_config(GPT_OSS, **c), STRATEGIES["none"], CPU).peak.label() for c in PEAKS}
    assert len(peaks) == len(PEAKS), peaks


@pytest.mark.parametrize("changes", [
    *PEAKS,
    {"b": 3, "s": 9, "a": 8, "kv_channels": 8},  # a/g = 4
    {"b": 3, "s": 5, "num_query_groups": 4},  # multi-head
    {"b": 1, "s": 7, "num_query_groups": 1},  # one K/V group at b = 1: matmul keeps K and V themselves
    {"b": 3, "s": 7, "num_query_groups": 1},  # at b > 1 matmul copies V as weights x V runs
    {"b": 3, "s": 3, "L": 1, "dtype": "fp32"},  # within the window
    {"h": 8, "vocab_size": 8, "b": 2, "s": 11, "a": 2, "num_query_groups": 1, "kv_channels": 64},
    # attention dropout: its bool mask, and the dropped-out weights, which weights x V keeps
    {"b": 1, "s": 7, "dropout": 0.1},
    {"b": 3, "s": 9, "dropout": 0.1, "num_query_groups": 1},
    {"b": 3, "s": 5, "dropout": 0.1, "dtype": "fp32", "num_query_groups": 4},
    NARROW | {"b": 1, "s": 31, "a": 8, "num_query_groups": 1, "kv_channels": 8, "moe_ffn_hidden_size": 8,
              "moe_router_topk": 1, "dropout": 0.1},  # the peak at native_dropout
], ids=str)
def test_gpt_oss_s_step_happens_in_order_and_peaks_where_the_timeline_says_to_the_byte(one_thread, changes):
    r = _exact_step(make_config(GPT_OSS, **changes), "none", "balanced")
    assert r.model == "transformers' GptOssForCausalLM, router forced balanced"


@pytest.mark.parametrize("changes, named", [
    ({"recompute": "full"}, "recompute full \\(gradient checkpointing\\) in gpt-oss's model"),
    ({"experts_implementation": "eager"}, "gpt-oss's experts by the eager loop"),
    ({"dp_shard": 2}, "gpt-oss's model under dp_shard or zero_stage"),
    ({"s": 1}, "one token \\(b = s = 1\\) in gpt-oss's model"),
])
def test_what_the_gpt_oss_walk_does_not_model_is_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match=named):
        timeline(make_config(GPT_OSS, **changes), STRATEGIES["none"], CPU)
