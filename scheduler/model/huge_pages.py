"""Large host buffers on the kernel's 2 MB pages (Linux's transparent huge pages), where the
kernel lends them to a region that asks (`/sys/kernel/mm/transparent_hugepage/enabled`:
`always` or `madvise`).

Why: a decode row's attention reads its context's K/V blocks where they lie in a pool of
hundreds of MB, and every round streams the weights. On 4 KB pages every 4 KB read is
another TLB entry, and a block taken out of order starts a page walk besides its cache
misses; on 2 MB pages the walks almost vanish. Measured on the default preset: the C decode
kernel read its K/V in 0.77-0.96x the time, and the engine's forward took 0.98x (0.96x in
decode-heavy rounds) with its pool and weights on 2 MB pages (BENCHMARKS.md, "The KV pool and
the weights on huge pages"). torch has a switch for every allocation it makes
(`THP_MEM_ALLOC_ENABLE=1`, read once per process, so too late for a process that has
allocated); this asks for the pool (`empty`, before its first write) and the weights
(`advise`, after the loader wrote them) alone. A buffer under glibc's mmap threshold (32 MB
at most) comes from the heap, where the advice outlives it: memory reused there later may
land on huge pages too.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable

import torch

HUGE = 2 << 20  # the x86-64 and arm64 (4 KB base pages) huge page
GAP = 4096  # `advise`: buffers less than this apart are one run (the allocator's headers between them)
# linux/mman.h's, from Linux 6.1; Python's mmap module names it from 3.14 only
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)
# `advise` collapses this much at once: the kernel copied 118 MB of weights in 0.33 s here
# (2.8 ms a MB, so about 3 s for this much), and a 7B model's float32 weights would add over a
# minute to its load. khugepaged takes the rest at its own pace (by default 4,096 pages every
# 10 s: hours for such a model).
COLLAPSE_MAX = 1 << 30


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def mode() -> str | None:
    """The kernel's setting (`always`, `madvise` or `never`), None where there is none to read."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def empty(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = True) -> tuple[torch.Tensor, bool]:
    """An uninitialised CPU tensor of `shape` whose storage starts on a 2 MB boundary, and
    whether the kernel was asked to back it with huge pages. The pages are not touched: the
    first write to each 2 MB faults in a huge page where the kernel has one free (else 4 KB
    pages, as before). A tensor under 2 MB, or where madvise is missing, is a plain one.
    `huge=False` asks for 4 KB pages even where the kernel's setting is `always` (a
    benchmark's baseline). Advice shapes the pages faulted in after it: memory a freed tensor
    left behind keeps the pages it had (`backed` says what a tensor got)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if _MADVISE is None or nbytes < HUGE:
        return torch.empty(shape, dtype=dtype), False
    length = -(-nbytes // HUGE) * HUGE  # advised whole: a tail under 2 MB would stay on 4 KB pages
    raw = torch.empty(length + HUGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE  # < HUGE, so [skip, skip + length) lies inside `raw`
    # the view keeps `raw`'s storage alive
    t = raw[skip:skip + nbytes].view(dtype).view(shape)
    advice = mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE
    asked = _MADVISE(t.data_ptr(), length, advice) == 0
    return t, asked and huge


def span(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of `t`'s data, a oneDNN-reordered weight's too (its storage is opaque
    to torch; `torch.ops.mkldnn` tells where it lies)."""
    if t.is_mkldnn:
        return int(torch.ops.mkldnn.data_ptr(t)), int(torch.ops.mkldnn._nbytes(t))
    return t.data_ptr(), t.numel() * t.element_size()


def advise(spans: Iterable[tuple[int, int]]) -> int:
    """Ask for 2 MB pages under buffers already written (a model's weights, which their
    allocator placed): spans that follow each other within GAP bytes make one run (the
    allocator's headers between them), and each run's whole 2 MB pages are advised
    `MADV_HUGEPAGE`. The first COLLAPSE_MAX bytes are collapsed onto huge pages now
    (`MADV_COLLAPSE`, Linux 6.1), the rest, or all where that is missing, by the kernel's
    khugepaged in its own time. Memory of other buffers in a run's pages only changes page
    size. Returns the bytes collapsed now: on huge pages when it returns (khugepaged's later
    ones not counted); 0 where madvise is missing or refused, or where the kernel's setting
    is `never` (a collapse would not ask it)."""
    if _MADVISE is None or mode() == "never":
        return 0
    runs: list[list[int]] = []
    for addr, n in sorted(spans):
        if runs and addr < runs[-1][1] + GAP:
            runs[-1][1] = max(runs[-1][1], addr + n)
        else:
            runs.append([addr, addr + n])
    advised = collapsed = 0
    for start, end in runs:
        lo, hi = -(-start // HUGE) * HUGE, end // HUGE * HUGE  # whole pages only: no one else's memory
        if hi > lo and _MADVISE(lo, hi - lo, mmap.MADV_HUGEPAGE) == 0:
            now = min(hi - lo, max(COLLAPSE_MAX - advised, 0))
            # refused before Linux 6.1 (khugepaged's then), or where no huge page was free
            if now and _MADVISE(lo, now, _MADV_COLLAPSE) == 0:
                collapsed += now
            advised += hi - lo
    return collapsed


def summary(pool: torch.Tensor, weights_bytes: int, weights_collapsed: int) -> str:
    """What the host's KV pool and weights got, as the trace's meta (`model.pages`) and the
    report's header say it: the pool's bytes on huge pages (`backed`; a pool over glibc's mmap
    threshold, as a served model's is, is a mapping of its own, while a smaller one's count
    may include its neighbours', up to its size), the weights' collapsed at load (`advise`),
    and the kernel's setting."""
    pool_bytes = pool.numel() * pool.element_size()
    on = min(backed(pool)[0], pool_bytes)  # the mapping's slack before the pool is never touched
    return (f"KV pool {_mb(on)} of {_mb(pool_bytes)} MB on 2 MB pages, weights {_mb(weights_collapsed)} of "
            f"{_mb(weights_bytes)} MB (transparent huge pages: {mode() or 'none here'})")


def _mb(n: int) -> str:
    """MB, a decimal under 10 (a tiny model's weights are not 0 MB)."""
    return f"{n / (1 << 20):,.0f}" if n >= 10 << 20 else f"{n / (1 << 20):.1f}"


def backed(t: torch.Tensor | list[tuple[int, int]]) -> tuple[int, int]:
    """(bytes on huge pages, bytes mapped) of the mappings `t`'s storage (or each (address,
    bytes) span of a list) lies in, from /proc/self/smaps; (0, 0) where there is none to read.
    A mapping's count may include other buffers than `t`'s."""
    spans = t if isinstance(t, list) else [span(t)]
    huge = mapped = 0
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = any(start < a + n and a < end for a, n in spans)
                    if inside:
                        mapped += end - start
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return huge, mapped
