"""What `--dtype auto` runs in: bfloat16 where the device computes it fast, else float32.

bfloat16 halves the bytes every weight and KV read moves, but a CPU without bfloat16 matrix
instructions (AVX512-BF16, AMX) widens it to float32 inside the GEMM and is slower than float32
itself. The CPU's flags say what the ISA has, not what torch's kernels use on it (oneDNN may
skip an instruction set, a VM may hide one), so the choice times a decode-shaped GEMM in both
dtypes and records the flags beside the measurement.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from scheduler.model.dtypes import name_of

# A default-preset decode round (64 rows) through a 512 -> 1536 projection (the fused
# gate/up is 512 -> 3072; the ratio, not the time, decides).
SHAPE = (64, 512, 1536)
# Native bfloat16 GEMMs measured 2.3-4x float32 (AVX512-BF16, AMX); emulated ones far below
# 1x (0.04-0.07x on an AVX2 EPYC). Between the two is neither, and float32 is the exact choice.
MIN_SPEEDUP = 1.5
# An emulated bfloat16 GEMM of SHAPE takes a quarter second (0.5 GFLOP/s on an AVX2 machine),
# which every run would pay: a small GEMM first, and the decode shape only where bfloat16 is
# not plainly emulated there.
SCREEN, SCREEN_BELOW = (16, 256, 256), 0.5
_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86; aarch64 says "bf16"


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    dtype: torch.dtype
    why: str  # the trace's meta and the report header say it


def pick(bf16_speedup: float) -> torch.dtype:
    return torch.bfloat16 if bf16_speedup >= MIN_SPEEDUP else torch.float32


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The bfloat16 matrix flags the CPU reports ([] where /proc/cpuinfo does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            have = set(line.partition(":")[2].split())
            return [f for f in _FLAGS if f in have]
    return []


def median_ratio(a: Callable[[], object], b: Callable[[], object], reps: int = 7) -> float:
    """a's time over b's: the median over `reps` calls of each, alternated after a warm-up
    call of each, so a moment the machine is busy slows both sides of a pair. Best-of-three
    of each timed apart read a loaded machine's bfloat16 as emulated often enough to flip
    a run's dtype; the median of alternated pairs does not move that far."""
    a(), b()
    ratios = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        ratios.append((t1 - t0) / (time.perf_counter() - t1))
    return statistics.median(ratios)


def bf16_speedup(shape: tuple[int, int, int]) -> float:
    """float32's time over bfloat16's for a GEMM of `shape` (m, k, n) as the model runs it,
    F.linear on an [n, k] weight."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    return median_ratio(lambda: F.linear(x, w), lambda: F.linear(xb, wb))


@functools.cache
def cpu_bf16_speedup() -> tuple[tuple[int, int, int], float]:
    """The shape timed and float32's time over bfloat16's on it, measured once per process:
    the CPU and torch's build do not change while it runs, and the engines of one process
    (`mstrace run --mode all`'s three, a test's two) must compute alike. Measured anew for
    each, a loaded moment tipped one of two engines to the other dtype (or, through
    packed_gemm's choice, the other GEMM) and a seeded request's tokens diverged."""
    # One thread: the ratio is the instruction set's, and the pool's size is not decided yet.
    # The setting is the process's; this runs as the engine is built, before anything of it
    # runs torch.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = SCREEN
        speedup = bf16_speedup(shape)
        if speedup >= SCREEN_BELOW:
            shape = SHAPE
            speedup = bf16_speedup(shape)
    finally:
        torch.set_num_threads(threads)
    return shape, speedup


def choose_dtype(device: torch.device, asked: torch.dtype | None) -> DtypeChoice:
    """The dtype to run in: what was asked, else bfloat16 on CUDA, else the CPU's measured choice."""
    if asked is not None:
        return DtypeChoice(asked, "asked")
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "auto: bfloat16 on CUDA")
    shape, speedup = cpu_bf16_speedup()
    dtype = pick(speedup)
    flags = ", ".join(cpu_flags()) or "none of " + ", ".join(_FLAGS)
    m, k, n = shape
    return DtypeChoice(dtype, f"auto: {name_of(dtype)}, a {m}x{k}x{n} "
                              f"bfloat16 GEMM measured {speedup:.2f}x float32's speed on this CPU "
                              f"(CPU flags: {flags})")
