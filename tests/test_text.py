"""Echoed values are short and printable, whatever a hostile config puts in them; whole numbers are read by one rule."""

import time

import pytest

from memcalc.errors import ConfigError
from memcalc.text import ECHO_LIMIT, MAX_INT_DIGITS, for_rich, printable, short_repr, whole_number


def _alias_bomb(levels: int = 9) -> list:
    """What a 500-byte YAML alias bomb expands to: nine references, nine deep (9^9 strings if written out)."""
    value: list = ["lol"] * 9
    for _ in range(levels - 1):
        value = [value] * 9
    return value


def test_an_alias_bomb_is_echoed_in_a_few_dozen_characters_at_once():
    started = time.monotonic()
    text = short_repr(_alias_bomb())
    assert len(text) <= ECHO_LIMIT and text.startswith("[[")
    assert time.monotonic() - started < 0.1


def test_a_5000_digit_integer_is_echoed_by_its_length():
    assert short_repr(10**4999) == "<an integer of about 5000 digits>"
    assert short_repr([10**4999]) == "[<an integer of about 5000 digits>]"


def test_small_values_are_echoed_as_repr_writes_them():
    assert [short_repr(v) for v in (2**63, "relu", True, None, 0.5)] == ["9223372036854775808", "'relu'", "True",
                                                                       "None", "0.5"]


def test_a_long_string_is_cut_to_the_limit_with_an_ellipsis():
    text = short_repr("x" * 100_000)
    assert len(text) <= ECHO_LIMIT and "..." in text


def test_terminal_escapes_are_written_out_not_sent():
    assert printable("a\x1b]0;title\x07b\x1b[31mc") == r"a\x1b]0;title\x07b\x1b[31mc"
    assert printable("line\u2028break\nnext") == r"line\u2028break\nnext"
    assert printable("café") == "café"  # printable non-ASCII stays


def test_rich_markup_in_a_name_is_escaped():
    from rich.console import Console

    console = Console(width=80, record=True, file=open("/dev/null", "w"))
    console.print(for_rich("[/x] [bold]\x1b[2J"))
    assert console.export_text().strip() == r"[/x] [bold]\x1b[2J"


@pytest.mark.parametrize("text, number", [
    ("1024", 1024), ("+1024", 1024), ("-3", -3), ("0", 0), (" 1024\n", 1024), ("9" * MAX_INT_DIGITS, 10**40 - 1),
])
def test_a_whole_number_is_an_optional_sign_then_ascii_digits(text, number):
    assert whole_number(text) == number


@pytest.mark.parametrize("text", [
    "1_024", "１０２４", "١٠٢٤", "१०२४", "01024", "-01", "0x400", "0b1", "1e3", "1024.0", "34:08", "1 024", "++1", "+",
    "", "\u20031024",
])
def test_anything_else_int_would_read_or_that_yaml_1_1_reads_otherwise_is_refused(text):
    with pytest.raises(ConfigError, match="is not a whole number in the digits 0-9, without '_' or a leading zero"):
        whole_number(text)


def test_a_number_longer_than_40_digits_is_refused_by_its_length_before_int_reads_it():
    with pytest.raises(ConfigError, match="a 5000-digit integer is too large"):
        whole_number("9" * 5000)
