"""Each cycle's time, attributed twice: what the device did and what the scheduling thread did.

A cycle is one scheduling round, from its start to the next round's start, minus
the time the engine sat idle with no work (docs/report.md, "Two views").

Device view: every instant of the cycle is
  * device_compute: some stream computes (two streams at once count once), minus
    a rank's communication waits, which run on its device thread;
  * idle for a device-side reason: a communication wait (all_reduce, pp_bubble,
    batch_broadcast) or a deliberate prefill_stagger on the stream;
  * idle while the scheduling thread is inside a host probe: charged to the
    innermost such probe (kv_fence inside bookkeeping goes to kv_fence);
  * otherwise `unattributed`: no probe covers it.
Host view: every instant of the scheduling thread's cycle is inside one host probe
(the innermost again: the barrier, bookkeeping, batch_prepare, response_send,
kv_fence, defrag) or `unattributed`.

Each row of each view is a measured interval, so each view sums to the cycle only
if the probes neither overlap nor miss time: `unattributed` is what they miss,
and a negative row is an overlap that the report flags instead of hiding.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probes import boundaries as B
from viewer.analysis import native
from viewer.analysis.intervals import (
    Coverage,
    CycleSums,
    CycleTotals,
    blocks,
    subtract_unions,
    union,
)

UNATTRIBUTED = "unattributed"
# The scheduling thread's probes. OUTER ones follow each other; INNER ones run inside
# an outer one (a fence's query inside bookkeeping) and are charged first. (Rank 0's
# batch_broadcast is a comm-stream row: in the host view it stays in batch_prepare.)
HOST_OUTER = (B.SCHEDULER_BARRIER, B.BOOKKEEPING, B.BATCH_PREPARE, B.RESPONSE_SEND, B.DEFRAG)
HOST_INNER = (B.KV_FENCE,)
HOST_VIEW = (*HOST_OUTER, *HOST_INNER)
# Device-side reasons for the device to sit idle: they take precedence over whatever the
# host is doing meanwhile (rank 0's scheduler waits in the barrier during an all_reduce).
COMM_WAITS = (B.ALL_REDUCE, B.PP_BUBBLE, B.BATCH_BROADCAST)
# An imported trace's communication kernels and copies keep the device busy with work that
# is not compute: where compute runs beside them they are hidden, and compute stays busy.
DEVICE_REASONS = (*COMM_WAITS, B.PREFILL_STAGGER, B.DEVICE_COMM, B.DEVICE_COPY)
# Off the scheduling thread (tokenizer pool, sender, a stream's wait): raw time only.
CONCURRENT = (B.TOKENIZE, B.STREAM_WAIT, B.RESPONSE_DELIVER)
HOST_STREAM = "host"
# `window_views`' own rows when the window is the whole trace
EVERY_ROW = (np.iinfo(np.int64).min, np.iinfo(np.int64).max)
NO_RANK = np.iinfo(np.int64).min  # a null rank's stand-in: no rank's rows


def chunk_codes(col: pa.ChunkedArray | pa.Array) -> tuple[list[np.ndarray], list[str]]:
    """Each chunk's dictionary codes (int32, zero-copy where no row is null) over one list of
    names: grouping a probes column on its codes costs a fraction of a string per row."""
    if isinstance(col, pa.Array):
        col = pa.chunked_array([col])
    if not pa.types.is_dictionary(col.type):
        col = pa.chunked_array([col.combine_chunks().dictionary_encode()])
    elif col.num_chunks > 1:  # one dictionary for every chunk
        col = pa.table({"c": col}).unify_dictionaries()["c"]
    chunks = [c for c in col.chunks if len(c)]
    names = chunks[0].dictionary.to_pylist() if chunks else []
    # a null row's code is -1 (its index slot holds no value; read as is it would be a float NaN)
    return [(c.indices.fill_null(-1) if c.null_count else c.indices).to_numpy(zero_copy_only=False)
            for c in chunks], names


def codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[str]]:
    """`chunk_codes` as one int64 array."""
    parts, names = chunk_codes(col)
    return (np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)), names


def _in_time_order(ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by start, stably: one thread's rows already are (host and other rows of one
    boundary, or several ranks' rows, are not)."""
    if len(ts) > 1 and not bool(np.all(ts[1:] >= ts[:-1])):
        o = np.argsort(ts, kind="stable")
        ts, dur = ts[o], dur[o]
    return ts, dur


def _numpy_chunks(col: pa.ChunkedArray) -> list[np.ndarray]:
    return [c.to_numpy() for c in col.chunks if len(c)]


@dataclass(slots=True)
class Issued:
    """Collectives rows as arrays (a null rank is nobody's)."""

    rank: np.ndarray
    issue_ns: np.ndarray
    end_ns: np.ndarray

    @classmethod
    def of(cls, t: pa.Table) -> Issued:
        rank = t["rank"].cast(pa.int64())
        return cls(pc.fill_null(rank, NO_RANK).to_numpy() if rank.null_count else rank.to_numpy(),
                   t["issue_ns"].to_numpy(), t["end_ns"].to_numpy())

    @classmethod
    def join(cls, parts: list[Issued]) -> Issued:
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("rank", "issue_ns", "end_ns")))

    def take(self, m: np.ndarray) -> Issued:
        return Issued(self.rank[m], self.issue_ns[m], self.end_ns[m])

    def __len__(self) -> int:
        return len(self.issue_ns)


class ProbeColumns:
    """A table's probe rows as numpy chunks, decoded once for every rank's views: boundary
    codes over one list of names, times, host masks (None: every row is the scheduling
    thread's) and ranks (None: no rank column; a null rank never matches), chunk for chunk."""

    def __init__(self, probes: pa.Table) -> None:
        codes, self.names = chunk_codes(probes["boundary"]) if probes.num_rows else ([], [])
        ts, dur = _numpy_chunks(probes["ts_ns"]), _numpy_chunks(probes["dur_ns"])
        host: list[np.ndarray] | None = None
        if "stream" in probes.column_names and probes.num_rows:
            sc, sn = chunk_codes(probes["stream"])
            if any(s != HOST_STREAM for s in sn):
                h = sn.index(HOST_STREAM) if HOST_STREAM in sn else -1
                host = [c == h for c in sc]
        rank: list[np.ndarray] | None = None
        self.rank_range: tuple[int | None, int | None] = (None, None)
        if "rank" in probes.column_names and probes.num_rows:
            col = probes["rank"]
            lo_hi = pc.min_max(col).as_py()  # (nulls aside, as a one-rank trace's stream reads no rank)
            self.rank_range = (lo_hi["min"], lo_hi["max"])
            rank = [(c.cast(pa.int64()).fill_null(NO_RANK) if c.null_count else c).to_numpy().astype(np.int64, copy=False)
                    for c in col.chunks if len(c)]
        lengths = [len(t) for t in ts]
        if any(x is not None and [len(c) for c in x] != lengths for x in (codes, host, rank)):
            # a plain string column is encoded as one chunk (chunk_codes): the rows in one chunk each
            codes, ts, dur = ([np.concatenate(x)] for x in (codes, ts, dur))
            host = [np.concatenate(host)] if host is not None else None
            rank = [np.concatenate(rank)] if rank is not None else None
        self.codes, self.ts, self.dur, self.host, self.rank = codes, ts, dur, host, rank

    def filters(self, rank: int | None) -> bool:
        """Whether `rank`'s rows are some of the rows, not all of them."""
        return rank is not None and self.rank is not None and self.rank_range != (rank, rank)

    def rank0_idle(self) -> tuple[np.ndarray, np.ndarray]:
        """Rank 0's idle rows alone, in time order: a mask, not a split of all its rows."""
        if B.IDLE not in self.names or self.rank is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        code = self.names.index(B.IDLE)
        pick = [np.flatnonzero((c == code) & (r == 0)) for c, r in zip(self.codes, self.rank, strict=True)]
        ts = np.concatenate([t[i] for t, i in zip(self.ts, pick, strict=True)]).astype(np.int64, copy=False)
        dur = np.concatenate([d[i] for d, i in zip(self.dur, pick, strict=True)]).astype(np.int64, copy=False)
        return _in_time_order(ts, dur)


class _Rows:
    """One rank's probe rows, split by boundary (and host or not): in C, one counting
    sort of the rank's rows; in numpy (no C build), a mask and a gather of increasing
    indices per boundary and chunk on demand. Chunk by chunk either way, so the
    reader's chunks are never copied into one array, nor a TP window's rows into a
    table per rank."""

    def __init__(self, probes: pa.Table | ProbeColumns, rank: int | None = None) -> None:
        cols = probes if isinstance(probes, ProbeColumns) else ProbeColumns(probes)
        self.names, self.host = cols.names, cols.host
        ranks = cols.rank if cols.filters(rank) else None
        want = int(rank) if ranks is not None and rank is not None else 0
        self.split: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if native.AVAILABLE and cols.codes:
            self.split = native.split_by_key(cols.codes, cols.host, len(self.names), cols.ts, cols.dur, ranks, want)
        else:
            self.codes = [c.astype(np.uint8) for c in cols.codes] if len(self.names) < 256 else cols.codes
            self.ts, self.dur = cols.ts, cols.dur
            self.mine = [r == want for r in ranks] if ranks is not None else None

    def get(self, name: str, host_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.names:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        code = self.names.index(name)
        if self.split is not None:
            off, ts_all, dur_all = self.split
            lo, hi = (code, code + 1) if self.host is None else (2 * code, 2 * code + (1 if host_only else 2))
            ts, dur = ts_all[off[lo]:off[hi]], dur_all[off[lo]:off[hi]]
        else:
            ts, dur = self._gather(code, host_only)
        return _in_time_order(ts, dur)

    def _gather(self, code: int, host_only: bool) -> tuple[np.ndarray, np.ndarray]:
        ts_parts, dur_parts = [], []
        for k, codes in enumerate(self.codes):
            m = codes == code
            if host_only and self.host is not None:
                m &= self.host[k]
            if self.mine is not None:
                m &= self.mine[k]
            idx = np.flatnonzero(m)
            ts_parts.append(self.ts[k][idx])
            dur_parts.append(self.dur[k][idx])
        if len(ts_parts) == 1:
            return ts_parts[0], dur_parts[0]
        return np.concatenate(ts_parts), np.concatenate(dur_parts)


def per_cycle(probes: pa.Table, steps: pa.Table, rank: int | None = 0,
              collectives: pa.Table | None = None, totals: bool = False,
              chunk: int = 1, bounds: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Both views, per cycle (what `diff` resamples; `totals`: summed over the cycles, what
    `cost_table` shows, each array then one entry long: start_ns the first cycle's start,
    end_ns the last one's end, and `cycles` their count). `chunk` > 1: an entry per `chunk`
    consecutive cycles (the last may hold fewer), their sums, start_ns the first one's start,
    end_ns the last one's end, `cycles` how many, and `series:cycle_ns` still one entry per
    cycle (what `diff` picks its block length from): a long trace's runs of cycles, in a
    tenth of the memory and the searches (`bootstrap.cycle_chunk`).

    `rank` selects one rank's rows (None: all); `collectives` (any ranks) gives
    all_reduce its HTA raw/hidden times. Every array has one entry per cycle (per chunk with
    `chunk` > 1), in time order (float64 ns unless noted):
      start_ns, end_ns   cycle bounds (int64)
      cycle_ns           cycle length minus idle (no-work) time
      idle_ns            no-work time inside the cycle
      device_ns          device-busy time
      raw_ns:<b>         raw time of boundary b's rows, by the cycle a row starts in (rows
                         before the first / after the last cycle count to that cycle)
      hidden_ns:<b>      the part of raw_ns:<b> under device compute
      count:<b>          probe rows of b
      exposed_ns:<b>     device view: device-idle time charged to b (device_compute: busy
                         time; unattributed: what no row claims)
      host_ns:<b>        host view: the scheduling thread's own time in b, nested rows
                         taken out (unattributed: what no host row covers)
    Boundaries appear only when they have rows, except scheduler_barrier, device_compute
    and unattributed. Empty dict when there are no steps. `bounds`: the cycles' (start, end)
    in time order, where the steps are some rounds of a trace (a window's: `cycle_bounds`
    would run a cycle to the next round read, across a gap the window left out).
    """
    S, E = bounds if bounds is not None else cycle_bounds(steps)
    if not len(S):
        return {}
    return window_views(probes, S, E, rank, Issued.of(collectives) if collectives is not None else None, totals,
                        EVERY_ROW, chunk)


def cycle_bounds(steps: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Each cycle's start and end, in time order: a cycle ends where the next starts (the
    last where its round ends)."""
    S, D = steps["ts_ns"].to_numpy(), steps["dur_ns"].to_numpy()
    n = len(S)
    if n and not bool(np.all(S[1:] >= S[:-1])):  # one rank's rounds are written in order
        order = np.argsort(S, kind="stable")
        S, D = S[order], D[order]
    # one array for both (E is S shifted by one): a long trace's rounds are 107 MB each, and
    # neither holds on to the steps table's columns, so its caller may drop them
    bounds = np.empty(n + 1, dtype=np.int64)
    bounds[:n] = S
    if n:
        bounds[n] = S[-1] + D[-1]
    return bounds[:n], bounds[1:]


def _own(ts: np.ndarray, dur: np.ndarray, own: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The rows (in start order) that start inside `own`."""
    if own == EVERY_ROW:
        return ts, dur
    i, j = np.searchsorted(ts, own[0], "left"), np.searchsorted(ts, own[1], "left")
    return ts[i:j], dur[i:j]


def window_views(probes: pa.Table | ProbeColumns, S: np.ndarray, E: np.ndarray, rank: int | None,
                 collectives: Issued | None, totals: bool, own: tuple[int, int],
                 chunk: int = 1) -> dict[str, np.ndarray]:
    """`per_cycle` for the cycles S, E (a window of a trace's cycles, time-ordered), from
    the rows in `probes` that start inside `own`; the other rows only tell when the
    device was busy or blocked, and which outer row a nested one sits in. Summed over
    windows that partition the cycles, with `own` partitioning time (the first window's
    from INT64_MIN, the last's to INT64_MAX) and every row that overlaps a window's own
    rows present in it, the totals equal the whole trace's exactly (integer-valued
    float sums): viewer/analysis/cycle_stream.py reads a trace of any length that way
    (`chunk` > 1: windows of whole chunks, the trace's last one excepted)."""
    n = len(S)
    first, end = int(S[0]), int(E[-1])
    chunked = chunk > 1 and not totals
    heads = np.arange(0, n, chunk) if chunked else np.zeros(0, np.int64)  # each entry's first cycle
    # each entry's start and end
    S1, E1 = (S[heads], E[np.minimum(heads + chunk, n) - 1]) if chunked else (S, E)
    bins: CycleSums | CycleTotals = CycleTotals(S) if totals else CycleSums(S1)

    cols = probes if isinstance(probes, ProbeColumns) else ProbeColumns(probes)
    rows = _Rows(cols, rank)
    dev_ts, dev_dur = rows.get(B.DEVICE_COMPUTE)
    reasons = {b: rows.get(b) for b in DEVICE_REASONS}
    ws = np.concatenate([reasons[b][0] for b in COMM_WAITS])
    we = ws + np.concatenate([reasons[b][1] for b in COMM_WAITS])
    dev_s, dev_e = union(dev_ts, dev_ts + dev_dur) if len(ws) else (dev_ts, dev_ts + dev_dur)
    busy = Coverage(*(subtract_unions(dev_s, dev_e, *union(ws, we)) if len(ws) and len(dev_s) else (dev_s, dev_e)))
    rs = np.concatenate([r[0] for r in reasons.values()])
    re = rs + np.concatenate([r[1] for r in reasons.values()])
    # What keeps the device from being idle on the host's account: its own work or a device-side
    # reason. The waits are reasons, so (device less waits) with the reasons is the device rows
    # with the reasons: a TP rank's rows, not the ten times as many pieces the waits cut them into.
    # (A bad trace's negative durations make a union depend on the order of tied starts: those
    # keep the pieces.)
    pos = dev_e > dev_s
    blocked = busy if not len(rs) else (
        Coverage(np.concatenate([dev_s[pos], rs]), np.concatenate([dev_e[pos], re]))
        if len(ws) and bool(np.all(re >= rs)) and bool(np.all(dev_dur >= 0))
        else Coverage(np.concatenate([busy.s, rs]), np.concatenate([busy.e, re])))

    # cycles are rank 0's, and so is the no-work time taken out of them
    idle_ts, idle_dur = cols.rank0_idle() if cols.filters(rank) and rank != 0 else rows.get(B.IDLE)
    keep = (idle_ts >= first) & (idle_ts < end)
    series = np.zeros(0)  # each cycle's length, when an entry holds several
    if chunked:
        each = CycleSums(S)
        idle_each = each.zeros()  # (idle rows are few: their searches cost nothing)
        each.add(idle_each, each.cycle_of(idle_ts[keep]), idle_dur[keep])
        series = (E - S).astype(np.float64) - idle_each
        idle_per = np.add.reduceat(idle_each, heads)
    else:
        idle_per = bins.zeros()
        bins.add(idle_per, bins.cycle_of(idle_ts[keep]), idle_dur[keep])
    if totals:
        cycle_len = float(end - first) - idle_per
        dev_per = busy.covered(np.array([first]), np.array([end])).astype(np.float64)
    else:
        cycle_len = (E1 - S1).astype(np.float64) - idle_per
        dev_per = np.concatenate([busy.covered(S1[b], E1[b]) for b in blocks(len(S1))]).astype(np.float64)
    out: dict[str, np.ndarray] = {"start_ns": S, "end_ns": E, "cycle_ns": cycle_len, "idle_ns": idle_per,
                                  "device_ns": dev_per}
    if totals:
        out.update(start_ns=S[:1].copy(), end_ns=E[-1:].copy(), cycles=np.array([float(n)]))
    elif chunked:
        out.update(start_ns=S1, end_ns=E1, cycles=np.diff(np.append(heads, n)).astype(np.float64))
        out["series:cycle_ns"] = series

    def attribute(job: tuple[str, str]) -> dict[str, np.ndarray]:
        name, kind = job
        a_all, d_all = _own(*(reasons[name] if kind == "reason" else rows.get(name, host_only=kind == "host")), own)
        if not len(a_all) and name != B.SCHEDULER_BARRIER:
            return {}
        raw, hid, cnt = bins.zeros(), bins.zeros(), bins.zeros()
        exposed = bins.zeros() if kind != "concurrent" else None
        outside = bins.zeros()  # raw time of rows outside the cycles (clipped into the edge cycles)
        for blk in blocks(len(a_all)):
            a, d = a_all[blk], d_all[blk]
            b = a + d
            lo, hi = int(a.min()), int(b.max())
            h = busy.covered(a, b, lo, hi)
            ci = bins.cycle_of(a)
            # integer-valued float sums are exact: these add up to the trace totals
            bins.add(raw, ci, d)
            bins.add(hid, ci, h)
            bins.add(cnt, ci)
            if exposed is None:
                continue
            idle = d - (h if blocked is busy or kind == "reason" else blocked.covered(a, b, lo, hi))
            if lo >= first and int(a.max()) < end:
                bins.add(exposed, ci, idle)
            else:  # each view must partition the cycles: rows outside them do not count
                inside = (a >= first) & (a < end)
                bins.add(exposed, ci[inside], idle[inside])
                bins.add(outside, ci[~inside], d[~inside])
        res = {f"raw_ns:{name}": raw, f"hidden_ns:{name}": hid, f"count:{name}": cnt}
        if exposed is not None:
            res[f"exposed_ns:{name}"] = exposed
        if kind == "host":
            res[f"host_ns:{name}"] = raw - outside
        return res

    jobs = [(b, "host") for b in HOST_VIEW] + [(b, "reason") for b in DEVICE_REASONS] + \
        [(b, "concurrent") for b in CONCURRENT]
    # Boundaries are independent and numpy's searches and ufuncs release the GIL:
    # two threads use both cores on a long trace.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for res in pool.map(attribute, jobs):
            out.update(res)
    _take_out_nested(out, rows, blocked, bins, first, end)
    if collectives is not None and len(collectives):
        _collective_times(out, collectives, rank, busy, bins, own)
    out[f"raw_ns:{B.DEVICE_COMPUTE}"] = dev_per
    out[f"exposed_ns:{B.DEVICE_COMPUTE}"] = dev_per
    dev_count = bins.zeros()
    dev_own = _own(dev_ts, dev_dur, own)[0]
    for blk in blocks(len(dev_own)):
        bins.add(dev_count, bins.cycle_of(dev_own[blk]))
    out[f"count:{B.DEVICE_COMPUTE}"] = dev_count
    for view in ("exposed_ns", "host_ns"):
        claimed = sum((v for k, v in out.items() if k.startswith(f"{view}:")), bins.zeros())
        out[f"{view}:{UNATTRIBUTED}"] = cycle_len - claimed
    return out


def _take_out_nested(out: dict[str, np.ndarray], rows: _Rows, blocked: Coverage, bins: CycleSums | CycleTotals,
                     first: int, end: int) -> None:
    """Charge nested time to the innermost probe: an inner row's time inside an outer
    row comes off the outer row, in both views. Inner rows are few (a fence query per
    finished request), so each is looked up in every outer boundary's rows."""
    inner = [rows.get(b, host_only=True) for b in HOST_INNER if f"host_ns:{b}" in out]
    if not inner:
        return
    a_in = np.concatenate([x[0] for x in inner])
    b_in = a_in + np.concatenate([x[1] for x in inner])
    for outer in HOST_OUTER:
        if f"host_ns:{outer}" not in out:
            continue
        s, d = rows.get(outer, host_only=True)
        if not len(s):
            continue
        k = np.searchsorted(s, a_in, side="right") - 1
        kc = np.maximum(k, 0)
        lo, hi = a_in, np.minimum(b_in, s[kc] + d[kc])
        m = (k >= 0) & (hi > lo) & (lo >= first) & (lo < end)
        if not m.any():
            continue
        lo, hi = lo[m], hi[m]
        ci = bins.cycle_of(lo)
        both = bins.zeros()
        bins.add(both, ci, hi - lo)
        out[f"host_ns:{outer}"] -= both
        idle = bins.zeros()
        bins.add(idle, ci, (hi - lo) - blocked.covered(lo, hi))
        out[f"exposed_ns:{outer}"] -= idle  # only the device-idle part moves in the device view


def _collective_times(out: dict[str, np.ndarray], colls: Issued, rank: int | None, cov: Coverage,
                      bins: CycleSums | CycleTotals, own: tuple[int, int]) -> None:
    """all_reduce's raw, hidden and count from the collectives table (HTA's comm/compute overlap):
    raw = issue -> completion of each completed collective, hidden = the part of it during which
    the rank's device computed. The exposed share stays the host waits' (the probe rows)."""
    issue, end = colls.issue_ns, colls.end_ns
    done = (end >= issue) & (issue >= own[0]) & (issue < own[1])  # in flight at the end (end -1): no duration
    if rank is not None:
        done &= colls.rank == rank
    issue, end = issue[done], end[done]
    if not len(issue):
        return
    b = B.ALL_REDUCE
    raw, hid, cnt = bins.zeros(), bins.zeros(), bins.zeros()
    for blk in blocks(len(issue)):
        ci = bins.cycle_of(issue[blk])
        bins.add(raw, ci, end[blk] - issue[blk])
        bins.add(hid, ci, cov.covered(issue[blk], end[blk]))
        bins.add(cnt, ci)
    out[f"raw_ns:{b}"], out[f"hidden_ns:{b}"], out[f"count:{b}"] = raw, hid, cnt
