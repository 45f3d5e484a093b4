"""Reading a trace directory back, with one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from tracing.schema import SCHEMA_VERSION, TABLES


class TraceError(Exception):
    """A missing, corrupt or incompatible trace. str(e) is a one-line message."""


def read_meta(root: str | Path) -> dict[str, Any]:
    r = Path(root)
    if not r.exists():
        raise TraceError(f"trace not found: {r}")
    if not r.is_dir():
        raise TraceError(f"not a trace directory: {r}")
    p = r / "meta.json"
    try:
        meta = json.loads(p.read_text())
    except FileNotFoundError:
        raise TraceError(f"not a trace directory (no meta.json): {r}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"corrupt meta.json in {r}: {e}") from None
    if not isinstance(meta, dict):
        raise TraceError(f"corrupt meta.json in {r}: not an object")
    v = meta.get("schema_version")
    if v != SCHEMA_VERSION:
        raise TraceError(
            f"trace {r} has schema_version {v}; this mstrace reads version {SCHEMA_VERSION}"
        )
    return meta


def _parts(root: str | Path, name: str) -> list[Path]:
    if name not in TABLES:
        raise TraceError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
    d = Path(root) / name
    if not d.is_dir():
        raise TraceError(f"trace {root} has no {name}/ table")
    return sorted(d.glob("part-*.parquet"))


def read_table(root: str | Path, name: str, columns: list[str] | None = None) -> pa.Table:
    parts = _parts(root, name)
    if not parts:
        return TABLES[name].empty_table() if columns is None else TABLES[name].empty_table().select(columns)
    try:
        dataset = ds.dataset([str(p) for p in parts], format="parquet", schema=TABLES[name])
        # Each part carries its own dictionary for string columns; unify so
        # group-bys and dictionary codes work across parts.
        return dataset.to_table(columns=columns).unify_dictionaries()
    except (pa.ArrowInvalid, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TraceError(f"corrupt {name}/ table in {root}: {first}") from None
