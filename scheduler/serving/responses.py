"""One served request, from submit to its last byte: a JSON reply, or SSE chunks.

Runs on the event loop. Its events come from the sender thread through the
request's inbox (scheduler/serving/streams.py); every chunk written to the client
is a `response_deliver` probe row on stream "http", so a slow client shows up in
the trace as long rows, while no round waits on it. A client that goes away has
its request aborted (the engine frees its blocks at the next round).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar, cast

from probes.boundaries import RESPONSE_DELIVER
from probes.clock import now_ns
from scheduler.core.request import SamplingParams
from scheduler.hops.tokenizer_pool import NoTokenizer
from scheduler.serving.http_timing import OUT_STAGES, HttpTimes
from scheduler.serving.logprobs import Scored, chat_logprobs, completion_logprobs
from scheduler.serving.protocol import BadRequest, created, usage
from scheduler.serving.streams import End, Event, Inbox, ResponseStreams, Text

# How often a request checks its client is still there, waiting for a token or not.
DISCONNECT_POLL_S = 0.25
_POLL_NS = int(DISCONNECT_POLL_S * 1e9)

_T = TypeVar("_T")  # what an inbox holds


class ClientGone(Exception):
    pass


class ClientWatch:
    """Whether the client is still there, asked at most every DISCONNECT_POLL_S: on a wait
    that times out, and between events. While tokens keep an inbox busy its waits never time
    out, and a reply that is not streamed has no listener of its own, so it would run to its
    last token (holding its KV blocks) for a client long gone. `ask` None: a stream's body,
    once the server runs it, where EventStream's listener task watches for the disconnect and
    cancels the stream; asking too (Starlette's is_disconnected, a receive under an anyio
    cancel scope beside the listener's) could reach the stream's task as a cancel the listener
    did not send, and cut it short (seen in CI once streams were asked between events)."""

    __slots__ = ("_ask", "_next_ns")

    def __init__(self, ask: Callable[[], Awaitable[bool]] | None) -> None:
        self._ask = ask
        self._next_ns = now_ns() + _POLL_NS if ask is not None else 2**63 - 1

    def due(self) -> bool:
        return now_ns() >= self._next_ns

    async def gone(self) -> bool:
        if self._ask is None:
            return False
        self._next_ns = now_ns() + _POLL_NS
        return await self._ask()


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
    n: int = 1  # samples per prompt: a choice each
    http: HttpTimes | None = None  # when the HTTP server read it (None: not through TimedHttpProtocol)


@dataclass(slots=True)
class Choice:
    """One prompt's answer as it arrives: its text, its tokens' logprobs, its end."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[Scored] = field(default_factory=list)
    prompt: tuple[Scored, ...] = ()


class Responder:
    def __init__(self, streams: ResponseStreams, submit: Callable[[str | list[int], SamplingParams, str, bool], None],
                 abort: Callable[[str, str], None], probe_buf: list[Any] | None, step: Callable[[], int],
                 decode: Callable[[list[int]], str] | None = None, timeline_buf: list[Any] | None = None) -> None:
        self._streams, self._submit, self._abort = streams, submit, abort
        self._buf, self._step = probe_buf, step
        self._timeline = timeline_buf  # the HTTP stamps of each request submitted (this loop's own list)
        self._decode = decode  # echo of a token-id prompt: its text

    async def answer(self, call: Call, disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | AsyncIterable[bytes]:
        """The reply's JSON, or the SSE body. BadRequest for a request the engine refused."""
        rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
        watch = ClientWatch(disconnected)
        if len(call.prompts) * call.n > 1:
            return await self._many(call, rid, watch)
        q = self._streams.open(rid, call.stops)
        try:
            self._submit_one(call, call.prompts[0], call.params, rid)
        except BaseException:
            self._streams.close(rid)
            raise
        try:
            first = await self._next(q, watch, rid)
            if isinstance(first, End) and (first.finish_reason == "error" or first.failed):
                raise _refusal(first)
            if call.stream:
                return self._timed(self._sse(call, rid, first, q, ClientWatch(None)), partial(self._gone, rid))
            ch, end = await self._collect(q, watch, rid, first)
        except ClientGone:  # aborted as its client was found gone
            self._streams.close(rid)
            raise
        except BaseException:
            # cancelled (a server shutting down cancels its requests): the engine's request
            # must not run on for nobody (a refused or ended one is not live: a no-op)
            self._streams.close(rid)
            self._abort(rid, "request cancelled")
            raise
        self._streams.close(rid)
        return self._reply(call, rid, [(ch, end)])

    def _gone(self, rid: str) -> None:
        """A stream whose client went away, before its first chunk or during it."""
        self._streams.close(rid)
        self._abort(rid, "client disconnected")

    def _submit_one(self, call: Call, prompt: str | list[int], params: SamplingParams, rid: str) -> None:
        """One engine request, stamped; a text prompt the model has no tokenizer for is the
        caller's error (400), as a refusal."""
        try:
            self._submit(prompt, params, rid, call.add_special_tokens)
        except NoTokenizer as e:
            raise BadRequest(str(e), param="prompt" if not call.chat else "messages", code="no_tokenizer") from None
        self._stamp(call, rid)

    def _stamp(self, call: Call, rid: str) -> None:
        """The HTTP server's stamps as timeline events of the engine request `rid`, once the
        engine has it (a refused submit raises before: no events for a request never made).
        Step -1: no round; the one running meanwhile is not the request's."""
        if self._timeline is not None and call.http is not None:
            self._timeline.extend((ts, rid, stage, -1, 0) for ts, stage in call.http.events())

    def _stamp_first(self, rid: str, posted_ns: int) -> None:
        """As a stream's first chunk with a choice is handed to the server to write: when
        the sender posted the first token and now, as timeline events (OUT_STAGES) of the
        request (nothing where `posted_ns` is 0: stamped already, or no token).
        Before the hand-over, not after: the server resumes this generator only after its
        write, by which time another thread may have held the GIL and the client may have
        read the chunk. Step -1, as the HTTP stamps."""
        if self._timeline is not None and posted_ns:
            self._timeline.extend(((posted_ns, rid, OUT_STAGES[0], -1, 0), (now_ns(), rid, OUT_STAGES[1], -1, 0)))

    async def _many(self, call: Call, rid: str, watch: ClientWatch) -> dict[str, Any] | AsyncIterable[bytes]:
        """A batch of prompts, `n` samples each: every choice an engine request of its own
        (`RID-i`, i = prompt * n + sample, OpenAI's order). A prompt's first sample is
        submitted at once; its other samples once it has its first token, when the prompt's
        full KV blocks are published, so they share them (prefix sharing) instead of
        computing the prompt again. A choice the engine refuses refuses the request, and the
        others are aborted."""
        n = call.n
        rids = [f"{rid}-{i}" for i in range(len(call.prompts) * n)]
        queues = [self._streams.open(r, call.stops) for r in rids]
        started = [asyncio.Event() for _ in call.prompts]

        async def first(i: int) -> Event:
            p, j = divmod(i, n)
            if j:
                await started[p].wait()
            # a refused submit leaves the prompt's other samples waiting: `_all` cancels them
            self._submit_one(call, call.prompts[p], _sample_params(call.params, j), rids[i])
            try:
                return await self._next(queues[i], watch, rids[i])
            finally:
                if not j:
                    started[p].set()

        def give_up(why: str) -> None:
            for r in rids:
                self._abort(r, why)
                self._streams.close(r)

        try:
            firsts = list(await _all(first(i) for i in range(len(rids))))
        except BaseException:
            give_up("another choice of its request failed")
            raise
        refused = next((e for e in firsts if isinstance(e, End) and (e.finish_reason == "error" or e.failed)), None)
        if refused is not None:
            give_up("another choice of its request was refused")
            raise _refusal(refused, "prompt")
        if call.stream:
            return self._timed(self._sse_many(call, rid, rids, queues, firsts, ClientWatch(None)),
                               lambda: give_up("client disconnected"))
        try:
            replies = await _all(self._collect(q, watch, r, ev) for q, r, ev in zip(queues, rids, firsts, strict=True))
        except BaseException:
            give_up("another choice of its request failed")
            raise
        for r in rids:
            self._streams.close(r)
        return self._reply(call, rid, replies)

    async def _collect(self, q: Inbox[Event], watch: ClientWatch,
                       rid: str, ev: Event | None = None) -> tuple[Choice, End]:
        """A request's whole answer, and its end."""
        ch = Choice()
        ev = ev if ev is not None else await self._next(q, watch, rid)
        while isinstance(ev, Text):
            ch.parts.append(ev.text)
            ch.logprobs += ev.logprobs
            ch.prompt = ev.prompt or ch.prompt
            ev = await self._next(q, watch, rid)
        ch.parts.append(ev.tail)
        return ch, ev

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt  # echoed as sent, as vLLM does
        return self._decode(prompt) if self._decode is not None else ""

    def _reply(self, call: Call, rid: str, replies: list[tuple[Choice, End]]) -> dict[str, Any]:
        failed = next((e for _, e in replies if e.failed), None)
        if failed is not None:  # a part of the answer will never come
            raise _refusal(failed)
        choices: list[dict[str, Any]] = []
        for i, (ch, end) in enumerate(replies):
            if call.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": "".join(ch.parts)},
                                "logprobs": chat_logprobs(ch.logprobs) if call.logprobs else None,
                                "finish_reason": end.finish_reason})
                continue
            text = "" if call.drop_output else "".join(ch.parts)
            lps = [] if call.drop_output else ch.logprobs
            if call.echo:
                text, lps = self._prompt_text(call.prompts[i // call.n]) + text, [*ch.prompt, *lps]
            choices.append({"index": i, "text": text, "finish_reason": end.finish_reason,
                            "logprobs": completion_logprobs(lps) if call.logprobs else None})
        return {"id": rid, "object": "chat.completion" if call.chat else "text_completion", "created": created(),
                "model": call.model, "choices": choices, "usage": self._usage(call, [e for _, e in replies])}

    @staticmethod
    def _usage(call: Call, ends: list[End]) -> dict[str, int]:
        """Summed over the choices (OpenAI's); a prompt shared by `n` samples counts once."""
        return usage(sum(e.prompt_tokens for e in ends[:: call.n]),
                     0 if call.drop_output else sum(e.completion_tokens for e in ends))

    async def _next(self, q: Inbox[_T], watch: ClientWatch, *rids: str) -> _T:
        while True:
            ev = await q.get(DISCONNECT_POLL_S)
            if ev is not None and not watch.due():
                return ev
            if await watch.gone():
                for rid in rids:
                    self._abort(rid, "client disconnected")
                raise ClientGone
            if ev is not None:
                return ev

    async def _sse(self, call: Call, rid: str, ev: Event, q: Inbox[Event],
                   watch: ClientWatch) -> AsyncIterator[bytes]:
        chunks = _Chunks(call, rid, self._prompt_text)
        done = False
        # the first token's post, stamped as the first chunk a client counts is handed over:
        # a chat stream's role chunk, written only once the first token is here
        first = ev.posted_ns if isinstance(ev, Text) else 0
        try:
            if call.chat:
                data = chunks.role(0)
                self._stamp_first(rid, first)
                first = 0
                yield data
            last = None  # the final token's chunk carries the finish reason, as vLLM's does
            while isinstance(ev, Text):
                nxt = q.take()
                if isinstance(nxt, End):
                    last = chunks.text(0, ev, nxt)
                    ev = nxt
                    break
                data = chunks.text(0, ev)
                self._stamp_first(rid, first)
                first = 0
                yield data
                ev = nxt if nxt is not None else await self._next(q, watch, rid)
            data = last if last is not None else chunks.end(0, ev)
            self._stamp_first(rid, first)  # (a one-token stream's first token goes with the end)
            yield data
            if call.include_usage:
                yield chunks.usage(self._usage(call, [ev]))
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            if done:
                self._streams.close(rid)
            else:  # the client went away (the server cancelled this generator)
                self._gone(rid)

    async def _sse_many(self, call: Call, rid: str, rids: list[str], queues: list[Inbox[Event]],
                        firsts: list[Event], watch: ClientWatch) -> AsyncIterator[bytes]:
        """Several choices in one stream: each chunk names its choice's `index`, in the order
        their tokens arrive (OpenAI's and vLLM's)."""
        chunks = _Chunks(call, rid, self._prompt_text)
        merged: Inbox[tuple[int, Event]] = Inbox(asyncio.get_running_loop())

        async def pump(i: int, ev: Event) -> None:
            merged.put((i, ev))
            while isinstance(ev, Text):
                nxt = await queues[i].get()  # (no timeout: never None)
                assert nxt is not None
                ev = nxt
                merged.put((i, ev))

        pumps = [asyncio.create_task(pump(i, ev)) for i, ev in enumerate(firsts)]
        ends: dict[int, End] = {}
        done = False
        try:
            if call.chat:
                for i in range(len(rids)):
                    yield chunks.role(i)
            while len(ends) < len(rids):
                i, ev = await self._next(merged, watch, *rids)
                if isinstance(ev, Text):
                    yield chunks.text(i, ev)
                else:
                    ends[i] = ev
                    yield chunks.end(i, ev)
            if call.include_usage:
                yield chunks.usage(self._usage(call, [ends[i] for i in range(len(rids))]))
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            for t in pumps:
                t.cancel()
            for r in rids:
                self._streams.close(r)
                if not done:
                    self._abort(r, "client disconnected")

    def _timed(self, body: AsyncIterator[bytes], unstarted: Callable[[], None]) -> AsyncIterable[bytes]:
        """`body`, each chunk's write timed; `unstarted`: what closing it before its first chunk
        must do that the body's own `finally` would have done (`_Body`)."""
        return _Body(self._each_timed(body), unstarted)

    async def _each_timed(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
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


class _Body:
    """An SSE body that ends its requests even when it is closed before it was iterated (a
    response whose start failed): closing an async generator that never started skips its
    `finally`, which ends the request in the engine and in ResponseStreams. Iterating it is
    iterating the generator itself: nothing is added per chunk."""

    __slots__ = ("_gen", "_unstarted")

    def __init__(self, gen: AsyncIterator[bytes], unstarted: Callable[[], None]) -> None:
        self._gen: Any = gen
        self._unstarted: Callable[[], None] | None = unstarted

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._unstarted = None  # its first __anext__ follows at once and enters the body's try
        return cast(AsyncIterator[bytes], self._gen)

    async def aclose(self) -> None:
        if self._unstarted is not None:
            self._unstarted()
            self._unstarted = None
        await self._gen.aclose()


class _Chunks:
    """The SSE chunks of one response, each choice's state kept apart: whether its prompt
    is still to be echoed, and where its next token's text starts (`text_offset`)."""

    def __init__(self, call: Call, rid: str, prompt_text: Callable[[str | list[int]], str]) -> None:
        self.call, self.rid, self._prompt_text = call, rid, prompt_text
        self.obj = "chat.completion.chunk" if call.chat else "text_completion"
        self.t = created()
        self._offset: dict[int, int] = {}
        self._echoed: set[int] = set()
        self._frames: dict[int, tuple[bytes, bytes]] = {}  # a choice's plain token chunk, around its text

    def role(self, i: int) -> bytes:
        return self._chunk(i, "", None, role=True)

    def text(self, i: int, ev: Text, end: End | None = None) -> bytes:
        """A token's chunk (`end`: it is the last, and carries the finish reason and tail)."""
        call = self.call
        text, lps = ("", []) if call.drop_output else (ev.text, list(ev.logprobs))
        if call.echo and i not in self._echoed:  # the choice's first chunk starts with the prompt
            self._echoed.add(i)
            text, lps = self._prompt_text(call.prompts[i // call.n]) + text, [*(ev.prompt or ()), *lps]
        if end is not None and not call.drop_output:
            text += end.tail
        return self._chunk(i, text, end.finish_reason if end is not None else None, lps=lps)

    def end(self, i: int, ev: End) -> bytes:
        tail = "" if self.call.drop_output else ev.tail
        return self._chunk(i, tail or (None if self.call.chat else ""), ev.finish_reason)

    def usage(self, u: dict[str, int]) -> bytes:
        return _data({"id": self.rid, "object": self.obj, "created": self.t, "model": self.call.model,
                      "choices": [], "usage": u})

    def _chunk(self, i: int, text: str | None, finish: str | None, role: bool = False,
               lps: list[Scored] | None = None) -> bytes:
        call = self.call
        if text is not None and finish is None and not role and not call.logprobs:
            # most chunks of a stream: the same bytes as the dict's, with only the text encoded
            # (a whole json.dumps per token was a fifth of the event loop's time)
            frame = self._frames.get(i)
            if frame is None:
                frame = self._frames[i] = _frame(self._dict(i, _MARK, None, None))
            return frame[0] + _encode_str(text).encode() + frame[1]
        lp: dict[str, Any] | None = None
        if call.logprobs and not role:
            offset = self._offset.get(i, 0)
            lp = chat_logprobs(lps or []) if call.chat else completion_logprobs(lps or [], offset)
            self._offset[i] = offset + sum(e.width for e in lps or [])
        return _data(self._dict(i, text, finish, lp, role))

    def _dict(self, i: int, text: str | None, finish: str | None, lp: dict[str, Any] | None,
              role: bool = False) -> dict[str, Any]:
        if self.call.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}
        return {"id": self.rid, "object": self.obj, "created": self.t, "model": self.call.model, "choices": [choice]}


def _refusal(end: End, param: str | None = None) -> BadRequest:
    """A first (or a whole reply's) End that is no answer: the engine refused the prompt (400),
    or stopped on a failure or a stall (503)."""
    if end.failed:
        return BadRequest(end.detail, status=503, kind="server_error", code="engine_unavailable")
    return BadRequest(end.detail or "the engine refused the request", param=param)


async def _all(coros: Iterable[Awaitable[_T]]) -> list[_T]:
    """gather's results; where one raises, the others are cancelled (and awaited) before it
    propagates: gather leaves them running, and a choice's task would submit its engine
    request after the request was given up, or fail with nobody to see it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """The `j`th sample of a prompt: a seeded request's samples draw with seed + j (vLLM's), so
    they differ and each repeats; unseeded ones differ by their request ids."""
    return params if j == 0 or params.seed is None else replace(params, seed=params.seed + j)


def _data(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


_MARK = "\x00text\x00"  # the text's place as a frame is built (split at its last occurrence: an id or
# model name holding it cannot move the split; a token's text is inserted, never split)
_encode_str = json.encoder.encode_basestring_ascii  # json.dumps's own encoding of a str (ensure_ascii)


def _frame(obj: dict[str, Any]) -> tuple[bytes, bytes]:
    """`_data(obj)` split around the encoded `_MARK`: the bytes before and after a text (the
    last mark: the text follows every other string of a chunk)."""
    head, _, tail = _data(obj).rpartition(_encode_str(_MARK).encode())
    return head, tail
