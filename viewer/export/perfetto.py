"""`mstrace export TRACE --perfetto OUT.pftrace`: the trace as Perfetto TrackEvents.

What ui.perfetto.dev shows:
- a process per rank, with a thread track per stream (main, prefill, comm, the
  scheduling thread's `host`, sender, tokenizer, http): every probe row is a slice
  named by its boundary, with its round in the `round` argument;
- a `rounds` track on rank 0: a slice per scheduling round;
- a `requests` process with an async track per request: `queued`, `prefill` (its
  chunks inside, one per round that ran one), `decode`; an instant at `finished`;
  flows from the request's prefill and decode slices to every round that produced one
  of its tokens;
- counters: free, used and fenced KV blocks, waiting and running requests, prefill and
  decode tokens per round;
- instants: preemptions, stalls (the wait cycle in the args) and leaked blocks.

Memory stays bounded: probe parts are read one at a time and streamed out in batches
of `BATCH` rows, encoded column-wise (viewer/export/wire.py). Everything else (a few
packets per round and per request) goes through the `perfetto` package's
StreamingTraceProtoBuilder.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracing.reader import Trace, read_parts
from tracing.schema import TABLES
from viewer.export import wire

BATCH = 200_000  # probe rows encoded at once
SEQ = 1  # one packet sequence: its interned names are set once, at its start
ROUND_ARG = 1  # the debug annotation name iid for "round"
STREAM_ORDER = ("host", "main", "prefill", "comm", "sender", "tokenizer", "http")
COUNTERS = (("blocks_free", "KV blocks free"), ("blocks_used", "KV blocks used"),
            ("blocks_fenced", "KV blocks fenced"), ("num_waiting", "requests waiting"),
            ("num_running", "requests running"), ("num_prefill_tokens", "prefill tokens / round"),
            ("num_decode_tokens", "decode tokens / round"))
# Track uuids: disjoint ranges per kind of track.
PROCESS, THREAD, ROUNDS, REQUESTS, COUNTER, REQUEST = 1 << 10, 1 << 20, 1 << 21, 1 << 22, 1 << 23, 1 << 32


@dataclass(slots=True)
class ExportStats:
    probe_rows: int = 0
    packets: int = 0
    rounds: int = 0
    requests: int = 0
    flows: int = 0
    tracks: dict[str, int] = field(default_factory=dict)  # track name -> uuid


def export_perfetto(root: str | Path, out: str | Path) -> ExportStats:
    from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

    trace = Trace.open(root)
    stats = ExportStats()
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    with open(tmp, "wb") as f:
        b = StreamingTraceProtoBuilder(f)
        names, threads = _header(trace, b, stats)
        lanes = _Lanes(threads)
        for chunk in _probe_chunks(trace):
            body = _probe_packets(chunk, names, lanes, stats)
            for uuid, (pid, tid, name) in lanes.new():  # a lane's track before its first slice
                _track(b, stats, uuid, name, thread=(pid, tid, name))
            f.write(body)
        steps = trace.table("steps") if trace.has_table("steps") else TABLES["steps"].empty_table()
        o = _Out(b, stats, names, _round_bounds(steps))
        flows = _requests(trace, o) if trace.has_table("requests") else (np.empty(0, np.int64),) * 2
        _rounds(o, steps, *flows)
        _counters(o, steps)
        _instants(trace, o, steps)
    tmp.replace(out)
    return stats


# ---- the header: tracks and interned names --------------------------------------------
def _header(trace: Trace, b: Any, stats: ExportStats) -> tuple[dict[str, int], dict[tuple[int, str], int]]:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket

    pairs: set[tuple[int, str]] = set()
    boundaries: set[str] = set()
    for chunk in _probe_chunks(trace, ["rank", "stream", "boundary"]):
        r, s, bd = chunk["rank"].to_numpy(), _strings(chunk["stream"]), _strings(chunk["boundary"])
        pairs |= set(zip(r.tolist(), s, strict=True))
        boundaries |= set(bd)
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
    names = {n: i + 1 for i, n in enumerate(sorted(boundaries | {"round", "request", "queued", "prefill", "prefill chunk",
                                                                  "decode", "finished", "preempted", "stall",
                                                                  "leaked blocks"}))}
    p = TracePacket(trusted_packet_sequence_id=SEQ, sequence_flags=TracePacket.SEQ_INCREMENTAL_STATE_CLEARED)
    for n, iid in names.items():
        p.interned_data.event_names.add(iid=iid, name=n)
    p.interned_data.debug_annotation_names.add(iid=ROUND_ARG, name="round")
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
    stats.tracks[name] = uuid


# ---- probe rows: the bulk, encoded column-wise ------------------------------------------
def _probe_chunks(trace: Trace, cols: list[str] | None = None) -> Iterator[pa.Table]:
    cols = cols or ["ts_ns", "dur_ns", "boundary", "stream", "rank", "step"]
    for part in trace.parts.get("probes", []):
        t = read_parts([part], TABLES["probes"], cols)
        for at in range(0, t.num_rows, BATCH):
            yield t.slice(at, BATCH)


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
        """Track uuids for one stream's rows (start order not required)."""
        key = (rank, stream)
        lanes = self._lanes.setdefault(key, [([], [0])])
        order = np.lexsort((-(end - start), start))
        st, en = start[order], end[order]
        out = np.empty(len(st), dtype=np.uint64)
        stack, hwm = lanes[0]
        prev = np.maximum.accumulate(en)
        if len(lanes) == 1 and not stack and st[0] >= hwm[0] and (len(st) == 1 or bool(np.all(st[1:] >= prev[:-1]))):
            out[:] = self._track(rank, stream, 0)  # one after another: the common case, without a loop
            hwm[0] = int(prev[-1])
        else:
            for i, (a, z) in enumerate(zip(st.tolist(), en.tolist(), strict=True)):
                out[i] = self._track(rank, stream, self._place(lanes, a, z))
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
            self._uuid[key] = base + (lane << 12)
            self._fresh.append((self._uuid[key], (rank + 1, (rank + 1) * 1000 + (base - THREAD) + (lane << 12),
                                                  f"{stream} #{lane + 1}")))
        return self._uuid[key]

    def new(self) -> list[tuple[int, tuple[int, int, str]]]:
        got, self._fresh = self._fresh, []
        return got


def _probe_packets(t: pa.Table, names: dict[str, int], lanes: _Lanes, stats: ExportStats) -> bytes:
    """Two packets per row (slice begin, slice end), ordered so that at one timestamp an
    end comes before a begin and an outer slice opens before and closes after an inner one."""
    n = t.num_rows
    if not n:
        return b""
    ts = t["ts_ns"].to_numpy().astype(np.int64)
    dur = np.maximum(t["dur_ns"].to_numpy().astype(np.int64), 0)
    end = ts + dur
    step = np.maximum(t["step"].to_numpy().astype(np.int64), 0)
    rank, stream, bnd = t["rank"].to_numpy(), _strings(t["stream"]), _strings(t["boundary"])
    track = np.empty(n, dtype=np.uint64)
    keys = np.array([f"{r}\x00{s}" for r, s in zip(rank.tolist(), stream, strict=True)], dtype=object)
    for key in set(keys.tolist()):
        idx = np.flatnonzero(keys == key)
        r, s = key.split("\x00", 1)
        track[idx] = lanes.assign(int(r), s, ts[idx], end[idx])
    name = np.fromiter((names[x] for x in bnd), dtype=np.uint64, count=n)
    u = np.uint64
    da = [b"\x08", np.full(n, ROUND_ARG, u), b"\x20", step.astype(u)]  # DebugAnnotation{name_iid, int_value}
    te_b = [b"\x22", wire.lengths(da, n).astype(u), *da, b"\x48\x01", b"\x50", name, b"\x58", track]
    te_e = [b"\x48\x02", b"\x58", track]

    def packets(ts_: np.ndarray, te: list[wire.Piece]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        body = [b"\x40", ts_.astype(u), b"\x50", np.full(n, SEQ, u), b"\x5a", wire.lengths(te, n).astype(u), *te,
                b"\x68\x02"]  # sequence_flags: SEQ_NEEDS_INCREMENTAL_STATE (the interned names)
        whole = [b"\x0a", wire.lengths(body, n).astype(u), *body]  # Trace.packet
        buf, start = wire.encode(whole, n)
        return buf, start, wire.lengths(whole, n)

    bb, bs, bl = packets(ts, te_b)
    eb, es, el = packets(end, te_e)
    buf = np.concatenate([bb, eb])
    start = np.concatenate([bs, es + len(bb)])
    size = np.concatenate([bl, el])
    # sort keys: time; then ends (1 before 0-length begins' ends) before begins; outer first
    t_all = np.concatenate([ts, end])
    kind = np.concatenate([np.ones(n, np.int64), np.where(dur > 0, 0, 2)])
    inner = np.concatenate([-dur, -ts])  # begins: the longer first; ends: the later-started first
    order = np.lexsort((inner, kind, t_all))
    stats.probe_rows += n
    stats.packets += 2 * n
    return wire.gather(buf, start, size, order)


# ---- rounds, counters, requests, instants (the protobuf classes) --------------------------
@dataclass(slots=True)
class _Out:
    b: Any  # StreamingTraceProtoBuilder
    stats: ExportStats
    names: dict[str, int]
    rounds: dict[int, tuple[int, int]]  # step -> (start, end)

    def slice(self, track: int, name: str, t0: int, t1: int, round_: int | None = None,
              flows: list[int] | None = None, terminating: list[int] | None = None,
              args: dict[str, Any] | None = None) -> None:
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

        e = self._event(t0, track, TrackEvent.TYPE_SLICE_BEGIN, name, args, round_)
        if flows:
            e.track_event.flow_ids.extend(flows)
        if terminating:
            e.track_event.terminating_flow_ids.extend(terminating)
        self.b.write_packet(e)
        self.b.write_packet(self._event(t1, track, TrackEvent.TYPE_SLICE_END))
        self.stats.packets += 2

    def instant(self, track: int, name: str, t: int, args: dict[str, Any]) -> None:
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackEvent

        self.b.write_packet(self._event(t, track, TrackEvent.TYPE_INSTANT, name, args))
        self.stats.packets += 1

    def _event(self, t: int, track: int, kind: int, name: str | None = None, args: dict[str, Any] | None = None,
               round_: int | None = None) -> Any:
        from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket

        p = TracePacket(timestamp=t, trusted_packet_sequence_id=SEQ,
                        sequence_flags=TracePacket.SEQ_NEEDS_INCREMENTAL_STATE)
        e = p.track_event
        e.type, e.track_uuid = kind, track
        if name is not None:
            e.name_iid = self.names[name]
        if round_ is not None:
            e.debug_annotations.add(name_iid=ROUND_ARG, int_value=round_)
        for k, v in (args or {}).items():
            if isinstance(v, int):
                e.debug_annotations.add(name=k, int_value=v)
            else:
                e.debug_annotations.add(name=k, string_value=v if isinstance(v, str) else json.dumps(v))
        return p


def _round_bounds(steps: pa.Table) -> dict[int, tuple[int, int]]:
    ts, dur, step = (steps[c].to_numpy() for c in ("ts_ns", "dur_ns", "step"))
    return {int(k): (int(a), int(a) + max(0, int(d))) for k, a, d in zip(step.tolist(), ts.tolist(), dur.tolist(),
                                                                         strict=True)}


def _requests(trace: Trace, o: _Out) -> tuple[np.ndarray, np.ndarray]:
    """An async track per request; returns the flows, as (round, flow id) arrays."""
    cols = ["request_id", "arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns", "token_runs",
            "prompt_len", "output_len", "cached_prefix_len", "finish_reason", "num_preemptions"]
    q = trace.table("requests", cols)
    tracks: dict[str, tuple[int, int, int]] = {}  # request id -> (uuid, prefill start, prefill end)
    flow_step: list[np.ndarray] = []
    flow_id: list[np.ndarray] = []
    next_flow = 1
    runs = q["token_runs"]
    for i, r in enumerate(q.drop_columns(["token_runs"]).to_pylist()):
        uuid = REQUEST + i
        _track(o.b, o.stats, uuid, r["request_id"], parent=REQUESTS)
        a = r["arrival_ns"]
        s = max(a, r["first_scheduled_ns"] or a)
        e = max(s, r["finish_ns"])
        f = min(e, max(s, r["first_token_ns"])) if r["first_token_ns"] > 0 else e
        rr = np.asarray(runs[i].values.to_numpy(zero_copy_only=False) if runs[i].is_valid else [], dtype=np.int64)
        steps = np.concatenate([np.arange(x, x + c) for x, c in zip(rr[0::2], rr[1::2], strict=True)]) \
            if len(rr) else np.empty(0, np.int64)
        ids = np.arange(next_flow, next_flow + len(steps), dtype=np.int64)
        next_flow += len(steps)
        flow_step.append(steps)
        flow_id.append(ids)
        args = {k: r[k] for k in ("prompt_len", "output_len", "cached_prefix_len", "finish_reason", "num_preemptions")}
        o.slice(uuid, "request", a, e, flows=ids.tolist(), args=args)
        o.slice(uuid, "queued", a, s)
        o.slice(uuid, "prefill", s, f) if f > s else None
        o.slice(uuid, "decode", f, e) if e > f else None
        o.instant(uuid, "finished", e, {"finish_reason": r["finish_reason"] or ""})
        tracks[r["request_id"]] = (uuid, s, f)
    o.stats.requests = q.num_rows
    o.stats.flows = next_flow - 1
    if trace.has_table("timeline"):
        _chunks_and_preemptions(trace, o, tracks)
    if not flow_step:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(flow_step), np.concatenate(flow_id)


def _chunks_and_preemptions(trace: Trace, o: _Out, tracks: dict[str, tuple[int, int, int]]) -> None:
    tl = trace.table("timeline", ["ts_ns", "request_id", "stage", "step", "value"])
    stage = _strings(tl["stage"])
    keep = [i for i, x in enumerate(stage) if x in ("prefill_chunk", "preempted")]
    rows = tl.take(pa.array(keep, pa.int64())).to_pylist() if keep else []
    done: dict[str, int] = {}  # request id -> where its last chunk slice ended
    for r in sorted(rows, key=lambda x: x["ts_ns"]):
        got = tracks.get(r["request_id"])
        if got is None:
            continue
        uuid, s, f = got
        if r["stage"] == "preempted":
            o.instant(uuid, "preempted", r["ts_ns"], {"computed_tokens": int(r["value"])})
            continue
        b0, b1 = o.rounds.get(int(r["step"]), (r["ts_ns"], r["ts_ns"]))
        # inside the request's prefill slice, after its previous chunk: nesting stays valid
        lo = max(b0, s, done.get(r["request_id"], s))
        hi = min(max(b1, lo), f)
        if hi > lo:
            o.slice(uuid, "prefill chunk", lo, hi, round_=int(r["step"]), args={"tokens": int(r["value"])})
            done[r["request_id"]] = hi


def _rounds(o: _Out, steps: pa.Table, flow_step: np.ndarray, flow_id: np.ndarray) -> None:
    """A slice per round on rank 0's `rounds` track, ending the flows of its requests."""
    order = np.argsort(flow_step, kind="stable")
    fs, fid = flow_step[order], flow_id[order]
    for k in sorted(o.rounds, key=lambda k: o.rounds[k]):
        t0, t1 = o.rounds[k]
        lo, hi = np.searchsorted(fs, [k, k + 1])
        o.slice(ROUNDS, "round", t0, t1, round_=k, terminating=fid[lo:hi].tolist())
    o.stats.rounds = len(o.rounds)


def _counters(o: _Out, steps: pa.Table) -> None:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent

    ts = steps["ts_ns"].to_numpy()
    order = np.argsort(ts, kind="stable")
    for k, (col, _) in enumerate(COUNTERS):
        if col not in steps.column_names:
            continue
        vals = steps[col].to_numpy()[order].tolist()
        for t, v in zip(ts[order].tolist(), vals, strict=True):
            p = TracePacket(timestamp=t, trusted_packet_sequence_id=SEQ)
            p.track_event.type, p.track_event.track_uuid = TrackEvent.TYPE_COUNTER, COUNTER + k
            p.track_event.counter_value = int(v)
            o.b.write_packet(p)
        o.stats.packets += len(vals)


def _instants(trace: Trace, o: _Out, steps: pa.Table) -> None:
    """Stalls (with their wait cycle) and leaked blocks, on rank 0's `rounds` track."""
    if trace.has_table("stalls"):
        for r in trace.table("stalls").to_pylist():
            o.instant(ROUNDS, "stall", int(r["ts_ns"]), {k: r[k] for k in ("rank", "step", "waiter", "what",
                                                                           "signaller", "boundary", "waited_ns",
                                                                           "cycle") if k in r})
    if trace.has_table("memory") and trace.has_table("requests"):
        from tracing.consistency import read_consistent
        from viewer.analysis.leaks import leak_report

        t = read_consistent(trace, {"memory": None, "requests": ["request_id", "finish_reason"]},
                            dictionary={"memory": ("request_id",)})
        rep = leak_report(t["memory"], t["requests"], int(trace.meta.get("model", {}).get("kv_blocks") or 0),
                          run_ended=trace.status.complete)
        end = max((b for _, b in o.rounds.values()), default=0)
        for h in rep.leaks:
            o.instant(ROUNDS, "leaked blocks", end, {"request_id": h.request_id, "blocks": len(h.block_ids),
                                                     "block_ids": h.block_ids[:64]})


def _strings(col: pa.ChunkedArray | pa.Array) -> list[str]:
    return col.cast(pa.string()).to_pylist() if pa.types.is_dictionary(col.type) else col.to_pylist()


def _stream_rank(s: str) -> int:
    return STREAM_ORDER.index(s) if s in STREAM_ORDER else len(STREAM_ORDER)
