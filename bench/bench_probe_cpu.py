"""Probe overhead by CPU time, attributed directly (issue 10, item 4).

    flock /tmp/mstrace-bench.lock .venv/bin/python bench/bench_probe_cpu.py --model tiny --requests 1024 --pairs 8

Wall-clock pairs cannot resolve a 1% cost on a shared 2-core machine, and whole-run
CPU time is noisy too (threads that wait burn CPU in proportion to wall time). So the
cost is measured itself, on real `mstrace run` traces:
  * the writer's own CPU time (its thread's CPU clock, and close() on the caller's),
    per table, as the writer records it in meta.json run.writer;
  * the rows the trace holds, by the kind of site that emitted them, times each kind's
    micro-benchmarked cost per row (bench/bench_probe_cost.py);
  * as a share of the run's CPU time (meta.json run.cpu: this process's threads and the
    CPU device process, from the workload's start to its end), and per output token.
Cross-check: alternated whole-run pairs, probes on vs --no-probes, OMP_WAIT_POLICY=PASSIVE,
reporting the median per-pair ratio of CPU per output token with its spread and a
distribution-free interval for the median. Every "on" run is attributed, so the
attribution too comes with a spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import OUT, REPO, load, mstrace_run

sys.path.insert(0, str(REPO))

from bench_probe_cost import kinds, measure  # noqa: E402
from probe_attribution import Attribution, attribute, trace_rows  # noqa: E402


def median_interval(xs: list[float], level: float = 0.90) -> tuple[float, float, float]:
    """The narrowest order-statistic interval [x(k), x(n+1-k)] that covers the median
    with probability >= level (sign test: no assumption on the ratios' distribution);
    the full range when n is too small for the level."""
    s, n = sorted(xs), len(xs)
    best = (s[0], s[-1], 1 - 2 * 0.5 ** n)
    for k in range(2, n // 2 + 1):
        cover = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if cover < level:
            break
        best = (s[k - 1], s[n - k], cover)
    return best


def one_run(out: Path, a: argparse.Namespace, probes: bool) -> dict[str, Any]:
    if not (a.reuse and (out / "meta.json").exists()):
        mstrace_run(out, "--model", a.model, "--requests", str(a.requests), "--mode", a.mode, "--seed", "0",
                    *([] if probes else ["--no-probes"]))
    meta = json.loads((out / "meta.json").read_text())
    rows = trace_rows(out)
    run = meta["run"]
    return {"meta": meta, "rows": rows, "cpu_ns": run["cpu"]["total_ns"], "tokens": rows.output_tokens,
            "wall_ns": run["end_ns"] - run["start_ns"], "threads_ns": run["cpu"]["threads_ns"],
            "switches": run["cpu"].get("threads_switches", {}), "process_ns": run["cpu"]["process_ns"],
            "children_ns": run["cpu"]["children_ns"], "writer_ns": run["writer"]["cpu_ns"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--mode", default="serial")
    ap.add_argument("--n", type=int, default=200_000, help="micro-benchmark iterations per kind")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--reuse", action="store_true", help="analyse the traces a previous run left, run none")
    a = ap.parse_args()
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # the runs inherit it: no spinning OpenMP workers
    print(f"load before: {load()}", flush=True)

    on: list[dict[str, Any]] = []
    off: list[dict[str, Any]] = []
    for i in range(a.pairs):
        # alternate the order inside the pairs, so a drift in load falls on both sides
        for probes in ((True, False) if i % 2 == 0 else (False, True)):
            r = one_run(OUT / "probe_cpu" / f"{'on' if probes else 'off'}-{i}", a, probes)
            (on if probes else off).append(r)
            print(f"pair {i} probes={'on ' if probes else 'off'} cpu {r['cpu_ns'] / 1e9:6.2f} s  "
                  f"wall {r['wall_ns'] / 1e9:6.2f} s  {r['tokens']} tokens", flush=True)

    rows0 = on[0]["rows"]
    costs = measure(a.n, a.repeats, round(rows0.prompt_len), round(rows0.output_len))
    scope = {k: v.scope for k, v in kinds().items()}
    cost_ns = {k: c.median_ns for k, c in costs.items()}
    atts = [attribute(r["meta"], r["rows"], cost_ns, scope) for r in on]
    print(f"load after: {load()}", flush=True)

    pairs = list(zip(on, off, strict=True))
    ratios = [x["cpu_ns"] / x["tokens"] / (y["cpu_ns"] / y["tokens"]) for x, y in pairs]
    lo, hi, cover = median_interval(ratios)
    # The CPU device process does the same work with probes on or off: the ratio of its
    # CPU time is the pair's noise alone (a placebo), and dividing by it takes out the part
    # of the noise that slows every process alike (a busy neighbour on the host).
    placebo = [x["children_ns"] / y["children_ns"] for x, y in pairs if y["children_ns"]]
    normed = [(x["process_ns"] / x["children_ns"]) / (y["process_ns"] / y["children_ns"])
              for x, y in pairs if x["children_ns"] and y["children_ns"]]
    writer_diff = [(x["writer_ns"] - y["writer_ns"]) / 1e9 for x, y in pairs]
    threads = sorted({t for r in on + off for t in r["threads_ns"]})
    thread_med = {t: (statistics.median(r["threads_ns"].get(t, 0) for r in on) / 1e9,
                      statistics.median(r["threads_ns"].get(t, 0) for r in off) / 1e9,
                      statistics.median(r["switches"].get(t, 0) for r in on),
                      statistics.median(r["switches"].get(t, 0) for r in off)) for t in threads}
    extra = []
    for label, xs in (("placebo, device process CPU on/off", placebo),
                      ("main process CPU / device process CPU, on/off", normed)):
        if xs:
            a_, b_, c_ = median_interval(xs)
            extra.append(f"{label}: median {statistics.median(xs):.3f}, {100 * c_:.0f}% interval "
                         f"[{a_:.3f}, {b_:.3f}]; " + ", ".join(f"{x:.3f}" for x in xs))
    extra.append(f"writer CPU on - off per pair, s: median {statistics.median(writer_diff):.3f}; "
                 + ", ".join(f"{x:.3f}" for x in writer_diff))
    print_report(atts, costs, scope, ratios, (lo, hi, cover), thread_med, extra)
    res = {
        "costs": {k: asdict(c) for k, c in costs.items()},
        "attribution": [{**_att_dict(x)} for x in atts],
        "pairs": {"ratio_cpu_per_token": ratios, "median": statistics.median(ratios), "interval": [lo, hi],
                  "interval_cover": cover,
                  "cpu_on_s": [r["cpu_ns"] / 1e9 for r in on], "cpu_off_s": [r["cpu_ns"] / 1e9 for r in off],
                  "wall_on_s": [r["wall_ns"] / 1e9 for r in on], "wall_off_s": [r["wall_ns"] / 1e9 for r in off],
                  "placebo_device_ratio": placebo, "process_over_device_ratio": normed,
                  "writer_on_minus_off_s": writer_diff},
        "threads_median_s": thread_med,
    }
    (OUT / f"probe_cpu_{a.model}.json").write_text(json.dumps(res, indent=2))


def _att_dict(x: Attribution) -> dict[str, Any]:
    return {**asdict(x), "probes_share": x.probes_share, "trace_share": x.trace_share}


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.4g} ({min(xs):.4g} - {max(xs):.4g})"


def print_report(atts: list[Attribution], costs: dict[str, Any], scope: dict[str, str], ratios: list[float],
                 interval: tuple[float, float, float], thread_med: dict[str, tuple[float, float, float, float]],
                 extra: list[str]) -> None:
    a0 = atts[0]
    print("\nrows by kind (run 0) and cost per row (median of repeats, min - max), rows x cost:")
    print(f"{'kind':16} {'scope':6} {'rows':>8} {'ns/row':>8} {'(min - max)':>16} {'ms':>8}")
    for k, c in costs.items():
        n = a0.rows.get(k, 0)
        print(f"{k:16} {scope[k]:6} {n:8d} {c.median_ns:8.0f} {f'({c.min_ns:.0f} - {c.max_ns:.0f})':>16} "
              f"{a0.hot_ns.get(k, 0) / 1e6:8.2f}")
    for k in set(a0.rows) - set(costs):
        print(f"{k:16} {'probes':6} {a0.rows[k]:8d} (priced as the dearest probe kind) {a0.hot_ns[k] / 1e6:8.2f}")
    print(f"\nover {len(atts)} probes-on runs: median (min - max)")
    lines = [
        ("writer CPU s (all tables)", [x.writer_ns / 1e9 for x in atts]),
        ("writer CPU s (probes, memory, no table)", [x.writer_probes_ns / 1e9 for x in atts]),
        ("hot-path rows CPU s (probes scope)", [(x.probes_ns - x.writer_probes_ns) / 1e9 for x in atts]),
        ("attributed probe CPU s", [x.probes_ns / 1e9 for x in atts]),
        ("attributed tracing CPU s (everything)", [x.trace_ns / 1e9 for x in atts]),
        ("run CPU s", [x.run_cpu_ns / 1e9 for x in atts]),
        ("output tokens", [float(x.output_tokens) for x in atts]),
        ("run CPU us / output token", [x.per_token_us(x.run_cpu_ns) for x in atts]),
        ("probe CPU us / output token", [x.per_token_us(x.probes_ns) for x in atts]),
        ("tracing CPU us / output token", [x.per_token_us(x.trace_ns) for x in atts]),
        ("probe share of run CPU %", [100 * x.probes_share for x in atts]),
        ("tracing share of run CPU %", [100 * x.trace_share for x in atts]),
    ]
    for label, xs in lines:
        print(f"  {label:42} {_med(xs)}")
    lo, hi, cover = interval
    print(f"\ncross-check, {len(ratios)} pairs (on/off CPU per output token): median {statistics.median(ratios):.3f}, "
          f"{100 * cover:.0f}% interval for the median [{lo:.3f}, {hi:.3f}], pairs {min(ratios):.3f} - {max(ratios):.3f}")
    print("  per pair: " + ", ".join(f"{r:.3f}" for r in ratios))
    for line in extra:
        print(f"  {line}")
    print("\nthread CPU s and context switches, median on / off:")
    for t, (x, y, sx, sy) in thread_med.items():
        print(f"  {t:18} {x:7.3f} {y:7.3f}   {sx:8.0f} {sy:8.0f}")


if __name__ == "__main__":
    main()
