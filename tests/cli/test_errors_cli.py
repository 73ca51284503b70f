"""Bad input: one line on stderr naming the field and the rule, exit code 2, no
traceback, nothing on stdout. Plus the other exit codes the CLI promises."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import memcalc_cli, one_line_error

ROOT = Path(__file__).parents[2]
TINY = ["--s", "16", "--h", "64", "--a", "8"]

BAD_FLAGS = {
    "zero size": (["estimate", "--s", "0", "--h", "64", "--a", "8"], ["'s'", "greater than 0"]),
    "negative size": (["estimate", *TINY, "--b", "-1"], ["'b'", "greater than 0"]),
    "zero layers": (["estimate", *TINY, "--L", "0"], ["'L'", "greater than 0"]),
    "zero ffn": (["estimate", *TINY, "--ffn-hidden-size", "0"], ["'ffn_hidden_size'", "greater than 0"]),
    "h not divisible by a": (["estimate", "--s", "16", "--h", "60", "--a", "8"], ["h=60", "a=8"]),
    "a not divisible by t": (["estimate", *TINY, "--t", "3"], ["a=8", "t=3"]),
    "ffn not divisible by t": (["estimate", *TINY, "--t", "2", "--ffn-hidden-size", "33"],
                               ["ffn_hidden_size=33", "t=2"]),
    "s not divisible by t under tp-sp": (["estimate", "--s", "15", "--h", "64", "--a", "8", "--t", "2", "--strategy",
                                          "tp-sp"],
                                         ["s=15", "t=2", "sequence parallelism"]),
    "heads not divisible by groups": (["estimate", *TINY, "--num-query-groups", "3"],
                                      ["a=8", "num_query_groups=3"]),
    "groups not divisible by t": (["estimate", *TINY, "--num-query-groups", "2", "--t", "4"],
                                  ["num_query_groups=2", "t=4"]),
    "missing size": (["estimate", "--h", "64", "--a", "8"], ["'s'", "required"]),
    "non-integer size": (["estimate", *TINY, "--b", "x"], ["'--b'", "is not a whole number in the digits 0-9"]),
    "fractional size": (["estimate", *TINY, "--s", "1.5"], ["'--s'", "is not a whole number in the digits 0-9"]),
    "non-number dropout": (["estimate", *TINY, "--dropout", "lots"], ["'--dropout'", "not a valid float"]),
    "bad mlp choice": (["estimate", *TINY, "--mlp", "relu"], ["'--mlp'", "'relu' is not one of"]),
    "bad strategy choice": (["estimate", *TINY, "--strategy", "sp"], ["'--strategy'", "'sp' is not one of"]),
    "bad format choice": (["formula", "--format", "docx"], ["'--format'", "'docx' is not one of"]),
    "dropout of one": (["estimate", *TINY, "--dropout", "1"], ["'dropout'", "less than 1"]),
    "negative dropout": (["estimate", *TINY, "--dropout", "-0.1"], ["'dropout'", "greater than or equal to 0"]),
    "dropout for formula": (["formula", "--dropout", "1.5"], ["'dropout'", "less than 1"]),
    "bad choice for explain": (["explain", "--norm", "batchnorm"], ["'--norm'", "'batchnorm' is not one of"]),
    "size beyond int64": (["estimate", *TINY, "--b", str(2**63)], ["'b'", "less than 9223372036854775808"]),
    "unknown option": (["estimate", "--heads", "8"], ["--heads"]),
    "unknown command": (["estimat"], ["estimat"]),
}

BAD_FILES = {
    "unknown key": ("s: 16\nh: 64\na: 8\nheads: 8\n", ["unknown field 'heads'"]),
    "syntax error": ("s: 16\nh: [64\na: 8\n", ["YAML syntax error", "line 3"]),
    "not a mapping": ("- 16\n- 64\n", ["expected a mapping"]),
    "string size": ("s: '16'\nh: 64\na: 8\n", ["'s'", "valid integer"]),
    "zero size in file": ("s: 16\nh: 64\na: 8\nL: 0\n", ["'L'", "greater than 0"]),
    "rule broken in file": ("s: 16\nh: 64\na: 8\nt: 3\n", ["a=8", "t=3"]),
}


def _assert_one_line_error(code: int, out: str, err: str, needles: list[str]) -> None:
    assert code == 2, err
    assert out == ""
    assert err.startswith("memcalc: error: ") and err.endswith("\n")
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("args, needles", BAD_FLAGS.values(), ids=BAD_FLAGS)
def test_bad_flags_are_one_line_naming_field_and_rule(args, needles):
    run = memcalc_cli(*args)
    _assert_one_line_error(run.code, run.out, run.err, needles)


@pytest.mark.parametrize("command", ["estimate", "formula", "explain"])
@pytest.mark.parametrize("text, needles", BAD_FILES.values(), ids=BAD_FILES)
def test_bad_config_files_are_one_line_naming_the_file_field_and_rule(tmp_path, command, text, needles):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    run = memcalc_cli(command, "--config", str(path))
    _assert_one_line_error(run.code, run.out, run.err, [str(path), *needles])


@pytest.mark.parametrize("command", ["estimate", "formula", "explain"])
def test_a_config_file_that_is_not_text_is_one_line(tmp_path, command):
    path = tmp_path / "model.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    run = memcalc_cli(command, "--config", str(path))
    _assert_one_line_error(run.code, run.out, run.err, [str(path), "not UTF-8 text (byte 0"])


@pytest.mark.parametrize("command", ["estimate", "formula", "explain"])
def test_a_missing_config_file_is_named(command):
    run = memcalc_cli(command, "--config", "models/no-such-model.yaml")
    _assert_one_line_error(run.code, run.out, run.err, ["config file not found", "no-such-model.yaml"])


def test_usage_errors_point_at_the_commands_help():
    assert "(see 'memcalc estimate --help')" in memcalc_cli("estimate", "--mlp", "relu").err


def test_tp_alone_does_not_need_t_to_divide_s():
    assert memcalc_cli("estimate", "--s", "15", "--h", "64", "--a", "8", "--t", "2", "--strategy", "tp").code == 0


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["estimate", "--help"], ["estimate", *TINY]])
def test_help_version_and_a_valid_estimate_exit_zero(args):
    assert memcalc_cli(*args).code == 0


def test_a_bug_is_one_line_with_exit_code_70(monkeypatch):
    from memcalc.model.knobs import Knobs

    def broken(cls, config):
        raise RuntimeError("boom")

    monkeypatch.delenv("MEMCALC_DEBUG", raising=False)
    monkeypatch.setattr(Knobs, "of", classmethod(broken))
    run = memcalc_cli("explain")
    assert (run.code, run.out) == (70, "")
    assert run.err == "memcalc: error: internal error: RuntimeError: boom (set MEMCALC_DEBUG=1 for the traceback)\n"


def test_memcalc_debug_lets_the_exception_through(monkeypatch):
    from memcalc.errors import ConfigError

    monkeypatch.setenv("MEMCALC_DEBUG", "1")
    with pytest.raises(ConfigError, match="h=60 is not divisible by a=8"):
        memcalc_cli("estimate", "--s", "16", "--h", "60", "--a", "8")



@pytest.mark.parametrize("off", ["0", "false", "Off", ""])
def test_memcalc_debug_set_to_an_off_value_keeps_the_one_line(monkeypatch, off):
    # MEMCALC_DEBUG=0 read as set: a traceback where the user asked for none
    monkeypatch.setenv("MEMCALC_DEBUG", off)
    run = memcalc_cli("estimate", "--s", "16", "--h", "60", "--a", "8")
    assert run.code == 2 and run.err.count("\n") == 1 and "h=60 is not divisible by a=8" in run.err

# A real process is the honest check of "one line on stderr, no traceback": a few only (~0.5 s each).
@pytest.mark.procs
@pytest.mark.parametrize(
    "args, needles",
    [
        (["estimate", "--config", "tiny", "--t", "3"], ["a=8", "t=3"]),
        (["formula", "--mlp", "relu"], ["'--mlp'"]),
        (["explain", "--config", "no-such.yaml"], ["no-such.yaml"]),
    ],
)
def test_a_real_process_prints_one_line_and_exits_2(args, needles):
    proc = subprocess.run(
        [sys.executable, "-m", "memcalc", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MEMCALC_DEBUG"},
    )
    _assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, needles)


def test_notes_wait_for_the_command_to_succeed_so_bad_input_is_one_line():
    # the notes (what --hf-config read, a layout left out) went to stderr before the error: three lines
    mixtral = str(Path(__file__).parents[1] / "data/hf/mixtral-tiny.json")
    refused = memcalc_cli("estimate", "--hf-config", mixtral, "--s", "63", "--t", "2")
    one_line_error(refused, "s=63 is not divisible by t=2")
    ok = memcalc_cli("estimate", "--hf-config", mixtral, "--s", "64", "--t", "2")
    assert ok.code == 0
    assert [line.split(":")[1] for line in ok.err.splitlines()] == [" read mixtral config.json", " note"]
