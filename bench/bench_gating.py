"""The SiLU-gating pass (`silu_mul` of scheduler/model/_elementwise.c) right after its gate/up
GEMM, as the forward runs it, one thread.

In the forward the gating reads a GEMM's output that the GEMM's own traffic has pushed out of the
near caches; timed alone on one input it reads it from cache and looks 2-3x faster than it is
in the forward (bench_forward.py's `act` against its `shape ms`). So each call here follows a
fresh gate/up GEMM (the engine's GEMM on the default preset's reordered weight: 512 -> 2 x 1536)
at 569, 128 and 57 rows (a prefill-heavy round, a full decode round, a median one), into a fresh
output as the layer allocates it. Builds are alternated call by call, so each sees the same
machine, and their outputs are checked equal; each ratio is the median of a build's calls over
the first build's calls of the same turn. Without `--lib` the installed build alone.
`--fresh-copy` also times the installed build on a copy of the GEMM's output made just before
(in cache): what the GEMM's traffic costs the pass. Where the gate/up GEMM does the gating in its
own pass (the AMX kernel, bfloat16), there is no pass of its own to time, and the bench says so.

    .venv/bin/python bench/bench_gating.py [--lib A.so --lib B.so] [--dtype bfloat16] [--calls 40] [--torch]

`--torch` also times torch's two ops (`F.silu(gate) * up`), what the forward runs where the C
pass steps aside. Where torch runs its AVX2 kernels (no AVX-512) the float32 builds run their
AVX2 pass (`silu_mul8`) with torch's AVX2 exp.

Build another revision's to compare:

    mkdir -p /tmp/e && for f in _elementwise.c _vec.h _kernels.h _torch_avx512.h; do
        git show REV:scheduler/model/$f > /tmp/e/$f; done
    gcc -O3 -ffp-contract=off -fno-wrapv -shared -fPIC \\
        -I"$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" /tmp/e/_elementwise.c -o /tmp/e.so -lm

(pyproject.toml's flags for this extension; the installed build is one of them.)
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from common import REPO, alternated

sys.path.insert(0, str(REPO))
from scheduler.model import native_elementwise, packed_gemm  # noqa: E402
from scheduler.model.native_attention import open_library  # noqa: E402

HIDDEN, INTER = 512, 1536  # the default preset's
ROWS = (569, 128, 57)


def entry(lib: ctypes.CDLL, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A build's gating as the forward calls it (its output allocated per call), with torch's exp
    of the width torch runs here."""
    avx2 = native_elementwise.EXPF16 is None
    name = "silu_mul8" if avx2 else "silu_mul" if dtype == torch.float32 else "silu_mul_bf16"
    fn = getattr(lib, name, None)
    if fn is None:
        raise SystemExit(f"{lib._name} has no {name} (a build from before it)")
    p, n = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [p, n, p, n, n, p], ctypes.c_int
    exp = native_elementwise.EXPF8 if avx2 else native_elementwise.EXPF16

    def gating(gate_up: torch.Tensor) -> torch.Tensor:
        y = torch.empty(gate_up.shape[0], INTER, dtype=gate_up.dtype)
        if fn(gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), gate_up.shape[0], INTER, exp) != 0:
            raise SystemExit("a build refused the call")
        return y
    return gating


def torch_ops(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", type=Path, action="append", default=[], help="a build to time (repeatable)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--calls", type=int, default=40, help="calls of each build per shape (the first 2 not counted)")
    ap.add_argument("--fresh-copy", action="store_true", help="also the installed build on a copy made just before")
    ap.add_argument("--torch", action="store_true", help="also torch's two ops")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    if native_elementwise.EXPF16 is None and (native_elementwise.EXPF8 is None or dtype != torch.float32):
        raise SystemExit(f"torch runs neither AVX-512 kernels here nor, for {a.dtype}, AVX2 ones: the C gating "
                         "steps aside")
    installed = open_library("_elementwise") if a.fresh_copy or not a.lib else None
    if installed is None and (a.fresh_copy or not a.lib):
        raise SystemExit("no C build installed")
    arms = [(str(p), entry(ctypes.CDLL(str(p.resolve())), dtype), False) for p in a.lib]
    if installed is not None:
        arms.append(("the installed build" + (", on a fresh copy" if a.fresh_copy else ""), entry(installed, dtype),
                     a.fresh_copy))
    if a.torch:
        arms.append(("torch's two ops", torch_ops, False))
    torch.set_num_threads(1)
    packed_gemm.size_primitive_cache()
    g = torch.Generator().manual_seed(0)
    weight = packed_gemm.pack((torch.randn(2 * INTER, HIDDEN, generator=g) * 0.05).to(dtype))
    if packed_gemm.gates(weight):
        raise SystemExit("the gate/up GEMM does the gating in its own pass here: no pass of its own to time")
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
        times: dict[str, list[float]] = {name: [] for name, _, _ in arms}
        outs: dict[str, torch.Tensor] = {}
        for call in range(a.calls):
            for name, fn, copy in arms if call % 2 == 0 else arms[::-1]:
                gate_up = packed_gemm.linear(x, weight, None)
                if copy:
                    gate_up = gate_up.clone()
                t = time.perf_counter()
                y = fn(gate_up)
                times[name].append(time.perf_counter() - t)
                outs[name] = y
        first = next(iter(outs.values()))
        if not all(torch.equal(o.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               first.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                   for o in outs.values()):
            raise SystemExit("the arms' outputs differ")
        print(f"{rows} rows, {a.dtype}: {alternated(times, 2, 1e3, 'ms')}", flush=True)


if __name__ == "__main__":
    main()
