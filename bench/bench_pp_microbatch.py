"""Pipeline parallel: one part per round against two pipelined halves, alternated.

    python bench/bench_pp_microbatch.py --model default --requests 32 --pairs 3

Each pair runs `mstrace run --pp 2 --pp-microbatches 1` then `... 2` on the same workload
(same seed); medians over pairs and the median of per-pair ratios are printed, with each
rank's pp_bubble share of rank 0's cycle time (the idle time micro-batching should cut).
"""

from __future__ import annotations

import argparse
import json

from common import OUT, load, median, mstrace_run, report


def bubble(rep: dict, rank: str) -> float:
    rows = rep.get("per_rank", {}).get(rank, {}).get("boundaries", [])
    return next((b["device_share"] or 0.0 for b in rows if b["boundary"] == "pp_bubble"), 0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=3)
    a = ap.parse_args()
    res: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    print(f"load before: {load()}")
    for i in range(a.pairs):
        for mb in (1, 2):
            out = OUT / "pp_microbatch" / f"{a.model}-mb{mb}-{i}"
            mstrace_run(out, "--model", a.model, "--requests", str(a.requests), "--pp", "2",
                        "--pp-microbatches", str(mb), "--seed", "0")
            r = report(out)
            res[mb].append({"tok_s": r["throughput"]["output_tok_per_s"],
                            "bubble_r0": bubble(r, "0"), "bubble_r1": bubble(r, "1")})
    print(f"load after: {load()}")
    ratio = median([res[2][i]["tok_s"] / res[1][i]["tok_s"] for i in range(a.pairs)])
    print(f"model={a.model} requests={a.requests} pairs={a.pairs} pp=2")
    print(f"{'microbatches':<13} {'tok/s':>8} {'bubble r0':>10} {'bubble r1':>10}   per-pair tok/s")
    for mb in (1, 2):
        m = {k: median([x[k] for x in res[mb]]) for k in res[mb][0]}
        print(f"{mb:<13} {m['tok_s']:>8.1f} {100 * m['bubble_r0']:>9.1f}% {100 * m['bubble_r1']:>9.1f}%   "
              + " / ".join(f"{x['tok_s']:.1f}" for x in res[mb]))
    print(f"two halves / one part, median of per-pair ratios: {ratio:.3f}")
    (OUT / "pp_microbatch.json").write_text(json.dumps({"runs": res, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
