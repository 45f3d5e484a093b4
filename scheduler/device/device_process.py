"""A CPU "device" in its own process (``--cpu-device process``).

Why: with the thread backend (scheduler/device/streams.py) the device's work runs on
stream threads of the engine's own process, so the forward's Python dispatch
and the host's scheduling take turns on one GIL. On a small model, whose
forward is mostly dispatch, overlap scheduling then hides nothing, which is an
artefact of the emulation, not of overlap: a GPU runs its kernels whatever the
host's interpreter is doing. A device process has its own interpreter, so the
host's round N+1 really runs while the device computes round N, as on a GPU.

The device process holds the model, the KV pool and the future-token ring. It runs one thread per stream, each doing its
queue's items in order, exactly like CpuStream; events and cross-stream waits
are device-side. The host sees it through ProcStream (the Stream interface):
every item it submits is answered, in order, by a completion (one message carries an
item's and those of the Records right behind it) with the device's
CLOCK_MONOTONIC timestamps (the clock is system-wide, so
the rows land on the host's timeline unchanged), and a reader thread turns the
answers into probe rows, completed events and the launch's tokens.

The wire is a multiprocessing pipe of small tuples of ints and floats (block
tables, token ids); nothing of it reaches a trace file. The device builds the
forward's index tensors itself from that wire (as the TP workers do), so on
this backend `batch_prepare` on the host covers only the wire.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from probes.boundaries import DEVICE_COMPUTE, STREAM_WAIT
from probes.clock import now_ns
from probes.recorder import ProbeRow, Probes
from probes.waits import DEVICE_THREAD, ActiveWait, WaitRegistry
from probes.watchdog import ThreadStack
from scheduler.device import wire
from scheduler.device.device_server import DeviceSpec, device_main
from scheduler.device.prepared import PreparedBatch
from scheduler.device.streams import CpuEvent
from scheduler.device.work import STREAM_NAMES, Event, OpRecord, RemoteOp, RowsOff, Work
from scheduler.seeds import Seed, fork_seeds, late_context

START_TIMEOUT_S = 300.0  # first use builds the preset model, which takes a while on a busy machine
# what a device process imports before its spec arrives
DEVICE_IMPORTS = ("torch", "scheduler.device.device_server", "scheduler.model.kv_cache", "scheduler.model.loader")


class RemoteDevice:
    """The model, KV pool and future ring of a device process, as the executor sees them:
    work for its streams is plain data (RemoteOp); the process builds the forward batch
    itself from the wire (scheduler/device/device_server.py)."""

    builds_batch_on_host = False
    kv_check_on = False  # the KV ordering check needs the tags in this process (config refuses it)
    device = None

    def forward_work(self, prepared: PreparedBatch, slots: list[int], step: int, out: list[Any]) -> Work:
        return RemoteOp("forward", (
            # score targets only in a round that scores a prompt: most have none to pickle
            [(c.token_ids, c.start_pos, c.block_table, c.sample) for c in prepared.seqs]
            if prepared.sampling.score_k < 0
            else [(c.token_ids, c.start_pos, c.block_table, c.sample, c.score_targets) for c in prepared.seqs],
            prepared.sampling, slots, prepared.has_placeholders), out.append)

    def sleep_work(self, us: float) -> Work:
        return RemoteOp("sleep", (us,))

    def copy_work(self, src: list[int], dst: list[int]) -> Work:
        return RemoteOp("copy", (src, dst))

    def kv_reads(self, chunks: Any) -> Any:
        raise NotImplementedError("the KV ordering check runs on a local device only")

    def enable_kv_check(self) -> None:
        raise NotImplementedError("the KV ordering check runs on a local device only")


class ProcEvent(CpuEvent):
    __slots__ = ("id",)

    def __init__(self, label: str, stream: str, ev_id: int) -> None:
        super().__init__(label, stream)
        self.id = ev_id

    def complete_at(self, ts_ns: int) -> None:
        self._ts = ts_ns
        self._done.set()


@dataclass(slots=True)
class _Pending:
    kind: str  # op | record | wait
    label: str
    step: int
    boundary: str
    on_result: Callable[[Any], None] | None = None
    event: ProcEvent | None = None  # record: the event it completes; wait: the event waited for
    what: str = ""  # wait: what the stream waits for, as the watchdog names it
    key: int | None = None  # wait: its entry in the wait registry while it heads the queue


class DeviceSeed:
    """A device process forked early (scheduler/seeds.py says why), waiting for its
    DeviceSpec; `DeviceProcess` hands it the spec instead of starting one. Where no seed
    could be forked, the device process comes from `late_context` (scheduler/seeds.py)."""

    def __init__(self, seed: Seed) -> None:
        self._taken: Seed | None = seed

    @classmethod
    def fork(cls, n: int) -> list[DeviceSeed] | None:
        """`n` seeds, or None where a fork is not safe here."""
        seeds = fork_seeds(n, device_main, DEVICE_IMPORTS, "mstrace-device")
        return None if seeds is None else [cls(s) for s in seeds]

    def take(self) -> Seed | None:
        taken, self._taken = self._taken, None
        return taken

    def close(self) -> None:
        """An unused seed: the pipe's end is its cue to exit."""
        taken = self.take()
        if taken is not None:
            taken[0].close()
            taken[1].join(5)


class DeviceProcess:
    """The host's handle on the device process: start it (from a DeviceSeed, else from
    `late_context` (scheduler/seeds.py)), send, read answers, stop."""

    def __init__(self, spec: DeviceSpec, probes: Probes, registry: WaitRegistry,
                 seed: DeviceSeed | None = None) -> None:
        self.spec = spec
        self.probes = probes
        self.registry = registry
        self.streams: dict[str, ProcStream] = {}
        seeded = seed.take() if seed is not None else None
        self._proc: BaseProcess
        if seeded is not None:
            self._conn, self._proc = seeded
            try:
                self._conn.send(spec)
            except OSError:
                pass  # a seed that died: the start-up below reads its end and says so
        else:
            ctx = late_context(DEVICE_IMPORTS)  # an engine made late: its imports paid once a process
            self._conn, child = ctx.Pipe(duplex=True)
            self._proc = ctx.Process(target=device_main, args=(child, self.spec), name="mstrace-device",
                                     daemon=True)
            self._proc.start()
            child.close()
        self._send_lock = threading.Lock()
        self._events = 0
        self.device_held: tuple[int, int] | None = None  # the truth harness's holds, told at Stopped
        self._stack_replies: dict[int, tuple[threading.Event, list[ThreadStack]]] = {}
        self._stack_keys = itertools.count()  # the watchdog's thread asks; atomic under the GIL
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop_failed()
            raise RuntimeError(f"the device process did not start within {START_TIMEOUT_S:.0f} s")
        msg = self._recv()
        if not isinstance(msg, wire.Ready):
            self._stop_failed()
            why = msg.why if isinstance(msg, wire.StartFailed | wire.Dead) else repr(msg)
            raise RuntimeError(f"the device process failed to start: {why}")
        self.pages = msg.pages
        _bound_sends(self._conn, spec.wait_timeout_s)
        for n in STREAM_NAMES:
            self.streams[n] = ProcStream(n, self)
        self._reader = threading.Thread(target=self._read, name="device-reader", daemon=True)
        self._reader.start()

    def _stop_failed(self) -> None:
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()

    def _recv(self) -> Any:
        try:
            return wire.recv(self._conn)
        except (EOFError, OSError):
            self._proc.join(1)  # so the exit code is known
            return wire.Dead(f"the device process exited (code {self._proc.exitcode})")

    def send(self, msg: wire.StreamItem | wire.Items | wire.AskStacks | wire.Stop) -> None:
        with self._send_lock:
            try:
                wire.send(self._conn, msg)
            except BlockingIOError:  # the pipe stayed full (_bound_sends): part of a message is in it
                self._fail(f"the device process stopped reading its pipe for {self.spec.wait_timeout_s:g} s")
            except (BrokenPipeError, OSError) as e:
                self._fail(f"the device process is gone: {e!r}")

    def _fail(self, why: str) -> None:
        """The device died: every stream fails and every pending event completes, so the
        scheduler's barrier returns at once with the error instead of waiting to time out."""
        for st in self.streams.values():
            st.fail(why)

    def next_event_id(self) -> int:
        self._events += 1
        return self._events

    def _read(self) -> None:
        while True:
            msg = self._recv()
            if isinstance(msg, wire.Done | wire.Dones):
                for d in msg.dones if isinstance(msg, wire.Dones) else (msg,):
                    self.streams[d.stream].complete(d.start_ns, d.end_ns, d.result, d.err)
            elif isinstance(msg, wire.Stacks):
                reply = self._stack_replies.get(msg.key)
                if reply is not None:
                    reply[1].extend(ThreadStack(tid, f"device process: {name}", frames)
                                    for tid, name, frames in msg.stacks)
                    reply[0].set()
            elif isinstance(msg, wire.Dead | wire.Stopped):
                if isinstance(msg, wire.Dead):
                    self._fail(msg.why)
                else:
                    self.device_held = msg.device_held
                return

    def stacks(self, timeout_s: float = 1.0) -> list[ThreadStack]:
        """Every thread's stack in the device process (for a stall report). Its dispatcher
        answers even while every stream thread is blocked."""
        key = next(self._stack_keys)
        reply: tuple[threading.Event, list[ThreadStack]] = (threading.Event(), [])
        self._stack_replies[key] = reply
        try:
            self.send(wire.AskStacks(key))
            reply[0].wait(timeout_s)
            return list(reply[1])
        finally:
            del self._stack_replies[key]

    def close(self) -> None:
        self.send(wire.Stop())
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
        self._conn.close()


def _bound_sends(conn: Any, timeout_s: float) -> None:
    """A send to a device process that stops reading (stopped, or its dispatcher stuck) waits
    at most `timeout_s` for room in the pipe, then fails (SO_SNDTIMEO on the socket pair
    under the Connection). Blocking for good, the scheduling thread hung outside any wait
    the watchdog sees. Where the option is missing, sends block as before."""
    opt = getattr(socket, "SO_SNDTIMEO", None)
    if opt is None:
        return
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # its own fd: closing it keeps conn's
            sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
    except OSError:
        pass  # not a socket (a platform's other Pipe): as before


class ProcStream(RowsOff):
    """One stream of the device process, seen from the host (the Stream interface).

    Device-side waits are registered in the engine's wait registry from the moment they
    head their stream's queue, so the watchdog's wait-for graph has the same edges as with
    an in-process device (the device answers an item when it ends: the head is the item in
    progress, or about to start).
    """

    def __init__(self, name: str, device: DeviceProcess, history: int = 32) -> None:
        self.name = name
        self.error: BaseException | None = None
        self._dev = device
        self._rank = device.probes.rank
        # written by the reader thread only (unrecorded() swaps it while nothing is in flight)
        self._buf: list[ProbeRow] | None = device.probes.buffer()
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()  # the host thread appends, the reader thread pops
        self._since = now_ns()  # when the item at the head of the queue could start
        self._events = 0
        self.completed: deque[OpRecord] = deque(maxlen=history)
        self._batch: list[tuple[_Pending, wire.StreamItem]] | None = None  # inside batched(): not sent yet

    def submit(self, fn: Work, label: str, step: int = -1, boundary: str = DEVICE_COMPUTE) -> None:
        if not isinstance(fn, RemoteOp):
            raise TypeError(f"{label}: the device process runs RemoteOp work, not Python callables")
        self._enqueue(_Pending("op", label, step, boundary, fn.on_result), wire.Op(self.name, fn.kind, fn.payload))

    def submit_host(self, fn: Callable[[], Any], label: str, step: int, boundary: str) -> None:
        raise TypeError(f"{label}: the device process runs no host Python work on its streams")

    def reserve(self) -> ProcEvent:
        """An event of this stream that a later record(ev) completes (others may wait on it first)."""
        self._events += 1
        return ProcEvent(f"{self.name}#{self._events}", self.name, self._dev.next_event_id())

    def record(self, ev: ProcEvent | None = None) -> ProcEvent:
        ev = ev or self.reserve()
        self._enqueue(_Pending("record", ev.label, -1, "", event=ev), wire.Record(self.name, ev.id))
        return ev

    def wait_event(self, ev: Event, what: str = "", label: str = "") -> None:
        if not isinstance(ev, ProcEvent):
            raise TypeError("a device-process stream can only wait for its own device's events")
        self._enqueue(_Pending("wait", label or f"wait {ev.label}", -1, STREAM_WAIT, event=ev,
                               what=what or f"event {ev.label}"), wire.Wait(self.name, ev.id, ev.label))

    @contextmanager
    def batched(self) -> Iterator[None]:
        """The items submitted inside go to the device in one message as the block ends: one
        pickle, one write and one wake-up of the device's dispatcher for a launch's record,
        forward and record. Sent one by one, they kept the host in batch_prepare 2-2.5x as
        long on rounds of one request (BENCHMARKS.md, "The device pipe's messages")."""
        if self._batch is not None:  # nested: the outer block sends
            yield
            return
        batch = self._batch = []
        try:
            yield
        except BaseException:
            self._unqueue([p for p, _ in batch])
            raise
        finally:
            self._batch = None
        if batch:
            self._send([p for p, _ in batch], batch[0][1] if len(batch) == 1 else wire.Items(tuple(m for _, m in batch)))

    def _enqueue(self, p: _Pending, msg: wire.StreamItem) -> None:
        # Queued before it is sent, so an answer always finds its item.
        with self._lock:
            self._pending.append(p)
            if len(self._pending) == 1:
                self._since = now_ns()
                self._register_head()
        if self._batch is not None:
            self._batch.append((p, msg))
        else:
            self._send([p], msg)

    def _send(self, ps: list[_Pending], msg: wire.StreamItem | wire.Items) -> None:
        try:
            self._dev.send(msg)
        except BaseException:
            # Never sent (a payload that cannot be pickled, Ctrl-C): no answer will come, and a
            # stale item would pair every later answer with the wrong item.
            self._unqueue(ps)
            raise

    def _unqueue(self, ps: list[_Pending]) -> None:
        """Take back `ps`, the newest items queued, none of them sent."""
        with self._lock:
            for p in reversed(ps):
                if self._pending and self._pending[-1] is p:
                    self._pending.pop()
                    if p.key is not None:
                        self._dev.registry.end(p.key)

    def _register_head(self) -> None:
        head = self._pending[0] if self._pending else None
        if head is not None and head.kind == "wait" and head.key is None and head.event is not None:
            head.key = self._dev.registry.begin(ActiveWait(
                f"{self.name}-stream", head.what, f"{head.event.stream}-stream", STREAM_WAIT, self._since, DEVICE_THREAD))

    def complete(self, t0: int, t1: int, result: Any, err: str | None) -> None:
        """Reader thread: the device finished the oldest item of this stream."""
        with self._lock:
            if not self._pending:
                return  # failed meanwhile (fail() drained the queue)
            p = self._pending.popleft()
            if p.key is not None:
                self._dev.registry.end(p.key)
            self._since = t1
            self._register_head()
        if err is not None and self.error is None:
            self.error = RuntimeError(err)
        if p.kind == "record":
            assert p.event is not None
            p.event.complete_at(t1)
            return
        if p.kind == "op" and err is None and p.on_result is not None:
            p.on_result(result)
        self.completed.append(OpRecord(p.label, p.step, t0, t1))
        if self._buf is not None:
            self._buf.append((t0, t1 - t0, p.boundary, self.name, self._rank, p.step))

    def fail(self, why: str) -> None:
        self.error = self.error or RuntimeError(why)
        with self._lock:
            while self._pending:
                p = self._pending.popleft()
                if p.key is not None:
                    self._dev.registry.end(p.key)
                if p.kind == "record" and p.event is not None:
                    p.event.complete_at(now_ns())

    def state(self) -> dict[str, Any]:
        with self._lock:  # the reader thread pops concurrently
            head = self._pending[0] if self._pending else None
            depth = len(self._pending)
        return {
            "stream": self.name,
            "queue_depth": depth,
            "in_progress": None if head is None else {"label": head.label, "since_ns": self._since},
            "recent": [(o.label, o.step, o.start_ns, o.end_ns) for o in list(self.completed)],
            "error": None if self.error is None else repr(self.error),
            "backend": "process",
        }

    def close(self) -> None:
        pass  # the DeviceProcess owns the pipe and stops every stream at once
