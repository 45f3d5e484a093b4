"""The GC scan: the remedy for blocks leaked on exception paths.

Periodically reconcile the Memory Manager's holders against live requests:
  * a holder that is no longer a running request (it died on a path that
    skipped its free) is an orphan; after `gc_after_s` its blocks are reclaimed;
  * a running request with no progress (no admission, prefill chunk or token) for
    `gc_after_s` is aborted and its blocks are reclaimed.
Every reclaim is a `reclaim` row in the memory table and a `reclaimed`
timeline event, so `mstrace leaks` can tell reclaimed blocks from leaked ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.core.memory_manager import MemoryManager
from scheduler.core.request import Request
from scheduler.core.request_manager import RequestManager


@dataclass(slots=True)
class Reclaimed:
    request_id: str
    blocks: list[int]
    reason: str


@dataclass(slots=True)
class Reclaimer:
    gc_after_s: float
    interval_s: float = 0.25
    _orphan_since: dict[str, int] = field(default_factory=dict)
    _last_scan_ns: int = 0

    def due(self, now: int) -> bool:
        return now - self._last_scan_ns >= self.interval_s * 1e9

    def scan(
        self, rm: RequestManager, mm: MemoryManager, now: int, force: bool = False
    ) -> tuple[list[Reclaimed], list[tuple[Request, str]]]:
        """Reclaim orphans older than gc_after_s (`force`: any age) and list stuck running
        requests, which the engine aborts through its normal release path."""
        self._last_scan_ns = now
        limit = 0 if force else int(self.gc_after_s * 1e9)
        live = {r.request_id: r for r in rm.running}
        out: list[Reclaimed] = []
        for rid in [rid for rid in mm.tables if rid not in live]:
            since = self._orphan_since.setdefault(rid, now)
            if now - since >= limit:
                table = mm.tables[rid]
                out.append(Reclaimed(rid, list(table), "holder is not a running request"))
                mm.free(rid, table, kind="reclaim")
                self._orphan_since.pop(rid, None)
        for rid in list(self._orphan_since):
            if rid not in mm.tables:
                del self._orphan_since[rid]
        stuck = []
        if not force:
            for req in rm.running:
                idle = now - _last_progress(req)
                if idle >= limit and req.block_table:
                    stuck.append((req, f"no progress for {idle / 1e9:.1f} s"))
        return out, stuck


def _last_progress(req: Request) -> int:
    return max(req.token_ns[-1] if req.token_ns else 0, req.progress_ns)
