"""Reading a trace directory back, with one-line errors for bad input.

`Trace.open` reads meta.json and every rank's manifest once; its tables are then
read from the parts those manifests committed, so every table comes from the same
flushes (tracing/manifest.py). Parts no manifest names (a flush or a compaction
cut short by a kill) are ignored. A trace from before manifests reads every part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from tracing.manifest import STORE, ManifestError, legacy_parts, read_manifests
from tracing.run_status import RunStatus, run_status
from tracing.schema import SCHEMA_VERSION, TABLES

# A live writer may compact away a part between our manifest read and the part's;
# the new manifest then names its replacement.
_REOPEN_TRIES = 5


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
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise TraceError(f"corrupt meta.json in {r}: {_first_line(e)}") from None
    if not isinstance(meta, dict):
        raise TraceError(f"corrupt meta.json in {r}: not an object")
    v = meta.get("schema_version")
    if v != SCHEMA_VERSION:
        raise TraceError(
            f"trace {r} has schema_version {v}; this mstrace reads version {SCHEMA_VERSION}"
        )
    store = meta.get("store")
    if store is not None and store != STORE:
        raise TraceError(f"trace {r} has store {store!r}; this mstrace reads {STORE!r}")
    return meta


@dataclass(slots=True)
class Part:
    path: Path
    rows: int | None  # as committed; None in a legacy trace


@dataclass(slots=True)
class Trace:
    root: Path
    meta: dict[str, Any]
    status: RunStatus
    legacy: bool  # no manifests: every part on disk counts
    parts: dict[str, list[Part]] = field(default_factory=dict)

    @classmethod
    def open(cls, root: str | Path) -> Trace:
        r = Path(root)
        meta = read_meta(r)
        legacy = meta.get("store") != STORE
        return cls(r, meta, run_status(r, meta), legacy, _committed(r, legacy))

    def has_table(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        if name not in TABLES:
            raise TraceError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
        if not self.has_table(name):
            raise TraceError(f"trace {self.root} has no {name}/ table")
        schema = TABLES[name]
        if columns is not None:
            missing = [c for c in columns if c not in schema.names]
            if missing:
                raise TraceError(f"table {name} has no column {missing[0]!r}")
        for attempt in range(_REOPEN_TRIES):
            parts = self.parts.get(name, [])
            gone = next((p for p in parts if not p.path.is_file()), None)
            if gone is None:
                try:
                    t = _read_parts(parts, schema, columns)
                    break
                except FileNotFoundError as e:  # removed by a live compaction meanwhile
                    gone = Part(Path(e.filename or "?"), None)
                except (pa.ArrowException, OSError) as e:
                    gone = next((p for p in parts if not p.path.is_file()), None)
                    if gone is None:
                        raise TraceError(f"corrupt {name}/ table in {self.root}: {_first_line(e)}") from None
            if self.legacy or attempt == _REOPEN_TRIES - 1:
                raise TraceError(f"corrupt {name}/ table in {self.root}: the manifest names "
                                 f"{gone.path.name}, which is missing")
            self.parts = _committed(self.root, self.legacy)
        else:  # pragma: no cover - the loop always breaks or raises
            raise AssertionError
        want = sum(p.rows or 0 for p in parts)
        if not self.legacy and t.num_rows != want:
            raise TraceError(f"corrupt {name}/ table in {self.root}: its parts hold {t.num_rows} rows, "
                             f"the manifest committed {want}")
        return t


def read_table(root: str | Path, name: str, columns: list[str] | None = None) -> pa.Table:
    """One table of a trace (opens it afresh: for several tables, use one Trace)."""
    return Trace.open(root).table(name, columns)


def _read_parts(parts: list[Part], schema: pa.Schema, columns: list[str] | None) -> pa.Table:
    if not parts:
        empty = schema.empty_table()
        return empty if columns is None else empty.select(columns)
    dataset = ds.dataset([str(p.path) for p in parts], format="parquet", schema=schema)
    # Each part carries its own dictionary for string columns; unify so
    # group-bys and dictionary codes work across parts.
    return dataset.to_table(columns=columns).unify_dictionaries()


def _committed(root: Path, legacy: bool) -> dict[str, list[Part]]:
    if legacy:
        return {t: [Part(root / t / f, None) for f in legacy_parts(root, t)] for t in TABLES if (root / t).is_dir()}
    try:
        manifests = read_manifests(root)
    except ManifestError as e:
        raise TraceError(f"trace {root}: {e}") from None
    if not any(m.rank == 0 for m in manifests):
        raise TraceError(f"trace {root} has no manifest.json (its committed parts are unknown)")
    out: dict[str, list[Part]] = {}
    for m in manifests:
        for t, entries in m.tables.items():
            out.setdefault(t, []).extend(Part(root / t / e.file, e.rows) for e in entries)
    return out


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
