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
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer; give input_ids instead of a prompt")
        self._pool.submit(self._tokenize, request_id, prompt, params, arrival_ns, add_special_tokens)

    def _tokenize(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_ns: int,
                  add_special_tokens: bool) -> None:
        try:
            if isinstance(prompt, str):
                assert self.tokenizer is not None
                ids = self.tokenizer.encode(prompt, add_special_tokens)
            else:
                ids = list(prompt)
            error = ""
        except Exception as e:  # noqa: BLE001 - the request is rejected, the pool lives on
            ids, error = [], f"tokenization failed: {type(e).__name__}: {e}"
        t1 = now_ns()
        if self._buf is not None:
            # The row spans the request's whole stay in the pool (queueing + encoding).
            self._buf.append((arrival_ns, t1 - arrival_ns, TOKENIZE, "tokenizer", self._rank, -1))
        self.ready.put(ReqSample(request_id, ids, len(ids), params, arrival_ns, t1, error))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
