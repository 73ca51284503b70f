"""torchtitan's own Llama3 block, under its own TP plan, keeps tensor by tensor what the torchtitan rules predict."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchtitan")
pytestmark = pytest.mark.usefixtures("one_thread")

import torch  # noqa: E402

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.errors import ConfigError  # noqa: E402
from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import torchtitan as runner  # noqa: E402
from memcalc.probe.libs import torchtitan_shim as shim  # noqa: E402
from memcalc.probe.measure import compare  # noqa: E402

LLAMA3 = {
    "b": 2, "s": 16, "h": 64, "a": 4, "ffn_hidden_size": 96, "impl": "torchtitan",
    "norm": "rmsnorm", "mlp": "swiglu", "attention": "flash", "dropout": 0.0, "recompute": "none",
}
GQA = {"num_query_groups": 2}
QWEN3 = {"qk_layernorm": True, "kv_channels": 12, "num_query_groups": 2}  # its Qwen3 block: heads of 12, not h/a = 16
# its DeepSeek-V3 block, small: a key/value latent of 24, heads of d_n + d_r = 8 + 4, values of d_v = 12 (the CPU
# stand-in's flash kernel needs d_v = d_n + d_r)
MLA = {"kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}
Q_LATENT = {"q_lora_rank": 16}


def _measured(knobs: dict, t: int, strategy: str, mode: str = "fake") -> list:
    """Each rank's rows: what the block kept next to the rules' prediction for the CPU."""
    config = build_config(LLAMA3 | knobs | {"t": t})
    prediction = estimate(config, STRATEGIES[strategy], Accounting(exact=True, device="cpu"))
    per_rank = run(runner.run_layer, (config, STRATEGIES[strategy]), mode="single" if t == 1 else mode, t=t)
    return [compare(prediction, saved) for saved in per_rank]


def _differences(rows) -> list[str]:
    return [row.describe() for row in rows if not row.matches]


CASES = {
    "none, mha: CPU rms_norm's fp32 tensors, q/k/v, lse, the SDPA output as wo's input": ({}, 1, "none"),
    "none, gqa: k and v at g heads": (GQA, 1, "none"),
    "tp t=2, gqa: norms and the linears' inputs whole, the rest split": (GQA, 2, "tp"),
    "tp-sp t=2, mha: norms split by s, wqkv's and w1/w3's inputs kept gathered": ({}, 2, "tp-sp"),
    "tp-sp t=2, gqa": (GQA, 2, "tp-sp"),
    "tp-sp t=4, mha": ({"num_query_groups": 4}, 4, "tp-sp"),
    "tp-sp t=4, gqa (one k/v head per rank)": ({"num_query_groups": 4, "a": 8}, 4, "tp-sp"),
    "full recompute: the block's input shard alone": ({"recompute": "full"}, 2, "tp-sp"),
    "op recompute, none: wqkv, attention, w1 and w2 outputs and the input": (GQA | {"recompute": "op"}, 1, "none"),
    "op recompute, tp-sp t=2: w2's output whole before the reduce-scatter": (GQA | {"recompute": "op"}, 2, "tp-sp"),
    "op recompute, tp t=4": ({"recompute": "op", "num_query_groups": 4}, 4, "tp"),
    "fp32, tp-sp t=2: the norm's upcast is its input itself": (GQA | {"dtype": "fp32"}, 2, "tp-sp"),
    # issue 18: at b = 1 a block of the sequence is already contiguous; the rank's input must still own only it
    "b=1, op recompute, tp-sp t=4: the input shard alone": (
        {"b": 1, "s": 64, "h": 256, "a": 8, "num_query_groups": 4, "ffn_hidden_size": 1024, "recompute": "op"},
        4, "tp-sp"),
    "b=1, full recompute, tp-sp t=2": ({"b": 1, "recompute": "full"}, 2, "tp-sp"),
    # issue 18, found by tests/probe/test_differential.py: CONDITIONS in memcalc/model/impls/torchtitan.py
    "b=s=1, one K/V group: V is a view, SDPA keeps the whole wqkv output": (
        {"b": 1, "s": 1, "num_query_groups": 1}, 1, "none"),
    "b=s=1, tp t=2, one K/V group per rank": ({"b": 1, "s": 1, "num_query_groups": 2}, 2, "tp"),
    "b=s=1, two K/V groups: V is copied": ({"b": 1, "s": 1, "num_query_groups": 2}, 1, "none"),
    # torchtitan's Qwen3 block (qk_layernorm): q_norm and k_norm on each head's d channels, heads of kv_channels
    "qwen3, none, b=1, s odd: each head norm's fp32 upcast, rstd and normed input": (QWEN3 | {"b": 1, "s": 13}, 1,
                                                                                    "none"),
    "qwen3, tp t=2: the head norms split by heads": (QWEN3 | {"b": 1, "s": 13}, 2, "tp"),
    "qwen3, tp-sp t=2, three query heads a group": (QWEN3 | {"a": 6, "s": 14}, 2, "tp-sp"),
    "qwen3, tp-sp t=4, one K/V group per rank": (QWEN3 | {"a": 8, "num_query_groups": 4}, 4, "tp-sp"),
    "qwen3, heads of h/a": ({"qk_layernorm": True, "b": 1, "s": 7}, 1, "none"),
    "qwen3, op recompute, tp t=2": (QWEN3 | {"recompute": "op", "s": 13}, 2, "tp"),
    "qwen3, full recompute, tp-sp t=2": (QWEN3 | {"recompute": "full"}, 2, "tp-sp"),
    "qwen3, fp32, tp t=2: the head norms' upcast is their input": (QWEN3 | {"dtype": "fp32", "s": 13}, 2, "tp"),
    "qwen3, b=s=1, one K/V group: q and k are views of wqkv's output, V's": (
        QWEN3 | {"b": 1, "s": 1, "num_query_groups": 1}, 1, "none"),
    "qwen3, b=s=1, fp32, tp t=2, one K/V group per rank: the head norms keep those views": (
        QWEN3 | {"b": 1, "s": 1, "dtype": "fp32"}, 2, "tp"),
    # torchtitan's DeepSeek-V3 block (kv_lora_rank): latents whole on every rank, V a view of wkv_b's output
    "mla, none, b=2, s odd: kv_norm's fp32 upcast, wkv_b's whole output in V's place": (MLA | {"s": 7}, 1, "none"),
    "mla with a query latent, none, b=1, s odd: q_norm's tensors and wq_b's input": (
        MLA | Q_LATENT | {"b": 1, "s": 5}, 1, "none"),
    "mla, tp t=2, s odd: the latents whole, the heads split": (MLA | {"s": 9}, 2, "tp"),
    "mla with a query latent, tp t=2, b=1": (MLA | Q_LATENT | {"b": 1, "s": 13}, 2, "tp"),
    "mla, tp-sp t=2: x gathered, the latents whole": (MLA | {"s": 10}, 2, "tp-sp"),
    "mla with a query latent, tp-sp t=2, b=1": (MLA | Q_LATENT | {"b": 1, "s": 14}, 2, "tp-sp"),
    "mla with a query latent, tp-sp t=4, eight heads": (MLA | Q_LATENT | {"a": 8}, 4, "tp-sp"),
    "mla, full recompute, tp-sp t=2": (MLA | Q_LATENT | {"recompute": "full"}, 2, "tp-sp"),
    "mla, op recompute, none, s odd: wq's and wkv_b's outputs, w1's and w2's (four matmuls before them)": (
        MLA | {"recompute": "op", "s": 7}, 1, "none"),
    "mla with a query latent, op recompute, none: wq_a's, wkv_a's, wo's and w3's outputs (five before them)": (
        MLA | Q_LATENT | {"recompute": "op", "b": 1, "s": 5}, 1, "none"),
    "mla, op recompute, tp t=2": (MLA | {"recompute": "op", "s": 9}, 2, "tp"),
    "mla with a query latent, op recompute, tp-sp t=2: wo's output whole before its reduce-scatter": (
        MLA | Q_LATENT | {"recompute": "op"}, 2, "tp-sp"),
}


@pytest.mark.parametrize("knobs, t, strategy", CASES.values(), ids=CASES.keys())
def test_the_block_keeps_exactly_what_the_rules_predict(knobs, t, strategy):
    (rows,) = _measured(knobs, t, strategy)
    assert _differences(rows) == []
    assert all(row.measured > 0 for row in rows)  # every predicted tensor was found, none unlabelled


@pytest.mark.procs
def test_two_gloo_ranks_each_keep_what_rank_zero_of_the_fake_group_keeps():
    ranks = _measured(GQA, 2, "tp-sp", mode="spawn")
    assert [_differences(rows) for rows in ranks] == [[], []]
    assert ranks[0] == ranks[1]


def test_under_sequence_parallelism_the_column_parallel_inputs_are_kept_whole():
    (rows,) = _measured(GQA, 2, "tp-sp")
    shapes = {row.name: row.measured_shape for row in rows}
    b, s, h = (LLAMA3[k] for k in "bsh")
    assert shapes["attention/qkv_in"] == shapes["mlp/fc1_in"] == (b, s, h)
    assert shapes["ln1/input_fp32"] == (b, s // 2, h)


@pytest.mark.parametrize("knobs, reason", [
    ({"norm": "layernorm"}, "norm layernorm"),
    ({"mlp": "gelu"}, "mlp gelu"),
    ({"attention": "eager"}, "attention eager"),
    ({"dropout": 0.1}, "dropout 0.1"),
    ({"recompute": "selective"}, "recompute op"),
    ({"bias_activation_fusion": True}, "Megatron's fused kernel"),
    ({"dtype": "fp16"}, "bfloat16 or float32"),
    ({"kv_channels": 8}, "kv_channels 8 .* set qk_layernorm"),
    (QWEN3 | {"kv_channels": 5}, "d = 5 is odd"),
    ({"h": 36}, "ComplexRoPE reshapes each head into channel pairs: d = 9 is odd"),
])
def test_knobs_torchtitans_llama3_does_not_have_are_refused_with_the_reason(knobs, reason):
    with pytest.raises(ConfigError, match=reason):
        estimate(build_config(LLAMA3 | knobs | {"t": 2}), STRATEGIES["tp-sp"])


@pytest.mark.parametrize("knobs, reason", [
    ({"dtype": "fp32"}, "dtype fp32: measured in bf16 only"),
    ({"qk_rope_head_dim": 5}, "qk_rope_head_dim = 5 is odd"),
])
def test_latent_attention_knobs_not_measured_on_torchtitans_block_are_refused_with_the_reason(knobs, reason):
    with pytest.raises(ConfigError, match=reason):
        estimate(build_config(LLAMA3 | MLA | knobs | {"t": 2}), STRATEGIES["tp-sp"])


def test_the_probe_refuses_values_of_another_width_than_the_heads_the_cpu_flash_kernel_needs():
    config = build_config(LLAMA3 | MLA | {"v_head_dim": 10})
    with pytest.raises(ConfigError, match="v_head_dim 10 is not qk_nope_head_dim"):
        runner.block_config(config, False)


def test_on_cuda_the_latent_norms_are_fused_kv_norm_keeping_wkv_as_output_and_rope_its_gathered_table():
    """The fused rms_norm keeps its input as passed: kv_norm's, a split of wkv_a's output, keeps that whole (the
    latent and the keys' RoPE part); ComplexRoPE keeps its table gathered at the trainer's positions, d_r wide."""
    config = build_config(LLAMA3 | MLA | Q_LATENT | {"t": 2})
    sp = STRATEGIES["tp-sp"]
    on = {device: {x.tensor.name: x for x in estimate(config, sp, Accounting(exact=True, device=device)).tensors}
          for device in ("cpu", "cuda")}
    assert set(on["cuda"]) - set(on["cpu"]) == {"ln1/input", "ln2/input", "mla/q_norm_input", "mla/kv_norm_input",
                                                 "mla/rope_cache"}
    b, s = LLAMA3["b"], LLAMA3["s"]
    assert on["cuda"]["mla/kv_norm_input"].bytes == b * s * (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 2
    assert on["cuda"]["mla/rope_cache"].bytes == b * s * MLA["qk_rope_head_dim"] * 4


def test_llama3s_complex_rope_raises_on_heads_of_odd_width_as_the_refusal_says():
    shim.stub_triton_kernels()
    from torchtitan.models.common.rope import ComplexRoPE

    rope = ComplexRoPE(ComplexRoPE.Config(dim=9, max_seq_len=16))
    q = torch.zeros(2, 16, 4, 9)
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        rope(q, q, None)


def test_on_cuda_the_norm_is_the_fused_kernel_and_rope_keeps_its_table_gathered_at_the_positions():
    """Compiled flex attention keeps what SDPA's flash kernel keeps (its row maxima are not saved); the trainer's
    positions make RoPE gather its table per token, a tensor each block keeps."""
    config = build_config(LLAMA3 | {"t": 2})
    on = {device: [x.tensor.name for x in estimate(config, STRATEGIES["tp-sp"], Accounting(exact=True, device=device))
                   .tensors] for device in ("cpu", "cuda")}
    assert [n for n in on["cuda"] if n.startswith("ln1/")] == ["ln1/input", "ln1/rstd_fp32"]
    assert set(on["cuda"]) - set(on["cpu"]) == {"ln1/input", "ln2/input", "attention/rope_cache"}


def test_on_cuda_qwen3s_head_norms_keep_their_input_and_its_rope_the_cos_and_sin_halves_of_its_table():
    """Qwen3's CosSinRoPE gathers a (b, s, 2d) fp32 table at the positions, of which q's and k's products keep the
    cos and sin halves; the fused rms_norm keeps each head norm's bf16 input and fp32 rstd."""
    config = build_config(LLAMA3 | QWEN3 | {"t": 2})
    on = {device: {x.tensor.name: x for x in estimate(config, STRATEGIES["tp"], Accounting(exact=True, device=device))
                   .tensors} for device in ("cpu", "cuda")}
    added = {"ln1/input", "ln2/input", "attention/q_norm_input", "attention/k_norm_input", "attention/rope_cos",
             "attention/rope_sin"}
    assert set(on["cuda"]) - set(on["cpu"]) == added
    b, s, d = LLAMA3["b"], LLAMA3["s"], QWEN3["kv_channels"]
    assert on["cuda"]["attention/rope_cos"].bytes + on["cuda"]["attention/rope_sin"].bytes == b * s * 2 * d * 4
    assert on["cuda"]["attention/q_norm_input"].bytes == b * s * LLAMA3["a"] // 2 * d * 2


def test_the_op_checkpointing_patch_undoes_itself():
    from torchtitan.distributed import activation_checkpoint

    original = activation_checkpoint._get_default_save_ops
    with shim.cuda_like_op_checkpointing():
        assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in (
            activation_checkpoint._get_default_save_ops()
        )
    assert activation_checkpoint._get_default_save_ops is original


@pytest.mark.parametrize("knobs", [GQA, QWEN3, MLA, MLA | Q_LATENT],
                         ids=["llama3", "qwen3", "deepseek-v3", "deepseek-v3 with a query latent"])
def test_a_blocks_parameters_are_the_inventorys_by_name_and_shape(knobs):
    """Each parameter of torchtitan's own block (Qwen3's with its q_norm and k_norm, one head's d channels each;
    DeepSeek-V3's latent attention, its down projections, latent norms and up projections), path and shape, as the
    model the probe builds registers it: what the count, the step walk's weight gradients and FSDP2's shards read
    (memcalc.sizing.params)."""
    from memcalc.sizing.params import torchtitan_layer_params

    config = build_config(LLAMA3 | knobs)
    with torch.device("meta"):
        model = runner.model_config(config, False, 1, 32).build()
    built = {n.removesuffix(".weight"): tuple(p.shape) for n, p in model.named_parameters() if n.startswith("layers.0.")}
    assert {p.module: p.shape for p in torchtitan_layer_params(config, 1, "layers.0", False)} == built
