"""CUDA streams and events: the device protocol (scheduler/device/work.py) on a GPU.

A stream's work is launched on the calling thread inside the stream's context, so a
launch returns as soon as its kernels are queued: nothing here synchronises with the
device except the one event sync that anchors the clock at start-up, and the waits
the engine asks for (the barrier, an idle wait before defragmenting).

Timing: each launch is bracketed by two timing events; the pairs already complete are
turned into probe rows at every launch (a query each, no sync), so device rows reach
the trace while the run goes on and the pending list stays as short as the work in
flight. Times come from cudaEventElapsedTime, float32 milliseconds between two
events. Read from one anchor for the whole run they would coarsen as it grows (a float32
millisecond count has 0.25 ms steps after an hour), so the clock re-anchors on every
resolved launch's end event: each reading spans about one launch, and the chain's
rounding errors are unbiased, growing with the square root of the number of launches.

Waits: an event is created with blocking sync, and a stream's waits are made by its own
sync thread (cudaEventSynchronize, which sleeps in the driver), which sets a host event;
the caller waits on that with its timeout. No polling, and the timeout still holds.

`cuda` is the torch.cuda module, or a stand-in with its semantics (tests/support/fake_cuda.py).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any

from probes.boundaries import DEVICE_COMPUTE
from probes.clock import now_ns
from probes.recorder import Probes
from scheduler.device.work import Event, OpRecord, Work


class DeviceClock:
    """Device event times on the host's CLOCK_MONOTONIC (see the module's notes)."""

    def __init__(self, cuda: Any, stream: Any) -> None:
        base = cuda.Event(enable_timing=True)
        base.record(stream)
        base.synchronize()  # the one sync: it ties the device's timeline to the host clock
        self._ev, self._ns = base, now_ns()

    def ts(self, ev: Any) -> int:
        """A completed event's time."""
        ms: float = self._ev.elapsed_time(ev)  # torch.cuda.Event.elapsed_time: milliseconds
        return self._ns + round(ms * 1e6)

    def advance(self, ev: Any, ts: int) -> None:
        """Later readings measure from `ev` (complete, at `ts`): short spans stay precise."""
        self._ev, self._ns = ev, ts


class _Syncer:
    """A stream's sync thread. Its events complete in stream order, so one thread per
    stream waits for them one after another; another stream's waits never queue behind a
    hung one."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Any, threading.Event] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"cuda-sync-{name}", daemon=True)
        self._thread.start()

    def request(self, ev: Any) -> threading.Event:
        done = threading.Event()
        self._q.put((ev, done))
        return done

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            ev, done = item
            try:
                ev.synchronize()
            finally:
                done.set()

    def close(self) -> None:
        self._q.put(None)


class CudaEvent:
    __slots__ = ("label", "stream", "ev", "_clock", "_syncer", "_done", "_ts")

    def __init__(self, label: str, stream: str, ev: Any, clock: DeviceClock, syncer: _Syncer) -> None:
        self.label, self.stream, self.ev = label, stream, ev
        self._clock, self._syncer = clock, syncer
        self._done: threading.Event | None = None
        self._ts: int | None = None

    def query(self) -> bool:
        return bool(self.ev.query())

    def wait(self, timeout_s: float) -> bool:
        if self.ev.query():
            return True
        if timeout_s <= 0:
            return False
        if self._done is None:  # one sync request per event, however many slices the wait takes
            self._done = self._syncer.request(self.ev)
        return self._done.wait(timeout_s)

    @property
    def ts_ns(self) -> int | None:
        if self._ts is None and self.ev.query():
            self._ts = self._clock.ts(self.ev)
        return self._ts


class CudaStream:
    def __init__(self, name: str, probes: Probes, device: Any, priority: int = 0, cuda: Any = None,
                 clock: DeviceClock | None = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.name = name
        self.error: BaseException | None = None
        self._cuda = cuda
        self.stream = cuda.Stream(device=device, priority=priority)
        self.clock = clock or DeviceClock(cuda, self.stream)
        self._rank = probes.rank
        self._buf = probes.buffer()
        self._events = 0
        self._syncer = _Syncer(name)
        self._pending: deque[tuple[Any, Any, str, int, str]] = deque()
        self.completed: deque[OpRecord] = deque(maxlen=32)

    def _event(self) -> Any:
        ev = self._cuda.Event(enable_timing=True, blocking=True)
        ev.record(self.stream)
        return ev

    def submit(self, fn: Work, label: str, step: int = -1, boundary: str = DEVICE_COMPUTE) -> None:
        if not callable(fn):
            raise TypeError(f"{label}: a CUDA stream runs Python callables that launch kernels")
        self.drain()
        # The batch's index tensors were copied (pinned, non-blocking) on the caller's stream
        # while it prepared the batch: this stream starts after them, on the device.
        self.stream.wait_stream(self._cuda.current_stream())
        start = self._event()
        try:
            with self._cuda.stream(self.stream):
                fn()
        except BaseException as e:  # noqa: BLE001 - surfaced by the barrier through `error`
            self.error = e
        self._pending.append((start, self._event(), label, step, boundary))

    def drain(self) -> None:
        """Probe rows for the launches already complete. They complete in stream order, so
        the first one still running ends the scan; a query each, never a sync."""
        clock = self.clock
        while self._pending and self._pending[0][1].query():
            start, end, label, step, boundary = self._pending.popleft()
            t0, t1 = clock.ts(start), clock.ts(end)
            clock.advance(end, t1)
            self.completed.append(OpRecord(label, step, t0, t1))
            if self._buf is not None:
                self._buf.append((t0, t1 - t0, boundary, self.name, self._rank, step))

    def record(self) -> CudaEvent:
        self._events += 1
        return CudaEvent(f"{self.name}#{self._events}", self.name, self._event(), self.clock, self._syncer)

    def wait_event(self, ev: Event) -> None:
        assert isinstance(ev, CudaEvent)
        self.stream.wait_event(ev.ev)

    def state(self) -> dict[str, Any]:
        return {
            "stream": self.name,
            "queue_depth": len(self._pending),
            "in_progress": self._pending[0][2] if self._pending else None,
            "recent": [(o.label, o.step, o.start_ns, o.end_ns) for o in list(self.completed)],
            "error": None if self.error is None else repr(self.error),
            "backend": "cuda",
        }

    def close(self) -> None:
        self.stream.synchronize()
        self.drain()
        self._syncer.close()


def make_cuda_streams(device: Any, probes: Probes, names: tuple[str, ...], cuda: Any = None) -> dict[str, CudaStream]:
    """One clock for all of a device's streams; lower number = higher priority: decode's main
    stream goes first."""
    first = CudaStream(names[0], probes, device, priority=-1 if names[0] == "main" else 0, cuda=cuda)
    rest = {n: CudaStream(n, probes, device, priority=-1 if n == "main" else 0, cuda=cuda, clock=first.clock)
            for n in names[1:]}
    return {names[0]: first, **rest}
