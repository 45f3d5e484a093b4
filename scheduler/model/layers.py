"""Building blocks of the engine forward: RMSNorm, RoPE, paged attention, the decoder layer.

Weights are stored fused (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows) so that each
layer runs 4 GEMMs instead of 7; the loader fills the fused tensors slice by slice.

Under tensor parallelism (``scheduler.parallel``) a layer holds this rank's heads and MLP columns,
so ``o_proj`` and ``down_proj`` produce partial sums: the optional ``all_reduce`` hook given at
construction sums them across the TP group before the (replicated) row-parallel bias is added.
Without a hook the forward is exactly the single-process one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import native_attention, native_elementwise, packed_gemm
from .config import ModelConfig
from .forward_batch import ForwardBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers (fp32 statistics, cast back, then scale) so logits match.
    out = native_elementwise.rms_norm(x, weight, eps)  # one pass in C on the CPU (float32, bfloat16)
    if out is not None:
        return out
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryTable:
    """cos / signed-sin tables indexed by absolute position, grown lazily by doubling.

    ``sin`` carries the sign of ``rotate_half`` (-sin for the first half), so applying RoPE is
    ``x * cos + x.roll(half) * sin``: one fused expression, bit-identical to transformers'
    ``x * cos + rotate_half(x) * sin``.

    The two streams of split scheduling run forwards on two threads over one table, so the
    pair is swapped as one tuple, under a lock, and never for a shorter one: a caller that
    holds the pair `tables` returned keeps it alive and whole while another forward grows it
    (a C call reading its rows holds that pair; reading the attributes twice could get a
    table grown and freed between the two reads).
    """

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.dtype = dtype
        self.device = device
        empty = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype, device=device)
        self._pair: tuple[torch.Tensor, torch.Tensor] = (empty, empty)
        self._grow = threading.Lock()

    def tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [rows >= length, head_dim]."""
        pair = self._pair
        if length <= pair[0].shape[0]:
            return pair
        with self._grow:
            pair = self._pair  # another thread may have grown it while this one waited
            if length <= pair[0].shape[0]:
                return pair
            cap = max(256, pair[0].shape[0])
            while cap < length:
                cap *= 2
            pos = torch.arange(cap, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            half = freqs.shape[-1]
            sign = torch.ones(2 * half, device=self.device)
            sign[:half] = -1.0
            self._pair = pair = (emb.cos().to(self.dtype), (emb.sin() * sign).to(self.dtype))
            return pair

    def lookup(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        cos, sin = self.tables(max_len)
        # index_select, not advanced indexing: the latter is several times slower on CPU.
        return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rope_qk(qkv: torch.Tensor, q_kv_size: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the q and k heads of a qkv GEMM's output, [T, heads + kv_heads, head_dim]:
    in place in one C pass on the CPU (the same values: the products and the sum round as
    torch's do), else `apply_rope` on q and k together (one expression, not two)."""
    qk = qkv[:, :q_kv_size].view(qkv.shape[0], -1, head_dim)
    return qk if native_elementwise.rope_(qk, cos, sin) else apply_rope(qk, cos, sin)


def rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RoPE on a qkv GEMM's output and its new K/V rows stored at `slots` of the caches: q
    [T, heads, D], k and v [T, kv_heads, D], views of qkv where the C call did it (one call for
    what is otherwise RoPE and two index_copy_), else RoPE'd by `rope_qk`."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, heads + 2 * kv_heads, head_dim).split_with_sizes([heads, kv_heads, kv_heads], dim=1)
    if not native_elementwise.rope_kv(qkv, heads, kv_heads, head_dim, cos, sin, k_cache, v_cache, slots):
        qk = rope_qk(qkv, (heads + kv_heads) * head_dim, head_dim, cos, sin)
        q, k = qk[:, :heads], qk[:, heads:]
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)
    return q, k, v


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` of a gate/up GEMM's output [T, 2 * inter]: in one C pass where torch's
    AVX-512 kernels run, or its AVX2 ones in float32 (the same bits), else torch's two ops."""
    out = native_elementwise.silu_mul(gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after an add and its RMSNorm: (x + y, rms_norm(x + y)), in one C
    call where it applies, with the same values as the two ops."""
    joined = native_elementwise.add_rms_norm(x, y, weight, eps)
    if joined is not None:
        return joined
    total = x + y
    return total, rms_norm(total, weight, eps)


@dataclass(slots=True)
class AttnPlan:
    """Per-forward attention masks, shared by all layers (built once, not per layer)."""

    decode_mask: torch.Tensor | None
    # None where the prefill chunks run in C (`prefill_keys`), until a call falls back to SDPA
    prefill_masks: list[torch.Tensor | None] | None
    decode_ctx: torch.Tensor | None = None  # [D] int64 context lengths of the decode rows
    window: int | None = None  # the sliding window, where some context exceeds it
    # native_attention.prefill's tables of the chunks' keys, where the C kernel takes this batch
    prefill_keys: tuple[torch.Tensor, torch.Tensor] | None = None


def plan_attention(
    batch: ForwardBatch, sliding_window: int | None, dtype: torch.dtype = torch.float32, head_dim: int | None = None
) -> AttnPlan:
    """Masks from the batch, narrowed by the sliding window only when some context exceeds it,
    as additive float masks: CPU SDPA ran ~1.6x faster with them than with bool masks. Where
    the prefill chunks can run in C (this dtype, device and `head_dim`), their key tables instead
    of their masks."""
    ctx = batch.positions[: batch.num_decode] + 1 if batch.num_decode else None
    w = sliding_window if sliding_window is not None and batch.max_context_len > sliding_window else None
    dmask = batch.decode_mask
    if w is not None and dmask is not None and batch.decode_blocks is not None:
        q_pos = batch.positions[: batch.num_decode]
        k_pos = torch.arange(batch.decode_blocks.shape[1] * batch.block_size, device=q_pos.device)
        dmask = dmask & (k_pos[None, :] > q_pos[:, None] - w)[:, None, None, :]
    keys = None
    if batch.prefills and native_attention.prefill_takes(dtype, batch.positions.device, head_dim):
        keys = native_attention.prefill_keys(
            [(p.row_start, p.row_end - p.row_start, p.start_pos, p.ctx_blocks) for p in batch.prefills],
            batch.slot_mapping, batch.num_decode, batch.block_size)
    masks = None if keys is not None else prefill_masks(batch, w, dtype)
    return AttnPlan(_additive(dmask, dtype), masks, ctx, w, keys)


def prefill_masks(batch: ForwardBatch, window: int | None, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Each prefill chunk's additive mask for SDPA (None: plain causal), narrowed to `window`."""
    pmasks: list[torch.Tensor | None] = []
    for p in batch.prefills:
        n = p.row_end - p.row_start
        if window is None or p.start_pos + n <= window:
            pmasks.append(p.mask)
            continue
        q_pos = torch.arange(p.start_pos, p.start_pos + n, device=batch.positions.device)
        nkeys = p.ctx_blocks.numel() * batch.block_size if p.ctx_blocks is not None else n
        k_pos = torch.arange(nkeys, device=q_pos.device)
        diff = q_pos[:, None] - k_pos[None, :]
        pmasks.append((diff >= 0) & (diff < window))
    return [_additive(m, dtype) for m in pmasks]


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    plan: AttnPlan,
) -> torch.Tensor:
    """q [T, H, D]; k_new/v_new [T, KVH, D] (already written to the cache) -> [T, H * D]: the
    decode rows' attention, then the prefill rows'."""
    return join_rows(decode_attention(q, k_cache, v_cache, batch, plan)
                     + prefill_attention(q, k_new, v_new, k_cache, v_cache, batch, plan))


def join_rows(outs: list[torch.Tensor]) -> torch.Tensor:
    """The row blocks `decode_attention` and `prefill_attention` return, in order, as one [T, H * D]."""
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _block_view(cache: torch.Tensor, bs: int) -> torch.Tensor:
    """The cache as whole blocks: a gather index is a block (bs * KVH * hd values)."""
    return cache.view(-1, bs * cache.shape[1] * cache.shape[2])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                     plan: AttnPlan) -> list[torch.Tensor]:
    """The decode rows' (q's first `num_decode`) outputs, each row's context read once where it
    lies (C, float32 or bfloat16 on the CPU), else gathered per length group for SDPA; [] for none."""
    nd = batch.num_decode
    if not nd:
        return []
    _, h, d = q.shape
    kvh = k_cache.shape[1]
    bs = batch.block_size
    assert batch.decode_blocks is not None and plan.decode_ctx is not None
    native = native_attention.decode(q[:nd], k_cache, v_cache, batch.decode_blocks, plan.decode_ctx, bs, plan.window)
    if native is not None:
        return [native]
    assert plan.decode_mask is not None
    kb, vb = _block_view(k_cache, bs), _block_view(v_cache, bs)
    # Fold the query heads of each KV group into the "query length" axis: [D, KVH, G, hd]
    # attends against [D, KVH, L, hd] with no K/V head replication.
    qd = q[:nd].reshape(nd, kvh, h // kvh, d)
    outs = []
    for r0, r1, nblk in batch.decode_groups or [(0, nd, batch.decode_blocks.shape[1])]:
        flat = batch.decode_blocks[r0:r1, :nblk].reshape(-1)
        ctx_shape = (r1 - r0, nblk * bs, kvh, d)
        kd = kb.index_select(0, flat).view(ctx_shape).transpose(1, 2)
        vd = vb.index_select(0, flat).view(ctx_shape).transpose(1, 2)
        mask = plan.decode_mask[r0:r1, :, :, : nblk * bs]
        o = F.scaled_dot_product_attention(qd[r0:r1], kd, vd, attn_mask=mask)
        outs.append(o.reshape(r1 - r0, h * d))
    return outs


def prefill_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, batch: ForwardBatch, plan: AttnPlan) -> list[torch.Tensor]:
    """The prefill rows' (q's rows past `num_decode`) outputs: one C call over every chunk where it
    takes them, else SDPA chunk by chunk; [] for none."""
    if not batch.prefills:
        return []
    _, h, d = q.shape
    kvh = k_new.shape[1]
    if plan.prefill_keys is not None:
        slots, meta = plan.prefill_keys
        pre = native_attention.prefill(q, k_cache, v_cache, slots, meta, batch.num_tokens - batch.num_decode,
                                       plan.window)
        if pre is not None:
            return [pre]
    if plan.prefill_masks is None:  # the C call refused (a buffer, a thread, q's layout): SDPA, as without it
        plan.prefill_masks = prefill_masks(batch, plan.window, q.dtype)
    if any(p.ctx_blocks is not None for p in batch.prefills):
        kb, vb = _block_view(k_cache, batch.block_size), _block_view(v_cache, batch.block_size)
    outs = []
    for p, pmask in zip(batch.prefills, plan.prefill_masks, strict=True):
        qp = q[p.row_start : p.row_end].transpose(0, 1)[None]
        if p.ctx_blocks is None:
            kp, vp = k_new[p.row_start : p.row_end], v_new[p.row_start : p.row_end]
        else:
            kp = kb.index_select(0, p.ctx_blocks).view(-1, kvh, d)
            vp = vb.index_select(0, p.ctx_blocks).view(-1, kvh, d)
        kp = kp.transpose(0, 1)[None]
        vp = vp.transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=pmask, is_causal=pmask is None, enable_gqa=kvh != h
        )
        outs.append(o[0].transpose(0, 1).reshape(-1, h * d))
    return outs


# Sums a row-parallel partial output across the tensor-parallel group (in place or not) and
# returns the sum; see scheduler.parallel.comm.AllReduce.
AllReduceFn = Callable[[torch.Tensor], torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        all_reduce: AllReduceFn | None = None,
    ) -> None:
        super().__init__()
        hs, qs, kvs, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = qs, kvs
        self.all_reduce = all_reduce

        def p(present: bool, *shape: int) -> nn.Parameter | None:
            return new_param(shape, dtype, device) if present else None

        self.input_layernorm = new_param((hs,), dtype, device)
        self.post_attention_layernorm = new_param((hs,), dtype, device)
        self.qkv_proj = new_param((qs + 2 * kvs, hs), dtype, device)
        self.qkv_bias = p(cfg.attention_bias, qs + 2 * kvs)
        self.o_proj = new_param((hs, qs), dtype, device)
        self.o_bias = p(cfg.o_proj_bias, hs)
        self.gate_up_proj = new_param((2 * inter, hs), dtype, device)
        self.gate_up_bias = p(cfg.mlp_bias, 2 * inter)
        self.down_proj = new_param((hs, inter), dtype, device)
        self.down_bias = p(cfg.mlp_bias, hs)
        # each projection's weight reordered once for the CPU's GEMM (`pack`); empty: F.linear
        self.packs: dict[str, torch.Tensor] = {}

    def pack(self) -> None:
        """Reorder the projections' weights for packed_gemm (after the loader filled them)."""
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            self.packs[name] = packed_gemm.pack(weight)
            packed_gemm.free_dense(weight)

    def _linear(self, x: torch.Tensor, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        packed = self.packs.get(name)
        return F.linear(x, weight, bias) if packed is None else packed_gemm.linear(x, packed, bias)

    def attention_core(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        plan: AttnPlan,
    ) -> torch.Tensor:
        """Norm, q/k/v, RoPE, KV write and attention: ``[T, q_size]``, the input of ``o_proj``."""
        qkv = self._linear(rms_norm(x, self.input_layernorm, self.eps), "qkv_proj", self.qkv_proj, self.qkv_bias)
        q, k, v = rope_store(qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin, k_cache, v_cache,
                             batch.slot_mapping)
        return paged_attention(q, k, v, k_cache, v_cache, batch, plan)

    def mlp_core(self, x: torch.Tensor) -> torch.Tensor:
        """Norm, gate/up and SiLU-gating: ``[T, intermediate]``, the input of ``down_proj``."""
        return self.gated(rms_norm(x, self.post_attention_layernorm, self.eps))

    def gated(self, h: torch.Tensor) -> torch.Tensor:
        """Gate/up on normed rows and SiLU-gating: ``[T, intermediate]``."""
        packed = self.packs.get("gate_up_proj")
        fused = None if packed is None else packed_gemm.gated(h, packed, self.gate_up_bias)
        if fused is not None:
            return fused
        return silu_gate(self._linear(h, "gate_up_proj", self.gate_up_proj, self.gate_up_bias))

    # The row-parallel halves without their bias: under TP these are the partial sums that go
    # through the all-reduce, and the bias is added once to the sum (``add_bias``).
    def attn_partial(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        plan: AttnPlan,
    ) -> torch.Tensor:
        attn = self.attention_core(x, cos, sin, k_cache, v_cache, batch, plan)
        return self._linear(attn, "o_proj", self.o_proj, None)

    def mlp_partial(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(self.mlp_core(x), "down_proj", self.down_proj, None)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        plan: AttnPlan,
    ) -> torch.Tensor:
        reduce = self.all_reduce
        if reduce is None:  # single rank: fused GEMM + bias, exactly the pre-TP forward
            o = self._linear(self.attention_core(x, cos, sin, k_cache, v_cache, batch, plan), "o_proj", self.o_proj,
                             self.o_bias)
            x, h = add_norm(x, o, self.post_attention_layernorm, self.eps)
            return x + self._linear(self.gated(h), "down_proj", self.down_proj, self.down_bias)
        # Reduce before the bias: every rank holds the full bias, adding it pre-reduce would
        # count it tp_size times.
        partial = self.attn_partial(x, cos, sin, k_cache, v_cache, batch, plan)
        x = x + add_bias(reduce(partial), self.o_bias)
        return x + add_bias(reduce(self.mlp_partial(x)), self.down_bias)


def add_bias(t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return t if bias is None else t + bias


def new_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """Uninitialised inference-only parameter; the loader fills it."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
