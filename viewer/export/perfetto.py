"""`mstrace export TRACE --perfetto OUT.pftrace`: the trace as Perfetto TrackEvents.

What ui.perfetto.dev shows:
- a process per rank, with a thread track per stream (main, prefill, comm, the
  scheduling thread's `host`, sender, tokenizer, http): every probe row is a slice
  named by its boundary, with its round in the `round` argument; but a `tokenize` row
  (a request's stay in the tokenizer pool: queueing + encoding) is cut in two where
  the pool's thread can first have taken it (`pool_starts`): the thread's part on the
  `tokenizer` track, the wait before it as `tokenize wait` on the request's track;
- a `rounds` track on rank 0: a slice per scheduling round;
- a `requests` process with an async track per request: `queued`, `prefill` (its
  chunks inside, one per round that ran one), `decode`; an instant at `finished`;
  flows from the request to the rounds where it entered and left the batch: each round
  that ran one of its prefill chunks, and the round of its last token. (A flow to every
  round it decoded in would be 50 M flows for a 10 M-row trace: too many for the UI.);
- counters: free, used and fenced KV blocks, waiting and running requests, prefill and
  decode tokens per round;
- instants: preemptions, stalls (the wait cycle in the args) and leaked blocks.

Memory stays bounded: probe parts are read one at a time and streamed out in batches
of `BATCH` rows. The bulk (probe rows, rounds, counters, requests) is encoded
column-wise (viewer/export/perfetto_bulk.py); the header and the rare events (stalls,
leaks, preemptions) go through the `perfetto` package's StreamingTraceProtoBuilder.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from probes import boundaries as B
from tracing.reader import Trace, read_parts
from tracing.schema import TABLES
from viewer.analysis.cycle_views import codes
from viewer.export import perfetto_bulk as bulk
from viewer.export.perfetto_bulk import (
    ARGS,
    COUNTER,
    COUNTERS,
    LANE,
    NAMES,
    PROCESS,
    REQUESTS,
    ROUNDS,
    THREAD,
)
from viewer.export.perfetto_rounds import instants, leak_counts, requests, rounds, timeline_rows
from viewer.export.window import Window, table_in, windowed
from viewer.live.state import STREAM_ORDER

BATCH = 200_000  # probe rows encoded at once
SEQ = bulk.SEQ  # one packet sequence: its interned names are set once, at its start


@dataclass(slots=True)
class ExportStats:
    probe_rows: int = 0
    packets: int = 0
    rounds: int = 0
    requests: int = 0
    flows: int = 0
    trace_probe_rows: int = 0  # the whole trace's, as committed: what a window left out is the difference
    trace_rounds: int = 0


def export_perfetto(root: str | Path, out: str | Path, window: Window | None = None) -> ExportStats:
    """The trace, or the part of it in `window` (viewer/export/window.py), as a Perfetto file."""
    trace = Trace.open(root)
    stats = ExportStats(trace_probe_rows=_committed_rows(trace, "probes"), trace_rounds=_committed_rows(trace, "steps"))
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    try:
        _write(trace, tmp, stats, window)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file where the user looks
        raise
    tmp.replace(out)
    return stats


def _committed_rows(trace: Trace, name: str) -> int:
    """A table's rows, from the manifest (a legacy trace's parts: their footers), none read."""
    return sum(p.rows if p.rows is not None else pq.read_metadata(p.path).num_rows for p in trace.parts.get(name, []))


def _write(trace: Trace, tmp: Path, stats: ExportStats, window: Window | None) -> None:
    # The leak count and the requests' timeline rows read their own tables: on the other core
    # while the probe rows are encoded (the timeline rows are held meanwhile). On an error,
    # what has not started does not start.
    side = ThreadPoolExecutor(1)
    try:
        _write_with(trace, tmp, stats, window, side)
    finally:
        side.shutdown(cancel_futures=True)


def _write_with(trace: Trace, tmp: Path, stats: ExportStats, window: Window | None, side: ThreadPoolExecutor) -> None:
    from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

    with open(tmp, "wb") as f:
        leaks = side.submit(leak_counts, trace, window)
        timeline = side.submit(timeline_rows, trace, window) if trace.has_table("requests") else None
        b = StreamingTraceProtoBuilder(f)
        names, threads = _header(trace, b, stats, window)
        lanes = _Lanes(threads)
        pool = _Pool(trace.meta.get("config", {}).get("tokenizer_threads"))
        for chunk in _probe_chunks(trace, window=window):
            body = _probe_packets(pool.take(chunk), names, lanes, stats)
            for uuid, (pid, tid, name) in lanes.new():  # a lane's track before its first slice
                _track(b, stats, uuid, name, thread=(pid, tid, name))
            f.write(body)
        steps = table_in(trace, "steps", TABLES["steps"].names, window)
        steps = steps.take(pc.sort_indices(steps, [("ts_ns", "ascending")]))
        for k, (col, _) in enumerate(COUNTERS):
            if col in steps.column_names:
                f.write(bulk.counter(steps["ts_ns"].to_numpy(), COUNTER + k, steps[col].to_numpy()))
                stats.packets += steps.num_rows
        # a held row's wait goes on its request's track; the row of no request stays whole
        a, s, e = pool.split()
        flows, waited = requests(trace, f, names, steps, stats, (a, s, e), timeline.result(), window) \
            if timeline is not None else (None, np.zeros(len(a), dtype=bool))
        held = pool.rows(np.where(waited, s, a), e)
        if held is not None:
            body = _probe_packets(held, names, lanes, stats)
            for uuid, (pid, tid, name) in lanes.new():
                _track(b, stats, uuid, name, thread=(pid, tid, name))
            f.write(body)
        rounds(f, steps, flows, names, stats)
        instants(trace, b, names, steps, stats, leaks.result(), window)


# ---- the header: tracks and interned names --------------------------------------------
def _header(trace: Trace, b: Any, stats: ExportStats,
            window: Window | None) -> tuple[dict[str, int], dict[tuple[int, str], int]]:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket

    pairs: set[tuple[int, str]] = set()
    boundaries: set[str] = set()
    for chunk in _probe_chunks(trace, ["rank", "stream", "boundary"], window):
        (s_code, s_names), (b_code, b_names) = codes(chunk["stream"]), codes(chunk["boundary"])
        key = chunk["rank"].to_numpy().astype(np.int64) * len(s_names) + s_code  # (a dictionary may hold unused names)
        pairs |= {(k // len(s_names), s_names[k % len(s_names)]) for k in np.flatnonzero(np.bincount(key)).tolist()}
        boundaries |= {b_names[c] for c in np.flatnonzero(np.bincount(b_code)).tolist()}
    ranks = sorted({r for r, _ in pairs} | {0})
    for r in ranks:
        _track(b, stats, PROCESS + r, f"rank {r}", process=(r + 1, f"rank {r}"))
    threads: dict[tuple[int, str], int] = {}
    for i, (r, s) in enumerate(sorted(pairs, key=lambda p: (p[0], _stream_rank(p[1]), p[1]))):
        threads[(r, s)] = THREAD + i
        _track(b, stats, THREAD + i, f"r{r} {s}", thread=(r + 1, (r + 1) * 1000 + i, s))
    _track(b, stats, ROUNDS, "rounds", parent=PROCESS + 0)
    _track(b, stats, REQUESTS, "requests", process=(1 << 20, "requests"))
    for k, (_, title) in enumerate(COUNTERS):
        _track(b, stats, COUNTER + k, title, parent=PROCESS + 0, counter=True)
    # The names every slice of the sequence refers to by number.
    names = {n: i + 1 for i, n in enumerate(sorted(boundaries | set(NAMES)))}
    p = TracePacket(trusted_packet_sequence_id=SEQ, sequence_flags=TracePacket.SEQ_INCREMENTAL_STATE_CLEARED)
    for n, iid in names.items():
        p.interned_data.event_names.add(iid=iid, name=n)
    for n, iid in ARGS.items():
        p.interned_data.debug_annotation_names.add(iid=iid, name=n)
    b.write_packet(p)
    stats.packets += 1
    return names, threads


def _track(b: Any, stats: ExportStats, uuid: int, name: str, parent: int | None = None,
           process: tuple[int, str] | None = None, thread: tuple[int, int, str] | None = None,
           counter: bool = False) -> None:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket

    p = TracePacket()
    d = p.track_descriptor
    d.uuid = uuid
    if process is not None:
        d.process.pid, d.process.process_name = process
    elif thread is not None:
        d.thread.pid, d.thread.tid, d.thread.thread_name = thread
    else:
        d.name = name
    if parent is not None:
        d.parent_uuid = parent
    if counter:
        d.counter.SetInParent()
    b.write_packet(p)
    stats.packets += 1


# ---- probe rows: the bulk, encoded column-wise ------------------------------------------
def _probe_chunks(trace: Trace, cols: list[str] | None = None, window: Window | None = None) -> Iterator[pa.Table]:
    cols = cols or ["ts_ns", "dur_ns", "boundary", "stream", "rank", "step"]
    parts = (read_parts([part], TABLES["probes"], cols) for part in trace.parts.get("probes", [])) \
        if window is None else windowed(trace, "probes", cols, window)
    for t in _read_ahead(parts):
        for at in range(0, t.num_rows, BATCH):
            yield t.slice(at, BATCH)


def _read_ahead(parts: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """The parts, the next one read on a thread while this one is encoded: Parquet's
    decoding, numpy's passes and the C encoder release the GIL, so on two cores the
    reads mostly vanish. At most three parts are held (the one encoded, the next, and
    for a moment the one after it)."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(next, parts, None)
        while (t := pending.result()) is not None:
            pending = pool.submit(next, parts, None)
            yield t


def pool_starts(start: np.ndarray, end: np.ndarray, threads: int) -> np.ndarray:
    """The earliest time a thread of a pool of `threads` can have taken each row (a
    request's stay in the pool, from its arrival to the end of its encoding): the part
    before it is certainly queueing. The probe records no encode start, so this is a
    bound, not a guess: with one thread, the end of the row the thread finished before
    (the thread works one request after another, so the rows' ends are its order);
    with more, FIFO in arrival order, the `threads`-th latest end of the rows that
    arrived before (at most `threads` - 1 of them can still be in the pool's threads;
    rows that arrived at the same nanosecond do not count for each other).
    Between a row's bound and its end lies the encoding and, with more threads, maybe
    some queueing the data cannot tell from it."""
    s = start.astype(np.int64).copy()
    if threads <= 1:
        order = np.lexsort((start, end))
        e = end[order].astype(np.int64)
        prev = np.concatenate([[np.iinfo(np.int64).min], e[:-1]])
        s[order] = np.minimum(np.maximum(s[order], prev), e)
        return s
    latest: list[int] = []  # a heap of the `threads` latest ends of the rows that arrived before
    order = np.argsort(start, kind="stable")
    a = start[order].tolist()
    e = end[order].tolist()
    at = 0
    while at < len(a):  # rows that arrived together: none is known to have been taken first
        to = at
        while to < len(a) and a[to] == a[at]:
            to += 1
        if len(latest) == threads:
            s[order[at:to]] = np.minimum(max(a[at], latest[0]), end[order[at:to]])
        for z in e[at:to]:
            heapq.heappush(latest, z)
            if len(latest) > threads:
                heapq.heappop(latest)
        at = to
    return s


class _Pool:
    """The tokenizer pool's `tokenize` rows (one per request), held back from the bulk
    until all are read, to be cut where the pool's thread can first have taken each
    (`pool_starts`); none are held when the trace does not say how many threads the
    pool had."""

    def __init__(self, threads: Any) -> None:
        self._threads = threads if isinstance(threads, int) and threads >= 1 else None
        self._held: list[pa.Table] = []
        self._t: pa.Table | None = None

    def take(self, t: pa.Table) -> pa.Table:
        """The chunk without its rows held back."""
        if self._threads is None or not t.num_rows:
            return t
        (s_code, s_names), (b_code, b_names) = codes(t["stream"]), codes(t["boundary"])
        if "tokenizer" not in s_names or B.TOKENIZE not in b_names:
            return t
        m = (s_code == s_names.index("tokenizer")) & (b_code == b_names.index(B.TOKENIZE))
        if not m.any():
            return t
        self._held.append(t.filter(pa.array(m)))
        return t.filter(pa.array(~m))

    def split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(arrival, the thread's earliest start, end) of each held row."""
        self._t = pa.concat_tables(self._held) if self._held else None
        self._held = []
        if self._t is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        a = self._t["ts_ns"].to_numpy().astype(np.int64)
        e = a + np.maximum(self._t["dur_ns"].to_numpy().astype(np.int64), 0)
        return a, pool_starts(a, e, self._threads or 1), e

    def rows(self, start: np.ndarray, end: np.ndarray) -> pa.Table | None:
        """The held rows from these starts: the slices for the thread's track."""
        if self._t is None:
            return None
        t = self._t.set_column(self._t.schema.get_field_index("ts_ns"), "ts_ns", pa.array(start, pa.int64()))
        return t.set_column(t.schema.get_field_index("dur_ns"), "dur_ns", pa.array(end - start, pa.int64()))


class _Lanes:
    """Which track each probe row goes on. Rows of one stream that overlap without
    nesting (a tokenizer pool's concurrent requests, an HTTP server's connections)
    cannot share a track: Perfetto pairs a slice's end with the innermost open slice.
    Such a row goes on the stream's next lane, a thread track of its own ("tokenizer #2").
    A lane accepts a row that starts after everything it has closed and nests inside
    its innermost open row (or starts a new top-level one)."""

    def __init__(self, threads: dict[tuple[int, str], int]) -> None:
        self._threads = threads
        self._lanes: dict[tuple[int, str], list[tuple[list[tuple[int, int]], list[int]]]] = {}
        self._uuid: dict[tuple[int, str, int], int] = {}
        self._fresh: list[tuple[int, tuple[int, int, str]]] = []

    def assign(self, rank: int, stream: str, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Track uuids for one stream's rows (start order not required).

        A row that starts after every earlier row of the stream has ended goes on lane 0
        without a loop (most rows: a stream mostly runs one op at a time); only the others
        go through `_place`, in order, with lane 0 brought up to date before each."""
        lanes = self._lanes.setdefault((rank, stream), [([], [0])])
        order = np.lexsort((-(end - start), start))
        st, en = start[order], end[order]
        stack0, hwm0 = lanes[0]
        base = max([hwm0[0], *(z for _, z in stack0)])
        seen = np.maximum.accumulate(np.concatenate([[base], en]))[:-1]
        ok = st >= seen
        acc = np.flatnonzero(ok)
        lane = np.zeros(len(st), dtype=np.int64)
        synced = -1
        bad = np.flatnonzero(~ok).tolist()
        stl, enl = (st.tolist(), en.tolist()) if bad else (st, en)  # Python ints only where the loop needs them
        for v in bad:
            j = int(np.searchsorted(acc, v)) - 1
            if j >= 0 and j != synced:  # accepted rows up to acc[j]: all closed but acc[j]
                hwm0[0] = max([hwm0[0], *(z for _, z in stack0), enl[acc[j - 1]] if j else hwm0[0]])
                stack0[:] = [(stl[acc[j]], enl[acc[j]])]
                synced = j
            lane[v] = self._place(lanes, stl[v], enl[v])
        if len(acc) and synced != len(acc) - 1:
            j = len(acc) - 1
            hwm0[0] = max([hwm0[0], *(z for _, z in stack0), int(enl[acc[j - 1]]) if j else hwm0[0]])
            stack0[:] = [(int(stl[acc[j]]), int(enl[acc[j]]))]
        out = np.empty(len(st), dtype=np.uint64)
        for k in np.flatnonzero(np.bincount(lane)).tolist():
            out[lane == k] = self._track(rank, stream, k)
        res = np.empty_like(out)
        res[order] = out
        return res

    @staticmethod
    def _place(lanes: list[tuple[list[tuple[int, int]], list[int]]], a: int, z: int) -> int:
        for k, (stack, hwm) in enumerate(lanes):
            while stack and stack[-1][1] <= a:
                hwm[0] = max(hwm[0], stack.pop()[1])
            if a >= hwm[0] and (not stack or (stack[-1][0] <= a and z <= stack[-1][1])):
                stack.append((a, z))
                return k
        lanes.append(([(a, z)], [0]))
        return len(lanes) - 1

    def _track(self, rank: int, stream: str, lane: int) -> int:
        if lane == 0:
            return self._threads[(rank, stream)]
        key = (rank, stream, lane)
        if key not in self._uuid:
            base = self._threads[(rank, stream)]
            # a range of their own: base + (lane << 12) ran into ROUNDS' uuid past 255 lanes
            self._uuid[key] = LANE + len(self._uuid)
            self._fresh.append((self._uuid[key], (rank + 1, (rank + 1) * 1000 + (base - THREAD) + (lane << 12),
                                                  f"{stream} #{lane + 1}")))
        return self._uuid[key]

    def new(self) -> list[tuple[int, tuple[int, int, str]]]:
        got, self._fresh = self._fresh, []
        return got


def _probe_packets(t: pa.Table, names: dict[str, int], lanes: _Lanes, stats: ExportStats) -> bytes:
    n = t.num_rows
    if not n:
        return b""
    ts = t["ts_ns"].to_numpy().astype(np.int64)
    end = ts + np.maximum(t["dur_ns"].to_numpy().astype(np.int64), 0)
    b_code, b_names = codes(t["boundary"])
    s_code, s_names = codes(t["stream"])
    rank = t["rank"].to_numpy().astype(np.int64)
    key = rank * (len(s_names) + 1) + s_code
    track = np.empty(n, dtype=np.uint64)
    for k in np.flatnonzero(np.bincount(key)).tolist():
        idx = np.flatnonzero(key == k)
        track[idx] = lanes.assign(int(rank[idx[0]]), s_names[s_code[idx[0]]], ts[idx], end[idx])
    name = np.array([names.get(x, 0) for x in b_names], dtype=np.uint64)[b_code]  # (0: a value no row of a window uses)
    stats.probe_rows += n
    stats.packets += 2 * n
    return bulk.slices([(ts, end, track, name, bulk.int_arg(ARGS["round"], t["step"].to_numpy()))])


def _stream_rank(s: str) -> int:
    return STREAM_ORDER.index(s) if s in STREAM_ORDER else len(STREAM_ORDER)
