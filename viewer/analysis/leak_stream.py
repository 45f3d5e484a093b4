"""The leak replay a window of memory events at a time, so memory does not grow with the trace.

Why: the vectorised replay (leak_replay.py) holds about 120 bytes per event at its peak,
and a long day of a busy server writes hundreds of millions of memory events.

How: the events are cut into windows in replay order (ts_ns, then file order), each cut
where the timestamp changes, so the rows of one snapshot (one ts_ns) stay in one window.
Each window is replayed as a whole table would be, after synthetic rows that rebuild the
state the earlier windows left: for every held block, an `alloc` by its first holder and
a `ref` for each further reference, holders in the order the exact replay added them (its
messages print holder dicts). Their ref_count is null, so no check reads them, and they
are not counted as events. What a window leaves held is the next one's carry. Anomalies,
reclaimed blocks and fragmentation points are each window's, in time order; capacity must
be known before the first window (fragmentation's matrix is capacity wide).

A trace's windows come from its row groups in order of their earliest timestamp
(tracing/sweep.py): after the groups read so far, every row earlier than the next
group's earliest is final; later ones wait for the next window. The next window is read
on a second thread while one is replayed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracing.reader import Trace
from tracing.sweep import NEVER, Sweep
from viewer.analysis import leak_fragmentation as frag
from viewer.analysis import leak_replay as replay
from viewer.analysis.leak_fragmentation import FragPoint

WINDOW_ROWS = 1 << 21  # events a window replays: about 250 MB of temporaries at the replay's peak
COLUMNS = ["ts_ns", "step", "kind", "block_id", "request_id", "ref_count"]
_POS = "__pos"  # a row's place in the table as a whole read gives it: the order of equal timestamps


# ------------------------------------------------------------ one window
def replay_state(memory: pa.Table) -> tuple[replay.Rows, frag.Snaps, replay.Blocks]:
    with ThreadPoolExecutor(1) as pool:
        # Hashing the request id strings is the costliest step; Arrow does it without the GIL,
        # so it runs beside the block sort, which does not need them.
        rids = pool.submit(replay.codes, memory["request_id"], replay.rid_luts)
        rows = replay.read_rows(memory)
        sn = frag.snapshots(rows)
        b = replay.blocks(rows, rids)
    replay.own_counts(b, rows)
    return rows, sn, b


def window_reclaimed(rows: replay.Rows) -> dict[str, list[int | None]]:
    """Request id -> the blocks reclaimed from it, ascending (a null id last)."""
    p = np.flatnonzero(rows.kind == replay.RECLAIM)
    o = np.lexsort((rows.bid[p], rows.rid[p]))
    codes = rows.rid[p][o]
    ids: list[int | None] = [None if x == replay.NOBID else x for x in rows.bid[p][o].tolist()]
    at = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]]) if len(p) else p
    cuts = np.r_[at, len(p)].tolist()
    return {n: ids[a:z] for n, a, z in zip(rows.rids(codes[at]), cuts[:-1], cuts[1:], strict=True)}


def _synthetic(carry: dict[Any, dict[str, int]], schema: pa.Schema, ts: int) -> pa.Table:
    """State rows that rebuild `carry` from an empty block table, as `schema`'s columns."""
    kinds: list[str] = []
    bids: list[Any] = []
    rids: list[str] = []
    for bid, holders in carry.items():
        for i, (rid, n) in enumerate(holders.items()):
            kinds += ["ref"] * n
            if i == 0:
                kinds[-n] = "alloc"
            bids += [bid] * n
            rids += [rid] * n
    k = len(kinds)
    plain = {"ts_ns": pa.array([ts] * k, pa.int64()), "kind": pa.array(kinds, pa.string()),
             "block_id": pa.array(bids, pa.int64()), "request_id": pa.array(rids, pa.string())}
    cols = [plain[f.name].cast(f.type) if f.name in plain else pa.nulls(k, f.type) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


@dataclass(slots=True)
class WindowedReplay:
    """The replay's findings so far; `feed` each window in replay order."""

    capacity: int
    carry: dict[Any, dict[str, int]] = field(default_factory=dict)  # block -> {request: references}
    events: int = 0
    anomalies: list[str] = field(default_factory=list)
    num_anomalies: int = 0
    reclaimed: dict[str, list[int | None]] = field(default_factory=dict)
    fragmentation: list[FragPoint] = field(default_factory=list)

    def feed(self, window: pa.Table) -> None:
        if not window.num_rows:
            return
        synth = _synthetic(self.carry, window.schema, pc.min(window["ts_ns"]).as_py()) if self.carry else None
        memory = pa.concat_tables([synth, window]) if synth is not None else window
        rows, sn, b = replay_state(memory)
        ranks = replay.suspect(b)
        dirty = replay.replay_dirty(rows, b, ranks)
        clean = np.ones(len(b.ub), bool)
        clean[ranks] = False
        found, n = replay.anomalies(rows, dirty)
        self.anomalies += found[: replay.MAX_ANOMALIES - len(self.anomalies)]
        self.num_anomalies += n
        self.carry = replay.final_counts(rows, b, clean, dirty)
        for rid, ids in window_reclaimed(rows).items():
            self.reclaimed.setdefault(rid, []).extend(ids)
        wide = len(b.ta) and max(b.ta.max(), -b.ta.min()) >= 1 << 14  # a count int16 cells could not hold
        held = frag.Held(b.spos, b.sbid, b.skind, np.int32 if wide else np.int16,
                         [None if x == replay.NOBID else x for x in b.ub[ranks].tolist()], dirty.flips)
        self.events += len(b.idx) - (synth.num_rows if synth is not None else 0)
        del rows, b  # the block-order arrays: fragmentation's matrix needs the room
        self.fragmentation += frag.fragmentation(sn, held, self.capacity)

    def holders(self) -> dict[Any, list[str]]:
        """Block -> the request ids holding it after the last window."""
        return {bid: list(h) for bid, h in self.carry.items()}

    def reclaimed_sorted(self) -> dict[str, list[int | None]]:
        out: dict[str, list[int | None]] = {}
        for rid in sorted(self.reclaimed):
            ids = self.reclaimed[rid]
            if len(ids) > 1 and None in ids:
                # A null id has no order among others; the event loop's sorted() fails there: so must we.
                raise replay.Unordered(f"reclaimed blocks of {rid!r}: a null block id cannot be ordered among others")
            out[rid] = sorted(ids, key=lambda x: -1 if x is None else x)
        return out


# ------------------------------------------------------------ windows of a table in memory
def table_windows(memory: pa.Table, rows: int = WINDOW_ROWS) -> Iterator[pa.Table]:
    """`memory` in replay order, cut where the timestamp changes, about `rows` rows a piece."""
    if memory.num_rows <= rows:
        yield memory  # the replay orders one window itself (a lone null timestamp included)
        return
    if memory["ts_ns"].null_count:
        raise replay.Unordered("memory.ts_ns has nulls: no replay order")
    ts = memory["ts_ns"].to_numpy()
    if not (ts[1:] >= ts[:-1]).all():
        order = np.argsort(ts, kind="stable")  # equal timestamps keep file order: emission order
        memory, ts = memory.take(pa.array(order)), ts[order]
    for a, z in _cuts(ts, rows):
        yield memory.slice(a, z - a)


def _cuts(ts: np.ndarray, rows: int) -> list[tuple[int, int]]:
    at = [0]
    while at[-1] + rows < len(ts):
        c = int(np.searchsorted(ts, ts[at[-1] + rows], "left"))
        if c <= at[-1]:  # a run of one timestamp longer than a window: it stays whole
            c = int(np.searchsorted(ts, ts[at[-1] + rows], "right"))
        if c >= len(ts):
            break
        at.append(c)
    return list(zip(at, [*at[1:], len(ts)], strict=True))


# ------------------------------------------------------------ windows of a trace on disk
def trace_windows(trace: Trace, clip: Callable[[pa.Table], pa.Table] | None,
                  rows: int = WINDOW_ROWS) -> Iterator[pa.Table]:
    """The trace's memory events in replay order, about `rows` a window; `clip` as
    tracing/consistency.py's `step_clip` gives it. Raises tracing.sweep.Vanished."""
    sw = Sweep(trace, "memory", COLUMNS, clip=clip, dictionary=("request_id",), position=_POS)
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(sw.read_next, rows)
        waiting: list[pa.Table] = []
        while True:
            got = ahead.result()
            t = sw.next_first()
            if t != NEVER:
                ahead = pool.submit(sw.read_next, rows)
            yield from _final(waiting, got, t, sw.rows)
            if t == NEVER:
                return


def _final(waiting: list[pa.Table], got: list[pa.Table], t: int, total: int) -> Iterator[pa.Table]:
    """The rows of `waiting` and `got` that start before `t` (every later group starts at
    `t` or after), in replay order; the rest stay in `waiting`."""
    parts = [x for x in (*waiting, *got) if x.num_rows]
    waiting.clear()
    if not parts:
        return
    tab = pa.concat_tables(parts)
    if tab["ts_ns"].null_count and total > 1:
        raise replay.Unordered("memory.ts_ns has nulls: no replay order")
    ts, pos = tab["ts_ns"].to_numpy(), tab[_POS].to_numpy()
    if t != NEVER:
        now = ts < t
        if not now.all():
            waiting.append(tab.filter(pa.array(~now)))
            tab, ts, pos = tab.filter(pa.array(now)), ts[now], pos[now]
    if len(ts) > 1 and not ((ts[1:] > ts[:-1]) | ((ts[1:] == ts[:-1]) & (pos[1:] > pos[:-1]))).all():
        tab = tab.take(pa.array(np.lexsort((pos, ts))))
    if tab.num_rows:
        yield tab.drop_columns([_POS])
