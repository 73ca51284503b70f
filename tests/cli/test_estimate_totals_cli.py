"""`memcalc estimate` with per-GPU totals, --cp and --hf-config: the existing output stays as it was,
totals list every term and answer "does it fit", and bad input is one line with exit code 2."""

import json
from pathlib import Path

import pytest

from . import memcalc_cli, one_line_error

GPT3 = ["--config", "gpt3-175b"]
GPT2 = ["--hf-config", "tests/data/hf/gpt2.json"]


def _json(*args: str) -> dict:
    """The document, after checking the exit code: 3 when totals find that no strategy fits (a "maybe" may), else 0."""
    run = memcalc_cli("estimate", *args, "--json")
    doc = json.loads(run.out)
    verdicts = [x["fits"] for x in doc.get("per_gpu", {}).get("strategies", {}).values()]
    assert run.code == (3 if verdicts and all(x is False for x in verdicts) else 0), run.err
    return doc


def test_without_a_totals_flag_estimate_is_unchanged():
    doc = _json(*GPT3)
    assert set(doc) == {"schema_version", "config", "accounting", "strategies"}
    assert "Per-GPU memory" not in memcalc_cli("estimate", *GPT3).out


@pytest.mark.parametrize("flags", [
    ["--totals"], ["--pp", "4"], ["--vpp", "2"], ["--dp", "8"], ["--distributed-optimizer"],
    ["--device-memory", "40GiB"], ["--vocab-size", "50304"], ["--untie-embeddings"],
])
def test_totals_add_a_per_gpu_key_and_keep_the_rest(flags):
    plain, with_totals = _json(*GPT3), _json(*GPT3, *flags)
    assert with_totals["strategies"] == plain["strategies"]
    assert set(with_totals["per_gpu"]["strategies"]) == {"none", "tp", "tp-sp"}


def test_per_gpu_json_adds_up():
    per = _json(*GPT3, "--totals", "--device-memory", "64GiB", "--reserve", "4GiB")["per_gpu"]
    assert per["device_memory_bytes"] == 64 * 2**30 and per["parameters"] > 174e9
    assert (per["reserve_bytes"], per["budget_bytes"]) == (4 * 2**30, 60 * 2**30)
    for result in per["strategies"].values():
        for stage in result["stages"]:
            assert stage["total_bytes"] == sum(x["bytes"] for x in stage["terms"])
            assert stage["parameters"] == sum(stage["parameter_groups"].values())
        assert [s["stage"] for s in result["stages"]] == ["first", "last"]  # the config has pp: 8, vpp: 3
        assert result["total_bytes"] == max(s["total_bytes"] for s in result["stages"])
        # the verdict is on the step's peak, the highest stage's
        assert result["needed_basis"] == "the step's peak"
        assert result["needed_bytes"] == max(s["peak_bytes"] for s in result["stages"]) > result["total_bytes"]
        assert result["fits"] == (result["needed_bytes"] <= 60 * 2**30)
        assert result["headroom_bytes"] == 60 * 2**30 - result["needed_bytes"]


def test_the_table_names_every_term_and_gives_a_verdict_per_strategy():
    args = [*GPT3, "--totals", "--exact", "--recompute", "full"]
    per = _json(*args)["per_gpu"]["strategies"]
    out = memcalc_cli("estimate", *args).out
    for stage in per["tp-sp"]["stages"]:
        for term in stage["terms"]:
            assert f"\u2502 {term['name']} " in out, term["name"]
    for name, result in per.items():
        verdict = {True: "yes", False: "no", None: "maybe"}[result["fits"]]
        assert f"  {name}: {verdict}, {result['needed_bytes']:,} B = " in out


def test_device_memory_decides_the_verdict():
    per = _json(*GPT3, "--totals")["per_gpu"]["strategies"]
    between = (per["tp-sp"]["needed_bytes"] + per["tp"]["needed_bytes"]) // 2
    verdict = _json(*GPT3, "--device-memory", str(between), "--reserve", "0")["per_gpu"]["strategies"]
    assert (verdict["tp-sp"]["fits"], verdict["tp"]["fits"]) == (True, False)


def test_context_parallelism_halves_the_sequence_each_rank_keeps():
    flash = [*GPT3, "--attention", "flash"]
    halved, shorter = _json(*flash, "--cp", "2"), _json(*flash, "--s", "1024")
    for name in ("none", "tp", "tp-sp"):
        assert halved["strategies"][name]["per_layer_bytes"] == shorter["strategies"][name]["per_layer_bytes"]
    assert "each rank keeps s/cp = 1024 tokens" in memcalc_cli("estimate", *flash, "--cp", "2").out


def test_hf_config_says_which_fields_it_used():
    run = memcalc_cli("estimate", *GPT2, "--json")
    assert run.code == 0
    assert json.loads(run.out)["config"]["h"] == 768
    assert run.err.startswith("memcalc: read gpt2 config.json: n_embd->h=768") and run.err.count("\n") == 1


def test_gpt2s_gelu_new_is_tanh_gelu_that_megatron_sizes_as_gelu():
    run = memcalc_cli("estimate", *GPT2, "--json")
    assert "activation_function=gelu_new->mlp=gelu_tanh" in run.err
    exact = memcalc_cli("estimate", *GPT2, "--mlp", "gelu", "--json")
    per_layer = [json.loads(r.out)["strategies"]["tp"]["per_layer_bytes"] for r in (run, exact)]
    assert json.loads(run.out)["config"]["mlp"] == "gelu_tanh" and per_layer[0] == per_layer[1]


@pytest.mark.parametrize("args,needles", [
    (["--config", "gpt3-22b", "--pp", "5"], ["L=48 is not divisible by pp=5"]),
    ([*GPT3, "--pp", "5"], ["L=96 is not divisible by pp*vpp=5*3=15"]),  # the config has vpp: 3
    ([*GPT3, "--cp", "2"], ["cp=2 needs attention 'flash'"]),
    ([*GPT3, "--attention", "flash", "--cp", "3"], ["s=2048 is not divisible by 2*cp=6"]),
    ([*GPT3, "--device-memory", "lots"], ["'--device-memory'", "cannot read 'lots' as a size"]),
    ([*GPT3, *GPT2], ["give --config or --hf-config, not both"]),
    (["--hf-config", "tests/data/hf/none.json"], ["Hugging Face config not found"]),
    ([*GPT2, "--s", "2048"], ["s=2048 exceeds max_position_embeddings=1024"]),
])
def test_bad_layouts_and_files_are_one_line(args, needles):
    one_line_error(memcalc_cli("estimate", *args), *needles)


def test_unknown_architecture_and_missing_fields_are_one_line(tmp_path):
    mpt = tmp_path / "mpt.json"
    mpt.write_text(json.dumps({"model_type": "mpt", "architectures": ["MptForCausalLM"], "d_model": 4096}))
    one_line_error(memcalc_cli("estimate", "--hf-config", str(mpt)), "unknown architecture (model_type='mpt'",
                   "MptForCausalLM", "memcalc reads llama")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 512}))
    one_line_error(
        memcalc_cli("estimate", "--hf-config", str(path)),
        "gpt_neox config.json is missing num_attention_heads, num_hidden_layers, vocab_size, intermediate_size",
    )


_LLAMA_FIELDS = {
    "model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "num_hidden_layers": 2,
    "vocab_size": 1000, "intermediate_size": 1024,
}
_GPT2_FIELDS = {
    "model_type": "gpt2", "n_embd": 512, "n_head": 8, "n_layer": 2, "vocab_size": 1000, "n_positions": 1024,
}


@pytest.mark.parametrize("fields, needles", [
    ({"model_type": ["llama"]}, ["model_type should be a string and architectures a list"]),
    ({"architectures": "LlamaForCausalLM"}, ["model_type should be a string and architectures a list"]),
    (_LLAMA_FIELDS | {"hidden_size": "512", "head_dim": 64},  # not the head_dim check, which needs numbers
     ["field 'h': input should be a valid integer (got '512')"]),
    (_LLAMA_FIELDS | {"attention_bias": [True], "mlp_bias": [True]}, ["field 'add_bias_linear'"]),
    (_LLAMA_FIELDS | {"attention_bias": True, "mlp_bias": False}, ["attention_bias and mlp_bias differ"]),
    (_GPT2_FIELDS | {"resid_pdrop": "0.1"}, ["dropout probabilities must be numbers"]),
])
def test_malformed_hf_fields_are_one_line_naming_the_file(tmp_path, fields, needles):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    one_line_error(memcalc_cli("estimate", "--hf-config", str(path), "--s", "128"), f"{path}: ", *needles)


def test_an_hf_config_that_is_not_text_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    one_line_error(memcalc_cli("estimate", "--hf-config", str(path)), str(path), "not UTF-8 text (byte 0")


def test_totals_json_carries_the_steps_peak_and_steady_state_from_the_timeline():
    from memcalc.config.schema import load_config
    from memcalc.config.shipped import locate
    from memcalc.model.strategy import TP_SP
    from memcalc.sizing.timeline import timeline

    run = memcalc_cli("estimate", "--config", "tiny", "--totals", "--json")
    (stage,) = json.loads(run.out)["per_gpu"]["strategies"]["tp-sp"]["stages"]
    expected = timeline(load_config(locate(Path("tiny")), {}), TP_SP)
    assert (stage["peak_bytes"], stage["steady_bytes"]) == (expected.peak.bytes, expected.steady.bytes)
    assert stage["peak_moment"] == expected.peak.label() and stage["peak_bytes"] > stage["total_bytes"]


def test_totals_say_where_the_steps_peak_is_not_modelled():
    run = memcalc_cli("estimate", "--config", "llama3-70b", "--cp", "2", "--totals", "--json")
    verdict = json.loads(run.out)["per_gpu"]["strategies"]["tp-sp"]
    (stage,) = verdict["stages"]
    assert "peak_bytes" not in stage and "cp=2" in stage["peak_not_modelled"]
    assert verdict["needed_basis"] == "states + saved activations" and verdict["needed_bytes"] == stage["total_bytes"]


def test_a_lower_bound_that_fits_is_a_maybe_not_a_yes():
    """Where the step's peak is not modelled, states + saved activations are a lower bound: under the budget they
    say neither yes nor no (fits null, "maybe"); over it, no. tp-sp beside dp_shard under torchtitan's pipeline is
    not walked, and the gathered weights and fp32 gradients its stages hold all step are not in that bound (its plain
    loss: beside pp and dp_shard the chunked one is not walked either)."""
    args = ["--config", "llama3-70b", "--impl", "torchtitan", "--pp", "8", "--dp-shard", "8", "--t", "2", "--totals",
            "--loss-chunks", "0"]
    verdict = _json(*args)["per_gpu"]["strategies"]
    assert verdict["none"]["needed_basis"] == "the step's peak" and verdict["none"]["fits"] is False
    assert verdict["tp-sp"]["needed_basis"] == "states + saved activations" and verdict["tp-sp"]["fits"] is None
    assert verdict["tp-sp"]["headroom_bytes"] > 0
    out = memcalc_cli("estimate", *args).out
    assert "  tp-sp: maybe, " in out and "  none: no, " in out
    tight = _json(*args, "--device-memory", str(verdict["tp-sp"]["needed_bytes"] - 1), "--reserve", "0")
    assert tight["per_gpu"]["strategies"]["tp-sp"]["fits"] is False


def test_hf_config_names_the_attention_kernel_it_takes_from_the_implementation():
    run = memcalc_cli("estimate", "--hf-config", "tests/data/hf/llama2-7b.json", "--impl", "hf", "--json")
    assert run.err.count("\n") == 1 and "defaults (impl hf's, else the seed's): attention=flash" in run.err
    assert json.loads(run.out)["config"]["attention"] == "flash"  # transformers' default: SDPA


def test_mixtral_totals_count_its_experts_and_give_the_steps_peak():
    """The step timeline walks megatron-core's MoELayer (memcalc.sizing.timeline.megatron_moe): Mixtral's peak and
    Qwen1.5-MoE's (shared experts, the softmax before the top k, 60 experts sharing 16,384 slots; at t = 1 and 2) are
    modelled, and beside ep (one expert a rank too); a MoE layer it does not model yet (the load-balancing loss) is refused by name
    there."""
    run = memcalc_cli("estimate", "--config", "mixtral-8x7b", "--totals")
    assert run.code == 3, run.err  # 834 GiB on one GPU fits no 80 GB card
    assert "46,702,792,704 parameters" in run.out
    assert "895,757,891,588 B = 834.24 GiB (the step's peak)" in run.out
    shared = memcalc_cli("estimate", "--config", "qwen1.5-moe-a2.7b", "--totals")
    assert "278,536,244,484 B = 259.41 GiB (the step's peak)" in shared.out
    shared_tp = memcalc_cli("estimate", "--config", "qwen1.5-moe-a2.7b", "--t", "2", "--totals")
    assert "tp-sp: no, 140,124,498,436 B = 130.50 GiB (the step's peak)" in shared_tp.out  # shared experts at t = 2
    ep = memcalc_cli("estimate", "--config", "mixtral-8x7b", "--ep", "2", "--dp", "2", "--t", "2", "--totals")
    assert "tp-sp: no, 246,027,726,852 B = 229.13 GiB (the step's peak)" in ep.out  # ep beside tp-sp
    full = memcalc_cli("estimate", "--config", "mixtral-8x7b", "--ep", "4", "--dp", "4", "--t", "2", "--recompute",
                       "full", "--totals")
    assert "tp-sp: no, 118,090,162,204 B = 109.98 GiB (the step's peak)" in full.out
    one = memcalc_cli("estimate", "--config", "mixtral-8x7b", "--ep", "8", "--dp", "8", "--totals")
    assert "none: no, 185,477,672,964 B = 172.74 GiB (the step's peak)" in one.out  # one expert a rank
    refused = memcalc_cli("estimate", "--config", "mixtral-8x7b", "--moe-aux-loss", "--totals")
    assert "(states + saved activations)" in refused.out
    assert "does not model the load-balancing loss" in " ".join(refused.out.split())


def test_qwen3_moe_totals_give_the_steps_peak_with_its_wide_normed_heads():
    """Qwen3-30B-A3B's heads are kv_channels = 128 wide (a*d = 4096 against h = 2048) and normed per head
    (qk_layernorm): megatron's step walks both (memcalc.sizing.timeline.megatron), at t = 1 and under tp-sp."""
    run = memcalc_cli("estimate", "--config", "qwen3-30b-a3b", "--totals", "--t", "4")
    assert run.code == 3, run.err
    assert "none: no, 583,181,680,644 B = 543.13 GiB (the step's peak)" in run.out
    assert "tp-sp: no, 150,805,864,452 B = 140.45 GiB (the step's peak)" in run.out


def test_torchtitans_qwen3_totals_give_the_steps_peak_with_its_head_norms_and_cos_sin_rope():
    """torchtitan's Qwen3 attention (q_norm and k_norm on each head, CosSinRoPE) is walked
    (memcalc.sizing.timeline.torchtitan): the verdict is on the step's peak for none, tp and tp-sp alike; under its
    chunked loss (its model configs') in the last MoE block's backward, under its plain loss in the loss's."""
    run = memcalc_cli("estimate", "--config", "qwen3-30b-a3b", "--impl", "torchtitan", "--totals", "--t", "4")
    assert run.code == 3, run.err
    assert "none: no, 555,792,512,524 B = 517.62 GiB (the step's peak)" in run.out
    assert "tp: no, 140,865,082,892 B = 131.19 GiB (the step's peak)" in run.out
    assert "tp-sp: no, 140,235,912,716 B = 130.60 GiB (the step's peak)" in run.out
    plain = memcalc_cli("estimate", "--config", "qwen3-30b-a3b", "--impl", "torchtitan", "--totals", "--t", "4",
                        "--loss-chunks", "0")
    assert "none: no, 561,754,485,772 B = 523.17 GiB (the step's peak)" in plain.out
    assert "tp: no, 142,028,301,328 B = 132.27 GiB (the step's peak)" in plain.out
    assert "tp-sp: no, 141,411,726,352 B = 131.70 GiB (the step's peak)" in plain.out


def test_torchtitans_activation_checkpointing_has_a_modelled_step_peak_below_the_one_without_it():
    """`--recompute full` and `op` (its FullAC and SelectiveAC) are walked on the CPU kernels, not refused: each
    strategy's verdict is on the step's peak, full's the lowest, op's between."""
    llama = ["--hf-config", "tests/data/hf/llama-tiny.json", "--impl", "torchtitan", "--b", "2", "--s", "24",
             "--t", "2", "--device", "cpu", "--totals"]
    per = {r: _json(*llama, "--recompute", r)["per_gpu"]["strategies"] for r in ("none", "op", "full")}
    for name in ("none", "tp", "tp-sp"):
        assert {per[r][name]["needed_basis"] for r in per} == {"the step's peak"}
        assert per["full"][name]["needed_bytes"] < per["op"][name]["needed_bytes"] < per["none"][name]["needed_bytes"]


def test_torchtitans_moe_under_its_activation_checkpointing_has_a_modelled_step_peak():
    """Mixtral under impl torchtitan (its trainer's default: SelectiveAC, `op`) walks its Qwen3-style MoE layers on
    the CPU kernels, not refused: the verdict is on the step's peak, FullAC's below it, no recomputation's above."""
    mixtral = ["--config", "mixtral-8x7b", "--impl", "torchtitan", "--device", "cpu", "--totals"]
    run = memcalc_cli("estimate", *mixtral)
    assert run.code == 3, run.err  # 789 GiB on one GPU fits no 80 GB card
    assert "847,146,739,756 B = 788.97 GiB (the step's peak)" in run.out
    per = {r: _json(*mixtral, "--recompute", r)["per_gpu"]["strategies"]["none"] for r in ("none", "op", "full")}
    assert {per[r]["needed_basis"] for r in per} == {"the step's peak"}
    assert per["full"]["needed_bytes"] < per["op"]["needed_bytes"] < per["none"]["needed_bytes"]


def test_latent_attention_without_experts_has_a_modelled_step_peak():
    """megatron-core's MLASelfAttention is walked (memcalc.sizing.timeline.megatron_mla): at t = 1, under tp and
    tp-sp the verdict is on the step's peak, above states and saved activations."""
    latent = ["--kv-lora-rank", "512", "--q-lora-rank", "1536", "--qk-rope-head-dim", "64", "--qk-nope-head-dim",
              "128", "--v-head-dim", "128"]
    per = _json("--config", "llama2-7b", "--attention", "eager", *latent, "--totals")["per_gpu"]["strategies"]
    for name in ("none", "tp", "tp-sp"):
        (stage,) = per[name]["stages"]
        assert per[name]["needed_basis"] == "the step's peak" and stage["peak_bytes"] > stage["total_bytes"]


def test_deepseek_v3_totals_give_the_steps_peak_in_its_last_layers_attention_core():
    """Issue 19: DeepSeek-V3's 61 layers (latent attention; three dense MLPs, then 256 experts under the sigmoid
    router beside a shared one) are walked, not refused: each strategy's verdict is on the step's peak."""
    run = memcalc_cli("estimate", "--config", "deepseek-v3", "--totals")
    assert run.code == 3, run.err  # 11 TiB on one GPU fits no card
    assert "671,026,404,352 parameters" in run.out and "not modelled" not in run.out
    assert "12,491,063,502,860 B = 11.36 TiB (the step's peak)" in run.out
    # read, as MemTracker reads it, inside attention_dropout: at p = 0 torch's ModTracker never leaves it in backward
    assert ("none: the step peaks at 11.36 TiB, backward layers.60.attention.core_attention.attention_dropout"
            " (softmax)") in " ".join(run.out.split())


def test_hf_gradient_checkpointing_has_a_modelled_step_peak_below_the_one_without_it():
    """`--impl hf --recompute full` (gradient_checkpointing_enable's non-reentrant checkpoint around each decoder
    layer, memcalc.sizing.timeline.hf) is walked, not refused: at t = 1 and under transformers' tp_plan the verdict
    is on the step's peak, the lower one."""
    llama = ["--config", "llama2-7b", "--impl", "hf", "--totals"]
    per = {r: _json(*llama, "--recompute", r)["per_gpu"]["strategies"] for r in ("none", "full")}
    for name in ("none", "tp"):
        assert {per[r][name]["needed_basis"] for r in per} == {"the step's peak"}
        assert per["full"][name]["needed_bytes"] < per["none"][name]["needed_bytes"]


def test_mixtral_under_recomputation_has_a_modelled_step_peak_below_the_one_without_it():
    """megatron-core's MoELayer under recomputation is walked: selective reruns the attention core alone, the MoE
    layer untouched, full the whole layer; each strategy's verdict is on the step's peak, full's the lowest."""
    per = {r: _json("--config", "mixtral-8x7b", "--recompute", r, "--totals")["per_gpu"]["strategies"]
           for r in ("none", "selective", "full")}
    for name in ("none", "tp-sp"):
        assert {per[r][name]["needed_basis"] for r in per} == {"the step's peak"}
        assert per["full"][name]["needed_bytes"] < per["selective"][name]["needed_bytes"] \
            < per["none"][name]["needed_bytes"]


def test_megatron_experts_without_biases_are_one_flag_away():
    """megatron-core refuses biases in experts at etp = t > 1, and Megatron's default is biases on: without a flag
    for add_bias_linear, a MoE layout from flags alone had no way past the refusal."""
    model = ("--num-experts", "8", "--t", "2", "--s", "64", "--h", "64", "--a", "8", "--L", "2", "--strategy", "tp-sp")
    one_line_error(memcalc_cli("estimate", *model), "refuses biases in its experts", "give --no-bias-linear")
    run = memcalc_cli("estimate", *model, "--no-bias-linear", "--json")
    assert run.code == 0 and json.loads(run.out)["config"]["add_bias_linear"] is False
