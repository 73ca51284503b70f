"""A generated page's hand-written prose: docs/templates/<page>.md, each {{slot}} in it filled from the code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Sequence

TEMPLATES = Path(__file__).resolve().parents[2] / "docs" / "templates"


def filled(template: str, **slots: str) -> str:
    """docs/templates/<template>, each {{name}} in it replaced by `slots[name]`."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: slots[m.group(1)], (TEMPLATES / template).read_text())


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the header, its rule, then a line per row of cells."""
    lines = [f"| {' | '.join(cells)} |" for cells in (header, *rows)]
    return "\n".join([lines[0], "|---" * len(header) + "|", *lines[1:]])
