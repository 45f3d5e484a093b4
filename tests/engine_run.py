"""Run a workload through an Engine from Python, closing it whatever happens."""

from __future__ import annotations

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.runner import run_workload
from scheduler.workload import WorkloadItem


def run_engine(cfg: EngineConfig, items: list[WorkloadItem]) -> Engine:
    eng = Engine(cfg)
    try:
        run_workload(eng, items)
    finally:
        eng.close()
    return eng
