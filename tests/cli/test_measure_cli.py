"""`memcalc measure`: exit 0 and a per-tensor table when real layers agree with the
ledger, exit 1 naming the tensors when they do not or a rank fails, exit 2 for input
that cannot run (before any rank starts), one line without torch."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memcalc.model.impls import IMPLEMENTATIONS

from . import memcalc_cli

torch = pytest.importorskip("torch")
MEGATRON_NAMES = IMPLEMENTATIONS["megatron"].by_name()  # what memcalc's own layer keeps

from memcalc.model.evaluate import estimate  # noqa: E402
from memcalc.model.knobs import Accounting  # noqa: E402
from memcalc.probe import measure as measure_module  # noqa: E402
from memcalc.probe.launch import Mode  # noqa: E402

ROOT = Path(__file__).parents[2]
TINY = ["--config", "tiny", "--layer", "memcalc"]  # memcalc's own layer: needs torch alone


def _fails_on_rank_1(tp, cases):
    if tp.rank == 1:
        raise RuntimeError("out of luck\non two lines")
    return measure_module.measure_on_rank(tp, cases)


def _sleeps(tp, cases):
    time.sleep(60)


def _one_line_error(run, code, *needles):
    assert run.code == code, run.err
    assert run.err.startswith("memcalc: error: ") and run.err.count("\n") == 1, run.err
    for needle in needles:
        assert needle in run.err, (needle, run.err)


def test_a_matching_run_prints_every_tensor_says_how_it_ran_and_exits_0():
    run = memcalc_cli("measure", *TINY, "--t", "8", "--strategy", "tp-sp")
    assert (run.code, run.err) == (0, "")
    assert "rank 0 of t=8 through torch's fake process group" in run.out
    assert "match: every tensor agrees to the byte" in run.out
    # s=16: outside Megatron's fused softmax window, so the layer keeps torch's softmax (16-bit, Megatron-LM's
    # default) and masked_fill_'s causal mask
    for name in ("ln1/input", "attention/causal_mask", "attention/softmax_out", "mlp/fc2_in", "total"):
        assert f"│ {name} " in run.out, name


def test_transformers_deepseek_v3_layer_measures_latent_attention_to_the_byte():
    pytest.importorskip("transformers")
    latent = ["--kv-lora-rank", "24", "--q-lora-rank", "16", "--qk-rope-head-dim", "8", "--qk-nope-head-dim", "12",
              "--v-head-dim", "10"]
    run = memcalc_cli("measure", "--impl", "hf", "--family", "deepseek_v3", "--b", "2", "--s", "32", "--h", "64", "--a",
                      "4", "--attention", "eager", "--strategy", "none", *latent)  # tp: not measured for latent attention (a note)
    assert (run.code, run.err) == (0, "")
    assert "match: every tensor agrees to the byte" in run.out
    for name in ("mla/q_norm_input_fp32", "mla/kv_up_in", "mla/rope_cos", "mla/q", "mla/v", "mla/proj_in"):
        assert f"│ {name} " in run.out, name


@pytest.mark.procs
@pytest.mark.parametrize("impl", ["memcalc", "megatron"])
def test_at_t_1_every_layout_measures_as_none_does_with_no_collective_to_issue(impl):
    """A group of one rank sends nothing: neither layer issues a call, and megatron runs SP's layout without SP
    (which it refuses at t = 1), so tp and tp-sp keep what none keeps."""
    layer = ("--layer", "memcalc") if impl == "memcalc" else ("--impl", "megatron")
    run = memcalc_cli("measure", *layer, "--b", "1", "--s", "16", "--h", "64", "--a", "4", "--t", "1")
    assert run.code == 0, run.err
    assert run.out.count("match: every tensor agrees to the byte") == 3 and "differs" not in run.out



    run = memcalc_cli("measure", *TINY, "--t", "2", "--backend", "gloo", "--json")
    assert (run.code, run.err) == (0, "")
    doc = json.loads(run.out)
    assert doc["match"] is True and list(doc["strategies"]) == ["none", "tp", "tp-sp"]
    assert [doc["strategies"][n]["launch"] for n in ("none", "tp", "tp-sp")] == ["single", "spawn", "spawn"]
    tp_sp = doc["strategies"]["tp-sp"]
    assert (tp_sp["group"], tp_sp["t"], tp_sp["ranks_compared"]) == ("gloo", 2, 2)
    assert tp_sp["predicted_bytes"] == tp_sp["measured_bytes"] == sum(x["measured"] for x in tp_sp["tensors"])
    for tensor in tp_sp["tensors"]:
        assert {"name", "predicted", "measured"} <= set(tensor) and tensor["name"] in MEGATRON_NAMES
    # The top level sums the strategies that ran and lists every tensor with its strategy.
    assert doc["predicted_bytes"] == doc["measured_bytes"] == sum(x["measured"] for x in doc["tensors"])
    assert doc["predicted_bytes"] == sum(doc["strategies"][n]["predicted_bytes"] for n in doc["strategies"])
    assert {x["strategy"] for x in doc["tensors"]} == {"none", "tp", "tp-sp"}


@pytest.mark.procs
def test_under_torchrun_rank_0_alone_reports_for_the_job():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "memcalc", "measure", *TINY, "--t", "2", "--strategy", "tp-sp", "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # one document: the other rank printed nothing
    tp_sp = doc["strategies"]["tp-sp"]
    assert (doc["match"], tp_sp["launch"], tp_sp["group"], tp_sp["t"]) == (True, "torchrun", "gloo", 2)


def test_a_prediction_for_the_wrong_device_is_caught_tensor_by_tensor_with_exit_1(monkeypatch):
    """Predicting CUDA's fp32 norm statistics for a CPU run: those rows, and only those, differ."""
    monkeypatch.setattr(
        measure_module, "estimate", lambda config, strategy, accounting: estimate(config, strategy, Accounting(True, "cuda"))
    )
    run = memcalc_cli("measure", *TINY, "--strategy", "none")
    _one_line_error(run, 1, "measured bytes differ from the ledger", "none: ln1/mean (-64 B)", "ln2/rstd (-64 B)")
    assert "attention/q" not in run.err
    assert "│ ln1/mean " in run.out and "differs" in run.out  # the table still comes first


@pytest.mark.procs
def test_a_failing_rank_exits_1_with_its_error_in_one_line(monkeypatch):
    monkeypatch.setattr(measure_module, "measure_on_rank", _fails_on_rank_1)
    run = memcalc_cli("measure", *TINY, "--t", "2", "--backend", "gloo", "--strategy", "tp")
    _one_line_error(run, 1, "rank 1 of t=2 (gloo) failed: RuntimeError: out of luck on two lines")


@pytest.mark.procs
def test_ranks_that_do_not_finish_are_stopped_at_the_timeout(monkeypatch):
    monkeypatch.setattr(measure_module, "measure_on_rank", _sleeps)
    started = time.monotonic()
    run = memcalc_cli("measure", *TINY, "--t", "2", "--backend", "gloo", "--strategy", "tp", "--timeout", "3")
    _one_line_error(run, 1, "did not finish within 3 s")
    assert time.monotonic() - started < 30


@pytest.mark.procs
def test_a_timeout_too_short_for_the_ranks_to_start_is_the_timeout_error(monkeypatch):
    monkeypatch.delenv("MEMCALC_DEBUG", raising=False)
    run = memcalc_cli("measure", *TINY, "--t", "2", "--backend", "gloo", "--strategy", "tp", "--timeout", "0.001")
    _one_line_error(run, 1, "did not finish within 0.001 s")


def test_sizes_the_strategy_cannot_split_exit_2_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr(measure_module, "run", lambda *a, **k: pytest.fail("a rank was started"))
    run = memcalc_cli("measure", *TINY, "--s", "15", "--t", "2", "--backend", "gloo", "--strategy", "tp-sp")
    _one_line_error(run, 2, "s=15 is not divisible by t=2")
    assert run.out == ""


def test_all_leaves_out_a_layout_the_sizes_rule_out_and_measures_the_others():
    run = memcalc_cli("measure", *TINY, "--s", "15", "--t", "2", "--launch", "fake")
    assert run.code == 0, run.err
    assert "memcalc: note: tp-sp left out: s=15 is not divisible by t=2" in run.err
    assert "tp-sp" not in run.out and "tp" in run.out


def test_the_launch_choices_are_auto_and_the_probes_modes():
    from memcalc.cli.measure import LAUNCHES

    assert LAUNCHES == ("auto", *(m.value for m in Mode))


@pytest.mark.procs
def test_without_torch_measure_says_how_to_install_it_in_one_line():
    code = "import sys; sys.modules['torch'] = None; from memcalc.cli import main; main(sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, "measure", *TINY], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MEMCALC_DEBUG"},
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("memcalc: error: the probe needs PyTorch") and proc.stderr.count("\n") == 1
    assert "pip install" in proc.stderr


def test_num_splits_that_do_not_divide_h_are_bad_input_before_any_rank_runs():
    # the pipelined reduce-scatter's blocks failed inside the layer's run: exit 1 (a failed measurement), no config
    run = memcalc_cli("measure", *TINY, "--overlap", "pipelined-rs", "--num-splits", "3")
    _one_line_error(run, 2, "h=64 is not divisible by num_splits=3")
