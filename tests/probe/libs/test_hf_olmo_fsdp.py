"""transformers' OlmoForCausalLM and Olmo2ForCausalLM sharded by torch's FSDP2 (accelerate's layout: each decoder
layer, then the root) over dp_shard = 2 ranks of the fake group, with and without reshard_after_forward, under
FSDPMemTracker, against the hf step timeline: the peak, each category at it and the state between steps to the byte,
the peak's moment, and every moment in order. FSDP2's MixedPrecisionPolicy casts the model's fp32 RoPE tables to bf16
at each layer's pre-forward, before its all-gather (hf_olmo.cast_inputs): that layer's RoPE keeps its own copies,
and is Llama's; under gradient checkpointing (transformers checkpoints the layer's forward, FSDP2's hooks outside
it) the checkpoint's frame holds them to the layer's backward. OlmoLayerNorm has no weights, so no FSDP2
parameter."""

import json

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.model.impls import hf as rules  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.step import measure_step  # noqa: E402
from memcalc.sizing.timeline import timeline  # noqa: E402

from ..step_readings import assert_moments_in_order  # noqa: E402
from tests.cli import memcalc_cli  # noqa: E402
from .test_hf_fsdp import _readings  # noqa: E402
from tests.helpers import LLAMA_HF, make_config  # noqa: E402

CPU = Accounting(exact=True, device="cpu")
OLMO = LLAMA_HF | {"vocab_size": 256, "family": "olmo", "norm": "layernorm_np", "attention": "flash", "dp_shard": 2}
OLMO2 = OLMO | {"family": "olmo2", "norm": "rmsnorm_fp32w", "post_norm": True, "qk_layernorm": True}
SHAPES = {  # b = 1 and 3, odd s, a/g = 1, 3 and 4, eager and SDPA, tied, fp32 (no cast: the tables are fp32 already)
    "b=2 s=24 a/g=4": {},
    "b=1 s=13 a/g=1 eager": {"b": 1, "s": 13, "attention": "eager", "num_query_groups": 8},
    "b=3 s=9 a/g=3 eager tied": {"b": 3, "s": 9, "h": 48, "a": 6, "num_query_groups": 2, "tie_embeddings": True,
                                 "attention": "eager"},
    "b=3 s=7 a/g=4": {"b": 3, "s": 7},
    "b=1 s=11 a/g=2 fp32": {"b": 1, "s": 11, "num_query_groups": 4, "dtype": "fp32"},
    "b=3 s=63 dp_shard=4 eager": {"dp_shard": 4, "b": 3, "s": 63, "h": 32, "a": 4, "num_query_groups": 1,
                                  "ffn_hidden_size": 64, "attention": "eager"},
    "b=2 s=24 a/g=4 checkpointed": {"recompute": "full"},
    "b=1 s=13 a/g=1 eager checkpointed": {"b": 1, "s": 13, "attention": "eager", "num_query_groups": 8,
                                          "recompute": "full"},
    "b=3 s=9 L=3 dp_shard=4 checkpointed": {"b": 3, "s": 9, "L": 3, "dp_shard": 4, "num_query_groups": 4,
                                            "recompute": "full"},
}
CASES = {f"{family} {shape}": base | changes for family, base in (("olmo", OLMO), ("olmo2", OLMO2))
         for shape, changes in SHAPES.items()}
RESHARD = [True, False]


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("name", CASES)
def test_the_peak_its_moment_every_category_and_the_steady_state_are_fsdpmemtrackers_to_the_byte(one_thread, name,
                                                                                                 reshard):
    (r,) = measure_step(make_config(CASES[name], reshard_after_forward=reshard), ["none"])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.measured.moment == r.predicted_moment


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_olmo_under_tp_on_a_2d_mesh_is_fsdpmemtrackers_to_the_byte(one_thread, recompute):
    (r,) = measure_step(make_config(OLMO, t=2, recompute=recompute), ["tp"])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.measured.moment == r.predicted_moment


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("name", ["olmo b=2 s=24 a/g=4", "olmo2 b=1 s=13 a/g=1 eager",
                                  "olmo b=1 s=13 a/g=1 eager checkpointed", "olmo2 b=2 s=24 a/g=4 checkpointed"])
def test_every_moment_the_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, name, reshard):
    config = make_config(CASES[name], reshard_after_forward=reshard)
    assert_moments_in_order(timeline(config, STRATEGIES["none"], CPU).moments[1:], _readings(config))


@pytest.mark.parametrize("name", ["olmo b=1 s=13 a/g=1 eager", "olmo2 b=3 s=7 a/g=4"])
def test_each_layer_casts_the_models_fp32_tables_to_a_bf16_pair_of_its_own_before_its_all_gather(name):
    config = make_config(CASES[name])
    moments = timeline(config, STRATEGIES["none"], CPU).moments
    pair = 2 * config.s * config.head_dim  # a bf16 (1, s, d) table
    for i in range(config.L):
        where = [m for m in moments if m.phase == "forward" and m.where == f"model.layers.{i}"]
        cos, sin, gather = where[:3]
        assert "cos" in cos.what and "sin" in sin.what and "all-gather" in gather.what
        cast = {x.name: x.bytes for x in sin.live if x.name.startswith(f"layers.{i}/attention/rope_")}
        assert cast == {f"layers.{i}/{x.name}": pair for x in rules.OLMO_ROPE_CAST}


@pytest.mark.parametrize("name", ["olmo b=3 s=7 a/g=4", "olmo2 b=1 s=13 a/g=1 eager checkpointed"])
def test_estimate_totals_json_reports_the_measured_peak(one_thread, tmp_path, name):
    fields = dict(CASES[name])
    shards = fields.pop("dp_shard")
    (r,) = measure_step(make_config(CASES[name]), ["none"])
    path = tmp_path / "olmo.yaml"
    path.write_text(yaml.safe_dump(fields))
    result = memcalc_cli("estimate", "--config", str(path), f"--dp-shard={shards}", "--strategy=none", "--totals",
                         "--json")
    assert result.code == 0, result.err
    (stage,) = json.loads(result.out)["per_gpu"]["strategies"]["none"]["stages"]
    assert (stage["peak_bytes"], stage["peak_moment"]) == (r.measured.peak_bytes, r.predicted.peak.label())
