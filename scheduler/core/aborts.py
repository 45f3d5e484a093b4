"""Aborts asked for from other threads (an HTTP client that went away, a stop string
the sender matched), carried out by the scheduling thread at the top of a round.

The scheduling thread owns the queues and the block tables, so another thread only
posts a request id; the round then finishes that request as aborted and its blocks
go back behind the KV fence like any finish. A request still in the tokenizer pool
is aborted as it arrives.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable

from scheduler.core.request import Request


class AbortInbox:
    def __init__(self) -> None:
        self._posted: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._pending: dict[str, str] = {}  # scheduling thread only: id -> why, not found yet

    def post(self, request_id: str, detail: str) -> None:
        """Any thread: abort this request at the next round."""
        self._posted.put((request_id, detail))

    def take(self, live: Iterable[Request], in_pool: bool) -> list[tuple[Request, str]]:
        """Scheduling thread: the live requests to abort now, with why. An id not live
        yet waits for its arrival while requests are still in the tokenizer pool
        (`in_pool`); otherwise it finished already and is dropped."""
        if not self._pending and self._posted.empty():  # every round: no exception raised for nothing
            return []
        while True:
            try:
                rid, detail = self._posted.get_nowait()
            except queue.Empty:
                break
            self._pending.setdefault(rid, detail)
        if not self._pending:
            return []
        found = [(r, self._pending.pop(r.request_id)) for r in live if r.request_id in self._pending]
        if not in_pool:
            self._pending.clear()
        return found

    def arrived(self, request_id: str) -> str | None:
        """Scheduling thread, as a request leaves the tokenizer pool: why to abort it, or None."""
        return self._pending.pop(request_id, None) if self._pending else None
