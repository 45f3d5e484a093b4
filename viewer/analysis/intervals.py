"""Interval arithmetic for the cost table: merged busy intervals with prefix
sums (how much of [a, b) a stream was busy), interval subtraction, and per-cycle
sums accumulated block by block.

A long trace has millions of rows per boundary. Every step here is a numpy pass,
and a pass over a 20 MB array runs at memory speed; cut into blocks of BLOCK rows
the same passes stay in cache (measured on 2.7 M bookkeeping rows: 0.35 s whole,
0.14 s in blocks of 32 k).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from viewer.analysis import native

BLOCK = 1 << 15


def search(s: np.ndarray, q: np.ndarray, lo_q: int, hi_q: int) -> np.ndarray:
    """np.searchsorted(s, q, "right") for a block whose values lie in [lo_q, hi_q]:
    in C where it was built (viewer/analysis/native.py); else searching only the
    slice of s they can land in keeps numpy's search in cache."""
    if native.AVAILABLE:
        return native.search_right(s, q)
    lo = max(int(np.searchsorted(s, lo_q, side="right")) - 1, 0)
    hi = int(np.searchsorted(s, hi_q, side="right"))
    return np.searchsorted(s[lo:hi], q, side="right") + lo


def blocks(n: int) -> Iterator[slice]:
    for k in range(0, n, BLOCK):
        yield slice(k, min(n, k + BLOCK))


class CycleSums:
    """Per-cycle sums over rows assigned to cycles by start time.

    A row belongs to the cycle whose start is the last one at or before it; rows
    before the first cycle count to it and rows after the last to the last."""

    def __init__(self, starts: np.ndarray) -> None:
        self.S = starts
        self.n = len(starts)

    def cycle_of(self, t: np.ndarray) -> np.ndarray:
        if not len(t):
            return np.zeros(0, np.int64)
        # arithmetic on an ndarray of unknown dtype is Any in numpy's stubs
        out: np.ndarray = np.clip(search(self.S, t, int(t.min()), int(t.max())) - 1, 0, self.n - 1)
        return out

    def zeros(self) -> np.ndarray:
        return np.zeros(self.n, dtype=np.float64)

    @staticmethod
    def add(out: np.ndarray, ci: np.ndarray, w: np.ndarray | None = None) -> None:
        """out[ci] += w (or 1), for one block: its cycles span a narrow range,
        so the bincount is the range's length, not the whole trace's."""
        if not len(ci):
            return
        lo, hi = int(ci.min()), int(ci.max())
        out[lo:hi + 1] += np.bincount(ci - lo, weights=w, minlength=hi - lo + 1)


class CycleTotals:
    """CycleSums' interface with a single bin: sums over all cycles, for callers that
    only want totals (the cost table). No row is searched for its cycle and no
    per-cycle array is kept: on 10 M probe rows a third of the searches and most of
    the memory of `per_cycle`."""

    def __init__(self, starts: np.ndarray) -> None:
        self.S = starts
        self.n = 1

    @staticmethod
    def cycle_of(t: np.ndarray) -> np.ndarray:
        return np.broadcast_to(np.intp(0), t.shape)

    @staticmethod
    def zeros() -> np.ndarray:
        return np.zeros(1, dtype=np.float64)

    @staticmethod
    def add(out: np.ndarray, ci: np.ndarray, w: np.ndarray | None = None) -> None:
        out[0] += len(ci) if w is None else float(w.sum())


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals [starts, ends) as sorted disjoint intervals (touching ones
    merged)."""
    if not len(starts):
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if native.AVAILABLE:
        merged = native.union_runs(starts, ends)
        if merged is not None:
            return merged
    if bool(np.all(starts[1:] >= starts[:-1])):  # one stream's rows are already in order
        s, e = starts, ends
    else:
        order = np.argsort(starts, kind="stable")
        s, e = starts[order], ends[order]
    # merge overlapping intervals (two streams busy at once count once)
    run_end = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    # run_end only grows: a merged interval ends at its last member's running maximum
    return s[new], run_end[np.flatnonzero(np.append(new[1:], True))]


class Coverage:
    """Prefix sums over the merged device-busy intervals: covered(a, b) = busy time in [a, b)."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        self.s, self.e = union(starts, ends)
        self.len = self.e - self.s
        self.cum = np.concatenate([[0], np.cumsum(self.len)])

    def covered(self, a: np.ndarray, b: np.ndarray, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """Busy time in [a, b): busy time before b minus busy time before a. Meant for cache-sized
        blocks (`blocks`): on a long trace the arrays of a whole boundary spill
        every cache, and each pass then costs a trip to memory. `lo`, `hi`: min(a) and max(b),
        when the caller has them."""
        s, ln, cum = self.s, self.len, self.cum
        if len(s) == 0:
            return np.zeros(len(a), dtype=np.int64)
        if not len(a):
            return np.zeros(0, dtype=np.int64)
        if native.AVAILABLE:
            busy: np.ndarray = native.busy_before(s, ln, cum, b) - native.busy_before(s, ln, cum, a)
            return busy
        if lo is None or hi is None:
            lo, hi = int(a.min()), int(b.max())
        i = search(s, a, lo, hi) - 1
        j = search(s, b, lo, hi) - 1
        ic, jc = np.maximum(i, 0), np.maximum(j, 0)
        fa = np.minimum(np.maximum(a - s[ic], 0), ln[ic])
        fb = np.minimum(np.maximum(b - s[jc], 0), ln[jc])
        fa[i < 0] = 0
        fb[j < 0] = 0
        covered: np.ndarray = (cum[jc] + fb) - (cum[ic] + fa)
        return covered


def subtract(s: np.ndarray, e: np.ndarray, cs: np.ndarray, ce: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of [s, e) minus the union of [cs, ce), as sorted disjoint intervals (without
    waits or rows: the rows as given; callers merge them, `Coverage`).

    Both unions first (each a few sorted runs: no full sort), then each interval of the
    first cut by the gaps of the second it overlaps (in C one pass over both; numpy finds
    them by binary search): a TP rank's comm waits outnumber its device rows ten to one,
    and a sort of all endpoints together was most of a window's time.
    """
    if not len(cs) or not len(s):
        return s, e
    return subtract_unions(*union(s, e), *union(cs, ce))


def subtract_unions(a_s: np.ndarray, a_e: np.ndarray, w_s: np.ndarray, w_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`subtract` of two unions already taken (sorted disjoint intervals, `union`'s output)."""
    if native.AVAILABLE:
        return native.subtract_sorted(a_s, a_e, w_s, w_e)
    # the gaps between waits: [w_e[k-1], w_s[k]), the first from -inf, the last to +inf
    g_s = np.concatenate([[np.iinfo(np.int64).min], w_e])
    g_e = np.concatenate([w_s, [np.iinfo(np.int64).max]])
    k0 = np.searchsorted(g_e, a_s, "right")  # the first gap ending after the interval starts
    k1 = np.searchsorted(g_s, a_e, "left")  # past the last gap starting before it ends
    n = np.maximum(k1 - k0, 0)
    which = np.repeat(np.arange(len(a_s)), n)
    gap = np.repeat(k0, n) + (np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    out_s = np.maximum(a_s[which], g_s[gap])
    out_e = np.minimum(a_e[which], g_e[gap])
    keep = out_e > out_s
    return out_s[keep], out_e[keep]
