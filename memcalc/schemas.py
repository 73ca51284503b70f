"""JSON Schemas (draft 2020-12) of every document memcalc prints or writes as JSON (`SCHEMAS`, each titled with
its command).

Scripts read `--json` output by key, so a renamed or dropped key breaks them silently: each document carries a
`schema_version` (bumped when a key changes meaning or goes away), tests validate every command's output against
its schema here, and top-level objects forbid unnamed keys, so a key added in code and not here fails a test.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from memcalc.config.schema import EXPERT_AXES, SIZES, ModelConfig, class_schema
from memcalc.model.knobs import Knobs
from memcalc.model.rules import AS_USED
from memcalc.model.strategy import STRATEGIES
from memcalc.sizing.verdict import COUNTS, PEAK, SAVED, SOLVES

SCHEMA_VERSION = 1
DIALECT = "https://json-schema.org/draft/2020-12/schema"

Schema = dict[str, Any]

# Building blocks. Bytes and sizes are integers: memcalc counts bytes exactly.
INT: Schema = {"type": "integer"}
COUNT: Schema = {"type": "integer", "minimum": 0}
POSITIVE: Schema = {"type": "integer", "minimum": 1}
NUMBER: Schema = {"type": "number"}
TEXT: Schema = {"type": "string"}
FLAG: Schema = {"type": "boolean"}
STRATEGY: Schema = {"enum": list(STRATEGIES)}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _array(items: Schema, **bounds: int) -> Schema:
    """A list of `items` (`bounds`: minItems)."""
    return {"type": "array", "items": items, **bounds}


def _map(values: Schema) -> Schema:
    """An object of any keys, each value of `values`."""
    return {"type": "object", "additionalProperties": values}


SHAPE: Schema = _array(COUNT)


def _object(properties: dict[str, Schema], optional: tuple[str, ...] = ()) -> Schema:
    """An object with these keys, all required but `optional`, and no other keys."""
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
    }


def _by_strategy(schema: Schema) -> Schema:
    """An object keyed by strategy name (none, tp, tp-sp), each value of `schema`."""
    return {"type": "object", "propertyNames": STRATEGY, "additionalProperties": schema, "minProperties": 1}


def _document(properties: dict[str, Schema], title: str, optional: tuple[str, ...] = ()) -> Schema:
    """A top-level document: the dialect, a title, `schema_version` first, no unnamed keys."""
    body = _object({"schema_version": {"const": SCHEMA_VERSION}, **properties}, optional)
    return {"$schema": DIALECT, "title": title, **body}


_JSON_TYPES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}
_JSON_BOUNDS = {"gt": "exclusiveMinimum", "ge": "minimum", "lt": "exclusiveMaximum", "le": "maximum"}


def _json(schema: Schema, null: bool) -> Schema:
    """A field's validation rule (memcalc.config.core's pydantic-core schema) in JSON Schema: what a valid config
    prints. `null`: an unset field is printed as null (else it is left out)."""
    kind = schema["type"]
    if kind == "nullable":
        return _nullable(_json(schema["schema"], null)) if null else _json(schema["schema"], null)
    if kind == "function-after":
        return _json(schema["schema"], null)
    if kind == "literal":
        return {"enum": schema["expected"]}
    return {"type": _JSON_TYPES[kind], **{word: schema[b] for b, word in _JSON_BOUNDS.items() if b in schema}}


def _fields(cls: type, null: bool) -> dict[str, Schema]:
    return {name: _json(f["schema"], null) for name, f in class_schema(cls)["fields"].items()}


# The model's knobs, as `formula` prints them (size knobs null unless set) and as a config carries them.
KNOBS: Schema = _object(_fields(Knobs, null=True))

# The config a command ran: every ModelConfig field, the fields whose default is None left out unless set, with the
# MLP width and K/V groups as used.
CONFIG: Schema = _object(
    _fields(ModelConfig, null=False),
    optional=tuple(f.name for f in fields(ModelConfig) if f.default is None and f.name not in AS_USED),
)

ACCOUNTING: Schema = _object({"exact": FLAG, "device": {"enum": ["cuda", "cpu"]}})

# --totals: one pipeline stage, term by term, and the step's peak (or why it is not modelled).
STAGE: Schema = _object(
    {
        "stage": TEXT,
        "layers": COUNT,
        "layer_activations_kept": COUNT,
        "total_bytes": COUNT,
        "parameters": COUNT,
        "parameter_groups": _map(COUNT),
        "terms": _array(_object({"name": TEXT, "group": TEXT, "bytes": COUNT, "note": TEXT})),
        "peak_bytes": COUNT,
        "peak_moment": TEXT,
        "peak_in_words": TEXT,  # the moment, and which of FSDP2's or ZeRO's buffers are live then
        "peak_by_category": _map(COUNT),
        "steady_bytes": COUNT,
        "peak_not_modelled": TEXT,
    },
    optional=("peak_bytes", "peak_moment", "peak_in_words", "peak_by_category", "steady_bytes", "peak_not_modelled"),
)

PER_GPU: Schema = _object({
    "gpu": TEXT,  # the preset's name, or "--device-memory"
    "device_memory_bytes": COUNT,
    "reserve_bytes": COUNT,
    "budget_bytes": INT,  # device memory less the reserve
    "gpus": _nullable(POSITIVE),
    "microbatches": _nullable(POSITIVE),
    "padded_vocab": POSITIVE,
    "parameters": COUNT,
    "strategies": _by_strategy(_object({
        "total_bytes": COUNT,
        "worst_stage": TEXT,  # the stage that needs the most
        "needed_bytes": COUNT,  # the step's peak where modelled, else states + saved activations
        "needed_basis": {"enum": [PEAK, SAVED]},
        "fits": _nullable(FLAG),  # null: states + saved activations fit, the step's peak is not modelled
        "headroom_bytes": INT,  # negative when it does not fit
        "stages": _array(STAGE, minItems=1),
    })),
})

_TENSORS: Schema = _array(_object({"name": TEXT, "bytes": COUNT, "shape": SHAPE, "saved_by": TEXT}))

# The paper's numbers at the same inputs (--impl paper), and each rule by which the implementation departs from
# them: its words, the bytes per layer it adds (negative: takes away), and each tensor it moves; or, where the paper
# does not model the inputs, its one-line refusal.
PAPER: Schema = {"anyOf": [
    _object({
        "per_layer_bytes": COUNT,
        "tensors": _TENSORS,
        "departures": _array(_object(
            {"rule": TEXT, "bytes": INT, "tensors": _array(_object({"name": TEXT, "bytes": INT}), minItems=1)}
        )),
    }),
    _object({"not_modelled": TEXT}),
]}

ESTIMATE: Schema = _document(
    {
        "config": CONFIG,
        "accounting": _object({**ACCOUNTING["properties"], "impl": KNOBS["properties"]["impl"]}),
        "strategies": _by_strategy(_object({
            "per_layer_bytes": COUNT,
            "total_bytes": COUNT,
            "ratio_to_none": NUMBER,
            "tensors": _TENSORS,
            "paper": PAPER,
        })),
        "per_gpu": PER_GPU,
    },
    "memcalc estimate --json",
    optional=("per_gpu",),
)

FORMULA: Schema = _document(
    {
        "knobs": KNOBS,
        "accounting": ACCOUNTING,
        "symbols": _map(TEXT),
        "strategies": _by_strategy(_object({
            "formula": TEXT, "latex": TEXT, "sympy": TEXT,
            "terms": _array(_object({"name": TEXT, "formula": TEXT, "latex": TEXT, "paper": FLAG})),
        })),
    },
    "memcalc formula --format json",
)

COMM: Schema = _document(
    {
        "config": CONFIG,
        "microbatches": POSITIVE,
        "strategies": _by_strategy(_object({
            "per_layer_bytes": COUNT,
            "per_step_bytes": COUNT,
            "pipeline_bytes": COUNT,
            "dense_layer_bytes": COUNT,  # a dense layer's, in a dense and MoE mix (0 otherwise)
            "layers": _map(COUNT),  # on the stage counted: moe and dense, or dense
            "formula": TEXT,
            "collectives": _array(_object({
                "name": TEXT, "operator": TEXT, "op": TEXT, "phase": {"enum": ["forward", "backward"]},
                "over": TEXT, "moves": TEXT, "shape": _array(TEXT), "bytes_sent": COUNT, "why": TEXT,
            })),
        })),
    },
    "memcalc comm --json",
)

_SECONDS = {"gemm_s": NUMBER, "comm_s": NUMBER, "exposed_without_s": NUMBER, "exposed_s": NUMBER}
COMM_OVERLAP: Schema = _document(
    {
        "gpu": _object({
            "name": TEXT, "memory_bytes": COUNT, "memory_source": TEXT, "tflops": NUMBER, "link_gb_s": NUMBER,
        }),
        "methods": _array(TEXT),
        "num_splits": POSITIVE,
        "collectives": _array(_object(
            {"collective": TEXT, "gemm": TEXT, "method": _nullable(TEXT), "bytes_sent": COUNT, **_SECONDS}
        )),
        "per_layer": _object(_SECONDS),
        "userbuffer_bytes": _map(COUNT),
        "userbuffer_total_bytes": COUNT,
        "note": TEXT,
    },
    "memcalc comm --overlap METHODS --json",
)

_MEASURED_TENSOR = {
    "name": TEXT, "predicted": COUNT, "measured": COUNT,
    "predicted_shape": _nullable(SHAPE), "measured_shape": _nullable(SHAPE), "match": FLAG,
}
_COLLECTIVE_SEEN: Schema = _array({"type": ["string", "integer"]})  # (op, pass, bytes), or empty
MEASURE: Schema = _document(
    {
        "config": CONFIG,
        "match": FLAG,
        "predicted_bytes": COUNT,
        "measured_bytes": COUNT,
        "tensors": _array(_object({"strategy": STRATEGY, **_MEASURED_TENSOR})),
        "strategies": _by_strategy(_object({
            "layer": TEXT,
            "cuda_like": _array(TEXT),
            "launch": TEXT,
            "group": TEXT,
            "device": TEXT,
            "t": POSITIVE,
            "ranks_compared": POSITIVE,
            "how": TEXT,
            "predicted_bytes": COUNT,
            "measured_bytes": COUNT,
            "match": FLAG,
            "differences": _array(TEXT),
            "tensors": _array(_object(_MEASURED_TENSOR)),
            "cuda": _nullable(_object({"kept": INT, "peak": INT})),
            "collectives": _array(_object(
                {"name": TEXT, "predicted": _COLLECTIVE_SEEN, "measured": _COLLECTIVE_SEEN, "match": FLAG}
            )),
        })),
    },
    "memcalc measure --json",
)

_PAIR: Schema = _object({"predicted": INT, "measured": INT})
MEASURE_STEP: Schema = _document(
    {
        "config": CONFIG,
        "match": FLAG,
        "strategies": _by_strategy(_object({
            "launch": TEXT,
            "t": POSITIVE,
            "how": TEXT,
            "match": FLAG,
            "differences": _array(TEXT),
            "moment": _object({"predicted": TEXT, "measured": TEXT, "match": FLAG, "what": TEXT}),
            "peak_bytes": _PAIR,
            "steady_bytes": _PAIR,
            "peak": _map(_PAIR),
            "steady": _map(_PAIR),
            "live_at_peak": _array(_object({"name": TEXT, "category": TEXT, "bytes": COUNT, "why": TEXT})),
        })),
    },
    "memcalc measure --step --json",
)

# A candidate value: its bytes, or null with the rule that makes it invalid.
_CANDIDATE: Schema = _nullable(_object({
    "value": POSITIVE, "bytes": _nullable(COUNT), "invalid": _nullable(TEXT),
    "basis": _nullable({"enum": [PEAK, SAVED]}),  # counting the peak only
}))
FIT: Schema = _document(
    {
        "config": CONFIG,
        "solve": {"enum": list(SOLVES)},
        "count": {"enum": list(COUNTS)},
        "budget_bytes": COUNT,
        "results": _array(_object({
            "strategy": STRATEGY, "recompute": KNOBS["properties"]["recompute"], "answer": _CANDIDATE,
            "left_over_bytes": _nullable(COUNT), "beyond": _CANDIDATE,
        })),
    },
    "memcalc fit --json",
)

# One list per column, all of length `rows` (JSON Schema cannot say "equal lengths"; the tests do).
SWEEP: Schema = _document(
    {
        "model": _nullable(TEXT),
        # With experts, the knobs' num_experts and moe_router_topk and the top-level ep are null: each row's
        # values are in the columns.
        "knobs": {**KNOBS, "properties": {**KNOBS["properties"], "moe_router_topk": _nullable(POSITIVE)}},
        "ep": _nullable(POSITIVE),
        "accounting": {"enum": ["paper", "exact-cuda", "exact-cpu"]},
        "configurations": COUNT,
        "skipped": _array(_object({"rule": TEXT, "count": POSITIVE, "example": TEXT})),
        "rows": COUNT,
        "columns": _object({
            **{name: _array(POSITIVE) for name in SIZES},
            "strategy": _array(STRATEGY),
            "per_layer_bytes": _array(COUNT),
            "total_bytes": _array(COUNT),
            **{name: _array(POSITIVE) for name in EXPERT_AXES},
        }, optional=EXPERT_AXES),
    },
    "memcalc sweep --format json",
)

SCHEMAS: dict[str, Schema] = {
    "estimate": ESTIMATE,
    "formula": FORMULA,
    "comm": COMM,
    "comm-overlap": COMM_OVERLAP,
    "measure": MEASURE,
    "measure-step": MEASURE_STEP,
    "fit": FIT,
    "sweep": SWEEP,
}
