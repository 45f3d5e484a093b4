"""RMSNorm and RoPE in C (scheduler/model/native_elementwise.py) against torch's own ops,
and the forward with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scheduler.model import native_elementwise
from scheduler.model.layers import apply_rope, rope_qk
from tests.support.oracle import logits_with_and_without

pytestmark = pytest.mark.skipif(not native_elementwise.AVAILABLE, reason="built without a C compiler")


# 512: the default preset's; 20 and 7: the scalar tails of the 8-float loop
@pytest.mark.parametrize("n", [512, 64, 20, 7])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_matches_torchs(n, strided):
    g = torch.Generator().manual_seed(n)
    base = torch.randn(37, n + 5, generator=g) * 4
    x = base[:, 3:3 + n] if strided else base[:, :n].contiguous()
    w = torch.randn(n, generator=g)
    out = native_elementwise.rms_norm(x, w, 1e-5)
    assert out is not None and out.is_contiguous()
    # the sum of squares runs in another order: a few float32 ulps, no more
    torch.testing.assert_close(out, F.rms_norm(x, (n,), w, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("heads,d", [(12, 64), (6, 128), (3, 40)])
def test_rope_is_torchs_expression_bit_for_bit(heads, d):
    """In place on q and k inside a qkv row (rows strided by the v heads after them)."""
    g = torch.Generator().manual_seed(heads * d)
    t = 29
    qkv = torch.randn(t, (heads + 2) * d, generator=g)
    cos, sin = torch.randn(t, 1, d, generator=g), torch.randn(t, 1, d, generator=g)
    want = apply_rope(qkv[:, :heads * d].view(t, heads, d), cos, sin)
    v_before = qkv[:, heads * d:].clone()
    got = rope_qk(qkv, heads * d, d, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where it lies
    assert torch.equal(got, want)
    assert torch.equal(qkv[:, heads * d:], v_before)  # the heads after q and k untouched


@pytest.mark.parametrize("n", [512, 20])
@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_in_bfloat16_rounds_where_torchs_does(n, strided):
    """layers.rms_norm's bfloat16 torch path: float32 statistics, x * inv rounded to bfloat16,
    times the weight rounded again. Only the sum of squares' order differs, which moves inv by
    a few float32 ulps: a value whose x * inv lies that close to a bfloat16 rounding boundary
    rounds the other way (one bfloat16 ulp, 2^-8 to 2^-7 of it), the rest are equal."""
    g = torch.Generator().manual_seed(n + 1)
    base = (torch.randn(37, n + 5, generator=g) * 4).bfloat16()
    x = base[:, 3:3 + n] if strided else base[:, :n].contiguous()
    w = torch.randn(n, generator=g).bfloat16()
    out = native_elementwise.rms_norm(x, w, 1e-5)
    assert out is not None and out.dtype == torch.bfloat16
    xf = x.float()
    want = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=0)
    assert (out == want).float().mean() > 0.99


@pytest.mark.parametrize("heads,d", [(12, 64), (3, 40)])
def test_rope_in_bfloat16_is_torchs_expression_bit_for_bit(heads, d):
    """Each product and the sum rounded to bfloat16, as torch's bfloat16 ops round."""
    g = torch.Generator().manual_seed(heads + d)
    t = 29
    qkv = torch.randn(t, (heads + 2) * d, generator=g).bfloat16()
    cos, sin = (torch.randn(t, 1, d, generator=g).bfloat16() for _ in range(2))
    want = apply_rope(qkv[:, :heads * d].view(t, heads, d), cos, sin)
    got = rope_qk(qkv, heads * d, d, cos, sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, want)


def test_what_it_does_not_take_falls_back():
    x = torch.randn(4, 8, dtype=torch.float64)
    assert native_elementwise.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-5) is None  # float64
    assert native_elementwise.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-5) is None  # columns strided
    assert native_elementwise.rms_norm(torch.randn(2, 4, 8), torch.ones(8), 1e-5) is None  # not rows
    q = torch.randn(3, 2, 8)
    before = q.clone()
    cs = torch.randn(3, 1, 8)
    assert not native_elementwise.rope_(q.transpose(0, 1).contiguous().transpose(0, 1), cs, cs)  # heads strided
    assert not native_elementwise.rope_(q.double(), cs.double(), cs.double())  # float64
    assert not native_elementwise.rope_(q.bfloat16(), cs, cs)  # dtypes mixed
    assert not native_elementwise.rope_(q, torch.randn(2, 1, 8), cs)  # a table of the wrong length
    assert torch.equal(q, before)


def test_the_forward_gives_the_same_logits_with_and_without_them(monkeypatch):
    """A batch of decode rows and a prefill chunk on the tiny preset: the C passes and
    torch's agree."""
    native, plain = logits_with_and_without(native_elementwise, monkeypatch)
    torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)
