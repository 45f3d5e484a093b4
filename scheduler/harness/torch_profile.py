"""`mstrace run --torch-profile DIR`: the same run recorded by a second instrument.

torch.profiler (CPU activities) runs around the workload, and each of the scheduling
thread's boundaries is also a `record_function` range named `mstrace::<boundary>`, opened
and closed at the moments the engine's own clock stamps (RoundClock), so the profiler's
ranges and the probe rows measure the same intervals; each round is `mstrace::round`.
`mstrace import DIR --round '^mstrace::round$'` then gives a host view to set beside the
probe report's (tests/test_torch_profile.py: within 2 percentage points per row).

Off by default and free when off: the engine makes a plain RoundClock unless
`Engine.trace_ranges` swapped the factory. What the profiler costs is measured, not hidden:
a micro-benchmark of one range under the running profiler, times the ranges recorded.

Limits: a round that had nothing to run or collect still opens `mstrace::round` (the probe
report has no row for it); with requests arriving over time such idle rounds are many and
the two views' cycles differ. The device process's forward (`--cpu-device process`) is not
in this process's profile.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from probes.boundaries import BATCH_PREPARE, BOOKKEEPING, IDLE, RESPONSE_SEND, SCHEDULER_BARRIER
from scheduler.round_record import RoundClock

if TYPE_CHECKING:
    from scheduler.engine import Engine

ROUND = "mstrace::round"
CALIBRATION_RANGES = 2000


def _name(boundary: str) -> str:
    return f"mstrace::{boundary}"


class Ranges:
    """The open profiler ranges of the scheduling thread, innermost last."""

    __slots__ = ("open", "count", "_rf")

    def __init__(self) -> None:
        import torch

        # The C++ range torch.compile uses for its own annotations: 1.8 us an enter and exit
        # under the profiler here, where record_function's Python object takes 14 us: the
        # ranges would move the intervals they measure by that much.
        fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
        self._rf: Any = fast if fast is not None else torch.autograd.profiler.record_function
        self.open: list[Any] = []
        self.count = 0

    def enter(self, name: str) -> None:
        r = self._rf(name)
        r.__enter__()
        self.open.append(r)
        self.count += 1

    def exit(self) -> None:
        if self.open:
            self.open.pop().__exit__(None, None, None)

    def close_all(self) -> None:
        while self.open:
            self.exit()


class RangedRoundClock(RoundClock):
    """A RoundClock whose stamps also close one range and open the next (RoundClock's
    docstring names the phases): bookkeeping, batch_prepare, [the barrier's own range],
    bookkeeping, response_send, all inside mstrace::round."""

    __slots__ = ("_ranges",)
    _ranges: Ranges

    def __init__(self, ranges: Ranges) -> None:
        ranges.close_all()  # a round that returned early left its ranges open
        object.__setattr__(self, "_ranges", ranges)
        ranges.enter(ROUND)
        ranges.enter(_name(BOOKKEEPING))
        super().__init__()

    def __setattr__(self, key: str, value: Any) -> None:
        object.__setattr__(self, key, value)
        if not value:  # RoundClock.__init__ zeroing the stamps: no moment passed
            return
        r = self._ranges
        if key == "scheduled":
            r.exit()
            r.enter(_name(BATCH_PREPARE))
        elif key == "launched":
            r.exit()
        elif key == "synced":
            r.enter(_name(BOOKKEEPING))
        elif key == "housekept":
            r.exit()
            r.enter(_name(RESPONSE_SEND))
        elif key == "sent":
            r.close_all()


def ranged(fn: Any, ranges: Ranges, boundary: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        ranges.enter(_name(boundary))
        try:
            return fn(*args, **kwargs)
        finally:
            ranges.exit()

    return call


def install(engine: Engine) -> Ranges:
    """Make `engine` open its ranges: the round's clock, the barrier's wait, the idle wait."""
    ranges = Ranges()
    engine.trace_ranges(lambda: RangedRoundClock(ranges))
    engine.executor.wait = ranged(engine.executor.wait, ranges, SCHEDULER_BARRIER)  # type: ignore[method-assign]
    engine.wait_for_arrivals = ranged(engine.wait_for_arrivals, ranges, IDLE)  # type: ignore[method-assign]
    return ranges


class TorchProfile:
    """torch.profiler around a run, its Kineto trace written to `folder` when it stops."""

    def __init__(self, folder: Path) -> None:
        import torch.profiler as tp

        self.folder = folder
        self.prof = tp.profile(activities=[tp.ProfilerActivity.CPU])
        self.range_ns = 0.0  # one range's cost under the running profiler (micro-benchmarked)
        self.ranges: Ranges | None = None

    def start(self, engine: Engine) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prof.start()
        self.range_ns = _calibrate()
        self.ranges = install(engine)

    def stop(self) -> dict[str, Any]:
        """Stop, write the trace, and say what the profiler cost (meta.json `run.torch_profile`)."""
        if self.ranges is not None:
            self.ranges.close_all()
        self.prof.stop()
        path = self.folder / "rank0.pt.trace.json"
        t0 = time.perf_counter()
        self.prof.export_chrome_trace(str(path))
        n = self.ranges.count if self.ranges is not None else 0
        return {"file": str(path), "ranges": n, "range_ns": round(self.range_ns, 1),
                "ranges_cost_ns": round(n * self.range_ns), "export_s": round(time.perf_counter() - t0, 3)}


def _calibrate() -> float:
    """ns per mstrace range (enter + exit) while the profiler records: its cost per event."""
    r = Ranges()
    t0 = time.perf_counter_ns()
    for _ in range(CALIBRATION_RANGES):
        r.enter("mstrace::calibration")
        r.exit()
    return (time.perf_counter_ns() - t0) / CALIBRATION_RANGES
