"""Reference pages rendered from the code: docs/model.md, docs/comm.md, docs/sharding.md and docs/impl-<name>.md;
their hand-written prose is in docs/templates/ and docs/impl-notes/.

    python -m memcalc.docgen          # print them
    python -m memcalc.docgen --write  # update the files

Tests fail when a checked-in page differs from what the code renders.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memcalc.output import atomic_write


def pages() -> dict[Path, str]:
    """Every generated page, by path."""
    from memcalc.docgen import comm, impls, model, sharding

    return {model.DOCS: model.render(), comm.DOCS: comm.render(), sharding.DOCS: sharding.render(), **impls.pages()}


def write(path: Path, text: str) -> None:
    """Replace `path` whole, as memcalc writes every file (`memcalc.output.atomic_write`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as stream:
        stream.write(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> None:
    """Print every page, or with --write update the files."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--write"]):
        sys.exit("usage: python -m memcalc.docgen [--write]")
    for path, text in pages().items():
        if args:
            write(path, text)
            print(f"wrote {path}")
        else:
            sys.stdout.write(text)
