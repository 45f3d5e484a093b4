"""The projections' GEMM on the CPU: each weight reordered once into oneDNN's blocked layout,
or `F.linear` on the weight as the checkpoint lays it out.

Why: `F.linear` hands a [out, in] weight to the BLAS as it lies. In bfloat16, oneDNN then
reorders the weight into its AMX / AVX512 layout at every call: a decode round of 16 rows
re-read and re-wrote every projection's weight to multiply it once. Reordering it once at
load, as torch.compile's freezing and Intel's extension do (`torch.ops.mkldnn`'s
`_reorder_linear_weight` and `_linear_pointwise`, the ops they emit), measured 2.8-4x on
decode-shaped bfloat16 GEMMs and 1.2-1.9x in float32 on a Sapphire Rapids core (BENCHMARKS.md,
"Weights reordered once"); MKL's own packed sgemm only helps at the one row count it was packed
for. Whether it pays depends on the CPU and torch's build, so `--weight-pack auto` times both
on a decode-shaped GEMM in the run's dtype, as `--dtype auto` does.

The reordered weight is an opaque oneDNN tensor that only this GEMM reads; the dense one stays
in the model (the loader, tied embeddings and the tests read it), so packing holds the
projections' weights twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scheduler.model.dtypes import name_of

# A default-preset decode round (64 rows) through a 512 -> 1536 projection, as --dtype auto times
SHAPE = (64, 512, 1536)
# The projections are about half a forward, so below this the gain is a few percent of it
# (float32 here: 1.2x on the GEMM, 2-6% of the forward), not worth a second copy of the
# weights; and float32's ratio, 0.86-1.18x in repeated measurements on one machine, would
# flip the choice from run to run. bfloat16 measured 1.45-1.56x there.
MIN_SPEEDUP = 1.3
CHOICES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class PackChoice:
    packed: bool
    why: str  # the trace's meta and the report header say it


def available() -> bool:
    """Whether this torch build has oneDNN's reorder and its GEMM on the reordered weight."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn,  # type: ignore[no-untyped-call]
                                                                  "_reorder_linear_weight")


def pack(weight: torch.Tensor, rows_hint: int = SHAPE[0]) -> torch.Tensor:
    """`weight` [out, in] reordered for `linear`; `rows_hint` picks the blocking, any row count runs."""
    out: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on `pack(weight)`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), packed, bias,
                                                           "none", [], "")
    return out


def _seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """The best of `reps` calls after one warm-up, as --dtype auto times its GEMMs."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def choose_pack(device: torch.device, dtype: torch.dtype, asked: str) -> PackChoice:
    """Whether the CPU model's projections run on reordered weights: as asked (`on` where the
    build has the ops), or, for `auto`, where they measured MIN_SPEEDUP times F.linear's speed
    on SHAPE in `dtype`, on one thread (as --dtype auto measures)."""
    if asked not in CHOICES:
        raise ValueError(f"--weight-pack must be one of {', '.join(CHOICES)}, not {asked!r}")
    if device.type != "cpu":
        return PackChoice(False, "off: the GPU's GEMMs take the weights as they are")
    if asked == "off":
        return PackChoice(False, "off: asked")
    if not available():
        return PackChoice(False, "off: this torch build has no oneDNN linear ops")
    if dtype not in (torch.float32, torch.bfloat16):
        return PackChoice(False, f"off: oneDNN's reordered GEMM is not used for {name_of(dtype)}")
    if asked == "on":
        return PackChoice(True, "on: asked")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, k, n = SHAPE
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        p = pack(w)
        speedup = _seconds(lambda: F.linear(x, w)) / _seconds(lambda: linear(x, p, None))
    finally:
        torch.set_num_threads(threads)
    on = speedup >= MIN_SPEEDUP
    return PackChoice(on, f"auto: {'on' if on else 'off'}, a {m}x{k}x{n} {name_of(dtype)} GEMM on the reordered "
                          f"weight measured {speedup:.2f}x F.linear's speed on this CPU")
