"""The C loops of `_kernels.c`, loaded with ctypes, where the install built them.

The searches gallop from the previous answer, so a block of nearly sorted queries
costs a few comparisons per query instead of a bisection (10 M probe rows: the cost
table's searches took 60% of its CPU time in numpy); the split sorts probe rows by
boundary in one counting pass. ctypes releases the GIL for the call, so the
analysis threads still run side by side. Where the extension is absent (an install
without a C compiler) `AVAILABLE` is False and the callers use numpy, which gives
the same answers.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

import numpy as np

_I64P = ctypes.POINTER(ctypes.c_int64)
_N = ctypes.c_int64
# Past this many sorted runs a union's heap merge loses to numpy's sort (a window's rows come
# in a few runs: one per boundary, stream or row group).
MAX_RUNS = 256


def open_library(folder: Path, stem: str) -> ctypes.CDLL | None:
    """The extension `stem` built in `folder`, opened with ctypes (no Python API is used);
    None where the install built none, or built a stale or foreign one (the numpy path
    then, not a failed import)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = folder / f"{stem}{suffix}"
        if p.is_file():
            try:
                return ctypes.CDLL(str(p))
            except OSError:
                return None
    return None


def _load() -> ctypes.CDLL | None:
    lib = open_library(Path(__file__).parent, "_kernels")
    if lib is None or not hasattr(lib, "replay_rounds"):  # (a build older than its newest loop: numpy's)
        return None
    lib.search_right.argtypes = [_I64P, _N, _I64P, _N, _I64P]
    lib.busy_before.argtypes = [_I64P, _I64P, _I64P, _N, _I64P, _N, _I64P]
    lib.count_keys.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _N, _N, _N, _I64P]
    lib.scatter_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, _N, _N, _N, _I64P, _I64P,
                                 _I64P, _I64P, _I64P]
    lib.union_runs.argtypes = [_I64P, _I64P, _N, _N, _I64P, _I64P]
    lib.subtract_sorted.argtypes = [_I64P, _I64P, _N, _I64P, _I64P, _N, _I64P, _I64P]
    lib.group_sorted.argtypes = [_I64P, _I64P, _I64P, _I64P, _N, _I64P, _I64P, _I64P, _I64P]
    lib.search_right.restype = lib.busy_before.restype = lib.scatter_rows.restype = None
    lib.count_keys.restype = lib.union_runs.restype = lib.subtract_sorted.restype = ctypes.c_int64
    lib.group_sorted.restype = ctypes.c_int64
    lib.replay_rounds.argtypes = [_N, _N, _I64P, _I64P, ctypes.c_void_p, ctypes.c_double, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_void_p]
    lib.replay_rounds.restype = ctypes.c_double
    return lib


_LIB = _load()
AVAILABLE = _LIB is not None


def _ptr(a: np.ndarray) -> ctypes._Pointer[ctypes.c_int64]:
    return a.ctypes.data_as(_I64P)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def search_right(s: np.ndarray, q: np.ndarray) -> np.ndarray:
    """np.searchsorted(s, q, side="right") for sorted int64 s."""
    assert _LIB is not None
    s, q = _i64(s), _i64(q)
    out = np.empty(len(q), dtype=np.int64)
    _LIB.search_right(_ptr(s), len(s), _ptr(q), len(q), _ptr(out))
    return out


def busy_before(s: np.ndarray, length: np.ndarray, cum: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Busy time before each q over sorted disjoint intervals [s, s + length), whose
    prefix sums are cum (len(s) + 1 entries, from 0)."""
    assert _LIB is not None
    s, length, cum, q = _i64(s), _i64(length), _i64(cum), _i64(q)
    out = np.empty(len(q), dtype=np.int64)
    _LIB.busy_before(_ptr(s), _ptr(length), _ptr(cum), len(s), _ptr(q), len(q), _ptr(out))
    return out


def union_runs(starts: np.ndarray, ends: np.ndarray, max_runs: int = MAX_RUNS) -> tuple[np.ndarray, np.ndarray] | None:
    """`intervals.union` of intervals whose starts come in at most `max_runs` sorted runs
    (None past that: a sort is the better plan), by merging the runs."""
    assert _LIB is not None
    s, e = _i64(starts), _i64(ends)
    n = len(s)
    if len(e) != n:
        raise ValueError(f"union_runs: {n} starts, {len(e)} ends")  # (C would read past the ends)
    out_s, out_e = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    m = _LIB.union_runs(_ptr(s), _ptr(e), n, max_runs, _ptr(out_s), _ptr(out_e))
    if m == -2:
        raise MemoryError("union_runs: no memory for the runs' heap")
    if m < 0:
        return None
    if m < n // 2:  # (a window's union outlives the window's rows: do not keep the slack)
        return out_s[:m].copy(), out_e[:m].copy()
    return out_s[:m], out_e[:m]


def subtract_sorted(a_s: np.ndarray, a_e: np.ndarray, w_s: np.ndarray,
                    w_e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`intervals.subtract` of two unions (sorted disjoint intervals): [a_s, a_e) less [w_s, w_e)."""
    assert _LIB is not None
    a_s, a_e, w_s, w_e = _i64(a_s), _i64(a_e), _i64(w_s), _i64(w_e)
    cap = len(a_s) + len(w_s)
    out_s, out_e = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)
    m = _LIB.subtract_sorted(_ptr(a_s), _ptr(a_e), len(a_s), _ptr(w_s), _ptr(w_e), len(w_s), _ptr(out_s), _ptr(out_e))
    return out_s[:m].copy(), out_e[:m].copy()


def group_sorted(key: np.ndarray, rank: np.ndarray, issue: np.ndarray,
                 order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`collectives.group_runs`, given `order`, a stable sort of the rows by key."""
    assert _LIB is not None
    key, rank, issue, order = _i64(key), _i64(rank), _i64(issue), _i64(order)
    n = len(key)
    if len(rank) != n or len(issue) != n or len(order) != n:
        raise ValueError(f"group_sorted: {n} keys, {len(rank)} ranks, {len(issue)} issue times, {len(order)} in order")
    run, count, first, last = (np.empty(n, dtype=np.int64) for _ in range(4))
    m = _LIB.group_sorted(_ptr(key), _ptr(rank), _ptr(issue), _ptr(order), n, _ptr(run), _ptr(count), _ptr(first),
                          _ptr(last))
    return run, count[:m], first[:m], last[:m]


def replay_rounds(launches: np.ndarray, collects: np.ndarray, rows: list[np.ndarray], cold: float,
                  cold_at: np.ndarray | None, shares: tuple[float, float] | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """`whatif_model.simulate`'s loop: `rows` its 13 per-batch inputs in `_kernels.c`'s order,
    `shares` the two streams' (None: one stream). Returns (start, launched, ended) as a 3 x
    rounds array, (dev_start, dev_end, synced) as 3 x n, held, busy (n x 4) and the end."""
    assert _LIB is not None
    n, rounds = len(rows[0]), len(launches)
    if len(rows) != 13 or any(len(x) != n for x in rows) or len(collects) != rounds:
        raise ValueError(f"replay_rounds: {len(rows)} rows of {[len(x) for x in rows]}, {rounds} and "
                         f"{len(collects)} rounds")
    if ((launches >= n) | (collects >= n)).any() or ((launches < 0) & (collects < 0)).any():
        raise ValueError("replay_rounds: a round names a batch past the last, or neither launches nor collects")
    inputs = np.ascontiguousarray(np.stack(rows), dtype=np.float64)
    at = None if cold_at is None else np.ascontiguousarray(cold_at, dtype=np.uint8)
    if at is not None and at.shape != (n, 2):
        raise ValueError(f"replay_rounds: cold_at is {at.shape}, not ({n}, 2)")
    out_r, out_b = np.empty((3, rounds)), np.empty((3, n))
    held = np.zeros(n, dtype=np.uint8)
    busy = np.full((n, 4), np.nan)
    launches, collects = _i64(launches), _i64(collects)
    end = _LIB.replay_rounds(n, rounds, _ptr(launches), _ptr(collects), inputs.ctypes.data, cold,
                             None if at is None else at.ctypes.data, int(shares is not None),
                             *(shares or (0.0, 0.0)), out_r.ctypes.data, out_b.ctypes.data, held.ctypes.data,
                             busy.ctypes.data)
    return out_r, out_b, held.astype(bool), busy, float(end)


def split_by_key(codes: list[np.ndarray], host: list[np.ndarray] | None, ncodes: int,
                 ts: list[np.ndarray], dur: list[np.ndarray], rank: list[np.ndarray] | None = None,
                 want: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (in chunks) sorted by key, stably: a row's key is its code in [0, ncodes), or
    with `host` masks code * 2 for a host row and code * 2 + 1 for another; with `rank`
    (int64 chunks), only the rows whose rank is `want`. Returns (offsets, ts, dur): key k's
    rows are [offsets[k], offsets[k + 1])."""
    assert _LIB is not None
    codes = [np.ascontiguousarray(c, dtype=np.int32) for c in codes]
    hosts = [np.ascontiguousarray(h, dtype=np.uint8) for h in host] if host is not None else None
    ranks = [_i64(r) for r in rank] if rank is not None else None
    nkeys = ncodes * (2 if hosts is not None else 1)
    counts = np.zeros(nkeys, dtype=np.int64)
    lengths = [len(c) for c in codes]
    if any(x is not None and [len(c) for c in x] != lengths for x in (ts, dur, hosts, ranks)):
        raise ValueError("probe rows' chunks differ in length across columns")  # (C would read past a chunk)

    def extra(k: int) -> tuple[int | None, int | None]:
        return (hosts[k].ctypes.data if hosts is not None else None,
                ranks[k].ctypes.data if ranks is not None else None)
    for k, c in enumerate(codes):
        bad = _LIB.count_keys(c.ctypes.data, *extra(k), want, len(c), ncodes, _ptr(counts))
        if bad >= 0:
            raise ValueError(f"probe row {bad} of a chunk has boundary code {int(c[bad])}, not in [0, {ncodes})")
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pos = offsets[:-1].copy()
    n = int(offsets[-1])
    ts_out, dur_out = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    for k, c in enumerate(codes):
        _LIB.scatter_rows(c.ctypes.data, *extra(k), want, len(c), ncodes, _ptr(_i64(ts[k])), _ptr(_i64(dur[k])),
                          _ptr(pos), _ptr(ts_out), _ptr(dur_out))
    return offsets, ts_out, dur_out
