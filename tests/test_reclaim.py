"""The GC's "no progress" clock runs only while a request runs (scheduler/core/reclaim.py)."""

from __future__ import annotations

from scheduler.core.memory_manager import MemoryManager
from scheduler.core.reclaim import Reclaimer
from scheduler.core.request import ReqSample, SamplingParams
from scheduler.core.request_manager import RequestManager

S = 1_000_000_000


def test_a_preempted_request_is_not_stuck_for_the_time_it_waited() -> None:
    """A request preempted under starvation can wait in the queue longer than gc_after_s (a
    loaded machine made a starve run wait 11.7 s); re-admitted, it is moving again, and the GC
    must not abort it for the wait."""
    rm, mm, gc = RequestManager(), MemoryManager(8, 16), Reclaimer(gc_after_s=10.0)
    req = rm.enqueue(ReqSample("r", list(range(1, 40)), 39, SamplingParams(4), 0, 1))
    req.block_table = mm.allocate("r", 3)
    rm.admit(req)
    mm.free("r", req.block_table)
    rm.preempt(req, "starved")
    req.block_table = mm.allocate("r", 3)
    rm.admit(req)
    now = req.progress_ns
    # its history: first admitted 21 s ago, its last token 20 s ago, then 20 s in the queue
    req.admitted_ns, req.token_ns = now - 21 * S, [now - 20 * S]
    _, stuck = gc.scan(rm, mm, now + 1 * S)
    assert stuck == []
    _, stuck = gc.scan(rm, mm, now + 11 * S)  # and a request that stops moving still is
    assert [r for r, _ in stuck] == [req] and "no progress for 11.0 s" in stuck[0][1]
