"""Re-run every `$ memcalc ...` example pasted in a guide and paste what it prints now.

    python scripts/refresh_guide.py docs/guide-fit-totals.md

For the guides whose tests compare each pasted block with the command's output
(stderr then stdout, on an 80-column terminal): run it after a change to the
model, read the diff, and commit the guide with the change that explains it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

BLOCK = re.compile(r"```text\n\$ memcalc (.*?)\n(.*?)```", flags=re.S)


def printed(command: str) -> str:
    """What `memcalc <command>` prints on an 80-column terminal, stderr first, lines right-stripped."""
    run = subprocess.run(
        [sys.executable, "-m", "memcalc", *shlex.split(command)], capture_output=True, text=True,
        env=os.environ | {"COLUMNS": "80"}, timeout=120,
    )
    return "".join(line.rstrip() + "\n" for line in (run.stderr + run.stdout).splitlines())


def main(path: str) -> None:
    guide = Path(path)
    text = BLOCK.sub(lambda m: f"```text\n$ memcalc {m[1]}\n{printed(m[1])}```", guide.read_text())
    guide.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1])
