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

How it is done at scale: leak_replay.py (the replay), leak_fragmentation.py (the
free blocks at each snapshot), leak_stream.py (both a window of events at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc

from tracing.consistency import read_steps, step_clip
from tracing.reader import Trace, TraceError
from tracing.run_status import RunStatus
from tracing.sweep import Sweep, start_over
from viewer.analysis import leak_fragmentation as frag
from viewer.analysis import leak_stream as stream
from viewer.analysis.leak_fragmentation import FragPoint
from viewer.analysis.leak_replay import MAX_ANOMALIES, Unordered
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


def build_leaks(tr: Trace, trace: str, window_rows: int = stream.WINDOW_ROWS) -> LeaksResult:
    """The leaks of an open trace recorded with probes (one without has no memory table),
    its memory events read a window at a time (leak_stream.py)."""
    if not tr.has_table("memory"):
        raise TraceError(f"trace {tr.root} has no memory/ table")
    capacity = int(tr.meta.get("model", {}).get("kv_blocks") or 0)

    def replay() -> tuple[stream.WindowedReplay, bool]:
        # each attempt clips by the steps of the snapshot it reads: after a start-over, the
        # first snapshot's steps dropped the rounds committed since, whose frees then went
        # missing beside the newer snapshot's finished requests (false leaks)
        clip = step_clip(tr, "memory", read_steps(tr, ["step"], references=False))
        cap, inferred = (capacity, False) if capacity > 0 else (_largest_block(tr, clip) + 1, True)
        rp = stream.WindowedReplay(cap)
        for w in stream.trace_windows(tr, clip, window_rows):
            rp.feed(w)
        return rp, inferred

    try:
        rp, inferred = start_over(tr, "memory", replay)
        rep = _report(rp, inferred, tr.status.complete, lambda names: _finished_in_trace(tr, names))
    except Unordered as e:
        raise TraceError(f"corrupt memory/ table in {tr.root}: {e}") from None
    return LeaksResult(trace, tr.status, rep)


def _largest_block(tr: Trace, clip: Callable[[pa.Table], pa.Table] | None) -> int:
    """The largest block id of the (clipped) memory events, -1 with none or only negative ones:
    from the row groups' statistics where they say it (a complete run), else read."""
    sw = Sweep(tr, "memory", ["block_id", "step"], clip=clip, ranges=("block_id",))
    bounds = [g.int_range(0) for g in sw.groups if g.rows]
    if clip is None and all(b is not None for b in bounds):
        return max([-1, *(b[1] for b in bounds if b is not None)])
    clipped = tr.status.clipped.get("memory")
    top = -1
    for t in sw.pieces(stream.WINDOW_ROWS):
        m = pc.max(t["block_id"]).as_py()
        top = top if m is None else max(top, m)
    # the replay's read clips the same rows and counts them: once
    if clipped is None:
        tr.status.clipped.pop("memory", None)
    else:
        tr.status.clipped["memory"] = clipped
    return top


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
def _classify(holders: dict[Any, list[str]], finished: Callable[[list[str]], dict[str, str]],
              run_ended: bool) -> tuple[list[HeldBlocks], list[HeldBlocks]]:
    by_req: dict[str, list[Any]] = {}
    for bid, names in holders.items():
        for rid in names:
            by_req.setdefault(rid, []).append(bid)
    done = finished(list(by_req)) if by_req else {}
    leaks: list[HeldBlocks] = []
    running: list[HeldBlocks] = []
    for rid in sorted(by_req):
        ids = sorted(by_req[rid])
        if rid in done:
            leaks.append(HeldBlocks(rid, "finished", done[rid], ids))
        elif run_ended:
            leaks.append(HeldBlocks(rid, "unknown", None, ids))
        else:
            running.append(HeldBlocks(rid, "running", None, ids))
    return leaks, running


def _finished_rows(req: pa.Table, names: list[str], into: dict[str, str]) -> None:
    """Add the finished ones of `names` among `req`'s rows (a later row wins, as in a dict)."""
    col = req["request_id"]
    col = col.cast(col.type.value_type) if pa.types.is_dictionary(col.type) else col
    d = req.filter(pc.is_in(col, value_set=pa.array(names, col.type))).to_pydict()
    into.update((r, fr) for r, fr in zip(d["request_id"], d["finish_reason"], strict=True) if fr)


def _finished_in_table(requests: pa.Table, names: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    if requests.num_rows:  # only the holders' rows: cheap on a long run's requests
        _finished_rows(requests.select(["request_id", "finish_reason"]), names, out)
    return out


def _finished_in_trace(tr: Trace, names: list[str]) -> dict[str, str]:
    """`_finished_in_table` over the trace's requests: two columns, the ids as Parquet's
    dictionary, each part as read (a request is a few dozen bytes; an event is what grows),
    the rows the memory table's snapshot committed (`Trace.table`)."""
    req = tr.table("requests", ["request_id", "finish_reason"], ("request_id",), coalesce=False)
    return _finished_in_table(req, names)


# ------------------------------------------------------------ the report
def leak_report(memory: pa.Table, requests: pa.Table, capacity: int, run_ended: bool,
                window_rows: int = stream.WINDOW_ROWS) -> LeakReport:
    """Replay `memory`; `requests` needs `request_id` and `finish_reason`; capacity = meta kv_blocks.
    Any string column may be dictionary-encoded (cheaper to read and to replay)."""
    pa.default_memory_pool().release_unused()  # the reader's freed decode buffers: lowers our peak
    inferred = capacity <= 0
    if inferred:
        top = pc.max(memory["block_id"]).as_py()
        capacity = max(-1, -1 if top is None else top) + 1
    rp = stream.WindowedReplay(capacity)
    for w in stream.table_windows(memory, window_rows):
        rp.feed(w)
    return _report(rp, inferred, run_ended, lambda names: _finished_in_table(requests, names))


def _report(rp: stream.WindowedReplay, inferred: bool, run_ended: bool,
            finished: Callable[[list[str]], dict[str, str]]) -> LeakReport:
    holders = rp.holders()
    leaks, running = _classify(holders, finished, run_ended)
    return LeakReport(
        capacity=rp.capacity, capacity_inferred=inferred, run_ended=run_ended, events=rp.events,
        final_held=len(holders), final_free=rp.capacity - len(holders), leaks=leaks,
        still_running=running, reclaimed=rp.reclaimed_sorted(), anomalies=rp.anomalies,
        num_anomalies=rp.num_anomalies, fragmentation=rp.fragmentation,
    )
