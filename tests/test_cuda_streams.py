"""The CUDA backend's logic against a stand-in with CUDA's semantics (tests/support/fake_cuda.py):
a launch never waits for its kernels, device rows stream into the probe buffer as launches
complete, the clock keeps sub-microsecond precision over hours, and waits neither poll
nor outlive their timeout."""

from __future__ import annotations

import threading
import time

import numpy as np

from probes.recorder import Probes
from probes.waits import DEVICE_THREAD, WaitRegistry
from scheduler.device.cuda_streams import CudaStream, make_cuda_streams
from tests.support.fake_cuda import FakeCuda

MS = 1_000_000


def _stream(cuda: FakeCuda, rows: list) -> CudaStream:
    return CudaStream("main", Probes(lambda table: rows), None, cuda=cuda)


HOUR = 3600 * 1000 * MS


def test_a_launch_returns_before_its_kernels_finish():
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    syncs = cuda.syncs
    s.submit(lambda: cuda.kernel(HOUR), "forward#1", 1)  # an hour of device time
    end = s.record()
    assert cuda.syncs == syncs  # neither the launch nor the events waited for the device
    assert not end.query() and end.ts_ns is None and not rows
    cuda.skew += 2 * HOUR
    assert end.wait(5.0) and end.ts_ns is not None
    s.close()


def test_device_rows_stream_in_while_the_run_goes_on():
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    for step in range(1, 201):
        s.submit(lambda: cuda.kernel(10_000), f"forward#{step}", step)  # 10 us each ...
        cuda.skew += 20_000  # ... and the host's round takes 20
    # every launch but the last few is already a probe row, before close(): none waits for the end
    assert len(rows) == 199 and len(s._pending) == 1
    assert [r[5] for r in rows] == list(range(1, len(rows) + 1))
    for _t0, dur, boundary, stream, _rank, _step in rows:
        assert boundary == "device_compute" and stream == "main" and dur >= 10_000
    s.close()
    assert len(rows) == 200 and not s._pending


def test_the_clock_stays_precise_over_hours():
    """A launch every ~36 ms for an hour of device time, then a reading: within a few
    microseconds of the truth. Each hop's float32 reading of ~35 ms rounds by at most 2 ns,
    and its error is set by the gap's place in float32's pattern of steps, which repeats
    every 15,625 ns (4,096 steps of 10^6 / 2^18 ns). A device's rounds vary by microseconds;
    this loop's gaps vary by its host's timing, which can be regular enough that successive
    errors agree (one CI run summed 5.05 us). So each gap gets a seeded jitter uniform over
    the pattern: the errors are independent whatever the host, and over 10^5 hops their sum
    wanders ~0.37 us (5 us is 13 sigma). One anchor for the whole run would read an hour
    in float32 ms, whose steps are 0.25 ms."""
    jitter = np.random.default_rng(0).integers(0, 15_625, size=100_000)
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    anchor_ev, anchor_ns = s.clock._anchor
    anchor_t = anchor_ev.t
    step = 36 * MS
    for k in range(100_000):  # 3,600 s
        cuda.skew += step + int(jitter[k])
        s.submit(lambda: cuda.kernel(1_000_003), f"forward#{k}", k)
    cuda.skew += step
    s.drain()
    ev = s.record()
    cuda.skew += step
    truth = anchor_ns + (ev.ev.t - anchor_t)
    assert abs(ev.ts_ns - truth) < 5_000
    assert len(rows) == 100_000
    assert np.spacing(np.float32((ev.ev.t - anchor_t) / 1e6)) * 1e6 >= 200_000  # one anchor's step, in ns
    s.close()


def test_waits_sleep_until_done_and_keep_their_timeout():
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    s.submit(lambda: cuda.kernel(HOUR), "forward#1", 1)
    ev = s.record()
    q0 = cuda.queries
    t = time.monotonic()
    assert not ev.wait(0.03)  # the timeout holds while the kernel runs on (a hung device)
    assert time.monotonic() - t >= 0.03
    assert not ev.wait(0.03)
    cuda.skew += 2 * HOUR
    assert ev.wait(5.0)
    assert cuda.queries - q0 <= 4  # one query per wait call: the sync thread slept, nobody polled
    # the last wait returned on its query; the sync thread, which a loaded host may not have run
    # yet, takes the request the first wait queued (and counts its sync) in its own time
    assert ev._done is not None and ev._done.done.wait(5.0)
    assert cuda.syncs == 2  # the clock's anchor, then one sync request for all three waits
    s.close()


def test_streams_of_a_device_share_one_clock_and_order_by_events():
    cuda, rows = FakeCuda(), []
    streams = make_cuda_streams(None, Probes(lambda table: rows), ("main", "prefill"), cuda=cuda)
    main, prefill = streams["main"], streams["prefill"]
    assert main.clock is prefill.clock
    main.submit(lambda: cuda.kernel(50 * MS), "decode#1", 1)
    done = main.record()
    prefill.wait_event(done)
    prefill.submit(lambda: cuda.kernel(1 * MS), "prefill#1", 1)
    after = prefill.record()
    assert after.wait(5.0) and done.query()
    assert after.ts_ns >= done.ts_ns + 1 * MS - 1_000
    for s in streams.values():
        s.close()
    by = {r[3]: r for r in rows}
    assert by["prefill"][0] >= by["main"][0] + by["main"][1] - 1_000  # prefill ran after decode


def test_a_launch_starts_after_the_copies_its_batch_was_prepared_with():
    """prepare() copies the batch's index tensors on the caller's stream (pinned, non-blocking):
    the launch's stream must start after them, on the device, without the host waiting."""
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    anchor_ns = s.clock._anchor[1]
    host_stream = cuda.current_stream()
    with cuda.stream(host_stream):
        cuda.kernel(HOUR)  # a slow H2D copy on the caller's stream
    s.submit(lambda: cuda.kernel(1 * MS), "forward#1", 1)
    end = s.record()
    cuda.skew += HOUR // 2
    assert not end.query()  # the forward waits for the copy ...
    cuda.skew += HOUR
    assert end.wait(5.0)  # ... and runs after it
    s.close()
    assert rows[0][0] - anchor_ns >= HOUR - 1_000  # its device row starts when the copy ended


def test_a_wait_for_another_streams_event_is_listed_while_the_stream_waits():
    """A GPU stream's wait blocks no host thread, so no timed_wait sees it: the stream lists it
    for the watchdog, from when its earlier work is done until the awaited event completes."""
    cuda, rows, registry = FakeCuda(), [], WaitRegistry()
    streams = make_cuda_streams(None, Probes(lambda table: rows), ("main", "prefill"), cuda=cuda, registry=registry)
    main, prefill = streams["main"], streams["prefill"]
    main.submit(lambda: cuda.kernel(HOUR), "decode#1", 1)
    done = main.record()
    prefill.submit(lambda: cuda.kernel(10 * MS), "prefill#0", 0)
    prefill.wait_event(done)
    assert registry.snapshot() == []  # prefill's own work is still running: not waiting yet
    cuda.skew += 20 * MS
    (w,) = registry.snapshot()
    assert (w.waiter, w.what, w.signaller, w.boundary, w.thread_id) == (
        "prefill-stream", f"event {done.label}", "main-stream", "stream_wait", DEVICE_THREAD)
    assert registry.snapshot()[0] is w  # one object per wait: the watchdog reports it once
    prefill.drain()
    assert abs(w.since_ns - prefill.completed[-1].end_ns) < 1_000  # since its own work ended, on the device clock
    cuda.skew += 2 * HOUR
    assert registry.snapshot() == []  # the event completed: the wait is over
    for s in streams.values():
        s.close()
    assert not prefill._waits  # and a later launch's drain() forgot it


def test_host_work_on_a_stream_runs_after_its_earlier_work_and_holds_its_later_work():
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    ran, release = [], threading.Event()
    s.submit(lambda: cuda.kernel(HOUR), "forward#1", 1)
    s.submit_host(lambda: (ran.append(cuda.now()), release.wait(5.0)), "host#1", 1, "kv_fence")
    s.submit(lambda: cuda.kernel(1 * MS), "forward#2", 2)
    end = s.record()
    time.sleep(0.05)
    assert not ran  # the forward before it is still running
    cuda.skew += 2 * HOUR
    deadline = time.monotonic() + 5
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran and ran[0] >= HOUR  # ran once the stream reached it, on another thread
    time.sleep(0.05)
    assert not end.query()  # the stream's later work waits for the host function
    release.set()
    assert end.wait(5.0)
    s.submit_host(lambda: 1 / 0, "host#2", 2, "kv_fence")
    assert s.record().wait(5.0) and isinstance(s.error, ZeroDivisionError)  # surfaced at the barrier
    s.close()
    # its row is of the boundary it was given, not the device's compute
    assert {r[2] for r in rows if r[1] > 0 and r[2] != "device_compute"} >= {"kv_fence"}


def test_the_injected_deadlock_on_gpu_streams_is_one_cycle_the_watchdog_names():
    """faults._deadlock on CUDA streams: main's host function waits for blocks the prefill
    stream would free, and prefill waits on the device for an event main records after it.
    Neither blocks the scheduling thread; the watchdog's graph holds the whole cycle."""
    from types import SimpleNamespace

    from probes.watchdog import Watchdog
    from scheduler.harness.faults import _deadlock

    cuda, rows, registry = FakeCuda(), [], WaitRegistry()
    streams = make_cuda_streams(None, Probes(lambda table: rows), ("main", "prefill"), cuda=cuda, registry=registry)
    engine = SimpleNamespace(streams=streams, registry=registry, device_proc=None)
    batch = SimpleNamespace(prefills=[SimpleNamespace(req=SimpleNamespace(request_id="req-1"))])
    reports: list = []
    # the host function gives up after 5 s: time for the watchdog (0.3 s) to see the cycle
    # live on a loaded host; a launching thread that blocked would take all of it
    t = time.monotonic()
    with Watchdog(registry, 0.3, interval_s=0.02, on_stall=reports.append):
        _deadlock(engine, batch, 5, timeout_s=5.0)
        assert time.monotonic() - t < 2.5  # the launching thread went on
        blocked = streams["main"].record()  # what the barrier would wait for
        while not any(r.cycle for r in reports) and time.monotonic() - t < 4.5:
            time.sleep(0.02)
        assert not blocked.query()  # still blocked when the cycle was named
    cycles = {r.cycle_name for r in reports if r.cycle}
    assert cycles, [r.wait for r in reports]
    name = next(iter(cycles))
    assert "blocks held by req req-1" in name and "event main#" in name
    assert {"main-stream", "prefill-stream"} <= {e.src for r in reports for e in r.cycle or []}
    assert blocked.wait(30.0) and streams["main"].error is not None  # the host function gave up at its timeout
    for s in streams.values():
        s.close()


def test_a_cuda_error_in_a_sync_is_raised_by_the_wait_and_later_waits_still_answer():
    """cudaEventSynchronize raising (an illegal address): the waiter raises it (it was told the
    event completed, and read host buffers whose copies never ran), and the stream's sync
    thread lives on, so the next wait is answered, not timed out as a stall."""
    import pytest

    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    s.submit(lambda: cuda.kernel(HOUR), "forward#1", 1)
    bad = s.record()

    def illegal() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    bad.ev.synchronize = illegal
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bad.wait(5.0)
    s.submit(lambda: cuda.kernel(1 * MS), "forward#2", 2)
    nxt = s.record()
    cuda.skew += 2 * HOUR
    assert nxt.wait(5.0)  # answered by the sync thread, which lived on (dead, it timed out)
    s.close()


def test_a_stall_names_the_launch_still_running_not_one_finished_since_the_last_launch():
    """In a stall no launch drains the pending list: the state skips its finished head."""
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    s.submit(lambda: cuda.kernel(1 * MS), "forward#1", 1)
    s.submit(lambda: cuda.kernel(HOUR), "forward#2", 2)  # hangs
    cuda.skew += 10 * MS
    st = s.state()
    assert st["in_progress"] == "forward#2" and st["queue_depth"] == 1
    assert [r[0] for r in st["recent"]] == ["forward#1"]
    cuda.skew += 2 * HOUR
    s.close()


def test_a_launch_after_an_idle_hour_is_timed_to_the_nanosecond_of_its_own_pair():
    """A launch's span is its own two events' reading, not two readings from an anchor as
    old as the device's idle (float32 ms: 0.25 ms steps after an hour; a 300 us kernel read
    250 us)."""
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    cuda.skew += HOUR  # the server idles an hour
    s.submit(lambda: cuda.kernel(300_123), "forward#1", 1)
    start, end = s._pending[0][:2]
    cuda.skew += 10 * MS
    s.close()
    truth = end.t - start.t  # the kernel and its launch, on the stand-in's device clock
    assert truth >= 300_123 and abs(rows[0][1] - truth) < 100


def test_closing_a_stream_with_a_kernel_that_never_ends_returns(monkeypatch):
    """A hung kernel (the stall the barrier reported, an all-reduce a dead peer never joins):
    close() gives up after its timeout and the run goes on to write its trace (an untimed
    synchronize hung it)."""
    cuda, rows = FakeCuda(), []
    s = _stream(cuda, rows)
    s.submit(lambda: cuda.kernel(HOUR), "forward#1", 1)
    import scheduler.device.cuda_streams as cs

    monkeypatch.setattr(cs, "CLOSE_TIMEOUT_S", 0.2, raising=False)
    closer = threading.Thread(target=s.close, daemon=True)
    closer.start()
    closer.join(10.0)
    assert not closer.is_alive() and not rows
