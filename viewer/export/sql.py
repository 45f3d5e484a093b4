"""`mstrace sql TRACE "SELECT ..."`: a trace's tables in DuckDB, read-only.

Every table of the trace is a view (read through tracing/reader.py, so a part from an
older version reads with its added columns' defaults and a corrupt one is one error
line), plus helper views built by the report's own analyses:

  cycles           one row per scheduling cycle (rank 0): its step, bounds, length
                   without idle time, the device's busy time
  cycle_cost       one row per cycle and boundary: what the device view charges to it
                   (`exposed_ns`), the host view's time in it (`host_ns`), its raw time,
                   hidden time and row count (viewer/analysis/cycle_views.py)
  request_latency  one row per request: TTFT, E2E, queueing, ITL p50 and max, in ms

So `SUM(exposed_ns) / (SELECT SUM(cycle_ns) FROM cycles)` per boundary is the
report's device-view share, to the last digit.

Read-only: a statement that is not a SELECT is refused before it runs, and the
database has no file system access once the views exist (DuckDB's
`enable_external_access`, locked), so no query can write to the trace or anywhere
else, nor read files the trace does not name. Only the tables a query names are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracing.consistency import read_consistent
from tracing.reader import Trace, TraceError
from tracing.run_status import first_line
from tracing.schema import TABLES

HELPERS: dict[str, tuple[str, ...]] = {  # helper view -> the tables it is built from
    "cycles": ("probes", "steps", "collectives"),
    "cycle_cost": ("probes", "steps", "collectives"),
    "request_latency": ("requests",),
}

REQUEST_LATENCY = """
CREATE VIEW request_latency AS
SELECT request_id, prompt_len, output_len, cached_prefix_len, finish_reason, num_preemptions,
       arrival_ns, finish_ns,
       CASE WHEN first_token_ns > 0 THEN (first_token_ns - arrival_ns) / 1e6 END AS ttft_ms,
       CASE WHEN first_token_ns > 0 THEN (finish_ns - arrival_ns) / 1e6 END AS e2e_ms,
       CASE WHEN admitted_ns > 0 THEN (admitted_ns - arrival_ns) / 1e6 END AS queue_ms,
       list_median(dur_itl_ns) / 1e6 AS itl_p50_ms,
       list_max(dur_itl_ns) / 1e6 AS itl_max_ms,
       CASE WHEN delivered_ns > 0 AND first_token_ns > 0 THEN (delivered_ns - arrival_ns) / 1e6 END
           AS delivered_e2e_ms
FROM requests
"""


class SqlError(ValueError):
    """A query that cannot run: one line for the user."""


@dataclass(slots=True)
class Result:
    columns: list[str]
    types: list[str]
    rows: list[tuple[Any, ...]]


class TraceDb:
    """A DuckDB connection over one trace, built for one query at a time."""

    def __init__(self, root: str | Path) -> None:
        self.trace = Trace.open(root)
        self.tables = [t for t in TABLES if self.trace.has_table(t)]
        self.views = [*self.tables, *(h for h, need in HELPERS.items() if need[0] in self.tables
                                      and (len(need) < 2 or need[1] in self.tables))]

    def query(self, sql: str) -> Result:
        import duckdb

        _only_select(sql)
        named = self._named(sql)
        # a query that names no view (SHOW TABLES, SELECT 1) still sees them all, empty: no
        # table is read for it
        con = self._connect(named) if named else self._connect(set(self.views), empty=True)
        try:
            rel = con.sql(sql)
            if rel is None:
                return Result([], [], [])
            return Result(list(rel.columns), [str(t) for t in rel.types], rel.fetchall())
        except duckdb.Error as e:
            raise SqlError(first_line(e)) from None
        finally:
            con.close()

    def describe(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """Every view and its columns (name, type), without reading a row of the trace."""
        con = self._connect(set(self.views), empty=True)
        try:
            return [(v, [(r[0], r[1]) for r in con.sql(f"DESCRIBE {v}").fetchall()]) for v in self.views]
        finally:
            con.close()

    # ---- building the connection ---------------------------------------------------
    def _named(self, sql: str) -> set[str]:
        """The views a query names (a word match: at worst one table more is read)."""
        words = {w.lower() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", sql)}
        return {v for v in self.views if v in words}

    def _connect(self, views: set[str], empty: bool = False) -> Any:
        import duckdb

        need = {t for v in views for t in HELPERS.get(v, (v,)) if t in self.tables}
        if empty:
            data = {t: TABLES[t].empty_table() for t in need}
        else:
            try:
                data = read_consistent(self.trace, {t: None for t in need})
            except TraceError as e:
                raise SqlError(str(e)) from None
        con = duckdb.connect(":memory:")
        frames = dict(data)
        if views & {"cycles", "cycle_cost"}:
            frames["cycles"], frames["cycle_cost"] = cycle_tables(data["probes"], data["steps"], data.get("collectives"))
        for name, table in frames.items():
            # a view over the registered Arrow table: catalog entries, so SHOW TABLES lists them
            con.register(f"__arrow_{name}", table)
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM __arrow_{name}")
        if "request_latency" in views:
            con.execute(REQUEST_LATENCY)
        # from here on no statement reaches the file system, and the setting cannot be undone
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return con


def _only_select(sql: str) -> None:
    import duckdb

    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as e:
        raise SqlError(first_line(e)) from None
    if not statements:
        raise SqlError("no statement given")
    if len(statements) > 1:
        raise SqlError(f"one statement at a time ({len(statements)} given)")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        # the statement's own first word (INSTALL, COPY, ...): DuckDB files several under one type
        word = (re.findall(r"[A-Za-z]+", statements[0].query) or [kind.name])[0].upper()
        raise SqlError(f"the trace is read-only: only SELECT statements run ({word} refused)")


def cycle_tables(probes: pa.Table, steps: pa.Table, collectives: pa.Table | None) -> tuple[pa.Table, pa.Table]:
    """`cycles` and `cycle_cost` from the report's per-cycle views (rank 0's cycles)."""
    from viewer.analysis.cycle_views import per_cycle

    pcy = per_cycle(probes, steps, 0, collectives) if steps.num_rows else {}
    step = steps["step"].to_numpy()
    ts = steps["ts_ns"].to_numpy()
    step = step[np.argsort(ts, kind="stable")]  # per_cycle's cycles run in time order
    n = len(pcy.get("start_ns", ()))
    idx = np.arange(n, dtype=np.int64)
    cycles = pa.table({
        "cycle": idx, "step": step[:n].astype(np.int64),
        "start_ns": pa.array(np.asarray(pcy.get("start_ns", []), dtype=np.int64)),
        "end_ns": pa.array(np.asarray(pcy.get("end_ns", []), dtype=np.int64)),
        "cycle_ns": pa.array(np.asarray(pcy.get("cycle_ns", []), dtype=np.float64)),
        "idle_ns": pa.array(np.asarray(pcy.get("idle_ns", []), dtype=np.float64)),
        "device_busy_ns": pa.array(np.asarray(pcy.get("device_ns", []), dtype=np.float64)),
    })
    names = sorted({k.split(":", 1)[1] for k in pcy if ":" in k})
    cols: dict[str, list[pa.Array]] = {c: [] for c in ("cycle", "step", "boundary", "exposed_ns", "host_ns",
                                                       "raw_ns", "hidden_ns", "count")}
    for b in names:
        cols["cycle"].append(pa.array(idx))
        cols["step"].append(pa.array(step[:n].astype(np.int64)))
        cols["boundary"].append(pa.array([b] * n, pa.string()))
        for col, key, typ in (("exposed_ns", "exposed_ns", pa.float64()), ("host_ns", "host_ns", pa.float64()),
                              ("raw_ns", "raw_ns", pa.float64()), ("hidden_ns", "hidden_ns", pa.float64()),
                              ("count", "count", pa.int64())):
            v = pcy.get(f"{key}:{b}")
            # a boundary outside a view is NULL there, not 0: "not in this view" is not "no time"
            cols[col].append(pa.nulls(n, typ) if v is None else pa.array(np.asarray(v).astype(typ.to_pandas_dtype())))
    schema = pa.schema([("cycle", pa.int64()), ("step", pa.int64()), ("boundary", pa.string()),
                        ("exposed_ns", pa.float64()), ("host_ns", pa.float64()), ("raw_ns", pa.float64()),
                        ("hidden_ns", pa.float64()), ("count", pa.int64())])
    cost = pa.table({c: pa.concat_arrays(v) if v else pa.array([], schema.field(c).type) for c, v in cols.items()},
                    schema=schema)
    return cycles, cost



def render(result: Result, fmt: str, out: Any) -> None:
    """Print a result as a rich table, CSV or JSON (a list of one object per row)."""
    if fmt == "json":
        import json

        print(json.dumps([dict(zip(result.columns, r, strict=True)) for r in result.rows], default=str), file=out)
    elif fmt == "csv":
        import csv

        w = csv.writer(out)
        w.writerow(result.columns)
        w.writerows(result.rows)
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(*result.columns, show_lines=False)
        for r in result.rows:
            t.add_row(*("" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v) for v in r))
        # into a pipe or a file, as wide as the values: never cut to 80 columns ("scheduler_bar…")
        tty = getattr(out, "isatty", lambda: False)()
        Console(file=out, width=None if tty else 100_000).print(t)
        print(f"{len(result.rows)} rows", file=out)
