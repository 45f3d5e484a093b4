"""The exit hop: new tokens leave the scheduling thread through an output queue
that a separate sender thread drains. The sender detokenizes incrementally and
hands text to a sink (the run command's trace writer and progress bar, or later
an HTTP response). A slow client therefore slows only this thread, never a
scheduling round."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from probes.boundaries import RESPONSE_DELIVER
from probes.clock import now_ns
from probes.recorder import Probes
from scheduler.core.request import Request, TokenLogprob
from scheduler.hops.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class FinishedRecord:
    """An immutable copy of a finished request, safe to read off the scheduling thread."""

    request_id: str
    input_ids: list[int]
    output_ids: list[int]
    cached_prefix_len: int
    finish_reason: str
    finish_detail: str
    arrival_ns: int
    tokenized_ns: int
    queued_ns: int
    admitted_ns: int
    first_scheduled_ns: int
    first_token_ns: int
    finish_ns: int
    num_preemptions: int
    num_prefill_chunks: int
    token_ns: list[int]
    token_runs: list[int] = field(default_factory=list)
    preempt_reasons: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, r: Request) -> FinishedRecord:
        s = r.sample
        return cls(
            r.request_id, s.input_ids, list(r.output_ids), r.num_cached_prefix,
            r.finish_reason.value if r.finish_reason else "", r.finish_detail,
            s.arrival_ns, s.tokenized_ns, r.queued_ns, r.admitted_ns, r.first_scheduled_ns,
            r.first_token_ns, r.finish_ns, r.num_preemptions, r.num_prefill_chunks,
            list(r.token_ns), list(r.token_runs), list(r.preempt_reasons),
        )


@dataclass(slots=True)
class StepOutput:
    step: int
    tokens: list[tuple[str, int]] = field(default_factory=list)  # (request_id, token id)
    # the prompt of each request whose first token is in `tokens` (shared, never mutated)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)  # by index into `tokens`, where asked
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)  # with the first token
    hidden: set[int] = field(default_factory=set)  # indices into `tokens` whose text is left out (stop tokens)
    finished: list[FinishedRecord] = field(default_factory=list)


class OutputSink(Protocol):
    # Called once for every token with the text it completes: "" while a character spans
    # tokens; a request's last token also carries what the detokenizer held back. (A request
    # that ends without a token in its last round gets that held-back text in one more call.)
    def on_text(self, request_id: str, text: str) -> None: ...

    def on_finish(self, record: FinishedRecord, text: str) -> None: ...

    # Optional, not in the protocol: a sink with `on_round_end()` is called once the round's
    # on_text and on_finish calls are all made (ResponseStreams posts them to the event loop then).


class LogprobSink(OutputSink, Protocol):
    # A sink that also takes log-probabilities, for the requests that asked: called just
    # before the on_text of the token they belong to. `prompt`: with a request's first token,
    # its prompt's (position p scores prompt token p; [0] is None); `token`: this token's.
    def on_logprobs(self, request_id: str, prompt: tuple[list[int], list[TokenLogprob | None]] | None,
                    token: tuple[int, TokenLogprob] | None) -> None: ...


class Sender:
    def __init__(
        self, tokenizer: Tokenizer | None, sinks: list[OutputSink], probes: Probes | None = None,
        before_deliver: Callable[[], None] = lambda: None,
    ) -> None:
        # a round's output, a call to make once the rounds before it are delivered, or None: stop
        self.queue: queue.SimpleQueue[StepOutput | Callable[[], None] | None] = queue.SimpleQueue()
        self._buf = probes.buffer() if probes is not None else None
        self._rank = probes.rank if probes is not None else 0
        self._before_deliver = before_deliver  # a fault's hook (the slow sender)
        self._tok = tokenizer
        self._sinks = sinks
        self._lp_sinks: list[LogprobSink] = [s for s in sinks if hasattr(s, "on_logprobs")]  # type: ignore[misc]
        # a sink that batches a round's events (the HTTP responses: one wake-up of the event
        # loop a round, not one a token) is told when the round's are all in
        self._round_ends: list[Callable[[], None]] = [s.on_round_end for s in sinks if hasattr(s, "on_round_end")]
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._text: dict[str, list[str]] = {}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="sender", daemon=True)
        self._thread.start()

    def call_after(self, fn: Callable[[], None]) -> None:
        """Any thread: `fn` on the sender thread once it has delivered every round queued before
        it (never, once the sender is closed). An exception it raises is reported on close()."""
        self.queue.put(fn)

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"output sink failed: {self.error}") from self.error

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if not isinstance(item, StepOutput):
                try:
                    item()
                except BaseException as e:  # noqa: BLE001 - as a round's: reported on close()
                    self.error = self.error or e
                continue
            t0 = now_ns()
            try:
                self._before_deliver()
                self._deliver(item)
            except BaseException as e:  # noqa: BLE001 - reported on close(); keep draining
                self.error = self.error or e
            for end in self._round_ends:  # (even after a failed sink: the others' events go out)
                try:
                    end()
                except Exception as e:  # noqa: BLE001 - as _deliver's sinks
                    self.error = self.error or e
            if self._buf is not None:
                self._buf.append((t0, now_ns() - t0, RESPONSE_DELIVER, "sender", self._rank, item.step))

    def _deliver(self, out: StepOutput) -> None:
        hidden = out.hidden
        texts = [(rid, self._push(rid, tok, out.prompts, bool(hidden) and i in hidden))
                 for i, (rid, tok) in enumerate(out.tokens)]
        last = {rid: i for i, (rid, _) in enumerate(texts)}
        tails: list[tuple[str, str]] = []  # text held back, of requests with no token this round
        for rec in out.finished:
            d = self._detok.get(rec.request_id)
            tail = d.flush() if d is not None else ""
            if tail:
                self._text[rec.request_id].append(tail)
                i = last.get(rec.request_id)
                if i is None:
                    tails.append((rec.request_id, tail))
                else:  # the last token carries it: still one on_text per token
                    texts[i] = (rec.request_id, texts[i][1] + tail)
        asked = bool(self._lp_sinks) and bool(out.logprobs or out.prompt_logprobs)
        # A sink that raises is reported on close(); its call is the only one skipped: the
        # other sinks, and the round's other requests, still get theirs (a stream left without
        # its End would hang until its client gave up).
        for i, (rid, text) in enumerate(texts):
            if asked and (i in out.logprobs or rid in out.prompt_logprobs):
                self._logprobs(out, i)
            for s in self._sinks:  # every token, even one whose text is not complete yet
                try:
                    s.on_text(rid, text)
                except Exception as e:  # noqa: BLE001 - see above
                    self.error = self.error or e
        for rid, text in tails:
            for s in self._sinks:
                try:
                    s.on_text(rid, text)
                except Exception as e:  # noqa: BLE001 - see above
                    self.error = self.error or e
        for rec in out.finished:
            self._detok.pop(rec.request_id, None)
            parts = self._text.pop(rec.request_id, [])
            for s in self._sinks:
                try:
                    s.on_finish(rec, "".join(parts))
                except Exception as e:  # noqa: BLE001 - see above
                    self.error = self.error or e

    def _logprobs(self, out: StepOutput, i: int) -> None:
        rid, tok = out.tokens[i]
        entries = out.prompt_logprobs.pop(rid, None)  # with the request's first token only
        prompt = (out.prompts[rid], entries) if entries is not None else None
        lp = out.logprobs.get(i)
        for s in self._lp_sinks:
            try:
                s.on_logprobs(rid, prompt, (tok, lp) if lp is not None else None)
            except Exception as e:  # noqa: BLE001 - as _deliver's sinks
                self.error = self.error or e

    def _push(self, rid: str, tok: int, prompts: dict[str, list[int]], hidden: bool) -> str:
        if self._tok is None or hidden:
            return ""
        d = self._detok.get(rid)
        if d is None:
            d = self._detok[rid] = self._tok.detokenizer(prompts.get(rid, []))
            self._text[rid] = []
        text = d.push([tok])
        if text:
            self._text[rid].append(text)
        return text
