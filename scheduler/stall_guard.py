"""The engine's side of the stall watchdog (probes/watchdog.py): it keeps every report
(whole in the trace's stalls table; a summary on stderr, at once) and turns a wait that
gave up into EngineStalled, which names the most telling report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from probes.boundaries import SCHEDULER_BARRIER
from probes.clock import now_ns
from probes.waits import WaitTimeout
from probes.watchdog import StallReport


class EngineStalled(RuntimeError):
    """A wait passed its timeout with --on-stall abort; the watchdog's reports say why."""

    def __init__(self, reports: list[StallReport], cause: BaseException) -> None:
        # The most telling report: a wait cycle, else the wait underneath the scheduler's barrier
        # (e.g. a collective some rank never joined), else the first.
        rep = (next((r for r in reports if r.cycle), None)
               or next((r for r in reports if r.wait.boundary != SCHEDULER_BARRIER), None)
               or (reports[0] if reports else None))
        what = (rep.cycle_name or rep.wait.what) if rep is not None else str(cause)
        super().__init__(f"engine stalled: {what}")
        self.reports = reports


REPORT_HANG_NS = 30_000_000_000  # a report still being built after this is itself stuck


class StallGuard:
    def __init__(self, stall_buf: list[Any] | None) -> None:
        self.reports: list[StallReport] = []
        self._settled = 0  # reports before this one came before a round the engine got through
        self._buf = stall_buf

    def on_stall(self, report: StallReport) -> None:
        """Watchdog thread: keep the evidence in the trace and say it at once."""
        self.reports.append(report)
        if self._buf is not None:
            self._buf.append(report.to_row())
        print(report.render_summary(), file=sys.stderr, flush=True)

    def stalled(self, cause: BaseException, reporting: Callable[[], int] = lambda: 0) -> BaseException:
        """What the round raises for a wait that failed with `cause`: EngineStalled, naming
        the reports made since the last round the engine got through, where there are any or
        the wait timed out; any other error as it is. A stall the run got through (under
        --on-stall warn) says nothing about a later error, a device's out-of-memory say.
        `reporting`: the watchdog's count of reports it is building (Watchdog.reporting)."""
        # The watchdog sees an expired wait at wait_timeout; the wait itself gives up a little
        # later (hard_wait_timeout_s), so by now its report exists or is being built: give the
        # watchdog's thread a moment to see it, and the build (the device's stacks: up to a
        # second, more on a loaded host) the time it takes, bounded only against a hang
        timed_out = _timeout_in(cause) is not None
        start = now_ns()
        while timed_out and now_ns() - start < REPORT_HANG_NS and (
                reporting() > 0 or (len(self.reports) == self._settled and now_ns() - start < 500_000_000)):
            time.sleep(0.01)
        current = self.reports[self._settled:]
        if current or timed_out:
            return EngineStalled(current, cause)
        return cause

    def got_through(self) -> None:
        """The scheduling thread, after a round's barrier returned: the stalls reported so
        far were got through (they stay in the trace, and in `reports`)."""
        self._settled = len(self.reports)


def _timeout_in(e: BaseException | None) -> WaitTimeout | None:
    """The wait that timed out behind `e`: itself, or what it was raised from (a stream's
    forward that failed on a wait: the barrier raises a RuntimeError from it)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, WaitTimeout):
            return e
        e, seen = e.__cause__, seen + 1
    return None
