"""Cross-table references, checked as a trace is read.

The references the analyses follow:
  * requests.token_runs -> steps: every round a request's tokens came from has a
    steps row with a collect time (ITL is computed from those times); on a
    complete trace a broken one means the trace is corrupt: `TraceError`;
  * probes / timeline / memory .step -> steps: the round a row belongs to. Rounds
    with no work have no steps row, so this one is only used to clip.
On any other (killed, stalled, failed, interrupted) the rows of the round that
never finished, and anything naming a round that is not on disk, are clipped and
counted in `RunStatus.clipped`, so no analysis joins against rows that are not
there, and the unfinished round's waits (a stalled barrier of seconds) are not
charged to the last round that did finish.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracing.reader import Trace, TraceError

STEP_TABLES = ("probes", "timeline", "memory")


STEP_NEED = ["step", "collect_ns", "ts_ns", "dur_ns"]  # what the references and clipping read


def read_consistent(trace: Trace, want: dict[str, list[str] | None],
                    dictionary: dict[str, tuple[str, ...]] | None = None,
                    steps: pa.Table | None = None, uncombined: tuple[str, ...] = ()) -> dict[str, pa.Table]:
    """The wanted tables (name -> columns, None for all), references checked or clipped;
    `dictionary`: per table, string columns to read dictionary-encoded; `uncombined`: tables
    whose parts' rows stay as read (`Trace.table`'s coalesce=False: one copy fewer).

    `steps` is always read (what the references point at), unless given (as `read_steps`
    returns it); it is returned when wanted."""
    if steps is None:
        steps = read_steps(trace, want["steps"] if "steps" in want else STEP_NEED)
    last = int(pc.max(steps["step"]).as_py()) if steps.num_rows else None
    # when the last committed round handed off its tokens (`steps` without round times: no probes wanted)
    last_end = int(pc.max(pc.add(steps["ts_ns"], steps["dur_ns"])).as_py()) \
        if steps.num_rows and "probes" in want else None

    def one(name: str) -> pa.Table:
        cols = want[name]
        clip = name in STEP_TABLES and not trace.status.complete
        extra = ["step"] if clip and cols is not None and "step" not in cols else []
        t = trace.table(name, None if cols is None else [*cols, *extra], (dictionary or {}).get(name, ()),
                        coalesce=name not in uncombined)
        if clip:
            t = _clip_past(trace, name, t, last, last_end if name == "probes" else None)
        if name == "requests" and "token_runs" in t.column_names:
            t = _check_token_runs(trace, t, steps)
        return t.drop_columns(extra) if extra else t

    names = [n for n in want if n != "steps"]
    # side by side: most of the work is decoding and numpy, which release the GIL
    # (10 M probe rows: the requests table and its checks hide under the probes' read)
    with ThreadPoolExecutor(max_workers=max(len(names), 1)) as pool:
        out = dict(zip(names, pool.map(one, names), strict=True))
    if "steps" in want:
        out["steps"] = steps if want["steps"] is None else steps.select(want["steps"])
    return out


def read_steps(trace: Trace, columns: list[str] | None, references: bool = True) -> pa.Table:
    """The steps table with `columns` and (`references`) what the references need, its rounds
    checked unique."""
    need = STEP_NEED if references else []
    steps = trace.table("steps", None if columns is None else list(dict.fromkeys([*columns, *need])))
    _check_unique_steps(trace, steps)
    return steps


def probe_clip(trace: Trace, steps: pa.Table) -> Callable[[pa.Table], pa.Table] | None:
    """What `read_consistent` does to the probes of an unfinished run, for a table read in
    pieces (tracing/sweep.py): each piece, read with its `step` column, clipped as the whole
    would be and returned without it (None: a complete run)."""
    return step_clip(trace, "probes", steps, keep_step=False)


def step_clip(trace: Trace, name: str, steps: pa.Table,
              keep_step: bool = True) -> Callable[[pa.Table], pa.Table] | None:
    """`probe_clip` for any table of STEP_TABLES: `steps` needs `step` (and, for the
    probes, `ts_ns` and `dur_ns`); `keep_step`: the piece keeps its `step` column."""
    if trace.status.complete:
        return None
    last = int(pc.max(steps["step"]).as_py()) if steps.num_rows else None
    last_end = None
    if name == "probes" and steps.num_rows:
        last_end = int(pc.max(pc.add(steps["ts_ns"], steps["dur_ns"])).as_py())

    def clip(t: pa.Table) -> pa.Table:
        t = _clip_past(trace, name, t, last, last_end)
        return t if keep_step else t.drop_columns(["step"])
    return clip


def _check_unique_steps(trace: Trace, steps: pa.Table) -> None:
    s = steps["step"].to_numpy()
    if len(s) < 2 or bool(np.all(s[1:] > s[:-1])):  # the writer's order: one comparison per row
        return
    u, counts = np.unique(s, return_counts=True)
    if (counts > 1).any():
        raise TraceError(f"corrupt trace {trace.root}: steps has {int(counts[counts > 1][0])} rows for "
                         f"round {int(u[counts > 1][0])} (a duplicated part?)")


def _clip(trace: Trace, name: str, t: pa.Table, keep: pa.Array | np.ndarray) -> pa.Table:
    mask = keep if isinstance(keep, pa.Array) else pa.array(keep)
    n = t.num_rows - int(pc.sum(mask).as_py() or 0)
    if n:
        trace.status.clipped[name] = trace.status.clipped.get(name, 0) + n
        t = t.filter(mask)
    return t


def _clip_past(trace: Trace, name: str, t: pa.Table, last: int | None, last_end: int | None) -> pa.Table:
    """An unfinished run: rows of rounds after the last committed steps row, and
    (`last_end`, probes) rows that start after that round handed off: in overlap
    mode the next round waits on this round's launches under this round's number,
    so a round that never finished leaves rows that name the last committed one."""
    if not t.num_rows:
        return t
    keep = pc.less_equal(t["step"], 0) if last is None else pc.less_equal(t["step"], last)
    if last_end is not None and "ts_ns" in t.column_names:
        # (<=: the last round's own response_send row starts at its hand-off)
        keep = pc.and_(keep, pc.less_equal(t["ts_ns"], last_end))
    return _clip(trace, name, t, keep.combine_chunks() if isinstance(keep, pa.ChunkedArray) else keep)


def _check_token_runs(trace: Trace, req: pa.Table, steps: pa.Table) -> pa.Table:
    if not req.num_rows:
        return req
    st, col = steps["step"].to_numpy(), steps["collect_ns"].to_numpy()
    st = st[col > 0]
    # rounds outside the steps table's range (or a garbled count) are broken at once;
    # the rest are checked against a prefix count over that range only
    lo, hi = (int(st.min()), int(st.max()) + 1) if len(st) else (0, 0)
    have = np.zeros(hi - lo + 1, np.int8)
    have[st - lo] = 1
    cum: np.ndarray = np.zeros(hi - lo + 2, np.int32 if hi - lo < 2**31 else np.int64)
    np.cumsum(have, out=cum[1:])
    del have
    bad_rows: list[np.ndarray] = []
    first = 0
    for runs in req["token_runs"].chunks:  # a chunk at a time: no copy of the whole column
        flat = pc.list_flatten(runs).to_numpy()
        lens = pc.list_value_length(runs).fill_null(0).to_numpy()
        if len(flat) % 2 or (lens % 2).any():
            raise TraceError(f"corrupt requests/ table in {trace.root}: a token_runs list has an odd length")
        if len(flat):
            s0, cnt = flat[0::2], flat[1::2]
            inside = (cnt > 0) & (s0 >= lo) & (s0 + cnt <= hi)
            a = np.where(inside, s0 - lo, 0)
            b = np.where(inside, s0 + cnt - lo, 0)
            ok_run = inside & (cum[b] - cum[a] == cnt)
            if not bool(ok_run.all()):
                owner = np.repeat(np.arange(len(runs)), lens // 2)
                bad_rows.append(owner[~ok_run] + first)
        first += len(runs)
    if not bad_rows:
        return req
    bad = np.zeros(req.num_rows, bool)
    bad[np.concatenate(bad_rows)] = True
    if trace.status.complete:
        i = int(np.flatnonzero(bad)[0])
        rid = req["request_id"][i].as_py() if "request_id" in req.column_names else f"row {i}"
        raise TraceError(f"corrupt trace {trace.root}: request {rid} has tokens from rounds the steps "
                         "table does not have")
    return _clip(trace, "requests", req, ~bad)
