"""The communication ledger: which collectives f, f*, g, g* issue per layer, and the bytes one rank sends."""

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from memcalc.cli import cli
from memcalc.config.schema import build_config
from memcalc.errors import ConfigError
from memcalc.model.comm import Group, Op, formula, layer_collectives, layer_comm
from memcalc.model.strategy import NONE, TP, TP_SP

GPT = dict(b=2, s=64, h=128, a=8, t=4, L=6)


def _ops(config, strategy):
    return Counter((c.op, c.phase) for c in layer_collectives(config, strategy))


def test_no_parallelism_sends_nothing():
    assert layer_comm(build_config(GPT), NONE, 1).per_layer_bytes == 0


def test_tensor_parallelism_all_reduces_twice_forward_and_twice_backward():
    config = build_config(GPT)
    assert _ops(config, TP) == {(Op.ALL_REDUCE, "forward"): 2, (Op.ALL_REDUCE, "backward"): 2}
    bsh_bytes = 2 * 2 * 64 * 128
    assert layer_comm(config, TP, 1).per_layer_bytes == 4 * 2 * bsh_bytes * 3 // 4  # 2(t-1)/t each


def test_sequence_parallelism_trades_each_all_reduce_for_a_gather_and_a_scatter_plus_megatrons_regather():
    config = build_config(GPT)
    assert _ops(config, TP_SP) == {
        (Op.ALL_GATHER, "forward"): 2, (Op.REDUCE_SCATTER, "forward"): 2,
        (Op.ALL_GATHER, "backward"): 4, (Op.REDUCE_SCATTER, "backward"): 2,
    }
    tp, tp_sp = (layer_comm(config, st, 1).per_layer_bytes for st in (TP, TP_SP))
    regathers = [c for c in layer_collectives(config, TP_SP) if c.moves.endswith("again")]
    assert len(regathers) == 2 and tp_sp - tp == tp // 4  # the two re-gathers: one all-reduce's worth of bytes


def test_full_recomputation_repeats_the_forward_collectives_in_backward():
    plain, full = (layer_collectives(build_config(GPT | {"recompute": r}), TP_SP) for r in ("none", "full"))
    assert len(full) - len(plain) == 4
    assert [c.op for c in full if "recomputed" in c.moves] == [c.op for c in plain if c.phase == "forward"]


def test_a_step_is_every_layer_of_the_stage_times_the_microbatches_plus_the_pipeline_sends():
    config = build_config(GPT | {"pp": 2})
    one, step = layer_comm(config, TP_SP, 1), layer_comm(config, TP_SP, 4)
    boundary = 2 * 2 * 2 * 64 * 128 // 4  # activation and gradient, a sequence shard each
    assert step.per_step_bytes == 3 * 4 * one.per_layer_bytes + 4 * boundary


@pytest.mark.parametrize("layout", [["--num-microbatches", "4"], ["--global-batch-size", "8"]])
def test_comm_steps_the_micro_batches_the_layout_gives_as_estimate_reads_them(layout):
    args = ["comm", "--config", "tiny", "--t", "2", "--pp", "2", "--strategy", "tp", "--json"]
    doc = json.loads(CliRunner().invoke(cli, [*args, *layout]).output)
    assert doc["microbatches"] == 4
    tp = doc["strategies"]["tp"]
    assert tp["per_step_bytes"] == 4 * tp["layers"]["dense"] * tp["per_layer_bytes"] + tp["pipeline_bytes"]


def test_comm_json_has_per_layer_bytes_and_the_collectives_of_each_strategy():
    out = CliRunner().invoke(cli, ["comm", "--config", "tiny", "--t", "2", "--json"]).output
    doc = json.loads(out)["strategies"]
    assert set(doc) == {"none", "tp", "tp-sp"} and doc["none"]["per_layer_bytes"] == 0
    assert doc["tp-sp"]["per_layer_bytes"] == sum(c["bytes_sent"] for c in doc["tp-sp"]["collectives"])


@pytest.mark.parametrize("strategy, latex", [("tp", "16 \\frac{t-1}{t} s b h"), ("tp-sp", "20 \\frac{t-1}{t} s b h")])
def test_comm_prints_each_strategys_formula_in_latex(strategy, latex):
    out = CliRunner().invoke(cli, ["comm", "--config", "gpt3-175b", "--strategy", strategy,
                                   "--format", "latex"]).output
    assert out.splitlines()[1] == latex


MOE = GPT | {"num_experts": 8, "moe_router_topk": 2, "add_bias_linear": False}


def _names(config, strategy):
    return [(c.name, c.op.value, c.phase) for c in layer_collectives(config, strategy, ep=config.ep)]


def test_a_moe_layer_trades_the_dense_mlps_g_and_g_star_for_the_dispatchers_collectives():
    names = _names(build_config(MOE | {"ep": 2}), TP_SP)
    assert not [n for n in names if n[0].startswith("mlp/")]
    assert names[2:9] == [("moe/counts", "all-gather", "forward"), ("moe/dispatch", "all-to-all", "forward"),
                          ("moe/dispatch", "all-to-all", "forward"), ("moe/g", "all-gather", "forward"),
                          ("moe/g", "all-gather", "forward"), ("moe/g*", "reduce-scatter", "forward"),
                          ("moe/combine", "all-to-all", "forward")]


def test_the_all_to_all_sends_what_leaves_a_ranks_shard_of_routed_slots_under_the_bound_asked_for():
    """tp-sp: a rank routes its bs/t tokens to k experts each and sends (ep-1)/ep of those slots away (balanced);
    the worst bound takes ep*bs*min(k, E/ep) slots for r."""
    b, s, h, t, k, ep = MOE["b"], MOE["s"], MOE["h"], MOE["t"], MOE["moe_router_topk"], 4
    for bound, r in (("balanced", k * b * s), ("worst", ep * b * s * min(k, 8 // ep))):
        comm = layer_comm(build_config(MOE | {"ep": ep, "moe_tokens": bound}), TP_SP, 1)
        tokens = next(n for c, n in comm.collectives if c.name == "moe/dispatch")
        assert tokens == r // t * h * 2 * (ep - 1) // ep
        assert bound in next(c.moves for c, _ in comm.collectives if c.name == "moe/dispatch")


def test_the_token_counts_are_int64_gathered_from_every_rank_of_t_times_ep():
    comm = layer_comm(build_config(MOE | {"ep": 2}), TP_SP, 1)
    counts = [n for c, n in comm.collectives if c.name == "moe/counts"]
    assert counts == [8 * 8 * (4 * 2 - 1)]  # E int64 from each of t*ep ranks, all but this rank's own


def test_expert_parallelism_alone_sends_the_all_to_alls_and_one_expert_parallel_rank_sends_nothing():
    assert layer_comm(build_config(MOE | {"ep": 1}), NONE, 1).per_layer_bytes == 0
    names = _names(build_config(MOE | {"ep": 2, "moe_aux_loss": True}), NONE)
    assert {n for n, _, _ in names} == {"moe/counts", "moe/dispatch", "moe/combine"}


def test_a_step_counts_each_kind_of_layer_of_a_dense_and_moe_mix_as_often_as_the_model_has_it():
    config = build_config(MOE | {"ep": 2, "moe_layer_freq": 2})  # L=6: layers 0, 2, 4 MoE, the rest dense
    comm, dense = layer_comm(config, TP_SP, 3), layer_comm(build_config(GPT), TP_SP, 3)
    assert comm.layers == (3, 3) and comm.dense_layer_bytes == dense.per_layer_bytes
    assert comm.per_step_bytes == 3 * (3 * comm.per_layer_bytes + 3 * dense.per_layer_bytes)


def test_a_step_counts_the_layers_of_the_pipeline_rank_that_holds_the_most_moe_layers_as_its_schedule_splits_them():
    """Interleaved, rank 0 of pp=2 holds chunks 0 and 2 (layers 0-1 and 4-5 of L=8): both MoE layers of freq 4;
    torchtitan's pp=4 of L=8 (the embedding and the output a layer each) gives rank 1 layers 2-4, two MoE of freq 2."""
    megatron = build_config(MOE | {"ep": 2, "L": 8, "pp": 2, "vpp": 2, "moe_layer_freq": 4})
    torchtitan = build_config(MOE | {"impl": "torchtitan", "L": 8, "pp": 4, "moe_layer_freq": 2, "ep": 4,
                                     "attention": "flash", "dropout": 0.0, "add_bias_linear": False})
    dense = build_config(GPT | {"impl": "torchtitan", "L": 8, "pp": 4, "attention": "flash", "dropout": 0.0,
                                "mlp": "swiglu", "norm": "rmsnorm", "add_bias_linear": False})
    assert [layer_comm(c, TP_SP, 1).layers for c in (megatron, torchtitan, dense)] == [(2, 2), (2, 1), (3, 0)]


def test_the_moe_formula_adds_the_dispatchers_terms_to_attentions():
    text, _ = formula(build_config(MOE | {"ep": 2}), TP_SP, 2, ep=2)
    assert text == "10sbh(t-1)/t + 8E(t*ep-1) + 8rh(ep-1)/(ep*t) + 4r(ep-1)/(ep*t) + 8rh(t-1)/t + 4r(t-1)/t"


@pytest.mark.parametrize("knobs, strategy, message", [
    ({"impl": "megatron"}, TP,
     "^impl megatron .* does not run tp .*MoELayer refuses tensor parallelism without sequence"),
    ({"impl": "hf", "family": "mixtral", "ep": 2}, NONE,
     "^impl hf: ep=2: transformers' expert-parallel plan \\(ep_dispatch_experts\\) is not"),
    ({"ep": 2, "b": 1, "s": 6, "moe_router_topk": 3, "t": 2}, TP_SP,
     "^the communication ledger does not model a router's k\\*b\\*s/2=9 slots that ep=2 does not divide"),
    ({"ep": 2, "b": 1, "s": 12, "cp": 2, "moe_router_topk": 3, "t": 2, "attention": "flash"}, TP_SP,
     "^the communication ledger does not model a router's k\\*b\\*s/\\(cp=2\\)/2=9 slots"),
], ids=["tp without sp", "transformers' expert-parallel plan", "uneven all-to-alls", "uneven, each cp rank's tokens"])
def test_moe_collectives_megatron_does_not_run_or_memcalc_has_not_measured_are_refused_in_one_line(knobs, strategy,
                                                                                                     message):
    """Uneven all-to-alls: the forced balanced route deals a router's 9 slots round ep=2 ranks, so rank 0 sends 4
    and returns 5 where the even share is 4.5 (found by a drawn measure at b=3, s=12, t=4, ep=4: 2,560 bytes sent,
    2,592 in the ledger)."""
    with pytest.raises(ConfigError, match=message):
        layer_comm(build_config(MOE | knobs), strategy, 1)


def test_comm_json_of_a_dense_and_moe_mix_counts_both_kinds_and_names_each_collectives_group():
    from jsonschema import Draft202012Validator

    from memcalc.schemas import SCHEMAS

    args = ["comm", "--config", "mixtral-8x7b", "--t", "2", "--L", "4", "--num-experts", "4", "--moe-router-topk", "2",
            "--ep", "2", "--moe-layer-freq", "2", "--strategy", "tp-sp", "--json"]
    doc = json.loads(CliRunner().invoke(cli, args).output)
    assert list(Draft202012Validator(SCHEMAS["comm"]).iter_errors(doc)) == []
    tp_sp = doc["strategies"]["tp-sp"]
    assert tp_sp["layers"] == {"moe": 2, "dense": 2}
    assert tp_sp["per_step_bytes"] == 2 * tp_sp["per_layer_bytes"] + 2 * tp_sp["dense_layer_bytes"]
    assert {c["over"] for c in tp_sp["collectives"]} == {"t", "ep", "t*ep"}


def test_torchtitans_experts_over_the_data_parallel_shards_exchange_each_ranks_own_tokens_and_nothing_else():
    """At t = 1 torchtitan's ep ranks are dp_shard's (its efsdp mesh): each rank's own tokens go round them, the
    counts, the slots out and back, each reversed in backward; no TP pair runs, nor the shared experts' g and g*."""
    from tests.helpers import TORCHTITAN_LLAMA3

    config = build_config(TORCHTITAN_LLAMA3 | {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                                               "moe_shared_expert_intermediate_size": 32, "t": 1, "dp_shard": 4,
                                               "ep": 2, "recompute": "none"})
    calls = layer_collectives(config, NONE, ep=config.ep)
    assert [(c.name, c.phase) for c in calls] == [
        ("moe/counts", "forward"), ("moe/dispatch", "forward"), ("moe/combine", "forward"),
        ("moe/combine", "backward"), ("moe/dispatch", "backward")]
    assert {c.group for c in calls} == {Group.EP}
