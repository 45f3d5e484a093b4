"""KV block leaks and fragmentation, by replaying the `memory` table.

The replay follows every block's holders through the events, in (ts_ns, file)
order: `alloc` (a request takes a free block), `ref` (another request shares
it), `unref` (a holder drops it, others remain), `free` (the last holder drops
it) and `reclaim` (the engine's GC took it back from a request that died or
made no progress: a free when ref_count is 0 after it, an unref of a shared
block otherwise; either way listed as reclaimed, never as leaked). `snapshot_begin`/`snapshot` rows are
the periodic full block tables; they do not change state, and are used for
fragmentation over time.

A block still held when the trace ends is a leak when its holder is finished
(it has a row in `requests`), or is unknown to `requests` although the run
ended cleanly. In a killed run an unknown holder was simply still running.

How it is done at scale: leak_replay.py (the replay) and leak_fragmentation.py
(the free blocks at each snapshot).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracing.consistency import read_consistent
from tracing.reader import Trace
from tracing.run_status import RunStatus
from viewer.analysis import leak_fragmentation as frag
from viewer.analysis import leak_replay as replay
from viewer.analysis.leak_fragmentation import FragPoint
from viewer.analysis.leak_replay import MAX_ANOMALIES
from viewer.analysis.records import INLINE, JsonRecord, plain

__all__ = ["MAX_ANOMALIES", "FragPoint", "HeldBlocks", "LeakReport", "LeaksResult", "build_leaks", "frag_point",
           "largest_run", "leak_report"]


@dataclass(slots=True)
class HeldBlocks:
    request_id: str
    status: str  # "finished" (in requests), "unknown" (not in requests) or "running" (killed run)
    finish_reason: str | None
    block_ids: list[int]


@dataclass(slots=True)
class LeakReport:
    capacity: int
    capacity_inferred: bool  # meta.json had no kv_blocks: max block id + 1
    run_ended: bool
    events: int  # state-changing rows replayed
    final_held: int
    final_free: int
    leaks: list[HeldBlocks] = field(default_factory=list)
    still_running: list[HeldBlocks] = field(default_factory=list)  # killed run: not leaks
    reclaimed: dict[str, list[int | None]] = field(default_factory=dict)  # None: a null block id
    anomalies: list[str] = field(default_factory=list)  # events the replay could not reconcile
    num_anomalies: int = 0
    fragmentation: list[FragPoint] = field(default_factory=list)
    # printed after the fields (viewer/analysis/records.py)
    DERIVED: ClassVar[tuple[str, ...]] = ("leaked_blocks", "reclaimed_blocks", "frag_index_min", "frag_index_max")

    @property
    def leaked_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self.leaks)

    @property
    def reclaimed_blocks(self) -> int:
        return sum(len(v) for v in self.reclaimed.values())

    def frag_range(self) -> tuple[float, float] | None:
        if not self.fragmentation:
            return None
        xs = [f.frag_index for f in self.fragmentation]
        return min(xs), max(xs)

    @property
    def frag_index_min(self) -> float | None:
        rng = self.frag_range()
        return None if rng is None else rng[0]

    @property
    def frag_index_max(self) -> float | None:
        rng = self.frag_range()
        return None if rng is None else rng[1]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = plain(self)
        return out


@dataclass(slots=True)
class LeaksResult(JsonRecord):
    """Everything `leaks` shows (its to_json() is what --json prints): the report's keys
    after the trace's."""

    trace: str  # the trace folder, as given
    status: RunStatus
    report: LeakReport = field(metadata=INLINE)


def build_leaks(tr: Trace, trace: str) -> LeaksResult:
    """The leaks of an open trace recorded with probes (one without has no memory table)."""
    t = read_consistent(tr, {"memory": None, "requests": ["request_id", "finish_reason"]},
                        dictionary={"memory": ("request_id",)})
    rep = leak_report(t["memory"], t["requests"], int(tr.meta.get("model", {}).get("kv_blocks") or 0),
                      run_ended=tr.status.complete)
    return LeaksResult(trace, tr.status, rep)


def largest_run(sorted_ids: list[int]) -> int:
    """Length of the longest run of consecutive integers in an ascending list."""
    best = run = 0
    prev = None
    for b in sorted_ids:
        run = run + 1 if prev is not None and b == prev + 1 else 1
        best = max(best, run)
        prev = b
    return best



def frag_point(ts_ns: int, step: int, free_ids: list[int], capacity: int,
               free_reported: int | None = None) -> FragPoint:
    return frag.point(ts_ns, step, len(free_ids), largest_run(sorted(free_ids)), capacity, free_reported)


# ------------------------------------------------------------ end state
def _classify(holders: dict[Any, list[str]], requests: pa.Table,
              run_ended: bool) -> tuple[list[HeldBlocks], list[HeldBlocks]]:
    by_req: dict[str, list[Any]] = {}
    for bid, names in holders.items():
        for rid in names:
            by_req.setdefault(rid, []).append(bid)
    req = requests.select(["request_id", "finish_reason"])
    if by_req and req.num_rows:  # only the holders' rows: cheap on a long run's requests
        col = req["request_id"]
        col = col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
        req = req.filter(pc.is_in(col, value_set=pa.array(list(by_req), col.type)))
    d = req.to_pydict() if by_req else {"request_id": [], "finish_reason": []}
    finished = {r: fr for r, fr in zip(d["request_id"], d["finish_reason"], strict=True) if fr}
    leaks: list[HeldBlocks] = []
    running: list[HeldBlocks] = []
    for rid in sorted(by_req):
        ids = sorted(by_req[rid])
        if rid in finished:
            leaks.append(HeldBlocks(rid, "finished", finished[rid], ids))
        elif run_ended:
            leaks.append(HeldBlocks(rid, "unknown", None, ids))
        else:
            running.append(HeldBlocks(rid, "running", None, ids))
    return leaks, running


def _reclaimed(rows: replay.Rows) -> dict[str, list[int | None]]:
    p = np.flatnonzero(rows.kind == replay.RECLAIM)
    o = np.lexsort((rows.bid[p], rows.rid[p]))
    codes = rows.rid[p][o]
    ids: list[int | None] = [None if x == replay.NOBID else x for x in rows.bid[p][o].tolist()]
    at = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]]) if len(p) else p
    cuts = np.r_[at, len(p)].tolist()
    got: dict[str, list[int | None]] = {}
    for n, a, z in zip(rows.rids(codes[at]), cuts[:-1], cuts[1:], strict=True):
        # Already in order (the lexsort). A null block id sorts last and stays a request's only
        # id; among others it has no order, and the replay's sorted() fails there: so must we.
        if z - a > 1 and ids[z - 1] is None:
            raise TypeError(f"reclaimed blocks of {n!r}: a null block id cannot be ordered among others")
        got[n] = ids[a:z]
    return {k: got[k] for k in sorted(got)}


# ------------------------------------------------------------ the report
def _replay_state(memory: pa.Table) -> tuple[replay.Rows, frag.Snaps, replay.Blocks]:
    with ThreadPoolExecutor(1) as pool:
        # Hashing the request id strings is the costliest step; Arrow does it without the GIL,
        # so it runs beside the block sort, which does not need them.
        rids = pool.submit(replay.codes, memory["request_id"], replay.rid_luts)
        rows = replay.read_rows(memory)
        sn = frag.snapshots(rows)
        b = replay.blocks(rows, rids)
    replay.own_counts(b, rows)
    return rows, sn, b


def leak_report(memory: pa.Table, requests: pa.Table, capacity: int, run_ended: bool) -> LeakReport:
    """Replay `memory`; `requests` needs `request_id` and `finish_reason`; capacity = meta kv_blocks.
    Any string column may be dictionary-encoded (cheaper to read and to replay)."""
    pa.default_memory_pool().release_unused()  # the reader's freed decode buffers: lowers our peak
    rows, sn, b = _replay_state(memory)
    ranks = replay.suspect(b)
    dirty = replay.replay_dirty(rows, b, ranks)
    clean = np.ones(len(b.ub), bool)
    clean[ranks] = False
    anomalies, n_anom = replay.anomalies(rows, dirty)
    inferred = capacity <= 0
    if inferred:
        top = pc.max(memory["block_id"]).as_py()
        capacity = max(-1, -1 if top is None else top) + 1
    holders = replay.final_holders(rows, b, clean, dirty)
    leaks, running = _classify(holders, requests, run_ended)
    reclaimed = _reclaimed(rows)
    wide = len(b.ta) and max(b.ta.max(), -b.ta.min()) >= 1 << 14  # a count int16 cells could not hold
    held = frag.Held(b.spos, b.sbid, b.skind, np.int32 if wide else np.int16,
                      [None if x == replay.NOBID else x for x in b.ub[ranks].tolist()], dirty.flips)
    events = len(b.idx)
    del rows, b  # the block-order arrays: fragmentation's matrix needs the room
    return LeakReport(
        capacity=capacity, capacity_inferred=inferred, run_ended=run_ended, events=events,
        final_held=len(holders), final_free=capacity - len(holders), leaks=leaks,
        still_running=running, reclaimed=reclaimed, anomalies=anomalies, num_anomalies=n_anom,
        fragmentation=frag.fragmentation(sn, held, capacity),
    )
