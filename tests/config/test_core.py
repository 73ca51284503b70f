"""The plain check accepts only what pydantic-core accepts, with the same result: pydantic-core stays the judge."""

import math
from dataclasses import fields

import pytest
from pydantic_core import SchemaValidator, ValidationError

from memcalc.config import core
from memcalc.config.schema import ModelConfig, _schema, class_schema
from memcalc.model.knobs import Knobs

SAMPLES = [
    None, True, False, 0, 1, 2, -1, 7, 2**63 - 1, 2**63, 0.0, 0.1, 0.5, 1.0, 1.5, 1e6, 1e7, math.nan, math.inf,
    -math.inf, "", "1", "x", "rope", "learned_absolute", "megatron", "gelu", "swiglu", "selective", "bf16", [1], {},
]
FIELDS = {f.name: f for cls in (ModelConfig, Knobs) for f in fields(cls)}


@pytest.mark.parametrize("name", FIELDS)
def test_a_plainly_valid_value_is_what_pydantic_core_returns(name):
    schema = _schema(FIELDS[name])
    judge = SchemaValidator(schema)
    for value in SAMPLES:
        plain = core.plain_value(schema, value)
        if plain is core.UNSURE:
            continue
        assert judge.validate_python(value) == plain and type(judge.validate_python(value)) is type(plain), value


@pytest.mark.parametrize("name", FIELDS)
def test_a_value_pydantic_core_refuses_is_never_plainly_valid(name):
    schema = _schema(FIELDS[name])
    judge = SchemaValidator(schema)
    for value in SAMPLES:
        try:
            judge.validate_python(value)
        except ValidationError:
            assert core.plain_value(schema, value) is core.UNSURE, value


def test_the_written_schemas_are_ones_pydantic_core_builds():
    for cls in (ModelConfig, Knobs):
        SchemaValidator(class_schema(cls))


def test_unknown_or_missing_fields_are_left_to_pydantic_core():
    schema = class_schema(ModelConfig)
    assert core.plain_values(schema, {"s": 2048, "h": 64, "a": 8}) == {"s": 2048, "h": 64, "a": 8}
    assert core.plain_values(schema, {"s": 2048, "h": 64}) is None  # a missing
    assert core.plain_values(schema, {"s": 2048, "h": 64, "a": 8, "x": 1}) is None  # an unknown key
