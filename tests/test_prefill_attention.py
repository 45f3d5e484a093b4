"""Prefill attention in C on the paged cache (native_attention.prefill, _prefill_attention.c)
against a plain float64 softmax over each chunk's causal context, each of its builds on this
CPU, and the forward with and without it."""

from __future__ import annotations

import pytest
import torch

from scheduler.model import native_attention
from scheduler.model.forward_batch import SeqChunk, build_forward_batch
from scheduler.model.loader import load_model
from scheduler.model.presets import ensure_preset
from tests.support.oracle import mixed_decode_chunks

pytestmark = pytest.mark.skipif(not native_attention.PREFILL_AVAILABLE, reason="built without a C compiler")
# what the engine runs: a CPU without AVX2 + FMA (or a build without them) keeps SDPA
runs_auto = pytest.mark.skipif(not native_attention.prefill_runs("auto"), reason="no AVX2 + FMA build on this CPU")

BS = 16
DECODE_ROWS = 3  # rows before the chunks' own, as a mixed batch has them


def _batch(heads: int, kv_heads: int, d: int, chunks: list[tuple[int, int]], seed: int, scale_q: float = 1.0):
    """Caches of shuffled blocks; each (start, n) chunk on blocks of its own, q a strided view
    of a qkv-shaped tensor, as the forward has it."""
    g = torch.Generator().manual_seed(seed)
    nblocks = 200
    kc = torch.randn(nblocks * BS, kv_heads, d, generator=g)
    vc = torch.randn(nblocks * BS, kv_heads, d, generator=g)
    perm = torch.randperm(nblocks, generator=g)
    specs, row, used = [], DECODE_ROWS, 0
    for start, n in chunks:
        nb = (start + n + BS - 1) // BS
        specs.append((row, n, start, perm[used : used + nb]))
        row, used = row + n, used + nb
    q = (torch.randn(row, heads + 2 * kv_heads, d, generator=g) * scale_q)[:, :heads]
    slot_mapping = torch.zeros(row, dtype=torch.int64)
    for row0, n, start, bt in specs:
        p = torch.arange(start, start + n)
        slot_mapping[row0 : row0 + n] = bt[p // BS] * BS + p % BS
    return q, kc, vc, specs, slot_mapping


def _reference(q, kc, vc, specs, window):
    heads, d = q.shape[1], q.shape[2]
    g = heads // kc.shape[1]
    outs = []
    for row0, n, start, bt in specs:
        p = torch.arange(start + n)
        s = bt[p // BS] * BS + p % BS
        k = kc[s].repeat_interleave(g, dim=1).double()
        v = vc[s].repeat_interleave(g, dim=1).double()
        scores = torch.einsum("qhd,khd->hqk", q[row0 : row0 + n].double(), k) * d**-0.5
        qpos, kpos = torch.arange(start, start + n)[:, None], p[None, :]
        see = kpos <= qpos
        if window:
            see &= kpos > qpos - window
        pr = torch.softmax(scores.masked_fill(~see, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", pr, v).reshape(n, heads * d))
    return torch.cat(outs).float()


def _run(q, kc, vc, specs, slot_mapping, window, isa="auto"):
    tables = native_attention.prefill_keys([(r0, n, st, None if st == 0 else bt) for r0, n, st, bt in specs],
                                           slot_mapping, DECODE_ROWS, BS)
    return native_attention.prefill(q, kc, vc, *tables, q.shape[0] - DECODE_ROWS, window, isa)


# KV groups of 1-32 heads: a tile of 32 rows may split a token's heads (3 does not divide it) or
# lie inside one token (32); head sizes up to the kernel's largest
SHAPES = [(8, 4, 64), (8, 8, 64), (4, 1, 128), (6, 2, 32), (3, 3, 40), (32, 1, 8), (2, 1, 256)]
LOADS = [
    ([(0, 17)], None),
    ([(0, 300), (40, 70), (0, 1)], None),  # a chunk after its context's first, a one-token prompt
    ([(100, 33), (0, 130)], None),
    ([(0, 200), (150, 90)], 50),  # a sliding window shorter than the chunks
    ([(0, 64), (64, 64)], 16),
]


@pytest.mark.parametrize("isa", ["auto", "avx512", "avx2", "baseline"])
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
def test_chunks_match_a_plain_softmax(isa, heads, kv_heads, d):
    """Every build this CPU runs, every shape of SHAPES: chunks with and without earlier context,
    a one-token prompt, sliding windows shorter than the chunks."""
    if not native_attention.prefill_runs(isa):
        pytest.skip(f"this CPU does not run the {isa} build")
    for seed, (chunks, window) in enumerate(LOADS):
        q, kc, vc, specs, sm = _batch(heads, kv_heads, d, chunks, seed)
        out = _run(q, kc, vc, specs, sm, window, isa)
        assert out is not None
        torch.testing.assert_close(out, _reference(q, kc, vc, specs, window), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 4, 64), (6, 2, 32), (2, 1, 256)])
def test_bfloat16_is_the_float32_result_rounded_once(isa, heads, kv_heads, d):
    """bfloat16 q and caches: the K/V tile widened, the float32 kernel's arithmetic, the output
    rounded to nearest even once. So the bits are the float32 call's on the same values, rounded
    as torch rounds (and within a rounding of the float64 softmax)."""
    if not native_attention.prefill_runs(isa):
        pytest.skip(f"this CPU does not run the {isa} build")
    for seed, (chunks, window) in enumerate(LOADS):
        q, kc, vc, specs, sm = _batch(heads, kv_heads, d, chunks, seed)
        qb, kb, vb = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
        out = _run(qb, kb, vb, specs, sm, window, isa)
        wide = _run(qb.float(), kb.float(), vb.float(), specs, sm, window, isa)
        assert out is not None and wide is not None and out.dtype == torch.bfloat16
        assert torch.equal(out.view(torch.int16), wide.bfloat16().view(torch.int16))
        want = _reference(qb.float(), kb.float(), vb.float(), specs, window)
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=8e-3)


@runs_auto
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_split_the_tiles_not_the_result(threads):
    q, kc, vc, specs, sm = _batch(8, 4, 64, [(0, 300), (40, 70), (0, 5)], 7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(q, kc, vc, specs, sm, None)
        torch.set_num_threads(threads)
        many = _run(q, kc, vc, specs, sm, None)
    finally:
        torch.set_num_threads(before)
    assert one is not None and many is not None
    assert torch.equal(one, many)  # each tile is one thread's, computed the same way


@runs_auto
def test_sharp_scores_weigh_only_their_maximum():
    """q scaled up: most of a row's exps underflow, across key tiles (the running maximum's
    rescale of what came before goes to exactly 0 or stays finite)."""
    q, kc, vc, specs, sm = _batch(8, 4, 64, [(0, 200), (90, 60)], 3, scale_q=40.0)
    out = _run(q, kc, vc, specs, sm, None)
    assert out is not None and torch.isfinite(out).all()
    torch.testing.assert_close(out, _reference(q, kc, vc, specs, None), atol=1e-4, rtol=1e-4)


@runs_auto
def test_a_nan_query_spoils_its_own_row_only():
    q, kc, vc, specs, sm = _batch(8, 4, 64, [(0, 90)], 5)
    want = _reference(q, kc, vc, specs, None)
    q[DECODE_ROWS + 40, 3, 7] = float("nan")  # token 40's head 3
    out = _run(q, kc, vc, specs, sm, None)
    assert out is not None
    bad = torch.zeros_like(out, dtype=torch.bool)
    bad[40, 3 * 64 : 4 * 64] = True
    assert out[bad].isnan().all()
    torch.testing.assert_close(out[~bad], want[~bad], atol=2e-5, rtol=1e-5)


@runs_auto
def test_what_it_does_not_take_falls_back():
    q, kc, vc, specs, sm = _batch(4, 2, 36, [(0, 20)], 0)  # a head size not a multiple of 8
    assert _run(q, kc, vc, specs, sm, None) is None
    q, kc, vc, specs, sm = _batch(4, 2, 264, [(0, 20)], 0)  # over the C kernel's largest
    assert _run(q, kc, vc, specs, sm, None) is None
    q, kc, vc, specs, sm = _batch(4, 2, 64, [(0, 20)], 0)
    assert _run(q.double(), kc.double(), vc.double(), specs, sm, None) is None


@runs_auto
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_forward_gives_the_same_logits_with_and_without_it(monkeypatch, dtype):
    """The tiny preset, one batch of decode rows, a new prompt and a prompt's second chunk:
    the C prefill path and SDPA with its masks (the plan then builds them) agree, and a C call
    that refuses falls back to exactly SDPA's result."""
    model, _ = load_model(ensure_preset("tiny"), "cpu", dtype)
    kv = model.make_kv_cache(400, 4)
    chunks, used = mixed_decode_chunks(model, kv, 4)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 500, (70,), generator=g).tolist()
    table = list(range(used, used + 18))
    model(build_forward_batch([SeqChunk(prompt[:40], 0, table, False)], 4, "cpu"), kv)  # its first chunk
    chunks.append(SeqChunk(prompt[40:], 40, table, True))
    chunks.append(SeqChunk(torch.randint(5, 500, (30,), generator=g).tolist(), 0,
                           list(range(used + 18, used + 26)), True))
    real, ran = native_attention.prefill, []

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(native_attention, "prefill", counted)
    native = model(build_forward_batch(chunks, 4, "cpu"), kv)
    assert ran and all(ran)  # every layer's chunks ran in C
    # a plan for the C call that then refuses (a buffer, a thread): SDPA, its masks made then
    monkeypatch.setattr(native_attention, "prefill", lambda *args, **kwargs: None)
    refused = model(build_forward_batch(chunks, 4, "cpu"), kv)
    monkeypatch.setattr(native_attention, "prefill", real)
    monkeypatch.setattr(native_attention, "_PREFILL", None)
    plain = model(build_forward_batch(chunks, 4, "cpu"), kv)
    # bfloat16: SDPA rounds its own intermediates; a few of bfloat16's ulps of the logits' scale
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (4 * 2**-8 * float(plain.abs().max()), 0.0)
    torch.testing.assert_close(native.float(), plain.float(), atol=atol, rtol=rtol)
    assert torch.equal(refused, plain)
