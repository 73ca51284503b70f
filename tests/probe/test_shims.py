"""The table of shims (memcalc.probe.shims) lists every patch the shim modules make, and docs/probe.md shows it."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from memcalc.probe.shims import SHIMS, Kind, markdown, notes, patched, patched_items

ROOT = Path(__file__).parents[2]
SHIM_MODULES = {"megatron": "megatron_shim.py", "torchtitan": "torchtitan_shim.py", "hf": "hf_shim.py"}
# `owner.name = value` (not on the shims' own objects: their stand-in modules, instances and the parameters they mark)
PATCHED = re.compile(r"^\s*(?!self\.|param\.|stub\.|module\.)\w+\.(\w+) = ", re.M)


# `a.x, b.y = ...`: several attributes patched at once
PATCHED_TOGETHER = re.compile(r"^\s*(\w+\.\w+(?:,\s*[\w.]+)+) = ", re.M)


def _patched_names(library: str) -> set[str]:
    source = (ROOT / "memcalc" / "probe" / "libs" / SHIM_MODULES[library]).read_text()
    together = {target.rsplit(".", 1)[-1] for targets in PATCHED_TOGETHER.findall(source)
                for target in targets.split(",") if "." in target}
    # patched(owner, name=...)
    in_calls = {keyword.arg for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "patched" for keyword in node.keywords}
    return set(PATCHED.findall(source)) | together | (in_calls - {None, "create"})


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


class _Base:
    inherited = "base's"


def test_patched_puts_back_an_owners_own_value_and_unshadows_an_inherited_one():
    class Owner(_Base):
        own = "owner's"

    with patched(Owner, own=1, inherited=2):
        assert (Owner.own, Owner.inherited) == (1, 2)
    assert (Owner.own, Owner.inherited, "inherited" in vars(Owner)) == ("owner's", "base's", False)


def test_patched_refuses_an_attribute_the_owner_lacks_unless_told_to_create_it():
    owner = SimpleNamespace()
    with pytest.raises(AttributeError, match="renamed"):
        with patched(owner, renamed=1):
            pass
    with patched(owner, create=True, renamed=1):
        assert owner.renamed == 1
    assert not hasattr(owner, "renamed")


def test_patched_items_leaves_the_table_as_it_was_even_what_was_added_inside():
    table = {"kept": 1}
    with patched_items(table, stand_in=2):
        table["added inside"] = 3
        assert table == {"kept": 1, "stand_in": 2, "added inside": 3}
    assert table == {"kept": 1}


def test_patched_fails_with_the_attributes_own_error_and_puts_back_what_it_had_set():
    class Owner:
        first = "owner's"

        @property
        def fixed(self) -> int:  # a property without a setter: an instance's cannot be set
            return 0

    owner = Owner()
    with pytest.raises(AttributeError, match="no setter"):
        with patched(owner, create=True, first=1, fixed=2):
            pass
    assert (owner.first, "first" in vars(owner)) == ("owner's", False)
