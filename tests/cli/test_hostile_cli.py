"""Hostile input, command by command: a one-line error naming the field and rule (exit 2), a
bounded run, or the right answer; never a hang, a traceback, unbounded memory or a lost file.

Each test is one failure from issue 10's list. The few that need a real process
(a closed stdout, /dev/full, a pipe nobody reads, an encoding, a FIFO) are marked `procs`.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import yaml_file

from . import memcalc_cli, one_line_error

ROOT = Path(__file__).parents[2]
TINY = ["--s", "16", "--h", "64", "--a", "8"]
SIZES = "s: 2048\nh: 1024\na: 16\n"


def _bomb() -> str:
    """The issue's 500-byte alias bomb: nine levels of nine aliases (2.8 GB if an error echoed it written out)."""
    parts, last = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'], "a"
    for name in "bcdefghi":
        parts.append(f"&{name} [" + ",".join([f"*{last}"] * 9) + "]")
        last = name
    return f"{SIZES}name: [{', '.join(parts)}]\n"


def _short_one_line_error(run, *needles: str) -> None:
    one_line_error(run, *needles)
    assert len(run.err) < 400, run.err


# -- unbounded memory: echoed values, config reads --------------------------------------------


@pytest.mark.parametrize("command", [["estimate"], ["sweep", "--b", "1,2"]])
def test_a_yaml_alias_bomb_is_refused_at_its_first_alias(tmp_path, command):
    run = memcalc_cli(*command, "--config", yaml_file(tmp_path, _bomb()))
    _short_one_line_error(run, "YAML alias *a", "aliases are not accepted")


def test_an_echoed_value_is_cut_short(tmp_path):
    run = memcalc_cli("estimate", "--config", yaml_file(tmp_path, f"{SIZES}name: [{', '.join(['x' * 50] * 2000)}]\n"))
    _short_one_line_error(run, "field 'name': input should be a valid string (got ['xxx")


@pytest.mark.parametrize("flag", ["--config", "--hf-config"])
def test_a_device_is_refused_before_it_is_read(flag):
    _short_one_line_error(memcalc_cli("estimate", flag, "/dev/null"), "/dev/null", "not a regular file")


def test_a_config_larger_than_a_mebibyte_is_refused(tmp_path):
    run = memcalc_cli("estimate", "--config", yaml_file(tmp_path, SIZES + "#" * (1 << 20)))
    _short_one_line_error(run, "larger than 1048576 bytes")


@pytest.mark.procs
@pytest.mark.parametrize("flag", ["--config", "--hf-config"])
def test_a_fifo_is_refused_at_once_instead_of_blocking(tmp_path, flag):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    proc = _memcalc("estimate", flag, str(fifo), timeout=30)
    assert (proc.returncode, proc.stdout) == (2, "")
    reason = "not a regular file (a FIFO, socket or device)"
    assert proc.stderr == f"memcalc: error: cannot read {_what(flag)} {fifo}: {reason}\n"


def _what(flag: str) -> str:
    return "config file" if flag == "--config" else "Hugging Face config"


# -- exit 70 that should have been a rule ----------------------------------------------------------


def test_a_5000_digit_integer_in_yaml_names_its_field(tmp_path):
    run = memcalc_cli("estimate", "--config", yaml_file(tmp_path, f"{SIZES}b: {'9' * 5000}\n"))
    _short_one_line_error(run, "field 'b' at line 4: a 5000-digit integer is too large")


def test_a_5000_digit_integer_in_json_names_its_field(tmp_path):
    doc = json.loads((ROOT / "tests/data/hf/llama2-7b.json").read_text())
    text = json.dumps(doc).replace('"hidden_size": 4096', f'"hidden_size": {"9" * 5000}')
    run = memcalc_cli("estimate", "--hf-config", yaml_file(tmp_path, text, "config.json"))
    _short_one_line_error(run, "field 'hidden_size': a 5000-digit integer is too large")


def test_a_5000_digit_sweep_value_is_refused():
    _short_one_line_error(memcalc_cli("sweep", *TINY[2:], "--s", "9" * 5000), "'--s'", "5000-digit integer is too large")


@pytest.mark.parametrize("flag, name", [("--config", "deep.yaml"), ("--hf-config", "config.json")])
def test_nesting_100k_deep_is_refused(tmp_path, flag, name):
    run = memcalc_cli("estimate", flag, yaml_file(tmp_path, "[" * 100_000, name))
    _short_one_line_error(run, "nested")


@pytest.mark.parametrize("command", [
    ["fit", "--config", "tiny", "--budget"], ["estimate", *TINY, "--device-memory"],
])
def test_a_400_digit_byte_size_is_refused(command):
    _short_one_line_error(memcalc_cli(*command, "9" * 400), "has 400 digits; at most 40")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused(value):
    run = memcalc_cli("measure", "--config", "tiny", "--timeout", value)
    _short_one_line_error(run, "'--timeout'")


def test_a_torchrun_rank_that_is_not_a_number_is_named(monkeypatch):
    pytest.importorskip("torch")
    env = {"RANK": "zero", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = memcalc_cli("measure", "--config", "tiny", "--strategy", "tp")
    _short_one_line_error(run, "torchrun variable RANK='zero' is not a whole number >= 0")


@pytest.mark.parametrize("sizes", [
    ["--s", "1099511627776", "--h", "1048576", "--a", "8"],
    ["--s", "65536", "--h", "16384", "--a", "128", "--b", "8", "--t", "2", "--backend", "gloo", "--strategy", "tp"],
])
def test_measure_refuses_sizes_the_machine_cannot_hold_naming_the_bytes(sizes):
    run = memcalc_cli("measure", *sizes)
    _short_one_line_error(run, "would allocate at least", "bytes", "available memory")


@pytest.mark.parametrize("where", ["yaml", "hf"])
def test_rich_markup_in_a_model_name_is_printed_as_text(tmp_path, where):
    if where == "yaml":
        args = ["--config", yaml_file(tmp_path, f'{SIZES}name: "[/x] [bold]"\n')]
    else:
        doc = json.loads((ROOT / "tests/data/hf/llama2-7b.json").read_text()) | {"_name_or_path": "[/x] [bold]"}
        args = ["--hf-config", yaml_file(tmp_path, json.dumps(doc), "config.json")]
    run = memcalc_cli("estimate", *args)
    assert run.code == 0, run.err
    assert run.out.startswith("[/x] [bold]: b=1")


def test_terminal_escapes_in_a_model_name_never_reach_the_output(tmp_path):
    config = yaml_file(tmp_path, f'{SIZES}name: "a\\e]0;pwned\\ab\\e[2J"\n')
    for command in (["estimate"], ["sweep", "--format", "table"], ["fit", "--budget", "80GiB"]):
        run = memcalc_cli(*command, "--config", config)
        assert run.code == 0, run.err
        assert "\x1b" not in run.out + run.err and "\x07" not in run.out + run.err
        assert r"a\x1b]0;pwned\x07b\x1b[2J" in run.out


def test_a_mathtext_model_name_is_drawn_as_written(tmp_path):
    pytest.importorskip("matplotlib")
    config = yaml_file(tmp_path, f'{SIZES}name: "$\\\\frac{{$"\n')
    for kind, out in (("line", tmp_path / "s.png"), ("breakdown", tmp_path / "b.svg")):
        run = memcalc_cli("plot", "--config", config, "--kind", kind, "--out", str(out))
        assert (run.code, run.err) == (0, ""), run.err
        assert out.stat().st_size > 0


# Each way memcalc writes stdout: rich (tables), click.echo (JSON, formulas), sweep's bytes, click's help and version.
OUTPUTS = {
    "estimate": ["estimate", "--config", "tiny"],
    "estimate --json": ["estimate", "--config", "tiny", "--json"],
    "comm": ["comm", "--config", "tiny"],
    "formula": ["formula"],
    "explain": ["explain"],
    "fit": ["fit", "--config", "tiny", "--budget", "80GiB"],
    "configs": ["configs"],
    "sweep csv": ["sweep", "--config", "tiny", "--s", "16,32"],
    "sweep table": ["sweep", "--config", "tiny", "--s", "16,32", "--format", "table"],
    "--version": ["--version"],
    "estimate --help": ["estimate", "--help"],
}
WRITING_NOWHERE = ["estimate", "estimate --json", "comm", "formula", "sweep csv"]


@pytest.mark.procs
@pytest.mark.parametrize("output", WRITING_NOWHERE)
def test_stdout_on_a_full_disk_is_exit_1_with_one_line(output):
    with open("/dev/full", "w") as full:
        proc = _memcalc(*OUTPUTS[output], stdout=full)
    assert (proc.returncode, proc.stderr) == (1, "memcalc: error: cannot write output: No space left on device\n")


@pytest.mark.procs
@pytest.mark.parametrize("output", WRITING_NOWHERE)
def test_a_closed_stdout_is_exit_1_with_one_line(output):
    proc = _memcalc(*OUTPUTS[output], stdout=None, preexec_fn=lambda: os.close(1))
    assert (proc.returncode, proc.stderr) == (1, "memcalc: error: cannot write output: stdout is closed\n")


@pytest.mark.procs
@pytest.mark.parametrize("output", OUTPUTS)
def test_a_reader_that_closed_the_pipe_ends_the_run_quietly_with_exit_0(output):
    """`memcalc ... | head`: head has stopped reading, which is no error of the user's (rich and click say 1)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = _memcalc(*OUTPUTS[output], stdout=write)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (0, "")


@pytest.mark.procs
def test_an_ascii_terminal_shows_a_non_ascii_name_escaped(tmp_path):
    config = yaml_file(tmp_path, f'{SIZES}name: "café"\n')
    proc = _memcalc("estimate", "--config", config, env={"PYTHONIOENCODING": "ascii"})
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith("caf\\xe9: b=1")


def test_a_bare_memcalc_prints_its_usage_as_click_does():
    run = memcalc_cli()
    assert (run.code, run.out) == (2, "")
    assert run.err.startswith("Usage: memcalc [OPTIONS] COMMAND [ARGS]...\n") and "\nCommands:\n" in run.err


# -- bad input accepted ------------------------------------------------------------------------


def test_duplicate_yaml_keys_are_refused(tmp_path):
    run = memcalc_cli("estimate", "--config", yaml_file(tmp_path, f"{SIZES}s: 4096\n"))
    _short_one_line_error(run, "duplicate key 's' at line 4")


@pytest.mark.parametrize("extra, needles", [
    ("pp: 0", ["field 'pp'", "greater than 0"]),
    ("L: 3\npp: 2\nvpp: 2", ["L=3 is not divisible by pp*vpp=2*2=4"]),
    ("L: 3\npp: 2", ["L=3 is not divisible by pp=2"]),
    ("vpp: 2", ["vpp=2 needs pp >= 2"]),
    ("vocab_size: -5", ["field 'vocab_size'", "greater than 0"]),
    ('tie_embeddings: "yes"', ["field 'tie_embeddings'", "valid boolean"]),
    ("position_embedding_type: bogus", ["field 'position_embedding_type'", "'bogus'"]),
    ("max_position_embeddings: 1024", ["s=2048 exceeds max_position_embeddings=1024"]),
])
def test_sweep_applies_the_layout_rules_estimate_applies(tmp_path, extra, needles):
    config = yaml_file(tmp_path, f"{SIZES}{extra}\n")
    _short_one_line_error(memcalc_cli("estimate", "--config", config), *needles)
    _short_one_line_error(memcalc_cli("sweep", "--config", config, "--b", "1,2"), *needles)


def test_sweep_checks_the_pipeline_rule_against_every_swept_l(tmp_path):
    config = yaml_file(tmp_path, f"{SIZES}pp: 2\n")
    assert memcalc_cli("sweep", "--config", config, "--L", "2:8:2").code == 0
    _short_one_line_error(memcalc_cli("sweep", "--config", config, "--L", "2:8"), "L=3 is not divisible by pp=2")


def test_sweep_checks_the_position_table_against_the_largest_s(tmp_path):
    config = yaml_file(tmp_path, "h: 64\na: 8\nmax_position_embeddings: 4096\n")
    assert memcalc_cli("sweep", "--config", config, "--s", "1024:4096:x2").code == 0
    _short_one_line_error(memcalc_cli("sweep", "--config", config, "--s", "1024:8192:x2"),
                          "s=8192 exceeds max_position_embeddings=4096")


# -- hangs -----------------------------------------------------------------------------------------


def test_fit_for_t_tries_the_divisors_of_a_not_every_value_below_it():
    started = time.monotonic()
    run = memcalc_cli("fit", "--s", "2048", "--h", "1099511627776", "--a", "1099511627776", "--budget", "80GiB",
                      "--solve", "t")
    assert time.monotonic() - started < 20
    assert (run.code, run.out, run.err.count("\n")) == (3, "", 1) and len(run.err) < 400, run.err  # 3: nothing fits
    assert "nothing fits in 80.00 GiB per GPU" in run.err and "t=1099511627776" in run.err


# -- files lost --------------------------------------------------------------------------------


def test_a_sweep_that_fails_mid_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from memcalc.cli import sweep_output

    out = tmp_path / "runs.csv"
    out.write_text("the old rows\n")
    real = sweep_output.csv_chunks

    def interrupted(result, *args):
        chunks = real(result, *args)
        yield next(chunks)
        raise SystemExit(143)  # what main makes of a SIGTERM, here between two chunks

    monkeypatch.setattr(sweep_output, "csv_chunks", interrupted)
    assert memcalc_cli("sweep", "--config", "tiny", "--b", "1:8", "--out", str(out)).code == 143
    assert out.read_text() == "the old rows\n"
    assert sorted(os.listdir(tmp_path)) == ["runs.csv"]


def test_a_sweep_writes_its_file_whole_through_a_rename(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (seen.append((Path(src).parent, Path(dst))),
                                                          real_replace(src, dst)))
    out = tmp_path / "runs.csv"
    assert memcalc_cli("sweep", "--config", "tiny", "--b", "1:8", "--out", str(out)).code == 0
    assert seen == [(tmp_path, out)]
    assert len(out.read_text().splitlines()) == 1 + 8 * 3


@pytest.mark.procs
def test_sigterm_during_a_sweep_leaves_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "runs.csv"
    out.write_text("the old rows\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "memcalc", "sweep", "--config", "gpt3-175b", "--b", "1:100",
         "--s", "64:640000:64", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".part") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err
    if proc.returncode == 0:  # finished before the signal came: then the file is whole
        assert len(out.read_text().splitlines()) == 1 + 100 * 10000 * 3
    else:
        assert proc.returncode == 143 and out.read_text() == "the old rows\n"
    assert sorted(os.listdir(tmp_path)) == ["runs.csv"]


def _memcalc(*args: str, timeout: float = 60, env: dict | None = None, **popen) -> subprocess.CompletedProcess:
    """`python -m memcalc ARGS` in a fresh process, from the repository root."""
    environment = {k: v for k, v in os.environ.items() if k != "MEMCALC_DEBUG"} | (env or {})
    popen.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "memcalc", *args], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, env=environment, **popen)
