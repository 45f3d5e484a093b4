"""The projections' GEMM on the CPU: each weight reordered once into oneDNN's blocked layout,
or `F.linear` on the weight as the checkpoint lays it out.

Why: `F.linear` hands a [out, in] weight to the BLAS as it lies. In bfloat16, oneDNN then
reorders the weight into its AMX / AVX512 layout at every call: a decode round of 16 rows
re-read and re-wrote every projection's weight to multiply it once. Reordering it once at
load, as torch.compile's freezing and Intel's extension do (`torch.ops.mkldnn`'s
`_reorder_linear_weight` and `_linear_pointwise`, the ops they emit), measured 1.5x on
decode-shaped bfloat16 GEMMs (16 and 64 rows) and 1.2-1.5x in float32 on a Sapphire Rapids
core, 1-20% of the default preset's whole forward (BENCHMARKS.md, "bfloat16 on an AMX core"); MKL's own packed
sgemm only helps at the one row count it was packed for. Whether it pays depends on the CPU
and torch's build, so `--weight-pack auto` times both on decode-shaped GEMMs in the run's
dtype, as `--dtype auto` does.

The reordered weight is an opaque oneDNN tensor that only this GEMM reads; once it is made
the dense one is freed (`free_dense`), so the weights are held once, except an LM head tied to
the embedding, whose dense table the embedding still reads.

In bfloat16 on a CPU with AMX, with one intra-op thread (`--device-threads 1`, the default
on a 2-core machine; the engine sets its threads before the weights load), the weight is
laid out instead for `_amx_gemm.c`'s kernel (a 4-D [N / 16, K / 32, 16, 32] tensor, which is
how `linear` tells the two apart): a decode round's GEMMs stream their weights from cache
faster through it than through oneDNN's (BENCHMARKS.md, "The projections on AMX tiles").
Sizes that are not multiples of 32, other dtypes, more threads or no AMX keep oneDNN's.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scheduler.model import native_elementwise
from scheduler.model.auto_dtype import median_ratio
from scheduler.model.dtypes import name_of
from scheduler.model.native_attention import open_library

# Decode rounds of 16 and 64 rows (the default preset's served and batch sizes) through a
# 512 -> 1536 projection; the ratio, not the time, decides
ROWS, K, N = (16, 64), 512, 1536
REPS = 9  # alternated pairs per shape: the median of their ratios
# Below this the gain is a few percent of a forward (the projections are about half of one).
# Measured as the median ratio of alternated calls, repeated choices on one machine spread by
# under 0.1 (float32 1.30-1.39x, bfloat16 1.48-1.50x on a Sapphire Rapids core); best-of-5 of
# each kernel on its own spread 0.86-1.18x in float32 there and would flip the choice.
MIN_SPEEDUP = 1.1
CHOICES = ("auto", "on", "off")
# oneDNN keeps its GEMM primitives (their JIT-built kernels) in an LRU cache keyed by shape,
# rows included: every distinct token count of a batch is a new primitive for each projection,
# two entries each while new (it holds a nested matmul; a primitive reused keeps its nested one
# alive out of the cache) and about 300-500 KB of memory. The default preset's 128-request
# workload asked for 758 GEMM shapes; in oneDNN's default 1,024 entries a replay of its batches
# rebuilt 733 primitives every pass, 2.3-3.1% of the pass with their page faults
# (BENCHMARKS.md, "oneDNN's primitive cache"). Twice the default holds that workload's: 1,024 to
# 2,047 primitives, 0.3-1 GB at most, where the default holds half as many.
PRIMITIVE_CACHE_CAPACITY = 2048
PRIMITIVE_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")  # oneDNN's order


@dataclass(frozen=True, slots=True)
class PackChoice:
    packed: bool
    why: str  # the trace's meta and the report header say it


def size_primitive_cache() -> None:
    """Ask oneDNN for PRIMITIVE_CACHE_CAPACITY entries, unless the user set the variable (under
    either of the names oneDNN reads). oneDNN reads it once, when the process makes its first
    primitive, so this runs before a process's first GEMM (the engine's dtype and pack probes, a
    model's load); a process that ran one earlier (a notebook's torch work) keeps the capacity
    it had."""
    if not any(name in os.environ for name in PRIMITIVE_CACHE_VARIABLES):
        os.environ[PRIMITIVE_CACHE_VARIABLES[0]] = str(PRIMITIVE_CACHE_CAPACITY)


def primitive_cache_asked() -> str | None:
    """What this process asks oneDNN for, as the trace records it (`2048 entries
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY)`): a run's forward may differ by a few percent with it.
    What was asked, not what took: a process whose oneDNN had started before keeps its own."""
    for name in PRIMITIVE_CACHE_VARIABLES:
        if name in os.environ:
            return f"{os.environ[name]} entries ({name})"
    return None


def unpackable(dtype: torch.dtype) -> str | None:
    """Why weights of `dtype` cannot be reordered here, None where they can: the torch build's
    ops, the dtype, and for bfloat16 the CPU (oneDNN's bfloat16 reorder needs AVX-512 BW, VL
    and DQ, and raises without them); a trial reorder settles what the flags do not."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,  # type: ignore[no-untyped-call]
                                                              "_reorder_linear_weight")):
        return "this torch build has no oneDNN linear ops"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN's reordered GEMM is not used for {name_of(dtype)}"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 GEMM on this CPU"
    try:
        pack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as e:
        return f"oneDNN cannot reorder {name_of(dtype)} weights here ({str(e).splitlines()[0][:120]})"
    return None


def _load_amx() -> ctypes.CDLL | None:
    """The AMX kernel where it is built and this CPU and process can run it, else None."""
    lib = open_library("_amx_gemm")
    if lib is None or not hasattr(lib, "amx_linear"):
        return None
    p, n = ctypes.c_void_p, ctypes.c_int64
    lib.amx_ready.argtypes, lib.amx_ready.restype = [], ctypes.c_int
    lib.amx_pack.argtypes, lib.amx_pack.restype = [p, p, n, n], None
    lib.amx_linear.argtypes, lib.amx_linear.restype = [p, n, p, p, p, n, n, n], ctypes.c_int
    lib.amx_gated.argtypes, lib.amx_gated.restype = [p, n, p, p, p, n, n, n, p], ctypes.c_int
    return lib if lib.amx_ready() == 1 else None


_AMX = _load_amx()
_EXPF16 = native_elementwise.EXPF16 if _AMX is not None else None


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether `pack` lays `weight` out for the AMX kernel (module docstring) on this thread count."""
    return (_AMX is not None and weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.numel() > 0 and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0
            and torch.get_num_threads() == 1)


def kernel_name(dtype: torch.dtype) -> str:
    """Which GEMM `pack` picks for a decode-shaped weight of `dtype` here, as the report says it."""
    return "AMX tiles" if amx_fits(torch.empty(N, K, dtype=dtype)) else "oneDNN"


def pack(weight: torch.Tensor, rows_hint: int = ROWS[-1]) -> torch.Tensor:
    """`weight` [out, in] laid out for `linear`: for the AMX kernel where `amx_fits`, else
    reordered by oneDNN (`rows_hint` picks its blocking); any row count runs."""
    if amx_fits(weight):
        assert _AMX is not None
        w = weight.detach().contiguous()
        laid = torch.empty(w.shape[0] // 16, w.shape[1] // 32, 16, 32, dtype=torch.bfloat16)
        _AMX.amx_pack(w.data_ptr(), laid.data_ptr(), w.shape[0], w.shape[1])
        return laid
    out: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
    return out


def free_dense(weight: torch.Tensor) -> None:
    """Drop a packed weight's dense storage (the parameter stays, empty): only `linear` reads it now."""
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on `pack(weight)`."""
    if packed.dim() == 4:  # the AMX kernel's layout
        assert _AMX is not None
        x2, b, n, k = _amx_operands(x, packed, bias)
        y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
        if _AMX.amx_linear(x2.data_ptr(), x2.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
                           y.data_ptr(), x2.shape[0], n, k) != 0:
            raise RuntimeError(f"the AMX GEMM refused a [{x2.shape[0]}, {k}] x [{n}, {k}] product")
        return y.view(*x.shape[:-1], n)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), packed, bias,
                                                           "none", [], "")
    return out


def gated(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.silu(gate) * up` where `gate, up = linear(x, packed, bias).chunk(2, -1)`, the same bits,
    in one pass of the AMX kernel: the SiLU and the product are computed on each tile's sums
    before they leave the core, so the [rows, 2 x intermediate] output is never written and read
    back. None where that pass does not apply (another layout, or torch's exp not found): the
    caller then runs the ops apart."""
    if not gates(packed):
        return None
    assert _AMX is not None
    x2, b, n, k = _amx_operands(x, packed, bias)
    y = torch.empty(x2.shape[0], n // 2, dtype=torch.bfloat16)
    if _AMX.amx_gated(x2.data_ptr(), x2.stride(0), packed.data_ptr(), None if b is None else b.data_ptr(),
                      y.data_ptr(), x2.shape[0], n, k, _EXPF16) != 0:
        raise RuntimeError(f"the AMX GEMM refused a [{x2.shape[0]}, {k}] x [{n}, {k}] gating")
    return y.view(*x.shape[:-1], n // 2)


def gates(packed: torch.Tensor) -> bool:
    """Whether `gated` runs on this packed gate/up weight (else the caller runs the ops apart)."""
    return packed.dim() == 4 and _EXPF16 is not None


def _amx_operands(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
    """x as rows of unit stride, the bias contiguous, and the weight's N and K, checked as F.linear would."""
    n, k = packed.shape[0] * 16, packed.shape[1] * 32
    if x.dtype != torch.bfloat16 or (bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,))):
        raise RuntimeError(f"the AMX GEMM takes bfloat16 x and a bfloat16 [{n}] bias, not {x.dtype} x and "
                           f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, None if bias is None else bias.contiguous(), n, k


def speedup(dtype: torch.dtype) -> float:
    """F.linear's time over the reordered weight's, on one thread: the geometric mean over ROWS
    of auto_dtype.median_ratio (REPS alternated calls)."""
    ratios = []
    for m in ROWS:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(m, K, generator=g).to(dtype)
        w = torch.randn(N, K, generator=g).to(dtype)
        p = pack(w)
        ratios.append(median_ratio(lambda: F.linear(x, w), lambda: linear(x, p, None), REPS))  # noqa: B023
    return math.prod(ratios) ** (1 / len(ratios))


@functools.cache
def cpu_pack_speedup(dtype: torch.dtype) -> float:
    """`speedup(dtype)` on one thread, measured once per process, as auto_dtype's
    `cpu_bf16_speedup` is and for its reason: one process's engines run the same GEMMs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ratio is the kernels'; the pool's size is not decided yet
    try:
        return speedup(dtype)
    finally:
        torch.set_num_threads(threads)


def choose_pack(device: torch.device, dtype: torch.dtype, asked: str) -> PackChoice:
    """Whether the CPU model's projections run on reordered weights: as asked (`on` where they
    can be, `unpackable`), or, for `auto`, where they measured MIN_SPEEDUP times F.linear's
    speed in `dtype` (`speedup`)."""
    if asked not in CHOICES:
        raise ValueError(f"--weight-pack must be one of {', '.join(CHOICES)}, not {asked!r}")
    if device.type != "cpu":
        return PackChoice(False, "off: the GPU's GEMMs take the weights as they are")
    if asked == "off":
        return PackChoice(False, "off: asked")
    why_not = unpackable(dtype)
    if why_not is not None:
        return PackChoice(False, f"off: {why_not}")
    if asked == "on":
        return PackChoice(True, "on: asked")
    ratio, kernel = cpu_pack_speedup(dtype), kernel_name(dtype)
    on = ratio >= MIN_SPEEDUP
    rows = " and ".join(str(m) for m in ROWS)
    return PackChoice(on, f"auto: {'on' if on else 'off'}, {name_of(dtype)} GEMMs of {rows} rows x {K} x {N} on the "
                          f"reordered weight ({kernel}, one thread) measured {ratio:.2f}x F.linear's speed "
                          "on this CPU")
