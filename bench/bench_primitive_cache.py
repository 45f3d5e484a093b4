"""What oneDNN's primitive cache costs the engine's forward: primitives rebuilt per pass, times
what one rebuild costs.

oneDNN builds a GEMM primitive (JIT kernels included) per shape, the batch's token count
included, and keeps them in an LRU cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1,024 by default;
the engine asks for packed_gemm.PRIMITIVE_CACHE_CAPACITY). A few percent of a forward is
invisible in wall-clock pairs on a shared host, so this counts instead:

1. For each capacity, a fresh process runs the engine on bench_engine_vs_hf.py's workload
   (bench_forward.capture), then replays its batches through the model `--passes` times, with
   oneDNN's verbose log on; the primitives built in the run and in each pass are counted from
   the log (`create:cache_miss`).
2. The memory the cache holds: a fresh process builds every row count up to `--held-rows` of the
   five projections, at 1,024 entries and at the engine's, and the growth of its resident memory
   is compared (each primitive counted as two entries, itself and its nested one).
3. The cost of one build, timed in this process: each distinct (token count, projection) of
   the run (from the log), the first call on a new shape against the best of two calls after
   it, the largest shapes first so that the heap has grown before the small ones; with the
   page faults of the first call. Each pass's page faults are counted too: a rebuild in the
   replay may map fresh memory where the isolated one reuses the heap; one fault's cost is
   timed on a fresh mapping (`fault_cost`, a Python loop's write included: an upper bound).

    .venv/bin/python bench/bench_primitive_cache.py            # about 3 minutes here
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

REPLAY = """
import resource, sys, time, torch
sys.path[:0] = [ROOT, ROOT + "/bench"]
import bench_forward as bf
torch.set_num_threads(1)
fbs, model, kv, _ = bf.capture("default", REQUESTS, (16, 512), (16, 256), 0)
for p in range(PASSES):
    print("PASS", p, flush=True)
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    with torch.inference_mode():
        for fb in fbs:
            model.forward(fb, kv)
    print("PASS_S", time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, flush=True)
"""
# A fresh process builds a primitive for each row count 1..ROWS of the five projections and
# prints its resident memory's growth; 1,024 entries against the engine's size the held ones.
HELD = """
import sys, torch
sys.path[:0] = [ROOT]
from scheduler.model import packed_gemm
torch.set_num_threads(1)
ws = [(k, packed_gemm.pack(torch.randn(n, k))) for k, n in ((512, 1024), (512, 512), (512, 3072), (1536, 512), (512, 8192))]
xs = {k: torch.ones(ROWS, k) for k in (512, 1536)}
import ctypes
trim = ctypes.CDLL("libc.so.6").malloc_trim
def rss():  # what is live: the heap's freed pages handed back first
    trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
with torch.inference_mode():
    for m in range(1, ROWS + 1):
        for k, w in ws:
            packed_gemm.linear(xs[k][:m], w, None)
print("HELD", rss() - before)
"""
SHAPE = re.compile(r"mb(\d+)ic(\d+)oc(\d+)")


def replay(capacity: str | None, requests: int,
           passes: int) -> tuple[list[int], list[tuple[float, int]], set[tuple[int, int, int]]]:
    """Builds in the run and in each pass, each pass's seconds and page faults, and the run's GEMM shapes."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env["ONEDNN_VERBOSE"] = "2"
    if capacity is not None:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = capacity
    code = REPLAY.replace("ROOT", repr(str(ROOT))).replace("REQUESTS", str(requests)).replace("PASSES", str(passes))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    builds, seconds, shapes = [0], [], set()
    for line in out.splitlines():
        if line.startswith("PASS "):
            builds.append(0)
        elif line.startswith("PASS_S "):
            seconds.append((float(line.split()[1]), int(line.split()[2])))
        elif "create:cache_miss" in line:
            builds[-1] += 1
            m = SHAPE.search(line)
            if m and len(builds) == 1:
                shapes.add((int(m[1]), int(m[2]), int(m[3])))
    return builds, seconds, shapes


def build_cost(shapes: set[tuple[int, int, int]]) -> tuple[list[float], list[int]]:
    """Per shape: the first call's seconds over the best of the two after it, and its page faults."""
    import torch

    from scheduler.model import packed_gemm

    torch.set_num_threads(1)
    weights = {(k, n): packed_gemm.pack(torch.randn(n, k) * 0.05) for _, k, n in shapes}
    extra, faults = [], []
    with torch.inference_mode():
        for m, k, n in sorted(shapes, reverse=True):
            x, w = torch.randn(m, k), weights[k, n]
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = [time.perf_counter()]
            for _ in range(3):
                packed_gemm.linear(x, w, None)
                t.append(time.perf_counter())
                if len(t) == 2:
                    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            extra.append((t[1] - t[0]) - min(t[2] - t[1], t[3] - t[2]))
    return extra, faults


def held_bytes(capacity: str, rows: int) -> int:
    """Resident memory grown by building every row count up to `rows` of the five projections."""
    env = dict(os.environ, ONEDNN_PRIMITIVE_CACHE_CAPACITY=capacity)
    code = HELD.replace("ROOT", repr(str(ROOT))).replace("ROWS", str(rows))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return int(out.split("HELD", 1)[1])


def fault_cost(mb: int = 256) -> float:
    """Seconds per page fault: the first write to each 4 KB page of a fresh anonymous mapping
    (the kernel's fault path and its zeroing of the page), the best of three mappings."""
    import mmap

    best = float("inf")
    for _ in range(3):
        m = mmap.mmap(-1, mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_NOHUGEPAGE)
        t0 = time.perf_counter()
        for off in range(0, mb << 20, 4096):
            m[off] = 1
        best = min(best, (time.perf_counter() - t0) / ((mb << 20) // 4096))
        m.close()
    return best


def main(argv: list[str] | None = None) -> int:
    from scheduler.model.packed_gemm import PRIMITIVE_CACHE_CAPACITY

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--held-rows", type=int, default=640,
                    help="row counts built per projection for the memory the cache holds")
    ap.add_argument("--capacities", default="1024,engine",
                    help="comma-separated; `engine`: the variable unset, as the engine sets it")
    args = ap.parse_args(argv)
    shapes: set[tuple[int, int, int]] = set()
    rows = []
    for cap in args.capacities.split(","):
        builds, seconds, found = replay(None if cap == "engine" else cap, args.requests, args.passes)
        shapes |= found
        rows.append((cap, builds, seconds))
    extra, faults = build_cost(shapes)
    per, fault = statistics.mean(extra), fault_cost()
    print(f"{len(shapes)} GEMM shapes in the run ({len({m for m, _, _ in shapes})} token counts); one build: "
          f"median {statistics.median(extra) * 1e3:.2f} ms, mean {per * 1e3:.2f} ms, "
          f"{statistics.median(faults):.0f} page faults (median); a page fault {fault * 1e6:.2f} us")
    small, large = held_bytes("1024", args.held_rows), held_bytes(str(PRIMITIVE_CACHE_CAPACITY), args.held_rows)
    built = 5 * args.held_rows
    held = min(built, PRIMITIVE_CACHE_CAPACITY // 2) - 1024 // 2  # two entries a primitive
    print(f"{built} primitives built: the process grew {small / 2**20:.0f} MB holding 1,024 entries, "
          f"{large / 2**20:.0f} MB holding {PRIMITIVE_CACHE_CAPACITY:,}: "
          f"{(large - small) / max(1, held) / 1024:.0f} KB a primitive")
    for cap, builds, seconds in rows:
        passes = ", ".join(f"{b} ({b * per:.2f} s of {s:.2f} s: {b * per / s:.1%}) with {f} page faults "
                           f"({f * fault:.2f} s: {f * fault / s:.1%})" for b, (s, f) in zip(builds[1:], seconds, strict=True))
        print(f"capacity {cap}: built in the run {builds[0]}; rebuilt per replay pass: {passes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
