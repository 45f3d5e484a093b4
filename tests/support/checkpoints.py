"""Tiny random HF checkpoints for oracle tests (a helper module, not a test module).

Sizes are deliberately odd (head_dim != hidden / heads, GQA and MQA, vocab not a power of two)
so shape bugs cannot hide behind coincidences, and ``initializer_range`` is large so the logit
spread makes greedy decisions robust to float32 rounding differences between implementations.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

INIT_RANGE = 0.15


def _save(model: PreTrainedModel, out_dir: Path) -> Path:
    # HF initialises norm weights to exactly 1 (and biases to 0); perturb them so a norm weight
    # or bias the engine forgets to apply cannot go unnoticed.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_llama(out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """Llama-3 style: GQA 6/2, head_dim 16 (hidden 96), tied embeddings, llama3 RoPE scaling."""
    torch.manual_seed(seed)
    kw: dict[str, object] = dict(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        # Small original context so the llama3 rule hits its low, medium and high bands.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    kw.update(overrides)
    return _save(LlamaForCausalLM(LlamaConfig(**kw)), out_dir)


def build_qwen2(out_dir: Path, seed: int = 1) -> Path:
    """Qwen2: q/k/v bias (no o bias), untied lm_head, 4 heads / 2 kv heads of dim 20."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=257,
        hidden_size=80,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        eos_token_id=5,
    )
    return _save(Qwen2ForCausalLM(cfg), out_dir)


def build_mistral(out_dir: Path, seed: int = 2) -> Path:
    """Mistral: MQA (4 heads, 1 kv head), head_dim 24 != hidden/heads, sliding window 32."""
    torch.manual_seed(seed)
    cfg = MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        max_position_embeddings=512,
        sliding_window=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
    )
    return _save(MistralForCausalLM(cfg), out_dir)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llama": build_llama,
    "qwen2": build_qwen2,
    "mistral": build_mistral,
}


def set_eos(folder: Path, ids: list[int]) -> None:
    """The folder's EOS ids, in config.json and generation_config.json alike (the engine stops
    on both files' ids, as generate() and vLLM do)."""
    for name in ("config.json", "generation_config.json"):
        f = folder / name
        raw = json.loads(f.read_text()) if f.exists() else {}
        f.write_text(json.dumps({**raw, "eos_token_id": ids}))
