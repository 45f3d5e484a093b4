"""RMSNorm and RoPE in one pass each (`_elementwise.c`), loaded with ctypes where the
install built it.

Each function takes float32 or bfloat16 CPU tensors (all of one dtype) in the layouts the
forward makes and returns None (or False) for anything else, or where the extension is
absent: `layers` then runs the torch expression, which gives the same values up to float32
rounding (tests/test_native_elementwise.py checks the two agree; bfloat16 rounds where
torch's bfloat16 ops do).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from scheduler.model.native_attention import open_library

_P = ctypes.c_void_p
_N = ctypes.c_int64


def _load() -> ctypes.CDLL | None:
    lib = open_library("_elementwise")
    if lib is not None:
        for suffix in ("", "_bf16"):
            if hasattr(lib, "rms_norm" + suffix):  # an older build has no bfloat16 entries
                norm, rope = getattr(lib, "rms_norm" + suffix), getattr(lib, "rope" + suffix)
                norm.argtypes = [_P, _N, _P, _P, _N, _N, ctypes.c_float]
                rope.argtypes = [_P, _N, _P, _P, _N, _N, _N]
                norm.restype = rope.restype = None
    return lib


_LIB = _load()
AVAILABLE = _LIB is not None
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}  # each dtype's C entry points


def _entry(name: str, *ts: torch.Tensor) -> Any:
    """`name`'s C function for the tensors' one dtype, None where there is none for them."""
    suffix = _SUFFIX.get(ts[0].dtype)
    if _LIB is None or suffix is None or not all(t.device.type == "cpu" and t.dtype == ts[0].dtype for t in ts):
        return None
    return getattr(_LIB, name + suffix, None)


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
