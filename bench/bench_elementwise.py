"""The C RMSNorm and RoPE (scheduler/model/_elementwise.c), or with `--library attention` the
C decode attention (_attention.c), against torch's ops, inside the default preset's whole
forward, one thread: decode batches (16 rows of 128-191 tokens, bench_serve_peer.py's; 57
rows of 16-768, the decode-heavy rounds' mean in bench_engine_vs_hf.py's workload) and one
512-token prefill chunk, the C path on and off alternated in one process (the module's `_LIB`
set to None switches it off, as an install without a compiler has it; attention then
gathers each row's context and runs SDPA). `--library joins` switches off only the layer's
two joins (`add_rms_norm`, `rope_kv`): off is the op sequence before them, the residual add
and index_copy_ in torch around the C RMSNorm and RoPE.

    .venv/bin/python bench/bench_elementwise.py --repeats 15 [--dtype bfloat16] [--library attention|joins]
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
    ap.add_argument("--library", default="elementwise", choices=("elementwise", "attention", "joins"))
    a = ap.parse_args()
    owner = native_attention if a.library == "attention" else native_elementwise
    if not owner.AVAILABLE:
        raise SystemExit(f"scheduler/model/_{'attention' if a.library == 'attention' else 'elementwise'}.c "
                         "is not built here")
    lib, fns = owner._LIB, dict(native_elementwise._FNS)
    joins = {k for k in fns if k[0] in ("add_rms_norm", "rope_kv")}
    if a.library == "joins" and len(joins) < 4:
        raise SystemExit("this build of _elementwise.c has no joins (rebuild: pip install -e .)")

    def use(on: bool) -> None:
        if a.library != "joins":
            owner._LIB = lib if on else None
            return
        native_elementwise._FNS.clear()
        native_elementwise._FNS.update({k: f for k, f in fns.items() if on or k not in joins})

    torch.set_num_threads(1)
    model, _ = load_model(ensure_preset("default"), "cpu", getattr(torch, a.dtype))
    bs = 16
    kv = model.make_kv_cache(4000, bs)
    g = torch.Generator().manual_seed(0)
    used = 0
    batches = {}
    for rows, lo, hi in ((16, 128, 192), (57, 16, 768)):
        chunks = []
        for _ in range(rows):
            ctx = int(torch.randint(lo, hi, (1,), generator=g))
            table = list(range(used, used + ctx // bs + 1))
            used += len(table)
            chunks.append(SeqChunk([int(torch.randint(5, 500, (1,), generator=g))], ctx, table, True))
        batches[f"decode, {rows} rows"] = build_forward_batch(chunks, bs, "cpu")
    prompt = torch.randint(5, 500, (512,), generator=g).tolist()
    batches["prefill, 512 tokens"] = build_forward_batch([SeqChunk(prompt, 0, list(range(used, used + 33)), True)],
                                                         bs, "cpu")
    with torch.inference_mode():
        for name, fb in batches.items():
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(3):
                model(fb, kv)
            for _ in range(a.repeats):
                for on in (True, False):
                    use(on)
                    t = time.perf_counter()
                    model(fb, kv)
                    times[on].append(time.perf_counter() - t)
            use(True)
            c, t_ = statistics.median(times[True]), statistics.median(times[False])
            yes, no = ("joined", "apart") if a.library == "joins" else ("C", "torch")
            print(f"{name}: {yes} {c * 1e3:.2f} ms, {no} {t_ * 1e3:.2f} ms (medians of {a.repeats}), "
                  f"{yes} / {no} {c / t_:.3f}")


if __name__ == "__main__":
    main()
