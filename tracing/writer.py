"""The trace directory writer.

Each producer (a thread, a stream worker) gets its own list per table and
appends plain tuples in the schema's column order: no lock on the hot path. A
background thread drains the lists at least once per `flush_interval_s`, in
`schema.DRAIN_ORDER`, writes one zstd Parquet part per table that has rows, and
commits them all with one manifest write (tracing/manifest.py): a reader sees
whole flushes or nothing of them. After each commit it merges small parts
(tracing/compaction.py), and `close()` compacts what is left, so the writer never
holds more than one flush's rows or one compaction batch, however long the run, besides
the Arrow tables of its own unsealed parts (up to CACHE_BYTES), which its merges read
instead of the files.

Several processes (the ranks of a tensor/pipeline-parallel run) may write into
one trace directory: rank r > 0 names its parts `part-r<r>-NNNNNN.parquet` and
commits them in its own `manifest-r<r>.json`, and it writes its timestamps
already on rank 0's clock (`clock_offset_ns`, measured at start-up; see
docs/trace-schema.md). Each writer holds an exclusive lock on its manifest's lock
file while it lives, so readers can tell a live trace from a killed one, and
`mstrace compact` never rewrites parts under a running writer.

The writer accounts for its own cost (`WriterStats`): the CPU time of its thread
(that thread's own CPU clock), of `close()` on the caller's thread, and per table,
with the rows it committed. `close(meta)` writes it into the end-of-run record
(meta.json `run.writer`), so a trace says what tracing it cost (BENCHMARKS.md,
bench/bench_probe_cpu.py).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracing.compaction import Merge, Targets, plan_full, plan_tiered
from tracing.durable import fsync_dir, replace_durably
from tracing.manifest import SEALED, STORE, Manifest, ManifestError, PartEntry, write_manifest
from tracing.reader import Part, part_batches
from tracing.run_status import first_line
from tracing.schema import DRAIN_ORDER, SCHEMA_VERSION, TABLES, TIMESTAMPS
from tracing.store_lock import WriterLock


def parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """Per-column encodings: flat integer columns (timestamps, durations,
    steps) as DELTA_BINARY_PACKED, strings dictionary-encoded.
    Measured on a 10 M-row probes table: 56 MB -> 5 MB, read 0.35 s -> 0.15 s.
    List columns keep the default: delta-decoding 50 M token timestamps was
    3x slower than plain + zstd (1.0 s vs 0.3 s).
    Codecs: lz4 for the flat columns (after delta encoding zstd saves almost nothing
    there, and lz4 decodes a 1 M-row probes part in 26 ms against 44, and a column chunk
    of a small flush in 10 us against 17); zstd for lists and free text (the requests
    table's token ids: 7.5 MB against 18.6 with lz4)."""
    enc: dict[str, str] = {}
    dictionary: list[str] = []
    codec: dict[str, str] = {}
    for f in schema:
        if pa.types.is_integer(f.type):
            enc[f.name] = "DELTA_BINARY_PACKED"
        elif pa.types.is_dictionary(f.type) or pa.types.is_string(f.type):
            dictionary.append(f.name)
        flat = pa.types.is_integer(f.type) or pa.types.is_dictionary(f.type) or pa.types.is_boolean(f.type)
        codec[f.name] = "lz4" if flat else "zstd"
    return {"compression": codec, "use_dictionary": dictionary, "column_encoding": enc}


def write_parquet_atomic(table: pa.Table, final: Path, row_group_size: int | None = None) -> None:
    """Write under a temporary name, fsync, then rename: no file ever holds half a part, and
    the part's data is on disk before any manifest can name it (tracing/durable.py)."""
    tmp = final.with_name(f".{final.name}.tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size, **parquet_options(table.schema))
    replace_durably(tmp, final)


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    replace_durably(tmp, path)
    fsync_dir(path.parent)


_UNFIT = (pa.ArrowException, TypeError, ValueError, OverflowError)  # a value its column cannot hold


def _fits(row: tuple[Any, ...], struct: pa.DataType) -> bool:
    try:
        pa.array([row], type=struct)
    except _UNFIT:
        return False
    return True


_cpu = time.thread_time_ns  # the calling thread's own CPU clock (CLOCK_THREAD_CPUTIME_ID)


@dataclass(slots=True)
class WriterStats:
    """What the writer cost and wrote (meta.json `run.writer`; docs/trace-schema.md)."""

    thread_cpu_ns: int  # the writer thread's own CPU time, its whole life
    close_cpu_ns: int  # close() on the caller's thread: the last flush and the final compaction
    table_cpu_ns: dict[str, int]  # per table: drain + build + write + merge, on either thread
    rows: dict[str, int]  # rows committed per table
    flushes: int  # flushes that committed rows
    refused: dict[str, int]  # per table: rows its columns cannot hold, set aside (never committed)

    @property
    def cpu_ns(self) -> int:
        return self.thread_cpu_ns + self.close_cpu_ns

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_ns": self.cpu_ns, "thread_cpu_ns": self.thread_cpu_ns, "close_cpu_ns": self.close_cpu_ns,
                "table_cpu_ns": dict(self.table_cpu_ns), "rows": dict(self.rows), "flushes": self.flushes,
                "refused": dict(self.refused)}


CACHE_BYTES = 32 << 20  # the run's writer keeps up to this much of its unsealed parts in memory


class PartCache:
    """The Arrow tables of the parts a writer wrote and has not sealed, so that merging
    them does not read back what it has just written: on the tiny preset, reading the
    probes and memory parts back for their merges was 30% of the writer's CPU time
    (BENCHMARKS.md, "Probe overhead by CPU time"). Bounded by bytes, oldest out first;
    a part that is not here is read from its file, as `mstrace compact` always does."""

    __slots__ = ("max_bytes", "_tables", "_bytes")

    def __init__(self, max_bytes: int = CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._tables: dict[tuple[str, str], pa.Table] = {}  # (table, part file) -> rows; insertion order = age
        self._bytes = 0

    def put(self, name: str, file: str, table: pa.Table) -> None:
        if table.nbytes > self.max_bytes:
            return
        self._tables[(name, file)] = table
        self._bytes += table.nbytes
        while self._bytes > self.max_bytes:
            self._bytes -= self._tables.pop(next(iter(self._tables))).nbytes

    def take(self, name: str, file: str) -> pa.Table | None:
        t = self._tables.pop((name, file), None)
        if t is not None:
            self._bytes -= t.nbytes
        return t

    def clear(self) -> None:
        self._tables.clear()
        self._bytes = 0


class PartStore:
    """One rank's committed parts: writing parts, committing them, merging them.

    Shared by the run's writer (with a PartCache) and `mstrace compact` (without);
    the caller serialises calls."""

    def __init__(self, root: Path, manifest: Manifest, schemas: dict[str, pa.Schema], targets: Targets,
                 cache: PartCache | None = None) -> None:
        self.root, self.manifest, self.schemas, self.targets = root, manifest, schemas, targets
        self.cache = cache

    def write_part(self, name: str, table: pa.Table, level: int = 0) -> PartEntry:
        """Write one part (not yet committed: no manifest names it)."""
        file = self.manifest.new_name()
        write_parquet_atomic(table, self.root / name / file, self.targets.max_rows)
        if self.cache is not None and level != SEALED:  # a sealed part is never merged again
            self.cache.put(name, file, table)
        return PartEntry(file, table.num_rows, table.nbytes, level, max(1, -(-table.num_rows // self.targets.max_rows)))

    def forget(self, name: str, files: list[str]) -> None:
        """Parts that will never be merged (sealed, or written by a flush that failed)."""
        if self.cache is not None:
            for f in files:
                self.cache.take(name, f)

    def _merge_streaming(self, name: str, files: list[str], level: int) -> PartEntry:
        """The parts' rows into one new part, read a batch at a time (tracing/reader.py
        part_batches) and written in row groups of up to `max_rows` rows and `max_bytes` of
        Arrow memory: no part is ever whole in memory (a 2.7 GB requests part was, and
        compact was OOM-killed)."""
        schema, t = self.schemas[name], self.targets
        file = self.manifest.new_name()
        final = self.root / name / file
        tmp = final.with_name(f".{final.name}.tmp")
        buf: list[pa.Table] = []
        rows = nbytes = groups = total_rows = total_bytes = 0
        batches = chain.from_iterable(part_batches(Part(self.root / name / f, None), schema) for f in files)
        try:
            with pq.ParquetWriter(tmp, schema, **parquet_options(schema)) as w:
                for b in chain(batches, [None]):  # None: the end, where the last group is written
                    if buf and (b is None or rows + b.num_rows > t.max_rows or nbytes + b.nbytes > t.max_bytes):
                        w.write_table(pa.concat_tables(buf).unify_dictionaries().combine_chunks(),
                                      row_group_size=rows)
                        buf, rows, nbytes, groups = [], 0, 0, groups + 1
                    if b is not None:
                        buf.append(b)
                        rows, nbytes = rows + b.num_rows, nbytes + b.nbytes
                        total_rows, total_bytes = total_rows + b.num_rows, total_bytes + b.nbytes
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not stay full of half a part
            raise
        replace_durably(tmp, final)
        return PartEntry(file, total_rows, total_bytes, level, max(1, groups))

    def _read(self, name: str, files: list[str], cache: PartCache) -> pa.Table:
        schema = self.schemas[name]
        # A part not in the cache is read on this thread (no Arrow thread pool), so that
        # all of the writer's work shows on its own CPU clock (run.writer).
        tables = [t if (t := cache.take(name, f)) is not None
                  else pq.read_table(self.root / name / f, schema=schema, use_threads=False) for f in files]
        return pa.concat_tables(tables).unify_dictionaries().combine_chunks()

    def commit(self, added: dict[str, list[PartEntry]]) -> None:
        """The parts' names on disk, then the manifest naming them (tracing/durable.py's order).
        The manifest held here names the parts only once the write returns: a flush whose
        commit failed writes its rows again, and a manifest that already named them would
        commit them twice. A write that failed after its rename did commit them on disk; the
        next commit names the rows' new parts instead (those become unnamed files, which
        readers ignore and `compact` removes), under an epoch no reader has seen."""
        for name in added:
            fsync_dir(self.root / name)
        m = self.manifest
        tables = {name: list(entries) for name, entries in m.tables.items()}
        for name, entries in added.items():
            tables.setdefault(name, []).extend(entries)
        new = Manifest(m.rank, m.epoch + 1, m.next_seq, tables)
        try:
            write_manifest(self.root, new)
        except BaseException:
            m.epoch = new.epoch
            raise
        m.epoch, m.tables = new.epoch, tables  # in place: `compact_trace` reads the object it handed over

    def compact(self, final: bool, cpu: dict[str, int] | None = None) -> int:
        """Merge until the plan has nothing left; returns the number of merges.
        `cpu`, when given, gains each table's merge CPU time (this thread's clock)."""
        merges = 0
        for name in [t for t in self.manifest.tables if t in self.schemas]:  # (a newer version's tables stay)
            c0 = _cpu()
            while True:
                entries = self.manifest.tables[name]
                plan = plan_full(entries, self.targets) if final else plan_tiered(entries, self.targets)
                step = next(iter(plan), None)
                if step is None:
                    break
                if isinstance(step, Merge):
                    self._merge(name, step)
                    merges += 1
                else:  # seal in place: a manifest-only change
                    entries[step].level = SEALED
                    self.forget(name, [entries[step].file])
                    self.commit({})
            if cpu is not None:
                cpu[name] = cpu.get(name, 0) + _cpu() - c0
        return merges

    def _merge(self, name: str, m: Merge) -> None:
        entries = self.manifest.tables[name]
        old = entries[m.start:m.stop]
        if self.cache is None:  # `mstrace compact`: parts of any size, in bounded memory
            new = self._merge_streaming(name, [e.file for e in old], m.level)
            rows = new.rows
        else:  # a run's merges stay within the targets, mostly from the cache: one table is faster
            table = self._read(name, [e.file for e in old], self.cache)
            rows = table.num_rows
            new = self.write_part(name, table, m.level)
            del table
        if rows != sum(e.rows for e in old):
            raise ManifestError(f"{name}/ parts {old[0].file}..{old[-1].file} hold {rows} rows, "
                                f"the manifest committed {sum(e.rows for e in old)}")
        # The commit swaps the new part in for the old ones in one manifest write;
        # only after it are the old files removed (a kill in between leaves
        # unreferenced files, which readers ignore and `compact` removes).
        entries[m.start:m.stop] = [new]
        fsync_dir(self.root / name)  # the merged part's name on disk before the manifest names it
        self.commit({})
        for e in old:
            (self.root / name / e.file).unlink(missing_ok=True)


# How often the writer commits what the producers buffered. Each flush writes one part per
# table, and a part has a fixed cost (~1.5 ms of the writer's CPU in a busy run, most of the
# probes' CPU cost: BENCHMARKS.md "Probe overhead by CPU time"); a killed run loses at most
# this much of its trace.
FLUSH_INTERVAL_S = 1.0


class TraceWriter:
    def __init__(
        self,
        root: str | Path,
        tables: dict[str, pa.Schema] | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        *,
        rank: int = 0,
        clock_offset_ns: int = 0,
        targets: Targets | None = None,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        # This process's clock minus rank 0's: subtracted from every timestamp column.
        self.clock_offset_ns = clock_offset_ns
        self.schemas = dict(TABLES if tables is None else tables)
        self.root.mkdir(parents=True, exist_ok=True)
        for name in self.schemas:
            (self.root / name).mkdir(exist_ok=True)
        self._lock = WriterLock.acquire(self.root, rank)
        self._store = PartStore(self.root, Manifest(rank), self.schemas, targets or Targets(), PartCache())
        # An empty commit at once: a trace of this format always has its manifest, so
        # parts written before the first commit are never mistaken for a legacy trace's.
        self._store.commit({})
        self._order = [n for n in DRAIN_ORDER if n in self.schemas] + \
            [n for n in self.schemas if n not in DRAIN_ORDER]
        self._buffers: dict[str, list[list[tuple[Any, ...]]]] = {name: [] for name in self.schemas}
        self._register_lock = threading.Lock()
        self._rows_written = {name: 0 for name in self.schemas}
        self._refused = {name: 0 for name in self.schemas}
        self._table_cpu = {name: 0 for name in self.schemas}
        self._flushes = 0
        self._thread_cpu_ns = 0  # set by the writer thread as it ends
        self._close_cpu_ns = 0
        self._interval = flush_interval_s
        self._stop = threading.Event()
        self._flush_lock = threading.Lock()
        self._retry: dict[str, list[tuple[Any, ...]]] = {}  # rows of a flush whose write failed
        self.last_error: BaseException | None = None  # the background thread's, kept for diagnosis
        self._closed = False
        self._taps: dict[str, list[Callable[[pa.Table], None]]] = {}
        self._tap_failed = False
        self._thread = threading.Thread(target=self._loop, name="trace-writer", daemon=True)
        self._thread.start()

    def buffer(self, table: str) -> list[tuple[Any, ...]]:
        """A new list, owned by one producer, to append `table` rows to.

        Keep the reference: it is drained in place, never replaced.
        """
        buf: list[tuple[Any, ...]] = []
        with self._register_lock:
            self._buffers[table].append(buf)
        return buf

    def tap(self, table: str, fn: Callable[[pa.Table], None]) -> None:
        """Call `fn` with each committed batch of `table`, on the writer's thread (a live
        view of the rows, off the producers' threads; `serve`'s live cost table)."""
        self._taps.setdefault(table, []).append(fn)

    def write_meta(self, meta: dict[str, Any]) -> None:
        write_json_atomic(self.root / "meta.json", {"schema_version": SCHEMA_VERSION, "store": STORE, **meta})

    def rows_written(self, table: str) -> int:
        return self._rows_written[table]

    def stats(self) -> WriterStats:
        """The writer's cost so far; complete once close() has returned."""
        return WriterStats(self._thread_cpu_ns, self._close_cpu_ns, dict(self._table_cpu),
                           dict(self._rows_written), self._flushes, dict(self._refused))

    @property
    def manifest(self) -> Manifest:
        return self._store.manifest

    def flush(self) -> None:
        """Drain every buffer, write one part per table, commit them together."""
        cpu = self._table_cpu
        with self._flush_lock:
            # Every table drained before any is written (the DRAIN_ORDER guarantee);
            # each table's share of this thread's CPU is taken as it goes.
            drained = []
            for name in self._order:
                c0 = _cpu()
                drained.append((name, self._retry.pop(name, []) + self._drain(name)))
                cpu[name] += _cpu() - c0
            try:
                added, tables = {}, {}
                for name, rows in drained:
                    if rows:
                        c0 = _cpu()
                        tables[name] = self._convert(name, rows)
                        added[name] = [self._store.write_part(name, tables[name])]
                        cpu[name] += _cpu() - c0
                if added:
                    self._store.commit(added)
            except BaseException:
                # Nothing of this flush is committed (its written parts are ignored):
                # keep its rows for the next one rather than lose them.
                self._retry = {name: rows for name, rows in drained if rows}
                for name, entries in added.items():
                    self._store.forget(name, [e.file for e in entries])
                raise
            self._flushes += bool(added)
            for name, t in tables.items():
                for fn in self._taps.get(name, ()):
                    try:
                        fn(t)
                    except Exception as e:  # noqa: BLE001 - a view's failure; the rows are committed
                        # raising here skipped the bookkeeping below, and failed close() for good
                        if not self._tap_failed:  # said once: the view may go stale, the trace does not
                            print(f"trace writer: a live view of the {name} rows failed (they are committed "
                                  f"all the same): {first_line(e)}", file=sys.stderr, flush=True)
                        self._tap_failed = True
                        self.last_error = e
            for name, rows in drained:
                self._rows_written[name] += len(rows)
                if rows:  # freeing the rows' tuples is this table's cost too
                    c0 = _cpu()
                    rows.clear()
                    cpu[name] += _cpu() - c0

    def commit_tables(self, tables: dict[str, pa.Table]) -> None:
        """Write whole tables (an importer's, built column by column) as one commit: a part
        per table, all named by one manifest write, as a flush commits its rows."""
        with self._flush_lock:
            added = {}
            try:
                for name, t in tables.items():
                    if t.num_rows:
                        added[name] = [self._store.write_part(name, t.cast(self.schemas[name]))]
                if added:
                    self._store.commit(added)
            except BaseException:
                for name, entries in added.items():
                    self._store.forget(name, [e.file for e in entries])
                raise
            self._flushes += bool(added)
            for name, t in tables.items():
                self._rows_written[name] += t.num_rows

    def close(self, meta: dict[str, Any] | None = None) -> None:
        """Last flush, then compact what is left (a finished run's trace has few parts),
        then `meta` (the end-of-run record), all before the lock is let go: a reader
        never sees a finished run's trace as a killed one."""
        if self._closed:
            return
        self._stop.set()
        self._thread.join()
        try:
            c0 = _cpu()
            self.flush()
            with self._flush_lock:
                self._store.compact(final=True, cpu=self._table_cpu)
                if self._store.cache is not None:
                    self._store.cache.clear()
            self._close_cpu_ns = _cpu() - c0
            if meta is not None:
                run = meta.get("run")
                if isinstance(run, dict):  # the end-of-run record says what the tracing cost
                    meta = {**meta, "run": {**run, "writer": self.stats().to_dict()}}
                self.write_meta(meta)
        finally:
            self._closed = True
            self._lock.release()

    def _drain(self, name: str) -> list[tuple[Any, ...]]:
        with self._register_lock:
            bufs = list(self._buffers[name])
        rows: list[tuple[Any, ...]] = []
        for buf in bufs:
            n = len(buf)
            # Slice then delete the same prefix: rows appended meanwhile
            # sit past n and stay for the next flush.
            rows += buf[:n]
            del buf[:n]
        return rows

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                try:
                    self.flush()
                    with self._flush_lock:
                        self._store.compact(final=False, cpu=self._table_cpu)
                except Exception as e:  # noqa: BLE001 - a full disk may clear; close() flushes again and raises
                    self.last_error = e
        finally:
            # Read inside the thread: its CPU clock counts from the thread's creation,
            # and only this thread can read it once the thread has ended.
            self._thread_cpu_ns = _cpu()

    def _convert(self, name: str, rows: list[tuple[Any, ...]]) -> pa.Table:
        """`rows` as a table; a row its columns cannot hold (a producer's bug) is set aside,
        removed from `rows` in place, and counted: kept for the next flush, it would fail
        that one too, and every flush after it, so nothing more would be stored."""
        try:
            return self._table(name, rows)
        except _UNFIT as e:
            struct = pa.struct(list(self.schemas[name]))
            good = [r for r in rows if _fits(r, struct)]
            if len(good) == len(rows):
                raise  # not a row's fault
            if not self._refused[name]:
                print(f"trace writer: {name} rows its columns cannot hold are set aside "
                      f"(meta.json run.writer.refused): {first_line(e)[:200]}", file=sys.stderr, flush=True)
            self._refused[name] += len(rows) - len(good)
            rows[:] = good
            return self._table(name, rows)

    def _table(self, name: str, rows: list[tuple[Any, ...]]) -> pa.Table:
        schema = self.schemas[name]
        # One pass over the rows as a struct array, then its fields: 30% less CPU than
        # transposing with zip(*rows) and converting column by column (probes, memory),
        # and a row of the wrong length is refused all the same.
        arrays = pa.array(rows, type=pa.struct(list(schema))).flatten()
        if self.clock_offset_ns:
            shift = set(TIMESTAMPS.get(name, ()))
            off = pa.scalar(self.clock_offset_ns, pa.int64())
            arrays = [
                pc.if_else(pc.greater(a, 0), pc.subtract(a, off), a) if f.name in shift else a
                for a, f in zip(arrays, schema, strict=True)
            ]
        return pa.Table.from_arrays(arrays, schema=schema)
