"""The Responder (scheduler/serving/responses.py) on its own event loop, fed by hand: what it
does with the engine's request when its client goes, when its task is cancelled, and when
the engine cannot take the prompt."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from scheduler.core.request import SamplingParams
from scheduler.hops.tokenizer_pool import NoTokenizer
from scheduler.serving.protocol import BadRequest
from scheduler.serving.responses import Call, ClientGone, Responder
from scheduler.serving.streams import ResponseStreams, Text


class Engine:
    """Posts a token to each request it was given every `every_s`, until it is aborted."""

    def __init__(self, streams: ResponseStreams, every_s: float = 0.02, tokenizer: bool = True) -> None:
        self.streams, self.every_s, self.tokenizer = streams, every_s, tokenizer
        self.aborted: list[tuple[str, str]] = []
        self.feeding: list[asyncio.Task[None]] = []

    def submit(self, prompt: Any, params: SamplingParams, rid: str, special: bool) -> None:
        if isinstance(prompt, str) and not self.tokenizer:
            raise NoTokenizer("this model folder has no tokenizer; give input_ids instead of a prompt")
        inbox = self.streams._open[rid].inbox

        async def feed() -> None:
            while all(r != rid for r, _ in self.aborted):
                inbox.put(Text("x"))
                await asyncio.sleep(self.every_s)

        self.feeding.append(asyncio.get_running_loop().create_task(feed()))

    def abort(self, rid: str, why: str) -> None:
        self.aborted.append((rid, why))


def responder(engine_kw: dict[str, Any] | None = None) -> tuple[Responder, Engine, ResponseStreams]:
    holder: list[Engine] = []
    streams = ResponseStreams(lambda rid, why: holder[0].abort(rid, why), lambda t: ("x", False))
    engine = Engine(streams, **(engine_kw or {}))
    holder.append(engine)
    return Responder(streams, engine.submit, engine.abort, None, lambda: 0), engine, streams


def call(stream: bool = False, n: int = 1) -> Call:
    return Call(False, ["hello"], SamplingParams(max_new_tokens=100_000), [], stream, False, "m", True, n=n)


def test_a_reply_not_streamed_is_aborted_soon_after_its_client_goes_though_tokens_keep_coming():
    """Tokens every 20 ms: no wait for the next ever times out, yet the client is asked
    about every DISCONNECT_POLL_S (0.25 s) and the request is aborted (its KV blocks freed) rather
    than run to its last token for nobody."""
    async def main() -> None:
        r, engine, streams = responder()
        gone_at = asyncio.get_running_loop().time() + 0.3

        async def disconnected() -> bool:
            return asyncio.get_running_loop().time() >= gone_at

        # 100,000 tokens 20 ms apart would take half an hour: an answer within 30 s is one the
        # poll cut short (it takes about 0.5 s here; the bound only ends a regression quickly)
        with pytest.raises(ClientGone):
            await asyncio.wait_for(r.answer(call(), disconnected), 30)
        assert [why for _, why in engine.aborted] == ["client disconnected"]
        assert not streams._open  # its inbox closed
        for t in engine.feeding:
            await t

    asyncio.run(main())


def test_a_cancelled_request_is_aborted_in_the_engine():
    """A server shutting down cancels its requests' tasks: each one's engine request is
    aborted too, not only its inbox closed (else the scheduling thread runs it on)."""
    async def main() -> None:
        r, engine, streams = responder()

        async def here() -> bool:
            return False

        task = asyncio.create_task(r.answer(call(), here))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [why for _, why in engine.aborted] == ["request cancelled"]
        assert not streams._open
        for t in engine.feeding:
            await t

    asyncio.run(main())


@pytest.mark.parametrize("n", [1, 3])
def test_a_text_prompt_without_a_tokenizer_is_a_400_and_leaves_no_inbox(n):
    async def main() -> None:
        r, _, streams = responder({"tokenizer": False})

        async def here() -> bool:
            return False

        with pytest.raises(BadRequest) as e:
            await r.answer(call(n=n), here)
        assert e.value.status == 400 and e.value.code == "no_tokenizer" and "input_ids" in e.value.message
        assert not streams._open

    asyncio.run(main())
