"""Per-row cost of every kind of trace row the hot path emits, in ns.

    python bench/bench_probe_cost.py [--n 200000] [--repeats 7]

Each kind is measured at its real emission site where the site can be called on
its own (timed_wait, ProcStream.complete, MemoryManager._emit with the engine's own
memory sink, append_snapshot (scheduler/core/memory_manager.py), RequestManager.mark with the engine's
timeline sink, TraceRequestsSink.on_finish, SpanSink.on_finish), and as a copy of
the site's code where it is inline in Engine.step (the round's probe rows, the
steps row, the token-runs stamp). Every site runs twice, with its buffer and with
None (what --no-probes, or no trace, hands out), over the same iterations: the
difference is what the row costs, nothing of the work the site does anyway.

Rows are cleared between chunks of 10,000, off the clock: in a run the writer's
thread drains them, and what that costs is the writer's CPU time (run.writer).
gc.freeze() first, as Engine.__init__ does, so gen-0 collections the rows trigger
are counted at their real size. Reports the median over repeats, per row.

bench/bench_probe_cpu.py multiplies these by a real run's row counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

from probes.boundaries import BOOKKEEPING, DEVICE_COMPUTE, KV_FENCE, RESPONSE_DELIVER
from probes.clock import now_ns
from probes.recorder import Probes
from probes.waits import WaitRegistry, timed_wait

Buf = list[tuple[Any, ...]] | None
Run = Callable[[int], int]  # run(k): k iterations of the site; returns the rows the buffer got (0 when None)
Site = Callable[[Buf], Run]
CHUNK = 10_000


@dataclass(slots=True)
class Kind:
    name: str
    thread: str  # the thread that emits it
    scope: str  # "probes": gone with --no-probes; "trace": written whatever the probes
    what: str
    site: Site


@dataclass(slots=True)
class Cost:
    median_ns: float
    min_ns: float
    max_ns: float


# ---- sites inline in Engine.step: copies of its code ------------------------------------

def _step_rows(buf: Buf) -> Run:
    """engine.step's own probe rows (bookkeeping, batch_prepare, response_send, defrag): the
    timestamps are read whatever the probes (the steps row and StepStats use them)."""
    pb, r = buf, 0

    def run(k: int) -> int:
        t0 = now_ns()
        for step in range(k):
            t1 = t0 + step
            if pb is not None:
                pb.append((t0, t1 - t0, BOOKKEEPING, "host", r, step))
        return k if pb is not None else 0
    return run


def _steps_row(buf: Buf) -> Run:
    """engine.step's steps-table row, field for field."""
    from scheduler.core.memory_manager import MemoryManager

    mm = MemoryManager(4096, 16, None, False)
    batch = SimpleNamespace(prefills=[1, 2], decodes=list(range(200)), num_prefill_tokens=512)
    rm = SimpleNamespace(waiting=list(range(30)), running=list(range(200)))
    cfg = SimpleNamespace(mode="serial")
    fence_blocks = 0
    q: queue.SimpleQueue[int] = queue.SimpleQueue()
    sb = buf

    def run(k: int) -> int:
        t0, device_ns = now_ns(), 1000
        for step in range(k):
            t4 = t3 = t0 + step
            if sb is not None:
                sb.append((
                    step, cfg.mode, t0, t4 - t0, max(0, (t4 - t0) - device_ns), device_ns,
                    len(batch.prefills), batch.num_prefill_tokens, len(batch.decodes), len(batch.decodes),
                    mm.num_used, mm.num_free, len(rm.waiting), len(rm.running),
                    q.qsize(), t3, fence_blocks,
                ))
        return k if sb is not None else 0
    return run


def _token_runs(buf: Buf) -> Run:
    """engine._collect's token_runs stamp, per output token (only the requests table reads it).
    It is not conditional: `buf` None stands for an engine without it."""
    step = 1

    def run(k: int) -> int:
        runs: list[int] = []
        if buf is None:
            for _ in range(k):
                pass
            return 0
        for _ in range(k):
            if runs and runs[-2] + runs[-1] == step:
                runs[-1] += 1
            else:
                runs += (step, 1)
        return k
    return run


# ---- real sites ------------------------------------------------------------------------

def _wait_rows(buf: Buf) -> Run:
    """timed_wait's row (scheduler_barrier, idle, kv waits), on the fast path: one clock
    read more than the slow path's row, so an upper bound for both."""
    reg = WaitRegistry()

    def done(_s: float) -> bool:
        return True

    def run(k: int) -> int:
        for i in range(k):
            timed_wait(done, registry=reg, waiter="scheduler", what="event", signaller="main",
                       boundary=KV_FENCE, buf=buf, step=i)
        return k if buf is not None else 0
    return run


def _device_rows(buf: Buf) -> Run:
    """ProcStream.complete (the device-reader thread): device_compute / stream_wait rows."""
    from scheduler.device.device_process import ProcStream, _Pending

    dev = SimpleNamespace(probes=Probes((lambda _t: buf) if buf is not None else None), registry=WaitRegistry())
    st = ProcStream("main", dev)  # type: ignore[arg-type] - only probes and registry are used

    def run(k: int) -> int:
        pending = st._pending
        for i in range(k):
            pending.append(_Pending("op", "forward", i, DEVICE_COMPUTE))
            st.complete(i, i + 5, None, None)
        st.completed.clear()
        return k if buf is not None else 0
    return run


class _AttrSite:
    """The shape of the sender's, tokenizer pool's and kv_fence's rows: attribute reads
    and one clock read more (Sender._loop)."""

    __slots__ = ("_buf", "_rank")

    def __init__(self, buf: Buf) -> None:
        self._buf, self._rank = buf, 0

    def run(self, k: int) -> int:
        for i in range(k):
            t0 = now_ns()
            if self._buf is not None:
                self._buf.append((t0, now_ns() - t0, RESPONSE_DELIVER, "sender", self._rank, i))
        return k if self._buf is not None else 0


def _attr_rows(buf: Buf) -> Run:
    return _AttrSite(buf).run


def _memory_events(buf: Buf) -> Run:
    """MemoryManager._emit through the engine's own memory sink (alloc, ref, unref, free, reclaim)."""
    from scheduler.core.memory_manager import MemoryManager
    from scheduler.engine import Engine

    sink = Engine._memory_sink(SimpleNamespace(_mem_buf=buf, step_no=7))  # type: ignore[arg-type]
    emit = MemoryManager(64, 16, sink, False)._emit

    def run(k: int) -> int:
        for i in range(k):
            emit("alloc", i & 63, "req-1", 1)
        return k if buf is not None else 0
    return run


def _snapshot_rows(buf: Buf) -> Run:
    """append_snapshot: 256 running requests of 8 blocks, 2,049 rows a snapshot."""
    from scheduler.core.memory_manager import MemoryManager, append_snapshot

    running = [SimpleNamespace(request_id=f"req-{i}", block_table=list(range(i * 8, i * 8 + 8))) for i in range(256)]
    mm = MemoryManager(4096, 16, None, False)
    per = 1 + 256 * 8

    def run(k: int) -> int:
        m = max(1, k // per)
        for _ in range(m):
            if buf is not None:  # the engine snapshots only when there is a memory table
                append_snapshot(buf, 50, mm, running)  # type: ignore[arg-type]
        return m * per if buf is not None else 0
    return run


def _timeline_rows(buf: Buf) -> Run:
    """RequestManager.mark through the engine's own timeline sink."""
    from scheduler.core.request_manager import RequestManager
    from scheduler.engine import Engine

    trace = SimpleNamespace(buffer=lambda _t: buf) if buf is not None else None
    rm = RequestManager(Engine._timeline_sink(SimpleNamespace(trace=trace)))  # type: ignore[arg-type]
    req = SimpleNamespace(request_id="req-1")

    def run(k: int) -> int:
        for _ in range(k):
            rm.mark(req, "queued")  # type: ignore[arg-type]
        return k if buf is not None else 0
    return run


def _finished(prompt_len: int, output_len: int) -> Any:
    from scheduler.hops.sender import FinishedRecord

    t = now_ns()
    return FinishedRecord(
        "req-1", list(range(prompt_len)), list(range(output_len)), 0, "length", "", t, t + 10, t + 20, t + 30,
        t + 40, t + 50, t + 60 + 1000 * output_len, 0, 1, [t + 50 + 1000 * i for i in range(output_len)],
        [3, output_len],
    )


def _requests_rows(prompt_len: int, output_len: int) -> Site:
    def site(buf: Buf) -> Run:
        """TraceRequestsSink.on_finish (the sender thread): one row per request, ITL gaps included."""
        from scheduler.harness.runner import TraceRequestsSink

        rec = _finished(prompt_len, output_len)
        sink = TraceRequestsSink(SimpleNamespace(buffer=lambda _t: buf)) if buf is not None else None  # type: ignore[arg-type]

        def run(k: int) -> int:
            if sink is None:
                return 0
            for _ in range(k):
                sink.on_finish(rec, "text")
            return k
        return run
    return site


def _span_rows(output_len: int) -> Site:
    def site(buf: Buf) -> Run:
        """SpanSink.on_finish (the sender thread): a request's spans through the OpenTelemetry SDK."""
        from probes.clock import wall_anchor
        from tracing.otel import SpanSink

        rec = _finished(8, output_len)
        sink = SpanSink(SimpleNamespace(buffer=lambda _t: buf), wall_anchor()) if buf is not None else None  # type: ignore[arg-type]

        def run(k: int) -> int:
            if sink is None:
                return 0
            n0 = len(buf or ())
            for _ in range(k):
                sink.on_finish(rec, "text")
            return len(buf or ()) - n0
        return run
    return site


def kinds(prompt_len: int = 144, output_len: int = 80) -> dict[str, Kind]:
    """Every kind of row the hot path emits. `prompt_len`, `output_len`: a request's mean
    sizes, for the kinds whose cost grows with them (requests rows, spans)."""
    ks = [
        Kind("probe.step", "scheduling", "probes", "round rows: bookkeeping, batch_prepare, response_send, defrag",
             _step_rows),
        Kind("probe.wait", "scheduling", "probes", "timed_wait rows: scheduler_barrier, idle", _wait_rows),
        Kind("probe.device", "device-reader", "probes", "device_compute, stream_wait (ProcStream.complete)",
             _device_rows),
        Kind("probe.attr", "tokenizer/sender/scheduling", "probes", "tokenize, response_deliver, kv_fence",
             _attr_rows),
        Kind("memory.event", "scheduling", "probes", "alloc, ref, unref, free, reclaim (memory sink)",
             _memory_events),
        Kind("memory.snapshot", "scheduling", "probes", "block-table snapshot rows (append_snapshot)",
             _snapshot_rows),
        Kind("timeline", "scheduling", "trace", "request stage events (RequestManager.mark)", _timeline_rows),
        Kind("steps", "scheduling", "trace", "one row per round", _steps_row),
        Kind("token_runs", "scheduling", "trace", "per output token: the collecting-round runs", _token_runs),
        Kind("requests", "sender", "trace", "one row per finished request (TraceRequestsSink)",
             _requests_rows(prompt_len, output_len)),
        Kind("spans", "sender", "trace", "OpenTelemetry spans, 5 a request (SpanSink)", _span_rows(output_len)),
    ]
    return {k.name: k for k in ks}


# Iterations per measurement: the sites that build whole records are ~100x dearer.
_N_SCALE = {"requests": 0.02, "spans": 0.005, "memory.snapshot": 1.0}


def _timed(site: Site, n: int, on: bool) -> tuple[int, int]:
    """(ns on the clock, rows emitted) for n iterations, cleared every CHUNK rows off the clock."""
    buf: Buf = [] if on else None
    run = site(buf)
    total = rows = 0
    chunk = max(1, min(CHUNK, n))
    for i in range(0, n, chunk):
        t = time.perf_counter_ns()
        rows += run(min(chunk, n - i))
        total += time.perf_counter_ns() - t
        if buf is not None:
            buf.clear()
    return total, rows


def row_cost(kind: Kind, n: int, repeats: int) -> Cost:
    n = max(10, int(n * _N_SCALE.get(kind.name, 1.0)))
    vals = []
    for r in range(repeats):
        # alternate which variant runs first, so a drift in machine load cancels
        order = (True, False) if r % 2 == 0 else (False, True)
        res = {on: _timed(kind.site, n, on) for on in order}
        (t_on, rows), (t_off, _) = res[True], res[False]
        vals.append((t_on - t_off) / max(1, rows))
    return Cost(statistics.median(vals), min(vals), max(vals))


def measure(n: int = 200_000, repeats: int = 7, prompt_len: int = 144, output_len: int = 80,
            only: list[str] | None = None) -> dict[str, Cost]:
    """Per-row cost of each kind (bench/bench_probe_cpu.py calls this with a real run's sizes)."""
    # Imported before the freeze: in a run, torch's and the engine's objects are long-lived too.
    import scheduler.device.device_process  # noqa: F401
    import scheduler.engine  # noqa: F401
    import scheduler.harness.runner  # noqa: F401
    import tracing.otel  # noqa: F401

    gc.collect()
    gc.freeze()  # as Engine.__init__ does
    ks = kinds(prompt_len, output_len)
    return {name: row_cost(k, n, repeats) for name, k in ks.items() if only is None or name in only}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000, help="iterations per measurement (scaled down for records)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=144)
    ap.add_argument("--output-len", type=int, default=80)
    a = ap.parse_args()
    costs = measure(a.n, a.repeats, a.prompt_len, a.output_len)
    ks = kinds()
    out = {name: {**asdict(c), "thread": ks[name].thread, "scope": ks[name].scope, "what": ks[name].what}
           for name, c in costs.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
