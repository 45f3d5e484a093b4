"""Per-event cost of the hot-path probe, in ns.

    python bench/bench_probe_cost.py [--n 2000000] [--repeats 7]

Measures, against an empty loop of the same shape:
  * `emit`: one clock read + one tuple appended to the producer's list (what
    the engine does at each boundary);
  * `timed_wait fast path`: a wait on an event that is already complete
    (serial mode's kv_fence), including its probe row.
Reports the median over repeats of (loop with probe - empty loop) / n.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from probes.boundaries import BOOKKEEPING, KV_FENCE
from probes.clock import now_ns
from probes.waits import WaitRegistry, timed_wait


def empty(n: int) -> int:
    t = time.perf_counter_ns()
    for _ in range(n):
        pass
    return time.perf_counter_ns() - t


def emit(n: int) -> int:
    buf: list[tuple[object, ...]] = []
    app = buf.append
    t = time.perf_counter_ns()
    for i in range(n):
        t0 = now_ns()
        app((t0, now_ns() - t0, BOOKKEEPING, "host", 0, i))
    return time.perf_counter_ns() - t


def fast_wait(n: int) -> int:
    buf: list[tuple[object, ...]] = []
    reg = WaitRegistry()
    done = lambda s: True  # noqa: E731 - an already-completed event
    t = time.perf_counter_ns()
    for i in range(n):
        timed_wait(done, registry=reg, waiter="scheduler", what="event", signaller="main", boundary=KV_FENCE,
                   buf=buf, step=i)
    return time.perf_counter_ns() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    res: dict[str, list[float]] = {"emit": [], "timed_wait_fast_path": []}
    for _ in range(a.repeats):
        base = empty(a.n)
        res["emit"].append((emit(a.n) - base) / a.n)
        res["timed_wait_fast_path"].append((fast_wait(a.n // 4) - base / 4) / (a.n // 4))
    out = {k: {"median_ns": statistics.median(v), "min_ns": min(v), "max_ns": max(v)} for k, v in res.items()}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
