"""The flat reader returns exactly what PyYAML's bounded safe loader returns, or leaves the text to it."""

from pathlib import Path

import pytest
import yaml

from memcalc.config.files import _bounded_loader
from memcalc.config.flat_yaml import read_flat

SHIPPED = sorted((Path(__file__).parents[2] / "memcalc" / "configs").glob("*.yaml"))

# One line each, in a file that is otherwise plainly flat: every YAML 1.1 form a value or key may take.
LINES = [
    'b: 1', 'b: +1', 'b: -0', 'b: 0', 'b: 007', 'b: 0x10', 'b: 0o10', 'b: 0b10', 'b: 1_000', 'b: 34:08',
    'b: 123456789012345678901234567890', 'b: 1.5', 'b: 1.', 'b: .5', 'b: 1e3', 'b: 1.0e3', 'b: 1.0e+3', 'b: 1.0E-3',
    'b: .inf', 'b: -.inf', 'b: .nan', 'b: 1:30.5', 'b: true', 'b: True', 'b: TRUE', 'b: yes', 'b: No', 'b: on',
    'b: OFF', 'b: y', 'b: n', 'b: null', 'b: Null', 'b: ~', 'b:', 'b: ', 'b: 2001-12-14',
    'b: 2001-12-14t21:59:43.10-05:00', 'b: =', 'b: <<', 'b: abc', 'b: abc # note', 'b: abc#x', 'b: a b c',
    "b: 'a # b'", 'b: "a # b"', 'b: "a\\tb"', "b: 'it''s'", 'b: "x" # c',
    'b: GPT-3 175B (Korthikanti et al. 2022, Table 3)', 'b: a: b', 'b: a:', 'b: [1, 2]', 'b: {a: 1}', 'b: &x 1',
    'b: *x', 'b: !!int 3', 'b: |', 'b: >', 'b: -', 'b: - 1', 'b: @x', 'b: `x', 'b: %x', "b: 'x'y", 'yes: 1',
    'on: 1', 'null: 1', 'True: 1', 'Y: 1', '  b: 1', 'b:1', '- b', '---', '...', 'b: café', 'b: \x00', 'b: \x7f',
    'b:\t1', 'b: 1\r', 'b: 1 ', 'b: 1  # c', 'b: impl', 'b: a.b/c+d-e_f', 'b: x,y', 'b: 530B (Table 3)', 'b: 1 2',
    'b: 0x10 a', 'b: 2001-12-14 21:59:43.10 -5', 'b: 1e3 x', 'b: 12 ',
]


def _pyyaml(text: str):
    loader = _bounded_loader(yaml)(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_is_read_flat_as_pyyaml_reads_it(path):
    text = path.read_text()
    assert read_flat(text) is not None
    assert read_flat(text) == _pyyaml(text)


@pytest.mark.parametrize("line", LINES)
def test_a_line_is_read_as_pyyaml_reads_it_or_left_to_pyyaml(line):
    text = f"# a model\ns: 2048\n{line}\nh: 64\n"
    flat = read_flat(text)
    if flat is None:
        return
    expected = _pyyaml(text)
    assert flat == expected and [type(v) for v in flat.values()] == [type(v) for v in expected.values()]


def test_a_repeated_key_is_left_to_pyyaml_which_refuses_it():
    assert read_flat("s: 1\ns: 2\n") is None


def test_most_of_those_lines_are_read_flat():
    """The reader is worth having only if it reads the common forms itself."""
    flat = [line for line in LINES if read_flat(f"s: 2048\n{line}\n") is not None]
    assert {"b: 1", "b: 1.5", "b: true", "b: abc # note", "b: 'a # b'", "b: \"x\" # c"} <= set(flat)
