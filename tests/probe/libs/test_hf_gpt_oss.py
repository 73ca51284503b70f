"""transformers' GptOssDecoderLayer keeps, tensor by tensor, what memcalc's hf rules predict.

Its default paths: eager attention (GptOssPreTrainedModel refuses sdpa) with the sinks, and the experts by grouped_mm
(transformers' default) and by the eager loop. Layer 0 is built as the config class makes it, a sliding-window layer,
or as a full-attention one (`layer_type`), and fed the mask GptOssModel gives that kind; at s past the window and
within it. The router is forced (balanced, all-to-one) so each expert's tokens are known; with the real router every
tensor lies within the balanced and worst bounds.
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.group import single  # noqa: E402
from memcalc.probe.libs import hf as runner  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402
from tests.cli import memcalc_cli  # noqa: E402
from . import assert_exact, assert_within_bounds  # noqa: E402

# torch._grouped_mm wants 16-byte strides: h and the expert width multiples of 8 in bf16. A window of 5.
GPT_OSS = {"impl": "hf", "family": "gpt_oss", "norm": "rmsnorm_fp32w", "mlp": "swiglu_clamped", "attention_sinks": True,
           "attention": "eager", "dropout": 0.0, "b": 2, "s": 8, "h": 32, "a": 4, "num_query_groups": 2,
           "kv_channels": 16, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "sliding_window": 5}
PATHS = ("grouped_mm", "eager")  # experts_implementation: transformers' default first
SLIDING, FULL = "sliding_attention", "full_attention"
CPU = Accounting(exact=True, device="cpu")

CASES = {
    "sliding layer, b=2, s=8 past the window": ({}, SLIDING),
    "full layer, b=2, s=8": ({}, FULL),
    "sliding layer at b=1, odd s=7 past the window": ({"b": 1, "s": 7}, SLIDING),
    "full layer at b=1, odd s=7": ({"b": 1, "s": 7}, FULL),
    "sliding layer within the window, b=3, s=3": ({"b": 3, "s": 3}, SLIDING),
    "one k/v group at b=1: matmul keeps K and V themselves": ({"b": 1, "s": 7, "num_query_groups": 1}, SLIDING),
    "multi-head, top-1 of 4, heads of 8, h=48": ({"a": 6, "num_query_groups": None, "kv_channels": 8, "h": 48,
                                                  "moe_router_topk": 1}, FULL),
    "fp32": ({"dtype": "fp32", "s": 9}, SLIDING),
    "attention dropout: its mask and the dropped-out weights, which weights x V keeps in place of the view":
        ({"dropout": 0.1}, SLIDING),
    "attention dropout at b=1, odd s, full layer": ({"dropout": 0.1, "b": 1, "s": 7}, FULL),
    "gradient checkpointing keeps the layer's input": ({"recompute": "full"}, SLIDING),
}


def _rows(knobs: dict, route: str | None, layer_type: str, bound: str = "balanced"):
    config = build_config(GPT_OSS | knobs | {"moe_tokens": bound})
    saved = runner.run_layer(single("cpu"), config, STRATEGIES["none"], route=route, layer_type=layer_type)
    return compare(estimate(config, STRATEGIES["none"], CPU), saved)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("route", ["balanced", "all-to-one"])
@pytest.mark.parametrize("knobs, layer_type", CASES.values(), ids=CASES.keys())
def test_a_forced_router_makes_gpt_oss_s_layer_keep_exactly_what_the_rules_predict(knobs, layer_type, route, path):
    assert_exact(_rows(knobs | {"experts_implementation": path}, route, layer_type))


@pytest.mark.parametrize("path", PATHS)
def test_a_sliding_layer_keeps_what_a_full_one_keeps_past_the_window_so_memcalc_counts_l_alike(path):
    """The window is a mask added to the whole (s, s) scores under eager attention: every tensor is the same."""
    sliding, full = (_rows({"s": 13, "experts_implementation": path}, "balanced", kind) for kind in (SLIDING, FULL))
    assert [(row.name, row.measured) for row in sliding] == [(row.name, row.measured) for row in full]


def test_the_sink_column_is_kept_in_the_softmax_s_output_and_weights_x_v_reads_a_view_of_it():
    rows = {row.name: row for row in _rows({"b": 1, "s": 7}, "balanced", SLIDING)}
    assert rows["attention/sink_softmax"].measured_shape == (1, 4, 7, 8)  # s + 1 columns
    assert "attention/weights" not in rows and "attention/softmax_fp32" not in rows


@pytest.mark.parametrize("path", PATHS)
def test_with_the_real_router_each_tensor_lies_within_the_balanced_and_worst_bounds(path):
    knobs = {"experts_implementation": path}
    assert_within_bounds(_rows(knobs, None, SLIDING), _rows(knobs, "balanced", SLIDING, bound="balanced"),
                         _rows(knobs, "balanced", SLIDING, bound="worst"))


def test_measure_reads_the_config_gpt_oss_s_class_wrote_and_agrees_to_the_byte():
    run = memcalc_cli("measure", "--impl", "hf", "--hf-config", "tests/data/hf/gpt-oss-tiny.json", "--s", "7",
                      "--b", "1", "--route", "balanced")
    assert run.code == 0, run.err
    assert "match: every tensor agrees to the byte" in run.out

