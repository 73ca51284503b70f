"""Hugging Face `config.json` files, read into memcalc's fields by each family's table (memcalc.model.families).

Whatever config.json does not say keeps memcalc's default (e.g. attention: eager, since config.json does not record
the kernel), and flags given beside --hf-config override the result. `HfConfig.used` says which field gave which
value, so the CLI can show it. An alias in the config class's `attribute_map` is read as the field it stands for,
and where a field is absent, the class's own default applies (noted per row).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memcalc.config.files import parse_json, read_capped
from memcalc.errors import ConfigError, in_file
from memcalc.model.families import FAMILIES, UNREAD, Family, Row
from memcalc.text import short_repr

@dataclass(frozen=True)
class HfConfig:
    """memcalc fields read from one config.json, and which of its fields gave them."""

    family: str
    fields: dict[str, Any]
    used: tuple[tuple[str, str, Any], ...]  # (config.json field(s), memcalc field, value)
    assumed: tuple[tuple[str, Any], ...]  # (memcalc field, value) fixed by the architecture or a class default

    def describe(self) -> str:
        """One line: the family, each field used, and what was assumed."""
        used = ", ".join(f"{src}={value} ({dst})" if " " in dst else f"{src}->{dst}={value}"
                         for src, dst, value in self.used)
        assumed = ", ".join(f"{dst}={value}" for dst, value in self.assumed)
        return f"read {self.family} config.json: {used}; assumed: {assumed}"


def read_hf_config(path: Path) -> HfConfig:
    """Map a Hugging Face config.json (or a model directory's, as from_pretrained takes one) to memcalc fields, or
    raise ConfigError naming what is wrong."""
    path = Path(path)
    if os.path.isdir(path) and os.path.isfile(path / "config.json"):  # os.path's: False for a name too long
        path = path / "config.json"
    raw = _load_json(path)
    family = _family(raw, path)
    raw, written = _renamed(raw, family)
    _refuse_unmodelled(raw, path, family)
    fields, used, missing = {"family": family.name, **family.fixed}, [], []
    assumed = list(family.fixed.items())
    for row in family.rows:
        present = [name for name in row.sources if raw.get(name) is not None]
        if not present:
            if row.default is ...:
                missing.append(row.sources[0])
            elif row.default is not None:
                fields[row.target] = row.default
                assumed.append((row.target, row.default))
            continue
        present = present if row.combine else present[:1]
        with in_file(path):
            value = _read(row, raw, present)
        if row.target is not None:
            fields[row.target] = value
        used.append((_source(raw, present, value, written), row.target or row.note, value))
    if missing:
        raise ConfigError(f"{path}: {family.name} config.json is missing {', '.join(dict.fromkeys(missing))}")
    _check_sparse_layers(raw, path)
    fields.setdefault("name", raw.get("_name_or_path") or _name_from(Path(path)))
    fields.setdefault("description", f"Hugging Face {family.name} config ({path})")
    return HfConfig(family.name, fields, tuple(used), tuple(assumed))


def _renamed(raw: dict[str, Any], family: Family) -> tuple[dict[str, Any], dict[str, str]]:
    """config.json's fields under the names the config class keeps them by: an `attribute_map` alias
    (Qwen3-MoE's num_experts, older files' word for num_local_experts) read as the field it stands for, as the
    class's __init__ sets it (a file holding both keeps the field); and each renamed field's word in the file."""
    renamed, written = dict(raw), {}
    for alias, kept in family.attribute_map.items():
        if alias in renamed:
            value = renamed.pop(alias)
            if kept not in renamed:
                renamed[kept], written[kept] = value, alias
    return renamed, written


def _read(row: Row, raw: dict[str, Any], present: list[str]) -> Any:
    """A row's value as memcalc's: every source combined (absent ones at the default), or the first present."""
    if row.combine:
        return row.convert(row.combine([raw[n] if n in present else row.default for n in row.sources]))
    return row.convert(raw[present[0]])


def _source(raw: dict[str, Any], present: list[str], value: Any, written: dict[str, str]) -> str:
    """The config.json field(s) a value came from, as the file spells them (`written`: an attribute_map alias), with
    the field's own word where memcalc renames it (activation_function=gelu_new for mlp=gelu_tanh), so that the one
    line shows every mapping."""
    given, names = raw[present[0]], [written.get(name, name) for name in present]
    if len(present) == 1 and isinstance(given, str) and given != value:
        return f"{names[0]}={given}"
    return "+".join(names)


def _name_from(path: Path) -> str:
    """A model directory's name for .../name/config.json, else the file's stem."""
    return path.parent.name if path.stem == "config" and path.parent.name else path.stem


def _load_json(path: Path) -> dict[str, Any]:
    text = read_capped(path, "Hugging Face config")
    with in_file(path):
        data = parse_json(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of fields, got {type(data).__name__}")
    return data


# config.json fields of layers memcalc does not model, and what they mean: each refused unless the family reads it
# (FAMILIES' rows), never silently dropped.
UNMODELLED = {
    "num_local_experts": "mixture of experts",
    "n_routed_experts": "mixture of experts",
    "num_experts": "mixture of experts",
    "kv_lora_rank": "multi-head latent attention",
}


def _refuse_unmodelled(raw: dict[str, Any], path: Path, family: Family) -> None:
    """One line naming every field that asks for layers memcalc cannot model (see docs/limitations.md); a field
    is modelled where the config's family reads it, and the line names the families that do."""
    read = set(family.reads())
    found = [f"{name}={short_repr(raw[name])} ({what})" for name, what in UNMODELLED.items()
             if name not in read and _sets(raw, name)]
    if found:
        readers = sorted({f.name for f in FAMILIES.values() for name in UNMODELLED if name in f.reads()})
        raise ConfigError(
            f"{path}: {family.name} config.json sets {', '.join(found)}, which memcalc does not read for"
            f" {family.name} (it reads these for {', '.join(readers)}); dropping them would give wrong numbers"
            " (see docs/limitations.md)"
        )


def _sets(raw: dict[str, Any], name: str) -> bool:
    """Whether config.json asks for the feature: any latent rank; more than one expert (0 or 1 is dense)."""
    value = raw.get(name)
    return value is not None if name == "kv_lora_rank" else value not in (None, 0, 1)


def _family(raw: dict[str, Any], path: Path) -> Family:
    """The family model_type names, else the first whose architecture is listed."""
    model_type, architectures = raw.get("model_type"), raw.get("architectures") or []
    if not isinstance(model_type, (str, type(None))) or not isinstance(architectures, list):
        raise ConfigError(
            f"{path}: model_type should be a string and architectures a list"
            f" (got {short_repr(model_type)} and {short_repr(architectures)})"
        )
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    named = [a for a in architectures if isinstance(a, str)]
    family = next((f for f in FAMILIES.values() if any(a in f.architectures for a in named)), None)
    if family is not None:
        return family
    if model_type in UNREAD:
        raise ConfigError(f"{path}: model_type {model_type} has {UNREAD[model_type]}, which memcalc does not model")
    if raw.get("auto_map") is not None:
        raise ConfigError(f"{path}: model_type {short_repr(model_type)} is built by the model's own code (auto_map,"
                          " trust_remote_code), not by a transformers class; memcalc measures only transformers' own"
                          " classes")
    known = ", ".join(FAMILIES)
    if model_type is None and not architectures:
        raise ConfigError(f"{path}: names no architecture (no model_type, no architectures); memcalc reads {known}")
    raise ConfigError(
        f"{path}: unknown architecture (model_type={short_repr(model_type)},"
        f" architectures={short_repr(architectures)});"
        f" memcalc reads {known}"
    )


def _check_sparse_layers(raw: dict[str, Any], path: Path) -> None:
    """Qwen2-MoE's and Qwen3-MoE's sparse layers: every decoder_sparse_step-th (ModelConfig.is_moe_layer), none
    listed in mlp_only_layers."""
    if raw.get("mlp_only_layers"):
        raise ConfigError(f"{path}: mlp_only_layers={short_repr(raw['mlp_only_layers'])} (dense layers at chosen"
                          " indices) is not modelled: memcalc places MoE layers every moe_layer_freq layers")
