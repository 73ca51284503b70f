"""`memcalc measure --step`: exit 0 with a table per layout when the step's peak agrees with MemTracker,
JSON with `peak_bytes` and `steady_bytes`, exit 1 beyond 1%, exit 2 for flags that do not apply and for
what the timeline does not model yet."""

import json

import pytest

from . import memcalc_cli

torch = pytest.importorskip("torch")

from memcalc.probe import step as step_module  # noqa: E402

STEP_YAML = "name: step\nb: 2\ns: 24\nh: 64\na: 8\nt: 2\nL: 2\nvocab_size: 250\n"
# transformers' Llama, untied, on the step's sizes
HF_LLAMA = ("impl: hf\nnum_query_groups: 2\nffn_hidden_size: 176\nposition_embedding_type: rope\n"
            "add_bias_linear: false\ntie_embeddings: false\n")


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "step.yaml"
    path.write_text(STEP_YAML)
    return str(path)


def _one_line_error(run, code, needle):
    assert run.code == code, run.err
    assert run.err.startswith("memcalc: error: ") and run.err.count("\n") == 1, run.err
    assert needle in run.err, run.err


def test_a_matching_step_prints_the_peak_by_category_and_its_moment_and_exits_0(config):
    run = memcalc_cli("measure", "--config", config, "--step", "--strategy", "tp-sp")
    assert (run.code, run.err) == (0, "")
    for words in ("optimizer states", "temporaries", "MemTracker at backward layers.1.mlp.fc2 (same moment)",
                  "rank 0 of t=2 through torch's fake process group", "steady state before the step",
                  "match: the peak and every category within 1%"):
        assert words in run.out, (words, run.out)


def test_json_carries_peak_and_steady_bytes_predicted_and_measured(config):
    run = memcalc_cli("measure", "--config", config, "--step", "--strategy", "tp", "--json")
    assert run.code == 0, run.err
    tp = json.loads(run.out)["strategies"]["tp"]
    assert tp["peak_bytes"]["predicted"] == tp["peak_bytes"]["measured"] == sum(
        c["measured"] for c in tp["peak"].values())
    assert tp["steady_bytes"]["predicted"] == tp["steady_bytes"]["measured"]
    assert tp["moment"]["match"] and tp["match"]


def test_a_step_beyond_one_percent_exits_1_naming_the_category(config, monkeypatch):
    measure = step_module.measure_step_on_rank

    def more_activations(tp, config, strategy):
        m = measure(tp, config, strategy)
        peak = m.peak | {"activations": m.peak["activations"] * 2}
        return type(m)(**{**vars(m), "peak": peak})

    monkeypatch.setattr(step_module, "measure_step_on_rank", more_activations)
    run = memcalc_cli("measure", "--config", config, "--step", "--strategy", "none")
    _one_line_error(run, 1, "none: peak activations predicted")


@pytest.mark.parametrize("flags, needle", [
    (["--device", "meta"], "--device meta is not supported"),
    (["--backend", "gloo"], "--backend does not apply"),
    (["--comm"], "--comm does not apply"),
    (["--impl", "paper"], "--step runs memcalc's own Megatron-style model, transformers' LlamaForCausalLM"),
    (["--impl", "torchtitan", "--dp-shard", "2", "--strategy", "tp"],
     "the step timeline for impl torchtitan does not model dp_shard with tp"),
    (["--impl", "hf", "--t", "2", "--dp-shard", "2"],
     "the step timeline for impl hf does not model tied embeddings under tp with dp_shard or zero_stage"),
    (["--impl", "hf", "--zero-stage", "3"], "--step does not compare DeepSpeed's ZeRO-3 step"),
])
def test_what_does_not_apply_or_is_not_modelled_exits_2_before_running(config, flags, needle):
    _one_line_error(memcalc_cli("measure", "--config", config, "--step", *flags), 2, needle)


def test_impl_torchtitan_under_pp_measures_the_first_and_the_last_stage_each_on_its_rank_and_exits_0(tmp_path):
    pytest.importorskip("torchtitan")
    path = tmp_path / "titan.yaml"
    path.write_text(STEP_YAML.replace("t: 2\n", "") + "impl: torchtitan\npp: 2\nnum_query_groups: 2\n"
                    "ffn_hidden_size: 176\nposition_embedding_type: rope\nadd_bias_linear: false\n"
                    "tie_embeddings: false\n")
    run = memcalc_cli("measure", "--config", str(path), "--step", "--strategy", "none", "--json")
    assert run.code == 0, run.err
    stages = json.loads(run.out)["strategies"]
    assert list(stages) == ["none (first stage)", "none (last stage)"]
    assert [x["how"].split(" through")[0] for x in stages.values()] == [
        "one process as rank 0 of pp=2 (the first pipeline stage)", "one process as rank 1 of pp=2 (the last pipeline"
        " stage)"]
    assert all(x["match"] and x["moment"]["match"] for x in stages.values())


@pytest.mark.parametrize("strategy, layout, inner, first", [("tp-sp", "", "t", "tp"),
                                                            ("none", "dp_shard: 2\nloss_chunks: 0\n", "dp_shard",
                                                             "dp_shard")])
def test_impl_torchtitan_under_pp_and_tp_sp_or_dp_shard_measures_each_stage_as_the_first_rank_of_its_world(
        tmp_path, strategy, layout, inner, first):
    """pp x t, each stage's chunk under its TP plan; or pp x dp_shard, FSDP2 on each stage's chunk
    (memcalc.probe.libs.torchtitan_pp.measure_torchtitan_pp_fsdp_step_on_rank)."""
    pytest.importorskip("torchtitan")
    path = tmp_path / "titan.yaml"
    path.write_text(STEP_YAML + layout + "impl: torchtitan\npp: 2\nnum_query_groups: 2\nffn_hidden_size: 176\n"
                    "position_embedding_type: rope\nadd_bias_linear: false\ntie_embeddings: false\n")
    run = memcalc_cli("measure", "--config", str(path), "--step", "--strategy", strategy, "--json")
    assert run.code == 0, run.err
    stages = json.loads(run.out)["strategies"]
    assert [x["how"].split(" through")[0] for x in stages.values()] == [
        f"one process as rank 0 of pp*{inner}=2*2=4 (the first pipeline stage, its {first} rank 0)",
        f"one process as rank 2 of pp*{inner}=2*2=4 (the last pipeline stage, its {first} rank 0)"]
    assert all(x["match"] and x["moment"]["match"] for x in stages.values())


def test_a_pipeline_stage_of_memcalcs_own_gpt_is_refused_not_compared_with_the_whole_model(tmp_path):
    path = tmp_path / "pp.yaml"
    path.write_text(STEP_YAML.replace("L: 2", "L: 2\npp: 2"))
    _one_line_error(memcalc_cli("measure", "--config", str(path), "--step"), 2,
                    "--step runs one pipeline stage (pp=2) only with --impl torchtitan")


def test_impl_hf_runs_transformers_llama_for_causal_lm_and_exits_0(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "llama.yaml"
    path.write_text(STEP_YAML.replace("t: 2\n", "") + HF_LLAMA)
    run = memcalc_cli("measure", "--config", str(path), "--step", "--attention", "eager")
    assert (run.code, run.err) == (0, "")
    for words in ("ran as: transformers' LlamaForCausalLM, one process (t=1) on cpu", "(same moment)",
                  "match: the peak and every category within 1%"):
        assert words in run.out, (words, run.out)


def test_impl_hf_family_gpt2_from_flags_alone_runs_gpt2_lm_head_model_exactly_and_exits_0(config):
    """--family gpt2 fixes GPT-2's biases and learned positions over impl hf's Llama defaults."""
    pytest.importorskip("transformers")
    run = memcalc_cli("measure", "--config", config, "--step", "--impl", "hf", "--family", "gpt2", "--t", "1",
                      "--norm", "layernorm", "--mlp", "gelu_tanh", "--attention", "eager", "--dropout", "0.1")
    assert run.code == 0, run.err
    for words in ("ran as: transformers' GPT2LMHeadModel, one process (t=1) on cpu", "(same moment)",
                  "match: the peak and every category within 1%"):
        assert words in run.out, (words, run.out)


def test_impl_hf_under_its_own_tp_plan_runs_rank_zero_of_t_and_exits_0(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "llama.yaml"
    path.write_text(STEP_YAML + HF_LLAMA)
    run = memcalc_cli("measure", "--config", str(path), "--step", "--strategy", "tp", "--attention", "eager")
    assert (run.code, run.err) == (0, "")
    for words in ("ran as: transformers' LlamaForCausalLM, one process as rank 0 of t=2 through torch's fake process",
                  "(same moment)", "match: the peak and every category within 1%"):
        assert words in run.out, (words, run.out)


def test_a_sharded_step_names_the_ranks_it_runs_one_of_by_their_layout_not_as_t(tmp_path):
    """Under FSDP2 the fake group's world is dp_shard*t (each factor named), not "t=4"."""
    pytest.importorskip("transformers")
    path = tmp_path / "llama.yaml"
    path.write_text(STEP_YAML.replace("b: 2\ns: 24", "b: 1\ns: 7") + HF_LLAMA + "dp_shard: 2\n")
    run = memcalc_cli("measure", "--config", str(path), "--step", "--strategy", "all", "--attention", "eager")
    assert (run.code, run.err) == (0, "")
    for words in ("rank 0 of dp_shard=2, one step", "one process as rank 0 of dp_shard*t=2*2=4 through torch's fake"):
        assert words in run.out, (words, run.out)


def test_impl_hf_refuses_tp_sp_citing_transformers(config):
    run = memcalc_cli("measure", "--config", config, "--step", "--impl", "hf", "--strategy", "tp-sp")
    _one_line_error(run, 2, "transformers has no sequence parallelism")


@pytest.mark.parametrize("route", [[], ["--route", "all-to-one"]], ids=["real router", "all-to-one"])
def test_impl_hf_mixtral_step_needs_the_balanced_route_the_timeline_walks(route):
    run = memcalc_cli("measure", "--hf-config", "tests/data/hf/mixtral-tiny.json", "--impl", "hf", "--step",
                      "--strategy", "none", "--experts-implementation", "eager", *route)
    _one_line_error(run, 2, "--step on a mixture of experts needs --route balanced")  # what config.json gave: not said


def test_route_on_a_step_without_experts_exits_2(config):
    run = memcalc_cli("measure", "--config", config, "--step", "--route", "balanced")
    _one_line_error(run, 2, "--route balanced forces a MoE router: the config has no experts")


def test_impl_hf_mixtral_step_on_transformers_default_grouped_mm_takes_the_all_to_one_route():
    run = memcalc_cli("measure", "--hf-config", "tests/data/hf/mixtral-tiny.json", "--impl", "hf", "--step",
                      "--strategy", "none", "--route", "all-to-one")
    assert run.code == 0, run.err
    for words in ("ran as: transformers' MixtralForCausalLM, router forced all-to-one", "(same moment)",
                  "match: the peak and every category within 1%"):
        assert words in run.out, (words, run.out)


MOE_YAML = STEP_YAML + (
    "ep: 2\ndp: 2\nimpl: megatron\nmlp: swiglu\nffn_hidden_size: 176\nnorm: rmsnorm\nnum_query_groups: 2\n"
    "position_embedding_type: rope\nadd_bias_linear: false\ndropout: 0.0\ntie_embeddings: false\nattention: flash\n"
    "num_experts: 4\nmoe_router_topk: 2\nmoe_ffn_hidden_size: 48\nmoe_shared_expert_intermediate_size: 32\n"
)


def test_megatron_moe_step_under_full_recomputation_beside_ep_and_tp_sp_matches_to_the_byte(tmp_path):
    """megatron-core's MoELayer with shared experts, ep = 2 beside tp-sp t = 2, each layer rerun in backward: the
    peak, in the rerun's reduce-scatter, and every category agree with MemTracker exactly."""
    path = tmp_path / "moe.yaml"
    path.write_text(MOE_YAML)
    run = memcalc_cli("measure", "--config", str(path), "--step", "--strategy", "tp-sp", "--recompute", "full",
                      "--route", "balanced", "--json")
    assert run.code == 0, run.err
    tp_sp = json.loads(run.out)["strategies"]["tp-sp"]
    assert [c["predicted"] - c["measured"] for c in tp_sp["peak"].values()] == [0] * len(tp_sp["peak"])
    assert tp_sp["peak_bytes"]["predicted"] == tp_sp["peak_bytes"]["measured"] == 1_067_244
    assert tp_sp["steady_bytes"]["predicted"] == tp_sp["steady_bytes"]["measured"] and tp_sp["moment"]["match"]


@pytest.mark.parametrize("family, model", [("olmo2", "Olmo2ForCausalLM"), ("glm", "GlmForCausalLM"),
                                           ("glm4", "Glm4ForCausalLM"), ("gemma3", "Gemma3ForCausalLM")])
def test_impl_hf_steps_the_rmsnorm_kin_from_their_config_json_as_the_walk_says(family, model):
    run = memcalc_cli("measure", "--hf-config", f"tests/data/hf/{family}-tiny.json", "--impl", "hf", "--step",
                      "--strategy", "none", "--b", "3", "--s", "9", "--attention", "eager")
    assert run.code == 0, run.err
    for words in (f"ran as: transformers' {model}", "(same moment)", "match: the peak and every category within 1%"):
        assert words in run.out, (words, run.out)


def test_impl_hf_steps_gpt_oss_from_its_config_json_to_the_byte():
    """GptOssForCausalLM from tests/data/hf/gpt-oss-tiny.json (a sliding layer, then a full one): the peak, in the
    experts' gate_up_proj GEMMs, every category and the steady state are MemTracker's exactly."""
    run = memcalc_cli("measure", "--hf-config", "tests/data/hf/gpt-oss-tiny.json", "--impl", "hf", "--step",
                      "--strategy", "none", "--b", "1", "--s", "7", "--route", "balanced", "--json")
    assert run.code == 0, run.err
    none = json.loads(run.out)["strategies"]["none"]
    assert [c["predicted"] - c["measured"] for c in none["peak"].values()] == [0] * len(none["peak"])
    assert none["peak_bytes"]["predicted"] == none["peak_bytes"]["measured"] == 812_268
    assert none["steady_bytes"]["predicted"] == none["steady_bytes"]["measured"] and none["moment"]["match"]


def test_impl_hf_under_deepspeed_zero_2_matches_every_category_in_deepspeeds_step_and_exits_0(tmp_path):
    """DeepSpeed's engine at ZeRO-2 (rank 0 of dp = 2): the peak, in DeepSpeed's step (the optimizer's moment), every
    category and the steady state are MemTracker's exactly (memcalc.probe.libs.hf_zero.ZeroTracker)."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "zero.yaml"
    path.write_text(STEP_YAML.replace("t: 2\n", "").replace("b: 2\ns: 24", "b: 1\ns: 7") + HF_LLAMA
                    + "zero_stage: 2\ndp: 2\n")
    run = memcalc_cli("measure", "--config", str(path), "--step", "--strategy", "none", "--json")
    assert run.code == 0, run.err
    none = json.loads(run.out)["strategies"]["none"]
    assert [c["predicted"] - c["measured"] for c in none["peak"].values()] == [0] * len(none["peak"])
    assert none["peak_bytes"]["predicted"] == none["peak_bytes"]["measured"]
    assert none["steady_bytes"]["predicted"] == none["steady_bytes"]["measured"]
    assert none["moment"] == {**none["moment"], "predicted": "optimizer", "measured": "optimizer", "match": True}
