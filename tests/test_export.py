"""`mstrace export`: a Perfetto trace parsed back with the package's own protobuf classes,
and request spans replayed to an OTLP/HTTP receiver on loopback."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.cli import mstrace
from tests.support.otlp_receiver import Receiver, receiver
from tests.support.tiny_runs import TinyRuns, session_root
from tracing.reader import read_table
from viewer.export import wire


@pytest.fixture(scope="module")
def tp2(tiny_runs: TinyRuns) -> Path:
    return tiny_runs("--tp", "2", "--requests", "12", "--shared-prefix", "0.5", "-q").out


@pytest.fixture(scope="module")
def texts(tiny_runs: TinyRuns, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve text prompts arriving together: all but the first wait in the tokenizer pool
    (token-id prompts skip it)."""
    import json
    import os

    wl = session_root(tmp_path_factory) / "twelve-texts.jsonl"
    if not wl.exists():  # the same bytes whichever worker writes them
        tmp = wl.with_suffix(f".{os.getpid()}")
        tmp.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"def f{i}(x):\n    return x * {i} + " * (i + 2),
                                           "max_new_tokens": 4, "arrival_s": 0}) + "\n" for i in range(12)))
        os.replace(tmp, wl)
    return tiny_runs("--workload", str(wl), "-q").out


def _parse(path: Path) -> dict[str, Any]:
    """The file as trace processor reads it: packets sorted by time (file order for ties),
    each slice end closing its track's innermost open slice."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent

    tr = Trace.FromString(path.read_bytes())
    names: dict[int, str] = {}
    tracks: dict[int, Any] = {}
    for p in tr.packet:
        if p.HasField("interned_data"):
            names.update({e.iid: e.name for e in p.interned_data.event_names})
        if p.HasField("track_descriptor"):
            tracks[p.track_descriptor.uuid] = p.track_descriptor
    events = sorted(((p.timestamp, i, p.track_event) for i, p in enumerate(tr.packet) if p.HasField("track_event")),
                    key=lambda x: (x[0], x[1]))
    open_: dict[int, list[tuple[str, int, Any]]] = defaultdict(list)
    slices: list[tuple[int, str, int, int, Any]] = []  # (track, name, start, end, begin event)
    instants, counters, bad = [], Counter(), 0
    for t, _, e in events:
        if e.type == TrackEvent.TYPE_SLICE_BEGIN:
            open_[e.track_uuid].append((names[e.name_iid], t, e))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            if not open_[e.track_uuid]:
                bad += 1
                continue
            n, t0, b = open_[e.track_uuid].pop()
            slices.append((e.track_uuid, n, t0, t, b))
        elif e.type == TrackEvent.TYPE_INSTANT:
            instants.append((e.track_uuid, names[e.name_iid], t, e))
        elif e.type == TrackEvent.TYPE_COUNTER:
            counters[e.track_uuid] += 1
    bad += sum(len(v) for v in open_.values())
    return {"tracks": tracks, "slices": slices, "instants": instants, "counters": counters, "unpaired": bad}


def _thread_key(tracks: dict[int, Any], uuid: int) -> tuple[int, str] | None:
    d = tracks[uuid]
    return (d.thread.pid - 1, d.thread.thread_name.split(" #")[0]) if d.HasField("thread") else None


def test_a_tp2_export_has_every_probe_row_as_a_slice_with_valid_nesting(tp2: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pftrace"
    p = mstrace("export", str(tp2), "--perfetto", str(out))
    assert p.returncode == 0, p.stderr
    got = _parse(out)
    tracks = got["tracks"]
    assert got["unpaired"] == 0
    processes = {d.process.process_name for d in tracks.values() if d.HasField("process")}
    assert {"rank 0", "rank 1", "requests"} <= processes
    threads = {_thread_key(tracks, u) for u in tracks} - {None}
    assert {(0, "main"), (1, "main"), (0, "host"), (0, "comm")} <= threads  # type: ignore[operator]
    # Every probe row comes back as exactly the slice it was: same track, name, start and end.
    # (A slice that closed before its child would pair with the wrong end and break this.)
    # A `tokenize` row is cut in two (the next test); here it starts where its wait ends.
    probes = read_table(tp2, "probes")
    want = Counter(zip(probes["rank"].to_pylist(), probes["stream"].cast("string").to_pylist(),
                       probes["boundary"].cast("string").to_pylist(), probes["ts_ns"].to_pylist(),
                       (np.asarray(probes["ts_ns"]) + np.maximum(np.asarray(probes["dur_ns"]), 0)).tolist(),
                       strict=True))
    wait_end = {t0: t1 for _, n, t0, t1, _ in got["slices"] if n == "tokenize wait"}
    have = Counter((*k, n, {v: k for k, v in wait_end.items()}.get(t0, t0) if n == "tokenize" else t0, t1)
                   for u, n, t0, t1, _ in got["slices"] if (k := _thread_key(tracks, u)) is not None)
    assert have == want
    per_boundary = Counter(n for u, n, *_ in got["slices"] if _thread_key(tracks, u) is not None)
    assert per_boundary == Counter(probes["boundary"].cast("string").to_pylist())
    # each probe slice carries its round
    one = next(b for u, _, _, _, b in got["slices"] if _thread_key(tracks, u) is not None)
    assert [a.int_value for a in one.debug_annotations if a.name_iid == 1]


def test_one_tokenizer_thread_is_one_track_its_queue_wait_on_the_requests(texts: Path, tmp_path: Path) -> None:
    """A `tokenize` row spans a request's stay in the pool, queueing + encoding: twelve
    requests arriving at once overlapped on the one thread's track and took eleven more
    (`tokenizer #2`...). Now the thread's track holds each request from the end of the one
    before (the thread's busy part), and the wait before it is `tokenize wait` on the
    request's own track: each row's time exactly once, and one tokenizer track."""
    out = tmp_path / "t.pftrace"
    assert mstrace("export", str(texts), "--perfetto", str(out)).returncode == 0
    got = _parse(out)
    tracks = got["tracks"]
    assert got["unpaired"] == 0
    assert [d.thread.thread_name for d in tracks.values()
            if d.HasField("thread") and d.thread.thread_name.startswith("tokenizer")] == ["tokenizer"]
    busy = sorted((t0, t1) for u, n, t0, t1, _ in got["slices"] if n == "tokenize")
    assert all(a[1] <= b[0] for a, b in zip(busy, busy[1:], strict=False))  # one thread: one at a time
    waits = {tracks[u].name: (t0, t1) for u, n, t0, t1, _ in got["slices"] if n == "tokenize wait"}
    assert waits  # the twelve arrive together: all but the first wait
    q = read_table(texts, "requests")
    probes = read_table(texts, "probes").to_pylist()
    rows = sorted((r["ts_ns"], r["ts_ns"] + r["dur_ns"]) for r in probes if r["boundary"] == "tokenize")
    assert len(rows) == q.num_rows == len(busy)
    # every row is its wait (on its request's track, from its arrival) and its busy part, or just the busy part
    pieces = []
    for rid, a, tok in zip(q["request_id"].to_pylist(), q["arrival_ns"].to_pylist(), q["tokenized_ns"].to_pylist(),
                           strict=True):
        s = waits[rid][1] if rid in waits else a
        assert rid not in waits or waits[rid][0] == a < s
        assert (s, tok) in busy
        pieces.append((a, tok))
    assert sorted(pieces) == rows
    assert sum(t1 - t0 for t0, t1 in busy) + sum(t1 - t0 for t0, t1 in waits.values()) == \
        sum(e - a for a, e in rows)


def test_a_pool_thread_can_first_have_taken_a_request_no_earlier_than_the_bound() -> None:
    """`pool_starts` against a simulated FIFO pool: never after the thread's real start nor
    before the arrival, exact with one thread, and at most `threads` busy parts at once
    (arrivals apart)."""
    import heapq

    from viewer.export.perfetto import pool_starts

    rng = np.random.default_rng(1)
    for threads in (1, 2, 4):
        arrival = np.sort(rng.choice(10_000, 300, replace=False))  # (rows that arrived together may all
        # start at the bound: which of them a thread took first is unknown)
        free = [0] * threads  # each thread's end of its last request
        start = np.empty(300, np.int64)
        end = np.empty(300, np.int64)
        for i, a in enumerate(arrival.tolist()):
            f = heapq.heappop(free)
            start[i] = max(a, f)
            end[i] = start[i] + int(rng.integers(1, 200))
            heapq.heappush(free, int(end[i]))
        order = rng.permutation(300)  # rows come in any order
        s = pool_starts(arrival[order], end[order], threads)
        assert np.all(arrival[order] <= s) and np.all(s <= start[order])
        if threads == 1:
            assert np.array_equal(s, start[order])
        edges = sorted([(int(x), 1) for x in s] + [(int(x), -1) for x in end[order]], key=lambda x: (x[0], x[1]))
        assert max(np.cumsum([d for _, d in edges])) <= threads


def test_requests_rounds_flows_and_counters(tp2: Path, tmp_path: Path) -> None:
    from viewer.export.perfetto import export_perfetto
    from viewer.export.perfetto_bulk import COUNTERS, ROUNDS

    out = tmp_path / "t.pftrace"
    st = export_perfetto(tp2, out)
    got = _parse(out)
    steps = read_table(tp2, "steps")
    requests = read_table(tp2, "requests")
    rounds = [(n, b) for u, n, _, _, b in got["slices"] if u == ROUNDS]
    assert len(rounds) == steps.num_rows == st.rounds
    by_request: dict[str, Counter[str]] = defaultdict(Counter)
    outgoing: dict[str, set[int]] = {}
    for u, n, _, _, b in got["slices"]:
        d = got["tracks"][u]
        if d.parent_uuid and got["tracks"][d.parent_uuid].process.process_name == "requests":
            by_request[d.name][n] += 1
            if n == "request":
                outgoing[d.name] = set(b.flow_ids)
    assert set(by_request) == set(requests["request_id"].to_pylist())
    for c in by_request.values():
        assert c["request"] == 1 and c["queued"] == 1 and c["prefill"] == 1 and c["prefill chunk"] >= 1
    # flows: each request's ids end in the rounds where it entered the batch (its prefill
    # chunks) and left it (its last token)
    ends: dict[int, int] = {}
    for _, b in rounds:
        rnd = next(a.int_value for a in b.debug_annotations if a.name_iid == 1)
        for f in b.terminating_flow_ids:
            ends[f] = rnd
    tl = read_table(tp2, "timeline")
    chunks: dict[str, set[int]] = defaultdict(set)
    for rid, stage, step in zip(tl["request_id"].to_pylist(), tl["stage"].cast("string").to_pylist(),
                                tl["step"].to_pylist(), strict=True):
        if stage == "prefill_chunk":
            chunks[rid].add(step)
    for rid, runs in zip(requests["request_id"].to_pylist(), requests["token_runs"].to_pylist(), strict=True):
        last = runs[-2] + runs[-1] - 1
        assert {ends[f] for f in outgoing[rid]} == chunks[rid] | {last}
    assert sum(len(v) for v in outgoing.values()) == st.flows > 0
    finished = [n for _, n, _, _ in got["instants"] if n == "finished"]
    assert len(finished) == requests.num_rows
    assert len(got["counters"]) == len(COUNTERS) and set(got["counters"].values()) == {steps.num_rows}


def test_the_column_wise_packets_equal_the_protobuf_classes_own() -> None:
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent

    rng = np.random.default_rng(0)
    ts = rng.integers(0, 1 << 62, 1000, dtype=np.uint64)
    uuid = rng.integers(0, 1 << 40, 1000, dtype=np.uint64)
    pieces = [b"\x40", ts, b"\x50", np.full(1000, 1, np.uint64), wire.Sub(b"\x5a", [b"\x48\x02", b"\x58", uuid], 1000)]
    buf, start, size = wire.encode(pieces, 1000)
    for i in (0, 1, 500, 999):
        want = TracePacket(timestamp=int(ts[i]), trusted_packet_sequence_id=1,
                           track_event=TrackEvent(type=TrackEvent.TYPE_SLICE_END, track_uuid=int(uuid[i])))
        assert bytes(buf[start[i]:start[i] + size[i]]) == want.SerializeToString()


def test_the_c_encoder_writes_numpys_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind of piece, submessages two deep, varints of 1-10 bytes (0 and 2^64 - 1
    among them), raw runs of 0-8 bytes, and a gather that drops and reorders messages."""
    assert wire.AVAILABLE, "setup.sh's install should have built viewer/export/_wire.c"
    rng = np.random.default_rng(1)
    n = 2000
    big = rng.integers(0, 1 << 63, n, dtype=np.uint64) >> rng.integers(0, 64, n).astype(np.uint64)
    big[:2] = [0, np.iinfo(np.uint64).max]
    small = rng.integers(0, 300, n, dtype=np.uint64)
    runs = rng.integers(0, 9, n)
    raw = wire.Raw(runs, rng.integers(0, 256, int(runs.sum()), dtype=np.uint8))
    order = rng.permutation(n)[:1500]

    def encoded() -> tuple[np.ndarray, np.ndarray, np.ndarray, bytes]:
        inner = wire.Sub(b"\x22", [b"\x08", small, raw, wire.Sub(b"\x12", [b"\x18", big], n)], n)
        pieces = [b"\x40", big, b"\x50\x01", raw, inner, b"\x28", small]
        buf, start, size = wire.encode(pieces, n)
        assert np.array_equal(size, wire.lengths(pieces, n))
        return buf, start, size, wire.gather(buf, start, size, order)

    c = encoded()
    monkeypatch.setattr(wire, "_LIB", None)
    py = encoded()
    for a, b in zip(c[:3], py[:3], strict=True):
        assert np.array_equal(a, b)
    assert c[3] == py[3] and len(c[3]) == int(c[2][order].sum())


def test_packets_are_ordered_as_lexsort_orders_them() -> None:
    """perfetto_bulk._order against np.lexsort on keys with many ties (at one timestamp,
    of one kind, and on all three keys), and on times too far apart for one integer."""
    from viewer.export.perfetto_bulk import _order

    rng = np.random.default_rng(2)
    # one integer: near-equal times, negative ones, a span just under 2^61; then lexsort's fallback
    for lo, span in ((1 << 60, 5), (-(1 << 40), 1000), (-(1 << 60), (1 << 61) - 1), (-(1 << 61), 1 << 62)):
        times = lo + rng.integers(0, span, 5000, dtype=np.int64)
        kinds = rng.integers(0, 3, 5000)
        inners = rng.integers(-3, 3, 5000)
        assert np.array_equal(_order(times, kinds, inners), np.lexsort((inners, kinds, times)))


def test_a_short_piece_is_refused_before_c_reads_past_it() -> None:
    n = 10
    for pieces in ([b"\x08", np.zeros(n - 1, np.uint64)], [wire.Raw(np.ones(n - 1, np.int64), np.zeros(9, np.uint8))],
                   [wire.Raw(np.full(n, 2, np.int64), np.zeros(5, np.uint8))]):
        with pytest.raises(ValueError):
            wire.encode(pieces, n)


def test_export_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    for args in (("export", str(tmp_path / "none"), "--perfetto", str(tmp_path / "x.pftrace")),
                 ("export", str(tmp_path))):
        p = mstrace(*args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr


# ---- windows --------------------------------------------------------------------------------
def _overlapping(tp2: Path, lo: int, hi: int) -> Counter[tuple[int, str, str, int, int]]:
    """Probe rows that share some time with [lo, hi] (an instant: inside it or on its edge),
    as the trace holds them (read here, not through the export's own reader)."""
    p = read_table(tp2, "probes")
    ts, dur = np.asarray(p["ts_ns"]), np.maximum(np.asarray(p["dur_ns"]), 0)
    meets = np.where(dur > 0, (ts < hi) & (ts + dur > lo), (ts >= lo) & (ts <= hi))
    keep = meets & (np.asarray(p["boundary"].cast("string")) != "tokenize")
    return Counter(zip(np.asarray(p["rank"])[keep].tolist(), np.asarray(p["stream"].cast("string"))[keep].tolist(),
                       np.asarray(p["boundary"].cast("string"))[keep].tolist(), ts[keep].tolist(),
                       (ts + dur)[keep].tolist(), strict=True))


def cycle_end(steps: dict[str, list[int]], i: int) -> int:
    """Where round i's cycle ends: the next round's start (the last round's: its end)."""
    end = steps["ts_ns"][i] + steps["dur_ns"][i]
    later = [t for t in steps["ts_ns"] if t > steps["ts_ns"][i]]
    return max(end, min(later)) if later else end


def test_a_rounds_window_holds_exactly_what_overlaps_those_rounds(tp2: Path, tmp_path: Path) -> None:
    from viewer.export.perfetto_bulk import ROUNDS

    steps = read_table(tp2, "steps").to_pydict()
    tl = read_table(tp2, "timeline")
    # rounds that hold some request's prefill chunk, so the window has flows to check
    # (which rounds do depends on how the run batched)
    a = max(s for s, g in zip(tl["step"].to_pylist(), tl["stage"].cast("string").to_pylist(), strict=True)
            if g == "prefill_chunk")
    a, b = max(min(steps["step"]), a - 2), a + 3
    sel = [i for i, s in enumerate(steps["step"]) if a <= s <= b]
    # the rounds' cycles: the last one's runs to the next round's start (its response_send after its end)
    lo, hi = min(steps["ts_ns"][i] for i in sel), max(cycle_end(steps, i) for i in sel)
    out = tmp_path / "w.pftrace"
    p = mstrace("export", str(tp2), "--perfetto", str(out), "--rounds", f"{a}-{b}")
    assert p.returncode == 0, p.stderr
    got = _parse(out)
    assert got["unpaired"] == 0
    rounds = sorted(next(x.int_value for x in e.debug_annotations if x.name_iid == 1)
                    for u, _, _, _, e in got["slices"] if u == ROUNDS)
    assert rounds == list(range(a, b + 1))
    tracks = got["tracks"]
    have = Counter((*k, n, t0, t1) for u, n, t0, t1, _ in got["slices"]
                   if (k := _thread_key(tracks, u)) is not None and n != "tokenize")
    want = _overlapping(tp2, lo, hi)
    assert have == want and sum(want.values()) < read_table(tp2, "probes").num_rows
    # every flow that starts at a request ends at one of the window's rounds
    starts = {f for _, n, _, _, e in got["slices"] if n == "request" for f in e.flow_ids}
    ends = {f for u, _, _, _, e in got["slices"] if u == ROUNDS for f in e.terminating_flow_ids}
    assert starts == ends and starts
    total = read_table(tp2, "probes").num_rows
    assert f"window: rounds {a}-{b}; left out {total - sum(want.values())} of {total} probe rows" in p.stdout


def test_worst_rounds_and_one_request_windows(tp2: Path, tmp_path: Path) -> None:
    from viewer.export.perfetto_bulk import ROUNDS

    steps = read_table(tp2, "steps").to_pydict()
    slowest = sorted(range(len(steps["step"])), key=lambda i: -steps["dur_ns"][i])[:2]
    out = tmp_path / "w.pftrace"
    assert mstrace("export", str(tp2), "--perfetto", str(out), "--worst", "2").returncode == 0
    got = _parse(out)
    rounds = {next(x.int_value for x in e.debug_annotations if x.name_iid == 1)
              for u, _, _, _, e in got["slices"] if u == ROUNDS}
    assert {steps["step"][i] for i in slowest} <= rounds and len(rounds) <= 6 and got["unpaired"] == 0
    rid = read_table(tp2, "requests")["request_id"][3].as_py()
    assert mstrace("export", str(tp2), "--perfetto", str(out), "--request", rid).returncode == 0
    got = _parse(out)
    on_requests = {got["tracks"][u].name for u, *_ in got["slices"]
                   if got["tracks"][u].parent_uuid and
                   got["tracks"][got["tracks"][u].parent_uuid].process.process_name == "requests"}
    assert on_requests == {rid}


@pytest.mark.parametrize("args,needle", [(("--rounds", "3-1"), "START-END"), (("--time", "x-2"), "START-END"),
                                         (("--rounds", "900-901"), "the trace has rounds"),
                                         (("--request", "nobody"), "no such request"),
                                         (("--worst", "2", "--rounds", "1-2"), "give one window"),
                                         (("--worst", "0"), "--worst must be >= 1")])
def test_a_bad_window_is_one_line(tp2: Path, tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    from tests.support.cli import cli

    out = tmp_path / "w.pftrace"
    code, _, err = cli("export", str(tp2), "--perfetto", str(out), *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    code, _, err = cli("export", str(tp2), "--otlp", "http://127.0.0.1:9", "--rounds", "1-2")
    assert code == 2 and "add --perfetto" in err


# ---- OTLP ---------------------------------------------------------------------------------
def test_otlp_replay_sends_every_requests_span_tree(tp2: Path) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    with receiver() as url:
        p = mstrace("export", str(tp2), "--otlp", url)
    assert p.returncode == 0, p.stderr
    assert Receiver.posts and {(path, kind) for path, kind, _ in Receiver.posts} == {
        ("/v1/traces", "application/x-protobuf")}
    spans = []
    for _, _, body in Receiver.posts:
        for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
            spans += [s for ss in rs.scope_spans for s in ss.spans]
    rows = read_table(tp2, "spans")
    assert len(spans) == rows.num_rows
    roots = {s.span_id.hex(): s for s in spans if s.name == "llm_request"}
    requests = read_table(tp2, "requests")
    assert len(roots) == requests.num_rows
    for s in spans:
        if s.name != "llm_request":  # every child hangs off its request's root, in one trace
            root = roots[s.parent_span_id.hex()]
            assert s.trace_id == root.trace_id
    for r in roots.values():
        attrs = {a.key for a in r.attributes}
        assert {"gen_ai.request.id", "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                "gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e"} <= attrs
        assert r.start_time_unix_nano > 1_600_000_000 * 10**9  # on the wall clock


def test_leaked_blocks_are_instants_naming_the_requests_mstrace_leaks_names(tmp_path: Path, tiny_runs: TinyRuns) -> None:
    """...and `mstrace top` names them too, though snapshots after the leak do not list them."""
    import json

    from viewer.live.state import LiveState
    from viewer.live.tail import TraceTail

    out = tiny_runs("--requests", "16", "--inject", "leak", "--no-gc", "--snapshot-every", "4", "-q").out  # test_stalls'
    leaks = json.loads(mstrace("leaks", str(out), "--json").stdout)
    want = {h["request_id"]: len(h["block_ids"]) for h in leaks["leaks"]}
    assert want
    pf = tmp_path / "leak.pftrace"
    assert mstrace("export", str(out), "--perfetto", str(pf)).returncode == 0
    got = {}
    for _, name, _, e in _parse(pf)["instants"]:
        if name == "leaked blocks":
            args = {a.name: a for a in e.debug_annotations}
            got[args["request_id"].string_value] = args["blocks"].int_value
    assert got == want
    # a window that holds the last round shows them; one that does not, not
    last = max(read_table(out, "steps")["step"].to_pylist())
    for rounds, shown in ((f"{last}-{last}", want), ("1-2", {})):
        assert mstrace("export", str(out), "--perfetto", str(pf), "--rounds", rounds).returncode == 0
        got = {next(a.string_value for a in e.debug_annotations if a.name == "request_id")
               for _, name, _, e in _parse(pf)["instants"] if name == "leaked blocks"}
        assert got == set(shown), rounds
    st = LiveState()
    st.update(TraceTail(out).poll())  # type: ignore[arg-type]
    assert dict(st.snapshot().leaks) == want


def test_a_stall_is_an_instant_with_its_wait_cycle(tmp_path: Path) -> None:
    from tests.support.tui_trace import synthetic_trace
    from viewer.export.perfetto import export_perfetto

    trace = synthetic_trace(tmp_path / "t", rounds=40, stall=True)
    export_perfetto(trace, tmp_path / "t.pftrace")
    stalls = [e for _, name, _, e in _parse(tmp_path / "t.pftrace")["instants"] if name == "stall"]
    assert len(stalls) == 1
    args = {a.name: a for a in stalls[0].debug_annotations}
    assert args["cycle"].string_value.startswith("scheduler -> prefill stream event")
    assert args["waiter"].string_value == "scheduler" and args["waited_ns"].int_value == 2_000_000_000


def test_otlp_replay_to_a_collector_that_is_not_there_is_one_line(tp2: Path) -> None:
    """No "Transient error" lines from the exporter's retries: the collector is checked first
    (issue 25, point 13)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = mstrace("export", str(tp2), "--otlp", f"http://127.0.0.1:{port}")
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1, p.stderr
    assert "cannot reach the collector" in lines[0] and "Transient" not in p.stderr


def test_a_time_window_cut_inside_rounds_takes_those_rounds_whole(tp2: Path) -> None:
    """`--time` from the middle of one round to the middle of a later one: the window is those
    rounds' cycles whole, so `view`'s per-round costs for them are the whole trace's (a round
    cut at the window's edge had its full length beside only the costs of its rows inside;
    the last round of any window lost its response_send, which comes after its end)."""
    from tracing.reader import Trace
    from viewer.export.window import parse_window
    from viewer.tui.view_data import TraceBrowser

    tr = Trace.open(tp2)
    steps = read_table(tp2, "steps").sort_by("ts_ns").to_pydict()
    t0 = tr.meta["run"]["start_ns"]
    i = len(steps["step"]) // 2
    mid = [steps["ts_ns"][j] + steps["dur_ns"][j] // 2 for j in (i, i + 2)]
    w = parse_window(tr, time=f"{(mid[0] - t0) / 1e9!r}-{(mid[1] - t0) / 1e9!r}")
    assert w is not None and w.spans == ((steps["ts_ns"][i], cycle_end(steps, i + 2)),)
    last = max(steps["step"])
    assert parse_window(tr, rounds=f"{last - 1}-{last + 50}").what == f"rounds {last - 1}-{last}"  # what it holds
    whole = TraceBrowser(tp2).rounds()
    rows = {r[0]: dict(zip(whole.columns, r, strict=True)) for r in whole.rows}
    assert [r[0] for r in TraceBrowser(tp2, w).rounds().rows] == steps["step"][i:i + 3]
    # and so for every kind of window (--worst's spans apart: each cycle ends in its own span)
    end_s = (steps["ts_ns"][-1] + steps["dur_ns"][-1] - t0) / 1e9
    for window in (w, parse_window(tr, rounds=f"{steps['step'][i]}-{steps['step'][i + 2]}"), parse_window(tr, worst=2),
                   parse_window(tr, time=f"{end_s - 0.01!r}-{end_s + 1000!r}"),  # past the run's end
                   parse_window(tr, request=read_table(tp2, "requests")["request_id"][3].as_py())):
        part = TraceBrowser(tp2, window).rounds()
        assert part.rows
        for r in part.rows:
            got = dict(zip(part.columns, r, strict=True))
            assert got == {c: v for c, v in rows[r[0]].items() if c in got}, (window.what, r[0])


def _flushed(root: Path, flushes: int = 6, rows: int = 5) -> None:
    """A trace of `flushes` probe parts, none merged: a killed run's (copied away from its
    writer, whose lock `compact` would wait for)."""
    import shutil

    from tests.support.store import probe_row
    from tracing.compaction import Targets
    from tracing.writer import TraceWriter

    w = TraceWriter(root.with_name(root.name + "-run"), flush_interval_s=3600,
                    targets=Targets(fan_in=100, max_rows=1 << 20))
    w.write_meta({"model": {"kv_blocks": 4}})
    for f in range(flushes):
        w.buffer("probes").extend(probe_row(f * rows + i) for i in range(rows))
        w.flush()
    shutil.copytree(w.root, root)


def test_a_window_read_while_a_compaction_removes_its_parts_reads_the_merged_one(tmp_path: Path) -> None:
    """The snapshot names parts a compaction then merges and removes: a window read as a table
    (view, report --html) takes the newer snapshot; one read part by part (export --perfetto)
    says so in one line."""
    from tracing.compact_trace import compact_trace
    from tracing.reader import Trace, TraceError
    from viewer.export.window import Window, table_in, windowed

    root = tmp_path / "t"
    _flushed(root)
    w = Window(((1005, 1020),), "t")
    want = table_in(Trace.open(root), "probes", ["step"], w)["step"].to_pylist()
    assert want == list(range(5, 20))
    stale, stale2 = Trace.open(root), Trace.open(root)
    assert len(stale.parts["probes"]) == 6
    compact_trace(root)
    assert table_in(stale, "probes", ["step"], w)["step"].to_pylist() == want
    with pytest.raises(TraceError, match="was removed while it was read .* run the command again"):
        list(windowed(stale2, "probes", ["step"], w))


def test_a_windowed_part_that_is_not_what_its_manifest_says_is_one_line(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from tracing.reader import Trace, TraceError
    from viewer.export.window import Window, windowed

    root = tmp_path / "t"
    _flushed(root, flushes=2)
    part = Trace.open(root).parts["probes"][0].path
    t = pq.read_table(part)
    pq.write_table(t.slice(0, 3), part)  # fewer rows than committed
    with pytest.raises(TraceError, match="holds 3 rows, the manifest committed 5"):
        list(windowed(Trace.open(root), "probes", ["step"], Window(((0, 10**6),), "t")))
    pq.write_table(t.drop_columns(["ts_ns"]), part)  # a footer without the window's column
    with pytest.raises(TraceError) as e:
        list(windowed(Trace.open(root), "probes", ["step"], Window(((0, 10**6),), "t")))
    assert str(e.value).startswith("corrupt probes/ table") and "\n" not in str(e.value)


def test_a_request_never_scheduled_is_queued_to_its_end_not_prefilled(tmp_path: Path) -> None:
    """A rejected request (its prompt past the KV pool) never ran: its Perfetto track shows it
    queued from arrival to its refusal, with no prefill slice (it had one over its whole life)."""
    import json

    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "big", "input_ids": list(range(5, 205)), "max_new_tokens": 2}) + "\n"
                  + json.dumps({"id": "ok", "input_ids": [5, 6, 7], "max_new_tokens": 2}) + "\n")
    tr = tmp_path / "t"
    assert mstrace("run", "--model", "tiny", "--workload", str(wl), "--kv-blocks", "8", "--out", str(tr),
                   "-q").returncode == 0
    out = tmp_path / "t.pftrace"
    assert mstrace("export", str(tr), "--perfetto", str(out)).returncode == 0
    got = _parse(out)
    by_track: dict[str, list[str]] = defaultdict(list)
    for u, n, *_ in got["slices"]:
        by_track[got["tracks"][u].name].append(n)
    assert "prefill" not in by_track["big"] and "queued" in by_track["big"]
    assert "prefill" in by_track["ok"]


def test_overlapping_rows_past_256_lanes_get_track_uuids_of_their_own() -> None:
    """300 rows of one stream that all overlap (a tokenizer pool under a burst): 300 lanes,
    each a uuid no other track has (base + (lane << 12) reached ROUNDS' uuid at lane 256)."""
    from viewer.export.perfetto import _Lanes
    from viewer.export.perfetto_bulk import COUNTER, PROCESS, REQUEST, REQUESTS, ROUNDS, THREAD

    lanes = _Lanes({(0, "tokenizer"): THREAD, (0, "host"): THREAD + 1})
    start = np.arange(300, dtype=np.int64)
    got = lanes.assign(0, "tokenizer", start, start + 1000)  # each overlaps the next without nesting
    assert len(set(got.tolist())) == 300
    reserved = {THREAD, THREAD + 1, PROCESS, ROUNDS, REQUESTS, COUNTER, REQUEST}
    assert not reserved & set(got.tolist()[1:])
    assert len({t for _, (_, t, _) in lanes.new()}) == 299  # the lanes' threads: distinct tids too
