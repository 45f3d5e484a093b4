"""The Request Manager: waiting, running and finished queues, with every
transition timestamped on the probes clock so a run can be replayed."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from probes.clock import now_ns
from scheduler.core.request import FinishReason, ReqSample, Request, RequestStatus

# (ts_ns, request_id, stage, step, value): the trace's timeline table.
TimelineSink = Callable[[int, str, str, int, int], None]


class RequestManager:
    def __init__(self, on_timeline: TimelineSink | None = None) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self._newly_finished: list[Request] = []
        self._on_timeline = on_timeline
        self.step = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def mark(self, req: Request, stage: str, value: int = 0, ts: int | None = None) -> int:
        t = now_ns() if ts is None else ts
        if self._on_timeline is not None:
            self._on_timeline(t, req.request_id, stage, self.step, value)
        return t

    def enqueue(self, sample: ReqSample) -> Request:
        req = Request(sample)
        self.mark(req, "arrived", ts=sample.arrival_ns)
        self.mark(req, "tokenized", sample.valid_len, ts=sample.tokenized_ns)
        req.queued_ns = req.wait_since_ns = self.mark(req, "queued")
        self.waiting.append(req)
        return req

    def admit(self, req: Request) -> None:
        """waiting -> running; the caller has just given it its KV blocks."""
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        t = self.mark(req, "got_blocks", len(req.block_table))
        # The request-level timestamp keeps the first admission; the timeline keeps every one.
        req.admitted_ns = req.admitted_ns or t
        req.progress_ns = t
        self.running.append(req)

    def preempt(self, req: Request, why: str = "", behind: Request | None = None) -> None:
        """running -> front of waiting (or just behind `behind`, the request it made room
        for). Its blocks are already released; it recomputes later."""
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        req.preempt_reasons.append(why)
        req.wait_since_ns = self.mark(req, "preempted", req.num_computed)
        req.num_computed = 0
        req.num_cached_prefix = 0
        req.num_hashed_blocks = 0
        req.last_block_hash = -1
        req.block_table = []
        if behind is not None and behind in self.waiting:
            # Behind the request it was evicted for: otherwise it is re-admitted first into
            # the blocks just freed, evicted again, and neither makes progress.
            self.waiting.insert(self.waiting.index(behind) + 1, req)
        else:
            self.waiting.appendleft(req)

    def finish(self, req: Request, reason: FinishReason, detail: str = "") -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_detail = detail
        req.finish_ns = self.mark(req, "rejected" if reason is FinishReason.REJECTED else
                                  "aborted" if reason is FinishReason.ABORTED else "finished",
                                  len(req.output_ids))
        self.finished.append(req)
        self._newly_finished.append(req)

    def has_undrained(self) -> bool:
        """Requests finished that the output path has not taken yet."""
        return bool(self._newly_finished)

    def drain_finished(self) -> list[Request]:
        """Requests finished since the last call, for the output path."""
        out, self._newly_finished = self._newly_finished, []
        return out
