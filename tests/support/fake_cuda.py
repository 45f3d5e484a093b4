"""A stand-in for torch.cuda's streams and events with CUDA's semantics, on a virtual
device clock, so the CUDA backend's logic (scheduler/device/cuda_streams.py) is tested
on a machine without a GPU.

Work launched inside `with cuda.stream(s)` calls `cuda.kernel(ns)`: the kernel is queued
on the stream and ends `ns` after the later of now and the stream's previous work; the
launch returns at once. An event records the stream's position; `query()` is true once
the device clock has passed it; `synchronize()` sleeps until then; `elapsed_time` is
float32 milliseconds, as cudaEventElapsedTime gives. The device clock is the host's
monotonic clock plus `skew`, which a test advances to jump hours ahead.

`launch_host_func(stream, fn)` is cuLaunchHostFunc: `fn` runs on a thread of the stand-in's
once the stream's earlier work is done, and the stream's later work waits for it. A time
behind such a function is not known until it returns: each time is `_T`, the later of a
known moment and (the function's return + an offset), which is all one host function
ahead of it needs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np


class _Gate:
    """A host function queued on a stream: when it returned (None: not yet)."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.done = threading.Event()


class _T(NamedTuple):
    """A device time: `lo`, or the later of `lo` and `gate.at + off` behind a host function."""

    gate: _Gate | None
    lo: int
    off: int

    def value(self) -> int | None:
        if self.gate is None:
            return self.lo
        return None if self.gate.at is None else max(self.lo, self.gate.at + self.off)

    def known(self) -> _T:
        """Behind a host function that has returned, a plain moment."""
        v = self.value()
        return _T(None, v, 0) if self.gate is not None and v is not None else self

    def after(self, ns: int, now: int) -> _T:
        """The end of `ns` of work queued behind this time at host moment `now`."""
        t = self.known()
        return _T(t.gate, max(now, t.lo) + ns, t.off + ns)

    def later(self, o: _T) -> _T:
        self, o = self.known(), o.known()
        if o.gate is None or o.gate is self.gate:
            return _T(self.gate, max(self.lo, o.lo), max(self.off, o.off) if o.gate else self.off)
        if self.gate is None:
            return _T(o.gate, max(self.lo, o.lo), o.off)
        raise NotImplementedError("the stand-in orders behind one host function at a time")


class FakeCuda:
    def __init__(self) -> None:
        self._t0 = time.monotonic_ns()
        self.skew = 0
        self.queries = 0
        self.syncs = 0
        self._local = threading.local()

    def now(self) -> int:
        return time.monotonic_ns() - self._t0 + self.skew

    def Stream(self, device: object = None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.cuda's name
        return FakeStream(self)

    def current_stream(self) -> FakeStream:
        cur = getattr(self._local, "stream", None)
        if cur is None:
            cur = self._local.default = getattr(self._local, "default", None) or FakeStream(self)
        return cur

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self)

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        prev = getattr(self._local, "stream", None)
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = prev

    def kernel(self, ns: int) -> None:
        s: FakeStream = self._local.stream
        s.tail = s.tail.after(ns, self.now())

    def launch_host_func(self, s: FakeStream, fn: Callable[[], None]) -> None:
        before, gate = s.tail.after(0, self.now()), _Gate()

        def run() -> None:
            self._sleep_until(before)
            try:
                fn()
            finally:
                gate.at = self.now()
                gate.done.set()

        threading.Thread(target=run, name="fake-cuda-host-func", daemon=True).start()
        s.tail = _T(gate, 0, 0)

    def _sleep_until(self, t: _T) -> None:
        if t.gate is not None:
            t.gate.done.wait()
        end = t.value()
        assert end is not None
        while self.now() < end:  # in slices, so a test's jump of `skew` is seen
            time.sleep(min(0.005, max(0.0, (end - self.now()) / 1e9)))


class FakeStream:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.tail = _T(None, 0, 0)  # device time at which the stream's queued work ends

    def wait_event(self, ev: FakeEvent) -> None:
        if ev.at is not None:  # an event never recorded: no wait, as in CUDA
            self.tail = self.tail.later(ev.at)

    def wait_stream(self, other: FakeStream) -> None:
        self.tail = self.tail.later(other.tail)

    def synchronize(self) -> None:
        self.cuda._sleep_until(self.tail)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.at: _T | None = None

    @property
    def t(self) -> int | None:
        """The device time it completes at; None until recorded and known."""
        return None if self.at is None else self.at.value()

    def record(self, stream: FakeStream) -> None:
        self.at = stream.tail.after(0, self.cuda.now())

    def query(self) -> bool:
        self.cuda.queries += 1
        t = self.t
        return t is not None and self.cuda.now() >= t

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize on an event never recorded"
        self.cuda.syncs += 1
        self.cuda._sleep_until(self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None and self.query() and end.query()
        return float(np.float32((end.t - self.t) / 1e6))
