"""Streams and events: the device's work queues, on CUDA or emulated on CPU.

The interface (scheduler/device/work.py): Stream.submit(fn), Stream.record() -> Event,
Stream.wait_event(ev); Event.query(), Event.wait(timeout) and Event.ts_ns.

cpu backend: one worker thread per stream runs its submitted work in order.
An event completes, with a timestamp, when the work before it has run;
wait_event makes the stream's own thread wait (through probes.timed_wait, so
the watchdog sees it). torch releases the GIL inside kernels, so work on two
streams really runs at the same time.

cuda backend: scheduler/device/cuda_streams.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from probes.boundaries import DEVICE_COMPUTE, STREAM_WAIT
from probes.clock import now_ns
from probes.recorder import ProbeRow, Probes
from probes.waits import DEFAULT_TIMEOUT_S, WaitRegistry, timed_wait
from scheduler.device.work import STREAM_NAMES, Event, OpRecord, RowsOff, Stream, Unbatched, Work


# ---------------------------------------------------------------- cpu backend
class CpuEvent:
    __slots__ = ("label", "stream", "_done", "_ts")

    def __init__(self, label: str, stream: str) -> None:
        self.label = label
        self.stream = stream
        self._done = threading.Event()
        self._ts: int | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s) if timeout_s > 0 else self._done.is_set()

    @property
    def ts_ns(self) -> int | None:
        return self._ts

    def _complete(self) -> None:
        self._ts = now_ns()
        self._done.set()


_STOP = object()


class CpuStream(RowsOff, Unbatched):
    """A worker thread that runs submitted callables in order."""

    def __init__(
        self,
        name: str,
        probes: Probes,
        registry: WaitRegistry,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        history: int = 32,
    ) -> None:
        self.name = name
        self.error: BaseException | None = None
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._rank = probes.rank
        self._buf: list[ProbeRow] | None = probes.buffer()
        self._registry = registry
        self._timeout = timeout_s
        self._events = 0
        # Two one-writer counters instead of a shared `+=`, which is not atomic across threads.
        self._queued = 0
        self._done = 0
        self.current: tuple[str, int] | None = None  # (label, since_ns) of the op in progress
        self.completed: deque[OpRecord] = deque(maxlen=history)
        # the recorded compute ops (the run's, not the start-up probe's) in all: count, wall
        # ns, this thread's CPU ns; wall - CPU is time they were not running (the GIL, a core).
        # One tuple rebound per op, so a reader never sees half an update.
        self.compute_times = (0, 0, 0)
        self._thread = threading.Thread(target=self._loop, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Work, label: str, step: int = -1, boundary: str = DEVICE_COMPUTE) -> None:
        if not callable(fn):
            raise TypeError(f"{label}: an in-process stream runs Python callables")
        self._queued += 1
        self._q.put((fn, label, step, boundary))

    def submit_host(self, fn: Callable[[], Any], label: str, step: int, boundary: str) -> None:
        self.submit(fn, label, step, boundary)  # the stream's thread is a host thread

    def record(self) -> CpuEvent:
        self._events += 1
        ev = CpuEvent(f"{self.name}#{self._events}", self.name)
        self._queued += 1
        self._q.put(ev)
        return ev

    def wait_event(self, ev: Event) -> None:
        self._queued += 1
        self._q.put(("wait", ev))

    def state(self) -> dict[str, Any]:
        cur = self.current
        return {
            "stream": self.name,
            "queue_depth": self._queued - self._done,
            "in_progress": None if cur is None else {"label": cur[0], "since_ns": cur[1]},
            "recent": [(o.label, o.step, o.start_ns, o.end_ns) for o in list(self.completed)],
            "error": None if self.error is None else repr(self.error),
        }

    def close(self) -> None:
        self._q.put(_STOP)
        self._thread.join(timeout=self._timeout + 1)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            self._done += 1
            if isinstance(item, CpuEvent):
                item._complete()
            elif item[0] == "wait":
                self._wait(item[1])
            else:
                self._run(*item)

    def _run(self, fn: Callable[[], Any], label: str, step: int, boundary: str) -> None:
        t0, c0 = now_ns(), time.thread_time_ns()
        self.current = (label, t0)
        try:
            if self.error is None:  # after a failure, later work is skipped but events still complete
                fn()
        except BaseException as e:  # noqa: BLE001 - surfaced to the host through .error
            self.error = e
        t1, c1 = now_ns(), time.thread_time_ns()
        self.current = None
        self.completed.append(OpRecord(label, step, t0, t1))
        if self._buf is not None:
            self._buf.append((t0, t1 - t0, boundary, self.name, self._rank, step))
            if boundary == DEVICE_COMPUTE:  # not a stagger's sleep or an injected fault's wait
                n, wall, cpu = self.compute_times
                self.compute_times = (n + 1, wall + t1 - t0, cpu + c1 - c0)

    def _wait(self, ev: Event) -> None:
        try:
            timed_wait(ev.wait, registry=self._registry, waiter=f"{self.name}-stream", what=f"event {ev.label}",
                       signaller=f"{ev.stream}-stream", boundary=STREAM_WAIT, timeout_s=self._timeout,
                       buf=self._buf, stream=self.name, rank=self._rank)
        except BaseException as e:  # noqa: BLE001
            self.error = e


def make_streams(
    device: Any, probes: Probes, registry: WaitRegistry, timeout_s: float = DEFAULT_TIMEOUT_S,
    names: tuple[str, ...] = STREAM_NAMES,
) -> dict[str, Stream]:
    if getattr(device, "type", str(device)) == "cuda":
        from scheduler.device.cuda_streams import make_cuda_streams

        return dict(make_cuda_streams(device, probes, names, registry=registry))
    return {n: CpuStream(n, probes, registry, timeout_s) for n in names}
