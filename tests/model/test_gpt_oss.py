"""gpt-oss under --impl hf: the knobs that say GptOssDecoderLayer (attention_sinks, mlp swiglu_clamped), what its
layer keeps in the ledger, and the knob values its layer does not run, refused in one line."""

from __future__ import annotations

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import estimate
from memcalc.model.impls import IMPLEMENTATIONS, left_out, strategies_of
from memcalc.model.knobs import Accounting, Knobs
from memcalc.model.strategy import STRATEGIES

GPT_OSS = {"impl": "hf", "family": "gpt_oss", "norm": "rmsnorm_fp32w", "mlp": "swiglu_clamped", "attention_sinks": True,
           "attention": "eager", "dropout": 0.0, "num_experts": 4, "moe_router_topk": 2}
SIZES = {"b": 2, "s": 9, "h": 32, "a": 4, "num_query_groups": 2, "kv_channels": 16, "moe_ffn_hidden_size": 32,
         "sliding_window": 5}
EXACT = Accounting(exact=True, device="cpu")


def _bytes(knobs: dict) -> dict[str, int]:
    config = build_config(SIZES | GPT_OSS | knobs)
    return {row.tensor.name: row.bytes for row in estimate(config, STRATEGIES["none"], EXACT).tensors}


def test_the_sink_column_widens_the_kept_softmax_to_s_plus_one_keys_in_the_activation_dtype():
    kept = _bytes({})
    b, s, a = SIZES["b"], SIZES["s"], SIZES["a"]
    assert kept["attention/sink_softmax"] == 2 * b * a * s * (s + 1)  # bf16, the sink column included
    assert kept["attention/sink_max_indices"] == 8 * b * a * s  # max's int64 indices, one a row
    assert "attention/softmax_fp32" not in kept and "attention/weights" not in kept  # weights x V reads a view


def test_the_half_head_rope_tables_and_the_routers_top_k_softmax_are_kept():
    kept = _bytes({})
    assert kept["attention/rope_cos_half"] == kept["attention/rope_sin_half"] == 2 * SIZES["s"] * 16 // 2
    assert kept["moe/router_topk_softmax"] == 2 * SIZES["b"] * SIZES["s"] * 2  # (b, s, k) in bf16
    assert "moe/router_probs_fp32" not in kept and "moe/topk_sum_fp32" not in kept


def test_the_clamped_glu_keeps_five_expert_width_tensors_a_slot_beside_gate_up_and_down_s_input():
    r = 2 * SIZES["b"] * SIZES["s"]  # k*b*s slots, balanced
    kept = _bytes({})
    glu = ("moe/glu_gate_clamped", "moe/glu_sigmoid", "moe/glu_up_plus_one", "moe/glu_out", "moe/expert_fc2_in")
    assert [kept[name] for name in glu] == [2 * r * 32] * 5
    assert kept["moe/glu_gate_in"] + kept["moe/glu_up_in"] == 2 * r * 64  # gate_up's (r, 2e) output
    assert "moe/expert_silu_out" not in kept


def test_grouped_mm_keeps_the_sorted_expert_ids_its_bias_gather_reads_and_the_eager_loop_does_not():
    assert _bytes({})["moe/sorted_expert_ids"] == 8 * 2 * SIZES["b"] * SIZES["s"]
    assert "moe/sorted_expert_ids" not in _bytes({"experts_implementation": "eager"})


def test_attention_dropout_keeps_the_mask_and_the_dropped_out_weights_beside_the_sink_softmax():
    kept, dropped = _bytes({}), _bytes({"dropout": 0.1})
    b, s, a = SIZES["b"], SIZES["s"], SIZES["a"]
    assert {k: v for k, v in dropped.items() if k not in kept} == {"attention/dropout_mask": b * a * s * s,
                                                                  "attention/dropout_out": 2 * b * a * s * s}
    assert dropped["attention/sink_softmax"] == kept["attention/sink_softmax"]


def test_sliding_and_full_layers_are_one_ledger_so_a_window_shorter_than_s_changes_nothing():
    assert _bytes({"sliding_window": 3}) == _bytes({"sliding_window": None}) == _bytes({})


def test_gpt_oss_runs_no_tp_and_says_why_in_one_line():
    knobs = Knobs(**GPT_OSS)
    assert strategies_of(knobs) == ("none",)
    (line,) = [x for x in left_out(knobs) if x.startswith("tp ")]
    assert "GptOssConfig's base_model_tp_plan names only embed_tokens" in line and "\n" not in line


@pytest.mark.parametrize("knobs, words", [
    ({"attention": "flash"}, "GptOssDecoderLayer runs eager attention only: GptOssPreTrainedModel has _supports_sdpa"
                             " False"),
    ({"attention_sinks": False}, "GptOssDecoderLayer, which needs attention_sinks True"),
    ({"mlp": "swiglu"}, "GptOssDecoderLayer, which needs mlp swiglu_clamped"),
    ({"num_experts": None, "moe_ffn_hidden_size": None}, "every GptOssDecoderLayer is sparse: set num_experts"),
    ({"norm": "rmsnorm"}, "no transformers layer has norm rmsnorm with mlp swiglu_clamped"),
    ({"moe_router_pre_softmax": True}, "GptOssTopKRouter softmaxes the k chosen logits"),
])
def test_knobs_gpt_oss_s_layer_does_not_run_are_refused(knobs, words):
    with pytest.raises(ConfigError, match=words):
        IMPLEMENTATIONS["hf"].check(build_config(SIZES | GPT_OSS | knobs))
