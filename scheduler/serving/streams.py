"""From the sender thread to each HTTP response: one inbox per request.

The scheduling thread hands a round's tokens to the sender (`response_send`); the
sender detokenizes and calls this sink, which matches stop strings and, once the
round's tokens are all in, posts their texts to the requests' inboxes on the event
loop with one `call_soon_threadsafe` (one wake-up of the loop a round: a post per
token woke it, and handed it the interpreter lock, once per stream). So
neither the scheduling thread nor the sender ever touches a socket: a client that
reads slowly only lets its own inbox grow, and the socket write is probed as
`response_deliver` where the response is written (scheduler/serving/app.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from probes.clock import now_ns
from scheduler.core.request import TokenLogprob
from scheduler.hops.sender import FinishedRecord
from scheduler.serving.logprobs import Scored, scored
from scheduler.serving.protocol import FINISH_REASON, STOP_MATCHED
from scheduler.serving.stop import StopMatcher


@dataclass(slots=True, frozen=True)
class Text:
    text: str
    logprobs: tuple[Scored, ...] = ()  # the token's, where asked (and of tokens whose event was skipped)
    prompt: tuple[Scored, ...] | None = None  # with the first token: the prompt's, where asked (echo)
    posted_ns: int = 0  # when the sender posted it to the event loop (the hop out's legs)


@dataclass(slots=True, frozen=True)
class End:
    finish_reason: str  # OpenAI's: "stop" or "length"; "error" and "abort" are the server's
    detail: str
    prompt_tokens: int
    completion_tokens: int
    tail: str  # the last text (held back for a stop string, or flushed by the detokenizer)
    failed: bool = False  # the engine stopped (a failure or a stall) before the request finished


Event = Text | End
_T = TypeVar("_T")


class Inbox(Generic[_T]):
    """What one reader on the event loop waits for: the items in order, and at most one
    reader waiting. A wait that blocks costs one future and one timer handle; asyncio.Queue
    with asyncio.timeout or wait_for cost several times that per token of every stream."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: deque[_T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = loop

    def put(self, item: _T) -> None:
        """On the event loop's thread (the sender posts it there)."""
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> _T | None:
        """The next item if there is one, without waiting."""
        return self._items.popleft() if self._items else None

    async def get(self, timeout_s: float | None = None) -> _T | None:
        """The next item, or None once `timeout_s` has passed without one."""
        if self._items:
            return self._items.popleft()
        if self._waiter is not None:  # a second reader would take the first one's wake-up
            raise RuntimeError("an Inbox has one reader")
        w = self._waiter = self._loop.create_future()
        h = None if timeout_s is None else self._loop.call_later(timeout_s, _expire, w)
        try:
            await w
        finally:
            self._waiter = None
            if h is not None:
                h.cancel()
        return self._items.popleft() if self._items else None


def _put_all(items: list[tuple[Inbox[Event], Event]]) -> None:
    for inbox, ev in items:
        inbox.put(ev)


def _expire(w: asyncio.Future[None]) -> None:
    if not w.done():
        w.set_result(None)


class _Open:
    __slots__ = ("loop", "inbox", "stop", "logprobs", "prompt", "posted", "tokens")

    def __init__(self, loop: asyncio.AbstractEventLoop, stops: list[str]) -> None:
        self.loop = loop
        self.inbox: Inbox[Event] = Inbox(loop)
        self.stop = StopMatcher(stops)
        self.logprobs: list[Scored] = []  # waiting for their token's text
        self.prompt: tuple[Scored, ...] | None = None
        self.posted = False  # a Text posted: the first carries what goes before the answer
        self.tokens = 0  # tokens answered: up to the one a stop string ends in (usage counts those)


class ResponseStreams:
    """The sender's sink for served requests (requests it does not know are ignored)."""

    def __init__(self, abort: Callable[[str, str], None], token_text: Callable[[int], tuple[str, bool]]) -> None:
        self._open: dict[str, _Open] = {}
        self._abort = abort  # engine.request_abort: thread-safe
        self._token_text = token_text  # a token's own text, for logprobs (the tokenizer's)
        self._texts: dict[int, tuple[str, bool]] = {}  # token_text's answers: logprobs name the same tokens again and again
        self._lock = threading.Lock()  # open() against fail_all(): no request opened as the engine fails is missed
        self._failed: str | None = None
        self._round: list[tuple[_Open, Event]] = []  # the sender's events of the round being delivered
        self._firsts: set[_Open] = set()  # the round's streams whose first Text is in it

    def open(self, request_id: str, stops: list[str]) -> Inbox[Event]:
        """Event loop: register a request before it is submitted."""
        o = _Open(asyncio.get_running_loop(), stops)
        with self._lock:
            self._open[request_id] = o
            failed = self._failed
        if failed is not None:
            self._post(o, End("abort", failed, 0, 0, "", failed=True))
        return o.inbox

    def fail_all(self, why: str) -> None:
        """When the engine stops on a failure or a stall (EngineLoop calls it on the sender
        thread once the rounds before the failure are delivered): every request still open (and
        any opened later) ends now, rather than waiting for tokens that will never come."""
        with self._lock:
            self._failed = why
            opened = list(self._open.values())
        for o in opened:
            self._post(o, End("abort", why, 0, 0, "", failed=True))

    def close(self, request_id: str) -> None:
        """Event loop: the response is over (sent, or its client went away). Under the lock, as
        fail_all copies the open requests: a dict that changes size mid-copy raises."""
        with self._lock:
            self._open.pop(request_id, None)

    def open_ids(self) -> list[str]:
        return list(self._open)

    # ---- the sender thread ------------------------------------------------
    def on_logprobs(self, request_id: str, prompt: tuple[list[int], list[TokenLogprob | None]] | None,
                    token: tuple[int, TokenLogprob] | None) -> None:
        o = self._open.get(request_id)
        if o is None or o.stop.done:
            return
        if prompt is not None:
            o.prompt = tuple(scored(self._text_of, t, lp) for t, lp in zip(*prompt, strict=True))
        if token is not None:
            o.logprobs.append(scored(self._text_of, *token))

    def _text_of(self, token_id: int) -> tuple[str, bool]:
        t = self._texts.get(token_id)
        if t is None:
            t = self._texts[token_id] = self._token_text(token_id)
        return t

    def on_text(self, request_id: str, text: str) -> None:
        o = self._open.get(request_id)
        if o is None or o.stop.done:
            return
        o.tokens += 1
        out = o.stop.push(text)
        if out or not o.stop.done or not o.posted:
            # one event per token, its text possibly "" (an incomplete character, or text held
            # for a stop string): the client's first chunk is then the server's first token.
            # A stop string in the first token still posts its (empty) Text: the first carries
            # the prompt's logprobs, and the answer's echo starts with it
            lps, o.logprobs = tuple(o.logprobs), []
            prompt, o.prompt = o.prompt, None
            if not o.posted:
                self._firsts.add(o)
            o.posted = True
            self._round.append((o, Text(out, lps, prompt)))
        if o.stop.done:  # the engine may run a round more: its tokens are dropped here
            self._abort(request_id, STOP_MATCHED)

    def on_finish(self, record: FinishedRecord, text: str) -> None:
        o = self._open.get(record.request_id)
        if o is None:
            return
        done = o.stop.done  # the tokens the engine made after the match were never answered
        reason = "stop" if done else FINISH_REASON.get(record.finish_reason, "abort")
        self._round.append((o, End(reason, record.finish_detail, len(record.input_ids),
                                   o.tokens if done else len(record.output_ids), o.stop.flush())))

    def on_round_end(self) -> None:
        """The round's events, in order, to their inboxes: one call per event loop (a server
        has one), each Text stamped as posted now."""
        if not self._round:
            return
        events, self._round = self._round, []
        if self._firsts:
            # The streams whose first token is in this round go first (each stream's own
            # events keep their order): the event loop resumes them, and writes their chunks,
            # before the round's other streams', so a client's first token does not wait
            # behind a batch of other clients' next ones.
            firsts, self._firsts = self._firsts, set()
            events = [e for e in events if e[0] in firsts] + [e for e in events if e[0] not in firsts]
        now = now_ns()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Inbox[Event], Event]]] = {}
        for o, ev in events:
            if isinstance(ev, Text):
                ev = Text(ev.text, ev.logprobs, ev.prompt, now)
            by_loop.setdefault(o.loop, []).append((o.inbox, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is closed: the server is gone
                pass

    @staticmethod
    def _post(o: _Open, ev: Event) -> None:
        try:
            o.loop.call_soon_threadsafe(o.inbox.put, ev)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass
