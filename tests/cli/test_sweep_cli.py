"""`memcalc sweep` through click's test runner: the files it writes, what goes to a
pipe, the table, and one line with exit 2 for every kind of bad input."""

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from memcalc.cli import main

ROOT = Path(__file__).parents[2]
GPT3 = "gpt3-175b"  # a shipped config, found by name


class _Script:
    """What the `memcalc` console script runs, shaped for CliRunner.invoke: `main`
    renders errors as the user sees them (one line on stderr, an exit code)."""

    name = "memcalc"

    @staticmethod
    def main(args, prog_name, **_):
        main(list(args))


def invoke(*args: str) -> Result:
    """Run `memcalc ARGS` in click's runner (stdout is not a terminal there)."""
    return CliRunner().invoke(_Script, list(args), prog_name="memcalc")


def _one_line_error(result: Result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("memcalc: error: ") and result.stderr.count("\n") == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr


def test_csv_file_has_a_row_per_size_combination_and_strategy(tmp_path):
    out = tmp_path / "runs.csv"
    result = invoke("sweep", "--config", GPT3, "--b", "1:4", "--s", "1024:4096:1024", "--out", str(out))
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 4 * 4 * 3
    assert [(r["b"], r["s"], r["strategy"]) for r in rows[:4]] == [
        ("1", "1024", "none"), ("1", "1024", "tp"), ("1", "1024", "tp-sp"), ("1", "2048", "none"),
    ]
    # b=1, s=2048, tp-sp at GPT-3 175B: sbh(34/t + 5as/(ht)) = 358,612,992 bytes a layer (seed, section 3).
    assert (rows[5]["per_layer_bytes"], rows[5]["total_bytes"]) == ("358612992", str(96 * 358612992))


def test_json_file_by_suffix(tmp_path):
    out = tmp_path / "runs.json"
    result = invoke("sweep", "--config", GPT3, "--t", "1,2,4,8", "--strategy", "tp", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["model"] == "gpt3-175b"
    assert doc["columns"]["t"] == [1, 2, 4, 8] and doc["columns"]["strategy"] == ["tp"] * 4


def test_csv_goes_to_stdout_when_it_is_not_a_terminal():
    result = invoke("sweep", "--s", "16,32", "--h", "64", "--a", "8", "--strategy", "none")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("b,s,h,a,t,L,strategy,per_layer_bytes,total_bytes,")
    assert [line.split(",")[:2] for line in lines[1:]] == [["1", "16"], ["1", "32"]]


def test_a_hugging_face_config_gives_the_sizes_and_knobs_estimate_reads():
    from memcalc.config.schema import build_config
    from memcalc.model.evaluate import estimate
    from memcalc.config.hf import read_hf_config
    from memcalc.model.strategy import TP_SP

    path = ROOT / "tests/data/hf/llama2-7b.json"
    result = invoke("sweep", "--hf-config", str(path), "--s", "1024,2048", "--strategy", "tp-sp", "--t", "2")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("memcalc: read llama config.json:")
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    fields = read_hf_config(path).fields
    for row in rows:
        expected = estimate(build_config(fields | {"s": int(row["s"]), "t": 2}), TP_SP).per_layer_bytes
        assert (row["mlp"], int(row["per_layer_bytes"])) == ("swiglu", expected)


def test_repeated_strategies_pick_those_strategies_once_each():
    result = invoke("sweep", "--config", GPT3, "--strategy", "tp-sp", "--strategy", "none", "--strategy", "none")
    assert [line.split(",")[6] for line in result.stdout.splitlines()[1:]] == ["none", "tp-sp"]


def test_table_shows_swept_sizes_and_hides_the_middle_of_long_sweeps():
    result = invoke("sweep", "--config", GPT3, "--b", "1:100", "--format", "table")
    assert result.exit_code == 0, result.output
    assert "gpt3-175b: s=2048 h=12288 a=96 t=8 L=96" in result.stdout
    assert "342.00 MiB" in result.stdout  # b=1, tp-sp
    assert "the first and last 20 of 300 rows" in result.stdout


def test_skipped_configurations_are_one_note_on_stderr(tmp_path):
    out = tmp_path / "t.csv"
    result = invoke("sweep", "--config", GPT3, "--t", "1:8", "--out", str(out))
    assert result.exit_code == 0
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("memcalc: note: skipped 8 of 24 configurations")
    assert len(out.read_text().splitlines()) == 1 + 16


LONG = ["sweep", "--config", GPT3, "--b", "1:100", "--s", "64:640000:640"]  # 300,000 configurations


def test_no_progress_bar_when_stderr_is_not_a_terminal(tmp_path):
    result = invoke(*LONG, "--out", str(tmp_path / "x.csv"))
    assert (result.exit_code, result.stderr) == (0, "")


def test_a_long_sweep_draws_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(SystemExit) as exit:
        main([*LONG, "--out", str(tmp_path / "x.csv")])
    assert exit.value.code == 0
    assert "sweep: 300,000 configurations" in sys.stderr.getvalue()


@pytest.mark.parametrize("args, needles", [
    (["--s", "4096:1024"], ["'--s'", "is empty: start 4096 is above stop 1024"]),
    (["--b", "1:8:0"], ["'--b'", "step must be positive"]),
    (["--t", "1:8:x1"], ["'--t'", "factor must be at least 2"]),
    (["--h", "1.5"], ["'--h'", "is not a whole number in the digits 0-9"]),
    (["--L", "1:2:3:4"], ["'--L'", "has 3 colons"]),
    (["--strategy", "sp"], ["'--strategy'"]),
    (["--t", "5,7"], ["no configuration in the sweep passes", "a=96 is not divisible by t=5"]),
    (["--s", "1:2", "--b", "1:10000000"], ["at most 10,000,000"]),
    (["--s", f"1:{10**30}"], [f"s={10**30} is too large for a sweep"]),  # too long a range even to count
    (["--b", "64", "--s", str(2**21), "--t", "1"], ["beyond 64-bit integers"]),
    (["--dropout", "1.5"], ["gpt3-175b: field 'dropout'"]),
    (["--out", "runs.txt"], ["cannot tell the format of 'runs.txt'", ".csv or .json"]),
    (["--out", "runs.csv", "--format", "table"], ["--format table prints to the terminal"]),
])
def test_bad_input_is_one_line_and_exit_2(args, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(invoke("sweep", "--config", GPT3, *args), *needles)
    assert list(tmp_path.iterdir()) == []  # and nothing written


@pytest.mark.parametrize("target, needle", [
    ("missing/runs.csv", "directory 'missing' does not exist"),
    (".", "is a directory"),
])
def test_an_unwritable_out_path_is_refused_before_the_sweep(target, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _one_line_error(invoke("sweep", "--config", GPT3, "--out", target), "'--out'", needle)


@pytest.mark.procs
def test_the_sweep_and_plot_modules_import_no_numpy_rich_or_matplotlib():
    code = ("import sys, memcalc.cli.sweep, memcalc.cli.plot;"
            "print(sorted(m for m in ('numpy', 'rich', 'matplotlib') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_ep_sets_the_experts_split_and_each_row_is_what_estimate_says_at_that_ep():
    model = ("--config", "mixtral-8x7b", "--moe-tokens", "worst", "--strategy", "tp-sp")
    rows = list(csv.DictReader(io.StringIO(invoke("sweep", *model, "--ep", "4", "--t", "1,2").stdout)))
    assert [row["ep"] for row in rows] == ["4", "4"]
    for row in rows:
        estimate = json.loads(invoke("estimate", *model, "--ep", "4", "--t", row["t"], "--json").stdout)
        assert int(row["total_bytes"]) == estimate["strategies"]["tp-sp"]["total_bytes"]
    one = next(csv.DictReader(io.StringIO(invoke("sweep", *model, "--t", "1").stdout)))
    assert int(one["total_bytes"]) < int(rows[0]["total_bytes"])  # worst case: every ep rank may route here


@pytest.mark.parametrize("ep, needle", [
    ("4", "impl torchtitan lays its experts out differently at ep=4 than at ep=1"),
    ("1,2,4", "ep=2 is measured as ep = t over the TP ranks"),
])
def test_an_ep_that_changes_torchtitans_expert_layout_is_refused_not_priced_as_ep_1(ep, needle):
    # torchtitan's MoE routes each TP rank's own s/t tokens at ep = t > 1; the sweep laid it out at ep = 1 and printed
    # 728,064 B where estimate says 726,336 B (--exact's top-k outputs whole), and priced ep=2 at t=4, which estimate
    # refuses
    model = ("--config", "mixtral-8x7b", "--impl", "torchtitan", "--dropout", "0", "--b", "3", "--s", "16",
             "--t", "4", "--strategy", "tp", "--exact")
    _one_line_error(invoke("sweep", *model, "--ep", ep), needle)
    assert invoke("sweep", *model, "--ep", "1").exit_code == 0


def test_bad_input_under_hf_config_is_one_line_and_the_fields_note_waits_for_the_rows():
    # the "read gpt2 config.json: ..." note went to stderr before the sweep found no configuration to evaluate
    gpt2 = str(ROOT / "tests/data/hf/gpt2.json")
    _one_line_error(invoke("sweep", "--hf-config", gpt2, "--s", "64", "--a", "7"), "h=768 is not divisible by a=7")
    ok = invoke("sweep", "--hf-config", gpt2, "--s", "64", "--t", "1,5")
    assert ok.exit_code == 0 and ok.stdout.startswith("b,s,")
    assert [line.split(":")[1] for line in ok.stderr.splitlines()] == [" read gpt2 config.json", " note"]


def test_deepseeks_config_json_sweeps_as_estimate_reads_it():
    # its num_key_value_heads = num_attention_heads = 128: estimate took it (multi-head, as latent attention is) and
    # sweep refused it ("num_query_groups=128 with kv_lora_rank"), the knobs alone not knowing a
    deepseek = str(ROOT / "tests/data/hf/deepseek-v3.json")
    model = ("--hf-config", deepseek, "--s", "128", "--strategy", "none")
    (row,) = csv.DictReader(io.StringIO(invoke("sweep", *model, "--format", "csv").stdout))
    estimate = json.loads(invoke("estimate", *model, "--json").stdout)["strategies"]["none"]
    assert int(row["per_layer_bytes"]) == estimate["per_layer_bytes"]
    assert int(row["total_bytes"]) == estimate["total_bytes"]


@pytest.mark.parametrize("model", [
    ("--impl", "paper", "--a", "5", "--h", "320", "--num-query-groups", "5"),  # a group per head: multi-head
    ("--impl", "paper", "--a", "5", "--h", "320", "--kv-channels", "64"),  # heads of h/a channels
    ("--impl", "torchtitan", "--dropout", "0", "--mlp", "swiglu", "--norm", "rmsnorm", "--attention", "flash",
     "--a", "2", "--h", "256", "--kv-channels", "128"),
    ("--a", "2", "--h", "256", "--num-query-groups", "2", "--kv-lora-rank", "8", "--qk-rope-head-dim", "4",
     "--qk-nope-head-dim", "4", "--v-head-dim", "4"),
])
def test_a_knob_at_the_value_estimate_reads_as_unset_sweeps_as_estimate_reads_it(model):
    # sweep built its knobs without a and h, so the knob read as set: impl paper refused it as outside the seed's
    # layer, torchtitan as Qwen3's head_dim, latent attention as K/V groups, where estimate gave a number
    args = (*model, "--s", "64", "--strategy", "none")
    (row,) = csv.DictReader(io.StringIO(invoke("sweep", *args, "--format", "csv").stdout))
    estimate = json.loads(invoke("estimate", *args, "--json").stdout)["strategies"]["none"]
    assert int(row["per_layer_bytes"]) == estimate["per_layer_bytes"]


def test_a_swept_a_leaves_a_group_count_set():
    # at a = 10 five groups are grouped-query attention, which the paper's layer is not
    _one_line_error(invoke("sweep", "--impl", "paper", "--a", "5,10", "--h", "320", "--num-query-groups", "5",
                           "--s", "64"), "num_query_groups=5 is outside it")
