"""Run a workload through an Engine from Python, closing it whatever happens."""

from __future__ import annotations

from scheduler.config import EngineConfig
from scheduler.engine import Engine, StepStats
from scheduler.harness.runner import run_workload
from scheduler.harness.workload import WorkloadItem


def run_engine(cfg: EngineConfig, items: list[WorkloadItem], max_steps: int | None = None) -> Engine:
    """`max_steps` turns a scheduling livelock (rounds that never finish a request)
    into a failure that shows the queues, instead of a test that never ends."""
    eng = Engine(cfg)

    def guard(stats: StepStats) -> None:
        e = eng
        if max_steps is not None and stats.step > max_steps:
            running = [(r.request_id, r.num_tokens, len(r.block_table), r.num_preemptions) for r in e.rm.running]
            raise AssertionError(f"no end after {max_steps} rounds: free={e.mm.num_free} running={running} "
                                 f"waiting={[r.request_id for r in e.rm.waiting]}")

    try:
        run_workload(eng, items, on_round=guard)
    finally:
        eng.close()
    return eng
