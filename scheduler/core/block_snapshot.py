"""Full block-table snapshots into the memory table (`--snapshot-every N` rounds)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from probes.clock import now_ns
from scheduler.core.memory_manager import MemoryManager
from scheduler.core.request import Request


def append_snapshot(buf: list[Any], step: int, mm: MemoryManager, running: Iterable[Request]) -> None:
    """One row per (block, holder), after a marker row, so an empty pool still shows up
    as a snapshot; the marker's ref_count carries the free count."""
    ts = now_ns()
    blocks = mm.blocks
    buf.append((ts, step, "snapshot_begin", -1, "", mm.num_free))
    for req in running:
        rid = req.request_id
        for bid in req.block_table:
            buf.append((ts, step, "snapshot", bid, rid, blocks[bid].ref_count))
