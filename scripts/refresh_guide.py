"""Re-run every `$ memcalc ...` example pasted in a page and paste what it prints now.

    python scripts/refresh_guide.py docs/guide-fit-totals.md [more pages ...]

tests/test_doc_examples.py (and, for docs/measured-<impl>.md, the probe's own
test) compares each pasted block with the command's output on an 80-column
terminal: run this after a change to the model, read the diff, and commit the
page with the change that explains it. A block may hold several commands; a
block that ends in `...` shows the start of the output only and is left as it
is; `--out PATH` writes into a temporary directory, so that tracked images and
files are never rewritten (PATH stays in the pasted output).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

BLOCK = re.compile(r"```text\n(\$ memcalc .*?)```", flags=re.S)


def printed(command: str) -> str:
    """What `memcalc <command>` prints on an 80-column terminal, stdout and stderr in the order written, lines
    right-stripped; a shell pipeline runs as one."""
    with tempfile.TemporaryDirectory() as tmp:
        args = shlex.split(command)
        original = None
        if "--out" in args:
            at = args.index("--out") + 1
            original, args[at] = args[at], str(Path(tmp) / Path(args[at]).name)
        python = f"{shlex.quote(sys.executable)} -m memcalc "
        shell = command.replace("memcalc ", python, 1) if " | " in command else python + shlex.join(args[1:])
        run = subprocess.run(shell, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=os.environ | {"COLUMNS": "80", "PYTHONUNBUFFERED": "1"}, timeout=300)
        out = run.stdout if original is None else run.stdout.replace(args[args.index("--out") + 1], original)
    return "".join(line.rstrip() + "\n" for line in out.splitlines())


def refresh_block(block: str) -> str:
    """A text block with each of its commands followed by what it prints now (kept as is if it shows `...`)."""
    if block.rstrip().endswith("..."):
        return block
    runs = re.split(r"^\$ (?=memcalc )", block, flags=re.M)[1:]
    out = []
    for run in runs:
        lines = run.split("\n")
        shown = [lines.pop(0)]
        while shown[-1].endswith("\\"):
            shown.append(lines.pop(0))
        command = " ".join(x.rstrip("\\").strip() for x in shown)
        out.append("$ " + "\n".join(shown) + "\n" + printed(command))
    return "".join(out)


def main(paths: list[str]) -> None:
    for path in paths:
        page = Path(path)
        page.write_text(BLOCK.sub(lambda m: f"```text\n{refresh_block(m[1])}```", page.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
