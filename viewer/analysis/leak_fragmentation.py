"""Fragmentation over time, at each periodic snapshot of the `memory` table.

How: every state row adds its +1 / -1 to its block at all later snapshots, a
scatter into a (snapshot x block) count matrix in time order and then a running
sum; the blocks replayed exactly get their columns from that replay instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from viewer.analysis.leak_replay import BEGIN, DELTA, NOREF, SNAP, Rows, lookup

CHUNK_CELLS = 1 << 24  # fragmentation matrix cells at a time (2 bytes each)


@dataclass(slots=True)
class FragPoint:
    ts_ns: int
    step: int
    free_blocks: int  # block ids held by nobody, per the snapshot and the replay
    free_reported: int | None  # the engine's own free count (snapshot_begin.ref_count)
    free_ratio: float
    largest_free_run: int  # longest run of contiguous free block ids
    frag_index: float  # 1 - largest_free_run / free_blocks; 0 with no free blocks


def point(ts_ns: int, step: int, free: int, run: int, capacity: int, free_reported: int | None) -> FragPoint:
    return FragPoint(ts_ns, step, free, free_reported, free / capacity if capacity else 0.0, run,
                     1.0 - run / free if free else 0.0)


# ------------------------------------------------------------ snapshots
@dataclass(slots=True)
class Snaps:
    """Snapshot rows grouped by ts_ns (the replay's snapshot key), in time order."""

    ts: list[int]
    step: list[Any]  # of each group's first row
    reported: list[int | None]  # ref_count of its last snapshot_begin
    at: np.ndarray  # replay position of its last snapshot_begin (else of its first row)
    begun: np.ndarray  # has a snapshot_begin: else the replay's held blocks are not counted
    lgroup: np.ndarray  # group and block of each `snapshot` row: listed as held
    lbid: np.ndarray


def snapshots(rows: Rows) -> Snaps:
    sp = np.flatnonzero((rows.kind == BEGIN) | (rows.kind == SNAP))
    ts = rows.ts[sp]
    first = np.flatnonzero(np.r_[True, ts[1:] != ts[:-1]]) if len(sp) else sp
    bi = np.flatnonzero(rows.kind[sp] == BEGIN)
    bg = np.searchsorted(first, bi, "right") - 1  # group of each begin
    nlisted = np.diff(np.r_[first, len(sp)]) - np.bincount(bg, minlength=len(first))
    keep = np.r_[bg[1:] != bg[:-1], True] if len(bi) else bi.astype(bool)  # the last begin counts
    bi, bg = sp[bi[keep]], bg[keep]
    at, begun = sp[first], np.zeros(len(first), bool)
    at[bg], begun[bg] = bi, True
    reported: list[int | None] = [None] * len(first)
    for g, x in zip(bg.tolist(), rows.ref[bi].tolist(), strict=True):
        reported[g] = None if x == NOREF else x
    return Snaps(ts[first].tolist(), rows.column("step", sp[first]), reported, at, begun,
                 np.repeat(np.arange(len(first), dtype=np.int32), nlisted), rows.bid[rows.kind == SNAP])


# ------------------------------------------------------------ fragmentation
@dataclass(slots=True)
class Held:
    """What fragmentation needs of the replay: state rows in replay order, and the exact flips
    of the blocks that were replayed row by row."""

    spos: np.ndarray
    bid: np.ndarray
    kind: np.ndarray
    cell: type  # dtype wide enough for any block's count
    redo: list[Any]  # block ids of the dirty blocks
    flips: list[tuple[int, Any, int]]


def fragmentation(sn: Snaps, h: Held, capacity: int) -> list[FragPoint]:
    n = len(sn.ts)
    # Every state row adds its +1 / -1 to its block at the snapshots after it. Rows come in time
    # order, so the writes walk the (snapshot, block) matrix forwards; the sum per cell is the
    # block's total count there (exact for clean blocks: those of dirty ones are redone from flips).
    before = np.searchsorted(h.spos, sn.at.astype(h.spos.dtype))  # state rows before each snapshot
    g = np.repeat(np.arange(n + 1, dtype=np.int32), np.diff(np.r_[0, before, len(h.spos)]))
    bid, d, cell = h.bid, lookup(DELTA.astype(h.cell), h.kind), h.cell
    if len(bid) and (bid.min() < 0 or bid.max() >= capacity):
        inside = (bid >= 0) & (bid < capacity)
        g, bid, d = g[inside], bid[inside], d[inside]
    redo = np.array([x for x in h.redo if x is not None and 0 <= x < capacity], np.int64)
    fl = [(p, x, v) for p, x, v in h.flips if x is not None and 0 <= x < capacity]
    f_pos, f_bid, f_val = (np.array(c, np.int64) for c in zip(*fl, strict=True)) if fl else [np.zeros(0, int)] * 3
    f_g = np.searchsorted(sn.at, f_pos)
    lin = (sn.lbid >= 0) & (sn.lbid < capacity)
    lgroup, lbid = sn.lgroup[lin], sn.lbid[lin]
    step = max(1, CHUNK_CELLS // max(capacity, 1))
    carry: np.ndarray = np.zeros(capacity, cell)
    out: list[FragPoint] = []
    for s0 in range(0, n, step):
        s1 = min(n, s0 + step)
        held = np.zeros((s1 - s0, capacity), carry.dtype)
        lo, hi = np.searchsorted(g, np.array([s0, s1], g.dtype))  # a list would convert all of g
        np.add.at(held.reshape(-1), (g[lo:hi] - s0) * capacity + bid[lo:hi], d[lo:hi])
        held[:, redo] = 0
        m = (f_g >= s0) & (f_g < s1)
        np.add.at(held, (f_g[m] - s0, f_bid[m]), f_val[m].astype(cell))
        held[0] += carry
        for i in range(1, s1 - s0):  # row by row: numpy's cumsum along axis 0 is many times slower
            held[i] += held[i - 1]
        carry = held[-1].copy()
        busy = held > 0
        busy[~sn.begun[s0:s1]] = False
        listed: slice | np.ndarray = slice(None) if s0 == 0 and s1 == n else (lgroup >= s0) & (lgroup < s1)
        busy[lgroup[listed] - s0, lbid[listed]] = True
        nfree, run = _free_runs(busy)
        out += [point(sn.ts[s], sn.step[s], fr, r, capacity, sn.reported[s])
                for s, fr, r in zip(range(s0, s1), nfree.tolist(), run.tolist(), strict=True)]
    return out


def _free_runs(busy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: free cells, and the longest run of consecutive free cells."""
    rows, cap = busy.shape
    free = np.zeros((rows, cap + 1), np.int8)  # a busy column after each row ends its last run
    np.logical_not(busy, out=free[:, :cap].view(np.bool_))
    f = free.ravel()
    x = np.flatnonzero(f[1:] != f[:-1]) + 1
    if len(f) and f[0]:
        x = np.r_[0, x]
    lens, row = x[1::2] - x[0::2], x[0::2] // (cap + 1)
    best = np.zeros(rows, np.int64)
    if len(row):
        cut = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        best[row[cut]] = np.maximum.reduceat(lens, cut)
    return cap - np.count_nonzero(busy, axis=1), best

