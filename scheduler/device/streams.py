"""Streams and events: the device's work queues, on CUDA or emulated on CPU.

The interface (scheduler/device/work.py): Stream.submit(fn), Stream.record() -> Event,
Stream.wait_event(ev); Event.query(), Event.wait(timeout) and Event.ts_ns.

cpu backend: one worker thread per stream runs its submitted work in order.
An event completes, with a timestamp, when the work before it has run;
wait_event makes the stream's own thread wait (through probes.timed_wait, so
the watchdog sees it). torch releases the GIL inside kernels, so work on two
streams really runs at the same time.

cuda backend: torch.cuda.Stream / torch.cuda.Event. Work is launched on the
calling thread inside the stream's context; device time comes from event pairs
resolved only after the engine's own synchronisation, so timing adds no sync.
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
from probes.recorder import Probes, Row
from probes.waits import DEFAULT_TIMEOUT_S, WaitRegistry, timed_wait
from scheduler.device.work import STREAM_NAMES, Event, OpRecord, Stream, Work


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


class CpuStream:
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
        self._buf: list[Row] | None = probes.buffer()
        self._registry = registry
        self._timeout = timeout_s
        self._events = 0
        # Two one-writer counters instead of a shared `+=`, which is not atomic across threads.
        self._queued = 0
        self._done = 0
        self.current: tuple[str, int] | None = None  # (label, since_ns) of the op in progress
        self.completed: deque[OpRecord] = deque(maxlen=history)
        self._thread = threading.Thread(target=self._loop, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn: Work, label: str, step: int = -1, boundary: str = DEVICE_COMPUTE) -> None:
        if not callable(fn):
            raise TypeError(f"{label}: an in-process stream runs Python callables")
        self._queued += 1
        self._q.put((fn, label, step, boundary))

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
        t0 = now_ns()
        self.current = (label, t0)
        try:
            if self.error is None:  # after a failure, later work is skipped but events still complete
                fn()
        except BaseException as e:  # noqa: BLE001 - surfaced to the host through .error
            self.error = e
        t1 = now_ns()
        self.current = None
        self.completed.append(OpRecord(label, step, t0, t1))
        if self._buf is not None:
            self._buf.append((t0, t1 - t0, boundary, self.name, self._rank, step))

    def _wait(self, ev: Event) -> None:
        try:
            timed_wait(ev.wait, registry=self._registry, waiter=f"{self.name}-stream", what=f"event {ev.label}",
                       signaller=f"{ev.stream}-stream", boundary=STREAM_WAIT, timeout_s=self._timeout,
                       buf=self._buf, stream=self.name, rank=self._rank)
        except BaseException as e:  # noqa: BLE001
            self.error = e


# --------------------------------------------------------------- cuda backend
class CudaEvent:
    __slots__ = ("label", "stream", "ev", "_base")

    def __init__(self, label: str, stream: str, ev: Any, base: tuple[Any, int]) -> None:
        self.label = label
        self.stream = stream
        self.ev = ev
        self._base = base

    def query(self) -> bool:
        return bool(self.ev.query())

    def wait(self, timeout_s: float) -> bool:
        # cudaEventSynchronize has no timeout; polling query() keeps the wait
        # interruptible without adding a device-wide sync.
        deadline = time.monotonic() + timeout_s
        while not self.ev.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(20e-6)
        return True

    @property
    def ts_ns(self) -> int | None:
        if not self.ev.query():
            return None
        base_ev, base_ns = self._base
        return base_ns + int(base_ev.elapsed_time(self.ev) * 1e6)


class CudaStream:
    def __init__(self, name: str, probes: Probes, device: Any, priority: int = 0) -> None:
        import torch

        self.name = name
        self.error: BaseException | None = None
        self._torch = torch
        self.stream = torch.cuda.Stream(device=device, priority=priority)
        self._rank = probes.rank
        self._buf = probes.buffer()
        self._events = 0
        # One sync at start-up anchors device time to the host clock.
        base = torch.cuda.Event(enable_timing=True)
        base.record(self.stream)
        base.synchronize()
        self._base = (base, now_ns())
        self._pending: list[tuple[Any, Any, str, int, str]] = []
        self.completed: deque[OpRecord] = deque(maxlen=32)

    def _event(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def submit(self, fn: Work, label: str, step: int = -1, boundary: str = DEVICE_COMPUTE) -> None:
        if not callable(fn):
            raise TypeError(f"{label}: a CUDA stream runs Python callables that launch kernels")
        start = self._event()
        try:
            with self._torch.cuda.stream(self.stream):
                fn()
        except BaseException as e:  # noqa: BLE001
            self.error = e
        self._pending.append((start, self._event(), label, step, boundary))

    def record(self) -> CudaEvent:
        self._events += 1
        return CudaEvent(f"{self.name}#{self._events}", self.name, self._event(), self._base)

    def wait_event(self, ev: Event) -> None:
        assert isinstance(ev, CudaEvent)
        self.stream.wait_event(ev.ev)

    def resolve_timings(self) -> None:
        """Turn finished event pairs into probe rows; call after the host has synced anyway."""
        base_ev, base_ns = self._base
        keep = []
        for start, end, label, step, boundary in self._pending:
            if not end.query():
                keep.append((start, end, label, step, boundary))
                continue
            t0 = base_ns + int(base_ev.elapsed_time(start) * 1e6)
            t1 = base_ns + int(base_ev.elapsed_time(end) * 1e6)
            self.completed.append(OpRecord(label, step, t0, t1))
            if self._buf is not None:
                self._buf.append((t0, t1 - t0, boundary, self.name, self._rank, step))
        self._pending = keep

    def state(self) -> dict[str, Any]:
        return {
            "stream": self.name,
            "queue_depth": len(self._pending),
            "in_progress": None,
            "recent": [(o.label, o.step, o.start_ns, o.end_ns) for o in list(self.completed)],
            "error": None if self.error is None else repr(self.error),
        }

    def close(self) -> None:
        self.stream.synchronize()
        self.resolve_timings()


def make_streams(
    device: Any, probes: Probes, registry: WaitRegistry, timeout_s: float = DEFAULT_TIMEOUT_S,
    names: tuple[str, ...] = STREAM_NAMES,
) -> dict[str, Stream]:
    if getattr(device, "type", str(device)) == "cuda":
        # Lower number = higher priority on CUDA: decode's main stream goes first.
        return {n: CudaStream(n, probes, device, priority=-1 if n == "main" else 0) for n in names}
    return {n: CpuStream(n, probes, registry, timeout_s) for n in names}
