"""What durable commits (tracing/durable.py) add to one flush: wall time and the flushing
thread's CPU, with the fsyncs and without them (os.fsync made a no-op), alternated.

    python bench/bench_flush_durable.py [--flushes 40] [--rows 2000] [--dir /tmp]

Each flush commits a part per table the way a run's writer does: `--rows` probe rows, a
tenth as many steps and timeline rows, into a fresh trace in `--dir` (its file system is
the one measured: tmpfs makes an fsync free, a disk does not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from tracing.writer import TraceWriter


def flushes(root: Path, n: int, rows: int) -> tuple[list[float], list[float]]:
    w = TraceWriter(root, flush_interval_s=3600)
    probes, steps, timeline = w.buffer("probes"), w.buffer("steps"), w.buffer("timeline")
    wall, cpu = [], []
    for k in range(n):
        for i in range(rows):
            probes.append((k * rows + i, 100, "bookkeeping", "host", 0, k))
        for i in range(rows // 10):
            steps.append((k * rows + i, "serial", k, 5, 2, 3, 0, 0, 4, 4, 10, 90, 0, 4, 0, k, 0))
            timeline.append((k, f"req-{i}", "queued", k, 0))
        t0, c0 = time.perf_counter(), time.thread_time()
        w.flush()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    w.close()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flushes", type=int, default=40)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    real_fsync = os.fsync
    res: dict[str, list[tuple[float, float]]] = {"durable": [], "no fsync": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for p in range(args.pairs):
            for mode in ("durable", "no fsync"):
                os.fsync = real_fsync if mode == "durable" else (lambda fd: None)  # type: ignore[assignment]
                try:
                    wall, cpu = flushes(Path(d) / f"{mode.replace(' ', '-')}-{p}", args.flushes, args.rows)
                finally:
                    os.fsync = real_fsync
                res[mode].append((statistics.median(wall), statistics.median(cpu)))
    for mode, v in res.items():
        print(f"{mode:9s}: flush wall p50 {statistics.median(x[0] for x in v) * 1e3:.2f} ms, "
              f"flushing thread CPU p50 {statistics.median(x[1] for x in v) * 1e3:.2f} ms "
              f"({args.pairs} runs x {args.flushes} flushes of {args.rows} probe rows)")


if __name__ == "__main__":
    main()
