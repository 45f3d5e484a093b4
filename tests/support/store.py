"""A trace store written by hand: compaction targets small enough that a few flushes merge,
and probe rows numbered by step."""

from __future__ import annotations

from probes import boundaries as B
from tracing.compaction import Targets

SMALL = Targets(fan_in=3, max_rows=40, max_bytes=1 << 30)


def probe_row(i: int) -> tuple[int, int, str, str, int, int]:
    return (1000 + i, 1, B.BOOKKEEPING, "host", 0, i)
