"""The engine's own forward against transformers as the oracle.

A miniature scheduler drives the engine with chunked prefill interleaved with other requests'
decodes, shuffled chunk order and shuffled non-contiguous KV blocks; transformers then runs each
final sequence once, teacher-forced, and must agree with every greedy token and every logit row.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from scheduler.model import (
    CausalLM,
    ForwardBatch,
    ModelConfig,
    ModelLoadError,
    PagedKVCache,
    SeqChunk,
    build_forward_batch,
    load_model,
)
from tests.support.checkpoints import BUILDERS, build_llama
from tests.support.oracle import (
    BLOCK,
    Req,
    generate,
    load_hf,
    make_reqs,
    mixed_decode_chunks,
    teacher_forced_check,
)


def run_model(model: CausalLM, reqs: list[Req], seed: int = 0) -> None:
    """Greedy-generate every request through the engine's forward (the oracle's loop)."""

    def forward(batch: ForwardBatch, kv: PagedKVCache, step: int) -> torch.Tensor:
        logits = model(batch, kv)
        assert logits.dtype == torch.float32
        assert logits.shape == (batch.num_sampled, model.cfg.vocab_size)
        return logits

    generate(forward, lambda n: model.make_kv_cache(n, BLOCK), reqs, seed)


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session", params=sorted(BUILDERS))
def checkpoint(request: pytest.FixtureRequest, ckpt_root: Path) -> Path:
    return BUILDERS[request.param](ckpt_root / request.param)


def test_greedy_matches_transformers(checkpoint: Path) -> None:
    model, cfg = load_model(checkpoint)
    # Lengths straddle block boundaries and the Mistral window (32); 1-token and one-shot
    # prompts go through the decode-shaped and start_pos == 0 paths.
    reqs = make_reqs(
        cfg.vocab_size, seed=7, lengths=[5, 17, 40, 1, 33], chunks=[7, 7, 7, 7, 64], max_new=20
    )
    run_model(model, reqs)
    teacher_forced_check(load_hf(checkpoint), reqs)


def test_prefill_logits_match(checkpoint: Path) -> None:
    """Every row of a prefill, not only the sampled one, via one-token-per-chunk batches."""
    model, cfg = load_model(checkpoint)
    hf = load_hf(checkpoint)
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    kv = model.make_kv_cache(8, BLOCK)
    table = [5, 2, 7]
    # First 30 tokens as one chunk, then 15 chunks of one token each batched with nothing else:
    # compares the last prefill row plus 15 positions that go through the decode path.
    got = [
        model(build_forward_batch([SeqChunk(ids[:30].tolist(), 0, table, True)], BLOCK, "cpu"), kv)
    ]
    for p in range(30, 45):
        got.append(
            model(build_forward_batch([SeqChunk([int(ids[p])], p, table, True)], BLOCK, "cpu"), kv)
        )
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()[29:]
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


def test_forward_batch_layout() -> None:
    chunks = [
        SeqChunk([10, 11, 12], 0, [4], False),  # first prefill chunk
        SeqChunk([20], 17, [1, 0], True),  # decode at position 17 -> block 0, offset 1
        SeqChunk([30, 31], 5, [2], True),  # last prefill chunk
        SeqChunk([40], 0, [3], True),  # one-token prompt: decode-shaped
    ]
    b = build_forward_batch(chunks, 16, "cpu")
    assert (b.num_tokens, b.num_seqs, b.num_sampled, b.num_decode) == (7, 4, 3, 2)
    assert b.input_ids.tolist() == [20, 40, 10, 11, 12, 30, 31]  # decode rows first
    assert b.positions.tolist() == [17, 0, 0, 1, 2, 5, 6]
    assert b.slot_mapping.tolist() == [1, 48, 64, 65, 66, 37, 38]
    assert b.logits_indices.tolist() == [0, 6, 1]  # chunk order of sample=True chunks
    assert b.decode_blocks is not None and b.decode_mask is not None
    # whole blocks, padded with block 0; the mask keeps exactly each context's positions
    assert b.decode_blocks.tolist() == [[1, 0], [3, 0]]
    assert b.decode_mask.shape == (2, 1, 1, 32)
    assert b.decode_mask[:, 0, 0].sum(-1).tolist() == [18, 1]
    first, second = b.prefills
    assert first.ctx_blocks is None and first.mask is None  # start_pos 0: causal, no gather
    assert second.ctx_blocks is not None and second.ctx_blocks.tolist() == [2]
    assert second.mask is not None and second.mask.shape == (2, 16)
    assert second.mask.sum(-1).tolist() == [6, 7]
    assert b.max_context_len == 18
    with pytest.raises(ValueError, match="cannot hold"):
        build_forward_batch([SeqChunk([1, 2], 15, [0], True)], 16, "cpu")
    with pytest.raises(ValueError, match="empty"):
        build_forward_batch([SeqChunk([], 0, [0], True)], 16, "cpu")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3), st.booleans()), min_size=1, max_size=20),
       st.sampled_from([4, 16]))
def test_a_decode_batch_is_laid_out_as_the_general_path_lays_it_out(rows, block_size) -> None:
    """The decode-only path (one tensor for its indices) gives the general path's batch."""
    from scheduler.model import forward_batch as fbm

    chunks = [SeqChunk([tok % 97 - 3], pos, list(range(i, i + pos // block_size + 1 + extra)), sample)
              for i, (pos, extra, sample) in enumerate(rows) for tok in (pos * 7 + i,)]
    decodes = sorted(enumerate(chunks), key=lambda ic: -ic[1].start_pos)
    max_ctx = max(c.start_pos + 1 for c in chunks)
    dev = torch.device("cpu")
    fast = fbm._decode_batch(chunks, decodes, block_size, dev, max_ctx)
    slow = fbm._mixed_batch(chunks, decodes, [], block_size, dev, max_ctx)
    assert build_forward_batch(chunks, block_size, "cpu").decode_groups == fast.decode_groups
    for f in dataclasses.fields(fbm.ForwardBatch):
        a, b = getattr(fast, f.name), getattr(slow, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def test_placeholders_resolve_from_the_future_ring() -> None:
    """Overlap's placeholder ids -(slot + 1) take the ring's tokens, real ids stay; the CPU's
    numpy path gives what the device expression gives, and leaves the batch it read unchanged."""
    from scheduler.model.forward_batch import resolve_placeholders

    future = torch.arange(1000, 1064)
    chunks = [SeqChunk([-1], 9, [0], True), SeqChunk([7], 3, [1], True), SeqChunk([5, 6, -64], 0, [2], True)]
    b = build_forward_batch(chunks, 16, "cpu")
    read, before = b.input_ids, b.input_ids.clone()
    want = torch.where(before < 0, future[(-before - 1).clamp(min=0)], before)
    resolve_placeholders(b, future)
    assert b.input_ids.dtype == torch.long and b.input_ids.tolist() == want.tolist() == [1000, 7, 5, 6, 1063]
    assert torch.equal(read, before)


def test_sliding_window_is_exercised(ckpt_root: Path) -> None:
    path = BUILDERS["mistral"](ckpt_root / "mistral_window")
    model, cfg = load_model(path)
    assert cfg.sliding_window == 32
    ids = torch.randint(
        0, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(4)
    ).tolist()

    def last_logits() -> torch.Tensor:
        kv = model.make_kv_cache(4, BLOCK)
        return model(build_forward_batch([SeqChunk(ids, 0, [0, 1, 2], True)], BLOCK, "cpu"), kv)

    windowed = last_logits()
    model.cfg.sliding_window = None
    assert not torch.allclose(windowed, last_logits(), atol=1e-3), "window had no effect"


def test_copy_blocks_moves_context(checkpoint: Path) -> None:
    model, cfg = load_model(checkpoint)
    ids = torch.randint(
        0, cfg.vocab_size, (36,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    kv = model.make_kv_cache(10, BLOCK)
    model(build_forward_batch([SeqChunk(ids[:35], 0, [4, 5, 6], False)], BLOCK, "cpu"), kv)
    # Overlapping move (6 -> 5 while 5 -> 2) must behave like a simultaneous copy.
    kv.copy_blocks([4, 5, 6], [9, 2, 5])
    moved = model(build_forward_batch([SeqChunk(ids[35:], 35, [9, 2, 5], True)], BLOCK, "cpu"), kv)
    ref_kv = model.make_kv_cache(10, BLOCK)
    model(build_forward_batch([SeqChunk(ids[:35], 0, [1, 3, 8], False)], BLOCK, "cpu"), ref_kv)
    ref = model(
        build_forward_batch([SeqChunk(ids[35:], 35, [1, 3, 8], True)], BLOCK, "cpu"), ref_kv
    )
    torch.testing.assert_close(moved, ref, atol=1e-5, rtol=0)


def test_sharded_checkpoint_loads_identically(ckpt_root: Path, tmp_path: Path) -> None:
    single = build_llama(ckpt_root / "llama_single")
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(
        tmp_path, safe_serialization=True, max_shard_size="40KB"
    )
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, _ = load_model(single)
    b, _ = load_model(tmp_path)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_bytes_per_block_matches_allocation(checkpoint: Path) -> None:
    cfg = ModelConfig.from_file(checkpoint / "config.json")
    kv = PagedKVCache.for_model(cfg, 3, BLOCK, torch.float32, "cpu")
    assert kv.nbytes == 3 * PagedKVCache.bytes_per_block(cfg, BLOCK, torch.float32)
    assert PagedKVCache.bytes_per_block(cfg, BLOCK, torch.bfloat16) * 2 == (
        PagedKVCache.bytes_per_block(cfg, BLOCK, torch.float32)
    )


def test_config_fields(ckpt_root: Path) -> None:
    llama = ModelConfig.from_file(build_llama(ckpt_root / "llama_cfg") / "config.json")
    assert (llama.head_dim, llama.num_key_value_heads, llama.rope_theta) == (16, 2, 500000.0)
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    assert llama.tie_word_embeddings and llama.eos_token_id == [2, 3] and llama.bos_token_id == 1
    qwen = ModelConfig.from_file(BUILDERS["qwen2"](ckpt_root / "qwen_cfg") / "config.json")
    assert qwen.attention_bias and not qwen.o_proj_bias and qwen.sliding_window is None
    assert qwen.eos_token_id == [5] and qwen.head_dim == 20


def test_eos_ids_of_generation_config_are_added(ckpt_root: Path) -> None:
    """Llama 3 Instruct's config.json names <|end_of_text|>, its generation_config.json
    <|eot_id|> too (the chat turn's end): the engine stops on both, as generate() does."""
    from tests.support.checkpoints import set_eos

    d = build_llama(ckpt_root / "gen_eos")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7], "do_sample": False}))
    assert ModelConfig.from_file(d / "config.json").eos_token_id == [2, 3, 7]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert ModelConfig.from_file(d / "config.json").eos_token_id == [2, 3, 9]
    (d / "generation_config.json").unlink()
    assert ModelConfig.from_file(d / "config.json").eos_token_id == [2, 3]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        ModelConfig.from_file(d / "config.json")
    set_eos(d, [5])
    assert ModelConfig.from_file(d / "config.json").eos_token_id == [5]


def test_legacy_rope_theta_and_rejected_rope_type() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    cfg = ModelConfig.from_dict({**base, "rope_theta": 1234.0, "torch_dtype": "bfloat16"})
    assert cfg.rope_theta == 1234.0 and cfg.head_dim == 4 and cfg.num_key_value_heads == 2
    assert cfg.torch_dtype == torch.bfloat16 and cfg.eos_token_id == []
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_missing_folder() -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("/nonexistent/model/dir")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path)
    msg = str(err.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "\n" not in msg


def test_no_weights(ckpt_root: Path, tmp_path: Path) -> None:
    shutil.copy(build_llama(ckpt_root / "llama_nw") / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_missing_tensor(ckpt_root: Path, tmp_path: Path) -> None:
    src = build_llama(ckpt_root / "llama_mt")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(tmp_path)


def test_wrong_shape(ckpt_root: Path, tmp_path: Path) -> None:
    src = build_llama(ckpt_root / "llama_ws")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    tensors = load_file(src / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(tmp_path)


@pytest.fixture(scope="session")
def preset_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("preset_cache")


@pytest.mark.parametrize("name", ["tiny", "default"])
def test_presets_match_transformers(name: str, preset_cache: Path) -> None:
    from scheduler.model.presets import ensure_preset

    path = ensure_preset(name, cache_dir=preset_cache)
    model, cfg = load_model(path)
    reqs = make_reqs(cfg.vocab_size, seed=11, lengths=[6, 19], chunks=[4, 8], max_new=10)
    run_model(model, reqs)
    teacher_forced_check(load_hf(path), reqs)


def test_length_grouped_decode_attention_matches_one_group(monkeypatch) -> None:
    """Decode rows attended in several length groups give the same logits as one padded group
    (the gather path: without the C decode attention, tests/test_native_attention.py)."""
    import scheduler.model.forward_batch as fbm
    from scheduler.model import native_attention
    from scheduler.model.presets import ensure_preset

    monkeypatch.setattr(native_attention, "_LIB", None)

    model, _ = load_model(ensure_preset("tiny"), "cpu", torch.float32)
    kv = model.make_kv_cache(400, 4)
    chunks, _ = mixed_decode_chunks(model, kv, 4)
    batch = build_forward_batch(chunks, 4, "cpu")
    assert batch.decode_groups is not None and len(batch.decode_groups) > 1
    grouped = model(batch, kv)
    monkeypatch.setattr(fbm, "_length_groups", lambda nblks, **kw: [(0, len(nblks), nblks[0])])
    single = model(build_forward_batch(chunks, 4, "cpu"), kv)
    torch.testing.assert_close(grouped, single, atol=1e-5, rtol=1e-5)


def test_bfloat16_is_as_close_to_float32_as_transformers_in_bfloat16(checkpoint: Path) -> None:
    """bfloat16 keeps 8 significant bits, so every rounding moves a value by up to 2^-9 of
    it, and the roundings compound through the layers; two correct bfloat16 forwards round at
    different points (fused QKV and gate/up, RoPE tables in the model's dtype) and differ
    from each other by as much as from float32. The tolerance is therefore transformers' own
    bfloat16 error, not a constant: the engine in bfloat16 must be at most twice as far from
    transformers in float32 as transformers in bfloat16 is, over a 30-token prefill's last row
    and 15 decode rows, and pick float32's token wherever float32's top-2 margin exceeds both
    errors."""
    model, cfg = load_model(checkpoint, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    kv = model.make_kv_cache(8, BLOCK)
    table = [5, 2, 7]
    got = [model(build_forward_batch([SeqChunk(ids[:30].tolist(), 0, table, True)], BLOCK, "cpu"), kv)]
    got += [model(build_forward_batch([SeqChunk([int(ids[p])], p, table, True)], BLOCK, "cpu"), kv)
            for p in range(30, 45)]
    engine = torch.cat(got)
    hf16 = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="eager")
    with torch.no_grad():
        ref = load_hf(checkpoint)(ids[None]).logits[0].float()[29:]
        theirs = hf16.eval()(ids[None]).logits[0].float()[29:]
    err_engine, err_hf = (engine - ref).abs().max().item(), (theirs - ref).abs().max().item()
    assert err_hf > 0, "transformers' bfloat16 equals its float32: the bound is vacuous"
    assert err_engine <= 2 * err_hf, (err_engine, err_hf)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * max(err_engine, err_hf)
    assert clear.any()
    assert torch.equal(engine.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_a_safetensors_file_beside_model_safetensors_is_not_loaded(ckpt_root: Path) -> None:
    """A LoRA adapter (adapter_model.safetensors) or a consolidated copy beside the model's own
    file, no index: transformers loads model.safetensors alone, and so does the engine (it
    loaded every *.safetensors and refused the adapter's tensors)."""
    from scheduler.model.loader import safetensors_files

    d = build_llama(ckpt_root / "with_adapter")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 96)},
              str(d / "adapter_model.safetensors"))
    assert safetensors_files(d) == [d / "model.safetensors"]
    load_model(d)
