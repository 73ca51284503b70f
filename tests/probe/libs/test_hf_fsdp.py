"""transformers' LlamaForCausalLM sharded by torch's own FSDP2 (`fully_shard` on each decoder layer and the root,
bf16 parameters, fp32 reduce) over dp_shard = 2, 4 and 8 ranks of the fake group, with and without
reshard_after_forward, under torch's FSDPMemTracker, against the hf step timeline with FSDP2's ops: the peak, each
category at it and the state between steps to the byte, the peak's moment, every moment in order, and
`estimate --totals --json`'s peak. Mixtral, Qwen2-MoE and Qwen3-MoE too, their experts by grouped_mm (the router
forced balanced or all-to-one) and by the eager loop (balanced)."""

import json

import pytest
import yaml

pytest.importorskip("torch")
pytest.importorskip("transformers")

from math import prod  # noqa: E402

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import check_strategy  # noqa: E402
from memcalc.model.families import FAMILIES, layer_family  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run_fake  # noqa: E402
from memcalc.probe.libs import hf_tp  # noqa: E402
from memcalc.probe.libs.hf_fsdp import FSDP_CATEGORIES, FsdpMomentTracker, warmed_up_sharded  # noqa: E402
from memcalc.probe.libs.hf_step import causal_lm  # noqa: E402
from memcalc.probe.step import categories, measure_step  # noqa: E402
from memcalc.sizing.pipeline import pipeline_stages  # noqa: E402
from memcalc.sizing.states import state_bytes, total_params  # noqa: E402
from memcalc.sizing.timeline import OPTIMIZER, PARAMETERS, timeline  # noqa: E402
from memcalc.sizing.timeline.fsdp import Fsdp, stage_params  # noqa: E402
from memcalc.sizing.timeline.zero import Zero  # noqa: E402
from memcalc.sizing.totals import per_gpu  # noqa: E402

from . import test_hf as hf  # noqa: E402
from .test_hf_gpt_oss import GPT_OSS  # noqa: E402
from ..step_readings import assert_moments_in_order, reading_every_op  # noqa: E402
from tests.cli import memcalc_cli  # noqa: E402
from tests.helpers import LLAMA_HF, make_config  # noqa: E402

# Llama-style, as tests/probe/libs/test_hf_step.py's, with every weight's first dimension a multiple of 8.
LLAMA = LLAMA_HF | {"vocab_size": 256, "attention": "flash"}
SHARDS = [2, 4, 8]
RESHARD = [True, False]


@pytest.fixture(scope="module")
def measured(one_thread):
    return {(n, reshard): measure_step(make_config(LLAMA, dp_shard=n, reshard_after_forward=reshard), ["none"])[0]
            for n in SHARDS for reshard in RESHARD}


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("n", SHARDS)
def test_the_peak_every_category_and_the_steady_state_are_fsdpmemtrackers_to_the_byte(measured, n, reshard):
    r = measured[n, reshard]
    assert [row.difference for row in r.rows("peak")] == [0] * 6, r.rows("peak")
    assert [row.difference for row in r.rows("steady")] == [0] * 6, r.rows("steady")
    assert r.matches and r.moment_matches, (r.predicted_moment, r.measured.moment)


@pytest.mark.parametrize("n", SHARDS)
def test_between_steps_each_rank_holds_16_bytes_a_parameter_over_dp_shard(measured, n):
    """fp32 shards, AdamW's m and v (and a 4-byte step per parameter tensor); gradients set to None."""
    steady = measured[n, True].measured.steady
    config = make_config(LLAMA, dp_shard=n, reshard_after_forward=True)
    params = total_params(config)
    rotary = 2 * 4 * (LLAMA["h"] // LLAMA["a"] // 2)  # LlamaRotaryEmbedding's two fp32 (d/2,) buffers
    assert steady[PARAMETERS] == 4 * params // n + rotary
    tensors = 9 * LLAMA["L"] + 3  # nine a decoder layer; embedding, final norm, lm_head
    assert steady[OPTIMIZER] == 8 * params // n + 4 * tensors
    assert sum(state_bytes(config, params).values()) == 16 * params // n


# Each family's model as tests/probe/libs/test_hf.py builds its layer, with h 40 over 4 heads of 10, v 101, f 71 and
# s 5 learned positions: of its parameters' first dimensions most do not divide by 3 (Gemma's 4 heads of 16: 64)
AT_3 = {"b": 1, "s": 5, "h": 40, "a": 4, "num_query_groups": 2, "kv_channels": None, "vocab_size": 101,
        "ffn_hidden_size": 71}
EXPERTS = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48}  # dim 0 of each expert weight: 4 -> 6
PADDED_FAMILIES = {
    "llama": {"h": 250, "a": 5, "num_query_groups": 5, "vocab_size": 509, "ffn_hidden_size": 701},
    "mistral": {"family": "mistral"},
    "qwen2 (q, k, v biases)": {"family": "qwen2", "add_qkv_bias": True},
    "qwen3 (q_norm, k_norm)": hf.QWEN3,
    "gpt2 (Conv1D, learned positions)": hf.GPT2 | {"family": "gpt2", "mlp": "gelu_tanh", "add_bias_linear": True,
                                                  "num_query_groups": None,
                                                  "position_embedding_type": "learned_absolute"},
    "gpt_oss (biases, sinks, experts)": {k: v for k, v in GPT_OSS.items() if k not in ("h", "a", "s", "b")},
    "phi3 (qkv_proj, gate_up_proj)": hf.PHI3,
    "glm (gate_up_proj)": hf.GLM | {"kv_channels": None},
    "glm4 (gate_up_proj, four norms)": hf.GLM | {"family": "glm4", "sandwich_norm": True, "kv_channels": None},
    "gemma": hf.GEMMA,
    "gemma2 (four norms)": hf.GEMMA2,
    "gemma3_text (four norms, q_norm, k_norm)": hf.GEMMA3,
    "cohere (one norm, (heads, d) q_norm, k_norm)": hf.COHERE | {"qk_layernorm": True},
    "starcoder2 (biases, LayerNorm)": hf.STARCODER2 | {"add_bias_linear": True},
    "falcon (multi-query query_key_value)": hf.FALCON | {"position_embedding_type": "rope"},
    "falcon (new_decoder_architecture)": hf.FALCON40 | {"position_embedding_type": "rope"},
    "olmo (LayerNorm without weights)": {"family": "olmo", "norm": "layernorm_np"},
    "olmo2 (post-norms, whole-projection q_norm, k_norm)": hf.OLMO2,
    "deepseek_v3 (latent attention)": hf.MLA | {"attention": "eager", "num_query_groups": None},
    "deepseek_v3 (experts)": hf.MLA | EXPERTS | {"attention": "eager", "num_query_groups": None,
                                                  "moe_shared_expert_intermediate_size": 48,
                                                  "moe_router_score_function": "sigmoid"},
    "mixtral": {"family": "mixtral"} | EXPERTS,
    "qwen2_moe": {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 40, "moe_layer_freq": 2} | EXPERTS,
    "qwen3_moe": hf.QWEN3 | {"family": "qwen3_moe"} | EXPERTS,
    "bloom (word_embeddings_layernorm)": hf.BLOOM | {"ffn_hidden_size": None, "num_query_groups": None,
                                                     "add_bias_linear": True},
    "gpt_neox (MLP biases without attention biases)": hf.NEOX | {"num_query_groups": None},
    "gptj (MLP biases, lm_head's bias)": hf.GPTJ | {"num_query_groups": None},
}


@pytest.mark.parametrize("family", PADDED_FAMILIES)
def test_at_dp_shard_3_fsdp2s_state_between_steps_is_the_totals_padded_model_states(one_thread, family):
    """fully_shard pads each parameter's dim 0 to a multiple of dp_shard: on each family's own model the measured fp32
    shards are --totals' weights, AdamW's states its m and v and a 0-d step per parameter (--totals split the
    parameters' sum evenly, short by the padding: Llama's at h 250, v 509, f 701 by 11,084 B of each; Qwen2's, GPT-2's,
    gpt-oss's, Phi-3's, GLM's, Gemma 2's and 3's, Cohere's, StarCoder 2's and DeepSeek-V3's experts' too; Falcon's it
    padded as Llama's modules, short too; BLOOM's, GPT-NeoX's and GPT-J's it counted short of their own parameters,
    and so split evenly)."""
    _assert_measured_shards_are_the_totals_states(make_config(LLAMA | AT_3 | PADDED_FAMILIES[family], dp_shard=3))


def test_under_tp_a_vocabulary_t_does_not_divide_is_padded_from_rank_0s_rows(one_thread):
    """transformers' tp_plan splits embed_tokens and lm_head into uneven DTensor shards (v 101 over t 2: rank 0 holds
    51 rows), whose dim 0 fully_shard pads over dp_shard 3 in turn: --totals' states are rank 0's measured shards
    (it split the parameters' sum evenly: 1,052 B of weights and 2,104 B of AdamW's states too few)."""
    _assert_measured_shards_are_the_totals_states(make_config(LLAMA | AT_3, ffn_hidden_size=70, t=2, dp_shard=3), "tp")


def test_every_family_memcalc_reads_has_its_parameters_checked_shape_by_shape():
    shaped = {layer_family(make_config(LLAMA | AT_3 | x)).name for x in PADDED_FAMILIES.values()}
    assert shaped == {x.name for x in FAMILIES.values() if x.runs_as is None}


# transformers has no tp plan for these (GPT-2, BLOOM, Falcon), or memcalc has not measured it (GPT-NeoX, latent
# attention, Cohere's (heads, d) q_norm), or it shards no layer (gpt-oss): memcalc.model.impls.hf refuses tp
TP_REFUSED = {"gpt2", "bloom", "falcon", "gpt_neox", "deepseek_v3", "gpt_oss"}


@pytest.mark.parametrize("family", PADDED_FAMILIES)
def test_under_tp_each_rank_holds_the_parameters_the_count_gives_it(one_thread, family):
    """transformers' tp_plan (from_pretrained(tp_plan="auto")'s, as the probe applies it) over t 2 leaves rank 0 the
    parameters --totals counts (the embedding's, lm_head's and GPT-J's lm_head bias's 51 of v 101 rows, colwise
    weights and biases halved, rowwise biases and the norms whole); tp is refused where there is no plan to apply."""
    knobs = LLAMA | AT_3 | PADDED_FAMILIES[family]
    if layer_family(make_config(knobs)).name in TP_REFUSED or family.startswith("cohere"):
        with pytest.raises(ConfigError, match="does not run tp"):
            check_strategy(make_config(knobs), STRATEGIES["tp"])
        return
    knobs |= AT_3 if family == "llama" else {}  # t must divide a, the groups and f
    config = make_config(knobs | ({"ffn_hidden_size": 70} if knobs["ffn_hidden_size"] == 71 else {}), t=2)
    held = sum(per_gpu(config, STRATEGIES["tp"]).worst().params.values())
    assert held == run_fake(_rank_parameters, (config,), config.t)


def _rank_parameters(tp, config) -> int:
    """The elements of the parameters this rank holds once the probe lays the family's model out by its tp_plan."""
    model, _ = causal_lm(config, "balanced" if config.moe else None, torch.float32, tp.device)
    hf_tp.apply(model, hf_tp.model_plan(model, tp.size), tp)
    return sum((x.to_local() if isinstance(x, DTensor) else x).numel() for x in model.parameters())


@pytest.mark.parametrize("family", PADDED_FAMILIES)
def test_the_parameters_fsdp2_and_zero3_pad_are_the_familys_own_model_shape_by_shape(family):
    """--totals pads the step walk's inventory of the parameters (Fsdp.of's units, Zero's groups), which it checks
    against the parameters it counts by their sum alone: each family's is its transformers model's, shape by shape (the
    walk laid Falcon's query_key_value out as Llama's q, k and v: as many elements, other rows to pad)."""
    knobs = LLAMA | AT_3 | PADDED_FAMILIES[family]
    config = make_config(knobs, dp_shard=3)
    model, _ = causal_lm(config, "balanced" if config.moe else None, torch.float32, torch.device("meta"))
    shapes = sorted(tuple(x.shape) for x in model.parameters())
    assert sorted(p.shape for unit in Fsdp.of(config, 1).units for p in unit.params) == shapes
    (stage,) = pipeline_stages(config)  # in registration order, the order ZeRO-1/2 partitions each group in
    assert [p.shape for p in stage_params(config, stage, 1)] == [tuple(x.shape) for x in model.parameters()]
    zero = Zero(make_config(knobs, zero_stage=3, dp=3))
    assert sorted(n for group in zero.groups for n in group) == sorted(map(prod, shapes))


def _assert_measured_shards_are_the_totals_states(config, strategy: str = "none") -> None:
    """Rank 0's fp32 shards are --totals' weights; its optimizer states AdamW's m and v and a 0-d step per parameter."""
    weights, optimizer, tensors = run_fake(_sharded_states, (config,), config.dp_shard * config.t)
    states = {x.name: x.bytes for x in per_gpu(config, STRATEGIES[strategy]).worst().terms}
    assert weights == states["states/weights"]
    assert optimizer == states["states/adam_m"] + states["states/adam_v"] + 4 * tensors


def _sharded_states(tp, config) -> tuple[int, int, int]:
    """FSDPMemTracker's sharded parameters and optimizer states between steps, and the parameters' count."""
    trainer = warmed_up_sharded(tp, config, "balanced" if config.moe else None)
    tracker = FsdpMomentTracker(trainer.model, trainer.optimizer)
    with tracker:
        steady = categories(tracker.get_tracker_snapshot("current"), {"Sharded Param": "weights", "OptState": "adam"})
    return steady["weights"], steady["adam"], len(list(trainer.model.parameters()))


def test_the_chosen_sizes_put_the_peak_in_forward_and_in_backward(measured):
    moments = {r.measured.moment.split()[0] for r in measured.values()}
    assert moments == {"forward", "backward"}


@pytest.mark.parametrize("reshard,reduce", [(True, "fp32"), (False, "fp32"), (True, "bf16")])
@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_every_moment_the_fsdp_walk_names_happens_in_order_in_its_module_with_its_bytes(one_thread, attention,
                                                                                         reshard, reduce):
    config = make_config(LLAMA, dp_shard=4, reshard_after_forward=reshard, attention=attention, reduce_dtype=reduce)
    predicted = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config))  # [0]: before the step


def _readings(config, route=None):
    """FSDPMemTracker's reading after every op of one step, on rank 0 of dp_replicate*dp_shard*t (with experts, the
    router forced to `route`)."""
    def on_rank(tp):
        trainer = warmed_up_sharded(tp, config, route)
        tracker = reading_every_op(FsdpMomentTracker, FSDP_CATEGORIES)(trainer.model, trainer.optimizer)
        tracker.readings = []
        with tracker:
            trainer.step()
        return tracker.readings

    return run_fake(on_rank, (), config.dp_replicate * config.dp_shard * config.t)


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_on_a_2d_mesh_every_moment_happens_in_order_with_its_bytes(one_thread, attention, reshard):
    """transformers' tp_plan over the mesh's inner dimension (t = 2), FSDP2 over its outer one (dp_shard = 2)."""
    config = make_config(LLAMA, dp_shard=2, reshard_after_forward=reshard, attention=attention, t=2)
    predicted = timeline(config, STRATEGIES["tp"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config))


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("n", [2, 4])
def test_on_a_2d_mesh_the_peak_and_the_steady_state_are_fsdpmemtrackers_to_the_byte(one_thread, n, reshard):
    (r,) = measure_step(make_config(LLAMA, dp_shard=n, reshard_after_forward=reshard, t=2), ["tp"])
    assert [row.difference for row in r.rows("peak")] == [0] * 6, r.rows("peak")
    assert [row.difference for row in r.rows("steady")] == [0] * 6, r.rows("steady")
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


@pytest.mark.parametrize("n", SHARDS)
def test_estimate_totals_json_reports_the_measured_peak(measured, tmp_path, n):
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(LLAMA))
    result = memcalc_cli("estimate", "--config", str(path), f"--dp-shard={n}", "--strategy=none", "--totals", "--json")
    assert result.code == 0, result.err
    (stage,) = json.loads(result.out)["per_gpu"]["strategies"]["none"]["stages"]
    assert stage["peak_bytes"] == measured[n, True].measured.peak_bytes
    assert stage["peak_moment"] == measured[n, True].predicted.peak.label()


def test_hsdp_replicates_the_shard_group_and_every_moment_is_fsdp2s_alone(one_thread):
    """HSDP over a (dp_replicate, dp_shard) mesh: the same states and transients as FSDP2 over dp_shard (its
    all-reduce across replicas runs in place on the reduce-scatter's output)."""
    config = make_config(LLAMA, dp_shard=2, reshard_after_forward=True, dp_replicate=2)
    cpu = Accounting(exact=True, device="cpu")
    predicted = timeline(config, STRATEGIES["none"], cpu)
    unreplicated = make_config(LLAMA, dp_shard=2, reshard_after_forward=True)
    assert predicted.moments == timeline(unreplicated, STRATEGIES["none"], cpu).moments
    assert_moments_in_order(predicted.moments[1:], _readings(config))


@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_hsdp_under_tp_on_a_3d_mesh_every_moment_happens_in_order_with_its_bytes(one_thread, attention):
    """transformers' tp_plan over the inner dimension of a (dp_replicate, dp_shard, t) mesh, HSDP over the outer two:
    FSDP2's moments over dp_shard on this rank's TP shards."""
    config = make_config(LLAMA, dp_shard=2, reshard_after_forward=True, attention=attention, t=2, dp_replicate=2)
    predicted = timeline(config, STRATEGIES["tp"], Accounting(exact=True, device="cpu"))
    assert predicted.moments == timeline(make_config(LLAMA, dp_shard=2, reshard_after_forward=True, attention=attention,
                                                     t=2), STRATEGIES["tp"],
                                         Accounting(exact=True, device="cpu")).moments
    assert_moments_in_order(predicted.moments[1:], _readings(config))


@pytest.mark.parametrize("reshard", RESHARD)
@pytest.mark.parametrize("replicas,n", [(2, 2), (2, 4), (4, 2)])
def test_hsdp_under_tp_the_peak_and_the_steady_state_are_fsdpmemtrackers_to_the_byte(one_thread, replicas, n,
                                                                                    reshard):
    (r,) = measure_step(make_config(LLAMA, dp_shard=n, reshard_after_forward=reshard, t=2, dp_replicate=replicas),
                        ["tp"])
    assert [row.difference for row in r.rows("peak")] == [0] * 6, r.rows("peak")
    assert [row.difference for row in r.rows("steady")] == [0] * 6, r.rows("steady")
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


@pytest.mark.parametrize("reshard", RESHARD)
def test_tied_embeddings_hand_fsdp2_the_two_gradients_summed_and_every_moment_happens_in_order(one_thread, reshard):
    config = make_config(LLAMA, dp_shard=2, reshard_after_forward=reshard, tie_embeddings=True)
    predicted = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config))


@pytest.mark.parametrize("layout, changes", [
    ("none", {"dp_shard": 2, "reshard_after_forward": True}),
    ("none", {"dp_shard": 4, "reshard_after_forward": False, "attention": "eager"}),
    ("tp", {"dp_shard": 2, "reshard_after_forward": True, "t": 2}),
], ids=str)
def test_qwen3_sharded_by_fsdp2_gathers_and_reduces_its_q_norm_and_k_norm_with_the_layer(one_thread, layout, changes):
    """Qwen3ForCausalLM: each layer's unit holds q_norm's and k_norm's (d,) weights after o_proj's."""
    config = make_config(LLAMA, family="qwen3", qk_layernorm=True, **changes)
    predicted = timeline(config, STRATEGIES[layout], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config))
    (r,) = measure_step(config, [layout])
    assert r.matches and r.moment_matches, r.differences()


@pytest.mark.parametrize("attention, changes", [
    ("eager", {"reshard_after_forward": True, "b": 1, "s": 13}),
    ("flash", {"reshard_after_forward": True, "b": 1, "s": 13}),  # SDPA's math kernel
    ("flash", {"reshard_after_forward": False, "b": 3, "s": 33, "h": 16, "a": 8, "ffn_hidden_size": 16,
               "vocab_size": 20, "kv_channels": 4}),  # the peak inside the math kernel's forward
], ids=str)
def test_attention_dropout_under_fsdp2_happens_in_order_and_peaks_where_the_walk_says(one_thread, attention, changes):
    """The step's loss runs under the probe's dropout shim sharded too: native_dropout's bool mask, as on CUDA; SDPA
    on a CPU runs its math kernel."""
    config = make_config(LLAMA, dp_shard=2, attention=attention, dropout=0.1, **changes)
    predicted = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config))
    (r,) = measure_step(config, ["none"])
    assert r.matches and r.measured.moment == r.predicted_moment, r.differences()


def test_under_tp_a_layers_forward_peaks_at_down_projs_all_reduce_beside_its_partial_sum(one_thread):
    """RowwiseParallel's down_proj all-reduces its GEMM's partial sum into a new tensor: as many bytes live as at the
    residual sum after it, reached first (found by the step differential: one layer, a vocabulary of 4, the layer's
    forward the peak)."""
    config = make_config(LLAMA_HF, b=1, s=2, h=8, a=4, num_query_groups=2, t=2, L=1, ffn_hidden_size=2, vocab_size=4,
                         attention="eager", dp_shard=2, reshard_after_forward=True)
    (r,) = measure_step(config, ["tp"])
    assert r.measured.moment == r.predicted_moment == "forward model.layers.0.mlp.down_proj"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()


def test_at_s_squared_beyond_h_a_layers_forward_peaks_at_eager_attentions_fp32_softmax(one_thread):
    """eager_attention_forward's fp32 softmax: the masked scores and their fp32 cast beside the softmax itself, wider
    than the layer's end where s^2 >> h; under FSDP2 the last layer's unsharded parameters (dim 0 padded over
    dp_shard = 3: ffn 1, h 2) beside them, which the final norm's moment no longer holds (found by the step
    differential at dp_shard = 2: the walk had the layer's forward as one moment, at its end)."""
    config = make_config(LLAMA_HF, b=1, s=16, h=2, a=1, num_query_groups=1, L=2, ffn_hidden_size=1, vocab_size=2,
                         attention="eager", dp_shard=3)
    predicted = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config))
    (r,) = measure_step(config, ["none"])
    assert r.measured.moment == r.predicted_moment == "forward model.layers.1.self_attn"
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()

# -- transformers' MoE models (grouped_mm, its default experts, and the loop), each layer's unit holding them all ----

MOE = {"family": "mixtral", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48,
       "experts_implementation": "grouped_mm", "dp_shard": 2}
QWEN2_MOE = {"family": "qwen2_moe", "moe_shared_expert_intermediate_size": 40}  # a shared expert beside the routed
QWEN3_MOE = {"family": "qwen3_moe", "qk_layernorm": True}
MOE_STEPS = [
    ({}, "balanced"),  # layer 0 gathered again in backward
    ({"s": 64, "moe_router_topk": 4, "moe_ffn_hidden_size": 128, "vocab_size": 16}, "all-to-one"),  # dY * w, backward
    ({"s": 64, "vocab_size": 16, "reshard_after_forward": False}, "balanced"),  # the rows in slot order, forward
    # Qwen2-MoE: the shared expert and its (1, h) gate, dim 0 padded to dp_shard
    (QWEN2_MOE | {"num_experts": 3, "b": 1, "s": 7, "dp_shard": 4}, "all-to-one"),
    (QWEN3_MOE | {"reduce_dtype": "bf16", "b": 3, "s": 5}, "all-to-one"),  # Qwen3-MoE: experts before gate
    ({"experts_implementation": "eager"}, "balanced"),  # the loop: each expert's weight gradients summed
]


def test_the_moe_sizes_put_the_peak_in_three_different_places_two_inside_the_experts():
    moments = {timeline(make_config(LLAMA, **(MOE | c)), STRATEGIES["none"], Accounting(exact=True, device="cpu"))
               .peak.label() for c, _ in MOE_STEPS[:3]}
    assert len(moments) == 3 and len([m for m in moments if ".mlp.experts" in m]) == 2, moments


@pytest.mark.parametrize("changes, route", MOE_STEPS, ids=str)
def test_a_moe_model_sharded_by_fsdp2_peaks_where_the_timeline_says_to_the_byte(one_thread, changes, route):
    (r,) = measure_step(make_config(LLAMA, **(MOE | changes)), ["none"], route=route)
    assert r.matches and r.moment_matches, r.differences()


@pytest.mark.parametrize("changes", [
    {},
    {"reshard_after_forward": False, "num_experts": 3, "b": 1, "s": 7, "dp_shard": 3},
    QWEN2_MOE | {"b": 3, "s": 5},  # its shared expert whole on each rank of t (the plan names no style for it)
], ids=str)
def test_on_a_2d_mesh_a_moe_models_experts_are_sharded_over_t_and_then_dp_shard(one_thread, changes):
    """transformers' plan splits the experts' gate_up_proj (packed_colwise) and down_proj (rowwise) over t before
    FSDP2 shards them (found by a drawn run: the walk sharded them whole over dp_shard, 3,072 B of fp32 parameters
    and 6,144 B of AdamW's moments above FSDPMemTracker's at E = 2, moe_ffn_hidden_size = 16, h = 32)."""
    (r,) = measure_step(make_config(LLAMA, **(MOE | {"t": 2} | changes)), ["tp"], route="balanced")
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


@pytest.mark.parametrize("changes, route", [
    ({}, "balanced"),
    (QWEN2_MOE | {"b": 1, "s": 13, "attention": "eager"}, "all-to-one"),
    (QWEN3_MOE | {"reshard_after_forward": False}, "balanced"),
    (QWEN2_MOE | {"experts_implementation": "eager"}, "balanced"),
    (QWEN3_MOE | {"moe_layer_freq": 2, "L": 4}, "all-to-one"),  # dense layers' units among sparse ones
], ids=str)
def test_a_moe_model_sharded_by_fsdp2_has_every_moment_in_order(one_thread, changes, route):
    """The experts' two weights, the router's and the shared expert's each kept as the unsharded .grad to the
    layer's reduce-scatter, beside the grouped_mm block's moments."""
    config = make_config(LLAMA, **(MOE | changes))
    predicted = timeline(config, STRATEGIES["none"], Accounting(exact=True, device="cpu"))
    assert_moments_in_order(predicted.moments[1:], _readings(config, route))


CHECKPOINTED = [  # gradient checkpointing inside each FSDP2 unit (transformers checkpoints the layer's forward only)
    {"dp_shard": 2, "b": 1, "s": 7},
    {"dp_shard": 4, "reshard_after_forward": False, "attention": "eager", "b": 2, "s": 9},
    {"dp_shard": 2, "attention": "eager", "b": 1, "s": 13, "num_query_groups": 8, "L": 3},
    {"dp_shard": 2, "b": 2, "s": 7, "family": "qwen3", "qk_layernorm": True},  # Qwen3ForCausalLM
    {"dp_shard": 2, "t": 2, "b": 2, "s": 7},  # on the 2-D mesh, transformers' tp_plan inside
    # attention dropout: the rerun drops out through the probe's shim; SDPA's on a CPU, torch's math kernel
    {"dp_shard": 2, "attention": "eager", "dropout": 0.1, "b": 1, "s": 7},
    {"dp_shard": 2, "attention": "flash", "dropout": 0.1, "b": 2, "s": 9, "num_query_groups": 8},
    {"dp_shard": 2, "attention": "eager", "dtype": "fp32", "b": 1, "s": 7},  # each norm's input is x itself
]


@pytest.mark.parametrize("changes", CHECKPOINTED, ids=str)
def test_under_gradient_checkpointing_every_moment_happens_in_order_and_the_peak_is_fsdpmemtrackers(one_thread,
                                                                                                   changes):
    """Each layer's rerun runs in backward outside its unit's forward hooks: FSDPMemTracker reads it as temporaries."""
    config = make_config(LLAMA, recompute="full", **changes)
    layout = "tp" if config.t > 1 else "none"
    assert_moments_in_order(timeline(config, STRATEGIES[layout], Accounting(exact=True, device="cpu")).moments[1:],
                            _readings(config))
    (r,) = measure_step(config, [layout])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)


# fp32 (param_dtype fp32: FSDP2 clamps it to None, so no shard is cast before the all-gather), at odd shapes
FP32_SHARDED = [
    ({"dp_shard": 2, "b": 1, "s": 7}, "none"),
    ({"dp_shard": 3, "reshard_after_forward": False, "attention": "eager", "b": 1, "s": 9, "num_query_groups": 4,
      "a": 12, "h": 96}, "none"),
    ({"dp_shard": 2, "t": 2, "b": 1, "s": 7, "attention": "eager"}, "tp"),  # on the 2-D mesh
    ({"dp_shard": 2, "b": 1, "s": 1, "h": 2, "a": 1, "num_query_groups": 1, "L": 3, "ffn_hidden_size": 1,
      "vocab_size": 2, "attention": "eager"}, "none"),  # tiny: the peak at q_proj's backward, no cast above it
]


@pytest.mark.parametrize("changes, layout", FP32_SHARDED, ids=str)
def test_in_fp32_every_moment_happens_in_order_and_the_peak_is_fsdpmemtrackers(one_thread, changes, layout):
    config = make_config(LLAMA, dtype="fp32", **changes)
    assert_moments_in_order(timeline(config, STRATEGIES[layout], Accounting(exact=True, device="cpu")).moments[1:],
                            _readings(config))
    (r,) = measure_step(config, [layout])
    assert [row.difference for row in (*r.rows("peak"), *r.rows("steady"))] == [0] * 12, r.differences()
    assert r.moment_matches, (r.predicted_moment, r.measured.moment)
