"""Decode attention in C on the paged cache (scheduler/model/native_attention.py) against
a plain softmax over each row's own context, and the forward with and without it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from scheduler.model import native_attention
from tests.support.oracle import logits_with_and_without

pytestmark = pytest.mark.skipif(not native_attention.AVAILABLE, reason="built without a C compiler")


def _reference(q, k_cache, v_cache, blocks, ctx, bs, window):
    rows, heads, d = q.shape
    g = heads // k_cache.shape[1]
    out = []
    for r in range(rows):
        n = int(ctx[r])
        first = max(0, n - window) if window else 0
        slots = torch.tensor([int(blocks[r, t // bs]) * bs + t % bs for t in range(first, n)])
        k = k_cache[slots].repeat_interleave(g, dim=1)  # [n, H, D]
        v = v_cache[slots].repeat_interleave(g, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[r].double(), k.double()) * d ** -0.5, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", p, v.double()).reshape(-1))
    return torch.stack(out).float()


def _case(heads: int, kv_heads: int, d: int, seed: int, dtype: torch.dtype, bs: int = 16):
    """Caches of 64 blocks, rows of many lengths on scattered, shuffled blocks (a row's unused
    table entries point anywhere: block 0), q as the forward has it (a strided view)."""
    g = torch.Generator().manual_seed(seed)
    nblocks = 64
    k_cache = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(dtype)
    ctx = torch.tensor([1, 16, 17, 100, 250, 3, 64], dtype=torch.int64)
    nblk = int(ctx.max() + bs - 1) // bs
    blocks = torch.stack([torch.randperm(nblocks, generator=g)[:nblk] for _ in ctx])
    for r, n in enumerate(ctx.tolist()):
        blocks[r, (n + bs - 1) // bs:] = 0
    qk = torch.randn(len(ctx), heads + kv_heads, d, generator=g).to(dtype)
    return qk[:, :heads], k_cache, v_cache, blocks, ctx, bs


def _assert_within_a_bfloat16_ulp(out: torch.Tensor, exact: torch.Tensor) -> None:
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)  # the spacing at the value (2^-7 of it at most)
    assert ((out.double() - exact).abs() <= ulp + 1e-5).all()


def _decode_on(threads: int, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return native_attention.decode(*args)
    finally:
        torch.set_num_threads(before)


# 20: the scalar tails of the 8-float loops; 256: the largest head size the kernel takes
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (4, 4, 128), (6, 2, 40), (8, 1, 64), (4, 2, 20), (2, 1, 256)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_matches_a_plain_softmax(heads, kv_heads, d, window, threads):
    q, k_cache, v_cache, blocks, ctx, bs = _case(heads, kv_heads, d, heads * d + (window or 0), torch.float32)
    out = _decode_on(threads, q, k_cache, v_cache, blocks, ctx, bs, window)
    assert out is not None and out.shape == (len(ctx), heads * d)
    torch.testing.assert_close(out, _reference(q, k_cache, v_cache, blocks, ctx, bs, window), atol=2e-5, rtol=1e-5)


# the kernel is compiled for 16-token blocks with head sizes 64 and 128; other block sizes take
# its general build
@pytest.mark.parametrize("bs", [8, 32])
@pytest.mark.parametrize("d", [64, 40])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_block_sizes_agree(bs, d, window, dtype):
    q, k_cache, v_cache, blocks, ctx, bs = _case(8, 4, d, bs + d, dtype, bs)
    out = native_attention.decode(q, k_cache, v_cache, blocks, ctx, bs, window)
    assert out is not None
    exact = _reference(q.double(), k_cache.double(), v_cache.double(), blocks, ctx, bs, window).double()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=1e-5)
    else:
        _assert_within_a_bfloat16_ulp(out, exact)


def _with_nan(seed: int, poison: Callable[..., None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 case's output, clean and after `poison(q, k_cache, blocks)` put a NaN in."""
    q, k_cache, v_cache, blocks, ctx, bs = _case(8, 4, 64, seed, torch.float32)
    clean = native_attention.decode(q, k_cache, v_cache, blocks, ctx, bs, None)
    q, k_cache = q.clone(), k_cache.clone()
    poison(q, k_cache, blocks)
    out = native_attention.decode(q, k_cache, v_cache, blocks, ctx, bs, None)
    assert clean is not None and out is not None
    return clean.view(len(ctx), 8, 64), out.view(len(ctx), 8, 64)


def test_a_nan_stays_in_its_heads():
    """A NaN in one head's q makes that head's output NaN, as torch's softmax does, and leaves
    every other head of the batch as it was."""
    def poison(q, k_cache, blocks):
        q[3, 5, 7] = float("nan")

    clean, out = _with_nan(3, poison)
    assert out[3, 5].isnan().all()
    out[3, 5] = clean[3, 5]
    assert torch.equal(out, clean)


def test_a_nan_key_spoils_its_group_only():
    """A NaN in one token's K row of one KV head (row 3's token 97: in its scores' scalar tail,
    past the last eight-token step) makes that row's two heads of the group NaN, and leaves its
    other heads as they were."""
    def poison(q, k_cache, blocks):
        k_cache[int(blocks[3, 97 // 16]) * 16 + 97 % 16, 1, 5] = float("nan")

    clean, out = _with_nan(4, poison)
    assert out[3, 2:4].isnan().all()
    assert torch.equal(out[3, :2], clean[3, :2]) and torch.equal(out[3, 4:], clean[3, 4:])


# 64 and 128: split widening with the head size compiled in; 96 and 256: split, the general
# build; 80: split, an odd number of 16-value chunks; 20: widened in order
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (4, 4, 128), (4, 2, 96), (4, 2, 80), (2, 1, 256),
                                              (4, 2, 20)])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("threads", [1, 3])
def test_bfloat16_is_the_float32_result_rounded_once(heads, kv_heads, d, window, threads):
    """bfloat16 q and caches, computed in float32: the output is the exact softmax of the
    bfloat16 inputs rounded to bfloat16 once, so it is the float64 reference's rounding, or
    its neighbour where float32's own error (~1e-6 here) straddles a rounding boundary."""
    q, k_cache, v_cache, blocks, ctx, bs = _case(heads, kv_heads, d, 7 * heads + d, torch.bfloat16)
    out = _decode_on(threads, q, k_cache, v_cache, blocks, ctx, bs, window)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == (len(ctx), heads * d)
    exact = _reference(q.double(), k_cache.double(), v_cache.double(), blocks, ctx, bs, window).double()
    _assert_within_a_bfloat16_ulp(out, exact)
    assert (out == exact.bfloat16()).float().mean() > 0.99  # mostly the very rounding


def test_scores_far_below_the_maximum_weigh_nothing():
    """One key scores 100 above the others: their exp underflows (the kernel clamps its
    argument at -87: e^-87 ~ 1.6e-38 against a sum of at least 1), so every head returns that
    key's V."""
    g = torch.Generator().manual_seed(5)
    bs, heads, kv_heads, d = 16, 4, 2, 64
    k_cache = torch.randn(64, kv_heads, d, generator=g) * 0.01
    v_cache = torch.randn(64, kv_heads, d, generator=g)
    one = torch.randn(kv_heads, d, generator=g)
    q = one.repeat_interleave(heads // kv_heads, dim=0).expand(3, -1, -1).contiguous()  # a group shares its q
    hot = 21
    k_cache[hot] = one * (100 * d ** 0.5 / one.pow(2).sum(-1, keepdim=True))  # q . k * d^-0.5 = 100
    blocks = torch.tensor([[0, 1, 2, 3]] * 3, dtype=torch.int64)
    ctx = torch.tensor([30, 40, 64], dtype=torch.int64)
    out = native_attention.decode(q, k_cache, v_cache, blocks, ctx, bs, None)
    assert out is not None
    want = v_cache[hot].repeat_interleave(heads // kv_heads, dim=0).reshape(-1).expand(3, -1)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_what_it_does_not_take_falls_back():
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    kc = torch.randn(32, 2, 8, dtype=torch.float64)
    ctx = torch.tensor([3, 5])
    blocks = torch.zeros(2, 1, dtype=torch.int64)
    assert native_attention.decode(q, kc, kc, blocks, ctx, 16, None) is None  # float64
    q32, kc32 = q.float(), torch.randn(32, 2, 300)
    assert native_attention.decode(torch.randn(2, 4, 300), kc32, kc32, blocks, ctx, 16, None) is None  # head 300
    assert native_attention.decode(q32.transpose(1, 2).contiguous().transpose(1, 2), kc.float(), kc.float(), blocks,
                                   ctx, 16, None) is None  # heads not row-major


def test_the_forward_gives_the_same_logits_with_and_without_it(monkeypatch):
    """Decode rows of many lengths (several length groups on the gather path) in one batch
    with a prefill chunk: the C path and the gather + SDPA path agree."""
    native, plain = logits_with_and_without(native_attention, monkeypatch)
    torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 80, 96])
def test_a_kv_groups_two_heads_together_are_each_head_alone(d):
    """bfloat16 with two query heads per KV head widens each K and V row once for both
    (dot_split2, accumulate2); the same caches with each KV head repeated, one query head per KV
    head, run the heads one at a time: the same bits."""
    q, k_cache, v_cache, blocks, ctx, bs = _case(8, 4, d, d, torch.bfloat16)
    paired = native_attention.decode(q, k_cache, v_cache, blocks, ctx, bs, None)
    alone = native_attention.decode(q, k_cache.repeat_interleave(2, dim=1), v_cache.repeat_interleave(2, dim=1),
                                    blocks, ctx, bs, None)
    assert paired is not None and alone is not None
    assert torch.equal(paired.view(torch.int16), alone.view(torch.int16))


def test_a_build_without_the_exported_limit_is_no_library_not_a_failed_import():
    """An in-place build from before MAX_HEAD_DIM was exported has no such symbol: the torch
    path takes over (ctypes' ValueError failed the import)."""
    import ctypes

    from scheduler.model import native_attention

    assert native_attention.max_head_dim(ctypes.CDLL(None)) == 0 and native_attention.max_head_dim(None) == 0
    assert native_attention.MAX_HEAD_DIM == 256 or not native_attention.AVAILABLE
