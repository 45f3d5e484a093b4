"""One served request, from submit to its last byte: a JSON reply, or SSE chunks.

Runs on the event loop. Its events come from the sender thread through the
request's queue (scheduler/serving/streams.py); every chunk written to the client
is a `response_deliver` probe row on stream "http", so a slow client shows up in
the trace as long rows, while no round waits on it. A client that goes away has
its request aborted (the engine frees its blocks at the next round).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from probes.boundaries import RESPONSE_DELIVER
from probes.clock import now_ns
from scheduler.core.request import SamplingParams
from scheduler.serving.logprobs import Scored, chat_logprobs, completion_logprobs
from scheduler.serving.protocol import BadRequest, created, usage
from scheduler.serving.streams import End, Event, ResponseStreams, Text

# How often a request waiting for its first or next token checks its client is still there.
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    pass


@dataclass(slots=True)
class Call:
    """What one request asked for, in the API's terms."""

    chat: bool
    prompts: list[str | list[int]]  # a completions batch has several: a choice each
    params: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    model: str
    add_special_tokens: bool  # a text prompt's: true for completions, false for a rendered chat
    echo: bool = False  # completions: the text (and logprobs) start with the prompt's
    logprobs: bool = False  # the reply carries a logprobs object
    drop_output: bool = False  # max_tokens 0 with echo: the one token generated is not returned


@dataclass(slots=True)
class Choice:
    """One prompt's answer as it arrives: its text, its tokens' logprobs, its end."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[Scored] = field(default_factory=list)
    prompt: tuple[Scored, ...] = ()


class Responder:
    def __init__(self, streams: ResponseStreams, submit: Callable[[str | list[int], SamplingParams, str, bool], None],
                 abort: Callable[[str, str], None], probe_buf: list[Any] | None, step: Callable[[], int],
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self._streams, self._submit, self._abort = streams, submit, abort
        self._buf, self._step = probe_buf, step
        self._decode = decode  # echo of a token-id prompt: its text

    async def answer(self, call: Call, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | AsyncIterator[bytes]:
        """The reply's JSON, or the SSE body. BadRequest for a request the engine refused."""
        rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
        if len(call.prompts) > 1:
            return await self._batch(call, rid, disconnected)
        q = self._streams.open(rid, call.stops)
        self._submit(call.prompts[0], call.params, rid, call.add_special_tokens)
        try:
            first = await self._next(q, disconnected, rid)
        except BaseException:
            self._streams.close(rid)
            raise
        if isinstance(first, End) and first.finish_reason == "error":
            self._streams.close(rid)
            raise BadRequest(first.detail or "the engine refused the request")
        if call.stream:
            return self._timed(self._sse(call, rid, first, q, disconnected))
        try:
            return await self._whole(call, rid, first, q, disconnected)
        finally:
            self._streams.close(rid)

    async def _batch(self, call: Call, rid: str, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        """A completions batch: every prompt an engine request of its own (`RID-i`), all
        submitted at once so they share rounds; one choice per prompt, in order, and the
        usage summed (OpenAI's). A prompt the engine refuses refuses the batch, and the
        others are aborted."""
        if call.stream:
            raise BadRequest("prompt: a batch of prompts is not streamed by this server; send them "
                             "without stream, or one per request", param="prompt", code="unsupported_parameter")
        rids = [f"{rid}-{i}" for i in range(len(call.prompts))]
        queues = [self._streams.open(r, call.stops) for r in rids]
        for p, r in zip(call.prompts, rids, strict=True):
            self._submit(p, call.params, r, call.add_special_tokens)
        try:
            replies = await asyncio.gather(*(self._collect(q, disconnected, r) for q, r in zip(queues, rids, strict=True)))
        except BaseException:
            for r in rids:
                self._abort(r, "another prompt of its batch failed")
            raise
        finally:
            for r in rids:
                self._streams.close(r)
        for _, end in replies:
            if end.finish_reason == "error":
                for r in rids:
                    self._abort(r, "another prompt of its batch was refused")
                raise BadRequest(end.detail or "the engine refused a prompt of the batch", param="prompt")
        choices = [self._completion_choice(call, i, p, ch, end)
                   for i, (p, (ch, end)) in enumerate(zip(call.prompts, replies, strict=True))]
        return {"id": rid, "object": "text_completion", "created": created(), "model": call.model,
                "choices": choices, "usage": usage(sum(e.prompt_tokens for _, e in replies),
                                                   sum(self._completion_tokens(call, e) for _, e in replies))}

    async def _collect(self, q: asyncio.Queue[Event], disconnected: Callable[[], Awaitable[bool]],
                       rid: str, ev: Event | None = None) -> tuple[Choice, End]:
        """A request's whole answer, and its end."""
        ch = Choice()
        ev = ev if ev is not None else await self._next(q, disconnected, rid)
        while isinstance(ev, Text):
            ch.parts.append(ev.text)
            ch.logprobs += ev.logprobs
            ch.prompt = ev.prompt or ch.prompt
            ev = await self._next(q, disconnected, rid)
        ch.parts.append(ev.tail)
        return ch, ev

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt  # echoed as sent, as vLLM does
        return self._decode(prompt) if self._decode is not None else ""

    def _completion_choice(self, call: Call, index: int, prompt: str | list[int], ch: Choice, end: End) -> dict[str, Any]:
        text = "" if call.drop_output else "".join(ch.parts)
        lps = [] if call.drop_output else ch.logprobs
        if call.echo:
            text, lps = self._prompt_text(prompt) + text, [*ch.prompt, *lps]
        return {"index": index, "text": text, "logprobs": completion_logprobs(lps) if call.logprobs else None,
                "finish_reason": end.finish_reason}

    @staticmethod
    def _completion_tokens(call: Call, end: End) -> int:
        return 0 if call.drop_output else end.completion_tokens

    async def _next(self, q: asyncio.Queue[Event], disconnected: Callable[[], Awaitable[bool]], rid: str) -> Event:
        while True:
            try:
                return await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await disconnected():
                    self._abort(rid, "client disconnected")
                    raise ClientGone from None

    async def _whole(self, call: Call, rid: str, ev: Event, q: asyncio.Queue[Event],
                     disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any]:
        ch, end = await self._collect(q, disconnected, rid, ev)
        if call.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "".join(ch.parts)},
                                      "logprobs": chat_logprobs(ch.logprobs) if call.logprobs else None,
                                      "finish_reason": end.finish_reason}
        else:
            choice = self._completion_choice(call, 0, call.prompts[0], ch, end)
        return {"id": rid, "object": "chat.completion" if call.chat else "text_completion", "created": created(),
                "model": call.model, "choices": [choice],
                "usage": usage(end.prompt_tokens, self._completion_tokens(call, end))}

    async def _sse(self, call: Call, rid: str, ev: Event, q: asyncio.Queue[Event],
                   disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if call.chat else "text_completion"
        t = created()
        offset = 0  # completions' text_offset: where the next token's text starts in the whole text
        echo = call.echo

        def chunk(text: str | None, finish: str | None, role: bool = False, lps: list[Scored] | None = None) -> bytes:
            nonlocal offset
            lp: dict[str, Any] | None = None
            if call.logprobs:
                lp = chat_logprobs(lps or []) if call.chat else completion_logprobs(lps or [], offset)
                offset += sum(len(e.token) for e in lps or [])
            if call.chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}
            return _data({"id": rid, "object": obj, "created": t, "model": call.model, "choices": [choice]})

        def piece(ev: Text) -> tuple[str, list[Scored]]:
            nonlocal echo
            text, lps = ("", []) if call.drop_output else (ev.text, list(ev.logprobs))
            if echo:  # the first chunk starts with the prompt
                echo = False
                text, lps = self._prompt_text(call.prompts[0]) + text, [*(ev.prompt or ()), *lps]
            return text, lps

        done = False
        try:
            if call.chat:
                yield chunk("", None, role=True)
            last = None  # the final token's chunk carries the finish reason, as vLLM's does
            while isinstance(ev, Text):
                nxt = q.get_nowait() if not q.empty() else None
                text, lps = piece(ev)
                if isinstance(nxt, End):
                    last = chunk(text + ("" if call.drop_output else nxt.tail), nxt.finish_reason, lps=lps)
                    ev = nxt
                    break
                yield chunk(text, None, lps=lps)
                ev = nxt if nxt is not None else await self._next(q, disconnected, rid)
            tail = "" if call.drop_output else ev.tail
            yield last if last is not None else chunk(tail or (None if call.chat else ""), ev.finish_reason)
            if call.include_usage:
                yield _data({"id": rid, "object": obj, "created": t, "model": call.model, "choices": [],
                             "usage": usage(ev.prompt_tokens, self._completion_tokens(call, ev))})
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            self._streams.close(rid)
            if not done:  # the client went away (the server cancelled this generator)
                self._abort(rid, "client disconnected")

    async def _timed(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`body`, each chunk's write timed: the server resumes this generator only once it
        has sent the chunk (and waited for a slow client's socket to take it)."""
        try:
            async for data in body:
                t0 = now_ns()
                yield data
                if self._buf is not None:
                    self._buf.append((t0, now_ns() - t0, RESPONSE_DELIVER, "http", 0, self._step()))
        finally:
            await body.aclose()  # type: ignore[attr-defined]


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
