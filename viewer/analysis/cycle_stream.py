"""Both views of every cycle, from a trace of any length in bounded memory.

The probe rows are read a window of cycles at a time (tracing/sweep.py: row groups in
order of their earliest start). A window attributes the rows that start inside it
(`cycle_views.window_views`) and holds besides them every earlier row that is still
open at its start (a device row that runs into it, the outer row a nested one sits
in) and every later row that starts before its own rows end (the device work those
rows overlap). What it keeps for the next window is what is still open at its end.
So memory grows with a window (WINDOW_ROWS rows, a TP trace's WINDOW_ROWS / ranks) and
with the longest row, not with the trace; the sums equal the whole-trace computation exactly (tests/test_cycle_stream.py).
A TP run's `collectives` rows (about one for every two probe rows) are read beside them,
in order of their issue: a window takes those issued inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probes import boundaries as B
from tracing.consistency import probe_clip
from tracing.reader import Trace
from tracing.schema import TABLES
from tracing.sweep import EARLIEST, NEVER, Sweep, start_over
from viewer.analysis.collectives import (
    FOLD_COLUMNS,
    MAX_RANK_SPAN,
    StragglerFold,
    StragglerView,
    trace_members,
)
from viewer.analysis.cycle_views import (
    Issued,
    ProbeColumns,
    chunk_codes,
    cycle_bounds,
    window_views,
)

FOLD_ROWS = 1 << 18  # collectives rows the straggler join takes at a time
# Probe rows a window reads: about 60 MB of columns and as much again in their split by boundary.
WINDOW_ROWS = 1 << 21


@dataclass(slots=True)
class Cycles:
    """What the stream needs of the steps table: rank 0's cycles, by which it cuts the probe
    rows, and the clip of an unfinished run's rows. Taken before the stream, so that its caller
    may drop the table's round times (two columns of 107 MB on a long trace) meanwhile."""

    start_ns: np.ndarray
    end_ns: np.ndarray
    clip: Callable[[pa.Table], pa.Table] | None

    @classmethod
    def of(cls, trace: Trace, steps: pa.Table) -> Cycles:
        return cls(*cycle_bounds(steps), probe_clip(trace, steps))


@dataclass(slots=True)
class CycleViews:
    """Per rank, `per_cycle`'s arrays (summed to one entry with `totals`)."""

    by_rank: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)  # the ranks with probe rows
    head: pa.Table | None = None  # the trace's first probe rows, in time order of their row groups
    rows: int = 0  # probe rows read (clipped rows not counted)
    # (collectives rows, `straggler_view`), joined as the stream read them; None: not read
    stragglers: tuple[int, StragglerView | None] | None = None


def stream_views(trace: Trace, cycles: Cycles, totals: bool = True, window_rows: int = WINDOW_ROWS,
                 head_rows: int = 0, chunk: int = 1) -> CycleViews:
    """Every rank's views of rank 0's cycles, the probe rows (and a TP run's collectives) read
    a window at a time; `head_rows`: that many of the first rows kept (`CycleViews.head`);
    `chunk`: per_cycle's."""
    return start_over(trace, "probes", lambda: _stream(trace, cycles, totals, window_rows, head_rows, chunk))


class _Issued:
    """The collectives table read in order of issue: `read(t)` (on the reading thread) reads
    the row groups that can hold a row issued before t, and `until(t, read)` gives every row
    issued before t that an earlier call did not (None for a trace without the table). What
    is read is also joined into the straggler view there, so the table is read once and the
    join runs beside the windows' views, not after them."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.sweep = (Sweep(trace, "collectives", [*FOLD_COLUMNS, "end_ns"], time="issue_ns",
                            dictionary=("group",))
                      if trace.has_table("collectives") else None)
        self.fold: StragglerFold | None = None
        self.later: Issued | None = None  # read, issued after the last `until`

    def read(self, t: int | None) -> list[Issued]:
        if self.sweep is None or not self.sweep.rows:
            return []
        if self.fold is None:
            self.fold = StragglerFold(trace_members(self.trace))
        got = [x for x in self.sweep.read_until(t) if x.num_rows]
        for x in got:  # (in slices: the join's temporaries are a few times its rows, beside a window's views)
            at = 0
            while at < x.num_rows:
                # each add sorts the carry again: a slice at least as long keeps a growing carry
                # (a member that stopped issuing) linear, not quadratic, in the table
                step = max(FOLD_ROWS, self.fold.carried())
                self.fold.add(x.slice(at, step))
                at += step
        return [Issued.of(x) for x in got]

    def until(self, t: int | None, read: list[Issued]) -> Issued | None:
        got = ([self.later] if self.later is not None else []) + read
        if not got:
            return None
        rows = Issued.join(got) if len(got) > 1 else got[0]
        if t is None:
            self.later = None
            return rows
        before = rows.issue_ns < t
        self.later = rows.take(~before)
        return rows.take(before)

    def stragglers(self) -> tuple[int, StragglerView | None]:
        """After the last `read(None)`: what `trace_stragglers` gives."""
        if self.sweep is None:
            return 0, None
        return self.sweep.rows, self.fold.view() if self.fold is not None else None


def _stream(trace: Trace, cycles: Cycles, totals: bool, window_rows: int, head_rows: int,
            chunk: int) -> CycleViews:
    S, E, clip = cycles.start_ns, cycles.end_ns, cycles.clip
    n = len(S)
    columns = ["ts_ns", "dur_ns", "boundary", "stream", "rank"]
    sweep = Sweep(trace, "probes", columns, clip=clip, dictionary=("boundary", "stream"), ranges=("rank",))
    ranks = _ranks(trace, sweep)
    if len(ranks) <= 1:  # one rank: its column is read for nothing
        columns.remove("rank")
    sweep.columns = [*columns, "step"] if clip is not None else columns
    out = CycleViews(ranks=ranks)
    if not n:
        out.rows = sum(t.num_rows for t in sweep.read_until(None))
        return out
    parts: dict[int, list[dict[str, np.ndarray]]] = {r: [] for r in (ranks or [0])}
    chunk = 1 if totals else chunk
    # A TP trace's window is cut by its ranks: each rank's views copy its rows out of the
    # window, and with a window of the whole size tp100m's report peaked at 2.08 GB (1.89 GB cut,
    # in the same time; BENCHMARKS.md, "A TP trace's collectives, a window at a time").
    cuts = _plan(S, sweep, window_rows // max(1, len(ranks)), chunk)
    owns = [(int(S[i0]) if i0 else EARLIEST, int(S[i1]) if i1 < n else NEVER) for i0, i1 in cuts]
    buf: pa.Table | None = None
    issued = _Issued(trace)
    def read(t: int | None) -> tuple[list[pa.Table], list[Issued]]:
        return sweep.read_until(t), issued.read(t)
    # The next window's rows are read (mostly decoding, which releases the GIL) while this one's are attributed.
    with ThreadPoolExecutor(max_workers=1) as pool:
        ahead = pool.submit(read, _until(owns[0]))
        for w, ((i0, i1), own) in enumerate(zip(cuts, owns, strict=True)):
            got, colls_read = ahead.result()
            reach = _reach(got, buf, own)
            if reach > own[1]:  # its rows end later: the device rows they overlap
                got += sweep.read_until(reach)
            if w + 1 < len(cuts):
                ahead = pool.submit(read, _until(owns[w + 1]))
            buf = _concat(buf, got, columns)
            out.rows += sum(t.num_rows for t in got)
            if out.head is None:
                out.head = buf.slice(0, head_rows).combine_chunks()
            colls = issued.until(_until(own), colls_read)
            cols = ProbeColumns(buf)  # (decoded once for every rank's views)
            for r in parts:
                parts[r].append(window_views(cols, S[i0:i1], E[i0:i1], r if ranks else None, colls, totals, own,
                                             chunk))
            del cols, colls, colls_read
            if i1 < n:  # what is still open at the next window's start
                ts, dur = buf["ts_ns"], buf["dur_ns"]
                buf = buf.filter(pc.or_(pc.greater_equal(ts, own[1]), pc.greater(pc.add(ts, dur), own[1])))
            del got
            # Read on the other thread, freed on this one: Arrow's pool keeps such memory until
            # asked. glibc's arenas are not trimmed too: on tp100m that gave back the numpy arrays
            # the next window makes again, 0.6 M more page faults and about 1 s, to save 0.1 GB.
            pa.default_memory_pool().release_unused()
    del buf
    out.stragglers = issued.stragglers()  # (after the last window: its rows are freed)
    sizes = [-(-(i1 - i0) // chunk) for i0, i1 in cuts]
    out.by_rank = {r: _join(p, sizes, totals, S, E) for r, p in parts.items()}
    return out


def _plan(S: np.ndarray, sweep: Sweep, window_rows: int, chunk: int = 1) -> list[tuple[int, int]]:
    """Windows of cycles [i0, i1), each ending at the last cycle start before the row group
    that would take it past `window_rows` rows (at least one cycle each), or at the chunk's
    start that holds it (at least one chunk each)."""
    starts = np.fromiter((g.first_ns for g in sweep.groups), np.int64, len(sweep.groups))
    cum = np.cumsum([g.rows for g in sweep.groups])
    n, i0, target = len(S), 0, window_rows
    cuts: list[tuple[int, int]] = []
    while i0 < n:
        k = int(np.searchsorted(cum, target, "left")) + 1
        i1 = n if k >= len(starts) else int(np.searchsorted(S, starts[k], "right")) - 1
        i1 = min(n, max(i0 + chunk, i1 - i1 % chunk))
        cuts.append((i0, i1))
        if i1 < n:  # the rows before the next window's start, and a window's worth more
            before = int(np.searchsorted(starts, S[i1], "left"))
            target = (int(cum[before - 1]) if before else 0) + window_rows
        i0 = i1
    return cuts


def _until(own: tuple[int, int]) -> int | None:
    return None if own[1] == NEVER else own[1]


def _ranks(trace: Trace, sweep: Sweep) -> list[int]:
    """The ranks with probe rows, from the row groups' statistics (`Sweep.values_in`; a
    compacted trace's groups mix ranks, and reading its whole column took 1.5 s of a 100 M-row
    TP report); the column where they cannot say."""
    found = sweep.values_in(sweep.groups, 0, MAX_RANK_SPAN)
    if found is None:  # no statistics, or a bad trace's ranks
        return sorted(r for r in pc.unique(trace.table("probes", ["rank"])["rank"]).to_pylist() if r is not None)
    return sorted(found)


def _reach(got: list[pa.Table], buf: pa.Table | None, own: tuple[int, int]) -> int:
    """Where the window's own rows end: the latest end of a row starting inside `own` (an idle
    row only counts where it starts: it needs no device rows)."""
    reach = own[1]
    for t in [*([buf] if buf is not None else []), *got]:
        if not t.num_rows:
            continue
        ts = t["ts_ns"].to_numpy()
        end = ts + t["dur_ns"].to_numpy()
        past = np.flatnonzero(end > reach)  # few: the rows still open at the window's end
        if not len(past):
            continue
        m = (ts[past] >= own[0]) & (ts[past] < own[1])
        codes, names = chunk_codes(t["boundary"])
        if B.IDLE in names:
            m &= np.concatenate(codes)[past] != names.index(B.IDLE)
        if m.any():
            reach = max(reach, int(end[past][m].max()))
    return reach


def _concat(buf: pa.Table | None, got: list[pa.Table], columns: list[str]) -> pa.Table:
    tables = [t.select(columns) for t in ([buf] if buf is not None else []) + got]
    if not tables:
        return TABLES["probes"].empty_table().select(columns)
    # one chunk: a read's columns need not be chunked alike, and `_Rows` pairs their chunks
    return pa.concat_tables(tables).unify_dictionaries().combine_chunks()


def _join(windows: list[dict[str, np.ndarray]], sizes: list[int], totals: bool,
          S: np.ndarray, E: np.ndarray) -> dict[str, np.ndarray]:
    """The windows' views as one trace's: totals summed, per-cycle (or per-chunk) arrays end
    to end (a boundary with no rows in a window is zero in its entries)."""
    keys = list(dict.fromkeys(k for w in windows for k in w if k not in ("start_ns", "end_ns")))
    out: dict[str, np.ndarray]
    if totals:
        out = {"start_ns": S[:1].copy(), "end_ns": E[-1:].copy()}
    elif "cycles" in windows[0]:  # entries of several cycles each: their own bounds
        out = {k: np.concatenate([w[k] for w in windows]) for k in ("start_ns", "end_ns")}
    else:
        out = {"start_ns": S, "end_ns": E}
    for k in keys:
        if totals:
            out[k] = np.array([sum(float(w[k][0]) for w in windows if k in w)])
        else:
            out[k] = np.concatenate([w[k] if k in w else np.zeros(m) for w, m in zip(windows, sizes, strict=True)])
    return out
