"""The KV pool's memory asks the kernel for 2 MB pages (scheduler/model/huge_pages.py).

Whether the kernel has a free huge page at that moment is the machine's business, so the
tests check what the code controls: the storage starts on a 2 MB boundary and the mapping
it lies in carries the advice (`hg` in /proc/self/smaps' VmFlags; `nh` for the 4 KB
baseline)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from scheduler.model import huge_pages
from scheduler.model.kv_cache import PagedKVCache
from tests.support.cli import mstrace

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or huge_pages._MADVISE is None
                           or huge_pages.mode() is None,
                           reason="madvise, transparent huge pages and /proc/self/smaps are Linux's")


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
    shape = (3, (1 << 20) + 1000)  # 12 MB of float32 and 12,000 bytes: its last 2 MB page is partly its
    t, asked = huge_pages.empty(shape, torch.float32, huge=huge)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert asked is huge
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()
    # every 2 MB page the tensor touches lies whole in an advised mapping (a page advised in
    # part is never a huge one), the last byte of the last included
    pages = -(-t.numel() * 4 // huge_pages.HUGE)
    for addr in [*range(t.data_ptr(), t.data_ptr() + pages * huge_pages.HUGE, huge_pages.HUGE // 2),
                 t.data_ptr() + pages * huge_pages.HUGE - 1]:
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


class Recorder:
    """madvise's stand-in: each call's (address, length, advice), every call a success."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, addr: int, length: int, advice: int) -> int:
        self.calls.append((addr, length, advice))
        return 0


needs_advice = pytest.mark.skipif(not hasattr(huge_pages.mmap, "MADV_HUGEPAGE"), reason="Linux's madvise advice")


@needs_advice
def test_advise_asks_for_the_whole_pages_of_each_run_and_collapses_at_most_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setattr(huge_pages, "_MADVISE", rec)
    monkeypatch.setattr(huge_pages, "mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "COLLAPSE_MAX", 3 * huge_pages.HUGE)
    M, H = 1 << 20, huge_pages.HUGE
    base = 100 * H + 64  # one byte past a page would make that page not whole
    # two buffers 64 bytes apart make one run; a third 1 MB further is a run of its own
    spans = [(base + 5 * M + 64, 7 * M), (base, 5 * M), (base + 13 * M, 9 * M)]
    assert huge_pages.advise(spans) == 3 * H  # what was collapsed: the bound's worth
    hp = [(a, n) for a, n, adv in rec.calls if adv == huge_pages.mmap.MADV_HUGEPAGE]
    assert hp == [(101 * H, 5 * H), (107 * H, 4 * H)]  # [base, base + 12 MB + 64) and [base + 13 MB, + 9 MB)
    collapsed = [(a, n) for a, n, adv in rec.calls if adv == huge_pages._MADV_COLLAPSE]
    assert collapsed == [(101 * H, 3 * H)]  # the bound spent on the first run
    assert huge_pages.advise([(base, M)]) == 0  # no whole page: nothing asked
    rec.calls.clear()  # a gap of a whole page splits runs: that page may be anyone's
    assert huge_pages.advise([(100 * H + 64, H - 64), (101 * H + 4096, H - 4096 + 100)]) == 0 and not rec.calls


def test_the_loader_asks_for_every_weight_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.model.loader import load_model
    from scheduler.model.presets import resolve_model

    seen: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(huge_pages, "advise", lambda spans: seen.append(list(spans)) or 0)
    for pack in (True, False):
        model, _ = load_model(resolve_model("tiny"), "cpu", torch.float32, pack=pack)
        # every weight the forward reads, the reordered ones by oneDNN's pointer, once each
        packed = [t for layer in model.layers for t in layer.packs.values()] + [model.lm_head_packed]
        dense = [p for p in model.parameters() if p.numel()]
        want = sorted(huge_pages.span(t) for t in [*packed, *dense] if t is not None)
        assert sorted(seen.pop()) == want and len(want) == len(set(want)) and not seen


@linux
@pytest.mark.skipif(huge_pages.mode() == "never", reason="the kernel is set to lend no huge pages")
def test_the_loaded_weights_are_advised_where_they_lie(monkeypatch: pytest.MonkeyPatch) -> None:
    from scheduler.model.loader import load_model
    from scheduler.model.presets import resolve_model

    real = huge_pages._MADVISE
    calls: list[tuple[int, int, int]] = []
    # the real madvise, each call noted
    monkeypatch.setattr(huge_pages, "_MADVISE", lambda *a: calls.append(a) or real(*a))
    model, _ = load_model(resolve_model("small"), "cpu", torch.float32, pack=True)  # 20 MB of weights
    want = sorted(model.weight_spans())
    # what was asked lies under the weights, in mappings that now carry the advice
    runs: list[list[int]] = []  # the weights' runs: spans at most GAP bytes apart
    for a, m in want:
        if runs and a <= runs[-1][1] + huge_pages.GAP:
            runs[-1][1] = max(runs[-1][1], a + m)
        else:
            runs.append([a, a + m])
    hp = [(a, n) for a, n, adv in calls if adv == huge_pages.mmap.MADV_HUGEPAGE]
    assert hp  # how much of 20 MB makes whole pages is the allocator's layout; some does
    for addr, n in hp:
        assert any(lo <= addr and addr + n <= hi for lo, hi in runs)
        assert "hg" in vm_flags(addr) and "hg" in vm_flags(addr + n - 1)


@needs_advice
def test_advise_leaves_a_kernel_set_to_never_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setattr(huge_pages, "_MADVISE", rec)
    monkeypatch.setattr(huge_pages, "mode", lambda: "never")
    assert huge_pages.advise([(100 * huge_pages.HUGE, 4 * huge_pages.HUGE)]) == 0 and not rec.calls


PAGES = re.compile(r"KV pool [\d,.]+ of [\d,.]+ MB on 2 MB pages, weights [\d,.]+ of [\d,.]+ MB "
                   r"\(transparent huge pages: (always|madvise|never|none here)\)")


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_run_records_what_its_pool_and_weights_got(tmp_path: Path, backend: str) -> None:
    out = tmp_path / "t"
    mstrace("run", "--model", "tiny", "--requests", "2", "--output-len", "2-2", "--cpu-device", backend,
            "--out", str(out), "-q")
    pages = json.loads((out / "meta.json").read_text())["model"]["pages"]
    assert PAGES.fullmatch(pages), pages
    if huge_pages.mode() in ("always", "madvise"):  # the pool is a mapping of its own, made to ask
        pool_mb = float(pages.split(" of ")[1].split(" MB")[0].replace(",", ""))
        assert pages.startswith("KV pool ") and pool_mb > 0
    assert json.loads(mstrace("report", str(out), "--json").stdout)["pages"] == pages
    assert f"pages {pages}" in " ".join(mstrace("report", str(out)).stdout.split())


def test_the_summary_counts_the_pool_on_its_pages() -> None:
    pool, _ = huge_pages.empty((4, 1 << 20), torch.float32)  # 16 MB
    pool.fill_(0)
    line = huge_pages.summary(pool, 3 << 20, 2 << 20)
    assert PAGES.fullmatch(line), line
    on = float(line.removeprefix("KV pool ").split(" of ")[0])
    assert 0 <= on <= 16 and ", weights 2.0 of 3.0 MB " in line
