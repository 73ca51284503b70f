"""Data-parallel sharding as each stack runs it: the layout fields (dp_shard, dp_replicate, reshard_after_forward,
reduce_dtype, zero_stage), what each stack refuses, and the model states each keeps: FSDP2's 16/dp_shard bytes a
parameter, and DeepSpeed ZeRO's against DeepSpeed's own estimators where it is installed (a documented layout
otherwise: stage 1 shards the 16 bytes of fp32 state, stage 2 the bf16 gradients too, stage 3 the weights)."""

import json
from pathlib import Path

import pytest

from memcalc.config.hf import read_hf_config
from memcalc.config.schema import build_config, load_config
from memcalc.errors import ConfigError
from memcalc.sizing.params import hf_layer_params
from memcalc.sizing.pipeline import pipeline_stages
from memcalc.sizing.states import group_params, sharding, state_bytes, total_params, zero3_largest_layer
from memcalc.sizing.totals import no_decay_params, per_gpu, per_parameter_shards
from memcalc.model.strategy import STRATEGIES

LLAMA = dict(impl="hf", b=1, s=128, h=256, a=8, L=2, vocab_size=512, mlp="swiglu", ffn_hidden_size=704,
             norm="rmsnorm", num_query_groups=4, position_embedding_type="rope", add_bias_linear=False, dropout=0.0,
             tie_embeddings=False)


def test_dp_is_dp_replicate_times_dp_shard_and_the_replicas_are_derived():
    assert build_config(LLAMA | {"dp_shard": 8}).dp == 8
    hsdp = build_config(LLAMA | {"dp_shard": 4, "dp_replicate": 2})
    assert (hsdp.dp, hsdp.dp_replicate) == (8, 2)
    with_gpus = build_config(LLAMA | {"impl": "torchtitan", "gpus": 64, "t": 4, "dp_shard": 4})
    assert (with_gpus.dp, with_gpus.dp_replicate) == (16, 4)


@pytest.mark.parametrize("fields,message", [
    ({"impl": "torchtitan", "zero_stage": 2}, "zero_stage=2 is DeepSpeed's ZeRO, which memcalc models under"
     " transformers' Trainer (impl hf); impl torchtitan shards with FSDP2 (dp_shard)"),
    ({"impl": "megatron", "dp_shard": 2}, "dp_shard=2 under impl megatron: memcalc models Megatron-LM's distributed"
     " optimizer (distributed_optimizer), not its own FSDP"),
    ({"dp_shard": 2, "distributed_optimizer": True}, "dp_shard=2 with distributed_optimizer: FSDP2 shards the"
     " optimizer's states itself; give one"),
    ({"dp": 2, "distributed_optimizer": True}, "distributed_optimizer is Megatron-LM's (impl megatron); impl hf"
     " shards with DeepSpeed's ZeRO (zero_stage) or FSDP2 (dp_shard)"),
    ({"impl": "torchtitan", "attention": "flash", "distributed_optimizer": True}, "distributed_optimizer is"
     " Megatron-LM's (impl megatron); impl torchtitan shards with FSDP2 (dp_shard)"),
    ({"zero_stage": 3, "dp_shard": 2}, "zero_stage=3 with dp_shard=2: transformers' Trainer runs DeepSpeed or FSDP2,"
     " not both"),
    ({"zero_stage": 3, "dp": 2, "pp": 2}, "zero_stage=3 with pp=2: DeepSpeed's PipelineEngine asserts ZeRO-2 and ZeRO-3"
     " are incompatible with pipeline parallelism"),
    ({"reshard_after_forward": False}, "reshard_after_forward and reduce_dtype are FSDP2's: they need dp_shard"),
    ({"dp_replicate": 2}, "dp_replicate=2 needs dp_shard (HSDP replicates FSDP2 groups of dp_shard ranks)"),
    ({"dp": 8, "dp_shard": 3}, "dp=8 is not divisible by dp_shard=3 (HSDP's replicas are dp/dp_shard FSDP2 groups)"),
    ({"dp": 8, "dp_shard": 2, "dp_replicate": 2}, "dp_replicate*dp_shard=2*2=4 is not dp=8"),
    ({"zero_stage": 4}, "field 'zero_stage'"),
])
def test_what_a_stack_cannot_shard_with_is_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError) as err:
        build_config(LLAMA | fields)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_fsdp2_keeps_fp32_weights_gradients_and_moments_all_sharded_16_bytes_over_dp_shard(n):
    config = build_config(LLAMA | {"dp_shard": n})
    assert sharding(config) == "fsdp2"
    states = state_bytes(config, 8000)
    assert states == {name: 4 * 8000 // n for name in ("states/weights", "states/grads", "states/adam_m",
                                                        "states/adam_v")}


def test_hsdp_shards_over_dp_shard_and_replicates_over_the_rest():
    assert state_bytes(build_config(LLAMA | {"dp_shard": 4, "dp_replicate": 2}), 8000) == \
        state_bytes(build_config(LLAMA | {"dp_shard": 4}), 8000)


@pytest.mark.parametrize("stage,per_param", [(0, 20), (1, 4 + 16 / 8), (2, 2 + 18 / 8), (3, 18 / 8)])
def test_zero_stages_shard_fp32_state_then_bf16_gradients_then_weights(stage, per_param):
    config = build_config(LLAMA | {"zero_stage": stage, "dp": 8})
    assert sum(state_bytes(config, 8000).values()) == per_param * 8000


@pytest.mark.parametrize("n", [2, 8])
def test_zero2_and_zero3_are_deepspeeds_own_estimates(n):
    """estimate_zero2/3_model_states_mem_needs (no offload) on transformers' own Llama, its parameters and largest
    module counted by DeepSpeed's model_to_params; at stage 3 beside the bf16 weights the estimator leaves out that
    DeepSpeed keeps whole: those of stage3_param_persistence_threshold (10h, the Trainer's "auto") elements or fewer
    (the norms), as the step walk does."""
    pytest.importorskip("deepspeed")
    transformers = pytest.importorskip("transformers")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from memcalc.probe.libs.hf import transformers_config

    config = build_config(LLAMA | {"dp": n})
    model = transformers.LlamaForCausalLM(transformers_config(config, "llama"))
    params, largest = model_to_params(model)
    assert params == total_params(config)
    _, zero2 = estimate_zero2_model_states_mem_needs(params, n, 1, cpu_offload=False)
    _, zero3, largest_bytes = estimate_zero3_model_states_mem_needs(params, largest, n, 1, cpu_offload=False,
                                                                    cpu_offload_params=False)
    totals = {stage: per_gpu(build_config(LLAMA | {"dp": n, "zero_stage": stage}), STRATEGIES["none"]).worst()
              for stage in (2, 3)}
    assert totals[2].bytes("model states") == zero2
    persistent = sum(x.numel() for x in model.parameters() if x.numel() <= 10 * config.h)
    assert totals[3].bytes("model states") == zero3 + 2 * persistent
    assert zero3_largest_layer(config) == largest_bytes


def _built(name: str, **changes):
    """The config.json `name` (tests/data/hf) as memcalc reads it under impl hf, and transformers' own model built
    from it on the meta device (pad_token_id None where the file sets none: GLM's default lies past a small
    vocabulary)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = Path(__file__).parents[1] / "data" / "hf" / f"{name}.json"
    config = load_config(path, {"impl": "hf", "s": 8, "attention": "eager"} | changes, base=read_hf_config(path).fields)
    with torch.device("meta"):
        return config, transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            **{"pad_token_id": None} | json.loads(path.read_text())))


@pytest.mark.parametrize("name", ["gpt2", "qwen2-0.5b", "gpt-oss-tiny", "cohere-tiny", "olmo2-tiny", "starcoder2-tiny",
                                  "qwen3-30b-a3b"])
def test_the_trainers_group_without_weight_decay_holds_the_norms_and_the_biases(name):
    """ZeRO-1/2 pads each of the Trainer's two parameter groups apart: the one without weight decay is what
    get_decay_parameter_names leaves out (norms, biases; gpt-oss's router and expert biases, not its sinks), counted
    on transformers' own model built from the config.json."""
    config, model = _built(name)
    decay = set(pytest.importorskip("transformers").Trainer.get_decay_parameter_names(None, model))
    (stage,) = pipeline_stages(config)
    assert no_decay_params(config, stage, 1) == sum(p.numel() for n, p in model.named_parameters() if n not in decay)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-0.5b", "qwen3-30b-a3b", "mixtral-tiny", "gpt-oss-tiny",
                                  "deepseek-v3", "olmo2-tiny", "cohere-tiny", "gemma3-tiny", "starcoder2-tiny",
                                  "glm4-tiny", "glm-tiny"])
def test_transformers_layers_parameters_are_the_inventorys_by_name_and_shape(name):
    """Each kind of decoder layer's parameters, path and shape, as transformers' model registers them (DeepseekV3MoE's
    shared experts `mlp.shared_experts`, Qwen2-MoE's `mlp.shared_expert`): what the step walks' weight gradients and
    FSDP2's and ZeRO's per-parameter shards read."""
    config, model = _built(name)
    for moe in {config.is_moe_layer(i) for i in range(config.L)}:
        i = next(i for i in range(config.L) if config.is_moe_layer(i) == moe)
        built = {n.removesuffix(".weight"): tuple(p.shape) for n, p in model.named_parameters()
                 if n.startswith(f"model.layers.{i}.")}
        assert {p.module: p.shape for p in hf_layer_params(config, 1, f"model.layers.{i}", moe)} == built


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen3-30b-a3b", "gpt-oss-tiny", "deepseek-v3", "gpt2",
                                  "falcon-7b", "qwen2-0.5b", "cohere-tiny"])
def test_zero3s_largest_layer_is_deepspeeds_largest_module_a_moe_blocks_experts_one(name):
    """ZeRO-3's transient is the module with the most parameters of its own, as DeepSpeed's model_to_params sums them
    on transformers' own model built from the config.json: a MoE block's experts (one module's weights, every expert),
    a fused projection with its bias, not only the embedding, an MLP projection or q_proj."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import model_to_params

    config, model = _built(name, zero_stage=3, dp=2)
    assert zero3_largest_layer(config) == 4 * model_to_params(model)[1]


def test_fit_finds_the_largest_micro_batch_by_the_fsdp2_step_peak():
    from dataclasses import replace

    from memcalc.sizing.fit import fit
    from memcalc.sizing.timeline import timeline
    from memcalc.sizing.verdict import PEAK

    config = build_config(LLAMA | {"dp_shard": 4, "attention": "flash"})
    peak = timeline(replace(config, b=3), STRATEGIES["none"]).peak.bytes
    found = fit(config, STRATEGIES["none"], "b", peak)
    assert (found.answer.value, found.answer.bytes, found.answer.basis) == (3, peak, PEAK)
    assert found.beyond.value == 4 and found.beyond.bytes > peak


def test_fit_finds_the_smallest_fsdp2_shard_group_that_fits_hsdp_replicating_the_rest():
    from memcalc.sizing.fit import fit

    totals = {n: per_gpu(build_config(LLAMA | {"dp": 8, "dp_shard": n}), STRATEGIES["none"]).bytes()
              for n in (1, 2, 4, 8)}
    assert totals[1] > totals[2] > totals[4] > totals[8]
    found = fit(build_config(LLAMA | {"dp": 8}), STRATEGIES["none"], "dp_shard", totals[4], count="total")
    assert (found.answer.value, found.answer.bytes) == (4, totals[4])
    assert (found.beyond.value, found.beyond.bytes) == (2, totals[2])


@pytest.mark.parametrize("args,needle", [
    (("estimate", "--config", "tiny", "--impl", "torchtitan", "--zero-stage", "3"), "zero_stage=3 is DeepSpeed's ZeRO"),
    (("estimate", "--config", "tiny", "--dp-shard", "2", "--distributed-optimizer"), "dp_shard=2 under impl megatron"),
    (("estimate", "--config", "tiny", "--zero-stage", "5"), "--zero-stage"),
    (("measure", "--config", "tiny", "--impl", "hf", "--zero-stage", "2"), "give --step"),
    (("measure", "--config", "tiny", "--impl", "hf", "--zero-stage", "3", "--step", "--t", "1"),
     "--step does not compare DeepSpeed's ZeRO-3 step"),
])
def test_the_cli_refuses_a_layout_the_stack_cannot_run_in_one_line(args, needle):
    from tests.cli import memcalc_cli, one_line_error

    one_line_error(memcalc_cli(*args), needle)


def test_estimate_totals_names_the_sharding_and_counts_fsdp2s_states():
    from tests.cli import memcalc_cli

    run = memcalc_cli("estimate", "--config", "tiny", "--impl", "hf", "--gpus", "16", "--dp-shard", "4", "--totals",
                      "--strategy", "none")
    assert run.code == 0, run.err
    assert "FSDP2 over dp_shard*cp=4, HSDP over 2 replicas" in run.out  # tiny: t = 2, so dp = 8
    assert "none: the step peaks at" in run.out


def test_fsdp2_pads_torchtitans_experts_under_tp_as_it_pads_them_without():
    """The count and FSDP2's padding read one inventory (memcalc.sizing.params): under tp torchtitan's experts are
    split by t in both (the walk's list held them whole, so --totals split the states evenly, unpadded). One rank of
    t 2, dp_shard 3: each parameter's dim 0 padded to a multiple of 3, the experts' E = 4 to 6."""
    config = build_config(dict(b=1, s=16, h=64, a=4, L=1, vocab_size=101, ffn_hidden_size=48, num_experts=4,
                               impl="torchtitan", t=2, dp_shard=3))
    (stage,) = pipeline_stages(config)
    held = sum(group_params(config, stage, 2).values())
    rows = 51 * 64  # tok_embeddings and lm_head: ceil(101/2) = 51 rows, a multiple of 3
    block = 96 * 64 + 66 * 32 + 3 * 6 * 24 * 64 + 6 * 64 + 2 * 66  # wqkv, wo, w1 w2 w3 (f/t = 24), router, norms
    assert per_parameter_shards(config, 2, held, stage) == ((2 * rows + block + 66) // 3, 0)
