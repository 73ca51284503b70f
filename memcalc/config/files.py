"""Reading config files that may be hostile: bounded in size, depth and integer length.

A FIFO that never ends, /dev/zero, an alias bomb, a 5000-digit integer, a list nested 100,000 deep: each is refused
with one ConfigError naming the file and the rule. The YAML loader is safe and also refuses aliases (how a 500-byte
file expands to gigabytes), duplicate keys (the last would silently win) and merge keys (a merged key silently loses
to one written out, or to an earlier merge).
"""

from __future__ import annotations

import os
import re
import stat
from functools import cache
from pathlib import Path
from typing import Any

from memcalc.config.flat_yaml import read_flat
from memcalc.errors import ConfigError
from memcalc.records import record
from memcalc.text import MAX_INT_DIGITS, printable, short_repr, whole_number

MAX_CONFIG_BYTES = 1 << 20  # a real config is under 10 KB; a Hugging Face config.json under 100 KB
MAX_DEPTH = 20  # configs are flat mappings of scalars; a few levels leave room for lists in config.json


def read_capped(path: Path, what: str) -> str:
    """The text of the regular file `path`, at most MAX_CONFIG_BYTES, refusing anything else before opening it
    (opening a FIFO blocks until a writer comes; /dev/zero never ends)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"cannot read {what} {path}: it is a directory")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"cannot read {what} {path}: not a regular file (a FIFO, socket or device)")
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes, the most a {what} may hold")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); a {what} is text") from None


def parse_yaml(text: str) -> Any:
    """The YAML document in `text`, by the bounded loader (a flat file `read_flat` is sure of without PyYAML);
    ConfigError for any problem."""
    flat = read_flat(text)
    if flat is not None:
        return flat
    import yaml  # only a config file that is not plainly flat pays for it

    try:
        loader = _bounded_loader(yaml)(text)  # its reader refuses a NUL or control character here, at once
    except yaml.reader.ReaderError as exc:
        raise ConfigError(
            f"character U+{exc.character:04X} at position {exc.position} is not allowed in YAML (a control character)"
        ) from None
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"YAML syntax error{at}: {getattr(exc, 'problem', None) or 'invalid YAML'}") from None
    finally:
        loader.dispose()


def parse_json(text: str) -> Any:
    """The JSON document in `text`, with long integers, duplicate keys and deep nesting refused."""
    import json  # only --hf-config pays for it

    try:
        return json.loads(text, parse_int=_json_int, parse_constant=_json_constant, object_pairs_hook=_json_object)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except RecursionError:  # the decoder recurses once per level
        raise ConfigError(f"JSON nested too deep (a config is at most {MAX_DEPTH} levels)") from None


@record
class _LongInteger:
    """An integer too long to read, kept as its length until the object holding it can name its key."""

    digits: int

    def refuse(self, where: str) -> ConfigError:
        return ConfigError(f"{where}: a {self.digits}-digit integer is too large (at most {MAX_INT_DIGITS} digits)")


def _json_int(text: str) -> int | _LongInteger:
    digits = len(text.lstrip("-"))
    return _LongInteger(digits) if digits > MAX_INT_DIGITS else int(text)


def _json_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not a JSON number (JSON has no NaN or infinity)")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a repeated key or a too-long integer by name."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(f"duplicate key '{printable(key[:40])}' (each field may appear once)")
        long = next((v for v in (value if isinstance(value, list) else [value]) if isinstance(v, _LongInteger)), None)
        if long is not None:
            raise long.refuse(f"field '{printable(key[:40])}'")
        data[key] = value
    return data


class _RefusedYamlNumber(ConfigError):
    """A YAML number refused where it is read; the mapping holding it names its key."""

    def __init__(self, node: Any, problem: str) -> None:
        super().__init__(f"at line {node.start_mark.line + 1}: {problem}")
        self.node = node

    def key_of(self, mapping: Any) -> str:
        """The key whose value is this number in `mapping` (a YAML mapping node), else '?'."""
        return next((str(k.value) for k, v in mapping.value if v is self.node), "?")


# YAML 1.1 also reads 34:08 as 2048 (base 60), 017 as 15 (octal), 0x10, 0b10 and 1_000: a config's
# numbers are plain decimals (integers by `whole_number`'s rule, as flags), so anything else is refused
# rather than read as a number nobody wrote. Compiled on first use (re caches it): a flat config never needs it.
_DECIMAL_FLOAT = r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"


@cache
def _bounded_loader(yaml: Any) -> type:
    """yaml.SafeLoader, less aliases, duplicate keys, deep nesting and huge integers (built once)."""

    class BoundedLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise ConfigError(
                    f"YAML alias *{event.anchor} at line {event.start_mark.line + 1}: aliases are not accepted"
                    " in a config (write the value out)"
                )
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    line = self.peek_event().start_mark.line + 1
                    raise ConfigError(f"YAML nested deeper than {MAX_DEPTH} levels at line {line}")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[str] = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue  # a list or mapping as a key: validation names it
                if key_node.tag == "tag:yaml.org,2002:merge":  # a key it merges would silently lose to another
                    raise ConfigError(f"YAML merge key '<<' at line {key_node.start_mark.line + 1}: merges are not"
                                      " accepted in a config (write the fields out)")
                if key_node.value in seen:
                    raise ConfigError(
                        f"duplicate key '{printable(key_node.value[:40])}' at line {key_node.start_mark.line + 1}"
                        " (each field may appear once)"
                    )
                seen.add(key_node.value)
            try:
                return super().construct_mapping(node, deep=deep)
            except _RefusedYamlNumber as exc:  # a value of this mapping: name its key
                raise ConfigError(f"field '{printable(exc.key_of(node)[:40])}' {exc}") from None

        def construct_yaml_int(self, node: Any) -> int:
            try:
                return whole_number(str(node.value))
            except ConfigError as exc:
                raise _RefusedYamlNumber(node, str(exc)) from None

        def construct_yaml_float(self, node: Any) -> float:
            text = str(node.value)
            if not re.fullmatch(_DECIMAL_FLOAT, text):
                raise _RefusedYamlNumber(node, f"{short_repr(text)} is not a finite decimal number; write it in the"
                                         " digits 0-9")
            return super().construct_yaml_float(node)

    BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)
    BoundedLoader.add_constructor("tag:yaml.org,2002:float", BoundedLoader.construct_yaml_float)
    return BoundedLoader
