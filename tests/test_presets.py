"""Tests for the locally generated preset models and their tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scheduler.model import presets, tokenizer_build
from scheduler.model.presets import PRESETS, ensure_preset, resolve_model

HASHED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _digests(folder: Path) -> dict[str, str]:
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in HASHED_FILES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_preset("tiny", tmp_path_factory.mktemp("cache"))


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    a = tokenizer_build.build_tokenizer(tmp_path / "a", 512, 2048)
    b = tokenizer_build.build_tokenizer(tmp_path / "b", 512, 2048)
    assert a == b
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_tokenizer_rejects_vocab_without_room_for_bytes() -> None:
    with pytest.raises(ValueError, match="at least"):
        tokenizer_build.train_tokenizer(tokenizer_build.MIN_VOCAB_SIZE - 1)


def test_corpus_is_capped_and_ordered() -> None:
    texts = tokenizer_build.stdlib_corpus(200_000)
    assert 100_000 < sum(map(len, texts)) <= 200_000
    assert len(texts) > 20  # spread over many modules, not one big file
    assert texts == tokenizer_build.stdlib_corpus(200_000)


# ------------------------------------------------------------------ building


def test_build_is_deterministic_across_cache_dirs(tiny_dir: Path, tmp_path: Path) -> None:
    other = ensure_preset("tiny", tmp_path)
    assert other.name == tiny_dir.name
    assert _digests(other) == _digests(tiny_dir)


def test_folder_has_hf_layout(tiny_dir: Path) -> None:
    spec = PRESETS["tiny"]
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert config["hidden_act"] == "silu"
    assert config["rms_norm_eps"] == 1e-5
    assert config["attention_bias"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "tie_word_embeddings",
    ):
        assert config[field] == getattr(spec, field), field
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    manifest = json.loads((tiny_dir / presets.MANIFEST_NAME).read_text())
    assert manifest["sha256"]["model.safetensors"] == _digests(tiny_dir)["model.safetensors"]


def test_weights_follow_the_spec(tiny_dir: Path) -> None:
    spec = PRESETS["tiny"]
    w = load_file(tiny_dir / "model.safetensors")
    assert sum(t.numel() for t in w.values()) == spec.num_parameters()
    assert all(t.dtype == torch.float32 for t in w.values())
    assert torch.equal(w["model.norm.weight"], torch.ones(spec.hidden_size))
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert abs(q.std().item() - spec.initializer_range) < 0.1 * spec.initializer_range
    head = w["lm_head.weight"]
    assert head.shape == (spec.vocab_size, spec.hidden_size)
    assert abs(head[3:].std().item() - spec.lm_head_initializer_range) < 0.05
    # Special tokens can never win greedy decoding.
    assert not head[:3].any()


def test_transformers_loads_tiny_without_missing_keys(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(
        tiny_dir, output_loading_info=True, local_files_only=True
    )
    assert info["missing_keys"] in (set(), [])
    assert info["unexpected_keys"] in (set(), [])
    assert not info.get("mismatched_keys")
    ours = load_file(tiny_dir / "model.safetensors")
    theirs = model.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    text = "The scheduler batches 16 requests:\n\tdef step(self): return 42  # ünïcødé ✓"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == model.config.bos_token_id
    assert tok.eos_token_id == model.config.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert max(ids) < model.config.vocab_size

    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tied_variant_loads_without_missing_keys(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    spec = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    presets.build_preset(spec, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model, info = LlamaForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_greedy_margins_are_not_near_ties(tiny_dir: Path) -> None:
    # Guards the init scales: near-ties would let float noise decide greedy
    # tokens and make engine-vs-reference comparisons flaky.
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_dir, local_files_only=True).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, PRESETS["tiny"].vocab_size, (8, 16), generator=gen)
    margins, chosen = [], []
    with torch.inference_mode():
        for _ in range(32):
            logits = model(ids).logits[:, -1]
            top = logits.topk(2, dim=-1).values
            margins.append(top[:, 0] - top[:, 1])
            nxt = logits.argmax(-1, keepdim=True)
            chosen.append(nxt)
            ids = torch.cat([ids, nxt], dim=1)
    m = torch.cat(margins)
    assert (m < 1e-3).float().mean().item() < 0.01
    assert m.median().item() > 0.1
    toks = torch.cat(chosen)
    assert (toks >= 3).all()  # no <unk>/<s>/</s>
    assert len(set(toks.flatten().tolist())) > 16  # not stuck repeating one token


# ------------------------------------------------------------------- caching


def test_second_call_reuses_cache(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("rebuilt a cached preset")

    monkeypatch.setattr(presets, "build_preset", boom)
    assert ensure_preset("tiny", tiny_dir.parent) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_build_leaves_only_the_final_folder(tmp_path: Path) -> None:
    folder = ensure_preset("tiny", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, f".{folder.name}.lock"])
    assert folder.stat().st_mode & 0o755 == 0o755  # not mkdtemp's owner-only mode


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(spec: presets.PresetSpec) -> dict[str, torch.Tensor]:
        raise RuntimeError("killed mid-build")

    with monkeypatch.context() as m:
        m.setattr(presets, "generate_weights", fail)
        with pytest.raises(RuntimeError, match="killed"):
            ensure_preset("tiny", tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    assert presets._is_complete(ensure_preset("tiny", tmp_path))


def test_stale_temp_folder_is_swept(tmp_path: Path) -> None:
    key = presets.preset_key("tiny")
    stale = tmp_path / f".{key}.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    old = stale.stat().st_mtime - presets.STALE_TMP_SECONDS - 10
    os.utime(stale, (old, old))
    ensure_preset("tiny", tmp_path)
    assert not stale.exists()


def test_concurrent_builds_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two callers at once: one builds, the other waits on the build's lock and takes its
    folder (both built, and the one that found the folder incomplete could remove it under
    the other's load)."""
    real_build = presets.build_preset
    builds: list[Path] = []

    def slow_build(spec: presets.PresetSpec, out_dir: Path, name: str = "custom") -> None:
        builds.append(out_dir)
        time.sleep(0.5)  # the other caller arrives meanwhile (it waits either way: no assert times it)
        real_build(spec, out_dir, name)

    monkeypatch.setattr(presets, "build_preset", slow_build)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(ensure_preset("tiny", tmp_path))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 2 and results[0] == results[1] and len(builds) == 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [results[0].name]
    assert presets._is_complete(results[0])


def test_default_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MSTRACE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert presets.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("MSTRACE_CACHE_DIR")
    assert presets.default_cache_dir() == tmp_path / "xdg" / "mstrace" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert presets.default_cache_dir() == tmp_path / "home" / ".cache" / "mstrace" / "models"


def test_env_cache_dir_is_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MSTRACE_CACHE_DIR", str(tmp_path))
    assert ensure_preset("tiny").parent == tmp_path


def test_cache_key_tracks_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    key = presets.preset_key("tiny")
    assert key.startswith("tiny-")
    changed = dataclasses.replace(PRESETS["tiny"], seed=PRESETS["tiny"].seed + 1)
    monkeypatch.setitem(PRESETS, "tiny", changed)
    assert presets.preset_key("tiny") != key


# ------------------------------------------------------------- name errors


def test_unknown_preset_is_a_one_line_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as exc:
        ensure_preset("huge", tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and "'huge'" in msg
    for name in PRESETS:
        assert name in msg
    assert list(tmp_path.iterdir()) == []


def test_resolve_model(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model("tiny", tiny_dir.parent) == tiny_dir
    assert resolve_model(str(tiny_dir)) == tiny_dir
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as exc:
        resolve_model(str(missing))
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"model folder not found: {missing}")
    assert "known presets: " + ", ".join(PRESETS) in msg


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        dataclasses.replace(PRESETS["tiny"], num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        dataclasses.replace(PRESETS["tiny"], num_attention_heads=5)


# ------------------------------------------------------------------ default


def test_default_preset_builds_and_loads(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import LlamaForCausalLM

    spec = PRESETS["default"]
    folder = ensure_preset("default", tmp_path_factory.mktemp("default-cache"))
    size = (folder / "model.safetensors").stat().st_size
    assert size >= 4 * spec.num_parameters()
    _, info = LlamaForCausalLM.from_pretrained(
        folder, output_loading_info=True, local_files_only=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = json.loads((folder / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["tie_word_embeddings"] is False


def test_a_build_renamed_in_after_the_check_is_kept_not_removed(tiny_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Process A finds no complete preset; B renames its finished build into place; A then
    saw a folder under the final name and removed it, deleting B's under B's load. A looks
    again under the build lock and takes B's folder: no rebuild, B's files untouched."""
    final = tmp_path / tiny_dir.name
    shutil.copytree(tiny_dir, final)
    (final / "b.sentinel").write_text("B's build")
    real, calls = presets._is_complete, {"n": 0}

    def stale_first(folder: Path) -> bool:
        calls["n"] += 1
        return False if calls["n"] == 1 else real(folder)  # A's check, just before B's rename

    monkeypatch.setattr(presets, "_is_complete", stale_first)
    monkeypatch.setattr(presets, "build_preset", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rebuilt")))
    assert ensure_preset("tiny", tmp_path) == final
    assert (final / "b.sentinel").read_text() == "B's build" and real(final)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [final.name]
