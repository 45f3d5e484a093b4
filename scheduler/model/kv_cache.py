"""Paged KV cache: one flat slot pool per layer, addressed by ``block_id * block_size + offset``."""

from __future__ import annotations

import torch

from . import huge_pages
from .config import ModelConfig


class PagedKVCache:
    """Per-layer K and V pools of shape ``[num_blocks * block_size, num_kv_heads, head_dim]``.

    The pool is flat (slot-major) rather than ``[num_blocks, block_size, ...]`` so that the
    forward can write new K/V with a single ``index_copy_`` and gather a sequence's context with a
    single ``index_select`` from precomputed slot ids, with no per-block Python work.
    All layers live in one allocation so that block copies touch every layer in one op.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) <= 0:
            raise ValueError("PagedKVCache dimensions must all be positive")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = num_blocks * block_size
        # [layer, k/v, slot, kv_head, head_dim]; zeros so padded gathers never read NaN garbage.
        shape = (num_layers, 2, self.num_slots, num_kv_heads, head_dim)
        # on the host, asked for on 2 MB pages (huge_pages: why); whether the kernel lent
        # them is huge_pages.backed's to say
        self.huge_pages = False
        if self.device.type == "cpu":
            self._pool, self.huge_pages = huge_pages.empty(shape, dtype)
            # The zeros are this fill's (the memory may be a freed tensor's). It also faults
            # the pool in once, now: untouched memory is lazily mapped zero pages, and gathers
            # that read them ran ~5x slower (measured) than over written memory, so step times
            # would depend on which blocks happen to be untouched.
            self._pool.fill_(0)
        else:
            self._pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k: list[torch.Tensor] = [self._pool[i, 0] for i in range(num_layers)]
        self.v: list[torch.Tensor] = [self._pool[i, 1] for i in range(num_layers)]

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagedKVCache:
        return cls(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
            device,
        )

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers (K and V), for sizing the pool from a budget."""
        return block_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, dtype)

    @property
    def pool(self) -> torch.Tensor:
        """Every layer's K and V in one tensor (where its memory lies: huge_pages)."""
        return self._pool

    @property
    def nbytes(self) -> int:
        return self._pool.numel() * self._pool.element_size()

    def slots(self, block_ids: list[int]) -> torch.Tensor:
        """Slot ids (host int64) covering whole blocks, in order."""
        b = torch.as_tensor(block_ids, dtype=torch.int64)
        return (b[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy block ``src[i]`` into ``dst[i]`` for every layer.

        All sources are read before any destination is written, so overlapping src/dst sets
        (e.g. a compaction that shifts blocks down) behave like a simultaneous move.
        """
        if len(src) != len(dst):
            raise ValueError(f"copy_blocks: {len(src)} sources vs {len(dst)} destinations")
        if not src:
            return
        if len(set(dst)) != len(dst):
            raise ValueError("copy_blocks: duplicate destination block")
        for b in (*src, *dst):
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"copy_blocks: block {b} out of range [0, {self.num_blocks})")
        s = self.slots(src).to(self.device)
        d = self.slots(dst).to(self.device)
        moved = self._pool.index_select(2, s)
        self._pool.index_copy_(2, d, moved)


def block_bytes(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes of one block: K and V of `layers` layers x `kv_heads` heads (a TP rank holds
    its share of the heads, a PP stage its layers)."""
    return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
