"""Parameters per GPU and the bytes of weights, gradients and Adam: against published parameter counts,
by-hand tensor-parallel shards, and Megatron-LM's 18 and 6 + 12/dp bytes per parameter."""

import pytest

from memcalc.config.schema import build_config, load_config
from memcalc.sizing.pipeline import stages
from memcalc.sizing.states import group_params, padded_vocab, state_bytes, total_params, vocab_shard

# By-hand counts use v as given (no padding); the padding tests below set the divisor themselves.
GPT = dict(s=128, h=64, a=8, L=4, vocab_size=1000, make_vocab_size_divisible_by=1)


def _held(config, t):
    """Parameters one rank of each bounding stage holds, by stage name."""
    return {st.name: sum(group_params(config, st, t).values()) for st in stages(config.L, config.pp, config.vpp)}


def test_llama3_70b_config_has_its_published_parameter_count():
    assert total_params(load_config("llama3-70b", {})) == 70_553_706_496


def test_gpt_layer_by_hand():
    """12h^2 + 13h per layer (QKV 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h)."""
    h, L, v, s = 64, 4, 1000, 128
    embeddings = v * h + s * h  # word table and a learned position table of s rows
    assert total_params(build_config(GPT)) == L * (12 * h * h + 13 * h) + embeddings + 2 * h


def test_tensor_parallel_splits_all_but_norms_row_biases_and_positions():
    h, L, s, t = 64, 4, 128, 4
    whole, one_rank = _held(build_config(GPT), 1)["only"], _held(build_config(GPT | {"t": t}), t)["only"]
    replicated = L * (4 * h + 2 * h) + s * h + 2 * h  # per layer: two LayerNorms, proj and fc2 biases
    assert t * one_rank - (t - 1) * replicated == whole


def test_vocabulary_is_padded_to_a_multiple_of_t():
    config = build_config(GPT | {"vocab_size": 1001, "t": 8, "add_bias_linear": False, "norm": "rmsnorm"})
    h = 64
    layer = (4 * h * h + 8 * h * h) // 8 + 2 * h
    assert _held(config, 8)["only"] == 4 * layer + 126 * h + 128 * h + h  # ceil(1001/8) = 126 rows


@pytest.mark.parametrize("v,t,padded", [(50257, 1, 50304), (50257, 8, 51200), (51200, 8, 51200), (128256, 8, 129024)])
def test_vocabulary_is_padded_as_megatron_does_to_128_times_t(v, t, padded):
    """Megatron-LM's _vocab_size_with_padding: GPT-2's 50257 becomes 50304 on one rank and 51200 at t=8."""
    config = build_config(GPT | {"vocab_size": v, "t": t, "make_vocab_size_divisible_by": 128})
    assert padded_vocab(config, t) == padded
    assert vocab_shard(config, t) * t == padded


def test_padded_vocabulary_rows_are_held_but_not_counted_as_the_models_parameters():
    unpadded, padded = (build_config(GPT | {"make_vocab_size_divisible_by": d}) for d in (1, 128))
    assert _held(padded, 1)["only"] - _held(unpadded, 1)["only"] == (1024 - 1000) * 64  # 24 padded rows of h
    assert total_params(padded) == total_params(unpadded)


def test_tied_output_layer_is_free_on_one_stage_and_a_copy_on_the_last_of_several():
    h, v = 64, 1000
    one = _held(build_config(GPT), 1)["only"]
    assert _held(build_config(GPT | {"tie_embeddings": False}), 1)["only"] == one + v * h
    held = _held(build_config(GPT | {"pp": 2}), 1)
    assert held["first"] + held["last"] == one + v * h  # Megatron-LM keeps the embedding's copy on the last stage
    assert total_params(build_config(GPT | {"pp": 2})) == one


def test_swiglu_and_gqa_change_the_layer_weights():
    h, f, g, a = 64, 96, 2, 8
    config = build_config(GPT | dict(mlp="swiglu", ffn_hidden_size=f, num_query_groups=g, add_bias_linear=False,
                                     norm="rmsnorm", position_embedding_type="rope", vocab_size=10))
    d = h // a
    layer = h * (a + 2 * g) * d + h * h + 3 * h * f + 2 * h
    assert total_params(config) == 4 * layer + 10 * h + h


@pytest.mark.parametrize("dtype,per_param", [("bf16", 18), ("fp16", 18), ("fp32", 16)])
def test_bytes_per_parameter_without_distributed_optimizer(dtype, per_param):
    """Megatron-LM: 2 (bf16 weight) + 4 (fp32 grad) + 4 (fp32 master) + 8 (Adam); fp32 needs no master copy."""
    assert sum(state_bytes(build_config(GPT | {"dtype": dtype}), 1000).values()) == per_param * 1000


@pytest.mark.parametrize("dp,cp", [(1, 1), (8, 1), (4, 2), (3, 1)])
def test_distributed_optimizer_shards_twelve_bytes_over_dp_times_cp(dp, cp):
    """Megatron-LM: 6 + 12/(data-parallel size) bytes per parameter; its optimizer group spans dp*cp ranks."""
    fields = GPT | dict(dp=dp, cp=cp, distributed_optimizer=True, attention="flash")
    params = 24_000
    got = state_bytes(build_config(fields), params)
    assert sum(got.values()) == 6 * params + 12 * params // (dp * cp)
    assert got["states/weights"] == 2 * params and got["states/grads"] == 4 * params


def test_data_parallelism_alone_shards_nothing():
    assert state_bytes(build_config(GPT | {"dp": 8}), 100) == state_bytes(build_config(GPT), 100)
