"""Where `mstrace diff`'s time goes: its phases, timed in one process, as `build_diff` runs them.

    python bench/bench_diff_phases.py TRACE_A TRACE_B [--repeats 3]

Phases: reading A, reading B (`load_inputs`, each its probe stream and its requests on two
threads; A's own bootstraps run beside B's read), the two reports (`build_report`, B's own
bootstraps and the requests' beside them), and the statistics (`compare`: what is left of
those, and the deltas). Prints each repeat and the medians; the process's
peak RSS at the end. Use it beside `/usr/bin/time mstrace diff A B` (BENCHMARKS.md,
"`diff`'s statistics on two cores"), whose wall adds the interpreter's start.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from viewer.analysis.diff import RESAMPLES, SEED, OwnDraws, Side, compare, place_of_b  # noqa: E402
from viewer.analysis.report import REQUEST_COLUMNS, build_report, load_inputs  # noqa: E402
from viewer.analysis.serving_boot import request_boot  # noqa: E402

PHASES = ("read_a_s", "read_b_s", "reports_s", "statistics_s", "total_s")


def once(a: str, b: str) -> dict[str, float]:
    columns = list(dict.fromkeys([*REQUEST_COLUMNS, "token_runs", "request_id"]))  # as build_diff reads
    with ThreadPoolExecutor(max_workers=1) as early, ThreadPoolExecutor(max_workers=1) as late:
        t0 = time.perf_counter()
        ia = load_inputs(a, columns, per_cycle=True)
        t1 = time.perf_counter()
        sa = Side(ia.main_rank, ia.steps, ia.requests, ia.trace.meta)
        a_draws = OwnDraws.start(sa, 0, RESAMPLES, SEED, early)  # beside B's read, as build_diff
        ib = load_inputs(b, columns, per_cycle=True)
        t2 = time.perf_counter()
        sb = Side(ib.main_rank, ib.steps, ib.requests, ib.trace.meta)
        b_draws = OwnDraws.start(sb, place_of_b(sa, sb), RESAMPLES, SEED, late)  # beside the reports
        req = early.submit(request_boot, sa.requests, sb.requests, sa.meta, sb.meta, RESAMPLES, SEED)
        reports = [build_report(i) for i in (ia, ib)]
        t3 = time.perf_counter()
        probes = all(r.probes for r in reports)
        compare(sa, sb, RESAMPLES, SEED, probes, draws=(a_draws, b_draws), requests=req)
        t4 = time.perf_counter()
    return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        runs.append(once(args.a, args.b))
        print(f"repeat {i}: " + "  ".join(f"{k} {v:.2f}" for k, v in runs[-1].items()), flush=True)
    print("median:   " + "  ".join(f"{k} {statistics.median(r[k] for r in runs):.2f}" for k in PHASES))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")


if __name__ == "__main__":
    main()
