"""The entry hop: tokenization runs on a thread pool, never on the scheduling
thread, and fills the pre-processing queue the scheduler drains."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

from probes.boundaries import TOKENIZE
from probes.clock import now_ns
from probes.recorder import Probes
from scheduler.core.request import ReqSample, SamplingParams
from scheduler.hops.tokenizer import Tokenizer


class NoTokenizer(ValueError):
    """A text prompt for a model folder without a tokenizer: the caller's to fix (a server
    answers it 400)."""


class TokenizerPool:
    def __init__(self, tokenizer: Tokenizer | None, num_threads: int, probes: Probes) -> None:
        self.tokenizer = tokenizer
        # One buffer for all pool threads: list.append is atomic under the GIL.
        self._buf = probes.buffer()
        self._rank = probes.rank
        self.ready: queue.SimpleQueue[ReqSample] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tokenizer")

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_ns: int,
               add_special_tokens: bool = True) -> None:
        """A text prompt goes to a pool thread; token ids (a list the caller does not keep)
        go straight to the queue: they need no tokenizer, and a pool thread's turn is a
        thread hop that took milliseconds under a burst (the thread waits for the GIL
        behind the scheduling thread's round)."""
        if not isinstance(prompt, str):
            self._ready(request_id, prompt, "", params, arrival_ns)
            return
        if self.tokenizer is None:
            raise NoTokenizer("this model folder has no tokenizer; give input_ids instead of a prompt")
        self._pool.submit(self._tokenize, request_id, prompt, params, arrival_ns, add_special_tokens)

    def _tokenize(self, request_id: str, prompt: str, params: SamplingParams, arrival_ns: int,
                  add_special_tokens: bool) -> None:
        try:
            assert self.tokenizer is not None
            ids, error = self.tokenizer.encode(prompt, add_special_tokens), ""
        except Exception as e:  # noqa: BLE001 - the request is rejected, the pool lives on
            ids, error = [], f"tokenization failed: {type(e).__name__}: {e}"
        self._ready(request_id, ids, error, params, arrival_ns)

    def _ready(self, request_id: str, ids: list[int], error: str, params: SamplingParams, arrival_ns: int) -> None:
        t1 = now_ns()
        if self._buf is not None:
            # The row spans the request's whole stay in the pool (queueing + encoding; token
            # ids: the hand-over alone).
            self._buf.append((arrival_ns, t1 - arrival_ns, TOKENIZE, "tokenizer", self._rank, -1))
        self.ready.put(ReqSample(request_id, ids, len(ids), params, arrival_ns, t1, error))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
