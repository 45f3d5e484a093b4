"""Reading a trace directory back, with one-line errors for bad input.

`Trace.open` reads meta.json and every rank's manifest once; its tables are then
read from the parts those manifests committed, so every table comes from the same
flushes (tracing/manifest.py). Parts no manifest names (a flush or a compaction
cut short by a kill) are ignored. A trace from before manifests reads every part.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tracing.manifest import STORE, ManifestError, legacy_parts, part_rank, read_manifests
from tracing.run_status import RunStatus, run_status
from tracing.schema import ADDED, NEVER_NULL, SCHEMA_VERSION, TABLES

# A live writer may compact away a part between our manifest read and the part's;
# the new manifest then names its replacement.
_REOPEN_TRIES = 5
# Tables are read in chunks at least this long: half a compacted part (so those stay
# uncopied), and long enough that a loop over chunks costs nothing beside the numpy
# passes inside it.
CHUNK_ROWS = 1 << 19
# A batch when a part is checked or rewritten as a stream (`mstrace compact`): at most this
# many rows, and about this much uncompressed data (a requests row, with its token lists,
# is a few kB; a probes row 36 bytes).
STREAM_BATCH_ROWS = 1 << 16
STREAM_BATCH_BYTES = 8 << 20


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
        inside = sorted(d.name for d in r.iterdir() if (d / "meta.json").is_file())
        if inside:  # e.g. the folder of a `--mode all` run
            raise TraceError(f"{r} is not a trace but holds {len(inside)}: "
                             f"{', '.join(str(r / n) for n in inside)}") from None
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
        parts = _committed(r, legacy)
        if legacy and read_meta(r).get("store") == STORE:
            # `mstrace compact` adopted the trace while we listed its files: the
            # listing may hold a merged part beside its sources; take the manifests
            meta, legacy, parts = read_meta(r), False, _committed(r, False)
        return cls(r, meta, run_status(r, meta), legacy, parts)

    def has_table(self, name: str) -> bool:
        return (self.root / name).is_dir()

    def reopen(self) -> None:
        """The parts the manifests commit now: a live trace's compaction replaced some."""
        self.parts = _committed(self.root, self.legacy)

    def table(self, name: str, columns: list[str] | None = None, dictionary: tuple[str, ...] = (),
              coalesce: bool = True) -> pa.Table:
        """`dictionary`: string columns to read dictionary-encoded (as Parquet stores
        them), so ten million repeated request ids are not built as strings. `coalesce`:
        small parts' rows combined into chunks of CHUNK_ROWS (a copy); else each part's rows
        stay as read (the requests of a 100 M-row trace: 0.98 -> 0.60 GB at the read's peak)."""
        if name not in TABLES:
            raise TraceError(f"unknown table {name!r}; tables: {', '.join(TABLES)}")
        if not self.has_table(name):
            raise TraceError(f"trace {self.root} has no {name}/ table")
        schema = TABLES[name]
        if columns is not None:
            missing = [c for c in columns if c not in schema.names]
            if missing:
                raise TraceError(f"table {name} has no column {missing[0]!r}")
        # A retry reads a later snapshot; rows only ever append (merges keep their order),
        # so each rank's rows are cut back to what the first snapshot committed.
        first = _rows_by_rank(self.parts.get(name, []))
        for attempt in range(_REOPEN_TRIES):
            parts = self.parts.get(name, [])
            gone = next((p for p in parts if not p.path.is_file()), None)
            if gone is None:
                try:
                    t = _read_parts(parts, schema, columns, dictionary, coalesce)
                    break
                except FileNotFoundError as e:  # removed by a live compaction meanwhile
                    gone = Part(Path(e.filename or "?"), None)
                except _PartSchemaError as e:
                    raise TraceError(f"corrupt {name}/ table in {self.root}: {e}") from None
                # garbage in a footer surfaces as any of these (a UnicodeDecodeError is a ValueError)
                except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as e:
                    gone = next((p for p in parts if not p.path.is_file()), None)
                    if gone is None:
                        raise TraceError(f"corrupt {name}/ table in {self.root}: {_first_line(e)}") from None
            if self.legacy or attempt == _REOPEN_TRIES - 1:
                raise TraceError(f"corrupt {name}/ table in {self.root}: the manifest names "
                                 f"{gone.path.name}, which is missing")
            self.reopen()
        else:  # pragma: no cover - the loop always breaks or raises
            raise AssertionError
        want = sum(p.rows or 0 for p in parts)
        if not self.legacy and t.num_rows != want:
            raise TraceError(f"corrupt {name}/ table in {self.root}: its parts hold {t.num_rows} rows, "
                             f"the manifest committed {want}")
        if attempt and not self.legacy:
            t = _cut_to(t, _rows_by_rank(parts), first)
        check_never_null(t, name, self.root)
        return t


    def verify(self, name: str) -> None:
        """TraceError unless every committed part of `name` reads whole, with the manifest's
        row count and no null where NEVER_NULL says: what `table` checks, read as a stream
        (part_batches), so a part of any size is checked in bounded memory (`mstrace
        compact` checks before it rewrites)."""
        for p in self.parts.get(name, []):
            try:
                rows = 0
                for b in part_batches(p, TABLES[name]):
                    b.validate(full=True)
                    check_never_null(b, name, self.root)
                    rows += b.num_rows
            except _PartSchemaError as e:
                raise TraceError(f"corrupt {name}/ table in {self.root}: {e}") from None
            except FileNotFoundError:
                raise TraceError(f"corrupt {name}/ table in {self.root}: the manifest names "
                                 f"{p.path.name}, which is missing") from None
            except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as e:
                raise TraceError(f"corrupt {name}/ table in {self.root}: {_first_line(e)}") from None
            if p.rows is not None and rows != p.rows:
                raise TraceError(f"corrupt {name}/ table in {self.root}: {p.path.name} holds {rows} rows, "
                                 f"the manifest committed {p.rows}")


def check_never_null(t: pa.Table, name: str, root: Path) -> None:
    """TraceError for a null in one of `name`'s NEVER_NULL columns (what Parquet's validation
    does not catch: the column's type allows it)."""
    for c in NEVER_NULL.get(name, ()):
        if c in t.column_names and t[c].null_count:
            n = t[c].null_count
            raise TraceError(f"corrupt {name}/ table in {root}: {n} {'row has' if n == 1 else 'rows have'} no {c}")


def part_batches(p: Part, schema: pa.Schema) -> Iterator[pa.Table]:
    """One part's rows a batch at a time (STREAM_BATCH_ROWS, STREAM_BATCH_BYTES), as `schema`'s
    columns (one added since the part was written holds its default, as `Trace.table` gives
    it): a part of any size in bounded memory. _PartSchemaError, or Arrow's errors, for a bad part."""
    added = _added(schema)
    pf, older = _open_part(p, schema, added, stream=True)
    md = pf.metadata
    row_bytes = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups)) / max(1, md.num_rows)
    rows = max(1, min(STREAM_BATCH_ROWS, int(STREAM_BATCH_BYTES / max(row_bytes, 1.0))))
    for b in pf.iter_batches(rows, columns=[n for n in schema.names if n not in older], use_threads=False):
        yield _with_added(pa.Table.from_batches([b]), schema, older, added).select(schema.names)


def read_row_groups(p: Part, schema: pa.Schema, columns: list[str], groups: list[int],
                    dictionary: tuple[str, ...] = ()) -> pa.Table:
    """Some row groups of one part, as `columns` of `schema` (a column added since the part
    was written holds its default); TraceError for a part of another shape. `dictionary`:
    as `Trace.table`'s. FileNotFoundError: a live compaction removed the part."""
    added = _added(schema)
    as_dict = pa.dictionary(pa.int32(), pa.string())
    want = pa.schema([schema.field(c).with_type(as_dict) if c in dictionary else schema.field(c) for c in columns])
    try:
        pf, older = _open_part(p, want, added, dictionary)
        t = pf.read_row_groups(groups, columns=[c for c in columns if c not in older], use_threads=False)
        t.validate(full=True)
    except _PartSchemaError as e:
        raise TraceError(f"corrupt part: {e}") from None
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise TraceError(f"corrupt part: {_first_line(e)}") from None
    return _with_added(t, want, older, added).select(columns)


def _with_added(t: pa.Table, schema: pa.Schema, older: list[str], added: dict[str, Any]) -> pa.Table:
    """t with the columns its part predates, each holding its default (schema.ADDED)."""
    for name in older:
        t = t.append_column(schema.field(name), pa.array([added[name]] * t.num_rows, schema.field(name).type))
    return t


def _added(schema: pa.Schema) -> dict[str, Any]:
    """The columns added to this table since version 1, with the value older parts hold."""
    return next((cols for t, cols in ADDED.items() if TABLES[t] is schema), {})


def _rows_by_rank(parts: list[Part]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in parts:
        r = part_rank(p.path.name)
        out[r] = out.get(r, 0) + (p.rows or 0)
    return out


def _cut_to(t: pa.Table, now: dict[int, int], first: dict[int, int]) -> pa.Table:
    """Rows are rank after rank (manifests are read in rank order): keep each rank's first rows."""
    pieces, at = [], 0
    for rank in sorted(now):
        pieces.append(t.slice(at, min(now[rank], first.get(rank, 0))))
        at += now[rank]
    return pa.concat_tables(pieces).combine_chunks() if pieces else t


def read_table(root: str | Path, name: str, columns: list[str] | None = None) -> pa.Table:
    """One table of a trace (opens it afresh: for several tables, use one Trace)."""
    return Trace.open(root).table(name, columns)


class _PartSchemaError(Exception):
    pass


def read_parts(parts: list[Part], schema: pa.Schema, columns: list[str] | None = None,
               dictionary: tuple[str, ...] = ()) -> pa.Table:
    """The rows of some committed parts, in order: a live tail's newest flushes
    (viewer/live/tail.py). FileNotFoundError: a live compaction removed one meanwhile.
    `dictionary`: as `Trace.table`'s."""
    try:
        return _read_parts(parts, schema, columns, dictionary)
    except _PartSchemaError as e:
        raise TraceError(f"corrupt part: {e}") from None
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise TraceError(f"corrupt part: {_first_line(e)}") from None


def _read_parts(parts: list[Part], schema: pa.Schema, columns: list[str] | None,
                dictionary: tuple[str, ...] = (), coalesce: bool = True) -> pa.Table:
    """The parts' rows in order, in chunks of at least CHUNK_ROWS rows (but where a run of
    small parts ends: before a large part, and at the end); with `coalesce` False, a chunk
    per part as read (no copy; a caller that loops over chunks loops over parts).

    Each part is read with ParquetFile, not the dataset scanner: on a trace of
    thousands of small row groups the scanner's per-row-group overhead was 3x the
    decoding (probes of 15 k flushes: 4.0 s against 1.2 s). Parts are read on two
    threads (decoding releases the GIL) and each part's row groups combined there;
    then string dictionaries are unified and small parts combined, so analyses never
    loop over thousands of chunks. A compacted part is already one chunk of more than
    CHUNK_ROWS and is not copied again (10 M probe rows: 200 MB of copy saved)."""
    names = columns if columns is not None else schema.names
    added = _added(schema)
    dictionary = tuple(c for c in dictionary if c in names)
    as_dict = pa.dictionary(pa.int32(), pa.string())
    want = pa.schema([schema.field(c).with_type(as_dict) if c in dictionary else schema.field(c) for c in names])
    if not parts:
        return want.empty_table()

    def one(p: Part) -> pa.Table:
        pf, older = _open_part(p, want, added, dictionary)
        t = pf.read(columns=[n for n in names if n not in older], use_threads=False)
        t = _with_added(t, want, older, added).select(names)
        if not coalesce:
            return t
        return t.unify_dictionaries().combine_chunks() if any(c.num_chunks > 1 for c in t.columns) else t

    if len(parts) == 1:
        tables = [one(parts[0])]
    else:
        with ThreadPoolExecutor(max_workers=2) as pool:
            tables = list(pool.map(one, parts))
    sizes = [x.num_rows for x in tables]
    t = pa.concat_tables(tables).select(names)
    del tables
    t = t.unify_dictionaries() if t.num_rows else t
    if coalesce:
        pieces = [t.slice(at - n, n) for at, n in zip(accumulate(sizes), sizes, strict=True)]
        del t  # each piece's buffers go as soon as it is combined: the peak is the rows plus one chunk
        t = _coalesce(pieces)
    # Freed here, allocated on the readers' threads: mimalloc keeps such memory until asked
    # (the requests of a 100 M-row trace: 880 -> 540 MB resident for 461 MB of rows).
    pa.default_memory_pool().release_unused()
    # Parquet checks neither UTF-8 nor dictionary indices: garbage in a data page would
    # surface later, in an analysis, as a traceback. (10 M probe rows: a few ms.)
    t.validate(full=True)
    return t


def _open_part(p: Part, want: pa.Schema, added: dict[str, Any], dictionary: tuple[str, ...] = (),
               stream: bool = False) -> tuple[pq.ParquetFile, list[str]]:
    """The part opened, and the columns of `want` it predates (added since it was written);
    _PartSchemaError if it lacks another or holds one of another type. `stream`: column
    chunks are also read through a small buffer as batches need them (pre-buffered, a
    requests part of 12 k row groups held 1.3 GB while 4 k-row batches were read from it)."""
    # Never pre-buffered (pyarrow's default fetches every column chunk of a read at once: it
    # pays on an object store, and on a local disk only raises the peak: `report` on 10 M
    # probe rows 0.93 -> 0.88 GB compacted, 1.25 -> 1.2 GB in 12 k one-flush row groups).
    how: dict[str, Any] = {"pre_buffer": False, **({"buffer_size": 1 << 20} if stream else {})}
    try:
        pf = pq.ParquetFile(p.path, read_dictionary=dictionary or None, **how)
    except KeyError as e:  # a dictionary column the part lacks
        name = e.args[0].decode() if e.args and isinstance(e.args[0], bytes) else str(e)
        raise _PartSchemaError(f"{p.path.name} has no column {name!r}") from None
    got = pf.schema_arrow
    older: list[str] = []
    for f in want:
        i = got.get_field_index(f.name)
        if i < 0 and f.name in added:
            older.append(f.name)
            continue
        if i < 0:
            raise _PartSchemaError(f"{p.path.name} has no column {f.name!r}")
        if got.field(i).type != f.type and not (f.name in dictionary and got.field(i).type == pa.string()):
            raise _PartSchemaError(f"{p.path.name} column {f.name!r} is {got.field(i).type}, not {f.type}")
    return pf, older


def _coalesce(pieces: list[pa.Table]) -> pa.Table:
    """The pieces (taken from the list) in order, runs of pieces under CHUNK_ROWS rows each
    combined into chunks of at least CHUNK_ROWS rows; a larger piece is not copied."""
    out: list[pa.Table] = []
    run: list[pa.Table] = []

    def flush() -> None:
        if run:
            g = pa.concat_tables(run)
            out.append(g.combine_chunks() if any(c.num_chunks > 1 for c in g.columns) else g)
            run.clear()
    pieces.reverse()
    while pieces:
        p = pieces.pop()
        if p.num_rows >= CHUNK_ROWS:
            flush()
            out.append(p)
            continue
        run.append(p)
        if sum(r.num_rows for r in run) >= CHUNK_ROWS:
            flush()
    flush()
    return pa.concat_tables(out)


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
