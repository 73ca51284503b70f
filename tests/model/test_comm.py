"""The communication ledger: which collectives f, f*, g, g* issue per layer, and the bytes one rank sends."""

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from memcalc.cli import cli
from memcalc.config.schema import build_config
from memcalc.model.comm import Op, layer_collectives, layer_comm
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
