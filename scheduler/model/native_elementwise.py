"""RMSNorm and RoPE in one pass each, and the joins a decoder layer makes around its
GEMMs (`_elementwise.c`), loaded with ctypes where the install built it:
- `add_rms_norm`: the residual add and the RMSNorm after it;
- `rope_kv`: RoPE on a qkv GEMM's q and k, then its k and v rows stored in the KV cache;
- `silu_mul`: the SiLU-gating of a gate/up GEMM's output, where torch runs its AVX-512 kernels,
  or its AVX2 ones in float32 (the bits are then `F.silu(gate) * up`'s: it calls torch's own
  exp, `torch_expf16` or `torch_expf8`);
- `argmax`: the greedy sampler's pick, each row's index of its largest logit, as torch's argmax.

Each function takes float32 or bfloat16 CPU tensors (all of one dtype; `argmax` float32 only)
in the layouts the forward makes and returns None (or False) for anything else, or where the
extension is absent: `layers` (`sampling` for `argmax`) then runs the torch expression, which
gives the same values up to float32 rounding (tests/test_native_elementwise.py checks the two
agree; bfloat16 rounds where torch's bfloat16 ops do).

Why the joins: in a decode round of 16 rows a small op costs its call (Python, the
dispatcher, an allocation, all slower right after a GEMM has streamed its weights through
the caches) more than its arithmetic; one call for what had been three ops saves those
calls. Measured: 1.6-2.5% of such a forward, nothing on larger batches (BENCHMARKS.md,
"The decoder layer's joins").
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from scheduler.model.native_attention import open_library

_P = ctypes.c_void_p
_N = ctypes.c_int64


def _load() -> ctypes.CDLL | None:
    lib = open_library("_elementwise")
    if lib is None:
        return None
    kinds = {"rms_norm": ([_P, _N, _P, _P, _N, _N, ctypes.c_float], None),
             "rope": ([_P, _N, _P, _P, _N, _N, _N], None),
             "add_rms_norm": ([_P, _P, _P, _P, _P, _N, _N, ctypes.c_float], None),
             "rope_kv": ([_P, _N, _P, _P, _N, _N, _N, _N, _P, _P, _P, _N], ctypes.c_int),
             "silu_mul": ([_P, _N, _P, _N, _N, _P], ctypes.c_int),
             "silu_mul8": ([_P, _N, _P, _N, _N, _P], ctypes.c_int),
             "argmax_rows": ([_P, _N, _N, _N, _P], None)}
    for name, (args, res) in kinds.items():
        for suffix in _SUFFIX.values():
            fn = getattr(lib, name + suffix, None)  # an older build lacks the later entries
            if fn is not None:
                fn.argtypes, fn.restype = args, res
                _FNS[name, suffix] = fn
    return lib


_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}  # each dtype's C entry points
_FNS: dict[tuple[str, str], Any] = {}  # (name, suffix) -> the C function, with its argtypes set
_LIB = _load()
AVAILABLE = _LIB is not None


def _torch_exp(capability: str, symbol: str) -> int | None:
    """The address of `symbol` in libtorch_cpu where torch runs its `capability` kernels here, else None."""
    if torch.backends.cpu.get_cpu_capability() != capability:
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def torch_expf16() -> int | None:
    """The address of the float exp torch's AVX-512 kernels call (`Sleef_expf16_u10`, exported by
    libtorch_cpu), where torch runs those kernels here; else None. The C SiLU-gating (`silu_mul`
    here, and _amx_gemm.c's in the GEMM's pass) computes SiLU with it, so its bits are F.silu's."""
    return _torch_exp("AVX512", "Sleef_expf16_u10")


def torch_expf8() -> int | None:
    """The same for torch's AVX2 kernels (`Sleef_expf8_u10`), which run on CPUs without AVX-512
    (AMD's Zen 2 and 3, Intel's client cores): `silu_mul`'s float32 pass there."""
    return _torch_exp("AVX2", "Sleef_expf8_u10")


EXPF16 = torch_expf16()
EXPF8 = torch_expf8()
# torch runs an elementwise op or a reduction on one thread below this many values
# (at::internal::GRAIN_SIZE) and in pieces of ceil(values / threads) on its threads above it
GRAIN = 32768


def _torch_serial(numel: int) -> bool:
    """Whether torch would run an op over `numel` values on one thread. Where it would not, the
    one-thread C passes (`silu_mul`, `argmax`) step aside: torch's threads then outrun them,
    and its SiLU's bits move with its thread count (a piece that begins off a vector boundary
    has its first and last values computed by torch's scalar code)."""
    return numel < GRAIN or torch.get_num_threads() == 1


def _entry(name: str, *ts: torch.Tensor) -> Any:
    """`name`'s C function for the tensors' one dtype, None where there is none for them."""
    if _LIB is None:  # no build (or a test taking it away)
        return None
    dtype = ts[0].dtype
    for t in ts:
        if t.dtype != dtype or t.device.type != "cpu":
            return None
    suffix = _SUFFIX.get(dtype)
    return None if suffix is None else _FNS.get((name, suffix))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, n] (rows may be strided), weight [n] -> a new [T, n]."""
    fn = _entry("rms_norm", x, weight)
    if not (fn is not None and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and weight.shape == (x.shape[1],)):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [T, heads, D] rotated in place (rows may be strided, heads contiguous), cos and sin
    [T, 1, D] or [T, D]; False (x untouched) where it does not apply."""
    fn = _entry("rope", x, cos, sin)
    if not (fn is not None and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[2] % 2 == 0 and cos.is_contiguous() and sin.is_contiguous()
            and cos.numel() == sin.numel() == x.shape[0] * x.shape[2]):
        return False
    fn(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2])
    return True


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + y, rms_norm(x + y)) as two new [T, n] tensors, x and y contiguous [T, n]."""
    fn = _entry("add_rms_norm", x, y, weight)
    if not (fn is not None and x.dim() == 2 and x.shape == y.shape and x.is_contiguous() and y.is_contiguous()
            and weight.is_contiguous() and weight.shape == (x.shape[1],)):
        return None
    total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
    fn(x.data_ptr(), y.data_ptr(), total.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return total, out


def rope_kv(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """RoPE on qkv's q and k heads in place, then row t's k and v heads stored at cache slot
    slots[t]: qkv [T, (heads + 2 * kv_heads) * head_dim] (rows may be strided), cos and sin
    [T, 1, head_dim] or [T, head_dim], caches [slots, kv_heads, head_dim], slots [T] int64.
    False (nothing touched) where it does not apply, or a slot is outside the caches."""
    fn = _entry("rope_kv", qkv, cos, sin, k_cache, v_cache)
    t = qkv.shape[0]
    if not (fn is not None and qkv.dim() == 2 and qkv.stride(1) == 1 and head_dim % 2 == 0
            and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim
            and cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() == t * head_dim
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and k_cache.dim() == 3 and k_cache.shape[1] == kv_heads and k_cache.shape[2] == head_dim
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() == t
            and slots.device.type == "cpu"):
        return False
    status: int = fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, kv_heads, head_dim,
                     k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), k_cache.shape[0])
    return status == 0


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` where `gate, up = gate_up.chunk(2, -1)`, as a new [T, inter] tensor with
    the bits torch's two ops give on one thread, in one pass; gate_up [T, 2 * inter] (rows may be
    strided). None where it does not apply (torch runs neither its AVX-512 kernels here nor, for
    float32, its AVX2 ones; another layout; an inter that torch's vector loops would not cover
    whole: 32 values, 64 in bfloat16, 16 with AVX2; or more values than torch runs on one thread
    while it has several, `_torch_serial`): the caller runs torch's two ops."""
    if EXPF16 is not None:
        fn, exp, whole = _entry("silu_mul", gate_up), EXPF16, 64 if gate_up.dtype == torch.bfloat16 else 32
    elif EXPF8 is not None and gate_up.dtype == torch.float32:
        fn, exp, whole = _entry("silu_mul8", gate_up), EXPF8, 16
    else:
        return None
    if fn is None or gate_up.dim() != 2 or gate_up.stride(1) != 1:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.shape[1] != 2 * inter or inter % whole or not _torch_serial(rows * inter):
        return None
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    status: int = fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, exp)
    return out if status == 0 else None


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """`x.argmax(dim=-1)` for float32 rows [R, V] (rows may be strided): the same indices (the
    first of equal maxima, the first NaN where a row has one), as a new int64 [R]. None where it
    does not apply (another dtype or layout, no values, or more than torch runs on one thread
    while it has several): the caller runs torch's."""
    fn = _entry("argmax_rows", x)
    # (the C pass counts indices in int32 lanes)
    if fn is None or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not 0 < x.shape[1] < 2**31 \
            or not _torch_serial(x.numel()):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    fn(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
