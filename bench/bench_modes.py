"""Serial vs overlap (and time-slice) throughput on one workload, alternated.

    python bench/bench_modes.py --model tiny --requests 64 --pairs 5
    python bench/bench_modes.py --model default --requests 32 --pairs 3

Each pair runs the modes back to back on the same synthetic workload (same
seed) through the CLI; medians over pairs and the median of per-pair ratios
are printed, with the exposed bookkeeping / batch_prepare / barrier shares.
"""

from __future__ import annotations

import argparse
import json

from common import OUT, load, median, mstrace_run, report, share


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--modes", default="serial,overlap,timeslice")
    ap.add_argument("--extra", default="", help="extra `mstrace run` flags, space separated")
    a = ap.parse_args()
    modes = a.modes.split(",")
    res: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    print(f"load before: {load()}")
    for i in range(a.pairs):
        for m in modes:
            out = OUT / "modes" / a.model / f"{m}-{i}"
            mstrace_run(out, "--model", a.model, "--requests", str(a.requests), "--mode", m,
                        "--seed", "0", *a.extra.split())
            r = report(out)
            res[m].append({
                "tok_s": r["throughput"]["output_tok_per_s"],
                "bookkeeping": share(r, "bookkeeping"),
                "batch_prepare": share(r, "batch_prepare"),
                "barrier": share(r, "scheduler_barrier"),
                "device_busy": r["device_busy"],
                "itl_p99": r["latency"]["itl_ms"]["p99"],
                "ttft_p50": r["latency"]["ttft_ms"]["p50"],
            })
    print(f"load after: {load()}")
    summary = {m: {k: median([x[k] for x in v]) for k in v[0]} for m, v in res.items()}
    ratios = {m: median([res[m][i]["tok_s"] / res["serial"][i]["tok_s"] for i in range(a.pairs)])
              for m in modes}
    print(f"model={a.model} requests={a.requests} pairs={a.pairs}")
    print(f"{'mode':<10} {'tok/s':>9} {'x serial':>9} {'busy%':>6} {'barrier%':>9} {'bookkeep%':>10} "
          f"{'prepare%':>9} {'ITL p99':>8} {'TTFT p50':>9}")
    for m in modes:
        s = summary[m]
        print(f"{m:<10} {s['tok_s']:>9.1f} {ratios[m]:>9.3f} {100 * s['device_busy']:>6.1f} "
              f"{100 * s['barrier']:>9.1f} {100 * s['bookkeeping']:>10.1f} {100 * s['batch_prepare']:>9.1f} "
              f"{s['itl_p99']:>8.2f} {s['ttft_p50']:>9.2f}")
    (OUT / "modes").mkdir(parents=True, exist_ok=True)
    (OUT / "modes" / f"{a.model}.json").write_text(json.dumps({"runs": res, "median": summary,
                                                               "ratio": ratios}, indent=2))


if __name__ == "__main__":
    main()
