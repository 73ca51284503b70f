"""Writing a sweep's rows as CSV or JSON, fast: numpy builds the text as bytes.

Each column becomes fixed-width digit bytes by table look-up (four digits at a time), the columns are laid side by
side as one uint8 matrix, and the padding is dropped in one pass (Python's string joins take seconds).
"""

from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Iterator, Sequence

import numpy as np

from memcalc.model.knobs import KNOBS, Accounting
from memcalc.schemas import SCHEMA_VERSION
from memcalc.sizing.sweep import EXPERT_AXES, SIZES, SweepResult

# A row's text is built as a (rows, width) byte matrix, one slice per field, each field NUL-padded to its widest value;
# dropping the NULs leaves the lines. Fields that are the same on every row are merged into one constant slice.

CSV_COLUMNS = (*SIZES, "strategy", "per_layer_bytes", "total_bytes")
# Every knob, from the knob table. The size knobs (4h and a unless set) come first and are written as used,
# so each row is a complete configuration: the grid's property for each, and the swept size it follows.
SIZE_KNOBS_AS_USED = {"ffn_hidden_size": ("ffn", "h"), "num_query_groups": ("groups", "a")}
KNOB_COLUMNS = (*SIZE_KNOBS_AS_USED, *(k.name for k in KNOBS if k.name not in SIZE_KNOBS_AS_USED))
CHUNK_ROWS = 1 << 16

# Four-digit groups as text, four bytes each: zero-padded for a group with digits to its left, NUL-padded for the
# leading group (all NUL above it); then zero itself, then the separator that ends every field.
_GROUPS = np.array(
    [f"{i:04d}".encode() for i in range(10_000)]
    + [str(i).encode().rjust(4, b"\0") if i else b"" for i in range(10_000)]
    + [b"\0\0\0" b"0", b","],
    dtype="S4",
).view(np.uint32)
_LEADING, _ZERO, _SEP = 10_000, 20_000, 20_001


def _digits(values: np.ndarray) -> np.ndarray:
    """Non-negative integers as text fields ending in ',', one row each, looked up four digits at a time (str()
    costs a microsecond a number: a million-row CSV would take seconds more)."""
    values = np.asarray(values, dtype=np.int64).ravel()
    n, groups = len(values), max(1, (len(str(int(values.max(initial=0)))) + 3) // 4)
    codes = np.empty((n, groups + 1), dtype=np.int64)
    rest = values
    for k in reversed(range(groups)):
        rest, codes[:, k] = np.divmod(rest, 10_000)
    # Group j (from the left) leads, or stands above the leading group, while the value is below 10^(4 * (groups - j)).
    below = np.array([min(10_000 ** (groups - j), 2**63) - 1 for j in range(groups)], dtype=np.int64)
    codes[:, :groups] += _LEADING * (values[:, None] <= below)
    codes[values == 0, groups - 1] = _ZERO
    codes[:, groups] = _SEP
    return _GROUPS[codes].view(np.uint8).reshape(n, 4 * (groups + 1))


def _text(strings: Sequence[str]) -> np.ndarray:
    """Short strings as text fields ending in ',', one row each."""
    encoded = np.array([f"{s},".encode() for s in strings], dtype="S")
    return encoded.view(np.uint8).reshape(len(strings), -1)


@dataclass(frozen=True)
class _Field:
    """A column's text: rows of a table picked by one of the result's indexes, or numbers."""

    table: np.ndarray
    index: int | None = None  # which of SweepResult.index picks the rows; None: numbers, one per row

    def text(self, result: SweepResult, rows: slice) -> np.ndarray:
        if self.index is None:
            return _digits(self.table[rows])
        return self.table[result.index[self.index][rows]]

    def constant(self) -> bytes | None:
        """The text if it is the same on every row."""
        if self.index is None or len(self.table) > 1:
            return None
        return self.table[0][self.table[0] != 0].tobytes()


def _layout(fields: list[_Field], end: bytes) -> list[_Field | bytes]:
    """The fields of a line, then `end`, with runs of constant text merged into one."""
    layout: list[_Field | bytes] = []
    for piece in [*(f.constant() or f for f in fields), end]:
        if piece == b"":
            continue
        if isinstance(piece, bytes) and layout and isinstance(layout[-1], bytes):
            layout[-1] += piece
        else:
            layout.append(piece)
    return layout


def _lines(layout: list[_Field | bytes], result: SweepResult, rows: slice) -> bytes:
    n = rows.stop - rows.start
    parts = [
        np.broadcast_to(np.frombuffer(p, dtype=np.uint8), (n, len(p))) if isinstance(p, bytes) else p.text(result, rows)
        for p in layout
    ]
    matrix = np.concatenate(parts, axis=1)
    return matrix[matrix != 0].tobytes()


def _columns(result: SweepResult, quote: bool) -> dict[str, _Field]:
    """CSV_COLUMNS as text, then E, k and ep if the model has experts; `quote` writes strategy names as JSON strings."""
    grid = result.grid
    names = [json.dumps(st.name) if quote else st.name for st in result.sweep.strategies]
    return {
        **{name: _Field(_digits(getattr(grid, name)), grid.axis(name)) for name in SIZES},
        "strategy": _Field(_text(names), -1), "per_layer_bytes": _Field(result.per_layer),
        "total_bytes": _Field(result.total),
        **{name: _Field(_digits(getattr(grid, name)), grid.axis(name)) for name in EXPERT_AXES if name in grid.names},
    }


def _text_of_chunks(layout: list[_Field | bytes], result: SweepResult, chunk_rows: int) -> Iterator[tuple[slice, bytes]]:
    """Each chunk of rows with its text, in order, on every core (numpy releases the GIL while it copies and
    compacts), at most two chunks per thread in flight so memory stays bounded."""
    workers = os.cpu_count() or 1
    chunks = (slice(start, min(start + chunk_rows, result.rows)) for start in range(0, result.rows, chunk_rows))
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[slice, Future[bytes]]] = deque()
        for rows in chunks:
            pending.append((rows, pool.submit(_lines, layout, result, rows)))
            if len(pending) >= 2 * workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def accounting_label(accounting: Accounting) -> str:
    """'paper', or 'exact-cuda' / 'exact-cpu'."""
    return f"exact-{accounting.device}" if accounting.exact else "paper"


def csv_chunks(result: SweepResult, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[float, bytes]]:
    """The CSV, piece by piece, each with how many rows it holds: CSV_COLUMNS, KNOB_COLUMNS, ep and the
    accounting, so each row is a configuration `memcalc estimate` reproduces."""
    yield 0, (",".join(CSV_COLUMNS + KNOB_COLUMNS + ("ep", "accounting")) + "\n").encode()
    grid = result.grid
    columns = _columns(result, quote=False)
    knobs = asdict(result.sweep.knobs) | {"ep": 1}
    fields = [columns[name] for name in CSV_COLUMNS] + [
        _Field(_digits(np.broadcast_to(getattr(grid, used), getattr(grid, axis).shape)), grid.axis(axis))
        for used, axis in SIZE_KNOBS_AS_USED.values()
    ] + [  # each a swept expert axis, or the same on every row
        columns.get(name) or _Field(_text([_cell(knobs[name])]), 0)
        for name in (*KNOB_COLUMNS[len(SIZE_KNOBS_AS_USED):], "ep")
    ]
    layout = _layout(fields, f"{accounting_label(result.sweep.accounting)}\n".encode())
    for rows, text in _text_of_chunks(layout, result, chunk_rows):
        yield rows.stop - rows.start, text


def _cell(value: object) -> str:
    """A knob's value as CSV text; booleans as YAML and JSON write them."""
    if value is None:  # a knob left unset (no experts, no capacity): an empty cell
        return ""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def json_chunks(result: SweepResult, chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[float, bytes]]:
    """The JSON document, piece by piece: knobs and skips once, then one list per column (a million rows as
    objects would be several times larger and slower to read back)."""
    sweep = result.sweep
    head = {
        "schema_version": SCHEMA_VERSION,
        "model": sweep.name,
        "knobs": asdict(sweep.knobs) | {name: None for name in EXPERT_AXES[:2] if name in sweep.axes},
        "ep": sweep.ep if "ep" not in sweep.axes else None,
        "accounting": accounting_label(sweep.accounting),
        "configurations": sweep.rows,
        "skipped": [{"rule": s.rule.text, "count": s.count, "example": s.example} for s in result.skipped],
        "rows": result.rows,
    }
    yield 0, (json.dumps(head, indent=1)[:-2] + ',\n "columns": {').encode()
    fields = _columns(result, quote=True)
    for i, (name, field) in enumerate(fields.items()):
        yield 0, f'{"," if i else ""}\n  "{name}": ['.encode()
        layout = _layout([field], b"")
        for rows, text in _text_of_chunks(layout, result, chunk_rows):  # every value ends in ','
            yield (rows.stop - rows.start) / len(fields), text[:-1] if rows.stop == result.rows else text
        yield 0, b"]"
    yield 0, b"\n }\n}\n"
