"""`--weight-pack`: the CPU's projections on weights reordered once for oneDNN's GEMM
(scheduler/model/packed_gemm.py), chosen by measurement like `--dtype auto`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from scheduler.model import packed_gemm
from scheduler.model.forward_batch import SeqChunk, build_forward_batch
from scheduler.model.loader import load_model
from scheduler.model.packed_gemm import MIN_SPEEDUP, choose_pack
from scheduler.model.presets import ensure_preset
from tests.support.cli import mstrace


def needs(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(packed_gemm.unpackable(dtype) is not None, reason=str(packed_gemm.unpackable(dtype)))


def test_what_is_not_measured() -> None:
    assert choose_pack(torch.device("cuda"), torch.bfloat16, "on").packed is False  # a device object needs no GPU
    assert choose_pack(torch.device("cpu"), torch.float32, "off") == packed_gemm.PackChoice(False, "off: asked")
    assert choose_pack(torch.device("cpu"), torch.float16, "auto").packed is False
    with pytest.raises(ValueError, match="--weight-pack must be one of auto, on, off"):
        choose_pack(torch.device("cpu"), torch.float32, "yes")


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=needs(d)) for d in (torch.float32, torch.bfloat16)])
def test_auto_follows_its_own_and_an_independent_measurement(dtype: torch.dtype) -> None:
    before = torch.get_num_threads()
    c = choose_pack(torch.device("cpu"), dtype, "auto")
    assert torch.get_num_threads() == before
    m = re.fullmatch(r"auto: (on|off), \w+ GEMMs of 16 and 64 rows x 512 x 1536 on the reordered weight measured "
                     r"([\d.]+)x F.linear's speed on this CPU", c.why)
    assert m, c.why
    assert c.packed == (m.group(1) == "on")
    # and a measurement of its own: where reordering plainly pays or plainly does not, the
    # choice must say so (near the threshold a busy machine could tip either)
    torch.set_num_threads(1)
    try:
        own = packed_gemm.speedup(dtype)
    finally:
        torch.set_num_threads(before)
    if own > 1.5 * MIN_SPEEDUP:
        assert c.packed, (own, c.why)
    elif own < 0.8 * MIN_SPEEDUP:
        assert not c.packed, (own, c.why)


@pytest.mark.parametrize("dtype,tol", [pytest.param(torch.float32, 1e-4, marks=needs(torch.float32)),
                                       pytest.param(torch.bfloat16, 2 ** -7, marks=needs(torch.bfloat16))])
def test_the_forward_on_reordered_weights_is_the_plain_one(dtype: torch.dtype, tol: float) -> None:
    """Decode rows and a prefill chunk, with the LM head: the same logits up to the GEMM's own
    summation order (float32: oneDNN against MKL, a few float32 ulps of the logits' size;
    bfloat16: another oneDNN primitive may round a value either way, a bfloat16 ulp)."""
    folder = ensure_preset("tiny")
    plain, _ = load_model(folder, "cpu", dtype)
    packed, _ = load_model(folder, "cpu", dtype, pack=True)
    assert packed.layers[0].packs and packed.lm_head_packed is not None and not plain.layers[0].packs
    # held once: the dense copies freed (the tiny preset's LM head is its own, untied)
    assert packed.layers[0].qkv_proj.numel() == 0 and packed.lm_head is not None and packed.lm_head.numel() == 0
    kv = plain.make_kv_cache(64, 4)
    g = torch.Generator().manual_seed(2)
    chunks = [SeqChunk([int(t)], ctx, list(range(4 * i, 4 * i + 4)), True)
              for i, (t, ctx) in enumerate(zip(torch.randint(5, 500, (5,), generator=g), (3, 7, 9, 12, 15),
                                               strict=True))]
    chunks.append(SeqChunk(torch.randint(5, 500, (13,), generator=g).tolist(), 0, [40, 41, 42, 43], True))
    batch = build_forward_batch(chunks, 4, "cpu")
    a, b = plain(batch, kv), packed(batch, kv)
    torch.testing.assert_close(b, a, atol=tol * a.abs().max().item(), rtol=0)


@needs(torch.float32)
def test_a_tied_head_keeps_the_embeddings_table(tmp_path: Path) -> None:
    from tests.support.checkpoints import build_llama

    folder = build_llama(tmp_path / "tied")  # tied embeddings
    plain, _ = load_model(folder, "cpu", torch.float32)
    packed, _ = load_model(folder, "cpu", torch.float32, pack=True)
    assert packed.lm_head is packed.embed_tokens and packed.lm_head is not None and packed.lm_head.numel() > 0
    kv = plain.make_kv_cache(8, 16)
    batch = build_forward_batch([SeqChunk(list(range(5, 25)), 0, [1, 3], True)], 16, "cpu")
    a, b = plain(batch, kv), packed(batch, kv)
    torch.testing.assert_close(b, a, atol=1e-4 * a.abs().max().item(), rtol=0)


def test_the_run_records_its_choice(tmp_path: Path) -> None:
    out = tmp_path / "t"
    mstrace("run", "--model", "tiny", "--requests", "2", "--output-len", "2-2", "--weight-pack", "off",
            "--out", str(out), "-q")
    meta = json.loads((out / "meta.json").read_text())["model"]
    assert (meta["weight_pack"], meta["weight_pack_choice"]) == (False, "off: asked")
    rep = json.loads(mstrace("report", str(out), "--json").stdout)
    assert rep["weight_pack_choice"] == "off: asked"
