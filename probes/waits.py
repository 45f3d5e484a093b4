"""Timed waits. Every wait in the engine goes through `timed_wait`, so a grep
for it finds every gate, every wait has a timeout, and a registry knows at any
moment who waits for what and for whom (the stall watchdog reads it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

from probes.clock import now_ns
from probes.recorder import ProbeRow

DEFAULT_TIMEOUT_S = 5.0  # long enough for a slow CPU forward, short enough to report a hang


class WaitTimeout(RuntimeError):
    """A timed wait expired. str(e) names the waiter, what it waited for and who should have signalled."""

    def __init__(self, wait: ActiveWait, timeout_s: float) -> None:
        super().__init__(
            f"{wait.waiter} waited {timeout_s:.1f} s for {wait.what} (to be signalled by {wait.signaller})"
        )
        self.wait = wait
        self.timeout_s = timeout_s


@dataclass(slots=True)
class ActiveWait:
    waiter: str  # thread or stream name
    what: str  # e.g. "event main#42", "queue tokenized"
    signaller: str  # who is expected to complete it
    boundary: str
    since_ns: int
    thread_id: int  # DEVICE_THREAD: a wait on the device (a GPU stream, the CPU device process), no host thread


DEVICE_THREAD = 0


class WaitRegistry:
    def __init__(self) -> None:
        self._active: dict[int, ActiveWait] = {}
        self._ids = count()
        # Waits nobody blocks a host thread for (a GPU stream's wait for another stream's
        # event): each source says which of its waits are waiting now, when asked. A source
        # returns the same ActiveWait object for as long as one wait lasts (the watchdog
        # reports each object once).
        self._sources: list[Callable[[], list[ActiveWait]]] = []

    def begin(self, w: ActiveWait) -> int:
        k = next(self._ids)  # itertools.count is atomic under the GIL
        self._active[k] = w
        return k

    def end(self, k: int) -> None:
        self._active.pop(k, None)

    def add_source(self, source: Callable[[], list[ActiveWait]]) -> None:
        self._sources.append(source)

    def snapshot(self) -> list[ActiveWait]:
        waits = list(self._active.values())
        for source in self._sources:
            try:
                waits += source()
            except Exception:  # noqa: BLE001 - a broken device (a sticky CUDA error) must not hide the host's waits
                continue
        return waits


def timed_wait(
    ready: Callable[[float], bool],
    *,
    registry: WaitRegistry,
    waiter: str,
    what: str,
    signaller: str,
    boundary: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    buf: list[ProbeRow] | None = None,
    stream: str = "host",
    rank: int = 0,
    step: int = -1,
    raise_on_timeout: bool = True,
    on_expire: Callable[[], object] | None = None,
) -> int:
    """Block until `ready(slice_s)` returns True, or raise WaitTimeout.

    `ready` is a blocking call with a timeout (Event.wait, Queue.get wrapper,
    work.wait ...). The wait is registered while it lasts and recorded as one
    probe row of `boundary`. Returns the waited nanoseconds, or -1 when the
    timeout passed and `raise_on_timeout` is False (a poll, e.g. for arrivals).
    `on_expire` is called once when the timeout passes, the wait still registered (a
    watchdog's `check`: a wait that gives up is reported even where the watchdog's own
    thread did not get a core between its threshold and the timeout).
    """
    t0 = now_ns()
    if ready(0.0):  # the common case: already done, no registry traffic
        waited = now_ns() - t0  # one reading: the row and the return agree
        if buf is not None:
            buf.append((t0, waited, boundary, stream, rank, step))
        return waited
    w = ActiveWait(waiter, what, signaller, boundary, t0, threading.get_ident())
    k = registry.begin(w)
    deadline = t0 + int(timeout_s * 1e9)
    try:
        while True:
            left = (deadline - now_ns()) / 1e9
            if left <= 0:
                if on_expire is not None:
                    on_expire()
                # the wait is a row either way: a stalled run's longest interval is its
                # timed-out wait, and it must not be left unattributed
                if buf is not None:
                    buf.append((t0, now_ns() - t0, boundary, stream, rank, step))
                if not raise_on_timeout:
                    return -1
                raise WaitTimeout(w, timeout_s)
            if ready(min(left, 0.1)):
                break
    finally:
        registry.end(k)
    t1 = now_ns()
    if buf is not None:
        buf.append((t0, t1 - t0, boundary, stream, rank, step))
    return t1 - t0
