"""The one clock every table uses: CLOCK_MONOTONIC in nanoseconds.

time.monotonic_ns() is CLOCK_MONOTONIC on Linux; perf_counter_ns() is too, but
only monotonic_ns is documented to be comparable across processes, which the
per-rank offset handshake relies on.
"""

from __future__ import annotations

import time

now_ns = time.monotonic_ns


def clock_record(anchor: tuple[int, int], name: str = "CLOCK_MONOTONIC") -> dict[str, int | str]:
    """meta.json's `clock`: the trace's clock and one (its time, unix time) pair taken together,
    which every reader maps trace time to wall time with (stalls, export --otlp)."""
    return {"name": name, "anchor_monotonic_ns": anchor[0], "anchor_unix_ns": anchor[1]}


def wall_anchor() -> tuple[int, int]:
    """A (monotonic_ns, unix_ns) pair taken back to back, to map trace time to wall time."""
    return time.monotonic_ns(), time.time_ns()
