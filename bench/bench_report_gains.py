"""What the report's "worth attacking" predictions cost on a long trace: the window of its
last rounds (`whatif_gains.gains_window`) and the round model's fit and predictions
(`cycle_gains`), each on the calling thread's CPU clock, from the steps as the report reads
them (one snapshot, read once). The rows are those the report would predict for: the ones
worth attacking in the trace's own report.

    python bench/bench_report_gains.py bench/out/big10m bench/out/tp100m --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import REPO

sys.path.insert(0, str(REPO))
from tracing.consistency import read_steps  # noqa: E402
from viewer.analysis.advice import attacked  # noqa: E402
from viewer.analysis.cost import table_of  # noqa: E402
from viewer.analysis.report import STEP_COLUMNS, load_inputs  # noqa: E402
from viewer.analysis.whatif_gains import cycle_gains, gains_window  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    for root in a.traces:
        inp = load_inputs(root)
        names = attacked(table_of(inp.main_rank))
        mode = inp.trace.meta.get("config", {}).get("mode")
        steps = read_steps(inp.trace, STEP_COLUMNS).combine_chunks()
        del inp
        cut, fit = [], []
        for _ in range(a.repeats):
            t0 = time.thread_time()
            w = gains_window(steps)
            t1 = time.thread_time()
            gains = cycle_gains(root, names, mode, w)
            fit.append(time.thread_time() - t1)
            cut.append(t1 - t0)
        print(f"{root}: {steps.num_rows:,} rounds, window {w.rounds if w else 'the whole run'}; "
              f"window {1e3 * statistics.median(cut):.1f} ms, fit and predictions "
              f"{statistics.median(fit):.3f} s (thread CPU, medians of {a.repeats}); "
              + ", ".join(f"{k} {100 * v:+.1f}%" for k, v in gains.items()), flush=True)


if __name__ == "__main__":
    main()
