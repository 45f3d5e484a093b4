"""The KV fence: a finished request's blocks go back to the pool only when no launch
that might still read them is in flight.

Work on one stream runs in order, so a block freed now and reused by a later launch
on the same stream is safe without waiting. Across streams (split streams) it is
not: the blocks are detached from their request and held here until every in-flight
launch that might read them has completed. The request's finished record waits with
them, so a committed requests row never precedes its frees in the trace
(tracing/schema.py DRAIN_ORDER).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from probes.boundaries import KV_FENCE
from probes.clock import now_ns
from probes.recorder import ProbeRow
from scheduler.core.memory_manager import MemoryManager
from scheduler.core.request import Request


class Completion(Protocol):
    def query(self) -> bool: ...


class KvFence:
    def __init__(self, mm: MemoryManager, split: bool, probe_buf: list[ProbeRow] | None, rank: int) -> None:
        self.mm, self.split = mm, split
        self._buf, self._rank = probe_buf, rank
        self._held: list[tuple[list[Completion], str, list[int], str]] = []
        self.blocks = 0  # blocks behind the fence (the policy counts them as soon to be free)
        self._records: dict[str, Any] = {}  # finished records waiting for their blocks
        self._freed: list[str] = []

    def __bool__(self) -> bool:
        return bool(self._held)

    def release(self, req: Request, in_flight: Sequence[Completion], kind: str = "free") -> None:
        """Give `req`'s blocks back now, or once `in_flight` and its own last launch complete."""
        if not req.block_table:
            return
        fence = list(in_flight)
        if req.last_event is not None:
            fence.append(req.last_event)
        if self.split and any(not ev.query() for ev in fence):
            self.mm.detach(req.request_id, req.block_table)
            self._held.append((fence, req.request_id, req.block_table, kind))
            self.blocks += len(req.block_table)
        else:
            self.mm.free(req.request_id, req.block_table, kind)
        req.block_table = []

    def free_completed(self, step: int) -> None:
        """Free the held blocks whose launches have all completed (a kv_fence row each)."""
        if not self._held:
            return
        keep = []
        for fence, rid, table, kind in self._held:
            t0 = now_ns()
            if all(ev.query() for ev in fence):
                self.mm.free(rid, table, kind)
                self.blocks -= len(table)
                self._freed.append(rid)
                if self._buf is not None:
                    self._buf.append((t0, now_ns() - t0, KV_FENCE, "host", self._rank, step))
            else:
                keep.append((fence, rid, table, kind))
        self._held = keep

    def hand_over(self, finished: Sequence[Request], record: Callable[[Request], Any]) -> list[Any]:
        """The finished records that may leave for the sender now: those of `finished` whose
        blocks are free, and those held earlier whose blocks have since been freed."""
        held = {rid for _, rid, _, _ in self._held}
        out = []
        for req in finished:
            rec = record(req)
            if req.request_id in held:
                self._records[req.request_id] = rec
            else:
                out.append(rec)
        for rid in self._freed:
            if rid not in held and rid in self._records:
                out.append(self._records.pop(rid))
        self._freed.clear()
        return out
