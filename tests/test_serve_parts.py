"""The serving pieces without a server: stop strings, cross-thread aborts, request bodies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from scheduler.core.aborts import AbortInbox
from scheduler.core.request import ReqSample, SamplingParams
from scheduler.core.request_manager import RequestManager
from scheduler.hops.tokenizer_pool import TokenizerPool
from scheduler.serving.protocol import BadRequest, ChatCompletionRequest, CompletionRequest
from scheduler.serving.stop import StopMatcher


def _expected(full: str, stops: list[str]) -> str:
    hits = [(i + len(s), i) for s in stops if s and (i := full.find(s)) >= 0]
    return full[: min(hits)[1]] if hits else full


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("abc", max_size=4), max_size=8), st.lists(st.text("abc", min_size=1, max_size=3), max_size=3))
def test_stop_strings_cut_the_text_wherever_the_pieces_split_it(pieces, stops):
    m = StopMatcher(stops)
    sent = "".join(m.push(p) for p in pieces) + m.flush()
    assert sent == _expected("".join(pieces), stops)


def test_a_stop_string_split_across_tokens_never_reaches_the_client():
    m = StopMatcher(["</end>"])
    assert m.push("hello </") == "hello "
    assert m.push("en") == ""
    assert m.push("d> more") == "" and m.done
    assert m.flush() == ""


def _sample(rid: str) -> ReqSample:
    return ReqSample(rid, [1, 2, 3], 3, SamplingParams(), 0)


def test_an_abort_finds_a_live_request_or_waits_for_one_still_in_the_tokenizer_pool():
    rm = RequestManager()
    inbox = AbortInbox()
    live = rm.enqueue(_sample("a"))
    inbox.post("a", "client disconnected")
    inbox.post("b", "client disconnected")  # not arrived yet
    assert inbox.take(rm.waiting, in_pool=True) == [(live, "client disconnected")]
    assert inbox.arrived("b") == "client disconnected"
    assert inbox.arrived("b") is None


def test_an_abort_for_a_request_that_already_finished_is_dropped():
    inbox = AbortInbox()
    inbox.post("gone", "client disconnected")
    assert inbox.take([], in_pool=False) == []
    assert inbox.arrived("gone") is None


def test_bodies_are_strictly_typed():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": "5"})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": -1})
    with pytest.raises(BadRequest, match="only with echo"):  # 0 scores the prompt: with echo only
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 0}).unsupported()
    CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True}).unsupported()
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    ok = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "temperature": 0, "unknown": 1})
    assert ok.prompts() == [[1, 2]] and ok.params(ok.max_tokens).temperature == 0.0
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompts() == ["a", "b"]
    with pytest.raises(BadRequest, match="empty"):
        CompletionRequest.model_validate({"model": "m", "prompt": [[1], []]}).prompts()


def test_a_chat_request_without_max_tokens_fills_what_the_context_leaves():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert body.params(body.wanted_tokens()).fill_context
    assert not body.params(7).fill_context


def test_token_ids_skip_the_tokenizer_pool():
    # no tokenizer, so a text prompt is refused; token ids need none and are ready as the
    # submit returns, without a pool thread's turn (a thread hop of milliseconds under a burst)
    rows: list[tuple[int, int, str, str, int, int]] = []
    pool = TokenizerPool(None, 1, SimpleNamespace(buffer=lambda: rows, rank=0))  # type: ignore[arg-type]
    try:
        with pytest.raises(ValueError, match="no tokenizer"):
            pool.submit("text", "hello", SamplingParams(), 0)
        pool.submit("ids", [5, 6, 7], SamplingParams(), 100)
        got = pool.ready.get_nowait()
        assert (got.request_id, got.input_ids, got.arrival_ns) == ("ids", [5, 6, 7], 100)
        assert [(r[0], r[2]) for r in rows] == [(100, "tokenize")]  # its row: the hand-over alone
    finally:
        pool.shutdown()


@settings(max_examples=300, deadline=None)
@given(st.text(), st.booleans(), st.text(min_size=1, max_size=12))
def test_a_token_chunk_is_the_bytes_its_dict_encodes_to(text, chat, model):
    """The chunk's frame, encoded once per response, around the token's text: the same bytes
    as json.dumps of the whole chunk, whatever the text (escapes, surrogates, the frame's mark)."""
    from scheduler.serving.responses import Call, _Chunks, _data
    from scheduler.serving.streams import Text

    chunks = _Chunks(Call(chat, ["p"], SamplingParams(), [], True, False, model, True), "cmpl-x", str)
    for t in (text, "\x00text\x00" + text, ""):
        assert chunks.text(0, Text(t)) == _data(chunks._dict(0, t, None, None))


def test_an_inbox_hands_items_in_order_and_times_a_wait_out():
    import asyncio

    from scheduler.serving.streams import Inbox

    async def main() -> None:
        box: Inbox[int] = Inbox(asyncio.get_running_loop())
        assert box.take() is None
        assert await box.get(0.01) is None  # nothing came: the wait ends
        asyncio.get_running_loop().call_later(0.01, box.put, 1)
        asyncio.get_running_loop().call_later(0.01, box.put, 2)
        assert await box.get(5) == 1  # woken by the first put, not by the timeout
        assert box.take() == 2 and box.take() is None
        waiting = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="one reader"):
            await box.get()
        waiting.cancel()  # a reader that goes away leaves the inbox usable
        with pytest.raises(asyncio.CancelledError):
            await waiting
        box.put(3)
        assert await box.get() == 3

    asyncio.run(main())
