"""RMSNorm and RoPE in one pass each (`_elementwise.c`), loaded with ctypes where the
install built it.

Each function takes float32 CPU tensors in the layouts the forward makes and returns None
(or False) for anything else, or where the extension is absent: `layers` then runs the
torch expression, which gives the same values up to float32 rounding
(tests/test_native_elementwise.py checks the two agree).
"""

from __future__ import annotations

import ctypes

import torch

from scheduler.model.native_attention import open_library

_P = ctypes.c_void_p
_N = ctypes.c_int64


def _load() -> ctypes.CDLL | None:
    lib = open_library("_elementwise")
    if lib is not None:
        lib.rms_norm.argtypes = [_P, _N, _P, _P, _N, _N, ctypes.c_float]
        lib.rope.argtypes = [_P, _N, _P, _P, _N, _N, _N]
        lib.rms_norm.restype = lib.rope.restype = None
    return lib


_LIB = _load()
AVAILABLE = _LIB is not None


def _fits(*ts: torch.Tensor) -> bool:
    return _LIB is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, n] (rows may be strided), weight [n] -> a new [T, n]."""
    if not (_fits(x, weight) and x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous()
            and weight.shape == (x.shape[1],)):
        return None
    assert _LIB is not None
    out = torch.empty(x.shape, dtype=torch.float32)
    _LIB.rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [T, heads, D] rotated in place (rows may be strided, heads contiguous), cos and sin
    [T, 1, D] or [T, D]; False (x untouched) where it does not apply."""
    if not (_fits(x, cos, sin) and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[2] % 2 == 0 and cos.is_contiguous() and sin.is_contiguous()
            and cos.numel() == sin.numel() == x.shape[0] * x.shape[2]):
        return False
    assert _LIB is not None
    _LIB.rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1], x.shape[2])
    return True
