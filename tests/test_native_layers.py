"""A decode round's decoder layers in one C call (scheduler/model/native_layers.py): the same
logits and KV cache, bit for bit, as the layers in Python, and the Python layers wherever the
call does not apply."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from scheduler.model import native_layers, packed_gemm
from scheduler.model.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from scheduler.model.layers import DecoderLayer
from scheduler.model.loader import load_model
from scheduler.model.presets import ensure_preset
from scheduler.model.transformer import CausalLM

pytestmark = pytest.mark.skipif(
    native_layers._LIB is None or native_layers._kernels() is None,
    reason="no AMX here, or a C build missing: a decode round's layers run in Python")

BS = 4


@pytest.fixture(scope="module")
def model() -> Iterator[CausalLM]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the AMX layout is one thread's (packed_gemm.amx_fits)
    try:
        m, _ = load_model(ensure_preset("tiny"), "cpu", torch.bfloat16, pack=True)
        assert m.decode_weights is not None
        yield m
    finally:
        torch.set_num_threads(threads)


def decode_batch(g: torch.Generator, ctxs: tuple[int, ...], slot_past_end: bool = False) -> ForwardBatch:
    chunks = []
    for i, ctx in enumerate(ctxs):
        table = list(range(8 * i, 8 * i + ctx // BS + 1))
        chunks.append(SeqChunk([int(torch.randint(5, 500, (1,), generator=g))], ctx, table, True))
    if slot_past_end:  # a block id past the cache's blocks for the last row's new token
        last = chunks[-1]
        last.block_table[ctxs[-1] // BS] = 10_000
    return build_forward_batch(chunks, BS, "cpu")


def both(model: CausalLM, batch: ForwardBatch, monkeypatch: pytest.MonkeyPatch,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, KV pool) through the C call, then through the Python layers, from equal caches."""
    g = torch.Generator().manual_seed(1)
    kv_c, kv_py = model.make_kv_cache(160, BS), model.make_kv_cache(160, BS)
    kv_c._pool.copy_(torch.randn(kv_c._pool.shape, generator=g).bfloat16())
    kv_py._pool.copy_(kv_c._pool)
    with monkeypatch.context() as m:  # the C call must not fall back: a Python layer would raise
        m.setattr(DecoderLayer, "forward", lambda *a, **k: pytest.fail("a layer ran in Python"))
        c = model(batch, kv_c)
    with monkeypatch.context() as m:
        m.setattr(native_layers, "decode_layers", lambda *a, **k: None)
        py = model(batch, kv_py)
    return c, py, kv_c._pool, kv_py._pool


@pytest.mark.parametrize("ctxs", [(3,), (3, 7, 9, 12, 15, 30, 17, 5), tuple(range(1, 18))])
def test_a_decode_round_in_one_call_is_the_python_layers_bit_for_bit(model, ctxs, monkeypatch):
    """One row, a row block with a short last tile, and 17 rows (a second, one-row tile):
    contexts within one block and across several."""
    c, py, pool_c, pool_py = both(model, decode_batch(torch.Generator().manual_seed(len(ctxs)), ctxs), monkeypatch)
    assert torch.equal(c, py)
    assert torch.equal(pool_c, pool_py)  # each layer's new K/V rows written alike


def test_biases_are_added_where_the_python_layers_add_them(monkeypatch):
    """Every projection with a bias (the tiny preset has none; Qwen2's qkv has one): the same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        biased, _ = load_model(ensure_preset("tiny"), "cpu", torch.bfloat16, pack=True)
    finally:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(11)
    for layer in biased.layers:
        for name, proj in (("qkv_bias", "qkv_proj"), ("o_bias", "o_proj"), ("gate_up_bias", "gate_up_proj"),
                           ("down_bias", "down_proj")):
            rows = layer.packs[proj].shape[0] * 16
            setattr(layer, name, torch.nn.Parameter(torch.randn(rows, generator=g).bfloat16(), requires_grad=False))
    biased.decode_weights = native_layers.weights_table(biased)
    assert biased.decode_weights is not None and bool((biased.decode_weights.table[:, 2] != 0).all())
    c, py, pool_c, pool_py = both(biased, decode_batch(g, (3, 7, 9, 12, 15)), monkeypatch)
    assert torch.equal(c, py) and torch.equal(pool_c, pool_py)


def test_a_sliding_window_reads_the_same_keys(model, monkeypatch):
    monkeypatch.setattr(model.cfg, "sliding_window", 6)
    c, py, _, _ = both(model, decode_batch(torch.Generator().manual_seed(5), (3, 9, 14, 20)), monkeypatch)
    assert torch.equal(c, py)
    monkeypatch.setattr(model.cfg, "sliding_window", None)
    unwindowed, _, _, _ = both(model, decode_batch(torch.Generator().manual_seed(5), (3, 9, 14, 20)), monkeypatch)
    assert not torch.equal(c, unwindowed)  # the window did cut the longer rows' keys


def test_what_the_call_does_not_take_runs_in_python(model, monkeypatch):
    """A batch with a prefill chunk, and a slot outside the caches: the C call says None (the
    latter with nothing written), and the Python layers run, or raise as they always did."""
    kv = model.make_kv_cache(64, BS)
    g = torch.Generator().manual_seed(7)
    mixed = build_forward_batch([SeqChunk([9], 5, [0, 1], True), SeqChunk(list(range(5, 16)), 0, [8, 9, 10], True)],
                                BS, "cpu")
    x = model.embed(mixed)
    assert native_layers.decode_layers(model, x, mixed, kv, model.decode_weights) is None
    bad = decode_batch(g, (3, 7), slot_past_end=True)
    before = kv._pool.clone()
    assert native_layers.decode_layers(model, model.embed(bad), bad, kv, model.decode_weights) is None
    assert torch.equal(kv._pool, before)
    with pytest.raises(IndexError, match="out of bounds"):
        model(bad, kv)


def test_a_cache_of_other_heads_is_refused(model):
    """A KV cache whose rows are not the model's kv_heads x head_dim: the C call would write
    other rows than the Python layers; it says None and they run (and raise)."""
    from scheduler.model.kv_cache import PagedKVCache

    cfg = model.cfg
    batch = decode_batch(torch.Generator().manual_seed(4), (3, 7))
    wide = PagedKVCache(len(model.layers), 64, BS, 2 * cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cpu")
    assert native_layers.decode_layers(model, model.embed(batch), batch, wide, model.decode_weights) is None


def test_without_the_gating_in_the_gemm_the_layers_run_in_python(model, monkeypatch):
    """Each kernel the call chains is looked up where it is loaded: one taken away (here torch's
    exp, so no gating in the GEMM's pass) and the round runs the Python layers."""
    batch = decode_batch(torch.Generator().manual_seed(2), (3, 7))
    kv = model.make_kv_cache(64, BS)
    monkeypatch.setattr(packed_gemm, "_EXPF16", None)
    assert native_layers.decode_layers(model, model.embed(batch), batch, kv, model.decode_weights) is None


def test_layers_the_call_would_refuse_every_round_get_no_table(model, monkeypatch):
    """A head size past the C attention's (it would refuse each round after layer 0's norm,
    projection and KV write) and a tensor-parallel layer (its sums all-reduce): no table, so
    the rounds go straight to the Python layers."""
    assert native_layers.weights_table(model) is not None
    with monkeypatch.context() as m:
        m.setattr(native_layers.native_attention, "MAX_HEAD_DIM", model.cfg.head_dim - 1)
        assert native_layers.weights_table(model) is None
    with monkeypatch.context() as m:
        m.setattr(model.layers[1], "all_reduce", lambda t: t)
        assert native_layers.weights_table(model) is None


def test_rows_that_are_not_the_batch_are_refused(model):
    """`x` of other rows than the batch's tokens (a pipeline stage's received tensor, say): the
    C loop would read the batch's positions and slots for rows that are not there."""
    batch = decode_batch(torch.Generator().manual_seed(5), (3, 7, 9))
    kv = model.make_kv_cache(64, BS)
    x = model.embed(batch)
    assert native_layers.decode_layers(model, x[:2].contiguous(), batch, kv, model.decode_weights) is None
    assert native_layers.decode_layers(model, x, batch, kv, model.decode_weights) is not None
