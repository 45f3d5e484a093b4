"""A minimal asyncio HTTP/1.1 client for OpenAI-style streaming, timed at the client.

One connection per request (as `vllm bench serve` opens one per request through
aiohttp's pool): the request is written, then the chunked SSE body is read as it
arrives, each `data:` event stamped with perf_counter_ns when its bytes are in.
No third-party client sits between the socket and the clock.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass(slots=True)
class Reply:
    ok: bool = False
    error: str = ""
    status: int = 0
    request_id: str = ""
    sent_ns: int = 0
    chunk_ns: list[int] = field(default_factory=list)  # when each chunk with choices arrived
    done_ns: int = 0
    text: str = ""
    usage: dict[str, int] | None = None


class Endpoint:
    def __init__(self, base_url: str, path: str, api_key: str | None = None) -> None:
        u = urlsplit(base_url.rstrip("/") + path)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {base_url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.path = u.path
        self.headers = {"Host": f"{self.host}:{self.port}", "Content-Type": "application/json",
                        "Accept": "text/event-stream", "Connection": "close"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    async def stream(self, body: dict[str, Any], chat: bool) -> Reply:
        r = Reply()
        data = json.dumps(body).encode()
        head = f"POST {self.path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        head += f"Content-Length: {len(data)}\r\n\r\n"
        writer = None
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port,
                                                           ssl=ssl.create_default_context() if self.tls else None)
            r.sent_ns = time.perf_counter_ns()
            writer.write(head.encode() + data)
            await writer.drain()
            status_line = await reader.readline()
            r.status = int(status_line.split()[1]) if len(status_line.split()) > 1 else 0
            chunked = False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                if k.strip().lower() == "transfer-encoding" and "chunked" in v.lower():
                    chunked = True
            body_iter = _chunks(reader) if chunked else _plain(reader)
            if r.status != 200:
                raw = b"".join([b async for b in body_iter])
                r.error = f"HTTP {r.status}: {_message(raw)}"
                return r
            await _events(body_iter, r, chat)
            r.done_ns = time.perf_counter_ns()
            r.ok = r.done_ns > 0 and not r.error
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            r.error = f"{type(e).__name__}: {e}"
        finally:
            if writer is not None:
                writer.close()
        return r


async def _chunks(reader: asyncio.StreamReader):  # type: ignore[no-untyped-def]
    while True:
        size_line = await reader.readline()
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)


async def _plain(reader: asyncio.StreamReader):  # type: ignore[no-untyped-def]
    while data := await reader.read(65536):
        yield data


async def _events(body, r: Reply, chat: bool) -> None:  # type: ignore[no-untyped-def]
    buf = b""
    parts: list[str] = []
    finished = False
    async for piece in body:
        now = time.perf_counter_ns()
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    r.text = "".join(parts)
                    return
                obj = json.loads(payload)
                r.request_id = r.request_id or obj.get("id", "")
                if obj.get("usage"):
                    r.usage = obj["usage"]
                choices = obj.get("choices") or ()
                if choices:  # a token's chunk, its text possibly empty (vLLM's bench counts it too)
                    r.chunk_ns.append(now)
                for ch in choices:
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    parts.append(text or "")
                    finished = finished or bool(ch.get("finish_reason"))
    r.text = "".join(parts)
    if not finished:  # some servers (transformers serve) end after the finish_reason, without [DONE]
        r.error = "the stream ended before a finish_reason or [DONE]"


def _message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        return str(obj.get("error", {}).get("message") or obj)[:200]
    except ValueError:
        return raw[:200].decode("utf-8", "replace")
