"""RoPE and the KV write (`rope_kv` of scheduler/model/_elementwise.c) alone, cold, one thread.

A decode round stores each row's new K and V rows at one slot of its last block, anywhere in
the KV pool; the pool is far beyond the caches, so every store first reads its line. This
times one layer's call at decode shapes (the default preset's 8 query and 4 KV heads of 64;
16, 57 and 128 rows, each row's slot in a block of its own, drawn from a layer's cache of the
engine's default pool (DEFAULT_KV_TOKENS slots) on 2 MB pages, as the engine lays it), with the
caches pushed out by a 64 MB read before every call, then the qkv rows copied in (the qkv GEMM
leaves them in cache) and the RoPE tables and slots read (a forward's every layer after its
first finds them in cache). Builds are alternated call by call, so each sees the same machine; the
ratio is the median of a build's calls over the first build's calls of the same turn. Without
`--lib` the installed build alone.

    .venv/bin/python bench/bench_rope_kv.py [--lib A.so --lib B.so] [--calls 40]

Another revision's build to compare: as bench_gating.py's docstring builds one (the same extension).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch
from common import REPO, alternated

sys.path.insert(0, str(REPO))
from scheduler.config import DEFAULT_KV_TOKENS  # noqa: E402
from scheduler.model import huge_pages, native_elementwise  # noqa: E402
from scheduler.model.native_attention import open_library  # noqa: E402

HEADS, KV_HEADS, D, BS = 8, 4, 64, 16
ROWS = (16, 57, 128)


def entry(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    fn = lib.rope_kv
    p, n = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [p, n, p, p, n, n, n, n, p, p, p, n], ctypes.c_int
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", type=Path, action="append", default=[], help="a build to time (repeatable)")
    ap.add_argument("--calls", type=int, default=40, help="calls of each build per shape (the first 2 not counted)")
    a = ap.parse_args()
    if a.lib:
        fns = {str(p): entry(ctypes.CDLL(str(p.resolve()))) for p in a.lib}
    else:
        lib = open_library("_elementwise")
        if lib is None or not native_elementwise.AVAILABLE:
            raise SystemExit("no C build installed")
        fns = {"installed": entry(lib)}
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    slots_total = DEFAULT_KV_TOKENS  # one layer's K (and V) cache
    k_cache, _ = huge_pages.empty((slots_total, KV_HEADS, D), torch.float32)
    v_cache, _ = huge_pages.empty((slots_total, KV_HEADS, D), torch.float32)
    k_cache.zero_()
    v_cache.zero_()
    on_huge, _ = huge_pages.backed([huge_pages.span(k_cache), huge_pages.span(v_cache)])
    print(f"one layer's caches: {slots_total} slots, {2 * k_cache.nbytes / 2**20:.0f} MB, "
          f"{on_huge / 2**20:.0f} MB of it on 2 MB pages")
    flush = torch.randn(16 * 2**20)  # 64 MB: past the last-level cache
    for rows in ROWS:
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * D, generator=g)
        cos, sin = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
        blocks = torch.randperm(slots_total // BS, generator=g)[:rows]
        slots = (blocks * BS + torch.randint(0, BS, (rows,), generator=g)).contiguous()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for call in range(a.calls):
            order = list(fns.items())
            for name, fn in order if call % 2 == 0 else reversed(order):
                flush.sum()
                q = qkv.clone()  # in cache, as the qkv GEMM leaves its output
                cos.sum(), sin.sum(), slots.sum()  # in cache, as after a forward's first layer
                t = time.perf_counter()
                status = fn(q.data_ptr(), q.stride(0), cos.data_ptr(), sin.data_ptr(), rows, HEADS, KV_HEADS, D,
                            k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), slots_total)
                times[name].append(time.perf_counter() - t)
                if status != 0:
                    raise SystemExit(f"{name} refused the call")
        print(f"{rows} rows: {alternated(times, 2, 1e6, 'us')}", flush=True)


if __name__ == "__main__":
    main()
