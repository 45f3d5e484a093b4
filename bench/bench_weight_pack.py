"""The default preset's forward with its projections on weights reordered once for oneDNN's GEMM
(`--weight-pack on`, scheduler/model/packed_gemm.py) against `F.linear` (`off`), one thread,
the two models alternated forward by forward in one process so both see the same machine.

    .venv/bin/python bench/bench_weight_pack.py --repeats 15
    .venv/bin/python bench/bench_weight_pack.py --profile   # where each forward's time goes, off and on

Batches: decode rounds of 16 and 64 rows (contexts 128-192: bench_serve_peer's and
bench_engine_vs_hf's decode sizes) and prefill chunks of 128 and 512 tokens, in float32 and,
where this CPU computes it natively, bfloat16 (what `--dtype auto` picks there). Prints each
batch's medians and their ratio, and the GEMM that `--weight-pack auto` times at start-up.
Where bfloat16's packed weights go to the AMX kernel (`_amx_gemm.c`: one thread, AMX), a
third model packed for oneDNN (its weights reordered with two threads set) joins the
alternation, and the line adds AMX / oneDNN; where the AMX kernel also does the MLP's
SiLU-gating in its pass (`packed_gemm.gated`), the AMX model runs once more with the gating as
torch's ops after the GEMM, and the line adds the ratio of the two. All of these run the
decoder layers in Python; where the engine runs a decode round's layers in one C call
(scheduler/model/native_layers.py), the AMX model runs once more that way, and the line adds
its ratio to the same model's layers in Python.
`--profile` prints instead, per batch and setting, torch.profiler's top ops over ten forwards
beside the forward's wall time (the C kernels, called through ctypes, are not torch ops: the
wall time less the ops' is theirs and Python's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from common import REPO, python_layers

sys.path.insert(0, str(REPO))
from scheduler.model import native_elementwise, packed_gemm  # noqa: E402
from scheduler.model.auto_dtype import choose_dtype  # noqa: E402
from scheduler.model.forward_batch import ForwardBatch, SeqChunk, build_forward_batch  # noqa: E402
from scheduler.model.loader import load_model  # noqa: E402
from scheduler.model.presets import ensure_preset  # noqa: E402

BS = 16


def batches(g: torch.Generator) -> dict[str, ForwardBatch]:
    out, used = {}, 0
    for rows in (16, 64):
        chunks = []
        for _ in range(rows):
            ctx = int(torch.randint(128, 192, (1,), generator=g))
            table = list(range(used, used + ctx // BS + 1))
            used += len(table)
            chunks.append(SeqChunk([int(torch.randint(5, 500, (1,), generator=g))], ctx, table, True))
        out[f"decode, {rows} rows"] = build_forward_batch(chunks, BS, "cpu")
    for n in (128, 512):
        prompt = torch.randint(5, 500, (n,), generator=g).tolist()
        out[f"prefill, {n} tokens"] = build_forward_batch([SeqChunk(prompt, 0, list(range(used, used + n // BS)), True)],
                                                          BS, "cpu")
        used += n // BS
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", action="store_true", help="torch.profiler's top ops per batch instead of the A/B")
    a = ap.parse_args()
    torch.set_num_threads(1)
    folder = ensure_preset("default")
    dtypes = [torch.float32] + ([torch.bfloat16] if choose_dtype(torch.device("cpu"), None).dtype == torch.bfloat16
                                else [])
    for dtype in dtypes:
        if packed_gemm.unpackable(dtype) is not None:
            raise SystemExit(f"{dtype}: {packed_gemm.unpackable(dtype)}")
    for dtype in dtypes:
        print(choose_pack_line(dtype), flush=True)
        plain, _ = load_model(folder, "cpu", dtype)
        packed, _ = load_model(folder, "cpu", dtype, pack=True)
        models = {"off": plain, "on": packed}
        if packed.layers[0].packs["qkv_proj"].dim() == 4:  # the AMX layout: oneDNN's beside it
            torch.set_num_threads(2)
            models["oneDNN"], _ = load_model(folder, "cpu", dtype, pack=True)
            torch.set_num_threads(1)
        gating = packed_gemm.gates(packed.layers[0].packs["gate_up_proj"])
        kv = plain.make_kv_cache(2000, BS)
        with torch.inference_mode():
            for name, fb in batches(torch.Generator().manual_seed(0)).items():
                if a.profile:
                    for key, model in (("off", plain), ("on", packed)):
                        profile(f"{str(dtype).removeprefix('torch.')}, {name}, --weight-pack {key}", model, fb, kv)
                    continue
                times: dict[str, list[float]] = {k: [] for k in models}
                for _ in range(3):
                    for model in models.values():
                        model(fb, kv)
                for _ in range(a.repeats):
                    with python_layers():  # the layouts compared under the same Python layers
                        for key, model in models.items():
                            t = time.perf_counter()
                            model(fb, kv)
                            times[key].append(time.perf_counter() - t)
                        if gating:  # the AMX model again, its SiLU-gating as torch's ops after the GEMM
                            saved = packed_gemm._EXPF16, native_elementwise.EXPF16
                            packed_gemm._EXPF16 = native_elementwise.EXPF16 = None  # not the C pass either
                            try:
                                t = time.perf_counter()
                                packed(fb, kv)
                                times.setdefault("apart", []).append(time.perf_counter() - t)
                            finally:
                                packed_gemm._EXPF16, native_elementwise.EXPF16 = saved
                    if packed.decode_weights is not None:  # the AMX model as the engine runs it
                        t = time.perf_counter()
                        packed(fb, kv)
                        times.setdefault("one call", []).append(time.perf_counter() - t)
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                amx = (f"; AMX / oneDNN {med['on'] / med['oneDNN']:.3f} (oneDNN {med['oneDNN']:.2f} ms)"
                       if "oneDNN" in med else "")
                if gating:
                    amx += f"; gating in the GEMM / apart {med['on'] / med['apart']:.3f} (apart {med['apart']:.2f} ms)"
                if "one call" in med:
                    amx += (f"; the engine's forward (a decode round's layers in one C call) / the layers in "
                            f"Python {med['one call'] / med['on']:.3f} ({med['one call']:.2f} ms)")
                print(f"  {str(dtype).removeprefix('torch.')}, {name}: on {med['on']:.2f} ms, off {med['off']:.2f} ms "
                      f"(medians of {a.repeats}), on / off {med['on'] / med['off']:.3f}{amx}", flush=True)


def profile(label: str, model: torch.nn.Module, fb: ForwardBatch, kv: object, calls: int = 10) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        model(fb, kv)
    t = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            model(fb, kv)
    wall = (time.perf_counter() - t) / calls * 1e3
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) / calls / 1e3
    top = ", ".join(f"{e.key} {e.self_cpu_time_total / calls / 1e3:.2f}" for e in ops[:6])
    print(f"  {label}: forward {wall:.2f} ms (profiled), torch ops {total:.2f} ms: {top}", flush=True)


def choose_pack_line(dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}: --weight-pack {packed_gemm.choose_pack(torch.device('cpu'), dtype, 'auto').why}"


if __name__ == "__main__":
    main()
