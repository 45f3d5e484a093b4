"""Throughput with probes on vs off (--no-probes), alternated, median of pairs.

    python bench/bench_probe_overhead.py --model tiny --requests 64 --pairs 5

tiny is the worst case: its steps are short, so per-step probe work weighs most.
"""

from __future__ import annotations

import argparse
import json

from common import OUT, load, median, mstrace_run, report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--mode", default="serial")
    a = ap.parse_args()
    on, off = [], []
    print(f"load before: {load()}")
    for i in range(a.pairs):
        for probes, acc in ((True, on), (False, off)):
            out = OUT / "probe_overhead" / f"{a.model}-{'on' if probes else 'off'}-{i}"
            mstrace_run(out, "--model", a.model, "--requests", str(a.requests), "--mode", a.mode, "--seed", "0",
                        *([] if probes else ["--no-probes"]))
            acc.append(report(out)["throughput"]["output_tok_per_s"])
    print(f"load after: {load()}")
    ratios = [x / y for x, y in zip(on, off, strict=True)]
    res = {"on": on, "off": off, "ratio_per_pair": ratios, "median_on": median(on), "median_off": median(off),
           "median_ratio": median(ratios)}
    print(json.dumps(res, indent=2))
    (OUT / f"probe_overhead_{a.model}.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
