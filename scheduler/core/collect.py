"""The host's side of step 4 and step 5 of a round, as plain functions of the requests
and the memory manager (no device, no torch): what a launch records on its requests,
and what collecting its sampled tokens does to them.

A sampled row's token is known on the host only after the barrier; until then the
request carries a placeholder, -(slot + 1), naming the future-token slot the device
writes it to (overlap mode schedules the next round with it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from scheduler.core.batch import ScheduledChunk
from scheduler.core.memory_manager import MemoryManager
from scheduler.core.request import FinishReason, Request, RequestStatus, TokenLogprob
from scheduler.core.request_manager import RequestManager


class TokenOut(Protocol):
    """Where a round's new tokens go (scheduler/hops/sender.py's StepOutput)."""

    tokens: list[tuple[str, int]]  # (request id, token)
    prompts: dict[str, list[int]]  # the prompt of each request whose first token is in `tokens`
    logprobs: dict[int, TokenLogprob]  # by index into `tokens`, for the tokens that asked
    prompt_logprobs: dict[str, list[TokenLogprob | None]]  # with the first token, where asked
    hidden: set[int]  # indices into `tokens` whose text is left out (a stop_token_ids match)


def launched(chunks: Sequence[ScheduledChunk], sampled: Sequence[ScheduledChunk], slots: Sequence[int]) -> None:
    """Step 4 on the host: the chunks' tokens count as computed, and each sampled chunk
    gets its placeholder."""
    for c in chunks:
        c.req.num_computed += c.num_tokens
    for c, slot in zip(sampled, slots, strict=True):
        c.req.output_ids.append(-(slot + 1))


def collect(
    results: Iterable[tuple[ScheduledChunk, int, int, TokenLogprob | None]],
    chunks: Sequence[ScheduledChunk],
    step: int,
    now: int,
    mm: MemoryManager,
    rm: RequestManager,
    eos_ids: frozenset[int],
    finish: Callable[[Request, FinishReason], None],
    out: TokenOut,
    scores: Iterable[tuple[ScheduledChunk, list[TokenLogprob]]] = (),
) -> None:
    """Step 5: each (chunk, slot, token, logprobs) replaces its placeholder; a request that
    sampled EOS or reached max_new_tokens is finished through `finish`; full blocks of the
    round's chunks are published for prefix sharing. New tokens go to `out.tokens`, and the
    prompt of a request's first token to `out.prompts` (its text is decoded after it).
    `scores`: each chunk's prompt logprobs, kept on its request until its first token."""
    for c, entries in scores:
        req = c.req
        if req.status is RequestStatus.FINISHED or c.generation != req.num_preemptions:
            continue
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.sample.valid_len
        # row i of the chunk scores the prompt token at c.start + 1 + i (a recompute writes the same)
        req.prompt_logprobs[c.start + 1 : c.start + 1 + len(entries)] = entries
    for c, slot, tok, lp in results:
        req = c.req
        if req.status is RequestStatus.FINISHED or c.generation != req.num_preemptions:
            continue  # finished or preempted while this round was in flight
        req.output_ids[req.output_ids.index(-(slot + 1), req.num_real_outputs)] = tok
        req.token_ns.append(now)
        runs = req.token_runs
        if runs and runs[-2] + runs[-1] == step:
            runs[-1] += 1
        else:
            runs += (step, 1)
        if lp is not None:
            out.logprobs[len(out.tokens)] = lp
        out.tokens.append((req.request_id, tok))
        if not req.first_token_ns:
            req.first_token_ns = rm.mark(req, "first_token")
            out.prompts[req.request_id] = req.sample.input_ids
            if req.sample.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs[req.request_id] = req.prompt_logprobs or [None] * req.sample.valid_len
        sp = req.sample.sampling_params
        if tok in eos_ids and not sp.ignore_eos:
            finish(req, FinishReason.EOS)
        elif req.extras and tok in sp.stop_token_ids:
            out.hidden.add(len(out.tokens) - 1)  # generated and counted, but not text (vLLM's)
            finish(req, FinishReason.STOP_TOKEN)
        elif req.num_real_outputs >= sp.max_new_tokens:
            finish(req, FinishReason.LENGTH)
    for c in chunks:
        req = c.req
        if req.status is not RequestStatus.RUNNING or c.generation != req.num_preemptions:
            continue
        # A block is published once its tokens are known on the host and its K/V written:
        # through this round's chunk, whose round is over. In overlap mode the next round is
        # already in flight (num_computed counts it): the K/V it writes is not there yet, and
        # a prompt matching the block could be prefilled on the prefill stream meanwhile.
        known = min(c.start + c.num_tokens, req.sample.valid_len + req.num_real_outputs)
        if known // mm.block_size > req.num_hashed_blocks:
            req.num_hashed_blocks, req.last_block_hash = mm.register_full_blocks(
                req.token_ids(), req.block_table, known, req.num_hashed_blocks, req.last_block_hash)
