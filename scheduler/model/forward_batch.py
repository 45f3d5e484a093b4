"""Host-side description of one forward step, turned into device index tensors.

Layout
------
Tokens are **ragged**: every chunk's new tokens are concatenated into one ``[T]`` row axis with no
padding.  Embedding, the q/k/v, o, gate/up and down projections, the norms and RoPE are all
row-wise, so they run once over ``T`` rows; the GEMMs dominate a step's FLOPs and padding them to
a rectangle would waste work proportional to the length spread of the batch.

Rows are **regrouped, not in chunk order**: all decode chunks (one new token) come first, rows
``[0, num_decode)``, followed by each prefill chunk (more than one new token) as a contiguous row
range.  Row order is free for the row-wise layers and it lets attention address both groups by
slicing instead of gathering/scattering rows.  ``logits_indices`` maps back to chunk order: the
model returns logits for the ``sample=True`` chunks in the order they were passed in.

Attention is the only per-sequence op:

* every decode row is handled by **one** padded SDPA call: each sequence's context is
  gathered a whole KV block at a time (``decode_blocks [D, nblk]``) with a key mask
  ``decode_mask [D, 1, 1, nblk * block_size]``.  Decode
  attention is tiny per sequence, so one batched call keeps the kernel launch count (and the
  Python overhead, which dominates on CPU) independent of the batch size;
* each prefill chunk gets its own SDPA call over its cached prefix plus itself, with a causal
  mask offset by ``start_pos``.  Chunks are long enough that per-chunk launch overhead is noise,
  and no padding is spent on length mismatches between prompts.  A chunk starting at position 0
  attends only to its own fresh K/V, so it skips the cache gather and uses ``is_causal``.

Everything is computed here on the host ("prepare") and copied to the device in one transfer per
dtype, so a later overlap mode can run this for step N+1 while the device computes step N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from scheduler.model.h2d import host_to_device


@dataclass(slots=True)
class SeqChunk:
    """One request's slice of work in this step."""

    token_ids: list[int]  # new tokens this step (len >= 1)
    start_pos: int  # absolute position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]  # KV block ids covering [0, start_pos + len(token_ids)), in order
    sample: bool  # logits for the last token are needed (decode, or the last prefill chunk)
    # Prompt logprobs: the chunk's first len(score_targets) rows are scored, row i against
    # score_targets[i] (the prompt token after it, which may lie in the next chunk).
    score_targets: Sequence[int] = ()


@dataclass(slots=True)
class PrefillAttn:
    """Attention work for one multi-token chunk occupying rows ``[row_start, row_end)``."""

    row_start: int
    row_end: int
    start_pos: int
    # Blocks covering positions [0, start_pos + n) to gather K/V from, whole blocks at a
    # time; None when start_pos == 0 (the chunk's own fresh K/V are the whole context).
    ctx_blocks: torch.Tensor | None
    # [n, len(ctx_blocks) * block_size] bool, True = attend; None means plain causal.
    mask: torch.Tensor | None


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, decode rows first, then prefill chunks
    positions: torch.Tensor  # [T] int64 absolute positions
    slot_mapping: torch.Tensor  # [T] int64 cache slot each row's new K/V is written to
    # [num_sampled + num_scored] int64 rows: the sample=True chunks' last rows in chunk order,
    # then the scored rows (SeqChunk.score_targets) in chunk order
    logits_indices: torch.Tensor
    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_decode: int  # decode rows are [0, num_decode)
    # Context gathered a whole block at a time: one 16-token row of the cache per index is
    # ~5x faster than gathering slot by slot (measured with index_select on CPU).
    decode_blocks: torch.Tensor | None  # [D, nblk] int64 block ids (padding -> block 0, masked)
    decode_mask: torch.Tensor | None  # [D, 1, 1, nblk * block_size] bool key mask
    # (row0, row1, nblk) per length group of the (longest-first) decode rows; attention
    # slices decode_blocks[row0:row1, :nblk]. None: one group over all decode rows.
    decode_groups: list[tuple[int, int, int]] | None
    prefills: list[PrefillAttn]
    max_context_len: int  # max over chunks of start_pos + len(token_ids) (host int, no sync)
    block_size: int = 16
    num_scored: int = 0
    score_targets: torch.Tensor | None = None  # [num_scored] int64: the token each scored row is scored against


def _slot(block_table: list[int], pos: int, block_size: int) -> int:
    return block_table[pos // block_size] * block_size + pos % block_size


def build_forward_batch(
    chunks: list[SeqChunk], block_size: int, device: torch.device | str
) -> ForwardBatch:
    """Flatten ``chunks`` into device index tensors (see module docstring for the layout)."""
    if not chunks:
        raise ValueError("build_forward_batch: empty batch")
    device = torch.device(device)
    decodes: list[tuple[int, SeqChunk]] = []
    prefill_chunks: list[tuple[int, SeqChunk]] = []
    max_ctx = 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"chunk {i}: token_ids is empty")
        if c.start_pos < 0:
            raise ValueError(f"chunk {i}: negative start_pos")
        end = c.start_pos + n
        if len(c.block_table) * block_size < end:
            raise ValueError(
                f"chunk {i}: block_table of {len(c.block_table)} blocks cannot hold {end} tokens"
            )
        max_ctx = max(max_ctx, end)
        (decodes if n == 1 else prefill_chunks).append((i, c))
    # Longest context first (the seed: sort by valid_len to cut padding), so the
    # decode rows can be attended in a few length groups, each padded only to its own max.
    decodes.sort(key=lambda ic: -ic[1].start_pos)
    if not prefill_chunks and not any(c.score_targets for c in chunks):
        return _decode_batch(chunks, decodes, block_size, device, max_ctx)
    return _mixed_batch(chunks, decodes, prefill_chunks, block_size, device, max_ctx)


def _decode_batch(chunks: list[SeqChunk], decodes: list[tuple[int, SeqChunk]], block_size: int,
                  device: torch.device, max_ctx: int) -> ForwardBatch:
    """A batch of decode rows only (most rounds), laid out as `_mixed_batch` lays it out: its
    indices from one Python list in one tensor, where the general path's per-part tensors,
    joins and splits cost a one-row batch 76 us (the forward is about 300 us)."""
    d = len(decodes)
    row = {i: r for r, (i, _) in enumerate(decodes)}
    nblk = (max_ctx + block_size - 1) // block_size
    flat = [c.token_ids[0] for _, c in decodes]
    flat += [c.start_pos for _, c in decodes]
    flat += [_slot(c.block_table, c.start_pos, block_size) for _, c in decodes]
    logits_rows = [row[i] for i, c in enumerate(chunks) if c.sample]
    flat += logits_rows
    for _, c in decodes:
        flat += c.block_table[:nblk]
        flat += [0] * (nblk - min(nblk, len(c.block_table)))
    host = torch.tensor(flat, dtype=torch.int64)
    mask_host = torch.arange(nblk * block_size)[None, :] <= host[d : 2 * d, None]
    ints = host_to_device(host, device)
    k = 3 * d + len(logits_rows)
    return ForwardBatch(
        input_ids=ints[:d], positions=ints[d : 2 * d], slot_mapping=ints[2 * d : 3 * d], logits_indices=ints[3 * d : k],
        num_tokens=d, num_seqs=len(chunks), num_sampled=len(logits_rows), num_decode=d,
        decode_blocks=ints[k:].view(d, nblk),
        decode_mask=host_to_device(mask_host.reshape(-1), device).view(d, 1, 1, nblk * block_size),
        decode_groups=_length_groups([(c.start_pos + block_size) // block_size for _, c in decodes]),
        prefills=[], max_context_len=max_ctx, block_size=block_size,
    )


def _mixed_batch(chunks: list[SeqChunk], decodes: list[tuple[int, SeqChunk]],
                 prefill_chunks: list[tuple[int, SeqChunk]], block_size: int, device: torch.device,
                 max_ctx: int) -> ForwardBatch:
    """Any batch: decode rows, prefill chunks, scored rows."""
    ids: list[int] = []
    dec_pos: list[int] = []
    dec_slots: list[int] = []
    row_of_chunk_last: dict[int, int] = {}
    row_of_chunk_first: dict[int, int] = {}

    # Decode rows: scalar Python per sequence (there is no per-token loop for one token).
    for i, c in decodes:
        row_of_chunk_last[i] = row_of_chunk_first[i] = len(ids)
        ids.append(c.token_ids[0])
        dec_pos.append(c.start_pos)
        dec_slots.append(_slot(c.block_table, c.start_pos, block_size))
    num_decode = len(ids)
    pos_pieces = [torch.tensor(dec_pos, dtype=torch.int64)]
    slot_pieces = [torch.tensor(dec_slots, dtype=torch.int64)]

    # Prefill rows: slot ids by block-table arithmetic, vectorised per chunk.
    ctx_pieces: list[torch.Tensor] = []
    prefill_meta: list[tuple[int, int, int]] = []
    for i, c in prefill_chunks:
        n = len(c.token_ids)
        row0 = len(ids)
        ids.extend(c.token_ids)
        p = torch.arange(c.start_pos, c.start_pos + n, dtype=torch.int64)
        bt = torch.as_tensor(c.block_table, dtype=torch.int64)
        pos_pieces.append(p)
        slot_pieces.append(bt[p // block_size] * block_size + p % block_size)
        nblk_ctx = (c.start_pos + n + block_size - 1) // block_size
        ctx_pieces.append(bt[:nblk_ctx] if c.start_pos > 0 else bt[:0])
        prefill_meta.append((row0, row0 + n, c.start_pos))
        row_of_chunk_last[i] = row0 + n - 1
        row_of_chunk_first[i] = row0

    logits_rows = [row_of_chunk_last[i] for i, c in enumerate(chunks) if c.sample]
    num_sampled = len(logits_rows)
    targets: list[int] = []
    for i, c in enumerate(chunks):
        if c.score_targets:
            if len(c.score_targets) > len(c.token_ids):
                raise ValueError(f"chunk {i}: {len(c.score_targets)} score targets for {len(c.token_ids)} tokens")
            r0 = row_of_chunk_first[i]
            logits_rows.extend(range(r0, r0 + len(c.score_targets)))
            targets.extend(c.score_targets)

    # Decode context: a padded [D, nblk] block-table matrix.
    decode_block_host = torch.empty((0, 0), dtype=torch.int64)
    decode_groups: list[tuple[int, int, int]] | None = None
    decode_mask_host: torch.Tensor | None = None
    if decodes:
        lens = torch.tensor([c.start_pos + 1 for _, c in decodes], dtype=torch.int64)
        lmax = int(lens.max())
        nblk = (lmax + block_size - 1) // block_size
        bt_pad = torch.tensor(
            [
                c.block_table[:nblk] + [0] * (nblk - min(nblk, len(c.block_table)))
                for _, c in decodes
            ],
            dtype=torch.int64,
        )
        decode_block_host = bt_pad
        decode_groups = _length_groups([(c.start_pos + block_size) // block_size for _, c in decodes])
        decode_mask_host = (torch.arange(nblk * block_size)[None, :] < lens[:, None])[:, None, None, :]

    masks_host: list[torch.Tensor] = []
    for row0, row1, sp in prefill_meta:
        if sp > 0:
            q_pos = torch.arange(sp, sp + row1 - row0)
            nkeys = (sp + row1 - row0 + block_size - 1) // block_size * block_size
            masks_host.append(torch.arange(nkeys)[None, :] <= q_pos[:, None])

    # One host->device copy for all int64 indices, one for all bool masks.
    t = len(ids)
    int_parts = [
        torch.tensor(ids, dtype=torch.int64),
        torch.cat(pos_pieces),
        torch.cat(slot_pieces),
        torch.tensor(logits_rows, dtype=torch.int64),
        decode_block_host.reshape(-1),
        *ctx_pieces,
        *([torch.tensor(targets, dtype=torch.int64)] if targets else []),  # last: most batches have none
    ]
    ints = host_to_device(torch.cat(int_parts), device)
    bool_parts = ([decode_mask_host.reshape(-1)] if decode_mask_host is not None else []) + [
        m.reshape(-1) for m in masks_host
    ]
    bools = host_to_device(torch.cat(bool_parts), device) if bool_parts else None

    sizes = [p.numel() for p in int_parts]
    views = list(torch.split(ints, sizes))
    input_ids, positions, slot_mapping, logits_indices, dec_flat = views[:5]
    ctx_views = views[5 : 5 + len(ctx_pieces)]

    boff = 0
    decode_blocks = decode_mask = None
    if decode_mask_host is not None and bools is not None:
        decode_blocks = dec_flat.view(decode_block_host.shape)
        decode_mask = bools[: decode_mask_host.numel()].view(decode_mask_host.shape)
        boff = decode_mask_host.numel()

    prefills: list[PrefillAttn] = []
    for (row0, row1, sp), ctx in zip(prefill_meta, ctx_views, strict=True):
        ctx_blocks = mask = None
        if sp > 0 and bools is not None:
            n = row1 - row0
            ctx_blocks = ctx
            nkeys = ctx.numel() * block_size
            mask = bools[boff : boff + n * nkeys].view(n, nkeys)
            boff += n * nkeys
        prefills.append(PrefillAttn(row0, row1, sp, ctx_blocks, mask))

    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        num_tokens=t,
        num_seqs=len(chunks),
        num_sampled=num_sampled,
        num_decode=num_decode,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        decode_groups=decode_groups,
        prefills=prefills,
        max_context_len=max_ctx,
        block_size=block_size,
        num_scored=len(targets),
        score_targets=views[-1] if targets else None,
    )


def _length_groups(nblks: list[int], max_groups: int = 16, min_rows: int = 4) -> list[tuple[int, int, int]]:
    """Split rows (block counts, longest first) into contiguous groups, cutting where the
    block count drops most, at most `max_groups` and about `min_rows` rows a group: each group
    is padded only to its own longest context. Measured on the default preset, 128 mixed
    requests: 1 group 98 tok/s, 4 groups 147, 8 groups 190, 16 groups 204."""
    n = len(nblks)
    k = min(max_groups, n // min_rows)
    if k < 2 or nblks[0] == nblks[-1]:
        return [(0, n, nblks[0])]
    drops = sorted(range(1, n), key=lambda r: nblks[r - 1] - nblks[r], reverse=True)[: k - 1]
    cuts = [0, *sorted(d for d in drops if nblks[d - 1] > nblks[d]), n]
    return [(a, b, nblks[a]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def resolve_placeholders(fb: ForwardBatch, future: torch.Tensor) -> None:
    """Replace placeholder ids -(slot + 1) by the tokens in the future ring, on the device.
    On a CPU in numpy: torch's six small ops cost 22-28 us of thread CPU a call (50-70 us in a
    device process beside other work; a one-row tiny forward is about 300 us), numpy's about
    40% less (BENCHMARKS.md, "Open-loop runs")."""
    ids = fb.input_ids
    if ids.device.type == "cpu" and future.device.type == "cpu":
        a = ids.numpy()
        fb.input_ids = torch.from_numpy(np.where(a < 0, future.numpy()[np.maximum(-a - 1, 0)], a))
        return
    fb.input_ids = torch.where(ids < 0, future[(-ids - 1).clamp(min=0)], ids)
