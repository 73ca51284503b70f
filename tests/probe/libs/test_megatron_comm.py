"""megatron-core's own layer issues, call by call and in order, the collectives the communication ledger lists:
its MoELayer's (the all-to-all dispatcher's token counts, exchanges over ep, gathers and reduce-scatters over t,
the router's aux-loss counts, the shared experts) and a dense layer's.

Routing is forced balanced, so every rank sends and receives kbs/ep slots' worth (the ledger's balanced bound).
Expert parallelism runs as rank 0 of t*ep ranks in torch's fake group, where each call is logged with the sizes it
is given: the log is exact though nothing moves.
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from memcalc.config.schema import build_config  # noqa: E402
from memcalc.model.comm import layer_collectives  # noqa: E402
from memcalc.model.evaluate import dim_sizes  # noqa: E402
from memcalc.model.knobs import DTYPE_BYTES  # noqa: E402
from memcalc.model.strategy import STRATEGIES  # noqa: E402
from memcalc.probe.collectives import compare_collectives  # noqa: E402
from memcalc.probe.launch import run  # noqa: E402
from memcalc.probe.libs import megatron as runner  # noqa: E402
from tests.cli import memcalc_cli, one_line_error  # noqa: E402

SIZES = {"b": 2, "s": 32, "h": 64, "a": 16, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
         "add_bias_linear": False, "dropout": 0.0}
SHARED = {"moe_shared_expert_intermediate_size": 48}


def _logged(tp, config, strategy):
    calls = []
    runner.run_layer(tp, config, STRATEGIES[strategy], route="balanced" if config.moe else None, collectives=calls)
    return tuple(calls)


def _rows(strategy, t, knobs, base=SIZES, mode=None):
    """Each rank's collectives against the ledger's (rank 0 alone on the fake group)."""
    config = build_config(base | knobs | {"t": t})
    mode = mode or ("single" if t == 1 and config.ep == 1 else "fake")
    per_rank = run(_logged, (config, strategy), mode=mode, t=t, backend="gloo", timeout_s=240)
    width, ep = DTYPE_BYTES[config.dtype], config.ep
    predicted = layer_collectives(config, STRATEGIES[strategy], ep=ep)
    rows = [compare_collectives(predicted, dim_sizes(config), t, width, calls, ep) for calls in per_rank]
    return rows[0] if len(rows) == 1 else [row for ranks in rows for row in ranks]


@pytest.mark.parametrize("shared", [{}, SHARED], ids=["routed experts", "shared experts too"])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_megatrons_moe_layer_under_tp_sp_issues_the_ledgers_collectives_in_order(ep, shared):
    rows = _rows("tp-sp", 2, shared | {"ep": ep})
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]
    assert any(r.name == "moe/dispatch" for r in rows) == (ep > 1)


@pytest.mark.parametrize("knobs", [{"moe_aux_loss": True}, {"dtype": "fp32", "recompute": "full", "mlp": "swiglu"},
                                   {"moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True}],
                         ids=["the aux loss's all-reduce of token counts", "fp32, full recomputation reruns them",
                              "padded to capacity: no gather of the token counts"])
def test_megatrons_moe_layer_issues_the_router_and_recomputation_collectives_the_ledger_lists(knobs):
    rows = _rows("tp-sp", 2, knobs | {"ep": 2})
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]


@pytest.mark.procs
def test_on_real_gloo_ranks_each_rank_issues_the_ledgers_moe_collectives_with_the_data_moving():
    rows = _rows("tp-sp", 2, SHARED | {"moe_aux_loss": True}, mode="spawn")
    assert len(rows) == 2 * 18 and all(row.matches for row in rows), [r for r in rows if not r.matches]


def test_expert_parallelism_without_tensor_parallelism_issues_only_the_dispatchers_all_to_alls_and_counts():
    rows = _rows("none", 1, {"ep": 2, "moe_aux_loss": True})
    assert [r.name for r in rows] == ["moe/counts", *["moe/dispatch"] * 2, *["moe/combine"] * 2, *["moe/dispatch"] * 2]
    assert all(row.matches for row in rows), [r for r in rows if not r.matches]


def test_megatrons_dense_layer_issues_the_seeds_g_and_g_star_and_the_regathers():
    rows = _rows("tp-sp", 2, {}, base={"b": 2, "s": 32, "h": 64, "a": 16, "dropout": 0.0})
    assert len(rows) == 10 and all(row.matches for row in rows), [r for r in rows if not r.matches]


def test_measure_comm_shows_megatrons_moe_collectives_next_to_the_ledgers(tmp_path):
    config = tmp_path / "moe.yaml"
    config.write_text("".join(f"{k}: {str(v).lower()}\n" for k, v in (SIZES | SHARED | {"t": 2, "ep": 2}).items()))
    run = memcalc_cli("measure", "--config", str(config), "--strategy", "tp-sp", "--launch", "fake", "--route",
                      "balanced", "--layer", "library", "--comm")
    assert run.code == 0, run.err
    dispatch = [line for line in run.out.splitlines() if "moe/dispatch" in line]
    assert len(dispatch) == 4 and "match: every tensor agrees to the byte" in run.out


def test_measure_compares_only_the_saved_tensors_of_a_moe_layer_whose_all_to_alls_are_uneven():
    """A router's k*b*s/t = 9 slots over ep = 2: the forced balanced route sends 4 away and returns 5, which the
    ledger does not model (model.comm.check_even_parts); the saved tensors are still the ledger's."""
    from memcalc.probe.measure import measure

    config = build_config(SIZES | {"t": 2, "ep": 2, "b": 1, "s": 6, "moe_router_topk": 3})
    (m,) = measure(config, ["tp-sp"], "cpu", None, "fake", 240, route="balanced")
    assert m.comm == () and m.matches, m.differences()


def test_measure_compares_the_collectives_of_each_routers_capacity_under_tp_sp():
    """Padded to capacity each of the t routers keeps ceil(k*(b*s/t)/E * c) slots an expert (the ledger's r at
    `routers` = t), not the capacity of all b*s tokens: 6 an expert, not 11 (found by a drawn measure: the gather
    of 42 slots a rank read as 38.5)."""
    from memcalc.probe.measure import measure

    config = build_config(SIZES | {"t": 2, "b": 3, "s": 8, "h": 8, "a": 4, "num_experts": 7, "moe_ffn_hidden_size": 4,
                                   "moe_expert_capacity_factor": 1.5, "moe_pad_expert_input_to_capacity": True})
    (m,) = measure(config, ["tp-sp"], "cpu", None, "fake", 240, route="balanced")
    assert m.comm and m.matches, m.differences()


def test_measure_comm_refuses_a_moe_layer_whose_routing_the_ledger_does_not_fix_in_one_line(tmp_path):
    config = tmp_path / "moe.yaml"
    config.write_text("".join(f"{k}: {str(v).lower()}\n" for k, v in (SIZES | {"ep": 2}).items()))
    run = memcalc_cli("measure", "--config", str(config), "--strategy", "none", "--launch", "fake", "--layer",
                      "library", "--comm")
    one_line_error(run, "--comm", "--route balanced", "the real router")


MLA = {"b": 2, "s": 8, "h": 32, "a": 4, "mlp": "swiglu", "attention": "eager", "add_bias_linear": False,
       "dropout": 0.0, "norm": "rmsnorm", "kv_lora_rank": 12, "q_lora_rank": 8, "qk_rope_head_dim": 4,
       "qk_nope_head_dim": 6, "v_head_dim": 5}


@pytest.mark.parametrize("strategy, t, knobs", [
    ("tp", 2, {}),
    ("tp-sp", 2, {}),
    ("tp", 2, {"q_lora_rank": None, "recompute": "full"}),
    ("tp-sp", 2, {"q_lora_rank": None}),
    ("tp-sp", 4, {"b": 1, "s": 12, "a": 8, "recompute": "selective", "dtype": "fp32"}),
    ("tp-sp", 2, {"recompute": "full", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
                  "moe_shared_expert_intermediate_size": 16}),
], ids=["tp", "tp-sp", "tp, no query latent, full recomputation", "tp-sp, no query latent",
        "tp-sp at t=4, b=1, fp32, selective", "tp-sp with experts, full recomputation"])
def test_megatrons_latent_attention_issues_each_projections_collectives_in_order(strategy, t, knobs):
    rows = _rows(strategy, t, knobs, base=MLA)
    assert rows and all(row.matches for row in rows), [r for r in rows if not r.matches]
    assert any(r.name.endswith("down_proj/gather") for r in rows)
