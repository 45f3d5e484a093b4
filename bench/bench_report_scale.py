"""`mstrace report` on a ~10 M probe-row trace: wall time and peak memory.

    python bench/bench_report_scale.py [--probe-rows 10000000] [--repeats 3]

Builds a real tiny-model trace, replicates it (bench/gen_big_trace.py) with
shifted times and steps, then runs `mstrace report` as a user would, under
/usr/bin/time -v, and prints the median wall time and the max peak RSS.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

from common import OUT, REPO, load, mstrace_run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe-rows", type=int, default=10_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    src, big = OUT / "scale_src", OUT / "scale_big"
    mstrace_run(src, "--model", "tiny", "--requests", "64", "--seed", "0")
    subprocess.run([sys.executable, str(REPO / "bench" / "gen_big_trace.py"), str(src), str(big),
                    "--probe-rows", str(a.probe_rows)], check=True, cwd=REPO)
    print(f"load before: {load()}")
    walls, rss = [], []
    for _ in range(a.repeats):
        p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "viewer.cli", "report", str(big)],
                           cwd=REPO, capture_output=True, text=True, check=True)
        m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([\d.]+)", p.stderr)
        assert m is not None
        walls.append(int(m.group(1)) * 60 + float(m.group(2)))
        r = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
        assert r is not None
        rss.append(int(r.group(1)) / 1e6)
    print(f"load after: {load()}")
    print(f"report on {a.probe_rows} probe rows: wall median {statistics.median(walls):.2f} s "
          f"(runs {', '.join(f'{w:.2f}' for w in walls)}), peak RSS max {max(rss):.2f} GB")


if __name__ == "__main__":
    main()
