"""The device protocol: what a stream runs, and the stream and event interfaces every
backend implements (threads here: scheduler/device/streams.py; CUDA streams there;
a device process: scheduler/device/device_process.py).

Stream.submit(work), Stream.record() -> Event, Stream.wait_event(ev);
Event.query(), Event.wait(timeout) and Event.ts_ns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from probes.boundaries import DEVICE_COMPUTE

MAIN, PREFILL, COMM = "main", "prefill", "comm"
# What a stream runs: a callable here, or plain data for a device process.
Work: TypeAlias = "Callable[[], Any] | RemoteOp"
STREAM_NAMES = (MAIN, PREFILL, COMM)
FUTURE_SLOTS = 1 << 16  # the future-token ring: > 2 rounds in flight x max batch; a slot is reused only after both finished


class Event(Protocol):
    label: str
    stream: str

    def query(self) -> bool: ...

    def wait(self, timeout_s: float) -> bool: ...

    @property
    def ts_ns(self) -> int | None: ...


class Stream(Protocol):
    name: str
    error: BaseException | None
    completed: deque[OpRecord]  # the last ops run, oldest first (the watchdog's history)

    def submit(self, fn: Work, label: str, step: int = -1, boundary: str = DEVICE_COMPUTE) -> None: ...

    def submit_host(self, fn: Callable[[], Any], label: str, step: int, boundary: str) -> None:
        """`fn` on a host thread once the stream's earlier work is done, the stream's later
        work held behind it (a CPU stream's own thread; a GPU's host function); its row is of
        `boundary` (what it does is not the device's compute)."""
        ...

    def record(self) -> Event: ...

    def wait_event(self, ev: Event) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def unrecorded(self) -> AbstractContextManager[None]:
        """Work submitted and waited for inside leaves no probe rows (the engine's start-up
        contention probe, scheduler/device/contention.py, which is not the run's work)."""
        ...

    def batched(self) -> AbstractContextManager[None]:
        """The items submitted inside reach the device together when the block ends (a
        device process: one pipe message for a launch's events and forward); elsewhere each
        as it is submitted."""
        ...


class Unbatched:
    """`Stream.batched` for a stream whose items reach the device as they are submitted."""

    def batched(self) -> AbstractContextManager[None]:
        return nullcontext()


class RowsOff:
    """`Stream.unrecorded` for a stream that appends its probe rows to `self._buf`."""

    _buf: list[Any] | None

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        buf, self._buf = self._buf, None
        try:
            yield
        finally:
            self._buf = buf


class DeviceOps(Protocol):
    """What the executor launches on: the model, KV pool and future ring in this process
    (scheduler/device/local_device.py), or in a device process (device_process.py's
    RemoteDevice). Each returns the work for a stream to run."""

    builds_batch_on_host: bool  # prepare() builds the forward batch's tensors (else: the device does)
    @property
    def kv_check_on(self) -> bool: ...  # the test-only KV ordering check
    device: Any  # the torch device of a local device (None for a device process)

    def forward_work(self, prepared: Any, slots: list[int], step: int, out: list[Any]) -> Work: ...

    def sleep_work(self, us: float) -> Work: ...

    def copy_work(self, src: list[int], dst: list[int]) -> Work: ...

    def kv_reads(self, chunks: Any) -> Any: ...

    def enable_kv_check(self) -> None: ...


@dataclass(slots=True)
class OpRecord:
    label: str
    step: int
    start_ns: int
    end_ns: int


@dataclass(slots=True)
class RemoteOp:
    """Device work named by kind and plain data (a closure cannot cross a process).

    kinds: ``forward`` (seqs, temperatures, top_ps, draw seeds, future slots,
    has_placeholders), ``copy`` (src, dst
    blocks), ``sleep`` (microseconds). ``on_result`` runs on the host's reader
    thread with what the op returned.
    """

    kind: str
    payload: tuple[Any, ...]
    on_result: Callable[[Any], None] | None = None
