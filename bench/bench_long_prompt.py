"""The seed's worked example, measured: 16 decoding requests, then one long
prompt arrives. How much do the decodes stall in each mode?

    python bench/bench_long_prompt.py [--model default] [--prompt 2000]

Configurations: serial with the whole prompt in one round (no chunking: the
seed's "prefill-first" case), serial with chunked prefill (512), time-slice
(256-token chunks), and overlap (decode and prefill on separate streams).
Reported: the decodes' ITL p50/p99/max over the window in which the long
prompt is prefilled, and the long prompt's TTFT.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pyarrow.compute as pc
from common import OUT, load, mstrace_run

CONFIGS = {
    "serial, unchunked": ["--mode", "serial", "--prefill-chunk", "4096"],
    "serial, chunk 512": ["--mode", "serial", "--prefill-chunk", "512"],
    "timeslice 256": ["--mode", "timeslice", "--timeslice-chunk", "256"],
    "overlap": ["--mode", "overlap", "--prefill-chunk", "512"],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--decodes", type=int, default=16)
    ap.add_argument("--arrive-s", type=float, default=1.0)
    a = ap.parse_args()
    import sys

    sys.path.insert(0, str(OUT.parent.parent))
    from tracing.reader import read_table

    wl = OUT / "long_prompt.jsonl"
    wl.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    # ids below 500 fit every preset's vocabulary; decodes run long enough to span the prefill
    lines = [{"id": f"d{i}", "input_ids": rng.integers(10, 500, 32).tolist(), "max_new_tokens": 400,
              "ignore_eos": True} for i in range(a.decodes)]
    lines.append({"id": "long", "input_ids": rng.integers(10, 500, a.prompt).tolist(), "max_new_tokens": 1,
                  "ignore_eos": True, "arrival_s": a.arrive_s})
    wl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    print(f"load before: {load()}")
    rows = {}
    for name, flags in CONFIGS.items():
        out = OUT / "long_prompt" / name.replace(" ", "_").replace(",", "")
        mstrace_run(out, "--model", a.model, "--workload", str(wl), "--kv-blocks", "4096", *flags)
        req = read_table(out, "requests")
        long = req.filter(pc.equal(req["request_id"], "long")).to_pylist()[0]
        t0, t1 = long["arrival_ns"], long["first_token_ns"]
        gaps = []
        for r in req.filter(pc.not_equal(req["request_id"], "long")).to_pylist():
            ts = r["first_token_ns"] + np.concatenate([[0], np.cumsum(r["dur_itl_ns"])])
            d = np.diff(ts)
            inside = (ts[1:] >= t0) & (ts[:-1] <= t1)  # gaps overlapping the long prefill
            gaps.extend((d[inside] / 1e6).tolist())
        g = np.array(gaps) if gaps else np.array([np.nan])
        rows[name] = {"itl_p50_ms": float(np.percentile(g, 50)), "itl_p99_ms": float(np.percentile(g, 99)),
                      "itl_max_ms": float(g.max()), "long_ttft_ms": (t1 - t0) / 1e6, "gaps": len(gaps)}
    print(f"load after: {load()}")
    print(f"model={a.model} decodes={a.decodes} long prompt={a.prompt} tokens")
    print(f"{'config':<20} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'long TTFT':>10}")
    for name, r in rows.items():
        print(f"{name:<20} {r['itl_p50_ms']:>8.1f} {r['itl_p99_ms']:>8.1f} {r['itl_max_ms']:>8.1f} "
              f"{r['long_ttft_ms']:>10.1f}")
    (OUT / "long_prompt.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
