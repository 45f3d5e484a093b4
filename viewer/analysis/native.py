"""The C searches of `_search.c`, loaded with ctypes, or None where they were not built.

They gallop from the previous answer, so a block of nearly sorted queries costs a
few comparisons per query instead of a bisection (10 M probe rows: the cost
table's searches took 60% of its CPU time in numpy). ctypes releases the GIL for
the call, so the analysis threads still run side by side. `intervals` falls back
to numpy's searchsorted, which gives the same answers, when the extension is absent
(an install without a C compiler).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

import numpy as np

_I64P = ctypes.POINTER(ctypes.c_int64)
_N = ctypes.c_int64


def _load() -> ctypes.CDLL | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_search{suffix}"
        if p.is_file():
            lib = ctypes.CDLL(str(p))
            lib.search_right.argtypes = [_I64P, _N, _I64P, _N, _I64P]
            lib.busy_before.argtypes = [_I64P, _I64P, _I64P, _N, _I64P, _N, _I64P]
            lib.search_right.restype = lib.busy_before.restype = None
            return lib
    return None


_LIB = _load()
AVAILABLE = _LIB is not None


def _ptr(a: np.ndarray) -> ctypes._Pointer[ctypes.c_int64]:
    return a.ctypes.data_as(_I64P)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def search_right(s: np.ndarray, q: np.ndarray) -> np.ndarray:
    """np.searchsorted(s, q, side="right") for sorted int64 s."""
    assert _LIB is not None
    s, q = _i64(s), _i64(q)
    out = np.empty(len(q), dtype=np.int64)
    _LIB.search_right(_ptr(s), len(s), _ptr(q), len(q), _ptr(out))
    return out


def busy_before(s: np.ndarray, length: np.ndarray, cum: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Busy time before each q over sorted disjoint intervals [s, s + length), whose
    prefix sums are cum (len(s) + 1 entries, from 0)."""
    assert _LIB is not None
    s, length, cum, q = _i64(s), _i64(length), _i64(cum), _i64(q)
    out = np.empty(len(q), dtype=np.int64)
    _LIB.busy_before(_ptr(s), _ptr(length), _ptr(cum), len(s), _ptr(q), len(q), _ptr(out))
    return out
