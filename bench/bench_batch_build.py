"""The host work of a decode round's forward batch, two revisions alternated: the thread CPU of
`build_forward_batch` on decode-only batches, and of `resolve_placeholders` (overlap mode's
placeholder ids filled from the future ring).

    python bench/bench_batch_build.py --a REV_A [--b REV_B] [--repeats 4] [--rows 1 16 40] [--what build resolve]

Each measurement runs in a process of its own from that revision's tree (bench_ab.checkout),
on one thread, and reports the median over 3,000 calls after 200 of warm-up. The batches are
a scheduler's: one decode row per running request, contexts of 100-300 tokens spread over
16-token blocks, every row sampled; the placeholders are the rows' input ids, as overlap
leaves them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench_ab import alternated

CHILD = r"""
import statistics, sys, time, torch
torch.set_num_threads(1)
import scheduler.model.forward_batch as fbm
assert fbm.__file__.startswith(sys.argv[1]), fbm.__file__
what, rows = sys.argv[2], int(sys.argv[3])
chunks, nxt = [], 0
for i in range(rows):
    pos = 100 + (i * 37) % 200
    nb = pos // 16 + 1
    token = -(i + 1) if what == "resolve" else 5 + i
    chunks.append(fbm.SeqChunk([token], pos, list(range(nxt, nxt + nb)), True))
    nxt += nb
future = torch.arange(4096)
def once():
    if what == "build":
        fbm.build_forward_batch(chunks, 16, "cpu")
    else:
        fbm.resolve_placeholders(batch, future)
        batch.input_ids = ids
batch = fbm.build_forward_batch(chunks, 16, "cpu")
ids = batch.input_ids
for _ in range(200):
    once()
times = []
for _ in range(3000):
    t = time.thread_time_ns()
    once()
    times.append(time.thread_time_ns() - t)
print(statistics.median(times) / 1e3)
"""


def measure(what: str, rows: int):
    def run(src: Path) -> float:
        p = subprocess.run([sys.executable, "-c", CHILD, str(src), what, str(rows)], cwd=src,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{src.name}: {p.stderr.strip()[-400:]}")
        return float(p.stdout.strip())
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="baseline revision")
    ap.add_argument("--b", help="revision to compare (default: the working tree)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 40])
    ap.add_argument("--what", nargs="+", choices=("build", "resolve"), default=["build", "resolve"])
    a = ap.parse_args()
    out = []
    for what in a.what:
        for rows in a.rows:
            print(f"{what}, {rows} rows (thread CPU us per call):", flush=True)
            out.append((what, rows, alternated(measure(what, rows), a.a, a.b, a.repeats, "us")))
    for what, rows, ratio in out:
        print(f"{what:8s} {rows:3d} rows: median B/A {ratio:.3f}")


if __name__ == "__main__":
    main()
