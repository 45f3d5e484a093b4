"""Prefill attention alone (scheduler/model/_prefill_attention.c against torch's SDPA), one
thread, on the default preset's heads (8 query, 4 KV, head size 64). Each batch is built as
the engine builds one (SeqChunks on shuffled 16-token blocks through build_forward_batch and
plan_attention) and runs through `layers.paged_attention` as a forward's 8 layers do, each
layer with its own cache:

- "one 512": a single 512-token prompt;
- "16 prompts": sixteen new prompts of 16-512 tokens (a prefill-heavy round of
  bench_engine_vs_hf's workload, whose 128 requests arrive together);
- "chunked": four 256-token chunks after 256-768 tokens of context (a long prompt's later
  chunks under --chunk-size).

Variants, timed call by call in turn so each sees the same machine: "sdpa" (the path without
the C extension: a call per chunk, masks and gathers), then every build of the kernel this CPU
runs (`auto` is the one the engine picks). GFLOP/s counts each query's causal keys only.

    .venv/bin/python bench/bench_prefill_attention.py [--calls 15] [--dtype bfloat16] [--lib OTHER.so]

`--lib` times another build (its `auto` pick) beside the installed ones, call by call, as
bench_decode_kernel.py's does; build another revision's as that file's docstring says, with
_prefill_attention.c, _prefill_tile.h and _vec.h. The installed build has setuptools' flags
(Python's, -fwrapv among them), so to compare two revisions' code build both that way and
pass both with `--lib`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import REPO

sys.path.insert(0, str(REPO))
from scheduler.model import native_attention  # noqa: E402
from scheduler.model.forward_batch import SeqChunk, build_forward_batch  # noqa: E402
from scheduler.model.layers import paged_attention, plan_attention  # noqa: E402

BS, HEADS, KV_HEADS, D, LAYERS = 16, 8, 4, 64, 8


def loads(g: torch.Generator) -> dict[str, list[tuple[int, int]]]:
    """(start, n) chunks of each load"""
    lens = torch.randint(16, 513, (16,), generator=g).tolist()
    ctx = torch.randint(256, 769, (4,), generator=g).tolist()
    return {"one 512": [(0, 512)], "16 prompts": [(0, n) for n in lens], "chunked": [(c, 256) for c in ctx]}


def time_load(name: str, spec: list[tuple[int, int]], g: torch.Generator, builds: list[str], calls: int,
              dtype: torch.dtype, libs: dict[str, Any]) -> None:
    chunks, used = [], 0
    for start, n in spec:
        nblk = (start + n + BS - 1) // BS
        chunks.append(SeqChunk(torch.randint(5, 500, (n,), generator=g).tolist(), start,
                               list(range(used, used + nblk)), True))
        used += nblk
    perm = torch.randperm(used, generator=g).tolist()  # the blocks scattered over the cache
    for c in chunks:
        c.block_table = [perm[b] for b in c.block_table]
    batch = build_forward_batch(chunks, BS, "cpu")
    t = batch.num_tokens
    q = torch.randn(t, HEADS + 2 * KV_HEADS, D, generator=g).to(dtype)[:, :HEADS]
    kn = torch.randn(t, KV_HEADS, D, generator=g).to(dtype)
    caches = [(torch.randn(used * BS, KV_HEADS, D, generator=g).to(dtype),
               torch.randn(used * BS, KV_HEADS, D, generator=g).to(dtype)) for _ in range(LAYERS)]
    native = plan_attention(batch, None, dtype, D)
    assert native.prefill_keys is not None
    slots, meta = native.prefill_keys
    saved = native_attention._PREFILL
    native_attention._PREFILL = None
    try:
        plain = plan_attention(batch, None, dtype, D)  # masks, as without the extension
    finally:
        native_attention._PREFILL = saved

    def sdpa() -> None:
        native_attention._PREFILL = None
        try:
            for kc, vc in caches:
                paged_attention(q, kn, kn, kc, vc, batch, plain)
        finally:
            native_attention._PREFILL = saved

    def build(isa: str, lib: Any = saved) -> Callable[[], None]:
        def call() -> None:
            native_attention._PREFILL = lib
            try:
                for kc, vc in caches:
                    assert native_attention.prefill(q, kc, vc, slots, meta, t, None, isa) is not None
            finally:
                native_attention._PREFILL = saved
        return call

    variants = {"sdpa": sdpa, **{b: build(b) for b in builds}, **{n: build("auto", lib) for n, lib in libs.items()}}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(calls):
        for v, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                times[v].append(time.perf_counter() - t0)
    flops = 4.0 * HEADS * D * sum(start * n + n * (n + 1) / 2 for start, n in spec) * LAYERS
    base = statistics.median(times["sdpa"])
    cells = []
    for v, ts in times.items():
        med = statistics.median(ts)
        cells.append(f"{v} {med * 1e3:.2f} ms {flops / med / 1e9:.1f} GFLOP/s ({base / med:.2f}x)")
    print(f"{name} ({len(spec)} chunks, {t} tokens, {flops / 1e9:.2f} GFLOP): " + "; ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=15, help="calls of each variant per load (the first 3 not counted)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--lib", type=Path, action="append", default=[],
                    help="another build of _prefill_attention.c to time beside the installed one (repeatable)")
    a = ap.parse_args()
    libs = {str(path): native_attention._load_prefill(path) for path in a.lib}
    for path, lib in libs.items():
        if lib is None:
            raise SystemExit(f"--lib {path}: not a loadable build of _prefill_attention.c")
    if not native_attention.prefill_runs("auto"):
        raise SystemExit("the engine runs SDPA here: no _prefill_attention build, or a CPU without AVX2 + FMA")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    builds = [i for i in ("auto", "avx512", "avx2", "baseline") if native_attention.prefill_runs(i)]
    print(f"one thread, {a.dtype}; heads {HEADS}/{KV_HEADS}, head size {D}, {LAYERS} layers a call; builds this CPU runs: "
          f"{', '.join(builds)}")
    for name, spec in loads(g).items():
        time_load(name, spec, g, builds, a.calls, getattr(torch, a.dtype), libs)


if __name__ == "__main__":
    main()
