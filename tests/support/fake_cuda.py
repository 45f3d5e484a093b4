"""A stand-in for torch.cuda's streams and events with CUDA's semantics, on a virtual
device clock, so the CUDA backend's logic (scheduler/device/cuda_streams.py) is tested
on a machine without a GPU.

Work launched inside `with cuda.stream(s)` calls `cuda.kernel(ns)`: the kernel is queued
on the stream and ends `ns` after the later of now and the stream's previous work; the
launch returns at once. An event records the stream's position; `query()` is true once
the device clock has passed it; `synchronize()` sleeps until then; `elapsed_time` is
float32 milliseconds, as cudaEventElapsedTime gives. The device clock is the host's
monotonic clock plus `skew`, which a test advances to jump hours ahead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


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
        s.tail = max(self.now(), s.tail) + ns

    def _sleep_until(self, t: int) -> None:
        while self.now() < t:  # in slices, so a test's jump of `skew` is seen
            time.sleep(min(0.005, max(0.0, (t - self.now()) / 1e9)))


class FakeStream:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.tail = 0  # device time at which the stream's queued work ends

    def wait_event(self, ev: FakeEvent) -> None:
        if ev.t is not None:
            self.tail = max(self.tail, ev.t)

    def wait_stream(self, other: FakeStream) -> None:
        self.tail = max(self.tail, other.tail)

    def synchronize(self) -> None:
        self.cuda._sleep_until(self.tail)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.t: int | None = None

    def record(self, stream: FakeStream) -> None:
        self.t = max(stream.tail, self.cuda.now())

    def query(self) -> bool:
        self.cuda.queries += 1
        return self.t is not None and self.cuda.now() >= self.t

    def synchronize(self) -> None:
        assert self.t is not None, "synchronize on an event never recorded"
        self.cuda.syncs += 1
        self.cuda._sleep_until(self.t)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None and self.query() and end.query()
        return float(np.float32((end.t - self.t) / 1e6))
