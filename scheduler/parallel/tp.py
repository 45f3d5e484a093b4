"""Megatron-style tensor parallelism: sharding rules, per-rank config, and the layer runner.

Sharding (``tp_shard_fn``, applied tensor by tensor as the loader streams the checkpoint):

* column-parallel: ``q_proj`` rows (and bias) by query head, rank ``r`` keeping heads
  ``[r * H/tp, (r+1) * H/tp)``; ``k_proj`` / ``v_proj`` rows (and bias) by KV head (rule below);
  ``gate_proj`` / ``up_proj`` rows (and bias) in ``intermediate / tp`` blocks;
* row-parallel: the matching *columns* of ``o_proj`` and ``down_proj``.  Their outputs are partial
  sums, all-reduced before the bias, which every rank holds whole and adds once, after the sum;
* replicated: norms, the embedding and the LM head.  A vocab-parallel embedding/head would split
  the two largest matrices, but then every step needs an all-reduce after the embedding and an
  all-gather of the logits; replicated, the head runs only on the rank that samples (TP rank 0 of
  the last stage) and sampling stays local to it, with no extra collective.

KV heads.  Query head ``j`` attends with KV head ``j // G`` (``G = H / KV``).  Each rank keeps the
KV heads its own query heads map to, in a layout the grouped attention can use (each local KV
head serving an equal, contiguous run of local query heads):

* ``KV % tp == 0``: partitioned, ``KV / tp`` heads per rank (no duplication);
* ``tp % KV == 0`` (incl. MQA, ``KV < tp``): replicated, one KV head per rank, each head on
  ``tp / KV`` ranks;
* otherwise (e.g. ``H=6, KV=3, tp=2``: rank 0's queries use KV heads 0, 0, 1): expanded, one KV
  head per local query head (repeats allowed).  Correct for any shape, at the cost of KV-cache
  memory; it is the only case that stores a KV head more than once on a rank.

``tp_config`` turns the model config into these per-rank shapes, which the model allocates and
the loader checks every sliced tensor against.

Comm/compute overlap (``TPRunner.overlap``): the batch's rows are split at a sequence boundary
into two micro-batches A and B (attention is per sequence, every other op is row-wise), and each
layer runs ``attn(A) -> issue AR(A) | attn(B) -> issue AR(B) | wait AR(A) -> mlp(A) -> issue |
wait AR(B) -> mlp(B) -> issue``, with the MLP all-reduces waited at the start of the next layer:
while one micro-batch's all-reduce is in flight the other computes.  A batch with one sequence has
nothing independent and runs with synchronous all-reduces (``TPRunner.sync_fallbacks``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch

from scheduler.model.config import ModelConfig, ModelLoadError
from scheduler.model.forward_batch import ForwardBatch, PrefillAttn
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.layers import DecoderLayer, add_bias, plan_attention
from scheduler.model.loader import ShardFn
from scheduler.model.transformer import CausalLM

from .comm import AllReduce, PendingAllReduce


def validate_tp(cfg: ModelConfig, tp_size: int) -> None:
    if tp_size < 1:
        raise ModelLoadError(f"tp_size must be >= 1, got {tp_size}")
    arch = cfg.architecture
    if cfg.num_attention_heads % tp_size:
        raise ModelLoadError(
            f"{arch}: {cfg.num_attention_heads} attention heads not divisible by tp_size {tp_size}"
        )
    if cfg.intermediate_size % tp_size:
        raise ModelLoadError(
            f"{arch}: intermediate_size {cfg.intermediate_size} not divisible by tp_size {tp_size}"
        )


def kv_heads_for_rank(cfg: ModelConfig, tp_rank: int, tp_size: int) -> list[int]:
    """Checkpoint KV-head indices rank ``tp_rank`` keeps, in local order (see module docstring)."""
    validate_tp(cfg, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    local_q = heads // tp_size
    group = heads // kv
    if kv % tp_size == 0:  # partitioned
        per = kv // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % kv == 0:  # replicated: all local query heads fall into one KV group
        return [tp_rank * local_q // group]
    # expanded: one (possibly repeated) KV head per local query head
    return [(tp_rank * local_q + i) // group for i in range(local_q)]


def tp_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """Per-rank shapes: heads, KV heads and intermediate size as one TP rank holds them."""
    validate_tp(cfg, tp_size)
    if tp_size == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp_size,
        num_key_value_heads=len(kv_heads_for_rank(cfg, 0, tp_size)),  # same count on every rank
        intermediate_size=cfg.intermediate_size // tp_size,
    )


def tp_shard_fn(cfg: ModelConfig, tp_rank: int, tp_size: int) -> ShardFn:
    """Slice each checkpoint tensor (by its HF name) to rank ``tp_rank``'s part; ``cfg`` is the
    full model's config.  Returns views where possible: the loader copies them into place."""
    hd = cfg.head_dim
    local_q = cfg.num_attention_heads // tp_size
    q0, q1 = tp_rank * local_q * hd, (tp_rank + 1) * local_q * hd
    kv_heads = kv_heads_for_rank(cfg, tp_rank, tp_size)
    kv_rows = (torch.tensor(kv_heads)[:, None] * hd + torch.arange(hd)).reshape(-1)
    kv_contiguous = kv_heads == list(range(kv_heads[0], kv_heads[0] + len(kv_heads)))
    inter = cfg.intermediate_size // tp_size
    i0, i1 = tp_rank * inter, (tp_rank + 1) * inter

    def shard(name: str, t: torch.Tensor) -> torch.Tensor:
        if not name.startswith("model.layers."):
            return t  # embedding, final norm, lm_head: replicated
        module, kind = name.split(".")[-2:]
        if module == "q_proj":
            return t[q0:q1]
        if module in ("k_proj", "v_proj"):
            if kv_contiguous:
                return t[kv_heads[0] * hd : (kv_heads[-1] + 1) * hd]
            return t.index_select(0, kv_rows)
        if module in ("gate_proj", "up_proj"):
            return t[i0:i1]
        if kind == "bias":  # o_proj / down_proj bias: whole, added once after the all-reduce
            return t
        if module == "o_proj":
            return t[:, q0:q1]
        if module == "down_proj":
            return t[:, i0:i1]
        return t  # layer norms

    return shard


# ----------------------------------------------------------------------------- overlap


def split_row(batch: ForwardBatch) -> int | None:
    """A row at a sequence boundary that halves the batch's tokens best; None with one sequence.

    Decode rows are one sequence each, so every decode row boundary qualifies; a prefill chunk
    is never cut (its rows attend to each other within the layer).
    """
    if batch.num_seqs < 2:
        return None
    cands: list[int] = [*range(1, batch.num_decode), *(p.row_start for p in batch.prefills)]
    cands = [c for c in cands if 0 < c < batch.num_tokens]
    if not cands:
        return None
    half = batch.num_tokens / 2
    return min(cands, key=lambda c: abs(c - half))


def slice_batch(batch: ForwardBatch, r0: int, r1: int) -> ForwardBatch:
    """Rows ``[r0, r1)`` of ``batch`` as a batch of their own; both ends at sequence boundaries.

    Attention-only view: ``logits_indices`` is empty (logits are computed on the re-joined rows)
    and ``max_context_len`` stays the parent's, an upper bound (it only sizes the RoPE table and
    lets ``plan_attention`` skip the sliding-window masks, which stay correct when not skipped).
    """
    nd = batch.num_decode
    d0, d1 = min(r0, nd), min(r1, nd)
    prefills = [
        PrefillAttn(p.row_start - r0, p.row_end - r0, p.start_pos, p.ctx_blocks, p.mask)
        for p in batch.prefills
        if r0 <= p.row_start and p.row_end <= r1
    ]
    dec = d1 > d0
    return ForwardBatch(
        input_ids=batch.input_ids[r0:r1],
        positions=batch.positions[r0:r1],
        slot_mapping=batch.slot_mapping[r0:r1],
        logits_indices=batch.logits_indices[:0],
        num_tokens=r1 - r0,
        num_seqs=(d1 - d0) + len(prefills),
        num_sampled=0,
        num_decode=d1 - d0,
        decode_blocks=(
            batch.decode_blocks[d0:d1] if dec and batch.decode_blocks is not None else None
        ),
        decode_mask=batch.decode_mask[d0:d1] if dec and batch.decode_mask is not None else None,
        decode_groups=None,  # one length group over the slice's decode rows
        prefills=prefills,
        max_context_len=batch.max_context_len,
        block_size=batch.block_size,
    )


@dataclass(slots=True)
class TPRunner:
    """Runs a TP rank's decoder layers; ``overlap`` hides all-reduces behind the other half."""

    model: CausalLM
    comm: AllReduce
    overlap: bool = False
    sync_fallbacks: int = 0  # overlapped steps that had one sequence and ran synchronously

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        if self.overlap:
            row = split_row(batch)
            if row is not None:
                return self._run_overlapped(x, batch, kv, row)
            self.sync_fallbacks += 1
        # The layers' own hook (this runner's AllReduce, called synchronously).
        return self.model.run_layers(x, batch, kv)

    def _run_overlapped(
        self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache, row: int
    ) -> torch.Tensor:
        model, comm = self.model, self.comm
        model.check_kv(kv)
        cos, sin, _ = model.attention_inputs(batch)
        bounds = ((0, row), (row, batch.num_tokens))
        mbs = [slice_batch(batch, a, b) for a, b in bounds]
        plans = [plan_attention(mb, model.cfg.sliding_window, model.dtype, model.cfg.head_dim) for mb in mbs]
        rope = [(cos[a:b], sin[a:b]) for a, b in bounds]
        xs = [x[a:b] for a, b in bounds]
        pending: list[PendingAllReduce | None] = [None, None]
        prev_down_bias: torch.Tensor | None = None
        for i, layer in enumerate(cast(list[DecoderLayer], list(model.layers))):
            kc, vc = kv.k[i], kv.v[i]
            for m in (0, 1):
                p = pending[m]
                if p is not None:  # the previous layer's MLP all-reduce, hidden behind attn
                    xs[m] = xs[m] + add_bias(comm.wait(p), prev_down_bias)
                c, s = rope[m]
                partial = layer.attn_partial(xs[m], c, s, kc, vc, mbs[m], plans[m])
                pending[m] = comm.issue(partial)
            for m in (0, 1):
                p = pending[m]
                assert p is not None
                xs[m] = xs[m] + add_bias(comm.wait(p), layer.o_bias)
                pending[m] = comm.issue(layer.mlp_partial(xs[m]))
            prev_down_bias = layer.down_bias
        for m in (0, 1):
            p = pending[m]
            if p is not None:
                xs[m] = xs[m] + add_bias(comm.wait(p), prev_down_bias)
        return torch.cat(xs)
