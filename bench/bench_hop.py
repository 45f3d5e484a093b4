"""The client - server hop under a burst, leg by leg, two server revisions alternated.

    python bench/bench_hop.py --a REV [--b REV] [--pairs 2] [--runs 3] [--prompts 64]
        [--concurrency 16] [--output-len 32]

Each turn starts `mstrace serve --model default` from one revision's worktree (bench/out/ab/,
as bench_ab.py; B defaults to the working tree), then runs this checkout's `bench-serve
--trace` against it `--runs` times at `--concurrency`, and once at concurrency 1. Every run
prints the hop's medians and its eight legs (bench-serve's `--save-result` keys, from the
server's own timeline stamps: docs/serve.md), and the CPU the server's event loop thread
(uvicorn runs on the main thread) and its other threads spent per request, read from /proc.
The turns alternate A, B, B, A, ...; the end prints each revision's medians over its runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_ab import checkout
from bench_serve_peer import free_port, wait_ready
from common import OUT, REPO, cpu_s

LEGS = ["hop_ttft_ms", "hop_in_client_ms", "hop_in_socket_ms", "hop_in_parse_ms", "hop_in_route_ms",
        "hop_in_submit_ms", "hop_out_sender_ms", "hop_out_loop_ms", "hop_out_read_ms"]


def cpu_ms(pid: int) -> tuple[float, float]:
    """(the main thread's, the other threads') CPU ms of process `pid` so far."""
    main = cpu_s(pid, pid) * 1e3
    return main, cpu_s(pid) * 1e3 - main


def turn(src: Path, runs: int, prompts: int, concurrency: int, output_len: int, work: Path) -> list[dict[str, float]]:
    port, trace = free_port(), work / "trace"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    server = subprocess.Popen([sys.executable, "-m", "viewer.cli", "serve", "--model", "default", "--port", str(port),
                               "--out", str(trace)], cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", server)
        for i, (c, n) in enumerate([(concurrency, prompts)] * runs + [(1, 8)]):
            saved = work / f"run{i}.json"
            before = cpu_ms(server.pid)
            p = subprocess.run([sys.executable, "-m", "viewer.cli", "bench-serve", "--base-url", f"http://127.0.0.1:{port}",
                                "--num-prompts", str(n), "--max-concurrency", str(c), "--random-input-len", "128",
                                "--random-output-len", str(output_len), "--trace", str(trace), "--save-result", str(saved)],
                               cwd=REPO, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"bench-serve failed: {p.stderr.strip()[-400:]}")
            after = cpu_ms(server.pid)
            r = json.loads(saved.read_text())
            side = r["server_side"]
            row = {"c": c, **{k: side[k]["median"] for k in LEGS}, "tok_s": r["output_throughput"],
                   "loop_cpu_ms": (after[0] - before[0]) / n, "other_cpu_ms": (after[1] - before[1]) / n}
            rows.append(row)
            print(f"| {src.name} | c{c} | " + " | ".join(f"{row[k]:.2f}" for k in LEGS)
                  + f" | {row['tok_s']:.0f} | {row['loop_cpu_ms']:.2f} | {row['other_cpu_ms']:.2f} |", flush=True)
    finally:
        server.terminate()
        server.communicate(timeout=60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline revision")
    ap.add_argument("--b", default=None, help="revision to compare (default: the working tree)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="bench-serve runs at --concurrency per server start")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    a = ap.parse_args()
    srcs = {"A": checkout(a.a), "B": checkout(a.b) if a.b else REPO}
    print("| server | load | " + " | ".join(k.removesuffix("_ms") for k in LEGS)
          + " | output tok/s | loop CPU ms/request | other threads' CPU ms/request |")
    print("|---|---|" + "---:|" * (len(LEGS) + 3))
    got: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for i in range(a.pairs):
        for k in ("A", "B") if i % 2 == 0 else ("B", "A"):
            got[k] += turn(srcs[k], a.runs, a.prompts, a.concurrency, a.output_len, OUT / "hop" / k)
    for k, rows in got.items():
        for c in sorted({r["c"] for r in rows}, reverse=True):
            sel = [r for r in rows if r["c"] == c]
            med = {f: statistics.median(r[f] for r in sel) for f in [*LEGS, "tok_s", "loop_cpu_ms", "other_cpu_ms"]}
            print(f"{k} ({srcs[k].name}) c{c}, medians of {len(sel)} runs: "
                  + ", ".join(f"{f.removesuffix('_ms')} {v:.2f}" for f, v in med.items()))


if __name__ == "__main__":
    main()
