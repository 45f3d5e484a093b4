"""The public probes API, version 1: what an engine that is not ours calls to write an mstrace
trace live (docs/api.md has the contract and the version policy).

    tracer = mstrace.Tracer("traces/mine", engine="my-engine")
    r = tracer.begin_round()
    with tracer.probe(mstrace.BATCH_PREPARE):
        ...
    tracer.device(mstrace.now_ns(), dur_ns, stream="main")      # a device interval you measured
    tracer.wait(done.wait, what="forward", signaller="device")  # a timed, watched wait
    tracer.end_round(r, decode_reqs=32, decode_tokens=32)
    tracer.request(...)                                         # one finished request
    tracer.close()

Rows go to per-thread buffers the trace writer drains every second (no lock, no sync with
the device); every wait goes through the same timed wait as the reference engine's, so
the stall watchdog sees it while it lasts and `mstrace stalls` names it afterwards.
"""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes import boundaries as B
from probes.clock import clock_record, now_ns, wall_anchor
from probes.waits import DEFAULT_TIMEOUT_S, WaitRegistry, WaitTimeout, timed_wait
from probes.watchdog import StallReport, Watchdog
from tracing.run_status import end_record
from tracing.writer import TraceWriter

API_VERSION = 1
HOST = "host"  # the scheduling thread's stream: the host view divides its time


@dataclass(slots=True)
class Round:
    step: int
    ts_ns: int


class Tracer:
    """One engine's trace. Call `begin_round`/`end_round`, `probe` and `wait` from the
    scheduling thread (the host view is that thread's time); `device` and `request` from
    any thread."""

    def __init__(self, out: str | Path, *, engine: str, config: dict[str, Any] | None = None,
                 wait_timeout_s: float = DEFAULT_TIMEOUT_S, watchdog: bool = True) -> None:
        self.out = Path(out)
        self.writer = TraceWriter(self.out)
        self.wait_timeout_s = wait_timeout_s
        self.registry = WaitRegistry()
        self._local = threading.local()
        self._steps = self.writer.buffer("steps")
        self._requests = self.writer.buffer("requests")
        self._stalls = self.writer.buffer("stalls")
        self.stalls: list[StallReport] = []
        self._step = 0
        self._round: Round | None = None
        self._first_ns: int | None = None
        self._last_ns: int | None = None
        mono, unix = wall_anchor()
        self.meta: dict[str, Any] = {
            "config": {"mode": "api", "probes": True, "wait_timeout_s": wait_timeout_s, **(config or {}),
                       "api": API_VERSION},
            "model": {"name": engine},
            "workload": {"source": f"{engine} (mstrace API v{API_VERSION})", "requests": 0},
            "clock": clock_record((mono, unix)),  # (the old keys were read by nothing: a stall said "ts N")
            "host": {"hostname": platform.node(), "pid": os.getpid()},
            "api": {"version": API_VERSION, "engine": engine},
        }
        self.writer.write_meta(self.meta)
        # the watchdog reports a wait a little before the wait gives up: its stacks show the stall live
        self._watchdog = Watchdog(self.registry, 0.9 * wait_timeout_s, on_stall=self._on_stall,
                                  step=lambda: self._step) if watchdog else None
        if self._watchdog is not None:
            self._watchdog.start()

    # -- rounds --------------------------------------------------------------------------------
    def begin_round(self) -> Round:
        """A scheduling round starts now (a cycle lasts until the next one starts)."""
        r = Round(self._step, now_ns())
        self._round = r
        self._first_ns = r.ts_ns if self._first_ns is None else self._first_ns
        return r

    def end_round(self, r: Round, *, prefill_reqs: int = 0, prefill_tokens: int = 0, decode_reqs: int = 0,
                  decode_tokens: int = 0, device_ns: int = 0, waiting: int = 0, running: int = 0) -> None:
        """The round ran: its `steps` row, with what it batched (tracing/schema.py STEPS)."""
        t = now_ns()
        dur = t - r.ts_ns
        self._steps.append((r.step, self.meta["config"]["mode"], r.ts_ns, dur, max(dur - device_ns, 0), device_ns,
                            prefill_reqs, prefill_tokens, decode_reqs, decode_tokens, 0, 0, waiting, running, 0, t,
                            0))
        self._last_ns = t
        self._step += 1
        self._round = None

    def cancel_round(self, r: Round) -> None:
        """The round found nothing to do: no `steps` row (its time joins the cycle before)."""
        self._round = None

    # -- host probes ---------------------------------------------------------------------------
    def _buf(self) -> list[tuple[Any, ...]]:
        b = getattr(self._local, "probes", None)
        if b is None:
            b = self._local.probes = self.writer.buffer("probes")
        return b

    @contextmanager
    def probe(self, boundary: str, stream: str = HOST) -> Iterator[None]:
        """A boundary's row around the block (docs/boundaries.md names them)."""
        t0 = now_ns()
        try:
            yield
        finally:
            self._buf().append((t0, now_ns() - t0, boundary, stream, 0, self._step))

    def record(self, boundary: str, ts_ns: int, dur_ns: int, stream: str = HOST) -> None:
        """A row from timestamps the engine took itself (now_ns's clock)."""
        self._buf().append((ts_ns, dur_ns, boundary, stream, 0, self._step))

    def device(self, ts_ns: int, dur_ns: int, stream: str = "main", boundary: str = B.DEVICE_COMPUTE) -> None:
        """A device stream's busy interval (on a GPU: CUDA event pairs read after your own sync)."""
        self._buf().append((ts_ns, dur_ns, boundary, stream, 0, self._step))

    def wait(self, ready: Callable[[float], bool], *, what: str, signaller: str,
             boundary: str = B.SCHEDULER_BARRIER, waiter: str = "scheduler", timeout_s: float | None = None) -> int:
        """Block until `ready(slice_s)` is true: registered while it lasts (the watchdog reports
        it past the timeout with the stacks), one probe row, WaitTimeout at the timeout."""
        return timed_wait(ready, registry=self.registry, waiter=waiter, what=what, signaller=signaller,
                          boundary=boundary, timeout_s=self.wait_timeout_s if timeout_s is None else timeout_s,
                          buf=self._buf(), step=self._step,
                          on_expire=None if self._watchdog is None else self._watchdog.check)

    # -- requests ------------------------------------------------------------------------------
    def request(self, request_id: str, *, arrival_ns: int, first_token_ns: int, finish_ns: int, prompt_len: int,
                output_len: int, finish_reason: str = "eos", first_scheduled_ns: int = 0,
                token_ns: list[int] | None = None) -> None:
        """One finished request (tracing/schema.py REQUESTS); `token_ns`: each output token's time."""
        gaps = [b - a for a, b in zip(token_ns, token_ns[1:], strict=False)] if token_ns else []
        self._requests.append((request_id, [], [], "", prompt_len, output_len, 0, finish_reason, "", arrival_ns, 0, 0,
                               0, first_scheduled_ns, first_token_ns, finish_ns, 0, 0, gaps, [], 0, []))
        self.meta["workload"]["requests"] += 1

    # -- the end -------------------------------------------------------------------------------
    def _on_stall(self, report: StallReport) -> None:
        self.stalls.append(report)
        self._stalls.append(report.to_row())

    def close(self, status: str = "complete", detail: str = "") -> None:
        """The last commit, then the end record: `complete`, or `stalled` / `error` with why."""
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.stalls and status == "complete":
            w = self.stalls[0].wait
            status, detail = "stalled", self.stalls[0].cycle_name or f"{w.waiter} waited for {w.what} ({w.signaller})"
        self.meta["run"] = end_record(status, detail, self.meta["workload"]["requests"], self._first_ns,
                                      self._last_ns, self._step)
        self.writer.close(self.meta)

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: Any) -> None:
        if ev is None:
            self.close()
        elif isinstance(ev, WaitTimeout):
            self.close("stalled", str(ev))
        else:
            self.close("error", (str(ev).splitlines() or [type(ev).__name__])[0])
