"""The C RMSNorm and RoPE (scheduler/model/_elementwise.c), or with `--library attention` the
C decode attention (_attention.c), against torch's ops, inside the default preset's whole
forward, one thread: a decode batch (57 rows, contexts 16-768, the decode-heavy rounds' mean
in bench_engine_vs_hf.py's workload) and one 512-token prefill chunk, the C path on and off
alternated in one process (the module's `_LIB` set to None switches it off, as an install
without a compiler has it; attention then gathers each row's context and runs SDPA).

    .venv/bin/python bench/bench_elementwise.py --repeats 15 [--dtype bfloat16] [--library attention]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from scheduler.model import native_attention, native_elementwise
from scheduler.model.forward_batch import SeqChunk, build_forward_batch
from scheduler.model.loader import load_model
from scheduler.model.presets import ensure_preset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--library", default="elementwise", choices=("elementwise", "attention"))
    a = ap.parse_args()
    owner = native_elementwise if a.library == "elementwise" else native_attention
    if not owner.AVAILABLE:
        raise SystemExit(f"scheduler/model/_{a.library}.c is not built here")
    torch.set_num_threads(1)
    model, _ = load_model(ensure_preset("default"), "cpu", getattr(torch, a.dtype))
    bs = 16
    kv = model.make_kv_cache(4000, bs)
    g = torch.Generator().manual_seed(0)
    chunks, used = [], 0
    for _ in range(57):
        ctx = int(torch.randint(16, 768, (1,), generator=g))
        table = list(range(used, used + ctx // bs + 1))
        used += len(table)
        chunks.append(SeqChunk([int(torch.randint(5, 500, (1,), generator=g))], ctx, table, True))
    prompt = torch.randint(5, 500, (512,), generator=g).tolist()
    batches = {"decode, 57 rows": build_forward_batch(chunks, bs, "cpu"),
               "prefill, 512 tokens": build_forward_batch([SeqChunk(prompt, 0, list(range(used, used + 33)), True)],
                                                          bs, "cpu")}
    lib = owner._LIB
    with torch.inference_mode():
        for name, fb in batches.items():
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(3):
                model(fb, kv)
            for _ in range(a.repeats):
                for on in (True, False):
                    owner._LIB = lib if on else None
                    t = time.perf_counter()
                    model(fb, kv)
                    times[on].append(time.perf_counter() - t)
            owner._LIB = lib
            c, t_ = statistics.median(times[True]), statistics.median(times[False])
            print(f"{name}: C {c * 1e3:.2f} ms, torch {t_ * 1e3:.2f} ms (medians of {a.repeats}), C / torch {c / t_:.3f}")


if __name__ == "__main__":
    main()
