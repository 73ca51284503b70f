"""docs/model.md is what `memcalc.docgen` renders from the code, and says what the seed says."""

import re
from pathlib import Path

import pytest
import sympy
from sympy.parsing.latex import parse_latex

import memcalc.docgen
from memcalc.docgen import model as docgen
from memcalc.model import ledger
from memcalc.model.formula import SYMBOLS

from tests.helpers import SEED_TEXT, seed_bytes

DOCS = Path(__file__).parents[1] / "docs" / "model.md"


@pytest.fixture(scope="module")
def rendered() -> str:
    return docgen.render()


def test_checked_in_pages_match_the_generator():
    for path, text in memcalc.docgen.pages().items():
        assert path.read_text() == text, f"{path.name} is stale: run `python -m memcalc.docgen --write`"


def test_docs_describe_every_ledger_tensor_with_its_reason(rendered):
    for x in ledger.ALL_TENSORS:
        row = next(line for line in rendered.splitlines() if line.startswith(f"| `{x.name}` | {x.saved_by} |"))
        assert x.why in row


def test_docs_print_the_seeds_three_formulas(rendered):
    default = rendered.split("## Formulas of the default layer", 1)[1].split("\n## ", 1)[0]
    for name, text in SEED_TEXT.items():
        assert f"| `{name}` | `{text}` |" in default


def test_docs_latex_totals_parse_back_to_the_seeds_formulas(rendered):
    b, s, h, a, t = (SYMBOLS[n] for n in "bshat")
    seed = {name: seed_bytes(name, b, s, h, a, t) for name in SEED_TEXT}
    default = rendered.split("## Formulas of the default layer", 1)[1]
    for name, expr in seed.items():
        latex = re.search(rf"\\text{{{name}}} &= (.*?)(?: \\\\)?$", default, re.M).group(1)
        parsed = parse_latex(latex, backend="antlr").subs({sympy.Symbol(n): x for n, x in SYMBOLS.items()})
        assert sympy.expand(parsed - expr) == 0, latex


def test_docs_mark_which_knobs_add_each_optional_tensor(rendered):
    lse = next(line for line in rendered.splitlines() if line.startswith("| `attention/softmax_lse` |"))
    assert "added by `--attention flash` (with `--exact`)" in lse
    gate = next(line for line in rendered.splitlines() if line.startswith("| `mlp/gate` |"))
    assert "added by `--mlp swiglu" in gate


def test_docgen_write_replaces_each_page_whole(tmp_path, monkeypatch, rendered):
    target = tmp_path / "docs" / "model.md"
    monkeypatch.setattr(memcalc.docgen, "pages", lambda: {target: rendered})
    memcalc.docgen.main(["--write"])
    assert target.read_text() == rendered
    assert [p.name for p in target.parent.iterdir()] == ["model.md"]  # no temporary file left beside it


def test_impl_pages_list_each_size_condition_once_with_its_tensors_sharing_a_reason_on_one_line():
    """SelectiveAC's shifted count decides every matmul output of a block: one line for that block, each tensor on
    it, not a line a tensor repeating the reason."""
    from memcalc.model.impls import IMPLEMENTATIONS

    conditions = IMPLEMENTATIONS["torchtitan"].size_conditions
    page = next(text for path, text in memcalc.docgen.pages().items() if path.name == "impl-torchtitan.md")
    section = page.split("## Where the sizes matter")[1].split("\n## ")[0]
    lines = [x for x in section.splitlines() if x.startswith("- ")]
    assert len(lines) == len({c.what for c in conditions}) < len(conditions)
    for c in conditions:
        line = next(x for x in lines if c.what[1:] in x)
        assert f"`{c.tensor.name}`" in line
