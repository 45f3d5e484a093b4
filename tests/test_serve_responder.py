"""The Responder (scheduler/serving/responses.py) on its own event loop, fed by hand: what it
does with the engine's request when its client goes, when its task is cancelled, and when
the engine cannot take the prompt."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from scheduler.core.request import SamplingParams, TokenLogprob
from scheduler.hops.sender import FinishedRecord
from scheduler.hops.tokenizer_pool import NoTokenizer
from scheduler.serving.protocol import BadRequest
from scheduler.serving.responses import Call, ClientGone, Responder
from scheduler.serving.streams import ResponseStreams, Text


class Engine:
    """Posts a token to each request it was given every `every_s`, until it is aborted."""

    def __init__(self, streams: ResponseStreams, every_s: float = 0.02, tokenizer: bool = True) -> None:
        self.streams, self.every_s, self.tokenizer = streams, every_s, tokenizer
        self.aborted: list[tuple[str, str]] = []
        self.submitted: list[str] = []
        self.feeding: list[asyncio.Task[None]] = []

    def submit(self, prompt: Any, params: SamplingParams, rid: str, special: bool) -> None:
        self.submitted.append(rid)
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
        r, engine, streams = responder({"tokenizer": False})

        async def here() -> bool:
            return False

        with pytest.raises(BadRequest) as e:
            await r.answer(call(n=n), here)
        assert e.value.status == 400 and e.value.code == "no_tokenizer" and "input_ids" in e.value.message
        assert not streams._open
        await asyncio.sleep(0.05)  # the other samples' tasks, cancelled: none submits after the refusal
        assert len(engine.submitted) == 1
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    asyncio.run(main())


def finished(rid: str, reason: str = "aborted") -> FinishedRecord:
    return FinishedRecord(rid, [1, 2], [3], 0, reason, "stop string matched", *[0] * 7, 0, 1, [0])


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_in_the_first_token_still_echoes_the_prompt_and_its_logprobs(stream):
    """The first token is the stop string: no text to answer, but the prompt is echoed (with
    its logprobs, where asked) whether streamed or not, as it is after any other answer."""
    async def main() -> list[Any]:
        streams = ResponseStreams(lambda rid, why: None, lambda t: (f"<{t}>", False))
        loop = asyncio.get_running_loop()

        def submit(prompt: Any, params: SamplingParams, rid: str, special: bool) -> None:
            def sender() -> None:  # the sender thread's calls, for the first token "\n"
                streams.on_logprobs(rid, ([1, 2], [None, TokenLogprob(-0.5, [2], [-0.5])]), (3, TokenLogprob(-1.0, [3], [-1.0])))
                streams.on_text(rid, "\n")
                streams.on_finish(finished(rid), "\n")
                streams.on_round_end()
            loop.call_soon(sender)

        r = Responder(streams, submit, lambda rid, why: None, None, lambda: 0)

        async def here() -> bool:
            return False

        c = Call(False, ["Q:"], SamplingParams(logprobs=0), ["\n"], stream, False, "m", True, echo=True, logprobs=True)
        out = await r.answer(c, here)
        if isinstance(out, dict):
            return [out]
        return [json.loads(line[6:]) for chunk in [b async for b in out]
                for line in chunk.decode().splitlines() if line.startswith("data: {")]

    replies = asyncio.run(main())
    choices = [ch for rep in replies for ch in rep["choices"]]
    assert "".join(ch["text"] for ch in choices) == "Q:"
    assert choices[-1]["finish_reason"] == "stop"
    tokens = [t for ch in choices if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    # the prompt's two, then the first token's, as a stop string's token is scored later in an answer
    assert tokens == ["<1>", "<2>", "<3>"]


def test_a_stop_string_finish_counts_the_tokens_answered_and_is_a_stop_in_the_metrics():
    """The engine ran two rounds more before the sender's abort reached it: usage counts the
    tokens through the one the stop string ended in, and /metrics counts the finish a
    "stop", as the client sees it (the engine's record says aborted)."""
    from prometheus_client import generate_latest

    from scheduler.serving.metrics import ServerMetrics
    from scheduler.serving.protocol import STOP_MATCHED

    async def main() -> dict[str, Any]:
        streams = ResponseStreams(lambda rid, why: None, lambda t: ("x", False))
        loop = asyncio.get_running_loop()

        def submit(prompt: Any, params: SamplingParams, rid: str, special: bool) -> None:
            def sender() -> None:
                for text in ("a", "b.", "c", "d"):  # the stop string "." in the second token
                    streams.on_text(rid, text)
                rec = finished(rid)
                rec.output_ids, rec.finish_detail = [3, 4, 5, 6], STOP_MATCHED
                streams.on_finish(rec, "ab.cd")
                streams.on_round_end()
            loop.call_soon(sender)

        r = Responder(streams, submit, lambda rid, why: None, None, lambda: 0)

        async def here() -> bool:
            return False

        out = await r.answer(Call(False, ["Q"], SamplingParams(), ["."], False, False, "m", True), here)
        assert isinstance(out, dict)
        return out

    reply = asyncio.run(main())
    assert reply["choices"][0]["text"] == "ab" and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 2
    m = ServerMetrics("m", 64)
    rec = finished("r")
    rec.finish_detail = STOP_MATCHED
    m.on_finish(rec, "")
    text = generate_latest(m.registry).decode()
    assert 'mstrace:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in text


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_closed_before_its_first_chunk_ends_its_requests(n):
    """The server closes a body it never asked a chunk of (its response's start failed):
    closing an async generator that never started skips its `finally`, so the body says
    itself what that `finally` would have done: the requests aborted, their inboxes closed."""
    async def main() -> None:
        r, engine, streams = responder()

        async def here() -> bool:
            return False

        body = await r.answer(call(stream=True, n=n), here)
        assert len(streams._open) == n
        await body.aclose()  # type: ignore[union-attr]  # the server's close of a body it never iterated
        assert sorted(why for _, why in engine.aborted) == ["client disconnected"] * n
        assert not streams._open
        for t in engine.feeding:
            await t

    asyncio.run(main())


def test_a_rounds_texts_reach_their_inboxes_in_one_post_in_order():
    """The sender's events of a round are posted to the event loop in one call once the round
    is delivered (a call per token woke the loop once per stream), each Text stamped then."""
    async def main() -> None:
        streams = ResponseStreams(lambda rid, why: None, lambda t: ("x", False))
        loop = asyncio.get_running_loop()
        inboxes = {rid: streams.open(rid, []) for rid in ("a", "b")}
        posts = []
        real = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            if getattr(args[0], "__name__", "") == "_put_all":  # (not the executor's own hand-back)
                posts.append(args)
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def sender() -> None:
            streams.on_text("a", "1")
            streams.on_text("b", "2")
            streams.on_text("a", "3")
            streams.on_finish(finished("b", "length"), "2")
            assert not posts  # nothing posted mid-round
            streams.on_round_end()
            streams.on_round_end()  # an empty round posts nothing

        await loop.run_in_executor(None, sender)
        await asyncio.sleep(0)
        assert len(posts) == 1
        got = {rid: [inboxes[rid].take() for _ in range(2)] for rid in inboxes}
        assert [ev.text for ev in got["a"]] == ["1", "3"]
        assert got["b"][0].text == "2" and got["b"][1].finish_reason == "length"
        stamps = {ev.posted_ns for evs in got.values() for ev in evs if isinstance(ev, Text)}
        assert len(stamps) == 1 and stamps.pop() > 0

    asyncio.run(main())


def test_a_streams_first_token_is_posted_ahead_of_the_rounds_other_streams():
    """The event loop resumes the streams in the order of the round's post: a stream whose first
    token is in the round goes first, so its chunk is not written behind a batch of other
    streams' next tokens; each stream's own events keep their order."""
    async def main() -> None:
        streams = ResponseStreams(lambda rid, why: None, lambda t: ("x", False))
        loop = asyncio.get_running_loop()
        inboxes = {rid: streams.open(rid, []) for rid in ("a", "b", "c", "d")}
        names = {id(q): rid for rid, q in inboxes.items()}
        posts: list[list[tuple[str, str]]] = []
        real = loop.call_soon_threadsafe

        def counted(*args: Any) -> Any:
            if getattr(args[0], "__name__", "") == "_put_all":
                posts.append([(names[id(q)], ev.text if isinstance(ev, Text) else ev.finish_reason)
                              for q, ev in args[1]])
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        def sender() -> None:
            streams.on_text("a", "a1")
            streams.on_text("b", "b1")
            streams.on_round_end()
            streams.on_text("a", "a2")
            streams.on_text("b", "b2")
            streams.on_text("c", "c1")
            streams.on_finish(finished("c", "length"), "c1")
            streams.on_text("d", "d1")
            streams.on_finish(finished("a", "length"), "a2")
            streams.on_round_end()
            streams.on_text("d", "d2")
            streams.on_round_end()

        await loop.run_in_executor(None, sender)
        await asyncio.sleep(0)
        assert posts == [[("a", "a1"), ("b", "b1")],
                         [("c", "c1"), ("c", "length"), ("d", "d1"), ("a", "a2"), ("b", "b2"), ("a", "length")],
                         [("d", "d2")]]

    asyncio.run(main())


@pytest.mark.parametrize("sender_stalls", [False, True])
def test_an_engine_failure_ends_a_request_after_the_rounds_the_sender_still_holds(sender_stalls, monkeypatch):
    """The engine fails with a round that finished a request still queued to the sender: the
    request ends as that round says (`length`), not as the failure, which once overtook it.
    A sender that never gets to it does not hold the failure back (FAIL_WITHIN_S; made long
    where the sender does get to it, so that a loaded host cannot fire it first)."""
    import threading
    from types import SimpleNamespace

    import scheduler.serving.engine_loop as engine_loop
    from scheduler.hops.sender import Sender, StepOutput
    from scheduler.serving.engine_loop import EngineLoop

    if not sender_stalls:
        monkeypatch.setattr(engine_loop, "FAIL_WITHIN_S", 600.0)

    async def main() -> list[Any]:
        streams = ResponseStreams(lambda rid, why: None, lambda t: ("x", False))
        inbox = streams.open("a", [])
        release = threading.Event()
        sender = Sender(None, [streams], None, before_deliver=lambda: release.wait(60))

        def drive(*_: Any) -> None:
            sender.queue.put(StepOutput(1, [("a", 7)], finished=[finished("a", "length")]))
            raise RuntimeError("the forward raised")

        loop = EngineLoop(SimpleNamespace(drive=drive, sender=sender), on_fail=streams.fail_all)
        loop.start()
        if not sender_stalls:
            await asyncio.sleep(0.1)  # (the failure is in while the sender holds the round, or soon after)
            release.set()
        got = [await inbox.get(30)]
        if not sender_stalls:
            got.append(await inbox.get(30))
        release.set()
        sender.close()
        return got

    got = asyncio.run(main())
    if sender_stalls:
        assert got[0].failed and "the forward raised" in got[0].detail, got
    else:
        assert isinstance(got[0], Text) and got[1].finish_reason == "length" and not got[1].failed, got
