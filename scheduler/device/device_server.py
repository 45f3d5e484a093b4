"""The device process's own side (scheduler/device/device_process.py is the host's):
it loads the model and KV pool, runs one thread per stream, each doing its queue's
items in order, and answers every item with a completion (an item's and those of the
Records right behind it in one message)."""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from probes.clock import now_ns
from scheduler.device import wire
from scheduler.device.work import STREAM_NAMES

if TYPE_CHECKING:
    from scheduler.harness.debug_delay import HeldForward
    from scheduler.model.forward_step import ModelStep, SamplingArgs
    from scheduler.model.sampling import SampledLists


@dataclass(slots=True)
class DeviceSpec:
    model_dir: str
    dtype: str
    num_blocks: int
    block_size: int
    threads: int
    wait_timeout_s: float
    future_slots: int
    debug_delay_ns: int = 0  # the truth harness: held inside every forward (scheduler/harness/debug_delay.py)
    pack_weights: bool = False  # scheduler/model/packed_gemm.py (the host's choose_pack decided)


def device_main(conn: Connection, spec: DeviceSpec) -> None:
    """Entry point of the device process."""
    import signal

    # Ctrl-C reaches the whole process group; the host handles it and stops this process
    # (a "stop" message, or the pipe's end when the host is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        dev = _Device(conn, spec)
    except BaseException as e:  # noqa: BLE001 - reported to the host, which exits with it
        conn.send(wire.StartFailed(f"{type(e).__name__}: {e}"))
        return
    conn.send(wire.Ready(dev.pages))
    dev.serve()
    # Served and answered `Stopped`: nothing here is left to write. Tearing down an
    # interpreter with torch loaded takes about a second, which a Ctrl-C'd run would wait.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Device:
    def __init__(self, conn: Connection, spec: DeviceSpec) -> None:
        import torch

        from scheduler.model.kv_cache import PagedKVCache
        from scheduler.model.loader import load_model

        torch.set_num_threads(max(1, spec.threads))
        self.torch = torch
        self.conn = conn
        self.spec = spec
        from scheduler.model.dtypes import DTYPES

        dtype = DTYPES[spec.dtype]
        model, mc = load_model(spec.model_dir, "cpu", dtype, pack=spec.pack_weights)
        self.model: ModelStep = model
        self._held: HeldForward | None = None
        if spec.debug_delay_ns:  # the truth harness: a known hold inside every forward
            from scheduler.harness.debug_delay import HeldForward

            self.model = self._held = HeldForward(model, spec.debug_delay_ns)
        self.kv = PagedKVCache(mc.num_hidden_layers, spec.num_blocks, spec.block_size,
                               mc.num_key_value_heads, mc.head_dim, dtype, "cpu")
        self.pages = model.pages(self.kv)
        self.future = torch.zeros(spec.future_slots, dtype=torch.long)
        self._out = threading.Lock()
        self._cond = threading.Condition()
        # recorded[i] == 1 once event i was recorded: a byte per event, however long the run
        self._recorded = bytearray(1024)
        self._queues: dict[str, queue.SimpleQueue[Any]] = {}
        self._threads = []
        for n in STREAM_NAMES:
            q: queue.SimpleQueue[Any] = queue.SimpleQueue()
            self._queues[n] = q
            t = threading.Thread(target=self._stream_loop, args=(n, q), name=f"device-{n}", daemon=True)
            t.start()
            self._threads.append(t)

    def serve(self) -> None:
        while True:
            try:
                msg = wire.recv(self.conn)
            except (EOFError, OSError):
                msg = wire.Stop()  # the host died: nothing left to serve
            if isinstance(msg, wire.Stop):
                for q in self._queues.values():
                    q.put(None)
                for t in self._threads:
                    t.join(self.spec.wait_timeout_s + 1)
                try:
                    self.conn.send(wire.Stopped(self._held.tally() if self._held is not None else None))
                except OSError:
                    pass
                return
            if isinstance(msg, wire.AskStacks):
                self._send(wire.Stacks(msg.key, _stacks()))
                continue
            if isinstance(msg, wire.Items):  # a launch: each stream's items as one entry (taken whole)
                by_stream: dict[str, list[wire.StreamItem]] = {}
                for item in msg.items:
                    by_stream.setdefault(item.stream, []).append(item)
                for stream, items in by_stream.items():
                    self._queues[stream].put(items)
            else:
                self._queues[msg.stream].put(msg)

    def _send(self, msg: wire.Done | wire.Dones | wire.Stacks) -> None:
        with self._out:
            wire.send(self.conn, msg)

    def _stream_loop(self, name: str, q: queue.SimpleQueue[Any]) -> None:
        failed: str | None = None
        held: deque[Any] = deque()  # items taken from the queue, not done yet (a launch's come whole)
        while True:
            if not held:
                _take(q, held, block=True)
            msg = held.popleft()
            if msg is None:
                return
            done, failed = self._do(name, msg, failed)
            dones = [done]
            # The Records right behind it (a launch's end event) take no time: they are done
            # now and answered with it, so the host's reader wakes once for the forward.
            while (held or _take(q, held, block=False)) and isinstance(held[0], wire.Record):
                done, failed = self._do(name, held.popleft(), failed)
                dones.append(done)
            self._send(dones[0] if len(dones) == 1 else wire.Dones(tuple(dones)))

    def _do(self, name: str, msg: wire.StreamItem, failed: str | None) -> tuple[wire.Done, str | None]:
        """One item of stream `name`, and the stream's failure after it (None: none yet)."""
        t0 = now_ns()
        result: Any = None
        err: str | None = None
        try:
            if isinstance(msg, wire.Record):
                with self._cond:
                    ev = msg.event
                    if ev >= len(self._recorded):
                        self._recorded.extend(bytes(max(ev + 1 - len(self._recorded), len(self._recorded))))
                    self._recorded[ev] = 1
                    self._cond.notify_all()
            elif isinstance(msg, wire.Wait):
                with self._cond:
                    if not self._cond.wait_for(partial(self._is_recorded, msg.event), self.spec.wait_timeout_s):
                        raise TimeoutError(f"{name}-stream: event {msg.label} not recorded "
                                           f"after {self.spec.wait_timeout_s:.1f} s")
            elif failed is None:  # after a failure, later work is skipped but events still complete
                result = self._run(msg.kind, msg.payload)
            else:
                err = f"skipped after: {failed}"
        except BaseException as e:  # noqa: BLE001 - surfaced to the host through the stream's error
            failed = failed or f"{type(e).__name__}: {e}"
            err = failed + ("\n" + traceback.format_exc(limit=4) if isinstance(msg, wire.Op) else "")
        return wire.Done(name, t0, now_ns(), result, err), failed

    def _is_recorded(self, ev: int) -> bool:
        return ev < len(self._recorded) and self._recorded[ev] == 1

    def _run(self, kind: str, payload: tuple[Any, ...]) -> Any:
        if kind == "forward":
            return self._forward(*payload)
        if kind == "copy":
            self.kv.copy_blocks(*payload)
            return None
        if kind == "sleep":
            import time

            time.sleep(payload[0] / 1e6)
            return None
        raise ValueError(f"unknown device op {kind!r}")

    def _forward(
        self,
        seqs: list[tuple[Any, ...]],  # SeqChunk's fields (score_targets only where a chunk has some)
        sampling: SamplingArgs,
        slots: list[int],
        has_placeholders: bool,
    ) -> SampledLists:
        from scheduler.model.forward_batch import SeqChunk, build_forward_batch
        from scheduler.model.forward_step import forward_step

        fb = build_forward_batch([SeqChunk(*s) for s in seqs], self.spec.block_size, "cpu")
        out = forward_step(self.model, fb, self.kv, sampling, self.future, slots, has_placeholders)
        assert out is not None, "a whole model gives logits"
        return out.lists()  # for the pipe


def _take(q: queue.SimpleQueue[Any], held: deque[Any], block: bool) -> bool:
    """The queue's next entry into `held` (a launch's items, or one item, or None: stop);
    false when `block` is false and the queue is empty."""
    try:
        entry = q.get() if block else q.get_nowait()
    except queue.Empty:
        return False
    if isinstance(entry, list):
        held.extend(entry)
    else:
        held.append(entry)
    return True


def _stacks() -> list[tuple[int, str, list[str]]]:
    import sys

    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()  # the dispatcher: its stack is just this function
    return sorted(((tid, names.get(tid, f"thread-{tid}"), traceback.format_stack(frame))
                   for tid, frame in sys._current_frames().items() if tid != me), key=lambda x: x[1])
