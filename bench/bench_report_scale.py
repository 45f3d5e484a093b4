"""`mstrace report` on a ~10 M probe-row trace, in both layouts: wall time and peak memory.

    python bench/bench_report_scale.py [--probe-rows 10000000] [--repeats 3] [--flush-files] [--diff] [--reuse]

Builds a real tiny-model trace, replicates it (bench/gen_big_trace.py) with shifted
times and steps into the uncompacted layout a long run leaves (one row group per
flush (the writer's interval); `--rows-per-group N`: one per N rows of each table; `--flush-files`: one
part file per flush), then `mstrace compact`s a copy
of it, and runs `mstrace report` on each as a user would, under /usr/bin/time -v:
median wall time and max peak RSS.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import time

from common import OUT, REPO, load, mstrace_run


def timed(cmd: list[str]) -> tuple[float, float]:
    p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "viewer.cli", *cmd],
                       cwd=REPO, capture_output=True, text=True, check=True)
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", p.stderr)
    r = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    assert m is not None and r is not None
    return int(m.group(1)) * 60 + float(m.group(2)), int(r.group(1)) / 1e6


def bench(cmd: list[str], repeats: int, label: str) -> None:
    runs = [timed(cmd) for _ in range(repeats)]
    walls = [w for w, _ in runs]
    print(f"{label}: {cmd[0]} wall median {statistics.median(walls):.2f} s "
          f"(runs {', '.join(f'{w:.2f}' for w in walls)}), peak RSS max {max(r for _, r in runs):.2f} GB",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe-rows", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flush-files", action="store_true", help="uncompacted: one part file per flush")
    ap.add_argument("--rows-per-group", type=int, default=0,
                    help="uncompacted: one row group per this many rows of each table, not per flush")
    ap.add_argument("--reuse", action="store_true",
                    help="time the traces the last run of this bench built (same --probe-rows) instead of building them")
    ap.add_argument("--diff", action="store_true", help="also time `mstrace diff` of the two layouts")
    a = ap.parse_args()
    tag = f"{a.probe_rows // 1_000_000}m"
    src, unc, cmp_ = OUT / "scale_src", OUT / f"scale_uncompacted_{tag}", OUT / f"scale_compacted_{tag}"
    t = time.perf_counter()
    if not (a.reuse and (unc / "meta.json").exists() and (cmp_ / "meta.json").exists()):
        mstrace_run(src, "--model", "tiny", "--requests", "64", "--seed", "0")
        gen = [sys.executable, str(REPO / "bench" / "gen_big_trace.py"), str(src), str(unc),
               "--probe-rows", str(a.probe_rows), "--rows-per-group", str(a.rows_per_group),
               *(["--flush-files"] if a.flush_files else [])]
        subprocess.run(gen, check=True, cwd=REPO)
        if cmp_.exists():
            shutil.rmtree(cmp_)
        shutil.copytree(unc, cmp_)
        t = time.perf_counter()
        w, rss = timed(["compact", str(cmp_)])
        print(f"mstrace compact: {w:.1f} s wall, peak RSS {rss:.2f} GB", flush=True)
    print(f"load before: {load()}", flush=True)
    bench(["report", str(unc)], a.repeats, "uncompacted")
    bench(["report", str(cmp_)], a.repeats, "compacted")
    if a.diff:
        bench(["diff", str(unc), str(cmp_)], a.repeats, "uncompacted vs compacted")
    print(f"load after: {load()}; total {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
