"""Sizes such as 80GiB are read exactly, and anything too long or too large is one ConfigError."""

import pytest

from memcalc.errors import ConfigError
from memcalc.units import MAX_BYTES, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("1.5 KiB", 1536), ("123456789", 123456789),
    ("0.1KB", 100), (f"{MAX_BYTES}", MAX_BYTES), ("2.0B", 2), ("0", 0),
])
def test_sizes_are_read_exactly(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, message", [
    ("9" * 400, "has 400 digits; at most 40"),
    ("9" * 400 + "GiB", "has 400 digits; at most 40"),
    ("1." + "5" * 5000, "has 5002 digits; at most 40"),
    ("10000PiB", "is too large (at most 9223372036854775807 bytes"),
    (f"{MAX_BYTES + 1}", "is too large"),
    ("80 GiBs", "cannot read '80 GiBs' as a size"),
])
def test_a_size_that_cannot_be_a_byte_count_is_refused(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_bytes(text)


@pytest.mark.parametrize("text, expected", [("1.3GiB", 1395864371), ("1.0001KB", 1000)])
def test_a_fraction_of_a_byte_in_a_larger_unit_is_dropped(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["0.5B", "0.5", "1.5b", "0.0001KB"])
def test_half_a_byte_is_refused_not_read_as_zero(text):
    """A budget of '0.5B' (bytes, not billions) once came out as 0 B and fit answered that nothing fits."""
    with pytest.raises(ConfigError, match="is not a whole number of bytes"):
        parse_bytes(text)


def test_the_echoed_text_of_a_huge_size_is_short():
    with pytest.raises(ConfigError) as caught:
        parse_bytes("9" * 400)
    assert len(str(caught.value)) < 150
