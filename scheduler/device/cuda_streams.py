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
resolved launch's end event: each reading spans about one launch. Each rounds by at most
2 ns below 64 ms (4 ns below 128); where the gaps between launches vary over float32's steps,
as a device's rounds do by microseconds, the roundings are independent and the chain's
error grows with the square root of the number of launches (gaps equal to the nanosecond
would add up the same rounding every launch).
A launch's length is its own two events' reading, however long the device idled before it.

Waits: an event is created with blocking sync, and a stream's waits are made by its own
sync thread (cudaEventSynchronize, which sleeps in the driver), which sets a host event;
the caller waits on that with its timeout. No polling, and the timeout still holds.

A stream's wait for another stream's event is the device's, not a host thread's, so no
timed_wait sees it; the stream lists it for the wait registry instead (`device_waits`, read
by the stall watchdog): waiting from the moment the stream's earlier work is done (its last
event before the wait completes) until the awaited event completes. That costs no sync and
no extra event: two queries per wait, when the watchdog looks.

Host work on a stream (`submit_host`: the fault injector's "wait for free blocks") runs as a
host function (cuLaunchHostFunc): on a driver thread once the stream's earlier work is
done, with the stream's later work held behind it, as a CPU stream thread would run it.

`cuda` is the torch.cuda module, or a stand-in with its semantics (tests/support/fake_cuda.py).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from probes.boundaries import DEVICE_COMPUTE, STREAM_WAIT
from probes.clock import now_ns
from probes.recorder import Probes
from probes.waits import DEVICE_THREAD, ActiveWait, WaitRegistry
from scheduler.device.work import Event, OpRecord, RowsOff, Unbatched, Work

CLOSE_TIMEOUT_S = 30.0  # how long closing waits for a stream's queued work to finish


class DeviceClock:
    """Device event times on the host's CLOCK_MONOTONIC (see the module's notes)."""

    def __init__(self, cuda: Any, stream: Any) -> None:
        base = cuda.Event(enable_timing=True)
        base.record(stream)
        base.synchronize()  # the one sync: it ties the device's timeline to the host clock
        # one tuple, swapped whole: the watchdog's thread reads it while the launching one advances it
        self._anchor: tuple[Any, int] = (base, now_ns())

    def ts(self, ev: Any) -> int:
        """A completed event's time."""
        base, ns = self._anchor
        ms: float = base.elapsed_time(ev)  # torch.cuda.Event.elapsed_time: milliseconds
        return ns + round(ms * 1e6)

    def advance(self, ev: Any, ts: int) -> None:
        """Later readings measure from `ev` (complete, at `ts`): short spans stay precise."""
        self._anchor = (ev, ts)


class _Synced:
    """One sync request: set once the event completed, or once its sync raised (`error`: a
    CUDA error, such as an illegal address, which the waiter raises)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Syncer:
    """A stream's sync thread. Its events complete in stream order, so one thread per
    stream waits for them one after another; another stream's waits never queue behind a
    hung one."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Any, _Synced] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"cuda-sync-{name}", daemon=True)
        self._thread.start()

    def request(self, ev: Any) -> _Synced:
        req = _Synced()
        self._q.put((ev, req))
        return req

    def _loop(self) -> None:
        # the loop outlives a failed sync: every later wait on the stream gets its answer
        # (the error again, from CUDA's sticky state), not a timeout read as a stall
        while (item := self._q.get()) is not None:
            ev, req = item
            try:
                ev.synchronize()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, who raises it
                req.error = e
            finally:
                req.done.set()

    def close(self) -> None:
        self._q.put(None)


class CudaEvent:
    __slots__ = ("label", "stream", "ev", "_clock", "_syncer", "_done", "_ts")

    def __init__(self, label: str, stream: str, ev: Any, clock: DeviceClock, syncer: _Syncer) -> None:
        self.label, self.stream, self.ev = label, stream, ev
        self._clock, self._syncer = clock, syncer
        self._done: _Synced | None = None
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
        if not self._done.done.wait(timeout_s):
            return False
        if self._done.error is not None:
            raise self._done.error  # its copies never ran: what the barrier would read is garbage
        return True

    @property
    def ts_ns(self) -> int | None:
        if self._ts is None and self.ev.query():
            self._ts = self._clock.ts(self.ev)
        return self._ts


class _DeviceWait:
    """A stream's wait for another stream's event, as the wait registry lists it."""

    __slots__ = ("reached", "awaited", "since_ns", "what", "signaller", "active")

    def __init__(self, reached: Any, awaited: CudaEvent, since_ns: int) -> None:
        self.reached = reached  # the stream's last event before the wait (None: it was idle)
        self.awaited = awaited
        self.since_ns = since_ns
        self.what, self.signaller = f"event {awaited.label}", f"{awaited.stream}-stream"
        self.active: ActiveWait | None = None  # made once, when first seen waiting


class CudaStream(RowsOff, Unbatched):
    def __init__(self, name: str, probes: Probes, device: Any, priority: int = 0, cuda: Any = None,
                 clock: DeviceClock | None = None, registry: WaitRegistry | None = None) -> None:
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
        self._last: Any = None  # the newest event recorded on the stream
        self._waits: deque[_DeviceWait] = deque()
        if registry is not None:
            registry.add_source(self.device_waits)

    def _event(self) -> Any:
        ev = self._cuda.Event(enable_timing=True, blocking=True)
        ev.record(self.stream)
        self._last = ev
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

    def submit_host(self, fn: Callable[[], Any], label: str, step: int, boundary: str) -> None:
        """`fn` on a host thread once the stream's earlier work is done; the stream's later work
        waits for it to return. Its exception becomes the stream's error. `fn` must not call
        CUDA (a host function may not)."""
        self.drain()

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - surfaced by the barrier through `error`
                self.error = e

        start = self._event()
        launch = getattr(self._cuda, "launch_host_func", None)  # the test stand-in's
        (launch or _launch_host_func)(self.stream, run)
        # its end completes when the function returns: the stall dump shows it in progress till then
        self._pending.append((start, self._event(), label, step, boundary))

    def device_waits(self) -> list[ActiveWait]:
        """The wait registry's source (any thread): this stream's waits for other streams'
        events that it has reached and that are not over."""
        out = []
        for w in tuple(self._waits):
            if w.awaited.query() or (w.reached is not None and not w.reached.query()):
                continue
            if w.active is None:
                since = w.since_ns if w.reached is None else self.clock.ts(w.reached)
                w.active = ActiveWait(f"{self.name}-stream", w.what, w.signaller, STREAM_WAIT, since,
                                      DEVICE_THREAD)
            out.append(w.active)
        return out

    def drain(self) -> None:
        """Probe rows for the launches already complete. They complete in stream order, so
        the first one still running ends the scan; a query each, never a sync."""
        while self._waits and self._waits[0].awaited.query():
            self._waits.popleft()
        clock = self.clock
        while self._pending and self._pending[0][1].query():
            start, end, label, step, boundary = self._pending.popleft()
            # the span from its own pair: read from the anchor, which is as old as the
            # device's last idle, a float32 count of an hour's milliseconds has 0.25 ms steps
            t0 = clock.ts(start)
            t1 = t0 + round(start.elapsed_time(end) * 1e6)
            clock.advance(end, t1)
            self.completed.append(OpRecord(label, step, t0, t1))
            if self._buf is not None:
                self._buf.append((t0, t1 - t0, boundary, self.name, self._rank, step))

    def record(self) -> CudaEvent:
        self._events += 1
        return CudaEvent(f"{self.name}#{self._events}", self.name, self._event(), self.clock, self._syncer)

    def wait_event(self, ev: Event) -> None:
        assert isinstance(ev, CudaEvent)
        self._waits.append(_DeviceWait(self._last, ev, now_ns()))
        self.stream.wait_event(ev.ev)

    def state(self) -> dict[str, Any]:
        # the pending list is drained at launches only: in a stall, finished launches wait
        # at its head (they complete in order, so the first not done is the one in progress)
        pending = tuple(self._pending)
        done = next((i for i, p in enumerate(pending) if not p[1].query()), len(pending))
        return {
            "stream": self.name,
            "queue_depth": len(pending) - done,
            "in_progress": pending[done][2] if done < len(pending) else None,
            "recent": [(o.label, o.step, o.start_ns, o.end_ns) for o in list(self.completed)]
            + [(p[2], p[3], self.clock.ts(p[0]), self.clock.ts(p[1])) for p in pending[:done]],
            "error": None if self.error is None else repr(self.error),
            "backend": "cuda",
        }

    def close(self) -> None:
        """The stream's last launches drained into probe rows, once done; a stream still busy
        after CLOSE_TIMEOUT_S (a kernel that never ends, the stall the barrier reported; an
        all-reduce a dead peer never joins) is left running, its launches unrecorded, so the
        run ends and writes its trace (an untimed synchronize here hung it)."""
        try:
            finished = self.record().wait(CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a CUDA error: already the stream's or the barrier's
            finished = False
        if finished:
            self.drain()
        self._syncer.close()


def make_cuda_streams(device: Any, probes: Probes, names: tuple[str, ...], cuda: Any = None,
                      registry: WaitRegistry | None = None) -> dict[str, CudaStream]:
    """One clock for all of a device's streams; lower number = higher priority: decode's main
    stream goes first."""
    first = CudaStream(names[0], probes, device, priority=-1 if names[0] == "main" else 0, cuda=cuda,
                       registry=registry)
    rest = {n: CudaStream(n, probes, device, priority=-1 if n == "main" else 0, cuda=cuda, clock=first.clock,
                          registry=registry)
            for n in names[1:]}
    return {names[0]: first, **rest}


_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_host_fns: dict[int, Callable[[], None]] = {}  # queued host functions by key, until they run
_host_keys = itertools.count(1)


def _run_host_fn_py(key: Any) -> None:
    fn = _host_fns.pop(int(key))  # user data: the key, as a pointer-sized integer
    fn()


_run_host_fn = _HOST_FN(_run_host_fn_py)  # one C callback for every host function, alive for good


@functools.cache
def _cu_launch_host_func() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")  # the driver torch has loaded already
    launch = lib.cuLaunchHostFunc
    launch.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    return launch


def _launch_host_func(stream: Any, fn: Callable[[], None]) -> None:
    """cuLaunchHostFunc on a torch stream (torch has no binding for it). `fn` is registered
    before the launch: on an idle stream the driver may run it before the call returns."""
    key = next(_host_keys)
    _host_fns[key] = fn
    rc = _cu_launch_host_func()(ctypes.c_void_p(stream.cuda_stream), _run_host_fn, ctypes.c_void_p(key))
    if rc != 0:
        _host_fns.pop(key, None)
        raise RuntimeError(f"cuLaunchHostFunc failed: CUresult {rc}")
