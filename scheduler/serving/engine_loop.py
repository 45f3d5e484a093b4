"""A server's scheduling thread: rounds for as long as the server runs.

Requests arrive through `engine.submit` from the event loop; the rounds run here,
never on the event loop, and their output leaves through the sender thread
(scheduler/serving/streams.py). `health` is what GET /health reports.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from probes.boundaries import IDLE
from probes.clock import now_ns
from scheduler.engine import Engine, StepStats
from scheduler.stall_guard import EngineStalled
from tracing.run_status import first_line

# How long an engine failure's end waits for the sender to deliver the rounds before it (a
# sender of its own stalled: the failure goes out then anyway).
FAIL_WITHIN_S = 1.0


@dataclass(slots=True, frozen=True)
class Health:
    ok: bool
    state: str  # running, stalled (a wait past its timeout), failed, stopped
    detail: str


class EngineLoop:
    def __init__(self, engine: Engine, on_round: Callable[[StepStats], None] | None = None,
                 idle_poll_s: float = 0.02, on_fail: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self._on_round = on_round
        self._on_fail = on_fail  # the engine stopped on a failure or a stall: with why
        self.idle_poll_s = idle_poll_s
        self.rounds = 0
        self.start_ns = 0
        self.end_ns = 0
        self.error: BaseException | None = None
        self._state = "running"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def start(self) -> None:
        self.start_ns = now_ns()
        self._thread.start()

    def _loop(self) -> None:
        try:
            self.engine.drive(lambda: not self._stop.is_set(), self._round, self.idle_poll_s)
            self._state = "stopped"
        except EngineStalled as x:
            self.error, self._state = x, "stalled"
        except BaseException as x:  # noqa: BLE001 - /health and the trace's end record say it
            self.error, self._state = x, "failed"
        finally:
            self.end_ns = now_ns()
            if self._state != "stopped" and self._on_fail is not None:
                h = self.health()
                self._fail_in_order(self._on_fail, f"the engine is {h.state}: {h.detail}")

    def _fail_in_order(self, on_fail: Callable[[str], None], why: str) -> None:
        """on_fail once the sender has delivered the rounds handed to it before the failure, so
        that a request one of them finished gets its own end, not the failure's; and within
        FAIL_WITHIN_S whatever the sender does, as a stalled sender must not hang every request.
        Not a wait: the scheduling thread returns at once."""
        once = threading.Lock()

        def fail() -> None:
            if once.acquire(blocking=False):
                late.cancel()  # (the sender got there first: no timer thread left waiting)
                on_fail(why)

        late = threading.Timer(FAIL_WITHIN_S, fail)
        late.daemon = True
        self.engine.sender.call_after(fail)
        late.start()

    def _round(self, stats: StepStats) -> None:
        self.rounds += 1
        if self._on_round is not None:
            self._on_round(stats)

    def stop(self, deadline_s: float, live: Iterable[str]) -> None:
        """Stop taking rounds once the work in flight is done; after `deadline_s`, abort
        what is left (`live`: the ids of requests still being answered) and wait for that."""
        self._stop.set()
        self._thread.join(deadline_s)
        if self._thread.is_alive():
            for rid in list(live):
                self.engine.request_abort(rid, "server shutting down")
            self._thread.join(max(5.0, self.engine.cfg.hard_wait_timeout_s))

    def health(self) -> Health:
        if self._state == "stalled" or self._state == "failed":
            why = first_line(self.error) if self.error else ""
            return Health(False, self._state, why)
        if not self._thread.is_alive():
            return Health(False, "stopped", "the scheduling thread is not running")
        limit = int(self.engine.cfg.wait_timeout_s * 1e9)
        now = now_ns()
        late = [w for w in self.engine.registry.snapshot() if w.boundary != IDLE and now - w.since_ns > limit]
        if late:
            w = late[0]
            return Health(False, "stalled", f"{w.waiter} has waited {(now - w.since_ns) / 1e9:.1f} s on "
                                            f"{w.what} ({w.signaller})")
        return Health(True, "running", "")
