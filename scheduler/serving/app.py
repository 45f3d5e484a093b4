"""The HTTP routes (FastAPI): OpenAI's completions, chat completions and models,
/health, and OpenAI's error object for every refusal.

Nothing here runs a round or blocks the event loop: a request is submitted to the
engine's tokenizer pool and answered from its queue (scheduler/serving/responses.py).

The two generation routes are served by `GenerationRoutes`, in front of FastAPI: a body that
parses and validates goes from there straight to its call, without FastAPI's routing and
dependency solving (more than half of a request's time on the event loop, which a burst of
arrivals queues behind); any other body goes on to FastAPI's routes, whose validation says
what is wrong with it as it always has.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.serving.chat import ChatTemplate
from scheduler.serving.engine_loop import EngineLoop
from scheduler.serving.http_timing import HttpTimes, http_times
from scheduler.serving.metrics import ServerMetrics
from scheduler.serving.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    created,
    error_body,
)
from scheduler.serving.responses import Call, ClientGone, Responder


@dataclass(slots=True)
class ServerState:
    loop: EngineLoop
    metrics: ServerMetrics
    responder: Responder
    chat: ChatTemplate
    model: str  # the name clients use
    max_model_len: int
    api_key: str | None
    started: int  # unix seconds, for /v1/models


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


class BodyLimit:
    """413 for a body over `limit` bytes. A POST body is read whole (at most `limit`
    bytes are held) before the route sees it, then replayed; after it, `receive` is the
    server's again, so a route can still tell when its client goes away."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_big(scope, receive, send)
            return
        chunks, seen = [], 0
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            chunks.append(m.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                await self._too_big(scope, receive, send)
                return
            if not m.get("more_body"):
                break
        await self.app(scope, _replaying(b"".join(chunks), receive), send)

    async def _too_big(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(413, f"request body over {self.limit} bytes", code="body_too_large")(scope, receive, send)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` that hands out `body` first, as one message, then the server's messages."""
    replay: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return replay.pop() if replay else await receive()

    return replayed


def check_key(state: ServerState, headers: Mapping[str, str]) -> None:
    if state.api_key is None:
        return
    got = headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
        raise BadRequest("missing or wrong API key (Authorization: Bearer KEY)", status=401,
                         kind="authentication_error", code="invalid_api_key")


def _admit(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> None:
    """The checks every generation request passes before it is submitted."""
    if body.model != state.model:
        raise BadRequest(f"the model `{body.model}` does not exist; this server serves `{state.model}`",
                         param="model", code="model_not_found", status=404)
    body.unsupported()
    h = state.loop.health()
    if not h.ok:
        raise BadRequest(f"the engine is {h.state}: {h.detail}", status=503, kind="server_error",
                         code="engine_unavailable")


def completion_call(state: ServerState, body: CompletionRequest, http: HttpTimes | None) -> Call:
    _admit(state, body)
    return Call(False, body.prompts(), body.sampling(), body.stop_strings(), body.stream, body.include_usage(),
                state.model, body.add_special_tokens, echo=body.echo, logprobs=body.logprobs is not None,
                drop_output=body.max_tokens == 0, n=body.n, http=http)


def chat_call(state: ServerState, body: ChatCompletionRequest, http: HttpTimes | None) -> Call:
    _admit(state, body)  # before the template is rendered: the checks are cheaper
    return Call(True, [state.chat.render(body.messages)], body.sampling(), body.stop_strings(), body.stream,
                body.include_usage(), state.model, body.add_special_tokens, logprobs=body.logprobs, n=body.n,
                http=http)


async def reply(state: ServerState, call: Call, request: Request) -> Response:
    try:
        out = await state.responder.answer(call, request.is_disconnected)
    except ClientGone:
        return JSONResponse({}, status_code=499)  # nobody reads it; the request is aborted
    if isinstance(out, dict):
        return JSONResponse(out)
    return EventStream(out, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStream(StreamingResponse):
    """StreamingResponse's bytes, without its task group. uvicorn speaks ASGI 2.3, where a
    write to a client that has gone is dropped, not refused, so Starlette runs the body and a
    disconnect listener in an anyio task group: cancel scopes on every response and every
    chunk, a tenth of the event loop's time per streamed request. Here the listener is a
    plain task that cancels the stream; a body that ends early is closed at once, so its own
    `finally` aborts its request (a served stream's does)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        pending: list[asyncio.Handle] = []
        fired = False

        def cancel() -> None:
            nonlocal fired
            fired = True
            streaming.cancel()

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            # on the next turn, as anyio does: a write that waited on a full socket is woken by
            # the same disconnect, and gets to return (and its response_deliver row to be kept)
            pending.append(asyncio.get_running_loop().call_soon(cancel))

        listener = asyncio.create_task(listen())
        ended = False
        try:
            await self.stream_response(send)
            ended = True
        except asyncio.CancelledError:
            # the listener's own cancel is taken back; any other (a shutdown, a timeout) goes on
            if not fired or streaming.uncancel() > 0:
                raise
        except (ClientGone, OSError):  # the body's own disconnect poll; ASGI 2.4's refused write
            pass
        finally:
            listener.cancel()
            for h in pending:  # the stream ended before the cancel came
                h.cancel()
            if not ended:
                await _close(self.body_iterator)


async def _close(body: Any) -> None:
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        await aclose()


class GenerationRoutes:
    """POST /v1/completions and /v1/chat/completions in front of FastAPI (module docstring).

    The key is checked first; the body is parsed by the same `json.loads` and validated by
    the same model as FastAPI's route, so a body served here gets exactly the call it would
    have got there. A body that fails either, or comes as another content type, is replayed
    to FastAPI unchanged."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state
        self.routes: dict[str, tuple[type[BaseModel], Any]] = {
            "/v1/completions": (CompletionRequest, completion_call),
            "/v1/chat/completions": (ChatCompletionRequest, chat_call),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            check_key(self.state, request.headers)
        except BadRequest as e:
            await _refusal(e)(scope, receive, send)
            return
        raw, disconnected = await _read_body(receive)
        if disconnected:  # (not behind BodyLimit, which answers a client gone mid-body itself)
            return
        model, make = route
        body = _validated(model, raw, request.headers.get("content-type"))
        if body is None:
            await self.app(scope, _replaying(raw, receive), send)
            return
        try:
            response = await reply(self.state, make(self.state, body, http_times(scope)), request)
        except BadRequest as e:
            response = _refusal(e)
        await response(scope, receive, send)


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            return b"", True
        chunks.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(chunks), False


def _validated(model: type[BaseModel], raw: bytes, content_type: str | None) -> Any:
    """The body as FastAPI's route would get it, or None where FastAPI would refuse it or
    read it otherwise: no content type (FastAPI reads it strictly: it validates the raw
    bytes) or another one than JSON."""
    if not content_type or content_type.split(";", 1)[0].strip().lower() != "application/json":
        return None
    try:
        return model.model_validate(json.loads(raw))
    except Exception:  # whatever it is (a RecursionError from deep nesting too), FastAPI says so
        return None


def _refusal(e: BadRequest) -> JSONResponse:
    return _error(e.status, e.message, e.kind, e.param, e.code)


def make_app(state: ServerState, max_body_bytes: int) -> ASGIApp:
    """The server's ASGI app: the body limit, then the generation routes, then FastAPI. The
    two are outside FastAPI's own middleware, which wraps every `send` of a stream and looks
    up OpenTelemetry's settings for every request; the limit holds on both paths."""
    app = FastAPI(title="mstrace serve", version="1", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals: a body it cannot decode, an unknown route, a wrong method
        msg = "the body is not valid JSON (or not UTF-8)" if exc.status_code == 400 else str(exc.detail)
        return _error(exc.status_code, msg, "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(BadRequest)
    async def refused(request: Request, exc: BadRequest) -> JSONResponse:
        return _refusal(exc)

    # async: FastAPI runs a plain `def` dependency on its thread pool, a thread hop per request
    async def authorize(request: Request) -> None:
        check_key(state, request.headers)

    # the key is checked before the body is: a caller without it learns nothing of the API.
    # The generation routes here answer the bodies GenerationRoutes passes on: those that
    # do not validate.
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await reply(state, completion_call(state, body, http_times(request.scope)), request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await reply(state, chat_call(state, body, http_times(request.scope)), request)

    @v1.get("/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": state.model, "object": "model", "created": state.started,
                                            "owned_by": "mstrace", "max_model_len": state.max_model_len}]}

    @app.get("/health")
    async def health() -> Any:
        h = state.loop.health()
        return JSONResponse({"status": h.state, "detail": h.detail, "time": created()},
                            status_code=200 if h.ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(v1)
    return BodyLimit(GenerationRoutes(app, state), max_body_bytes)
