"""Defragmentation's plan (--kv-layout contiguous): every live run moves to the low
end of the pool, in pool order, so the free blocks become one run. The engine pauses
scheduling, waits for the streams, and has the device copy the KV (scheduler/engine.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from scheduler.core.memory_manager import MemoryManager
from scheduler.core.request import Request


def plan_moves(running: Iterable[Request], mm: MemoryManager,
               mark: Callable[[Request, str, int], object]) -> list[tuple[int, int]]:
    """Move the block tables in the memory manager; returns the (src, dst) block copies
    the device must make. `mark` records a `defrag_moved` stage on each moved request."""
    holders = sorted((r for r in running if r.block_table), key=lambda r: r.block_table[0])
    moves: list[tuple[int, int]] = []
    at = 0
    for req in holders:
        m = mm.move(req.request_id, req.block_table, at)
        at += len(req.block_table)
        if m:
            moves += m
            mark(req, "defrag_moved", len(m))
    return moves
