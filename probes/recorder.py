"""The hot-path recorder.

A probe row is a plain tuple appended to a list the producer owns: no lock,
no allocation beyond the tuple, no synchronisation with the device. Each
producer (the scheduling thread, each stream worker, the sender, the tokenizer
pool) asks once for its own buffer; the trace writer's background thread
drains every buffer into Parquet. Measured cost: see BENCHMARKS.md
(bench/bench_probe_cost.py).

A probe row's layout is `ProbeRow`, the probes table's columns in order (`PROBE_COLUMNS`;
tests/test_store.py checks them against tracing/schema.py). It stays a plain tuple, not a
NamedTuple: making one is a Python-level call on every probe; the type lets mypy check each
place that builds one for arity and order of types.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

Row = tuple[Any, ...]  # a row of any table, in its schema's column order
ProbeRow = tuple[int, int, str, str, int, int]
PROBE_COLUMNS = ("ts_ns", "dur_ns", "boundary", "stream", "rank", "step")
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

    def buffer(self) -> list[ProbeRow] | None:
        """A buffer of probe rows for one producer thread."""
        return None if self._factory is None else cast("list[ProbeRow]", self._factory("probes"))

    def table_buffer(self, table: str) -> list[Row] | None:
        """A buffer for another table's rows (memory, collectives), on the same switch."""
        return None if self._factory is None else self._factory(table)

