"""Large host buffers on the kernel's 2 MB pages (Linux's transparent huge pages), where the
kernel lends them to a region that asks (`/sys/kernel/mm/transparent_hugepage/enabled`:
`always` or `madvise`).

Why: a decode row's attention reads its context's K/V blocks where they lie in a pool of
hundreds of MB. On 4 KB pages every 4 KB it reads is another TLB entry, and a block taken
out of order starts a page walk besides its cache misses; on 2 MB pages the walks almost
vanish. Measured on the default preset's decode shapes: the C kernel read its K/V in
0.67-0.80x the time (BENCHMARKS.md, "The KV pool on huge pages"). torch has a switch for
every allocation it makes (`THP_MEM_ALLOC_ENABLE=1`, read once per process); this asks for
the KV pool alone, where the reads are, and changes nothing else the process allocates.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE = 2 << 20  # the x86-64 and arm64 (4 KB base pages) huge page


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



def backed(t: torch.Tensor) -> tuple[int, int]:
    """(bytes on huge pages, bytes mapped) of the mappings `t`'s storage lies in, from
    /proc/self/smaps; (0, 0) where there is none to read."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    huge = mapped = 0
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
                    start, end = (int(x, 16) for x in head.split("-"))
                    inside = start < hi and lo < end
                    if inside:
                        mapped += end - start
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1]) * 1024
    except OSError:
        return 0, 0
    return huge, mapped
