"""The KV pool's memory asks the kernel for 2 MB pages (scheduler/model/huge_pages.py).

Whether the kernel has a free huge page at that moment is the machine's business, so the
tests check what the code controls: the storage starts on a 2 MB boundary and the mapping
it lies in carries the advice (`hg` in /proc/self/smaps' VmFlags; `nh` for the 4 KB
baseline)."""

from __future__ import annotations

import sys

import pytest
import torch

from scheduler.model import huge_pages
from scheduler.model.kv_cache import PagedKVCache

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or huge_pages._MADVISE is None,
                           reason="madvise and /proc/self/smaps are Linux's")


def vm_flags(addr: int) -> set[str]:
    """The VmFlags of the mapping holding `addr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= addr < end
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux
@pytest.mark.parametrize("huge", [True, False])
def test_a_large_tensor_starts_on_2mb_and_carries_the_advice(huge: bool) -> None:
    shape = (3, 1 << 20)  # 12 MB of float32, not a whole number of 2 MB pages past the first
    t, asked = huge_pages.empty(shape, torch.float32, huge=huge)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert asked is huge
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()
    # every 2 MB the tensor spans, its last byte included, lies in an advised mapping
    for addr in range(t.data_ptr(), t.data_ptr() + t.numel() * 4, huge_pages.HUGE // 2):
        assert ("hg" if huge else "nh") in vm_flags(addr)
    # how many of them the kernel lent is its business (and memory a freed tensor left behind
    # keeps the pages it had, advice or not); the mappings hold the tensor, no more huge than mapped
    on, mapped = huge_pages.backed(t)
    assert mapped >= t.numel() * 4 and 0 <= on <= mapped


def test_a_small_tensor_is_a_plain_one() -> None:
    t, asked = huge_pages.empty((100, 100), torch.float32)
    assert t.shape == (100, 100) and not asked


@linux
def test_the_kv_pool_asks_for_huge_pages_and_starts_zeroed() -> None:
    kv = PagedKVCache(2, 256, 16, 4, 64, torch.float32, "cpu")  # 16 MB
    assert kv.huge_pages
    assert kv._pool.data_ptr() % huge_pages.HUGE == 0 and "hg" in vm_flags(kv._pool.data_ptr())
    assert not kv._pool.any()
    assert kv.k[1].data_ptr() == kv._pool[1, 0].data_ptr() and kv.k[0].shape == (256 * 16, 4, 64)
    kv.k[0][16:32] = 1.0
    kv.copy_blocks([1], [5])
    assert bool((kv.k[0][80:96] == 1.0).all()) and not kv.v[0].any()


def test_a_pool_on_a_small_scale_needs_no_advice() -> None:
    kv = PagedKVCache(1, 4, 4, 1, 8, torch.float32, "cpu")  # 1 KB
    assert not kv.huge_pages and not kv._pool.any()
