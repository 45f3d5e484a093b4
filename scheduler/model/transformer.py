"""The engine's own decoder-only transformer (Llama / Mistral / Qwen2) over a paged KV cache.

A :class:`CausalLM` may hold only part of the network (:class:`ModelPart`: a pipeline stage's
layer range, with or without the embedding and the head); ``forward`` needs the whole network,
and ``embed`` / ``run_layers`` / ``compute_logits`` are the pieces a pipeline stage composes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import huge_pages, native_layers, packed_gemm
from .config import ModelConfig, ModelPart
from .forward_batch import ForwardBatch
from .kv_cache import PagedKVCache
from .layers import (
    AllReduceFn,
    AttnPlan,
    DecoderLayer,
    RotaryTable,
    new_param,
    plan_attention,
    rms_norm,
)


class CausalLM(nn.Module):
    """Parameters are allocated uninitialised; :func:`scheduler.model.loader.load_model` fills them.

    ``all_reduce`` (tensor parallelism only) is handed to every layer to sum its row-parallel
    partial outputs; ``None`` (one rank) costs nothing.
    """

    embed_tokens: nn.Parameter | None
    norm: nn.Parameter | None
    lm_head: nn.Parameter | None

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        part: ModelPart | None = None,
        all_reduce: AllReduceFn | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        part = part or ModelPart.whole(cfg)
        part.validate(cfg)
        self.cfg = cfg
        self.part = part
        self.dtype = dtype
        vh = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = new_param(vh, dtype, device) if part.embed else None
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, device, all_reduce) for _ in range(part.num_layers)
        )
        self.norm = new_param((cfg.hidden_size,), dtype, device) if part.head else None
        if not part.head:
            self.lm_head = None
        elif cfg.tie_word_embeddings and self.embed_tokens is not None:
            self.lm_head = self.embed_tokens
        else:  # untied, or tied but the embedding lives on another pipeline stage
            self.lm_head = new_param(vh, dtype, device)
        self.rope = RotaryTable(cfg.rope_inv_freq(), dtype, device)
        self.lm_head_packed: torch.Tensor | None = None  # pack_weights
        # each layer's weights for a decode round's layers in one C call (pack_weights)
        self.decode_weights: native_layers.DecodeWeights | None = None
        self.weights_collapsed = 0  # bytes of weights on 2 MB pages at load (loader: huge_pages.advise)

    def pack_weights(self) -> None:
        """Every projection and the LM head reordered once for the CPU's GEMM (packed_gemm),
        after the loader filled them."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.pack()
        if self.lm_head is not None:
            self.lm_head_packed = packed_gemm.pack(self.lm_head)
            if self.lm_head is not self.embed_tokens:  # tied: the embedding still reads the table
                packed_gemm.free_dense(self.lm_head)
        self.decode_weights = native_layers.weights_table(self)

    def weight_spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of every weight the forward reads: the parameters still dense and
        the reordered ones (pack_weights)."""
        held: list[torch.Tensor] = [p for p in self.parameters() if p.numel()]
        held += [t for layer in self.layers for t in layer.packs.values()]  # type: ignore[operator]
        if self.lm_head_packed is not None:
            held.append(self.lm_head_packed)
        return [huge_pages.span(t) for t in held]

    def pages(self, kv: PagedKVCache) -> str | None:
        """What this model's weights and `kv`'s pool got on the host (huge_pages.summary); None on a GPU."""
        if self.device.type != "cpu":
            return None
        return huge_pages.summary(kv.pool, sum(n for _, n in self.weight_spans()), self.weights_collapsed)

    @property
    def device(self) -> torch.device:
        return self.rope.device

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        # len(self.layers), not cfg.num_hidden_layers: a pipeline stage caches only its layers.
        cfg = self.cfg
        return PagedKVCache(
            len(self.layers),
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run one step; returns float32 logits ``[batch.num_sampled + batch.num_scored, vocab]``
        (the rows of ``batch.logits_indices``)."""
        return self.compute_logits(self.run_layers(self.embed(batch), batch, kv), batch)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        if self.embed_tokens is None:
            raise RuntimeError("this model part has no embedding (not the first pipeline stage)")
        return F.embedding(batch.input_ids, self.embed_tokens)

    def attention_inputs(
        self, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttnPlan]:
        """RoPE cos/sin ``[T, 1, head_dim]`` and the attention plan, shared by all layers."""
        # Gathered once per step rather than once per layer.
        cos, sin = self.rope.lookup(batch.positions, batch.max_context_len)
        # self.dtype, not embed_tokens.dtype: later pipeline stages hold no embedding.
        return cos, sin, plan_attention(batch, self.cfg.sliding_window, self.dtype, self.cfg.head_dim)

    def check_kv(self, kv: PagedKVCache) -> None:
        if kv.num_layers != len(self.layers):
            raise ValueError(f"KV cache has {kv.num_layers} layers, model has {len(self.layers)}")

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """This part's decoder layers over hidden states ``x [T, hidden]``."""
        self.check_kv(kv)
        if self.decode_weights is not None:  # a decode round on AMX: the layers in one C call where it applies
            out = native_layers.decode_layers(self, x, batch, kv, self.decode_weights)
            if out is not None:
                return out
        cos, sin, plan = self.attention_inputs(batch)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.k[i], kv.v[i], batch, plan)
        return x

    def compute_logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final norm + LM head on the sampled and scored rows: float32 ``[len(logits_indices), vocab]``."""
        if self.norm is None or self.lm_head is None:
            raise RuntimeError("this model part has no LM head (not the last pipeline stage)")
        if batch.num_sampled + batch.num_scored == 0:
            return torch.empty(0, self.cfg.vocab_size, dtype=torch.float32, device=x.device)
        # Norm and LM head only on rows whose logits are needed: the vocab GEMM is the single
        # largest one for small models and most prefill rows are never sampled.
        h = rms_norm(x.index_select(0, batch.logits_indices), self.norm, self.cfg.rms_norm_eps)
        return self.head_gemm(h).float()

    def head_gemm(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's GEMM on normed rows, on the reordered weight where `pack_weights` made one."""
        assert self.lm_head is not None
        packed = self.lm_head_packed
        return F.linear(h, self.lm_head) if packed is None else packed_gemm.linear(h, packed, None)
