"""Running an Engine from a test: round by round to the end, or a whole workload through the
harness, closing it whatever happens; and the workloads more than one test module runs."""

from __future__ import annotations

from scheduler.config import EngineConfig
from scheduler.core.request import SamplingParams
from scheduler.engine import Engine, StepStats
from scheduler.harness.runner import run_workload
from scheduler.harness.workload import WorkloadItem


def drive(eng: Engine, limit: int = 2000) -> None:
    """Rounds until the engine has nothing left; an engine still busy after `limit` fails."""
    for _ in range(limit):
        if not eng.has_work():
            return
        if eng.step() is None:
            eng.wait_for_arrivals(0.05)
    raise AssertionError("engine did not finish")


def run_engine(cfg: EngineConfig, items: list[WorkloadItem], max_steps: int | None = None) -> Engine:
    """`items` through a new Engine(cfg) with the harness's runner; the engine, closed.
    `max_steps` turns a scheduling livelock (rounds that never finish a request) into a
    failure that shows the queues, instead of a test that never ends."""
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


def fragmenting_workload() -> list[WorkloadItem]:
    """Long-lived and short requests interleaved in the pool, then one big
    request: after the short ones finish, enough blocks are free but no run fits."""
    items = []
    for i in range(4):
        items.append(WorkloadItem(f"long{i}", None, tuple(range(20 + i, 36 + i)),
                                  SamplingParams(112, ignore_eos=True), 0.0))  # 16+112 = 8 blocks
        # short ones finish in the first round; the long ones decode for 112 more rounds
        items.append(WorkloadItem(f"short{i}", None, tuple(range(60 + i, 76 + i)),
                                  SamplingParams(1, ignore_eos=True), 0.0))  # 16+1 = 2 blocks
    items.append(WorkloadItem("big", None, tuple(range(100, 164)), SamplingParams(384, ignore_eos=True), 0.03))
    return items  # big: 64+384 = 28 blocks
