"""The writer merges its own fresh parts from memory (tracing/writer.py PartCache): the
trace must read back exactly as when every merge reads its parts from disk."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from tracing import writer
from tracing.compaction import Targets
from tracing.reader import read_table
from tracing.writer import PartCache, TraceWriter


def _write(root: Path, cache_bytes: int | None, clock_offset_ns: int = 0) -> list[tuple[object, ...]]:
    w = TraceWriter(root, flush_interval_s=3600, targets=Targets(fan_in=2, max_rows=400, max_bytes=1 << 20),
                    clock_offset_ns=clock_offset_ns)
    if cache_bytes is not None:
        assert w._store.cache is not None
        w._store.cache = PartCache(cache_bytes)
    buf, expect = w.buffer("probes"), []
    for i in range(9):  # nine flushes: merges at two levels, a seal, the final packing
        rows = [(1 + i * 100 + j, j, "bookkeeping" if j % 2 else "batch_prepare", "host", 0, i) for j in range(60)]
        buf.extend(rows)
        expect += [(r[0] - clock_offset_ns, *r[1:]) for r in rows]
        w.flush()
        with w._flush_lock:
            w._store.compact(final=False)
    w.close({"run": {"status": "complete"}})
    return expect


def _rows(root: Path) -> list[tuple[object, ...]]:
    return [tuple(r.values()) for r in read_table(root, "probes").to_pylist()]


def test_merging_from_the_cache_reads_back_like_merging_from_disk(tmp_path: Path, monkeypatch) -> None:
    reads: list[str] = []
    real = writer.pq.read_table
    monkeypatch.setattr(writer.pq, "read_table", lambda path, **kw: reads.append(str(path)) or real(path, **kw))
    expect = _write(tmp_path / "cached", None)
    assert reads == []  # every merge found its parts in memory
    _write(tmp_path / "disk", 1)  # a cache that holds nothing: every merge reads its parts
    assert reads
    assert _rows(tmp_path / "cached") == _rows(tmp_path / "disk") == expect


def test_a_rank_with_a_clock_offset_still_shifts_its_timestamps(tmp_path: Path) -> None:
    expect = _write(tmp_path / "t", None, clock_offset_ns=7)
    assert _rows(tmp_path / "t") == expect


def test_the_cache_drops_its_oldest_parts_beyond_its_budget() -> None:
    t = pa.table({"x": pa.array(range(100), pa.int64())})  # 800 bytes
    c = PartCache(max_bytes=2 * t.nbytes)
    for f in ("a", "b", "c"):
        c.put("probes", f, t)
    assert c.take("probes", "a") is None and c.take("probes", "b") is t and c.take("probes", "c") is t
    c.put("probes", "big", pa.concat_tables([t, t, t]))  # larger than the budget: not kept
    assert c.take("probes", "big") is None
