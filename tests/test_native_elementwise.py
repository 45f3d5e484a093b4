"""RMSNorm, RoPE and SiLU-gating in C (scheduler/model/native_elementwise.py) against torch's
own ops, and the forward with and without them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scheduler.model import native_elementwise
from scheduler.model.layers import add_norm, apply_rope, rope_qk, rope_store, silu_gate
from tests.support.cli import REPO
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [512, 20])
def test_the_residual_join_is_the_add_then_the_norm_bit_for_bit(dtype, n):
    """add_rms_norm gives what the add (torch's, rounding as its dtype does) and then the C
    RMSNorm of the sum give: the same bits, the sum included."""
    g = torch.Generator().manual_seed(n)
    x, y = ((torch.randn(37, n, generator=g) * 4).to(dtype) for _ in range(2))
    w = torch.randn(n, generator=g).to(dtype)
    got = native_elementwise.add_rms_norm(x, y, w, 1e-5)
    assert got is not None
    total = x + y
    assert torch.equal(got[0], total)
    assert torch.equal(got[1], native_elementwise.rms_norm(total, w, 1e-5))


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (6, 6, 40), (3, 1, 20)])
def test_the_qkv_join_is_rope_then_the_two_index_copies_bit_for_bit(dtype, heads, kv_heads, d, strided):
    """rope_kv rotates q and k where they lie and stores each row's k and v at its slot: the
    same bits as RoPE's torch expression and index_copy_, every other cache slot untouched;
    also on rows strided apart (a qkv inside a wider row)."""
    g = torch.Generator().manual_seed(heads * d + kv_heads)
    t, slots_n, width = 11, 64, (heads + 2 * kv_heads) * d
    base = torch.randn(t, width + (3 * d if strided else 0), generator=g).to(dtype)
    qkv = base[:, d:d + width] if strided else base
    cos, sin = (torch.randn(t, 1, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(slots_n, generator=g)[:t]
    kc, vc = (torch.randn(slots_n, kv_heads, d, generator=g).to(dtype) for _ in range(2))
    want_kc, want_vc, plain = kc.clone(), vc.clone(), qkv.clone()
    qk = apply_rope(plain[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
    want_kc.index_copy_(0, slots, qk[:, heads:])
    want_vc.index_copy_(0, slots, plain[:, (heads + kv_heads) * d:].view(t, kv_heads, d))
    q, k, v = rope_store(qkv, heads, kv_heads, d, cos, sin, kc, vc, slots)
    assert q.data_ptr() == qkv.data_ptr()  # rotated where it lies
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)


def test_a_slot_outside_the_cache_writes_nothing_and_index_copy_says_why():
    t, heads, kv_heads, d = 3, 2, 1, 8
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    cs = torch.randn(t, 1, d)
    kc, vc = torch.zeros(4, kv_heads, d), torch.zeros(4, kv_heads, d)
    before = qkv.clone()
    bad = torch.tensor([0, 1, 4])
    assert not native_elementwise.rope_kv(qkv, heads, kv_heads, d, cs, cs, kc, vc, bad)
    assert torch.equal(qkv, before) and not kc.any() and not vc.any()
    with pytest.raises(IndexError):
        rope_store(qkv, heads, kv_heads, d, cs, cs, kc, vc, bad)


def test_the_joins_refuse_what_they_do_not_take():
    x, y, w = torch.randn(5, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64), torch.randn(16)
    assert native_elementwise.add_rms_norm(x, y, w.double(), 1e-5) is None  # float64
    assert native_elementwise.add_rms_norm(x.float().t().contiguous().t(), y.float(), w, 1e-5) is None  # strided
    assert native_elementwise.add_rms_norm(x.float(), y.float(), torch.randn(8), 1e-5) is None  # weight's length


def test_without_the_library_the_joins_are_torchs_ops(monkeypatch):
    """An install without a C compiler: `add_norm` and `rope_store` run the ops apart, with
    the values the C joins give (the sum and the KV rows bit for bit; RMSNorm and RoPE as
    torch computes them)."""
    g = torch.Generator().manual_seed(5)
    x, y, w = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g), torch.randn(16, generator=g)
    t, heads, kv_heads, d = 5, 4, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
    cos, sin = torch.randn(t, 1, d, generator=g), torch.randn(t, 1, d, generator=g)
    slots = torch.tensor([7, 0, 3, 9, 2])
    joined = add_norm(x, y, w, 1e-5), rope_store(qkv.clone(), heads, kv_heads, d, cos, sin,
                                                  *(torch.zeros(10, kv_heads, d) for _ in range(2)), slots)
    kc, vc = torch.zeros(10, kv_heads, d), torch.zeros(10, kv_heads, d)
    monkeypatch.setattr(native_elementwise, "_LIB", None)
    assert native_elementwise.add_rms_norm(x, y, w, 1e-5) is None
    total, h = add_norm(x, y, w, 1e-5)
    assert torch.equal(total, joined[0][0])
    torch.testing.assert_close(h, F.rms_norm(total, (16,), w, 1e-5), rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(h, joined[0][1], rtol=2e-6, atol=1e-6)
    q, k, v = rope_store(qkv.clone(), heads, kv_heads, d, cos, sin, kc, vc, slots)
    for apart, c_join in zip((q, k, v), joined[1], strict=True):
        torch.testing.assert_close(apart, c_join, rtol=0, atol=1e-6)
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v) and not kc[[1, 4, 5, 6, 8]].any()


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


GATES = pytest.mark.skipif(native_elementwise.EXPF16 is None and native_elementwise.EXPF8 is None,
                           reason="torch runs neither AVX-512 nor AVX2 kernels here: the gating runs as torch's two ops")
GATES_BF16 = pytest.mark.skipif(native_elementwise.EXPF16 is None,
                                reason="torch runs no AVX-512 kernels here: bfloat16's gating runs as torch's two ops")


@pytest.fixture
def one_thread():
    """torch on one thread, as the C passes take it (`_torch_serial`), and its references computed
    so: with several, its SiLU's bits move where a thread's piece begins off a vector boundary."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s encodings, so that a NaN compares equal to the same NaN"""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _torch_gating(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@GATES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 64, 300])
@pytest.mark.parametrize("inter,strided", [(1536, False), (64, True)])
def test_the_gating_is_torchs_two_ops_bit_for_bit(dtype, rows, inter, strided, one_thread):
    """`silu_mul` on a gate/up output: the bits of F.silu(gate) * up, gates from 1e-3 to 1e2 (an
    exp of -x that overflows float32 included), NaN and infinities in both halves."""
    if dtype == torch.bfloat16 and native_elementwise.EXPF16 is None:
        pytest.skip("torch runs no AVX-512 kernels here: bfloat16's gating runs as torch's two ops")
    g = torch.Generator().manual_seed(rows * 7 + inter)
    scale = torch.logspace(-3, 2, 2 * inter)[torch.randperm(2 * inter, generator=g)]
    base = (torch.randn(rows, 2 * inter + (48 if strided else 0), generator=g) * torch.cat(
        (scale, torch.ones(48 if strided else 0)))).to(dtype)
    gate_up = base[:, 16:16 + 2 * inter] if strided else base
    if rows >= 5:
        gate_up[1, 0], gate_up[2, 3], gate_up[3, 5] = float("nan"), float("inf"), float("-inf")
        gate_up[4, inter + 1] = float("nan")
    out = native_elementwise.silu_mul(gate_up)
    assert out is not None and out.shape == (rows, inter) and out.is_contiguous()
    assert torch.equal(_bits(out), _bits(_torch_gating(gate_up)))


@GATES_BF16
def test_the_gating_is_torchs_for_every_finite_bfloat16_gate(one_thread):
    """Every finite bfloat16 value as a gate, each times another as its up."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = torch.where(values.float().isfinite(), values, torch.zeros((), dtype=torch.bfloat16)).reshape(512, 128)
    gate_up = torch.cat((values, values.roll(1, dims=1)), dim=1)
    out = native_elementwise.silu_mul(gate_up)
    assert out is not None and torch.equal(_bits(out), _bits(_torch_gating(gate_up)))


@GATES
def test_the_gating_is_torchs_over_float32s_of_every_exponent(one_thread):
    """A million float32 gates drawn over their whole range (random encodings, the finite ones)."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(-2**31, 2**31, (2, 1 << 20), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    raw = torch.where(raw.isfinite(), raw, torch.zeros(()))
    gate_up = torch.cat((raw[0].reshape(1024, 1024), raw[1].reshape(1024, 1024)), dim=1)
    out = native_elementwise.silu_mul(gate_up)
    assert out is not None and torch.equal(_bits(out), _bits(_torch_gating(gate_up)))


def test_the_gating_refuses_what_torchs_loops_would_not_cover_whole(monkeypatch, one_thread):
    """An inter whose last values torch computes with its scalar exp (not a multiple of 32, or
    of 64 in bfloat16, or of 16 with AVX2), another dtype or layout, or no exp of torch's: None,
    and `silu_gate` runs torch's ops."""
    assert native_elementwise.silu_mul(torch.randn(4, 2 * 40)) is None
    if native_elementwise.EXPF16 is not None:
        assert native_elementwise.silu_mul(torch.randn(4, 2 * 48)) is None
    assert native_elementwise.silu_mul(torch.randn(4, 2 * 32).bfloat16()) is None
    assert native_elementwise.silu_mul(torch.randn(4, 2 * 64, dtype=torch.float64)) is None
    assert native_elementwise.silu_mul(torch.randn(2 * 64, 4).t()) is None  # columns strided
    x = torch.randn(5, 2 * 64)
    expected = _torch_gating(x)
    monkeypatch.setattr(native_elementwise, "EXPF16", None)
    monkeypatch.setattr(native_elementwise, "EXPF8", None)
    assert native_elementwise.silu_mul(x) is None
    assert torch.equal(silu_gate(x), expected)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="no AVX2 here")
def test_the_gating_tests_pass_with_torch_on_its_avx2_kernels():
    """This module's float32 gating tests again with torch on its AVX2 kernels (as on CPUs without
    AVX-512; forced by ATEN_CPU_CAPABILITY, so an AVX-512 host checks that path too): the pass
    with torch's AVX2 exp, every shape, stride and gate range above, bit for bit."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        "-k", "gating and not avx2_kernels", __file__],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    passed = re.search(r"(\d+) passed", summary)
    # the 10 float32 bit-for-bit cases, the exponent sweep and the refusals (bfloat16's skip)
    assert p.returncode == 0 and passed and int(passed.group(1)) >= 12, (summary, p.stdout[-3000:], p.stderr[-2000:])


@pytest.mark.parametrize("kind", ["normal", "ties", "nan", "inf", "zeros"])
def test_argmax_picks_torchs_index(kind, one_thread):
    """The greedy pick: torch's argmax index on every row (the first of equal maxima, the
    first NaN), over widths below, at and past the kernel's 32-value blocks."""
    g = torch.Generator().manual_seed(len(kind))
    for v in [1, 7, 31, 32, 33, 100, 257, 8192]:
        base = torch.randn(9, v + 5, generator=g)
        x = base[:, 2:2 + v]  # rows strided
        if kind == "ties":
            x.copy_(torch.randint(-2, 3, x.shape, generator=g).float())
        elif kind == "nan":
            x[torch.rand(x.shape, generator=g) < 0.03] = float("nan")
            x[0, -1] = float("nan")
        elif kind == "inf":
            x.copy_(torch.randint(-1, 2, x.shape, generator=g).float() * float("inf"))  # 0 * inf: NaN
        elif kind == "zeros":
            x.copy_(torch.where(torch.rand(x.shape, generator=g) < 0.5, -0.0, 0.0))
        got = native_elementwise.argmax(x)
        assert got is not None and torch.equal(got, x.argmax(dim=-1)), (kind, v)


def test_argmax_refuses_what_it_does_not_take(one_thread):
    assert native_elementwise.argmax(torch.randn(3, 8, dtype=torch.float64)) is None
    assert native_elementwise.argmax(torch.randn(3, 8).bfloat16()) is None
    assert native_elementwise.argmax(torch.randn(8, 3).t()) is None  # columns strided
    assert native_elementwise.argmax(torch.randn(3, 0)) is None  # torch raises there


def test_the_passes_step_aside_where_torch_would_use_its_threads(monkeypatch):
    """More values than torch runs on one thread, with several threads: torch's ops (they run in
    parallel there, and its SiLU's bits depend on where the pieces begin); fewer: the C passes."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    big, small = torch.randn(64, 2 * 1536), torch.randn(4, 2 * 1536)
    assert native_elementwise.silu_mul(big) is None and native_elementwise.argmax(big) is None
    assert native_elementwise.argmax(small) is not None
    if native_elementwise.EXPF16 is not None or native_elementwise.EXPF8 is not None:
        assert native_elementwise.silu_mul(small) is not None
