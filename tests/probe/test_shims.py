"""The table of shims (memcalc.probe.shims) lists every patch the shim modules make, and docs/probe.md shows it."""

import re
from pathlib import Path

import pytest

from memcalc.probe.shims import SHIMS, Kind, markdown, notes

ROOT = Path(__file__).parents[2]
SHIM_MODULES = {"megatron": "megatron_shim.py", "torchtitan": "torchtitan_shim.py", "hf": "hf_shim.py"}
# mock.patch.object(target, "name", ...), and `owner.name = value` (not on the shims' own objects: their stand-in
# modules, instances and the parameters they mark)
PATCHED = re.compile(r'mock\.patch\.object\([\w.]+, "(\w+)"|^\s*(?!self\.|param\.|stub\.|module\.)\w+\.(\w+) = ', re.M)


# `a.x, b.y = ...`: several attributes patched at once
PATCHED_TOGETHER = re.compile(r"^\s*(\w+\.\w+(?:,\s*[\w.]+)+) = ", re.M)


def _patched_names(library: str) -> set[str]:
    source = (ROOT / "memcalc" / "probe" / "libs" / SHIM_MODULES[library]).read_text()
    together = {target.rsplit(".", 1)[-1] for targets in PATCHED_TOGETHER.findall(source)
                for target in targets.split(",") if "." in target}
    return {a or b for a, b in PATCHED.findall(source)} | together


@pytest.mark.parametrize("library", SHIM_MODULES)
def test_every_attribute_a_shim_module_patches_is_in_the_table(library):
    listed = " ".join(s.patched for s in SHIMS if s.library == library)
    assert sorted(name for name in _patched_names(library) if name not in listed) == []


def test_docs_probe_shows_the_table():
    assert markdown() in (ROOT / "docs" / "probe.md").read_text()


@pytest.mark.parametrize("library", SHIM_MODULES)
def test_measure_names_each_shims_kind_and_leaves_route_lines_to_route(library):
    lines = notes(library)
    assert lines and all(line.split(": ", 1)[0] in {k.value for k in Kind} for line in lines)
    assert not any(line.startswith("knob: --route") for line in lines)


def test_dropout_is_a_device_emulation_wherever_a_library_runs_it():
    dropout = [s for s in SHIMS if s.patched == "torch.nn.functional.dropout"]
    assert {s.library for s in dropout} == {"megatron", "hf"} and {s.kind for s in dropout} == {Kind.EMULATION}
