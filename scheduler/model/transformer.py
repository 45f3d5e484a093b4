"""The engine's own decoder-only transformer (Llama / Mistral / Qwen2) over a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .forward_batch import ForwardBatch
from .kv_cache import PagedKVCache
from .layers import DecoderLayer, RotaryTable, new_param, plan_attention, rms_norm


class CausalLM(nn.Module):
    """Parameters are allocated uninitialised; :func:`scheduler.model.loader.load_model` fills them."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = new_param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = new_param((cfg.hidden_size,), dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = new_param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.rope = RotaryTable(cfg.rope_inv_freq(), dtype, device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache.for_model(self.cfg, num_blocks, block_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step; returns float32 logits ``[batch.num_sampled, vocab]`` in chunk order."""
        if kv.num_layers != len(self.layers):
            raise ValueError(f"KV cache has {kv.num_layers} layers, model has {len(self.layers)}")
        x = F.embedding(batch.input_ids, self.embed_tokens)
        # Shared by all layers: gathered once per step rather than once per layer.
        cos, sin = self.rope.lookup(batch.positions, batch.max_context_len)
        plan = plan_attention(batch, self.cfg.sliding_window)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.k[i], kv.v[i], batch, plan)
        if batch.num_sampled == 0:
            return torch.empty(0, self.cfg.vocab_size, dtype=torch.float32, device=x.device)
        # Norm and LM head only on rows whose logits are needed: the vocab GEMM is the single
        # largest one for small models and most prefill rows are never sampled.
        h = rms_norm(x.index_select(0, batch.logits_indices), self.norm, self.cfg.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
