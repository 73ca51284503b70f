"""Hostile input, second round (issue 22): output files, numbers, terminals, and strict JSON.

Each test is one case of the issue's list: what stands at --out stays what it is, an unwritable --out is found
before any work, every number flag takes ASCII digits and finite values only, YAML 1.1's odd numbers are refused,
every --json parses with a strict parser, and a narrow terminal or a pipe never loses or cuts a number.
"""

import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import yaml_file

from . import memcalc_cli, one_line_error

ROOT = Path(__file__).parents[2]
QWEN2_7B = str(ROOT / "tests/data/hf/qwen2-7b.json")  # Qwen2-7B's config.json: 28 heads, 4 K/V groups
SIZES = "s: 2048\nh: 64\na: 8\n"


# -- --out: nothing damaged ----------------------------------------------------------------------------


def test_sweep_out_through_a_symlink_writes_its_target_and_keeps_its_mode(tmp_path):
    real = tmp_path / "real.csv"
    real.write_text("old\n")
    real.chmod(0o600)
    link = tmp_path / "runs.csv"
    link.symlink_to(real)
    assert memcalc_cli("sweep", "--config", "tiny", "--b", "1,2", "--out", str(link)).code == 0
    assert link.is_symlink() and real.read_text().startswith("b,") and stat.S_IMODE(real.stat().st_mode) == 0o600


def test_sweep_out_to_a_full_device_is_exit_1_and_the_device_stays_a_device():
    run = memcalc_cli("sweep", "--config", "gpt3-175b", "--format", "csv", "--out", "/dev/full")
    assert (run.code, run.err) == (1, "memcalc: error: cannot write /dev/full: No space left on device\n")
    assert stat.S_ISCHR(os.lstat("/dev/full").st_mode)


@pytest.mark.parametrize("command", [["sweep", "--b", "1,2"], ["plot", "--kind", "breakdown"]])
def test_an_out_where_no_file_can_be_made_is_refused_before_any_work(command):
    out = "/proc/x.svg" if command[0] == "plot" else "/proc/x.csv"
    one_line_error(memcalc_cli(*command, "--config", "tiny", "--out", out), "'--out'", f"cannot write {out}")


# -- bad input that ended in exit 70 ---------------------------------------------------------------------


def test_a_huge_capacity_factor_is_refused_at_the_parameter(tmp_path):
    flag = ["--num-experts", "8", "--moe-expert-capacity-factor", "1e308"]
    one_line_error(memcalc_cli("estimate", "--config", "tiny", *flag), "moe_expert_capacity_factor", "1000000")
    config = yaml_file(tmp_path, f"{SIZES}num_experts: 8\nmoe_expert_capacity_factor: 1.0e+308\n")
    one_line_error(memcalc_cli("estimate", "--config", config), "moe_expert_capacity_factor", "1000000")


@pytest.mark.parametrize("character", ["\x00", "\x07", "\x1b", "\ufffe"])
def test_a_control_character_in_yaml_is_one_line(tmp_path, character):
    config = yaml_file(tmp_path, f'{SIZES}name: "a{character}b"\n')
    one_line_error(memcalc_cli("estimate", "--config", config), "is not allowed in YAML")


def test_a_control_character_in_yaml_is_a_config_error_from_the_api(tmp_path):
    from memcalc import api
    from memcalc.errors import ConfigError

    with pytest.raises(ConfigError, match="U\\+0000 at position .* is not allowed in YAML"):
        api.load(yaml_file(tmp_path, f'{SIZES}name: "a\x00b"\n'))


def test_overlap_at_t_1_is_refused_instead_of_dividing_by_zero():
    one_line_error(memcalc_cli("comm", "--config", "tiny", "--t", "1", "--overlap", "default"), "t=1", "t >= 2")


def test_a_stage_of_65536_layers_is_not_walked_layer_by_layer():
    """The step timeline's cost grows as the square of the layers it walks: 4096 took tens of GB. Beyond 512 the
    peak is named as not modelled (estimate) or left out of the count (fit), at once."""
    run = memcalc_cli("estimate", "--config", "tiny", "--L", "65536", "--device-memory", "80GiB")
    assert run.code == 0 and "at most 512: L/pp = 65536/1 is 65536" in run.out, run.err
    run = memcalc_cli("fit", "--config", "tiny", "--L", "65536", "--budget", "1KiB")
    assert run.code == 3 and run.err.startswith("memcalc: error: nothing fits in 1.00 KiB"), run.err


@pytest.mark.parametrize("impl", ["megatron", "hf"])
def test_two_billion_experts_are_not_walked_expert_by_expert(impl):
    """The MoE walks take each local expert one by one: config.json's n_routed_experts = 2**31 once held 17 GB and
    ran for hours. Beyond 2**15 experts in a stage the peak is named as not modelled, at once."""
    run = memcalc_cli("estimate", "--hf-config", "tests/data/hf/mixtral-tiny.json", "--impl", impl, "--totals",
                      "--strategy", "none", "--num-experts", str(2**31), "--s", "64")
    assert run.code in (0, 3) and "at most 32768 in a stage: 2 layers (L/pp) of 2147483648 (num_experts/ep)" in run.out, (
        run.out + run.err)


# -- nonsense accepted -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "Infinity", "1_0"])
@pytest.mark.parametrize("flag", ["--peak-tflops", "--link-gbps"])
def test_comm_refuses_a_rate_that_is_not_a_finite_number(flag, value):
    run = memcalc_cli("comm", "--config", "tiny", "--t", "2", "--overlap", "default", flag, value)
    one_line_error(run, f"'{flag}'", "not a valid float")


@pytest.mark.parametrize("flag", ["--peak-tflops", "--link-gbps"])
@pytest.mark.parametrize("value", ["1e-300", "1e300"])
def test_comm_refuses_a_rate_that_would_make_a_time_infinite(flag, value):
    """A time is bytes or FLOPs over the rate: 1e-300 TFLOPS made it infinite, and its JSON not JSON."""
    run = memcalc_cli("comm", "--config", "gpt3-175b", "--overlap", "default", flag, value, "--json")
    one_line_error(run, f"'{flag}'")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_knob_floats_refuse_non_finite_values(value):
    one_line_error(memcalc_cli("estimate", "--config", "tiny", "--dropout", value), "'--dropout'", "not a valid float")


def test_overlap_with_another_strategy_is_refused_not_shown_as_tp_sp():
    run = memcalc_cli("comm", "--config", "tiny", "--t", "2", "--overlap", "default", "--strategy", "tp")
    one_line_error(run, "overlap needs sequence parallelism", "not tp")


@pytest.mark.parametrize("value", ["1_024", "１０２４", "١٠٢٤", "१०२४", "0x400", "1e3"])
@pytest.mark.parametrize("command, flag", [
    (["estimate", "--config", "tiny"], "--b"),
    (["estimate", "--config", "tiny"], "--vocab-size"),
    (["comm", "--config", "tiny"], "--num-splits"),
    (["fit", "--config", "tiny", "--budget", "80GiB"], "--t"),
    (["measure", "--config", "tiny"], "--num-splits"),
    (["sweep", "--config", "tiny"], "--etp"),
])
def test_integer_flags_take_ascii_digits_only_as_sweep_ranges_do(command, flag, value):
    one_line_error(memcalc_cli(*command, flag, value), f"'{flag}'", "is not a whole number in the digits 0-9")


def test_sweep_ranges_refuse_the_same_digits():
    one_line_error(memcalc_cli("sweep", "--config", "tiny", "--s", "1_000"), "'--s'", "is not a whole number in the digits 0-9")


# text -> the number every reader takes it for, or None where every reader refuses it
WHOLE_NUMBERS = {"+1024": 1024, " 1024 ": 1024, "1_024": None, "１０２４": None, "١٠٢٤": None, "01024": None,
                 "0x400": None, "1 024": None, "+": None}
REFUSED = "is not a whole number in the digits 0-9, without '_' or a leading zero"


@pytest.mark.parametrize("text", WHOLE_NUMBERS)
def test_every_reader_of_a_whole_number_takes_the_same_number_or_refuses_it(tmp_path, text):
    """One rule: estimate's flag, sweep's list, the API's sweep text and a YAML value read the same number, or all
    refuse it (YAML types '１０２４' or '1 024' as text, which the schema refuses as not an integer)."""
    import memcalc
    from memcalc.errors import ConfigError

    expected = WHOLE_NUMBERS[text]
    estimate = memcalc_cli("estimate", "--config", "tiny", "--s", text, "--json")
    sweep = memcalc_cli("sweep", "--config", "tiny", "--s", text, "--format", "json")
    from_yaml = memcalc_cli("estimate", "--config", yaml_file(tmp_path, f"h: 64\na: 8\ns: {text}\n"), "--json")
    if expected is None:
        for run in (estimate, sweep):
            one_line_error(run, "'--s'", REFUSED)
        one_line_error(from_yaml, "field 's'")
        with pytest.raises(ConfigError, match=REFUSED):
            memcalc.sweep("tiny", s=text)
        return
    assert json.loads(estimate.out)["config"]["s"] == expected
    assert set(json.loads(sweep.out)["columns"]["s"]) == {expected}
    assert json.loads(from_yaml.out)["config"]["s"] == expected
    assert memcalc.sweep("tiny", s=text).row(0)["s"] == expected


@pytest.mark.parametrize("text, shown", [
    ("s: 34:08", "'34:08'"), ("s: 04000", "'04000'"), ("s: 0x800", "'0x800'"), ("s: 0b100000000000", "'0b1"),
    ("s: 2_048", "'2_048'"), ("dropout: 1:30.5", "'1:30.5'"), ("dropout: .nan", "'.nan'"),
])
def test_yaml_1_1s_other_number_forms_are_refused(tmp_path, text, shown):
    config = yaml_file(tmp_path, f"h: 64\na: 8\n{text}\n" if text.startswith("s:") else f"{SIZES}{text}\n")
    field = text.split(":")[0]
    one_line_error(memcalc_cli("estimate", "--config", config), f"field '{field}'", shown, "at line")


# -- every --json is JSON --------------------------------------------------------------------------------


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


JSON_COMMANDS = {
    "estimate": ["estimate", "--config", "tiny", "--json"],
    "estimate --totals": ["estimate", "--config", "gpt3-175b", "--device-memory", "1024GiB", "--json"],
    "comm": ["comm", "--config", "gpt3-175b", "--json"],
    "comm --overlap": ["comm", "--config", "gpt3-175b", "--overlap", "default", "--json"],
    "fit": ["fit", "--config", "gpt3-175b", "--budget", "80GiB", "--json"],
    "formula": ["formula", "--format", "json"],
    "sweep": ["sweep", "--config", "tiny", "--b", "1,2", "--format", "json"],
}


@pytest.mark.parametrize("name", JSON_COMMANDS)
def test_every_json_output_parses_with_a_strict_parser(name):
    run = memcalc_cli(*JSON_COMMANDS[name])
    assert run.code == 0, run.err
    json.loads(run.out, parse_constant=_refuse)


def test_a_non_finite_number_never_reaches_json_output():
    from memcalc.cli import echo_json

    with pytest.raises(ValueError):
        echo_json({"ratio": math.nan})


# -- terminals: nothing lost, nothing cut ------------------------------------------------------------------


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"[0-9][0-9,.]*[0-9]", text))


@pytest.mark.procs
def test_piped_output_does_not_depend_on_columns():
    def run(columns: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "MEMCALC_DEBUG")}
        env |= {"COLUMNS": columns} if columns is not None else {}
        proc = subprocess.run([sys.executable, "-m", "memcalc", "estimate", "--config", "gpt3-175b", "--breakdown"],
                              cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
        assert (proc.returncode, proc.stderr) == (0, "")
        return proc.stdout

    wide = run(None)
    assert "2,868,903,936" in wide and "…" not in wide
    assert run("0") == wide and run("20") == wide


@pytest.mark.parametrize("width", [0, 20, 40])
def test_a_narrow_terminal_lists_every_number_whole(width):
    command = ["estimate", "--config", "gpt3-175b", "--breakdown", "--device-memory", "1024GiB"]
    wide, narrow = memcalc_cli(*command, width=250), memcalc_cli(*command, width=width)
    assert (wide.code, narrow.code) == (0, 0) and narrow.err == ""
    assert "…" not in narrow.out
    assert _numbers(wide.out) <= _numbers(narrow.out)
    assert "  tp-sp: per layer 358,612,992 B" in narrow.out


BREAKDOWN = ["estimate", "--config", "gpt3-175b", "--breakdown"]


def _on_a_terminal(args: list[str], width: int, columns: str | None) -> str:
    """What `memcalc ARGS` shows on a pseudo-terminal `width` characters wide, COLUMNS set to `columns` (or unset),
    with its styles taken out; it must exit 0."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "MEMCALC_DEBUG", "NO_COLOR")}
    env |= {"TERM": "xterm-256color"} | ({"COLUMNS": columns} if columns is not None else {})
    proc = subprocess.Popen([sys.executable, "-m", "memcalc", *args], cwd=ROOT, env=env, stdin=follower,
                            stdout=follower, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0, shown
    return re.sub(r"\x1b\[[0-9;]*m", "", shown.decode().replace("\r\n", "\n"))


@pytest.mark.procs
@pytest.mark.parametrize("width, columns", [(80, "20"), (20, None), (20, "0"), (80, "0")],
                         ids=["COLUMNS=20", "20 wide", "20 wide, COLUMNS=0", "COLUMNS=0"])
def test_a_narrow_terminal_shows_every_number_whole_and_columns_0_is_ignored(width, columns):
    """On a real terminal, COLUMNS narrows the layout (0 is no width: the terminal's own stands), and whatever the
    width, every number of the piped output is shown whole: in tables, or listed as 'key: value' lines."""
    piped = subprocess.run([sys.executable, "-m", "memcalc", *BREAKDOWN], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={k: v for k, v in os.environ.items() if k != "COLUMNS"}).stdout
    shown = _on_a_terminal(BREAKDOWN, width, columns)
    assert "…" not in shown and _numbers(piped) <= _numbers(shown)
    narrow = width == 20 or columns == "20"
    assert ("  tp-sp: per layer 358,612,992 B" in shown) == narrow
    assert ("┃ strategy ┃" in shown) == (not narrow)
    if columns == "0":
        assert shown == _on_a_terminal(BREAKDOWN, width, None)


def test_a_wide_enough_terminal_still_gets_tables():
    assert "┃ strategy ┃" in memcalc_cli("estimate", "--config", "gpt3-175b", width=120).out


# -- Ctrl-C ----------------------------------------------------------------------------------------------------

# A command whose Ctrl-C lands inside code run from a string, as dataclasses' generated methods are while a module
# loads: `python -m` then ended by SIGINT (-2) although memcalc had caught the interrupt and printed its line.
CTRL_C_IN_EXEC = """
import os, signal, sys, types
import click
from memcalc import cli

@click.command("ctrl-c")
def command():
    exec("os.kill(os.getpid(), signal.SIGINT)\\nfor _ in range(10**7): pass", {"os": os, "signal": signal})

sys.modules["memcalc.cli.ctrl_c"] = types.SimpleNamespace(command=command)
cli.COMMANDS["ctrl-c"] = ("ctrl_c", "A Ctrl-C inside exec'd text.")
cli.main(["ctrl-c"])
"""


@pytest.mark.procs
def test_a_ctrl_c_inside_code_run_from_a_string_still_exits_130_under_python_m(tmp_path):
    (tmp_path / "ctrl_c_in_exec.py").write_text(CTRL_C_IN_EXEC)
    env = {k: v for k, v in os.environ.items() if k != "MEMCALC_DEBUG"} | {"PYTHONPATH": f"{tmp_path}:{ROOT}"}
    proc = subprocess.run([sys.executable, "-m", "ctrl_c_in_exec"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr) == (130, "memcalc: error: interrupted\n")


@pytest.mark.procs
def test_a_memcalc_started_with_sigint_ignored_keeps_ignoring_it():
    """A shell starts a background job with SIGINT ignored, so that a Ctrl-C meant for the foreground spares it."""
    proc = subprocess.Popen([sys.executable, "-m", "memcalc", "estimate", "--config", "gpt3-175b"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    while proc.poll() is None:  # from its start (click loading) to its end
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.01)
    assert (proc.returncode, proc.stderr.read()) == (0, "")


# -- --breakdown: rows keyed by tensor ---------------------------------------------------------------------


def test_breakdown_rows_are_keyed_by_tensor_when_strategies_keep_different_tensors():
    """Qwen2-7B at t=4 under megatron: tp and tp-sp keep attention/softmax_fp32, none does not. Each cell must be
    that tensor's bytes as --json lists them for that strategy, and each column must sum to its total."""
    args = ["estimate", "--hf-config", QWEN2_7B, "--s", "2048", "--t", "4"]
    doc = json.loads(memcalc_cli(*args, "--json").out)
    by_strategy = {name: {x["name"]: x["bytes"] for x in st["tensors"]} for name, st in doc["strategies"].items()}
    assert len({frozenset(names) for names in by_strategy.values()}) > 1  # the case: the tensor lists differ
    run = memcalc_cli(*args, "--breakdown")
    assert run.code == 0, run.err
    table = run.out.split("Per-tensor bytes per GPU, one layer")[1]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.startswith("│")]
    names = list(by_strategy)
    sums = dict.fromkeys(names, 0)
    for tensor, *cells in rows:
        if tensor == "total":
            assert [int(c.replace(",", "")) for c in cells] == [doc["strategies"][n]["per_layer_bytes"] for n in names]
            assert [sums[n] for n in names] == [doc["strategies"][n]["per_layer_bytes"] for n in names]
            break
        for name, cell in zip(names, cells):
            expected = by_strategy[name].get(tensor.removesuffix(" (exact)"))
            assert cell == ("-" if expected is None else f"{expected:,}"), (tensor, name)
            sums[name] += expected or 0
    else:
        pytest.fail("no total row")
    assert sorted(r[0] for r in rows if r[0] != "total") == sorted(set().union(*by_strategy.values()))


# -- third round: what a demanding user found -------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("moe_expert_capacity_factor", "true"), ("moe_expert_capacity_factor", "'2'"),
                                          ("rotary_percent", "'0.5'")])
def test_a_factor_written_as_text_or_a_boolean_is_refused_as_dropout_is(tmp_path, field, value):
    """A quoted '2' or a YAML true was read as 2.0 or 1.0 and the estimate printed: a factor is a number."""
    config = yaml_file(tmp_path, f"{SIZES}num_experts: 8\nadd_bias_linear: false\n{field}: {value}\n")
    one_line_error(memcalc_cli("estimate", "--config", config), f"field '{field}': input should be a valid number")


@pytest.mark.parametrize("merge", ["<<: {s: 4096}\ns: 16\n", "<<: [{s: 4096}, {s: 16}]\n"])
def test_a_yaml_merge_key_is_refused_as_a_duplicate_key_is(tmp_path, merge):
    """A merge lets one field be written twice with one silently winning: s=16 or s=4096 was shown."""
    config = yaml_file(tmp_path, f"{merge}h: 64\na: 8\n")
    one_line_error(memcalc_cli("estimate", "--config", config), "merge key '<<' at line 1")


@pytest.mark.parametrize("args", [["--s", "-1"], ["--s", "4096"], ["--x", "t", "--t", "4"]])
def test_plot_refuses_a_flag_for_the_knob_its_line_varies(tmp_path, args):
    """--s beside --x s (the default) was dropped without a word, even --s -1: the plot drew 1024..131072."""
    x = args[1] if args[0] == "--x" else "s"
    run = memcalc_cli("plot", "--config", "tiny", *args, "--out", str(tmp_path / "p.svg"))
    one_line_error(run, f"is the line's x axis (--x {x}); give its values with --range")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("solve, size", [("t", ["--h", "2162160", "--a", "2162160"]), ("pp", ["--L", "2162160"])])
def test_fit_refuses_a_size_with_more_divisors_than_it_tries(solve, size):
    """2162160 has 320 divisors, each a whole step walk per strategy and recompute; a size below 2^63 can have
    161,280 (hours when nothing fits)."""
    run = memcalc_cli("fit", "--config", "tiny", "--budget", "1KiB", "--solve", solve, *size, "--strategy", "tp",
                      "--recompute", "full")
    one_line_error(run, "=2162160 has 320 divisors, each a", "fit tries at most 256", f"memcalc estimate --{solve} N")


@pytest.mark.parametrize("args, needle", [
    (["estimate", "--config", "x" * 300], "config file not found: xxx"),
    (["estimate", "--config", "/tmp/" + "x" * 300], "config file not found: /tmp/xxx"),
    (["estimate", "--hf-config", "x" * 300], "cannot read Hugging Face config xxx"),
    (["sweep", "--config", "tiny", "--out", "x" * 300 + ".csv"], "'--out': cannot write xxx"),
    (["plot", "--config", "tiny", "--out", "x" * 300 + ".svg"], "'--out': cannot write xxx"),
])
def test_a_file_name_longer_than_the_file_system_takes_is_bad_input(args, needle):
    """A name over 255 bytes made Path.exists() raise ENAMETOOLONG: 'cannot write output', exit 1, as if stdout
    had failed."""
    run = memcalc_cli(*args)
    one_line_error(run, needle)
    assert len(run.err) < 2100


@pytest.mark.parametrize("layer", [[], ["--layer", "library"], ["--layer", "memcalc"]])
def test_measure_on_meta_with_a_library_impl_names_the_impls_meta_runs(layer):
    """--impl hf --device meta said 'use --layer library'; with it, 'add --layer memcalc': advice in a loop."""
    run = memcalc_cli("measure", "--config", "tiny", "--impl", "hf", "--device", "meta", *layer)
    one_line_error(run, "--device meta runs memcalc's own layer only: add --layer memcalc,",
                   "with --impl megatron or paper")
