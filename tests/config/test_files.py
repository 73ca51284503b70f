"""Config files are read within bounds: regular files only, at most 1 MiB, no YAML aliases, no
duplicate keys, no deep nesting, no integer too long to read; each refusal is a ConfigError naming the rule."""

import os
import threading

import pytest

from memcalc.config.files import MAX_CONFIG_BYTES, MAX_DEPTH, parse_json, parse_yaml, read_capped
from memcalc.errors import ConfigError

BOMB = (
    '&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    + "".join(f", &{n} [{','.join([f'*{q}'] * 9)}]" for q, n in zip("abcdefgh", "bcdefghi"))
)


def test_a_yaml_alias_bomb_is_refused_at_its_first_alias():
    with pytest.raises(ConfigError, match=r"YAML alias \*a at line 4: aliases are not accepted"):
        parse_yaml(f"s: 2048\nh: 1024\na: 16\nname: [{BOMB}]\n")


def test_anchors_without_aliases_are_plain_yaml():
    assert parse_yaml("s: &x 16\nh: 64\n") == {"s": 16, "h": 64}


def test_duplicate_yaml_keys_are_refused_with_the_line_of_the_second():
    with pytest.raises(ConfigError, match=r"duplicate key 's' at line 3 \(each field may appear once\)"):
        parse_yaml("s: 16\nh: 64\ns: 32\n")


def test_duplicate_json_keys_are_refused():
    with pytest.raises(ConfigError, match="duplicate key 'hidden_size'"):
        parse_json('{"hidden_size": 1, "hidden_size": 2}')



@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_json_nan_or_infinity_is_refused_not_read_as_a_float(constant):
    # Python's json reads them as floats; a config.json holding one is not JSON, so it is refused by name
    with pytest.raises(ConfigError, match=f"{constant} is not a JSON number"):
        parse_json(f'{{"hidden_size": {constant}}}')

@pytest.mark.parametrize("parse, text", [(parse_yaml, "[" * 100_000), (parse_json, "[" * 100_000)],
                         ids=["yaml", "json"])
def test_nesting_100k_deep_is_refused_not_a_recursion_error(parse, text):
    with pytest.raises(ConfigError, match="nested"):
        parse(text)


def test_nesting_up_to_the_limit_is_read():
    assert parse_yaml("x: " + "[" * (MAX_DEPTH - 2) + "1" + "]" * (MAX_DEPTH - 2)) is not None


def test_a_5000_digit_yaml_integer_is_refused_naming_its_field():
    with pytest.raises(ConfigError, match=r"field 'b' at line 2: a 5000-digit integer is too large"):
        parse_yaml(f"s: 16\nb: {'9' * 5000}\n")


def test_a_5000_digit_json_integer_is_refused_naming_its_field():
    with pytest.raises(ConfigError, match=r"field 'hidden_size': a 5000-digit integer is too large"):
        parse_json(f'{{"model_type": "llama", "hidden_size": {"9" * 5000}}}')


def test_a_20_digit_integer_is_read_for_validation_to_judge():
    assert parse_yaml(f"b: {2**64}\n") == {"b": 2**64}


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_is_refused_before_it_is_opened(device):
    with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO, socket or device\)"):
        read_capped(device, "config file")


def test_a_fifo_is_refused_instead_of_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "model.yaml"
    os.mkfifo(fifo)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_error(read_capped, fifo)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():  # let the blocked open() go, so the test run can end
        with open(fifo, "w"):
            pass
    assert outcome and "not a regular file" in outcome[0]


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="it is a directory"):
        read_capped(tmp_path, "config file")


def test_a_file_over_the_cap_is_refused_after_reading_only_the_cap(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        read_capped(big, "config file")


def test_a_file_at_the_cap_is_read(tmp_path):
    exact = tmp_path / "exact.yaml"
    exact.write_bytes(b"#" * MAX_CONFIG_BYTES)
    assert len(read_capped(exact, "config file")) == MAX_CONFIG_BYTES


def _error(read, path) -> str:
    try:
        read(path, "config file")
    except ConfigError as exc:
        return str(exc)
    return ""
