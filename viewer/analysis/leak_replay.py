"""The vectorised replay behind `leaks.leak_report`: the `memory` table as numpy
codes, its state rows in block order with running holder counts, the blocks
whose checks fail on those counts, their exact replay row by row, the anomaly
messages and the holders when the trace ends.

How: a long run has tens of millions of events, so nothing loops over rows;
tests/support/leak_oracle.py keeps the event-by-event loop as the definition, and a
property test holds the two equal.

- A block's holders depend on its own events only, so state rows are put in
  (block, replay position) order: one sort of int64 keys (block | position |
  request | kind). Keys are unique, so numpy's unstable SIMD sort is stable
  here, and the columns ride along instead of costing a random gather each.
- In a consistent history every holder count is a plain running sum of +1
  (alloc, ref) and -1 (unref, free, reclaim): an alloc or a free only ever
  meets an empty block or a sole holder, so its reset changes nothing. The
  block's total is one cumulative sum; a request's own count equals it while
  a "segment" (from an alloc, or after a free, to the next) has one requester,
  and comes from a small sort by (segment, request) where it has several.
- Each row's checks (alloc of a held block, unref by a non-holder, ref_count
  against the count, ...) run on those sums. Up to a block's first
  inconsistency the sums are the exact state, so that first finding is always
  made; after it they may drift. So each block with a finding is replayed
  again, exactly, in Python (`_step`), which also writes the anomaly messages
  (they show holder dicts). A healthy trace has no such block.
- Hashing the request id strings is the costliest step, so it runs on a worker
  thread (Arrow drops the GIL) while the rest is prepared; a dictionary-encoded
  column is not hashed again.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MAX_ANOMALIES = 50  # keep the report readable when a trace is badly inconsistent
KINDS = ("alloc", "ref", "unref", "free", "reclaim", "snapshot_begin", "snapshot")
ALLOC, REF, UNREF, FREE, RECLAIM, BEGIN, SNAP, UNKNOWN = range(8)  # codes below BEGIN change state
DELTA = np.array([1, 1, -1, -1, -1, 0, 0, 0], np.int32)
CHECKED = np.array([0, 1, 1, 0, 1, 0, 0, 0], np.uint8)  # kinds whose ref_count the replay checks
NOREF = -(1 << 40)  # a null ref_count: equal to no count
NOBID = 1 << 40  # a null block_id: a block of its own


def ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """concatenate([arange(a, b) for a, b in zip(lo, hi)]) without the loop."""
    lens = hi - lo
    return np.repeat(lo - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())


# ------------------------------------------------------------ columns as numpy codes
def _identity(a: pa.Array) -> tuple[int, ...]:
    return (a.offset, len(a), *(b.address if b is not None else 0 for b in a.buffers()))


def codes(col: pa.ChunkedArray, lut_of: Any) -> tuple[np.ndarray, pa.Array | None]:
    """Codes via lut_of(distinct dictionaries) -> (a lut per dictionary, the code of null, values)."""
    # Chunk by chunk: a hash table per chunk stays small, and chunks of one read share a dictionary.
    chunks = [c if pa.types.is_dictionary(c.type) else pc.dictionary_encode(c) for c in col.chunks if len(c)]
    dicts = {_identity(c.dictionary): c.dictionary for c in chunks}
    luts, null_code, values = lut_of(list(dicts.values()))
    lut = dict(zip(dicts, luts, strict=True))
    out = [np.asarray(pc.fill_null(pc.take(pa.array(lut[_identity(c.dictionary)]), c.indices), null_code))
           for c in chunks]
    return (out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, np.int32)), values


def _kind_luts(dicts: list[pa.Array]) -> tuple[list[np.ndarray], int, None]:
    code = {k: i for i, k in enumerate(KINDS)}
    return [np.array([code.get(k, UNKNOWN) for k in d.to_pylist()], np.int8) for d in dicts], UNKNOWN, None


def rid_luts(dicts: list[pa.Array]) -> tuple[list[np.ndarray], int, pa.Array]:
    """One list of distinct request ids for all dictionaries; null is "" (the replay's `rid or ""`)."""
    allv = pa.concat_arrays([d.cast(pa.string()) for d in dicts] + [pa.array([""])])
    enc = pc.dictionary_encode(pc.fill_null(allv, ""))
    remap, at = np.asarray(enc.indices), np.cumsum([0, *map(len, dicts)])
    return [remap[a:b] for a, b in zip(at[:-1], at[1:], strict=True)], int(remap[-1]), enc.dictionary


def lookup(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """table[codes]: Arrow's take does it ~2x faster than numpy's fancy indexing."""
    return np.asarray(pc.take(pa.array(table), pa.array(codes)))


def _ints(col: pa.ChunkedArray, null: int) -> np.ndarray:
    return np.asarray(pc.fill_null(col.cast(pa.int64()), null)) if col.null_count else col.to_numpy()


@dataclass(slots=True)
class Rows:
    """The memory table as numpy columns, in replay order (stable by ts_ns)."""

    ts: np.ndarray
    kind: np.ndarray
    bid: np.ndarray
    ref: np.ndarray
    order: np.ndarray | None  # replay position -> file row; None: the file is in order
    memory: pa.Table
    rid: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # set by attach()
    names: pa.Array = field(default_factory=lambda: pa.array([""]))  # rid code -> request id

    def attach(self, rid: np.ndarray, names: pa.Array | None) -> None:
        self.rid = rid if self.order is None else rid[self.order]
        self.names = names if names is not None else self.names

    def column(self, name: str, pos: np.ndarray) -> list[Any]:
        out: list[Any] = self.memory[name].take(pa.array(pos if self.order is None else self.order[pos])).to_pylist()
        return out

    def rids(self, codes: np.ndarray) -> list[str]:
        out: list[str] = self.names.take(pa.array(codes, pa.int32())).to_pylist()
        return out


class Unordered(TypeError):
    """A null where the replay needs an order (a memory table no writer of ours leaves): the
    event-by-event replay's sorted() raises TypeError there, and so does this; `leaks` on a
    trace says it in one line (a corrupt trace)."""


def read_rows(memory: pa.Table) -> Rows:
    if memory["ts_ns"].null_count and memory.num_rows > 1:
        raise Unordered("memory.ts_ns has nulls: no replay order")
    ts = memory["ts_ns"].to_numpy()
    kind = codes(memory["kind"], _kind_luts)[0].astype(np.int8, copy=False)
    bid, ref = _ints(memory["block_id"], NOBID), _ints(memory["ref_count"], NOREF)
    order: np.ndarray | None = None
    if len(ts) > 1 and not (ts[1:] >= ts[:-1]).all():
        order = np.argsort(ts, kind="stable")  # equal timestamps keep file order: emission order
        ts, kind, bid, ref = ts[order], kind[order], bid[order], ref[order]
    return Rows(ts, kind, bid, ref, order, memory)


# ------------------------------------------------------------ state rows, block by block
def _block_order(bid: np.ndarray, pos: np.ndarray, kind: np.ndarray, rid: np.ndarray,
                 n_rids: int) -> tuple[np.ndarray, ...]:
    """(pos, kind, rid) of the rows in (block, pos) order, the distinct block ids and their row counts."""
    lo, hi = (int(bid.min()), int(bid.max())) if len(bid) else (0, 0)
    pbits, rbits = int(pos[-1]).bit_length() if len(pos) else 0, max(n_rids - 1, 0).bit_length()
    at = 3 + rbits  # key bits: block | position | rid | kind
    if (hi - lo).bit_length() + pbits + at <= 63:
        # Keys are unique (positions are), so numpy's SIMD sort of values gives the stable order,
        # and kind and rid come along without a gather each.
        key = (bid - lo).astype(np.int64)
        counts = np.bincount(key) if hi - lo < 1 << 22 else None
        key <<= pbits + at
        part = np.left_shift(pos, at, dtype=np.int64)
        key |= part
        key |= np.left_shift(rid, 3, out=part, dtype=np.int64)
        key |= kind
        del part
        key.sort()
        k, r = (key & 7).astype(np.int8), ((key >> 3) & ((1 << rbits) - 1)).astype(np.int32)
        if counts is None:
            high = key >> (pbits + at)
            first = np.flatnonzero(np.r_[True, high[1:] != high[:-1]])
            ub, counts = high[first], np.diff(np.r_[first, len(key)])
        else:
            ub = np.flatnonzero(counts)
            counts = counts[ub]
        key >>= at
        key &= (1 << pbits) - 1
        return key.astype(np.int32) if pbits < 32 else key, k, r, ub + lo, counts
    ob = np.argsort(bid, kind="stable")  # a null block id (or a vast range): sort the slow way
    sb = bid[ob]
    first = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]]) if len(sb) else ob
    return pos[ob], kind[ob], rid[ob], sb[first], np.diff(np.r_[first, len(sb)])


@dataclass(slots=True)
class Blocks:
    """State rows in (block, replay position) order, with running holder counts."""

    spos: np.ndarray  # replay position of each state row, in replay order
    sbid: np.ndarray  # ... its block
    skind: np.ndarray  # ... its kind
    idx: np.ndarray  # in block order from here on: replay position
    ub: np.ndarray  # distinct block ids
    cnt: np.ndarray  # rows per block
    first: np.ndarray  # each block's first row
    kind: np.ndarray
    rid: np.ndarray
    tb: np.ndarray  # the block's total count before the row
    ta: np.ndarray  # ... and after it
    start: np.ndarray  # a segment starts here
    checked: np.ndarray  # rows whose ref_count is checked (ref, unref, reclaim) ...
    ref: np.ndarray  # ... and that ref_count
    cb: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # the row's request's count before it


def blocks(rows: Rows, rids: Future[tuple[np.ndarray, pa.Array | None]]) -> Blocks:
    """The state rows in block order and their running sums; `rids` is the request id encoding."""
    st = rows.kind < BEGIN
    spos, sbid, skind = np.flatnonzero(st), rows.bid[st], rows.kind[st]
    spos = spos.astype(np.int32) if len(st) < 1 << 31 else spos
    rows.attach(*rids.result())  # from the encoder thread: all the above needed none
    idx, k, r, ub, cnt = _block_order(sbid, spos, skind, rows.rid[st], len(rows.names))
    first = np.r_[0, np.cumsum(cnt)[:-1]].astype(np.int64) if len(cnt) else cnt
    d = lookup(DELTA, k)
    ta = np.cumsum(d, dtype=np.int32)
    ta -= np.repeat(ta[first] - d[first], cnt)
    tb = ta - d
    checked = np.flatnonzero(lookup(CHECKED, k))  # few rows: gather their ref_count alone
    ref = rows.ref[idx[checked]]
    # Segments restart at an alloc and after a free: in a consistent block both meet no other holder.
    start = k == ALLOC
    start[1:] |= k[:-1] == FREE
    ends = checked[(k[checked] == RECLAIM) & (ref == 0)] + 1
    start[ends[ends < len(k)]] = True
    start[first] = True
    return Blocks(spos, sbid, skind, idx, ub, cnt, first, k, r, tb, ta, start, checked, ref)


def own_counts(b: Blocks, rows: Rows) -> None:
    """The block total in one-requester segments; per (segment, request) sums in the others."""
    r = b.rid
    b.cb = b.tb
    ch = np.flatnonzero((r[1:] != r[:-1]) & ~b.start[1:]) + 1
    if not len(ch):
        return
    seg = np.flatnonzero(b.start)
    ms = np.searchsorted(seg, ch, "right") - 1
    ms = ms[np.r_[True, ms[1:] != ms[:-1]]]  # sorted already: no need for np.unique
    lo, hi = seg[ms], np.r_[seg[1:], len(r)][ms]
    m = ranges(lo, hi)
    key = np.repeat(ms.astype(np.int64), hi - lo) * len(rows.names) + r[m]
    o = np.argsort(key, kind="stable")
    m, key = m[o], key[o]
    dm = lookup(DELTA, b.kind[m])
    gs = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    c = np.cumsum(dm)
    c -= np.repeat(c[gs] - dm[gs], np.diff(np.r_[gs, len(m)]))
    b.cb = b.tb.copy()
    b.cb[m] = c - dm


def suspect(b: Blocks) -> np.ndarray:
    """Ranks of the blocks whose checks fail on the running counts (exact up to a first anomaly)."""
    k, tb, ta, cb = b.kind, b.tb, b.ta, b.cb
    bad = (k == ALLOC) & (tb > 0)
    bad |= (k == UNREF) & ((cb <= 0) | (ta == 0))
    bad |= (k == FREE) & ((tb != 1) | (cb != 1))
    bad |= (k == RECLAIM) & (cb <= 0)
    c = b.checked
    miscount = (b.ref != NOREF) & (b.ref != ta[c])  # a reclaim that frees: checked as "freed still held"
    bad[c[miscount & ((k[c] != RECLAIM) | (ta[c] > 0))]] = True
    return np.unique(np.searchsorted(b.first, np.flatnonzero(bad), "right") - 1)


# ------------------------------------------------------------ the exact replay, for inconsistent blocks
@dataclass(slots=True)
class _Dirty:
    holders: dict[Any, dict[str, int]] = field(default_factory=dict)
    anomalies: list[tuple[int, str]] = field(default_factory=list)  # (replay position, message): the first
    n: int = 0
    flips: list[tuple[int, Any, int]] = field(default_factory=list)  # (position, block, +1 held / -1 free)


def replay_dirty(rows: Rows, b: Blocks, ranks: np.ndarray) -> _Dirty:
    out = _Dirty()
    pos = np.sort(b.idx[ranges(b.first[ranks], b.first[ranks] + b.cnt[ranks])])
    bids = [None if x == NOBID else x for x in rows.bid[pos].tolist()]
    refs = [None if x == NOREF else x for x in rows.ref[pos].tolist()]
    for p, t, kind, bid, rid, ref in zip(pos.tolist(), rows.ts[pos].tolist(), rows.kind[pos].tolist(), bids,
                                         rows.rids(rows.rid[pos]), refs, strict=True):
        was = bid in out.holders
        for msg in _step(out.holders, t, KINDS[kind], bid, rid, ref):
            out.n += 1
            if len(out.anomalies) < MAX_ANOMALIES:
                out.anomalies.append((p, msg))
        if (bid in out.holders) != was:
            out.flips.append((p, bid, -1 if was else 1))
    return out


def _step(holders: dict[Any, dict[str, int]], t: int, kind: str, bid: Any, rid: str, ref: int | None) -> list[str]:
    """One state event, exactly as tests/support/leak_oracle.py replays it; returns its anomaly messages."""
    h, msgs = holders.get(bid), []
    if kind == "alloc":
        if h:
            msgs.append(f"ts {t}: alloc of block {bid} to {rid} while held by {sorted(h)}")
        holders[bid] = {rid: 1}
    elif kind == "ref":
        h = holders.setdefault(bid, {})  # a ref may revive a free prefix block
        h[rid] = h.get(rid, 0) + 1
    elif kind == "unref":
        if not h or rid not in h:
            return [f"ts {t}: unref of block {bid} by {rid}, which does not hold it"]
        h[rid] -= 1
        if h[rid] == 0:
            del h[rid]
        if not h:
            msgs.append(f"ts {t}: unref of block {bid} by {rid} left no holder (ref_count {ref})")
            del holders[bid]
    elif kind == "free":
        if not h:
            msgs.append(f"ts {t}: free of block {bid} by {rid}, which is already free")
        elif set(h) != {rid} or h[rid] != 1:
            msgs.append(f"ts {t}: free of block {bid} by {rid} while held by {h}")
        holders.pop(bid, None)
    else:  # reclaim
        if not h or rid not in h:
            msgs.append(f"ts {t}: reclaim of block {bid} from {rid}, which does not hold it")
        else:
            h[rid] -= 1
            if h[rid] == 0:
                del h[rid]
        if ref == 0 or not holders.get(bid):
            if holders.get(bid):
                msgs.append(f"ts {t}: reclaim freed block {bid} still held by {holders[bid]}")
            holders.pop(bid, None)
    if kind in ("ref", "unref", "reclaim") and bid in holders:
        held = sum(holders[bid].values())
        if ref is not None and ref != held:
            msgs.append(f"ts {t}: block {bid} ref_count {ref} but the replay counts {held}")
    return msgs


def anomalies(rows: Rows, dirty: _Dirty) -> tuple[list[str], int]:
    unknown = np.flatnonzero(rows.kind == UNKNOWN)
    head = unknown[:MAX_ANOMALIES]
    found = dirty.anomalies + [(p, f"ts {t}: unknown memory event kind {k!r}") for p, t, k in
                               zip(head.tolist(), rows.ts[head].tolist(), rows.column("kind", head), strict=True)]
    found.sort(key=lambda a: a[0])  # stable: one row's messages keep their order
    return [m for _, m in found[:MAX_ANOMALIES]], dirty.n + len(unknown)


# ------------------------------------------------------------ end state
def final_counts(rows: Rows, b: Blocks, clean: np.ndarray, dirty: _Dirty) -> dict[Any, dict[str, int]]:
    """Block -> {request id: references} when the rows end. Each block's holders come in the
    order the exact replay added them to its dict, which its messages print: a request is
    added where its own count rises from 0, so the latest such row of each orders them."""
    out: dict[Any, dict[str, int]] = {}
    last = b.first + b.cnt - 1
    held = np.flatnonzero(clean & (b.ta[last] > 0))
    if len(held):  # a clean block's holders: the positive counts of its last segment
        seg = np.flatnonzero(b.start)
        lo = seg[np.searchsorted(seg, last[held], "right") - 1]
        m = ranges(lo, last[held] + 1)
        n = len(rows.names)
        key = np.repeat(held.astype(np.int64), last[held] + 1 - lo) * n + b.rid[m]
        uk, inv = np.unique(key, return_inverse=True)
        d = DELTA[b.kind[m]]
        cnt = np.bincount(inv, weights=d, minlength=len(uk)).astype(np.int64)
        added = np.full(len(uk), -1, np.int64)
        new = (b.cb[m] == 0) & (d > 0)
        np.maximum.at(added, inv[new], m[new])
        keep = cnt > 0
        uk, cnt, added = uk[keep], cnt[keep], added[keep]
        o = np.lexsort((added, uk // n))
        uk, cnt = uk[o], cnt[o]
        for bid, name, c in zip(b.ub[uk // n].tolist(), rows.rids(uk % n), cnt.tolist(), strict=True):
            out.setdefault(None if bid == NOBID else bid, {})[name] = c
    out.update((bid, dict(h)) for bid, h in dirty.holders.items())
    return out
