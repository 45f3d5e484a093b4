"""transformers as the oracle for the engine's forward: a miniature continuous-batching loop
(chunked prefill, arrivals, batched decodes, shuffled chunk order and KV blocks) that
greedy-generates through any forward, and the teacher-forced checks of what it generated.

Module-level imports stay light: test_parallel's spawned ranks import this module, and
transformers (needed only by the checks, in the parent) costs seconds per process."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scheduler.model.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from scheduler.model.kv_cache import PagedKVCache
from scheduler.model.loader import load_model

if TYPE_CHECKING:
    from scheduler.model.transformer import CausalLM

BLOCK = 16
NEAR_TIE = 1e-3

Forward = Callable[[ForwardBatch, PagedKVCache, int], torch.Tensor]


@dataclass(slots=True)
class Req:
    prompt: list[int]
    chunk: int  # prefill chunk size (>= len(prompt) means one-shot prefill)
    start_step: int  # step at which the request arrives
    max_new: int
    blocks: list[int] = field(default_factory=list)
    done: int = 0  # tokens in the KV cache
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per generated token


def make_reqs(vocab: int, seed: int, lengths: list[int], chunks: list[int], max_new: int) -> list[Req]:
    """Random prompts of the given lengths; request i arrives at step i."""
    g = torch.Generator().manual_seed(seed)
    return [
        Req(torch.randint(0, vocab, (n,), generator=g).tolist(), chunk, i, max_new)
        for i, (n, chunk) in enumerate(zip(lengths, chunks, strict=True))
    ]


def generate(forward: Forward, make_kv: Callable[[int], PagedKVCache], reqs: list[Req], seed: int = 0) -> int:
    """Greedy-generate every request with a tiny continuous-batching loop; returns the steps.

    Deterministic given ``seed``, so every rank of a parallel run builds the same batches in
    the same order."""
    rng = random.Random(seed)
    need = sum(-(-(len(r.prompt) + r.max_new) // BLOCK) for r in reqs)
    free = list(range(need + 7))
    rng.shuffle(free)  # blocks come from anywhere in the pool, in any order
    kv = make_kv(len(free))
    step = 0
    while any(len(r.out) < r.max_new for r in reqs):
        work: list[tuple[Req, SeqChunk]] = []
        for r in reqs:
            if step < r.start_step or len(r.out) >= r.max_new:
                continue
            if r.done < len(r.prompt):
                toks = r.prompt[r.done : r.done + r.chunk]
                sample = r.done + len(toks) == len(r.prompt)
            else:
                toks, sample = [r.out[-1]], True
            while len(r.blocks) * BLOCK < r.done + len(toks):
                r.blocks.append(free.pop())
            work.append((r, SeqChunk(toks, r.done, list(r.blocks), sample)))
        rng.shuffle(work)
        step += 1
        if not work:
            continue
        logits = forward(build_forward_batch([c for _, c in work], BLOCK, "cpu"), kv, step)
        rows = iter(logits)
        for r, c in work:
            r.done += len(c.token_ids)
            if c.sample:
                row = next(rows)
                r.logits.append(row.clone())
                r.out.append(int(row.argmax()))
    return step


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def teacher_forced_check(hf: torch.nn.Module, reqs: list[Req]) -> None:
    """Every engine token must be transformers' argmax unless transformers itself has a near-tie."""
    checked = ties = 0
    for r in reqs:
        seq = r.prompt + r.out
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        gen_rows = ref[len(r.prompt) - 1 : len(seq) - 1]
        engine = torch.stack(r.logits)
        scale = ref.abs().max().item()
        torch.testing.assert_close(engine, gen_rows, atol=1e-4 * max(scale, 1.0), rtol=0)
        top2 = gen_rows.topk(2, dim=-1).values
        for j, tok in enumerate(r.out):
            checked += 1
            if (top2[j, 0] - top2[j, 1]).item() < NEAR_TIE:
                ties += 1
                continue
            assert tok == int(gen_rows[j].argmax()), f"prompt len {len(r.prompt)}, token {j}"
    assert checked > 0 and ties <= 0.05 * checked, f"{ties}/{checked} near-ties: check is vacuous"


def teacher_forced_mismatches(model_dir: Path, prompt: list[int], output: list[int]) -> tuple[int, int]:
    """(tokens of `output` that are not transformers' argmax, near-ties skipped), teacher-forced
    on prompt + output: how a trace's tokens are checked after an `mstrace run`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0]
    bad, ties = 0, 0
    for j, tok in enumerate(output):
        row = logits[len(prompt) - 1 + j]
        top2 = torch.topk(row, 2)
        if top2.values[0] - top2.values[1] < NEAR_TIE:
            ties += 1
            continue
        bad += int(top2.indices[0].item() != tok)
    return bad, ties


def mixed_decode_chunks(model: CausalLM, kv: PagedKVCache, block_size: int) -> tuple[list[SeqChunk], int]:
    """16 decode rows whose contexts (2-150 tokens, prefilled into `kv` first) span several
    length groups; returns them and the number of blocks they hold (blocks [0, used))."""
    g = torch.Generator().manual_seed(0)
    chunks, used = [], 0
    for ctx in [3, 70, 9, 41, 41, 120, 5, 88, 17, 64, 33, 2, 99, 12, 7, 150]:
        nblk = ctx // block_size + 1
        table = list(range(used, used + nblk))
        used += nblk
        prompt = torch.randint(5, 500, (ctx,), generator=g).tolist()
        model(build_forward_batch([SeqChunk(prompt, 0, table, False)], block_size, "cpu"), kv)  # fill its KV
        chunks.append(SeqChunk([int(torch.randint(5, 500, (1,), generator=g))], ctx, table, True))
    return chunks, used


def logits_with_and_without(library_owner: Any, monkeypatch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiny preset's logits for `mixed_decode_chunks` and a 30-token prefill chunk in one
    batch: with `library_owner`'s C library (a native_* module's `_LIB`) and without it."""
    from scheduler.model.presets import ensure_preset

    model, _ = load_model(ensure_preset("tiny"), "cpu", torch.float32)
    kv = model.make_kv_cache(400, 4)
    chunks, used = mixed_decode_chunks(model, kv, 4)
    g = torch.Generator().manual_seed(1)
    chunks.append(SeqChunk(torch.randint(5, 500, (30,), generator=g).tolist(), 0, list(range(used, used + 8)), True))
    native = model(build_forward_batch(chunks, 4, "cpu"), kv)
    monkeypatch.setattr(library_owner, "_LIB", None)
    return native, model(build_forward_batch(chunks, 4, "cpu"), kv)
