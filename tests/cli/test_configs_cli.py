"""`memcalc configs` lists the shipped configs; `--config NAME` finds one, or lists them when it cannot."""

from memcalc.config.shipped import shipped_dir, shipped_names

from . import memcalc_cli, one_line_error


def test_an_unknown_name_lists_the_shipped_ones():
    run = memcalc_cli("estimate", "--config", "gpt3-175")
    one_line_error(run, "config file not found: gpt3-175 (nor a shipped config: deepseek-v3, gpt3-175b, gpt3-1t,")


def test_memcalc_configs_lists_each_name_with_its_description():
    run = memcalc_cli("configs")
    assert run.code == 0 and run.err == ""
    lines = run.out.splitlines()
    assert [line.split()[0] for line in lines] == shipped_names()
    assert [line.split(maxsplit=1)[1] for line in lines if line.startswith("gpt3-175b ")] == [
        "GPT-3 175B (Korthikanti et al. 2022, Table 3)"]  # names padded to the longest one


def test_memcalc_configs_path_is_the_folder_to_copy_from():
    assert memcalc_cli("configs", "--path").out == f"{shipped_dir()}\n"
