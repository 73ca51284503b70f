"""pydantic-core schemas written as the plain dicts they are, and their common case checked without pydantic-core.

`memcalc estimate` runs in loops, and importing pydantic-core (its schema helpers define hundreds of
TypedDicts) is a large share of its start-up. Its schemas are plain dicts in a documented format, so they
are written here directly, in the same shape `pydantic_core.core_schema`'s helpers return.

A config whose every value already has its field's exact type and lies in range (a shipped config, flags)
is accepted by `plain_values` in a few lines. Anything else (a wrong type, a value out of range, a type
pydantic-core would convert, anything this check is unsure of) goes to pydantic-core, which accepts it or
words the error. pydantic-core stays the one judge: this path accepts only what it accepts, with the same
result (tests/config/test_core.py checks both on every field).
"""

from __future__ import annotations

import math
from typing import Any, Callable

Schema = dict[str, Any]
UNSURE = object()  # "ask pydantic-core"


def int_schema(**bounds: int) -> Schema:
    """A strict integer (no bool, no float, no text), within gt/ge/lt/le `bounds`."""
    return {"type": "int", "strict": True, **bounds}


def float_schema(allow_inf_nan: bool = True, **bounds: float) -> Schema:
    """A strict number (an int or a float; no bool, no text), within gt/ge/lt/le `bounds`."""
    return {"type": "float", "strict": True, "allow_inf_nan": allow_inf_nan, **bounds}


def bool_schema() -> Schema:
    return {"type": "bool", "strict": True}


def str_schema() -> Schema:
    return {"type": "str", "strict": True}


def nullable_schema(schema: Schema) -> Schema:
    return {"type": "nullable", "schema": schema}


def literal_schema(expected: list[str]) -> Schema:
    return {"type": "literal", "expected": expected}


def after_schema(function: Callable[[Any], Any], schema: Schema) -> Schema:
    """`schema`, then `function` applied to its result (pydantic-core's no-info after-validator)."""
    return {"type": "function-after", "function": {"type": "no-info", "function": function}, "schema": schema}


def typed_dict_schema(fields: dict[str, tuple[Schema, bool]]) -> Schema:
    """A mapping of these fields (name -> (schema, required)), no others."""
    return {
        "type": "typed-dict", "extra_behavior": "forbid",
        "fields": {name: {"type": "typed-dict-field", "schema": s, "required": r} for name, (s, r) in fields.items()},
    }


_EXACT = {"int": int, "float": float, "bool": bool, "str": str}
_BOUNDS = (("gt", lambda v, b: v > b), ("ge", lambda v, b: v >= b), ("lt", lambda v, b: v < b),
           ("le", lambda v, b: v <= b))


def plain_value(schema: Schema, value: Any) -> Any:
    """`value` as pydantic-core would return it, when it is plainly valid; else UNSURE."""
    kind = schema["type"]
    if kind == "nullable":
        return None if value is None else plain_value(schema["schema"], value)
    if kind == "function-after":
        inner = plain_value(schema["schema"], value)
        if inner is UNSURE:
            return UNSURE
        try:
            return schema["function"]["function"](inner)
        except Exception:  # pydantic-core words the error
            return UNSURE
    if kind == "literal":
        expected = schema["expected"]
        return value if type(value) is str and value in expected and all(type(e) is str for e in expected) else UNSURE
    if type(value) is not _EXACT.get(kind) or (kind == "float" and not math.isfinite(value)):
        return UNSURE
    if all(check(value, schema[name]) for name, check in _BOUNDS if name in schema):
        return value
    return UNSURE


def plain_values(schema: Schema, values: dict[str, Any]) -> dict[str, Any] | None:
    """The typed dict `values` as pydantic-core would return it, when every value is plainly valid; else None."""
    fields = schema["fields"]
    if any(name not in fields for name in values) or any(
        f["required"] and name not in values for name, f in fields.items()
    ):
        return None
    out = {name: plain_value(fields[name]["schema"], value) for name, value in values.items()}
    return None if any(v is UNSURE for v in out.values()) else out
