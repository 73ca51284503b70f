"""Integer bytes per rank, checked against the seed's tables and formulas by hand."""

import pytest

from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.evaluate import TensorBytes, estimate, rank_shape
from memcalc.model.knobs import Accounting
from memcalc.model.ledger import GELU_IN, PROJ_IN, QKV_IN, Dim
from memcalc.model.strategy import NONE, TP, TP_SP

from tests.helpers import seed_bytes

SIZES = dict(b=4, s=40, h=80, a=10, t=5)  # where Megatron's fused softmax runs: b*a/t a multiple of 8


@pytest.mark.parametrize("strategy", [NONE, TP, TP_SP], ids=lambda x: x.name)
@pytest.mark.parametrize("sizes", [SIZES, dict(b=1, s=2048, h=12288, a=96, t=8), dict(b=8, s=32, h=8, a=1, t=1)])
def test_per_layer_bytes_are_the_seeds_formulas(strategy, sizes):
    result = estimate(build_config(sizes), strategy)
    assert result.per_layer_bytes == seed_bytes(strategy.name, **sizes)


def test_no_parallelism_matches_the_seeds_table_tensor_by_tensor():
    b, s, h, a = (SIZES[k] for k in "bsha")
    bsh, bass = b * s * h, b * a * s * s
    got = {x.tensor.name: x.bytes for x in estimate(build_config(SIZES), NONE).tensors}
    assert got == {
        # MLP: 19bsh
        "mlp/fc1_in": 2 * bsh, "mlp/gelu_in": 8 * bsh, "mlp/fc2_in": 8 * bsh, "mlp/dropout_mask": bsh,
        # attention: 11bsh + 5bas^2
        "attention/qkv_in": 2 * bsh, "attention/q": 2 * bsh, "attention/k": 2 * bsh, "attention/v": 2 * bsh,
        "attention/softmax_out": 2 * bass, "attention/dropout_out": 2 * bass, "attention/dropout_mask": bass,
        "attention/proj_in": 2 * bsh, "attention/out_dropout_mask": bsh,
        # two norms: 4bsh
        "ln1/input": 2 * bsh, "ln2/input": 2 * bsh,
    }


def test_all_layers_are_L_times_one_layer():
    one = estimate(build_config(SIZES | {"L": 1}), TP)
    many = estimate(build_config(SIZES | {"L": 7}), TP)
    assert many.per_layer_bytes == one.per_layer_bytes
    assert many.total_bytes == 7 * one.per_layer_bytes


def test_rank_shape_divides_only_the_split_dimension():
    sizes = {Dim.B: 2, Dim.S: 12, Dim.H: 6, Dim.A: 3, Dim.D: 2, Dim.F: 24}
    assert rank_shape(QKV_IN, NONE, sizes, 3) == (2, 12, 6)
    assert rank_shape(QKV_IN, TP, sizes, 3) == (2, 12, 6)
    assert rank_shape(QKV_IN, TP_SP, sizes, 3) == (2, 4, 6)
    assert rank_shape(PROJ_IN, TP, sizes, 3) == (2, 12, 1, 2)  # a/t heads of d
    assert rank_shape(GELU_IN, TP_SP, sizes, 3) == (2, 12, 8)


def test_tensor_bytes_is_element_width_times_element_count():
    assert TensorBytes(QKV_IN, (2, 3, 5), 2).bytes == 60


def test_estimate_reports_the_per_rank_shape_of_each_tensor():
    result = estimate(build_config(SIZES), TP_SP)
    shapes = {x.tensor.name: x.shape for x in result.tensors}
    b, s, h, a, t = (SIZES[k] for k in "bshat")
    assert shapes["attention/qkv_in"] == (b, s // t, h)
    assert shapes["attention/q"] == (b, a // t, s, h // a)
    assert shapes["attention/softmax_out"] == (b, a // t, s, s)
    assert shapes["mlp/gelu_in"] == (b, s, 4 * h // t)


def test_sequence_parallelism_needs_t_to_divide_s_but_tp_does_not():
    config = build_config(SIZES | {"s": 42})
    assert estimate(config, TP).per_layer_bytes > 0
    with pytest.raises(ConfigError, match=r"s=42 is not divisible by t=5"):
        estimate(config, TP_SP)


def test_exact_accounting_never_counts_less_than_the_paper():
    config = build_config(SIZES)
    for strategy in (NONE, TP, TP_SP):
        paper = estimate(config, strategy, Accounting()).per_layer_bytes
        assert estimate(config, strategy, Accounting(exact=True)).per_layer_bytes > paper


@pytest.mark.parametrize("fused", [False, True], ids=["F.gelu tanh", "fused bias_gelu"])
def test_megatron_keeps_for_tanh_gelu_what_it_keeps_for_exact_gelu(fused):
    def names_and_bytes(mlp):
        result = estimate(build_config(SIZES | {"mlp": mlp, "bias_activation_fusion": fused}), TP_SP)
        return [(t.tensor.name, t.bytes) for t in result.tensors], result.per_layer_bytes

    assert names_and_bytes("gelu_tanh") == names_and_bytes("gelu")


def test_megatrons_fused_tanh_gelu_needs_fc1s_bias():
    with pytest.raises(ConfigError, match="bias_activation_fusion with gelu_tanh fuses fc1's bias"):
        build_config(SIZES | {"mlp": "gelu_tanh", "bias_activation_fusion": True, "add_bias_linear": False})


@pytest.mark.parametrize("t, shared, words", [
    (2, None, "biases in its experts at etp = t = 2"),  # TransformerConfig: "Bias in Moe is only supported when ETP==1"
    (1, 64, "biases in its shared experts"),  # SharedExpertMLP asserts add_bias_linear == False
])
def test_megatron_refuses_biases_where_megatron_core_refuses_them_in_its_experts(t, shared, words):
    # estimate priced both (add_bias_linear is megatron's default) where megatron-core refuses to build the layer
    moe = {"num_experts": 4, "moe_shared_expert_intermediate_size": shared, "t": t}
    with pytest.raises(ConfigError, match=words):
        build_config(SIZES | moe)
    assert build_config(SIZES | moe | {"add_bias_linear": False}).moe
    assert build_config(SIZES | moe | {"t": 1, "moe_shared_expert_intermediate_size": None}).add_bias_linear


@pytest.mark.parametrize("dispatcher, factor, refused", [
    ("alltoall", 1.5, True),  # 3*1.5 = 4.5 > 4 experts: megatron-core's permute fails ("shape '[4, 5]' is invalid")
    ("alltoall", 4 / 3, False),  # 3*4/3 = 4: each expert padded to exactly the tokens, which its view takes
    ("allgather", 1.5, False),  # the all-gather dispatcher keeps each token once, padded or not
])
def test_megatron_refuses_its_all_to_all_dispatcher_padded_past_the_tokens_where_megatron_core_fails(
        dispatcher, factor, refused):
    moe = {"num_experts": 4, "moe_router_topk": 3, "moe_expert_capacity_factor": factor, "add_bias_linear": False,
           "moe_pad_expert_input_to_capacity": True, "moe_token_dispatcher_type": dispatcher, "moe_tokens": "capacity"}
    if refused:
        with pytest.raises(ConfigError, match=r"topk\*moe_expert_capacity_factor=3\*1.5=4.5 > num_experts=4"):
            build_config(SIZES | moe)
    else:
        assert build_config(SIZES | moe).moe
