"""The generation routes' two paths (scheduler/serving/app.py, GenerationRoutes): a body that
validates is served in front of FastAPI, any other goes on to FastAPI's routes. Both give the
engine the same call for the same body, and the same refusals."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler.serving import app as app_module
from scheduler.serving.app import ServerState, make_app
from scheduler.serving.engine_loop import Health
from scheduler.serving.responses import Call


class Recorder:
    """The responder: records each call and answers it with a small JSON body."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    async def answer(self, call: Call, disconnected: Any) -> dict[str, Any]:
        self.calls.append(call)
        return {"answered": len(self.calls)}


class Template:
    def render(self, messages: list[Any]) -> str:
        return "|".join(f"{m.role}:{m.content}" for m in messages)


def server(api_key: str | None = None, healthy: bool = True) -> tuple[Any, Recorder]:
    rec = Recorder()
    health = Health(True, "running", "") if healthy else Health(False, "stalled", "a wait past its timeout")
    state = ServerState(loop=SimpleNamespace(health=lambda: health), metrics=None, responder=rec,  # type: ignore[arg-type]
                        chat=Template(), model="m", max_model_len=4096, api_key=api_key, started=0)  # type: ignore[arg-type]
    return make_app(state, max_body_bytes=4096), rec


def post(app: Any, path: str, body: bytes, content_type: str | None = "application/json",
         key: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = [(b"host", b"test"), (b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type.encode()))
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "state": {}, "extensions": {}}
    sent: list[dict[str, Any]] = []
    body_msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if body_msgs:
            return body_msgs.pop()
        await asyncio.sleep(3600)  # the client stays: nothing more arrives
        return {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]) or b"{}")


COMPLETIONS = [
    {"model": "m", "prompt": "hello", "max_tokens": 5},
    {"model": "m", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3, "temperature": 0, "stop": ["x", "yz"], "n": 2},
    {"model": "m", "prompt": [7, 8, 9], "stream": True, "stream_options": {"include_usage": True}, "logprobs": 2,
     "echo": True, "max_tokens": 0, "seed": 4, "top_p": 0.5, "unknown_field": 1},
]
CHATS = [
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
     "max_tokens": 9, "stream": True, "logprobs": True, "top_logprobs": 2, "stop": "\n"},
]
BODIES = [("/v1/completions", b) for b in COMPLETIONS] + [("/v1/chat/completions", b) for b in CHATS]


@pytest.mark.parametrize("path, body", BODIES)
def test_a_body_gets_the_same_call_in_front_of_fastapi_as_through_it(path, body, monkeypatch):
    # the key is checked once in front, once more by FastAPI's dependency when a body goes on to it
    checks: list[str] = []
    check = app_module.check_key
    monkeypatch.setattr(app_module, "check_key", lambda state, headers: (checks.append(path), check(state, headers)))
    app, rec = server(api_key="k")
    raw = json.dumps(body).encode()
    # application/json is served in front; FastAPI reads a +json type as JSON too, and is given it
    assert post(app, path, raw, key="k") == (200, {"answered": 1}) and len(checks) == 1
    assert post(app, path, raw, "application/vnd.test+json", key="k") == (200, {"answered": 2}) and len(checks) == 3
    assert rec.calls[0] == rec.calls[1]
    # no content type: FastAPI validates the raw bytes, and refuses them, as it always has
    assert post(app, path, raw, content_type=None, key="k")[0] == 400 and len(checks) == 5 and len(rec.calls) == 2


@pytest.mark.parametrize("content_type", ["application/json", "application/vnd.test+json"])
def test_refusals_are_the_same_on_both_paths(content_type):
    app, rec = server(api_key="k")
    ok = json.dumps(COMPLETIONS[0]).encode()

    def refusal(path: str, raw: bytes, key: str | None = "k") -> tuple[int, str | None, str]:
        status, reply = post(app, path, raw, content_type, key)
        return status, reply["error"]["code"], reply["error"]["message"]

    assert refusal("/v1/completions", ok, key=None)[:2] == (401, "invalid_api_key")
    assert refusal("/v1/completions", ok, key="wrong")[:2] == (401, "invalid_api_key")
    assert refusal("/v1/completions", json.dumps({**COMPLETIONS[0], "model": "other"}).encode())[:2] == (
        404, "model_not_found")
    status, _, message = refusal("/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in message
    assert refusal("/v1/completions", b"[" * 3000)[0] == 400  # json.loads' RecursionError: FastAPI's 400, not a 500
    # the key before the body: a caller without it learns nothing of the API, not even that
    # its JSON is broken (FastAPI alone would parse the body first and say so)
    assert refusal("/v1/completions", b"{not json", key=None)[:2] == (401, "invalid_api_key")
    status, _, message = refusal("/v1/completions", json.dumps({**COMPLETIONS[0], "max_tokens": "5"}).encode())
    assert status == 400 and message.startswith("max_tokens:")
    status, _, message = refusal("/v1/chat/completions", json.dumps({"model": "m", "messages": []}).encode())
    assert status == 400 and message.startswith("messages:")
    assert refusal("/v1/completions", json.dumps({**COMPLETIONS[0], "prompt": [[1], []]}).encode())[0] == 400
    assert refusal("/v1/completions", b"x" * 5000)[:2] == (413, "body_too_large")
    assert rec.calls == []
    sick, _ = server(healthy=False)
    status, reply = post(sick, "/v1/completions", ok, content_type)
    assert status == 503 and reply["error"]["code"] == "engine_unavailable"


def test_a_body_of_another_type_is_fastapis_to_refuse():
    app, rec = server()
    status, reply = post(app, "/v1/completions", json.dumps(COMPLETIONS[0]).encode(), "text/plain")
    assert status == 400 and rec.calls == []  # FastAPI validates a text body's bytes, not its JSON


def test_an_event_stream_ends_its_body_when_the_client_goes() -> None:
    """EventStream (uvicorn's ASGI 2.3: a write to a client that went away is dropped): the
    disconnect ends the stream without an error, and the body's `finally` runs (where a served
    stream aborts its request)."""
    from scheduler.serving.app import EventStream

    closed: list[bool] = []

    async def body() -> Any:
        try:
            yield b"data: a\n\n"
            await asyncio.sleep(3600)  # the next token never comes
            yield b"data: b\n\n"
        finally:
            closed.append(True)

    async def main() -> list[dict[str, Any]]:
        gone = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(m: Any) -> None:
            sent.append(m)
            if m.get("body"):
                asyncio.get_running_loop().call_later(0.01, gone.set)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/"}
        await asyncio.wait_for(EventStream(body(), media_type="text/event-stream")(scope, receive, send), 10)
        return sent

    sent = asyncio.run(main())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert closed == [True]


def _stream_scenario(body: Any, *, outside_cancel: bool = False, refuse_writes: bool = False,
                     seen: Any = lambda: "") -> str:
    """Run an EventStream of `body` whose client leaves after the first chunk; `outside_cancel`:
    something else cancels the stream in the same turn (a shutdown, a timeout); `refuse_writes`:
    a write to the gone client raises OSError (ASGI 2.4). Returns how the stream's task ended,
    with `seen()` as it ended."""
    from scheduler.serving.app import EventStream

    async def main() -> str:
        gone = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await gone.wait()
            return {"type": "http.disconnect"}

        left: list[bool] = []

        async def send(m: Any) -> None:
            if left:
                raise OSError("the client went away")
            if m.get("body"):
                loop.call_later(0.01, leave)

        def leave() -> None:
            if refuse_writes:  # ASGI 2.4: the write says so before any receive does
                left.append(True)
                return
            gone.set()
            if outside_cancel:
                task.cancel()

        loop = asyncio.get_running_loop()
        task = asyncio.create_task(EventStream(body, media_type="text/event-stream")(
            {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/"},
            receive, send))
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
            return f"returned, cancelling {task.cancelling()}{seen()}"
        except asyncio.CancelledError:
            return f"cancelled{seen()}"

    return asyncio.run(main())


def test_an_event_stream_does_not_swallow_a_cancel_that_is_not_its_own() -> None:
    async def body() -> Any:
        yield b"data: a\n\n"
        await asyncio.sleep(3600)

    assert _stream_scenario(body()) == "returned, cancelling 0"
    assert _stream_scenario(body(), outside_cancel=True) == "cancelled"


def test_an_event_stream_ends_quietly_when_its_body_or_its_write_finds_the_client_gone() -> None:
    from scheduler.serving.responses import ClientGone

    closed: list[str] = []

    async def polled() -> Any:  # the responder's own poll saw the disconnect first
        yield b"data: a\n\n"
        raise ClientGone

    async def endless() -> Any:
        try:
            while True:
                yield b"data: a\n\n"
                await asyncio.sleep(0.02)
        finally:
            closed.append("closed")

    assert _stream_scenario(polled()) == "returned, cancelling 0"
    # closed as the stream ends, not when the loop shuts down (or the generator is collected)
    assert _stream_scenario(endless(), refuse_writes=True, seen=lambda: f", {closed}") \
        == "returned, cancelling 0, ['closed']"
