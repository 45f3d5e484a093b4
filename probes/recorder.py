"""The hot-path recorder.

A probe row is a plain tuple appended to a list the producer owns: no lock,
no allocation beyond the tuple, no synchronisation with the device. Each
producer (the scheduling thread, each stream worker, the sender, the tokenizer
pool) asks once for its own buffer; the trace writer's background thread
drains every buffer into Parquet. Measured cost: see BENCHMARKS.md
(bench/bench_probe_cost.py).

Row layout (the probes table's column order): ts_ns, dur_ns, boundary, stream, rank, step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Row = tuple[Any, ...]
BufferFactory = Callable[[str], list[Row]]


class Probes:
    """Hands out per-producer buffers; `enabled=False` hands out None so
    emission sites skip with one comparison (--no-probes)."""

    __slots__ = ("rank", "_factory")

    def __init__(self, factory: BufferFactory | None, rank: int = 0) -> None:
        self.rank = rank
        self._factory = factory

    @property
    def enabled(self) -> bool:
        return self._factory is not None

    def buffer(self, table: str = "probes") -> list[Row] | None:
        return None if self._factory is None else self._factory(table)

