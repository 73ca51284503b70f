"""The step's peak in words (memcalc.sizing.timeline.words): where it is, and which of FSDP2's or ZeRO's buffers sit on
the states then, said of the blocks they belong to; in `estimate --totals`' text and JSON."""

import json

import pytest

from memcalc.config.schema import build_config
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.timeline import timeline
from memcalc.sizing.timeline.words import in_words
from tests.cli import memcalc_cli

LLAMA = dict(impl="hf", b=2, s=24, h=64, a=8, L=2, vocab_size=256, mlp="swiglu", ffn_hidden_size=176, norm="rmsnorm",
             num_query_groups=2, position_embedding_type="rope", add_bias_linear=False, dropout=0.0,
             tie_embeddings=False, attention="flash", dp=8)


def _peak(**changes):
    walk = timeline(build_config(LLAMA | changes), STRATEGIES["none"])
    return walk.peak, {x.name for x in walk.peak.live}


def test_fsdp2s_peak_names_its_block_gathered_and_the_previous_blocks_reduce_scatter():
    """At dp_shard 8 this Llama peaks as layer 0's backward begins: layer 0 copied out of its all-gather buffer
    while layer 1's gradients still wait in their reduce-scatter buffer."""
    peak, live = _peak(dp_shard=8)
    assert {"fsdp/layers.0 unsharded", "fsdp/layers.1 reduce-scatter"} <= live
    words = in_words(peak)
    assert words.startswith("backward of layer 0 (")
    assert "its gathered parameters" in words and "the reduce-scatter of layer 1's gradients" in words


def test_torchtitans_peak_under_fsdp2_is_said_of_its_block():
    """torchtitan's module paths have no `model.` ahead of `layers.N` (under its checkpointing the block's is
    layers.N._checkpoint_wrapped_module): a MoE model's peak at dp_shard 2 in a block's backward is that layer's,
    not the root's."""
    from memcalc.model.knobs import Accounting

    config = build_config({"impl": "torchtitan", "num_experts": 4, "moe_router_topk": 2} | {
        k: LLAMA[k] for k in ("b", "s", "h", "a", "L", "vocab_size", "ffn_hidden_size", "num_query_groups")} | {
        "position_embedding_type": "rope", "add_bias_linear": False, "tie_embeddings": False, "dp_shard": 2})
    peak = timeline(config, STRATEGIES["none"], Accounting(device="cpu")).peak
    assert peak.where.startswith("layers.") and in_words(peak).startswith(f"{peak.phase} of layer {peak.where[7]} (")


def test_a_moment_under_zero3_names_the_gathered_modules_and_the_bucket():
    walk = timeline(build_config(LLAMA | {"zero_stage": 3}), STRATEGIES["none"])
    (moment,) = [m for m in walk.moments if m.where == "model.layers.1.self_attn.q_proj" and "reduce bucket" in m.what]
    assert in_words(moment).endswith(": its modules gathered by ZeRO-3, ZeRO's reduce bucket and the gradient"
                                     " partition")


def test_zero2s_peak_in_its_step_names_the_gradient_partition_not_stage_1s_whole_gradients():
    """The gradient norm DeepSpeed's step makes is no gradient stage 1 keeps whole."""
    peak, _ = _peak(zero_stage=2, dp=2, b=1, s=7)
    assert (peak.phase, in_words(peak)) == ("optimizer", f"optimizer ({peak.what}): the gradient partition")


def test_without_sharding_a_moment_is_its_phase_block_and_op_alone():
    peak, _ = _peak()
    assert in_words(peak) == f"{peak.phase} ({peak.what})"


@pytest.mark.parametrize("flag", ["--dp-shard=8", "--zero-stage=2"])
def test_estimate_totals_says_the_peaks_moment_in_words_in_text_and_json(tmp_path, flag):
    import yaml

    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in LLAMA.items() if k != "dp"}))
    args = ("estimate", "--config", str(path), "--dp=8", flag, "--strategy=none", "--totals")
    text, doc = memcalc_cli(*args), memcalc_cli(*args, "--json")
    assert text.code == 0 and doc.code == 0, text.err + doc.err
    (stage,) = json.loads(doc.out)["per_gpu"]["strategies"]["none"]["stages"]
    assert f"none: at the peak, {stage['peak_in_words']}" in " ".join(text.out.split())


def test_a_pipeline_stage_under_fsdp2_says_its_layers_in_a_row_as_one_range():
    """Under torchtitan's pipeline FSDP2 keeps every unit of a stage gathered all step, and the loss's backward holds
    each layer's accumulated gradients: each phrase says the stage's layers once, as a range lowest first, and the
    units that are no layer (norm+lm_head) by name."""
    from memcalc.model.knobs import Accounting

    config = build_config({"impl": "torchtitan"} | {
        k: LLAMA[k] for k in ("b", "s", "h", "a", "vocab_size", "ffn_hidden_size", "num_query_groups")} | {
        "L": 8, "pp": 2, "dp_shard": 2, "position_embedding_type": "rope", "add_bias_linear": False,
        "tie_embeddings": False, "loss_chunks": 0})  # the chunked loss is not walked beside pp and dp_shard
    walk = timeline(config, STRATEGIES["none"], Accounting(device="cpu"), stage="last")
    words = in_words(walk.peak)
    assert "layers 4 to 7's gathered parameters" in words and "layer 5's" not in words
    assert "norm+lm_head's gathered parameters" in words


def test_two_layers_in_a_row_are_said_one_by_one():
    from memcalc.sizing.timeline.words import _whose

    assert _whose(["layers.3", "layers.4"], None) == ["layer 3's", "layer 4's"]
    assert _whose(["layers.2", "layers.3", "layers.4", "layers.6"], "layers.6") == ["layers 2 to 4's", "its"]
    assert _whose(["layers.5", "layers.4", "layers.3", "norm+lm_head", "layers.1"], None) == [
        "layers 3 to 5's", "norm+lm_head's", "layer 1's"]
