"""The part of a trace an export shows: `--rounds A-B`, `--time START-END`, `--request ID` or
`--worst N`, each turned into time spans on the trace's clock.

A windowed table is read row group by row group: a group whose timestamps (the Parquet
statistics the writer stores for every group) cannot reach a span is never read, so a
window costs time in proportion to the window and the number of groups, not to the rows
of the trace. Rows are kept when their interval overlaps a span for some time (a slice that
starts before the window and ends inside it is kept whole, as Perfetto would draw it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tracing.reader import Trace, TraceError, read_parts, read_row_groups
from tracing.run_status import first_line
from tracing.schema import TABLES
from tracing.sweep import Vanished, start_over

# Each table's row interval: (its start column, the column that ends it or None for an
# instant, whether that column is a duration rather than an end time).
INTERVAL: dict[str, tuple[str, str | None, bool]] = {
    "probes": ("ts_ns", "dur_ns", True),
    "steps": ("ts_ns", "dur_ns", True),
    "timeline": ("ts_ns", None, False),
    "requests": ("arrival_ns", "finish_ns", False),
    "memory": ("ts_ns", None, False),
    "collectives": ("issue_ns", "end_ns", False),  # (end_ns -1: never completed, as 0 is for a request)
}
WORST_NEIGHBOURS = 1  # rounds kept on each side of a worst round


@dataclass(frozen=True, slots=True)
class Window:
    spans: tuple[tuple[int, int], ...]  # disjoint, sorted, inclusive [lo, hi] ns
    what: str  # what the output says it shows
    request: str | None = None  # --request: the only request on the requests track
    holds_first_round: bool = False  # it reaches the start of the run's first round
    holds_last_round: bool = False  # it reaches the end of the run's last round
    rounds_end: int | None = None  # that end: no cycle runs past it (`window_cycles`)

    def mask(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Rows that overlap a span for some time (a row that only touches one, ending where it
        starts, does not: the round before a `--rounds` window often ends at the nanosecond
        the window's first round starts); an instant (start == end) inside one or on its edge."""
        lo = np.array([s[0] for s in self.spans], dtype=np.int64)
        hi = np.array([s[1] for s in self.spans], dtype=np.int64)
        point = start >= end
        # the first span ending after the row's start (at or after it, for an instant)
        k = np.where(point, np.searchsorted(hi, start, side="left"), np.searchsorted(hi, start, side="right"))
        first = lo[np.minimum(k, len(lo) - 1)]
        return (k < len(hi)) & np.where(point, first <= start, first < end)

    def reaches(self, lo: int, hi: int) -> bool:
        return bool(self.mask(np.array([lo], np.int64), np.array([hi], np.int64))[0])


def parse_window(trace: Trace, rounds: str | None = None, time: str | None = None, request: str | None = None,
                 worst: int | None = None) -> Window | None:
    """The window the flags ask for (at most one of them), or None for the whole trace;
    TraceError with one line for a window the trace does not have."""
    steps = _steps(trace)
    w = _window(trace, steps, rounds, time, request, worst)
    if w is None or not len(steps["end"]):
        return w
    first, last = int(steps["ts"].min()), int(steps["end"].max())
    return replace(w, holds_first_round=w.reaches(first, first), holds_last_round=w.reaches(last, last),
                   rounds_end=last)


def first_of_last(step: np.ndarray, n: int) -> int:
    """The first round of the last `n` rows (round numbers, each once: the n-th largest)."""
    k = max(len(step) - n, 0)
    return int(np.partition(step, k)[k])


def last_rounds(steps: pa.Table, n: int) -> tuple[str, Window] | None:
    """`--rounds A-B` of the last `n` rounds of `steps` (a trace's whole steps table: step,
    ts_ns, dur_ns) and the window parse_window makes of it, from those rows alone; None where
    the table holds no more. By rows, not numbers: an idle engine's rounds take numbers and
    write no row (a served run idle for minutes skips thousands)."""
    if steps.num_rows <= n:
        return None
    first = first_of_last(steps["step"].to_numpy(), n)
    tail = _step_arrays(steps.filter(pc.greater_equal(steps["step"], first)))
    last = int(tail["step"].max())
    # (each of these rounds' cycle ends with a later one's start: all in the tail)
    w = Window(((int(tail["ts"].min()), int(tail["cycle_end"].max())),), f"rounds {first}-{last}",
               holds_first_round=False, holds_last_round=True, rounds_end=int(tail["end"].max()))
    return f"{first}-{last}", w


def with_run_edges(w: Window) -> Window:
    """The window, reaching back to the trace's beginning where it holds the run's first round
    and on past its end where it holds the last: a round's rows before its start or after its
    end (the first round's intake, the last one's response_send) belong to it."""
    lo, hi = w.spans[0][0], w.spans[-1][1]
    lo, hi = (0 if w.holds_first_round else lo), (np.iinfo(np.int64).max if w.holds_last_round else hi)
    return replace(w, spans=((lo, w.spans[0][1]), *w.spans[1:-1], (w.spans[-1][0], hi)) if len(w.spans) > 1
                   else ((lo, hi),))


def _window(trace: Trace, steps: dict[str, np.ndarray], rounds: str | None, time: str | None, request: str | None,
            worst: int | None) -> Window | None:
    given = [f for f, v in (("--rounds", rounds), ("--time", time), ("--request", request), ("--worst", worst))
             if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise TraceError(f"give one window, not {' and '.join(given)}")
    if rounds is not None:
        a, b = _range(rounds, "--rounds", int)
        sel = (steps["step"] >= a) & (steps["step"] <= b)
        if not sel.any():
            raise TraceError(f"--rounds {rounds}: the trace has rounds {_span_of(steps['step'])}")
        spans = [(int(steps["ts"][sel].min()), int(steps["cycle_end"][sel].max()))]
        have = steps["step"][sel]  # what the trace holds of A-B (a window past its ends says so)
        return Window(tuple(spans), f"rounds {int(have.min())}-{int(have.max())}")
    if time is not None:
        s, e = _range(time, "--time", float)
        t0 = _run_start(trace, steps)
        return Window((_whole_rounds(steps, t0 + round(s * 1e9), t0 + round(e * 1e9)),),
                      f"t = {s:g}-{e:g} s from the run's start, its rounds whole")
    if request is not None:
        q = trace.table("requests", ["request_id", "arrival_ns", "finish_ns"]) if trace.has_table("requests") \
            else TABLES["requests"].empty_table()
        hit = q.filter(pc.equal(q["request_id"], request))
        if not hit.num_rows:
            raise TraceError(f"--request {request}: no such request in {trace.root}")
        a, f = int(hit["arrival_ns"][0].as_py()), int(hit["finish_ns"][0].as_py())
        end = f if f > 0 else int(steps["end"].max()) if len(steps["end"]) else a
        return Window((_whole_rounds(steps, a, max(a, end)),), f"request {request}, its rounds whole",
                      request=request)
    assert worst is not None
    if worst < 1:
        raise TraceError(f"--worst must be >= 1, got {worst}")
    if not len(steps["step"]):
        raise TraceError(f"--worst {worst}: the trace has no rounds")
    dur = steps["end"] - steps["ts"]
    top = np.argsort(-dur, kind="stable")[:worst]
    order = np.argsort(steps["step"], kind="stable")
    pos = np.searchsorted(steps["step"][order], steps["step"][top])
    near = np.unique(np.clip(np.concatenate([pos + d for d in range(-WORST_NEIGHBOURS, WORST_NEIGHBOURS + 1)]),
                             0, len(order) - 1))
    idx = order[near]
    spans = _merged(sorted(zip(steps["ts"][idx].tolist(), steps["cycle_end"][idx].tolist(), strict=True)))
    return Window(tuple(spans), f"the {len(top)} slowest rounds, each with {WORST_NEIGHBOURS} round(s) on "
                                f"either side ({len(spans)} span(s))")


def windowed(trace: Trace, name: str, columns: list[str], window: Window, vanish: bool = False) -> Iterator[pa.Table]:
    """The table's rows in the window, part by part, reading only the row groups that can
    reach it (by their statistics). A part a live compaction removed meanwhile: Vanished with
    `vanish` (for `start_over`, which reads a newer snapshot), else a one-line TraceError (an
    export that wrote some of its rows already cannot start over)."""
    start, other, is_dur = INTERVAL[name]
    cols = list(dict.fromkeys([*columns, start, *([other] if other else [])]))
    for part in trace.parts.get(name, []):
        try:
            pf = pq.ParquetFile(part.path)
            n = pf.metadata.num_row_groups
            if part.rows is not None and pf.metadata.num_rows != part.rows:  # (the left-out counts rely on it)
                raise _Corrupt(f"{part.path.name} holds {pf.metadata.num_rows} rows, the manifest committed "
                               f"{part.rows}")
            lo, hi = _group_reach(pf.metadata, start, other, is_dur)
            # (a group that only touches a span may hold an instant on its edge)
            groups = np.flatnonzero(window.mask(lo, hi) | window.mask(lo, lo) | window.mask(hi, hi)).tolist()
            if not groups:
                continue
            t = read_parts([part], TABLES[name], cols) if len(groups) == n else \
                read_row_groups(part, TABLES[name], cols, groups)
        except FileNotFoundError:
            if vanish:
                raise Vanished(part.path.name) from None
            raise TraceError(f"{name}/ part {part.path.name} was removed while it was read (a compaction of the "
                             f"trace, which is still being written): run the command again") from None
        # garbage in a footer surfaces as any of these (as tracing/reader.py's reads catch them)
        except (_Corrupt, pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            raise TraceError(f"corrupt {name}/ table in {trace.root}: {first_line(e)}") from None
        a = t[start].to_numpy().astype(np.int64)
        if other is None:
            z = a
        elif is_dur:
            z = a + np.maximum(t[other].to_numpy().astype(np.int64), 0)
        else:  # an end; 0 means not yet (a request still running when the trace ends)
            z = t[other].to_numpy().astype(np.int64)
            z = np.where(z > 0, np.maximum(z, a), np.iinfo(np.int64).max)
        keep = window.mask(a, z)
        if keep.any():
            yield t.select(columns).filter(pa.array(keep))


class _Corrupt(Exception):
    pass


def window_cycles(steps: pa.Table, window: Window) -> tuple[np.ndarray, np.ndarray]:
    """The cycles of a window's rounds (`steps`, in time order): each ends where the next round
    read starts, or where its span ends (the window's spans end at a cycle's end) when that
    round lies in another span or there is none; the run's last round where it ends (a
    `--time` window past the run's end reaches further: the whole trace's last cycle does not)."""
    S = steps["ts_ns"].to_numpy().astype(np.int64)
    lo = np.array([a for a, _ in window.spans], np.int64)
    hi = np.array([b for _, b in window.spans], np.int64)
    if window.rounds_end is not None:
        hi = np.minimum(hi, max(window.rounds_end, int(S.max()) if len(S) else 0))
    cap = hi[np.clip(np.searchsorted(lo, S, side="right") - 1, 0, len(hi) - 1)]
    return S, np.minimum(np.append(S[1:], np.iinfo(np.int64).max), cap)


def table_in(trace: Trace, name: str, columns: list[str], window: Window | None) -> pa.Table:
    """The table's columns, whole (no window) or only the rows in the window."""
    if not trace.has_table(name):
        return TABLES[name].empty_table().select(columns)
    if window is None:
        return trace.table(name, columns)
    got = start_over(trace, name, lambda: list(windowed(trace, name, columns, window, vanish=True)))
    return pa.concat_tables(got).unify_dictionaries() if got else TABLES[name].empty_table().select(columns)


def _group_reach(md: pq.FileMetaData, start: str, other: str | None, is_dur: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per row group, the earliest start and the latest end its rows can have, from the
    statistics (a group without them reaches everything: it is read and filtered)."""
    names = [md.schema.column(i).path for i in range(md.num_columns)]
    si = names.index(start)
    oi = names.index(other) if other in names else None
    big = np.iinfo(np.int64).max
    lo, hi = np.zeros(md.num_row_groups, np.int64), np.full(md.num_row_groups, big, np.int64)
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        s = rg.column(si).statistics
        if s is None or not s.has_min_max:
            continue
        lo[g] = s.min
        o = rg.column(oi).statistics if oi is not None else None
        if other is None:
            hi[g] = s.max
        elif o is not None and o.has_min_max:
            hi[g] = s.max + max(o.max, 0) if is_dur else (big if o.min <= 0 else max(s.max, o.max))
    return lo, hi


def _whole_rounds(steps: dict[str, np.ndarray], lo: int, hi: int) -> tuple[int, int]:
    """[lo, hi] widened to the cycles that share some time with it, whole: a round cut at the
    window's edge would keep only its rows inside (`view` would show that round's full length
    beside a part of its costs). A window inside one cycle is that cycle."""
    ts, end = steps["ts"], steps["cycle_end"]
    sel = (ts < hi) & (end > lo) if lo < hi else (ts <= lo) & (end >= lo)
    if not sel.any():
        return lo, hi
    return min(lo, int(ts[sel].min())), max(hi, int(end[sel].max()))


def _steps(trace: Trace) -> dict[str, np.ndarray]:
    """The rounds in time order: step, ts, end (ts + dur) and cycle_end, where the next round
    starts (the last: its end). A window takes rounds by their cycles (cycle_views.py's
    `cycle_bounds`): a round's response_send and the gap before the next round come after its
    end, and a window that stopped there would leave them out of its last round's costs."""
    return _step_arrays(trace.table("steps", ["step", "ts_ns", "dur_ns"]) if trace.has_table("steps") else
                        TABLES["steps"].empty_table().select(["step", "ts_ns", "dur_ns"]))


def _step_arrays(t: pa.Table) -> dict[str, np.ndarray]:
    ts = t["ts_ns"].to_numpy().astype(np.int64)
    order = np.argsort(ts, kind="stable")
    ts = ts[order]
    end = ts + np.maximum(t["dur_ns"].to_numpy().astype(np.int64)[order], 0)
    cycle_end = np.maximum(np.append(ts[1:], end[-1:]), end) if len(ts) else end
    return {"step": t["step"].to_numpy().astype(np.int64)[order], "ts": ts, "end": end, "cycle_end": cycle_end}


def _run_start(trace: Trace, steps: dict[str, np.ndarray]) -> int:
    run = trace.meta.get("run") if isinstance(trace.meta.get("run"), dict) else {}
    start = run.get("start_ns") if isinstance(run, dict) else None
    if isinstance(start, int) and start > 0:
        return start
    if len(steps["ts"]):
        return int(steps["ts"].min())
    raise TraceError(f"--time: {trace.root} records no run start and no rounds")


def _range(text: str, flag: str, kind: type[int] | type[float]) -> tuple[float, float]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = kind(lo), kind(hi)
    except ValueError:
        a = b = math.nan
    if not sep or not (math.isfinite(a) and math.isfinite(b)) or a < 0 or b < a:
        raise TraceError(f"{flag} wants START-END with 0 <= START <= END, got {text!r}")
    return a, b


def _span_of(x: np.ndarray) -> str:
    return f"{int(x.min())}-{int(x.max())}" if len(x) else "none"


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
