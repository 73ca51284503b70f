"""The model configs that ship inside the package, found by name: `--config gpt3-175b`.

They live in `memcalc/configs/` as package data, so they travel with the wheel
and work from any directory. A path that exists is always read as given; only
a bare name with no file behind it is looked up here.
"""

from __future__ import annotations

import os
from pathlib import Path

from memcalc.config.files import parse_yaml, read_capped
from memcalc.records import record

SUFFIX = ".yaml"


@record
class Shipped:
    """One shipped config: its name (the file's stem), where it is, and its one-line description."""

    name: str
    path: Path
    description: str


def shipped_dir() -> Path:
    """The folder of shipped configs: package data, which setuptools installs as plain files beside the code
    (a path from __file__ costs nothing at start-up, where importlib.resources costs milliseconds)."""
    return Path(__file__).resolve().parents[1] / "configs"


def shipped_names() -> list[str]:
    """Every shipped config's name, sorted."""
    return sorted(p.stem for p in shipped_dir().glob(f"*{SUFFIX}"))


def locate(path: Path) -> Path:
    """`path` if it exists; else the shipped config it names (`gpt3-175b` or `gpt3-175b.yaml`); else `path`."""
    if os.path.exists(path) or path.parent != Path("."):  # os.path's: False, not OSError, for a name too long
        return path
    candidate = shipped_dir() / (path.name if path.suffix == SUFFIX else f"{path.name}{SUFFIX}")
    return candidate if os.path.isfile(candidate) else path


def catalogue() -> list[Shipped]:
    """Each shipped config with its description (the `description` field of the file: one of ours, a mapping)."""
    found = []
    for name in shipped_names():
        path = shipped_dir() / f"{name}{SUFFIX}"
        found.append(Shipped(name, path, str(parse_yaml(read_capped(path, "config file")).get("description") or "")))
    return found
