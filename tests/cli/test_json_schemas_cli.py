"""Every JSON document memcalc prints is described by its schema in memcalc.schemas.

Each command's real output is validated against its schema; the schemas forbid
keys they do not name, so a key added to an output without its schema fails here.
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from jsonschema import Draft202012Validator

from memcalc.config.schema import ModelConfig, field_names
from memcalc.errors import DoesNotFit
from memcalc.model.knobs import KNOBS
from memcalc.schemas import CONFIG, SCHEMA_VERSION, SCHEMAS

from . import memcalc_cli

# (schema, command) pairs: every `--json` output, with the options that change its shape.
OUTPUTS = [
    ("estimate", ["estimate", "--config", "gpt3-175b", "--json"]),
    ("estimate", ["estimate", "--config", "tiny", "--exact", "--device", "cpu", "--json"]),
    ("estimate", ["estimate", "--config", "tiny", "--totals", "--json"]),  # the step's peak, from the timeline
    ("estimate", ["estimate", "--config", "gpt3-175b", "--attention", "flash", "--cp", "2", "--totals", "--json"]),  # cp: no peak
    ("estimate", ["estimate", "--config", "llama2-7b", "--device-memory", "4GiB", "--reserve", "0", "--json"]),  # no fit
    ("formula", ["formula", "--config", "llama3-70b", "--format", "json"]),
    ("comm", ["comm", "--config", "gpt3-175b", "--pp", "8", "--num-microbatches", "8", "--json"]),
    ("comm-overlap", ["comm", "--config", "gpt3-175b", "--overlap", "default", "--json"]),
    ("fit", ["fit", "--config", "gpt3-175b", "--budget", "80GiB", "--json"]),
    ("fit", ["fit", "--config", "gpt3-175b", "--budget", "80GiB", "--solve", "t", "--json"]),
    ("fit", ["fit", "--config", "gpt3-175b", "--budget", "80GiB", "--count", "total", "--json"]),
    ("fit", ["fit", "--config", "llama3-70b", "--gpu", "h100-80gb", "--solve", "pp", "--json"]),  # a layout's size
    ("sweep", ["sweep", "--config", "tiny", "--t", "1,2,3", "--format", "json"]),
]


def _document(args: list[str]) -> dict:
    run = memcalc_cli(*args)
    assert run.code in (0, DoesNotFit.exit_code), run.err  # a "does not fit" verdict still prints its document
    return json.loads(run.out)


def _errors(name: str, doc: object) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in Draft202012Validator(SCHEMAS[name]).iter_errors(doc)]


@pytest.mark.parametrize("name", SCHEMAS)
def test_each_schema_is_valid_draft_2020_12_and_plain_json(name):
    Draft202012Validator.check_schema(SCHEMAS[name])
    assert json.loads(json.dumps(SCHEMAS[name])) == SCHEMAS[name]  # publishable as it is
    assert SCHEMAS[name]["$schema"] == "https://json-schema.org/draft/2020-12/schema"


@pytest.mark.parametrize("name, args", OUTPUTS, ids=[" ".join(a) for _, a in OUTPUTS])
def test_each_commands_json_output_matches_its_schema(name, args):
    doc = _document(args)
    assert next(iter(doc)) == "schema_version" and doc["schema_version"] == SCHEMA_VERSION
    assert _errors(name, doc) == []


def test_the_estimate_outputs_cover_totals_both_with_and_without_a_modelled_peak():
    stages = [st for args in (OUTPUTS[2][1], OUTPUTS[3][1])
              for p in _document(args)["per_gpu"]["strategies"].values() for st in p["stages"]]
    assert any("peak_bytes" in st for st in stages) and any("peak_not_modelled" in st for st in stages)


def test_a_sweeps_columns_all_hold_one_value_per_row():
    doc = _document(OUTPUTS[-1][1])
    assert {len(column) for column in doc["columns"].values()} == {doc["rows"]}


def test_a_key_the_schema_does_not_name_is_refused():
    doc = _document(OUTPUTS[0][1])
    doc["strategies"]["tp"]["surprise"] = 1
    assert _errors("estimate", doc) == ["strategies/tp: Additional properties are not allowed ('surprise' was unexpected)"]


def test_another_schema_version_is_refused():
    doc = _document(OUTPUTS[0][1]) | {"schema_version": SCHEMA_VERSION + 1}
    assert [e.split(":")[0] for e in _errors("estimate", doc)] == ["schema_version"]


def test_the_config_schema_names_every_model_config_field():
    assert set(CONFIG["properties"]) == set(field_names(ModelConfig))


def test_a_config_leaves_out_exactly_the_fields_that_default_to_none():
    unset = {f.name for f in fields(ModelConfig) if f.default is None} - {"ffn_hidden_size", "num_query_groups"}
    assert set(CONFIG["properties"]) - set(CONFIG["required"]) == unset  # those two are recorded as used


def test_the_knob_schemas_name_every_knob():
    assert set(SCHEMAS["formula"]["properties"]["knobs"]["properties"]) == {k.name for k in KNOBS}


@pytest.mark.parametrize("name, args", [  # in this process: the fake group, no ranks started
    ("measure", ["measure", "--config", "tiny", "--layer", "memcalc", "--strategy", "tp-sp", "--comm", "--json"]),
    ("measure-step", ["measure", "--config", "tiny", "--step", "--strategy", "tp", "--json"]),
])
def test_measures_json_output_matches_its_schema(name, args):
    pytest.importorskip("torch")
    doc = _document(args)
    assert doc["schema_version"] == SCHEMA_VERSION and _errors(name, doc) == []
