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
from dataclasses import dataclass
from typing import Any

from probes.boundaries import RESPONSE_DELIVER
from probes.clock import now_ns
from scheduler.core.request import SamplingParams
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


class Responder:
    def __init__(self, streams: ResponseStreams, submit: Callable[[str | list[int], SamplingParams, str, bool], None],
                 abort: Callable[[str, str], None], probe_buf: list[Any] | None, step: Callable[[], int]) -> None:
        self._streams, self._submit, self._abort = streams, submit, abort
        self._buf, self._step = probe_buf, step

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
        choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": end.finish_reason}
                   for i, (text, end) in enumerate(replies)]
        return {"id": rid, "object": "text_completion", "created": created(), "model": call.model,
                "choices": choices, "usage": usage(sum(e.prompt_tokens for _, e in replies),
                                                   sum(e.completion_tokens for _, e in replies))}

    async def _collect(self, q: asyncio.Queue[Event], disconnected: Callable[[], Awaitable[bool]],
                       rid: str, ev: Event | None = None) -> tuple[str, End]:
        """A request's whole text, and its end."""
        parts: list[str] = []
        ev = ev if ev is not None else await self._next(q, disconnected, rid)
        while isinstance(ev, Text):
            parts.append(ev.text)
            ev = await self._next(q, disconnected, rid)
        parts.append(ev.tail)
        return "".join(parts), ev

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
        text, ev = await self._collect(q, disconnected, rid, ev)
        choice: dict[str, Any] = {"index": 0, "finish_reason": ev.finish_reason}
        if call.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {"id": rid, "object": "chat.completion" if call.chat else "text_completion", "created": created(),
                "model": call.model, "choices": [choice], "usage": usage(ev.prompt_tokens, ev.completion_tokens)}

    async def _sse(self, call: Call, rid: str, ev: Event, q: asyncio.Queue[Event],
                   disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if call.chat else "text_completion"
        t = created()

        def chunk(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if call.chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return _data({"id": rid, "object": obj, "created": t, "model": call.model, "choices": [choice]})

        done = False
        try:
            if call.chat:
                yield chunk("", None, role=True)
            last = None  # the final token's chunk carries the finish reason, as vLLM's does
            while isinstance(ev, Text):
                nxt = q.get_nowait() if not q.empty() else None
                if isinstance(nxt, End):
                    last = chunk(ev.text + nxt.tail, nxt.finish_reason)
                    ev = nxt
                    break
                yield chunk(ev.text, None)
                ev = nxt if nxt is not None else await self._next(q, disconnected, rid)
            yield last if last is not None else chunk(ev.tail or (None if call.chat else ""), ev.finish_reason)
            if call.include_usage:
                yield _data({"id": rid, "object": obj, "created": t, "model": call.model, "choices": [],
                             "usage": usage(ev.prompt_tokens, ev.completion_tokens)})
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
