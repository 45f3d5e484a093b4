"""Replicate a real trace to a target number of probe rows, for report scale tests.

Every table is copied K times with timestamps shifted by the trace's span and
steps shifted by its step count, so the result looks like one long run. Two
layouts, both committed through the store's own code (tracing/writer.py PartStore):

  uncompacted  what a long run leaves when nothing merges its flushes: one row group
               per table per flush window (the writer's FLUSH_INTERVAL_S) of the rows' own timestamps, in parts
               of about 1 M rows (`--flush-files`: one part file per flush window, the
               layout the writer of older versions left)
  compacted    that trace after `mstrace compact` (parts of up to ~1 M-row row groups)
  single       one part file per table, a row group per flush window: an older writer's
               trace adopted whole (`mstrace compact` must stream it: a part can be GBs)

    python bench/gen_big_trace.py SRC_TRACE OUT_TRACE --probe-rows 10000000 --layout uncompacted
    python bench/gen_big_trace.py SRC_TRACE OUT_TRACE --layout compacted   # = uncompacted, then compact
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracing.compaction import MAX_BYTES, MAX_ROWS, Targets
from tracing.manifest import Manifest, PartEntry
from tracing.reader import Trace
from tracing.schema import TABLES
from tracing.writer import FLUSH_INTERVAL_S, PartStore, parquet_options, write_json_atomic

FLUSH_S = FLUSH_INTERVAL_S  # the layout the writer leaves
BATCH_ROWS = 10_000_000  # probe rows built in memory at a time
# the column whose time decides which flush a row left in
FLUSH_TIME = {"probes": "ts_ns", "steps": "ts_ns", "requests": "finish_ns", "timeline": "ts_ns", "memory": "ts_ns",
              "collectives": "issue_ns"}


def shifted(t: pa.Table, dt: int, dstep: int, suffix: str | None, dseq: int = 0) -> pa.Table:
    cols = {}
    for name in t.column_names:
        c = t[name]
        if name.endswith("_ns") and pa.types.is_integer(c.type):
            # 0 means "never happened" in requests, -1 "not yet" in collectives: kept
            c = pc.if_else(pc.less_equal(c, 0), c, pc.add(c, dt)) if not name.startswith("dur_") else c
        elif name == "token_runs":  # [first_step, count, ...]: shift the steps, keep the counts
            arr = c.combine_chunks()
            flat = pc.list_flatten(arr).to_numpy().copy()
            flat[0::2] += dstep
            c = pa.ListArray.from_arrays(arr.offsets, pa.array(flat))
        elif name == "step":
            c = pc.if_else(pc.less(c, 0), c, pc.add(c, dstep))
        elif name == "seq":  # a collective's number in its group: copies go on numbering
            c = pc.add(c, dseq)
        elif name == "request_id" and suffix is not None:
            c = pc.binary_join_element_wise(c, pa.scalar(suffix), "")
        cols[name] = c
    return pa.table(cols, schema=t.schema)


class Source:
    """A trace to replicate: its tables, and the time and round span one copy shifts by."""

    def __init__(self, src: Path) -> None:
        tr = Trace.open(src)
        self.meta = tr.meta
        self.tables = {n: tr.table(n) for n in FLUSH_TIME if tr.has_table(n)}
        probes, steps = self.tables["probes"], self.tables["steps"]
        t0 = min(pc.min(probes["ts_ns"]).as_py(), pc.min(steps["ts_ns"]).as_py())
        t1 = max(pc.max(pc.add(probes["ts_ns"], probes["dur_ns"])).as_py(),
                 pc.max(pc.add(steps["ts_ns"], steps["dur_ns"])).as_py())
        self.span = t1 - t0 + 1000
        self.nstep = pc.max(steps["step"]).as_py() + 1
        colls = self.tables.get("collectives")
        self.nseq = pc.max(colls["seq"]).as_py() + 1 if colls is not None and colls.num_rows else 0
        firsts = (pc.min(pc.filter(t[FLUSH_TIME[n]], pc.greater(t[FLUSH_TIME[n]], 0))).as_py()
                  for n, t in self.tables.items())
        self.t_min = min(int(x) for x in firsts if x is not None)

    def copies(self, lo: int, hi: int) -> dict[str, pa.Table]:
        """Copies lo..hi-1 as one run's tables (copy i shifted by i spans and i rounds)."""
        return {name: pa.concat_tables([shifted(t, i * self.span, i * self.nstep, f"#{i}" if i else None, i * self.nseq)
                                        for i in range(lo, hi)])
                for name, t in self.tables.items()}


def write_uncompacted(out: Path, src: Source, k: int, files: bool, rows_per_group: int = 0,
                      single: bool = False, batch_rows: int = BATCH_ROWS) -> int:
    """K copies of `src`, one row group per table per flush window (`files`: one part file
    per flush window, as the writer of older versions left them). `rows_per_group`: instead,
    one row group per that many rows of every table (the replication the issue measured).
    `single`: one part per table, however large. Copies are built and written about
    `batch_rows` probe rows at a time and committed batch by batch, as a long run commits
    its flushes, so a 100 M-row trace never has to fit in memory. Returns the number of
    row groups (or part files) of probes."""
    for name in TABLES:
        (out / name).mkdir(parents=True)
    store = PartStore(out, Manifest(0), TABLES, Targets())
    per_batch = max(1, batch_rows // max(1, src.tables["probes"].num_rows))
    singles: dict[str, tuple[pq.ParquetWriter, str, Path, list[int]]] = {}
    groups = 0
    for lo in range(0, k, per_batch):
        tables = src.copies(lo, min(k, lo + per_batch))
        added: dict[str, list[PartEntry]] = {}
        for name, t in tables.items():
            if not t.num_rows:
                continue
            if rows_per_group:
                cuts = np.arange(rows_per_group, t.num_rows, rows_per_group)
            else:
                ts = t[FLUSH_TIME[name]].to_numpy()
                window = (np.maximum(ts - src.t_min, 0) // int(FLUSH_S * 1e9)).astype(np.int64)
                order = np.argsort(window, kind="stable")  # a flush keeps its producers' append order
                t, window = t.take(pa.array(order)), window[order]
                cuts = np.flatnonzero(np.diff(window)) + 1
            bounds = list(zip([0, *cuts.tolist()], [*cuts.tolist(), t.num_rows], strict=True))
            if name == "probes":
                groups += len(bounds)
            if single:
                if name not in singles:
                    file = store.manifest.new_name()
                    tmp = store.root / name / f".{file}.tmp"
                    singles[name] = (pq.ParquetWriter(tmp, t.schema, **parquet_options(t.schema)), file, tmp, [0, 0, 0])
                w, _, _, count = singles[name]
                for a, b in bounds:
                    w.write_table(t.slice(a, b - a).combine_chunks(), row_group_size=b - a)
                count[0] += t.num_rows
                count[1] += t.nbytes
                count[2] += len(bounds)
            elif files:
                added[name] = [store.write_part(name, t.slice(a, b - a)) for a, b in bounds]
            else:
                added[name] = _row_group_parts(store, name, t, bounds)
        if added:
            store.commit(added)
    for name, (w, file, tmp, (rows, nbytes, n)) in singles.items():
        w.close()
        tmp.rename(store.root / name / file)
        store.commit({name: [PartEntry(file, rows, nbytes, 0, n)]})
    return groups


def _row_group_parts(store: PartStore, name: str, t: pa.Table, bounds: list[tuple[int, int]]) -> list[PartEntry]:
    """Parts of up to MAX_ROWS rows and MAX_BYTES of Arrow memory (as the writer's
    merges bound them), each flush window its own row group."""
    entries: list[PartEntry] = []
    per_row = t.nbytes / max(t.num_rows, 1)
    i = 0
    while i < len(bounds):
        j, start = i, bounds[i][0]
        while j < len(bounds) and (bounds[j][1] - start <= MAX_ROWS
                                   and (bounds[j][1] - start) * per_row <= MAX_BYTES):
            j += 1
        j = max(j, i + 1)
        file = store.manifest.new_name()
        final = store.root / name / file
        tmp = final.with_name(f".{final.name}.tmp")
        with pq.ParquetWriter(tmp, t.schema, **parquet_options(t.schema)) as w:
            for a, b in bounds[i:j]:
                w.write_table(t.slice(a, b - a).combine_chunks(), row_group_size=b - a)
        tmp.rename(final)
        piece = t.slice(start, bounds[j - 1][1] - start)
        entries.append(PartEntry(file, piece.num_rows, piece.nbytes, 0, j - i))
        i = j
    return entries


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--probe-rows", type=int, default=10_000_000)
    ap.add_argument("--copies", type=int, default=0,
                    help="this many copies of SRC (instead of --probe-rows): two sources of one workload, "
                         "the same requests on both sides of a diff")
    ap.add_argument("--layout", choices=("uncompacted", "compacted", "single"), default="uncompacted")
    ap.add_argument("--rows-per-group", type=int, default=0,
                    help="uncompacted: one row group per this many rows of each table, not per flush")
    ap.add_argument("--flush-files", action="store_true",
                    help="uncompacted: one part file per flush (not one row group per flush)")
    ap.add_argument("--batch-rows", type=int, default=BATCH_ROWS,
                    help="build and commit the copies about this many probe rows at a time")
    a = ap.parse_args()
    src = Source(a.src)
    k = a.copies or max(1, math.ceil(a.probe_rows / src.tables["probes"].num_rows))
    if a.out.exists():
        shutil.rmtree(a.out)
    groups = write_uncompacted(a.out, src, k, a.flush_files, a.rows_per_group, a.layout == "single", a.batch_rows)
    write_json_atomic(a.out / "meta.json", {**src.meta, "store": "manifest-v1",
                                            "replicated": {"from": str(a.src), "copies": k}})
    what = "part files" if a.flush_files else "row groups"
    per = f"{a.rows_per_group} rows each" if a.rows_per_group else f"one per {FLUSH_S} s flush"
    print(f"{k} copies -> {k * src.tables['probes'].num_rows} probe rows, {groups} {what} in probes/ ({per}) "
          f"in {a.out}")
    if a.layout == "compacted":
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "viewer.cli", "compact", str(a.out)], check=True)
        print(f"mstrace compact: {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
