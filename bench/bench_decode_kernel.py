"""The C decode attention kernel alone (scheduler/model/_attention.c), float32 and bfloat16,
one thread, on the default preset's heads (8 query, 4 KV, head size 64) and decode shapes:
16 and 64 rows of 128-192 tokens (bench_serve_peer's and bench_engine_vs_hf's rounds) and
57 rows of 16-768. A call is a forward's worth: the preset's 8 layers, each with its own
cache and its rows on their own shuffled blocks, so what a round reads is what a forward
reads (57 rows of 16-768 read about 380 MB in float32, out of every cache, as in
bench_forward's run; 16 rows of 128-192 about 40 MB). `--in-order` lays each row's blocks one
after another in the cache instead (a row whose blocks were taken together: in bench_forward's
run 75% of a decode row's blocks follow its previous one). The caches lie on 2 MB pages, as
the engine's KV pool asks (scheduler/model/huge_pages.py); `--pages small` puts them on 4 KB
pages (as before 820b857), `--pages both` times each build on both. Several
builds are timed call by call in turn, so each sees the same machine; without `--lib` the
installed build alone.

    .venv/bin/python bench/bench_decode_kernel.py [--lib A.so --lib B.so] [--calls 40] [--in-order] [--pages both]

Build another revision's kernel to compare (as bench_forward.py's --attention-lib does):

    git show REV:scheduler/model/_attention.c > /tmp/a/_attention.c
    git show REV:scheduler/model/_vec.h > /tmp/a/_vec.h
    gcc -O3 -shared -fPIC -I"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \\
        /tmp/a/_attention.c -o /tmp/a.so -lm -lpthread
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import REPO

sys.path.insert(0, str(REPO))
from scheduler.model import huge_pages, native_attention  # noqa: E402

BS, HEADS, KV_HEADS, D, LAYERS = 16, 8, 4, 64, 8
SHAPES = ((16, 128, 192), (64, 128, 192), (57, 16, 768))  # rows, shortest and longest context


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", type=Path, action="append", default=[], help="a build to time (repeatable)")
    ap.add_argument("--calls", type=int, default=40, help="calls of each build per shape (the first 5 not counted)")
    ap.add_argument("--in-order", action="store_true", help="each row's blocks in address order, not shuffled")
    ap.add_argument("--pages", choices=("huge", "small", "both"), default="huge",
                    help="the caches on 2 MB pages (as the engine's KV pool asks), on 4 KB pages, or both in turn")
    a = ap.parse_args()
    libs = {str(p): native_attention.load_library(p) for p in a.lib} or {"installed": native_attention._LIB}
    if any(lib is None for lib in libs.values()):
        raise SystemExit("a build did not load (or the install has none)")
    pages = ("huge", "small") if a.pages == "both" else (a.pages,)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for rows, lo, hi in SHAPES:
        nblk = hi // BS + 1
        blocks_per_layer = rows * nblk
        ctx = torch.randint(lo, hi, (rows,), generator=g)
        order = torch.arange(blocks_per_layer) if a.in_order else torch.randperm(blocks_per_layer, generator=g)
        blocks = order.view(rows, nblk).contiguous()
        q = torch.randn(rows, HEADS, D, generator=g)
        caches = [(torch.randn(blocks_per_layer * BS, KV_HEADS, D, generator=g),
                   torch.randn(blocks_per_layer * BS, KV_HEADS, D, generator=g)) for _ in range(LAYERS)]
        for dtype in (torch.float32, torch.bfloat16):
            pools = {p: [(laid(k, dtype, p), laid(v, dtype, p)) for k, v in caches] for p in pages}
            qd = q.to(dtype)
            read = int(ctx.sum()) * KV_HEADS * D * 2 * qd.element_size() * LAYERS
            runs = [(f"{name}{'' if len(pages) == 1 else f', {p} pages'}", lib, pools[p])
                    for name, lib in libs.items() for p in pages]
            times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
            for _ in range(a.calls):
                for name, lib, layers in runs:
                    native_attention._LIB = lib
                    t = time.perf_counter()
                    for k, v in layers:
                        out = native_attention.decode(qd, k, v, blocks, ctx, BS, None)
                    times[name].append(time.perf_counter() - t)
                    if out is None:
                        raise SystemExit(f"{name} does not take {dtype}")
            cells = "; ".join(f"{name} {statistics.median(ts[5:]) * 1e3:.3f} ms "
                              f"({read / statistics.median(ts[5:]) / 1e9:.1f} GB/s)" for name, ts in times.items())
            print(f"{rows} rows of {lo}-{hi}, {str(dtype).removeprefix('torch.')}, {LAYERS} layers "
                  f"({read / 1e6:.0f} MB of K/V): {cells}", flush=True)


def laid(t: torch.Tensor, dtype: torch.dtype, pages: str) -> torch.Tensor:
    """`t` in `dtype`, copied into memory on 2 MB or 4 KB pages (huge_pages.empty)."""
    out, _ = huge_pages.empty(tuple(t.shape), dtype, huge=pages == "huge")
    return out.copy_(t)


if __name__ == "__main__":
    main()
