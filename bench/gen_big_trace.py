"""Replicate a real trace to a target number of probe rows, for report scale tests.

Every table is copied K times with timestamps shifted by the trace's span and
steps shifted by its step count, so the result looks like one long run.

    python bench/gen_big_trace.py SRC_TRACE OUT_TRACE --probe-rows 10000000
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from tracing.reader import read_meta, read_table
from tracing.writer import write_parquet_atomic


def shifted(t: pa.Table, dt: int, dstep: int, suffix: str | None) -> pa.Table:
    cols = {}
    for name in t.column_names:
        c = t[name]
        if name.endswith("_ns") and pa.types.is_integer(c.type):
            # 0 means "never happened" in requests; keep it 0
            c = pc.if_else(pc.equal(c, 0), c, pc.add(c, dt)) if name != "dur_ns" and not name.startswith("dur_") else c
        elif name == "token_runs":  # [first_step, count, ...]: shift the steps, keep the counts
            arr = c.combine_chunks()
            flat = pc.list_flatten(arr).to_numpy().copy()
            flat[0::2] += dstep
            c = pa.ListArray.from_arrays(arr.offsets, pa.array(flat))
        elif name == "step":
            c = pc.if_else(pc.less(c, 0), c, pc.add(c, dstep))
        elif name == "request_id" and suffix is not None:
            c = pc.binary_join_element_wise(c, pa.scalar(suffix), "")
        cols[name] = c
    return pa.table(cols, schema=t.schema)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--probe-rows", type=int, default=10_000_000)
    a = ap.parse_args()
    meta = read_meta(a.src)
    tables = {n: read_table(a.src, n) for n in ("probes", "steps", "requests", "timeline", "memory")}
    probes = tables["probes"]
    k = max(1, math.ceil(a.probe_rows / probes.num_rows))
    steps = tables["steps"]
    t0 = min(pc.min(probes["ts_ns"]).as_py(), pc.min(steps["ts_ns"]).as_py())
    t1 = max(pc.max(pc.add(probes["ts_ns"], probes["dur_ns"])).as_py(),
             pc.max(pc.add(steps["ts_ns"], steps["dur_ns"])).as_py())
    span = t1 - t0 + 1000
    nstep = pc.max(steps["step"]).as_py() + 1
    if a.out.exists():
        shutil.rmtree(a.out)
    a.out.mkdir(parents=True)
    for name, t in tables.items():
        (a.out / name).mkdir()
        # group copies into parts of roughly 1M rows, like a long run's flushes would
        per_part = max(1, 1_000_000 // max(t.num_rows, 1))
        for start in range(0, k, per_part):
            copies = [shifted(t, i * span, i * nstep, f"#{i}" if i else None)
                      for i in range(start, min(k, start + per_part))]
            write_parquet_atomic(pa.concat_tables(copies), a.out / name / f"part-{start // per_part:06d}.parquet")
    meta["replicated"] = {"from": str(a.src), "copies": k}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2))
    print(f"{k} copies -> {k * probes.num_rows} probe rows in {a.out}")


if __name__ == "__main__":
    main()
