"""Memory an allocator keeps after it is freed, given back to the system.

A reading thread's buffers freed on another thread stay with their allocator until asked:
Arrow's pool (mimalloc), and glibc's arena of the thread that allocated them, which past
its adaptive mmap threshold serves multi-megabyte numpy arrays from the arena too (a TP
report's straggler join on the reading thread grew tp100m's peak by about 0.3 GB over the
stream without a trim). A fixed mmap threshold instead cost 25-50% more time in page faults.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pyarrow as pa


def _malloc_trim() -> Callable[[int], int] | None:
    # the process's own symbols (libc among them): find_library would run ldconfig at import
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_freed() -> None:
    """Give freed memory back: Arrow's pool, then every glibc arena (where libc is glibc)."""
    pa.default_memory_pool().release_unused()
    if _TRIM is not None:
        _TRIM(0)
