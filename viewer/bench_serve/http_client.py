"""OpenAI-style streaming requests over aiohttp, timed at the client.

One `aiohttp.ClientSession` for the whole run, its keep-alive pool sized to the
requests in flight, as `vllm bench serve` shares one: a request then reuses a warm
connection instead of paying a connect (and, for https, a handshake) inside its TTFT.
The body is read with `iter_any`, which hands over whatever bytes the socket has as
soon as it has them; each piece is stamped with perf_counter_ns before it is parsed,
so a chunk's time is its arrival, not the end of the parse of what came with it.
aiohttp is an extra (`pip install 'mstrace[bench]'`), imported only by bench-serve.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from viewer.bench_serve.sse import SSEParser


@dataclass(slots=True)
class Reply:
    ok: bool = False
    error: str = ""
    status: int = 0
    request_id: str = ""
    sent_ns: int = 0
    written_ns: int = 0  # aiohttp began writing the body's last chunk to the socket (0: it never did)
    chunk_ns: list[int] = field(default_factory=list)  # when each chunk with choices arrived
    done_ns: int = 0  # [DONE], or the stream's end
    text: str = ""
    usage: dict[str, int] | None = None

    @property
    def end_ns(self) -> int:
        """Where E2E ends, as vLLM's bench ends it: the last chunk with a choice (the trailing
        usage chunk and [DONE] carry no token)."""
        return self.chunk_ns[-1] if self.chunk_ns else self.done_ns


class Endpoint:
    """Where the requests go, with what headers, and how long one may take in all."""

    def __init__(self, base_url: str, path: str, api_key: str | None, timeout_s: float) -> None:
        u = urlsplit(base_url.rstrip("/") + path)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {base_url!r}")
        if not timeout_s > 0:
            raise ValueError(f"--request-timeout must be positive seconds (inf: none), got {timeout_s}")
        self.url = u.geturl()
        self.timeout_s = timeout_s
        # identity: a compressed stream would reach the parser in the decompressor's
        # blocks, not as the server wrote it
        self.headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def session(self, in_flight: int | None) -> aiohttp.ClientSession:
        """The run's session: at most `in_flight` connections (None: one per request in
        flight), kept alive between requests. No proxy from the environment: the figures
        are the server's, not a proxy's."""
        pool = aiohttp.TCPConnector(limit=in_flight or 0, limit_per_host=in_flight or 0, keepalive_timeout=60,
                                    force_close=False)
        total = None if math.isinf(self.timeout_s) else self.timeout_s
        # the client's own share of the hop in: from the send to the body's write (a burst's
        # requests are built and written one after another on this loop)
        written = aiohttp.TraceConfig()
        written.on_request_chunk_sent.append(_written)
        return aiohttp.ClientSession(connector=pool, timeout=aiohttp.ClientTimeout(total=total),
                                     headers=self.headers, trust_env=False, trace_configs=[written])

    async def stream(self, session: aiohttp.ClientSession, body: dict[str, Any], chat: bool) -> Reply:
        r = Reply()
        r.sent_ns = time.perf_counter_ns()  # before the pool: a connect, when one is needed, is the request's
        try:
            async with session.post(self.url, json=body, trace_request_ctx=r) as resp:
                r.status = resp.status
                if resp.status != 200:
                    r.error = f"HTTP {resp.status}: {_message(await resp.read())}"
                    return r
                await _read(resp, r, chat)
        except TimeoutError:
            r.error = f"no complete reply within --request-timeout {self.timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - one reply's failure, with its reason; never the run's
            r.error = f"{type(e).__name__}: {e}"
        return r


async def _written(session: aiohttp.ClientSession, ctx: Any, params: aiohttp.TraceRequestChunkSentParams) -> None:
    # aiohttp signals a chunk as it begins its write; the last chunk's stamp stays
    ctx.trace_request_ctx.written_ns = time.perf_counter_ns()


async def _read(resp: aiohttp.ClientResponse, r: Reply, chat: bool) -> None:
    parser = SSEParser()
    parts: list[str] = []
    finished = done = False
    async for piece in resp.content.iter_any():
        now = time.perf_counter_ns()
        if done:
            continue  # read to the end all the same: a connection is kept alive only once its body is
        for ev in parser.feed(piece):
            if ev.event == "error":
                raise ValueError(f"the server sent an error event: {ev.data[:200]}")
            if ev.event != "message":
                continue
            if ev.data == "[DONE]":
                done, r.done_ns = True, now
                break
            obj = json.loads(ev.data)
            if not isinstance(obj, dict):
                raise ValueError(f"an SSE event's data is not a JSON object: {ev.data[:200]}")
            if obj.get("error"):  # vLLM's and SGLang's error mid-stream, then [DONE]
                raise ValueError(f"the server sent an error: {_message(ev.data.encode())}")
            r.request_id = r.request_id or str(obj.get("id") or "")
            usage = obj.get("usage")
            if isinstance(usage, dict) and usage:
                r.usage = usage
            choices = obj.get("choices") or []
            if not isinstance(choices, list) or not all(isinstance(ch, dict) for ch in choices):
                raise ValueError(f"a chunk whose choices are not a list of objects: {ev.data[:200]}")
            if choices:  # a token's chunk, its text possibly empty (vLLM's bench counts it too)
                r.chunk_ns.append(now)
            for ch in choices:
                delta = ch.get("delta") if chat else None
                text = (delta.get("content") if isinstance(delta, dict) else None) if chat else ch.get("text")
                parts.append(text if isinstance(text, str) else "")
                finished = finished or bool(ch.get("finish_reason"))
    parser.close()
    r.text = "".join(parts)
    if not done:
        r.done_ns = time.perf_counter_ns()
        if not finished:  # some servers (transformers serve) end after the finish_reason, without [DONE]
            r.error = "the stream ended before a finish_reason or [DONE]"
            return
    if not r.chunk_ns:  # vLLM's bench: "Never received a valid chunk to calculate TTFT"
        r.error = "the stream held no chunk with a choice"
        return
    r.ok = True


def _message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error") if isinstance(obj, dict) else None
        return str((err.get("message") if isinstance(err, dict) else err) or obj)[:200]
    except ValueError:
        return raw[:200].decode("utf-8", "replace")
