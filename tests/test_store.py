"""The trace store: manifest commits, compaction, legacy traces, run status, references."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pytest

from tests.support.store import SMALL, probe_row
from tracing.compact_trace import compact_trace
from tracing.compaction import Targets, plan_tiered
from tracing.consistency import read_consistent
from tracing.manifest import SEALED, PartEntry, read_manifests
from tracing.reader import Trace, TraceError, read_table
from tracing.writer import TraceWriter


def write_flushes(root: Path, flushes: int, rows: int, targets: Targets = SMALL, close: bool = True,
                  run: bool = True) -> TraceWriter:
    """A trace of `flushes` commits of `rows` probe rows each (the writer's thread never flushes)."""
    w = TraceWriter(root, flush_interval_s=3600, targets=targets)
    w.write_meta({"model": {"kv_blocks": 4}})
    buf = w.buffer("probes")
    for f in range(flushes):
        buf.extend(probe_row(f * rows + i) for i in range(rows))
        w.flush()
        w._store.compact(final=False)  # what the writer's thread does after each flush
    if close:
        w.close()
        if run:
            w.write_meta({"model": {"kv_blocks": 4}, "run": {"status": "complete"}})
    return w


def steps_of(root: Path) -> list[int]:
    return read_table(root, "probes", ["step"])["step"].to_pylist()


def test_the_engines_steps_row_is_the_schemas_columns_in_order() -> None:
    from scheduler.round_record import StepsRow
    from tracing.schema import STEPS

    assert StepsRow._fields == tuple(STEPS.names)


def test_the_requests_and_probes_rows_are_the_schemas_columns_in_order() -> None:
    from probes.recorder import PROBE_COLUMNS, ProbeRow
    from scheduler.harness.runner import RequestsRow
    from tracing.schema import PROBES, REQUESTS

    assert RequestsRow._fields == tuple(REQUESTS.names)
    assert PROBE_COLUMNS == tuple(PROBES.names)
    assert len(ProbeRow.__args__) == len(PROBE_COLUMNS)  # type: ignore[attr-defined]


def test_tiered_plan_merges_fan_in_parts_of_one_level_and_seals_full_ones() -> None:
    e = [PartEntry(f"part-{i:06d}.parquet", 5, 10, 0) for i in range(7)]
    plan = list(plan_tiered(e, SMALL))
    assert [(m.start, m.stop, m.level) for m in plan] == [(0, 3, 1), (3, 6, 1)]
    big = [PartEntry("part-000000.parquet", 30, 10, 1), PartEntry("part-000001.parquet", 30, 10, 1)]
    assert list(plan_tiered(big, SMALL)) == [0]  # two 30-row parts exceed 40: seal the first in place


def test_compaction_keeps_every_row_in_order_and_bounds_the_part_count(tmp_path: Path) -> None:
    write_flushes(tmp_path, flushes=60, rows=4, close=False)
    live = [e for es in read_manifests(tmp_path)[0].tables.values() for e in es]
    # 60 flushes of 4 rows: without compaction 60 parts
    assert len(live) <= 12, [(e.rows, e.level) for e in live]
    assert steps_of(tmp_path) == list(range(240))
    on_disk = {p.name for p in (tmp_path / "probes").iterdir()}
    assert on_disk == {e.file for e in live}  # merged-away parts are removed


def test_close_compacts_what_is_left_and_row_groups_follow_the_target(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    write_flushes(tmp_path, flushes=25, rows=7)
    entries = read_manifests(tmp_path)[0].tables["probes"]
    assert sum(e.rows for e in entries) == 175
    assert all(e.rows <= SMALL.max_rows for e in entries)
    assert sum(e.level == SEALED for e in entries) >= len(entries) - 1
    for e in entries:
        md = pq.read_metadata(tmp_path / "probes" / e.file)
        assert all(md.row_group(i).num_rows <= SMALL.max_rows for i in range(md.num_row_groups))
    assert steps_of(tmp_path) == list(range(175))


def test_a_part_no_manifest_names_is_ignored(tmp_path: Path) -> None:
    write_flushes(tmp_path, flushes=2, rows=3)
    src = next((tmp_path / "probes").iterdir())
    shutil.copy(src, tmp_path / "probes" / "part-000999.parquet")  # written, never committed
    assert steps_of(tmp_path) == list(range(6))
    res = compact_trace(tmp_path)
    assert res.removed == 1 and not (tmp_path / "probes" / "part-000999.parquet").exists()
    assert steps_of(tmp_path) == list(range(6))


class Crash(Exception):
    pass


@pytest.mark.parametrize("op", ["replace", "unlink"])
def test_a_crash_at_any_file_operation_of_compaction_loses_and_duplicates_nothing(tmp_path: Path, op: str,
                                                                                  monkeypatch) -> None:
    """Interrupt `mstrace compact` at its k-th rename (a part or a manifest commit) or
    k-th removal, for every k: the trace reads the same rows, then compacts cleanly."""
    base = tmp_path / "base"
    write_flushes(base, flushes=20, rows=3, targets=Targets(fan_in=100, max_rows=1 << 20), close=False)
    want = steps_of(base)
    real = getattr(os, op) if op == "replace" else Path.unlink
    k = 0
    while True:
        t = tmp_path / f"k{k}"
        shutil.copytree(base, t)
        calls = 0

        def crashing(*a, k=k, **kw):
            nonlocal calls
            calls += 1
            if calls > k:
                raise Crash
            return real(*a, **kw)

        monkeypatch.setattr(os, "replace", crashing) if op == "replace" else \
            monkeypatch.setattr(Path, "unlink", crashing)
        try:
            compact_trace(t, Targets(fan_in=4, max_rows=16))
            finished = True
        except Crash:
            finished = False
        monkeypatch.undo()
        assert steps_of(t) == want, f"crash after {k} {op} calls"
        compact_trace(t, Targets(fan_in=4, max_rows=16))
        assert steps_of(t) == want
        if finished:
            break
        k += 1
    assert k >= 3  # the crash points really were inside the compaction


def test_legacy_trace_reads_every_part_and_compact_adopts_it(tmp_path: Path) -> None:
    from tracing.schema import PROBES
    from tracing.writer import write_parquet_atomic

    (tmp_path / "probes").mkdir()
    for i in range(5):
        t = pa.Table.from_pylist([dict(zip(PROBES.names, probe_row(3 * i + j), strict=True)) for j in range(3)],
                                 schema=PROBES)
        write_parquet_atomic(t, tmp_path / "probes" / f"part-{i:06d}.parquet")
    (tmp_path / "meta.json").write_text(json.dumps({"schema_version": 1, "run": {"steps": 1}}))
    tr = Trace.open(tmp_path)
    assert tr.legacy and tr.status.complete
    assert steps_of(tmp_path) == list(range(15))
    res = compact_trace(tmp_path)
    assert res.parts_before == 5 and res.parts_after == 1
    assert not Trace.open(tmp_path).legacy and steps_of(tmp_path) == list(range(15))


def test_a_trace_without_an_end_record_is_truncated_and_live_while_its_writer_runs(tmp_path: Path) -> None:
    w = write_flushes(tmp_path, flushes=2, rows=2, close=False)
    st = Trace.open(tmp_path).status
    assert st.state == "truncated" and st.live and "still being written" in (st.headline() or "")
    with pytest.raises(TraceError, match="still being written"):
        compact_trace(tmp_path)
    w.close()
    st = Trace.open(tmp_path).status
    assert st.state == "truncated" and not st.live and "killed" in (st.headline() or "")


def _trace_with_requests(root: Path, runs: list[int], steps: list[int], status: str | None) -> None:
    w = TraceWriter(root, flush_interval_s=3600)
    meta: dict = {"model": {"kv_blocks": 4}}
    w.write_meta(meta)
    sb = w.buffer("steps")
    for s in steps:
        sb.append((s, "serial", 1000 * s, 10, 5, 5, 0, 0, 1, 1, 1, 3, 0, 1, 0, 1000 * s + 9, 0))
    w.buffer("requests").append(("r0", [1], [2, 3], "", 1, 2, 0, "length", "", 1, 1, 1, 1, 1, 1, 9, 0, 1,
                                 [5], runs, 10, []))
    w.buffer("probes").extend(probe_row(s) for s in range(max(steps) + 3))
    w.close()
    if status is not None:
        w.write_meta({**meta, "run": {"status": status, "detail": "engine stalled: x"}})


def test_broken_references_fail_a_complete_trace_and_are_clipped_in_an_unfinished_one(tmp_path: Path) -> None:
    want = {"requests": ["request_id", "token_runs"], "probes": ["step"]}
    _trace_with_requests(tmp_path / "ok", [1, 2], [1, 2], "complete")
    t = read_consistent(Trace.open(tmp_path / "ok"), want)
    assert t["requests"].num_rows == 1 and t["probes"].num_rows == 5

    _trace_with_requests(tmp_path / "bad", [1, 3], [1, 2], "complete")  # tokens from rounds 1-3
    with pytest.raises(TraceError, match="request r0 has tokens from rounds the steps table does not have"):
        read_consistent(Trace.open(tmp_path / "bad"), want)

    _trace_with_requests(tmp_path / "cut", [1, 3], [1, 2], None)
    tr = Trace.open(tmp_path / "cut")
    t = read_consistent(tr, want)
    assert t["requests"].num_rows == 0 and t["probes"]["step"].to_pylist() == [0, 1, 2]
    assert tr.status.clipped == {"requests": 1, "probes": 2}
    assert "clipped 2 probes rows, 1 requests rows" in (tr.status.headline() or "")

    _trace_with_requests(tmp_path / "stalled", [1, 2], [1, 2], "stalled")
    st = Trace.open(tmp_path / "stalled").status
    assert st.state == "stalled" and (st.headline() or "").startswith("STALLED: the run ended in a stall")


def test_broken_token_runs_are_found_in_every_chunk(tmp_path: Path) -> None:
    """The check walks the requests a chunk at a time: a broken run in a later chunk clips
    that request, not its chunk's first."""
    from tracing.consistency import _check_token_runs

    _trace_with_requests(tmp_path, [1, 2], [1, 2, 3], None)
    tr = Trace.open(tmp_path)
    steps = pa.table({"step": [1, 2, 3], "collect_ns": [10, 20, 30]})
    runs = pa.list_(pa.int64())
    req = pa.Table.from_batches([
        pa.record_batch({"request_id": ["a", "b"], "token_runs": pa.array([[1, 2], [2, 1]], runs)}),
        pa.record_batch({"request_id": ["c", "d", "e"], "token_runs": pa.array([[1, 1], [1, 1, 3, 2], [2, 2]], runs)}),
    ])
    got = _check_token_runs(tr, req, steps)
    assert got["request_id"].to_pylist() == ["a", "b", "c", "e"] and tr.status.clipped == {"requests": 1}


def test_duplicate_steps_are_a_corrupt_trace(tmp_path: Path) -> None:
    _trace_with_requests(tmp_path, [1, 2], [1, 2], "complete")
    m = json.loads((tmp_path / "manifest.json").read_text())
    part = m["tables"]["steps"][0]
    shutil.copy(tmp_path / "steps" / part["file"], tmp_path / "steps" / "part-000900.parquet")
    m["tables"]["steps"].append({**part, "file": "part-000900.parquet"})
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TraceError, match="steps has 2 rows for round 1"):
        read_consistent(Trace.open(tmp_path), {"probes": ["step"]})


def test_the_writers_own_thread_flushes_and_compacts_while_rows_arrive(tmp_path: Path) -> None:
    import threading

    w = TraceWriter(tmp_path, flush_interval_s=0.005, targets=SMALL)
    w.write_meta({})
    buf = w.buffer("probes")
    stop = threading.Event()
    n = 0

    def produce() -> None:
        nonlocal n
        while not stop.is_set() or n < 400:  # at least 400 rows, over many flushes
            buf.append(probe_row(n))
            n += 1
            if n % 4 == 0:
                stop.wait(0.001)

    t = threading.Thread(target=produce)
    t.start()
    deadline = time.monotonic() + 30
    while read_manifests(tmp_path)[0].epoch < 60 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join()
    w.close()
    m = read_manifests(tmp_path)[0]
    assert m.epoch >= 60  # many commits: flushes and merges
    # merged as it went and at the end: parts above half the target, not one per flush
    assert len(m.tables["probes"]) <= 2 * n // SMALL.max_rows + 1, [e.rows for e in m.tables["probes"]]
    assert steps_of(tmp_path) == list(range(n))


def test_an_error_status_says_so(tmp_path: Path) -> None:
    _trace_with_requests(tmp_path, [1, 2], [1, 2], "error")
    st = Trace.open(tmp_path).status
    assert st.state == "error" and (st.headline() or "").startswith("FAILED: the run ended in an error")


def test_a_part_written_before_a_column_was_added_reads_it_as_its_default(tmp_path: Path) -> None:
    """requests.delivered_ns came after schema version 1: an older part has no such column."""
    import pyarrow.parquet as pq

    from tracing.manifest import read_manifests as manifests

    root = tmp_path / "t"
    _trace_with_requests(root, [1, 2], [1, 2], "complete")
    (part,) = [root / "requests" / e.file for m in manifests(root) for e in m.tables["requests"]]
    old = pq.read_table(part)
    pq.write_table(old.drop_columns(["delivered_ns"]), part)
    got = read_table(root, "requests", ["request_id", "delivered_ns"]).to_pydict()
    assert got == {"request_id": ["r0"], "delivered_ns": [0]}
    assert read_table(root, "requests")["delivered_ns"].to_pylist() == [0]


def test_compact_holds_a_batch_of_rows_not_a_part(tmp_path: Path) -> None:
    """`mstrace compact` checks and rewrites parts as streams: an adopted trace of two 1 M-row
    probes parts, one in a thousand row groups (rewritten) and one in a single group (sealed,
    only checked), compacts with Arrow's memory peaking at a fraction of one part's rows,
    and every row is kept in order."""
    import subprocess
    import sys

    import numpy as np
    import pyarrow.parquet as pq

    from tracing.schema import PROBES
    from tracing.writer import parquet_options

    n = 1_000_000
    (tmp_path / "probes").mkdir()
    for i, groups in enumerate((1000, 1)):
        step = np.arange(i * n, (i + 1) * n, dtype=np.int64)
        t = pa.table([pa.array(step * 10), pa.array(np.ones(n, np.int64)),
                      pa.DictionaryArray.from_arrays(pa.array(step % 4, pa.int32()), ["a", "b", "c", "d"]),
                      pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), ["host"]),
                      pa.array(np.zeros(n, np.int32)), pa.array(step)], schema=PROBES)
        pq.write_table(t, tmp_path / "probes" / f"part-{i:06d}.parquet", row_group_size=n // groups,
                       **parquet_options(PROBES))  # as the writer writes a part
    part_bytes = t.nbytes
    (tmp_path / "meta.json").write_text(json.dumps({"schema_version": 1, "run": {"steps": 1}}))
    code = ("import sys, pyarrow as pa; from tracing.compact_trace import compact_trace; "
            "from tracing.compaction import Targets; "
            f"compact_trace({str(tmp_path)!r}, Targets(max_rows=50_000)); "
            "print(pa.default_memory_pool().max_memory())")
    p = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    peak = int(p.stdout.split()[-1])
    assert peak < part_bytes / 3, (peak, part_bytes)
    (m,) = read_manifests(tmp_path)
    first, second = m.tables["probes"]
    assert (first.rows, first.row_groups, second.rows, second.row_groups) == (n, n // 50_000, n, 1)
    assert steps_of(tmp_path) == list(range(2 * n))


@pytest.mark.parametrize("error", ["disk full", "out of memory"])
def test_compact_that_runs_out_of_disk_or_memory_says_which_in_one_line_and_keeps_every_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    import errno

    import pyarrow.parquet as pq

    from tests.support.cli import cli

    write_flushes(tmp_path / "killed", flushes=6, rows=5, targets=Targets(fan_in=100), close=False)
    shutil.copytree(tmp_path / "killed", tmp_path / "t")  # a killed run's parts, no writer
    tmp_path = tmp_path / "t"
    want = steps_of(tmp_path)

    def failing(self: object, *a: object, **kw: object) -> None:
        if error == "disk full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise pa.ArrowMemoryError("malloc of size 268435456 failed")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    code, out, err = cli("compact", str(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert ("No space left on device" if error == "disk full" else "out of memory") in err
    assert "corrupt" not in err
    assert not list((tmp_path / "probes").glob(".*.tmp"))  # the half-written part is gone, not left to fill a disk
    monkeypatch.undo()
    assert steps_of(tmp_path) == want  # the manifest still names the parts it did
    assert cli("compact", str(tmp_path))[0] == 0 and steps_of(tmp_path) == want


def test_parts_coalesce_into_chunks_without_copying_large_ones(monkeypatch):
    """Runs of small parts are combined into chunks of at least CHUNK_ROWS rows; a part of
    CHUNK_ROWS or more stays its own chunk, its buffers not copied; the rows keep their order."""
    import tracing.reader as R

    monkeypatch.setattr(R, "CHUNK_ROWS", 10)
    sizes = [3, 4, 5, 12, 2, 2, 30, 1]
    start = [sum(sizes[:k]) for k in range(len(sizes))]
    pieces = [pa.table({"x": pa.array(range(s, s + n), pa.int64())}) for s, n in zip(start, sizes, strict=True)]
    big = {n: p["x"].chunk(0).buffers()[1].address for n, p in zip(sizes, pieces, strict=True) if n >= 10}
    t = R._coalesce(list(pieces))
    assert t["x"].to_pylist() == list(range(sum(sizes)))
    chunks = t["x"].chunks
    assert [len(c) for c in chunks] == [12, 12, 4, 30, 1]
    assert {len(c): c.buffers()[1].address for c in chunks if len(c) in big} == big


def test_parts_read_uncombined_give_the_same_rows_one_chunk_a_part(tmp_path, monkeypatch):
    """`coalesce=False` (the report's requests: one copy fewer of a long run's rows) gives the
    rows `coalesce=True` gives, in order, with each part's rows left as read."""
    import pyarrow.parquet as pq

    import tracing.reader as R
    from tracing.schema import TABLES
    from tracing.writer import parquet_options

    monkeypatch.setattr(R, "CHUNK_ROWS", 10)
    src = pq.read_table(next((Path(__file__).resolve().parents[1] / "traces" / "sample-overlap" / "requests")
                             .glob("*.parquet")))
    assert src.num_rows >= 8
    parts = []
    for k, a in enumerate(range(0, src.num_rows, 3)):
        path = tmp_path / f"part-{k:06d}.parquet"
        pq.write_table(src.slice(a, 3), path, **parquet_options(src.schema))
        parts.append(R.Part(path, min(3, src.num_rows - a)))
    cols = ["request_id", "arrival_ns", "token_runs"]
    whole = R._read_parts(parts, TABLES["requests"], cols)
    uncombined = R._read_parts(parts, TABLES["requests"], cols, coalesce=False)
    assert uncombined.equals(whole) and whole.num_rows == src.num_rows
    assert uncombined["request_id"].num_chunks == len(parts) > whole["request_id"].num_chunks


@pytest.mark.parametrize("where", ["before the rename", "after the rename"])
def test_a_flush_whose_manifest_write_failed_commits_its_rows_once_on_the_next(tmp_path: Path, monkeypatch,
                                                                                where: str) -> None:
    """The manifest write fails (a full disk as its temp file is written, or the folder's
    fsync after its rename): the flush raises and keeps its rows, and the next flush commits
    each of them once, under an epoch above any a reader could have seen."""
    import tracing.manifest as manifest_mod

    w = TraceWriter(tmp_path, flush_interval_s=3600, targets=SMALL)
    w.write_meta({"model": {"kv_blocks": 4}})
    buf = w.buffer("probes")
    buf.extend(probe_row(i) for i in range(3))
    w.flush()
    buf.extend(probe_row(i) for i in range(3, 6))
    real_write = Path.write_text

    def full(self: Path, *a, **kw):
        if self.name.startswith(".manifest"):
            raise OSError(28, "No space left on device")
        return real_write(self, *a, **kw)

    def failing_fsync(d: Path) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:
        if where == "before the rename":
            m.setattr(Path, "write_text", full)
        else:
            m.setattr(manifest_mod, "fsync_dir", failing_fsync)
        with pytest.raises(OSError):
            w.flush()
    seen = read_manifests(tmp_path)[0].epoch  # what a reader saw after the failed commit
    buf.extend(probe_row(i) for i in range(6, 8))
    w.flush()
    assert read_manifests(tmp_path)[0].epoch > seen
    w.close()
    assert steps_of(tmp_path) == list(range(8))


def test_a_row_its_table_cannot_hold_is_set_aside_and_later_rows_are_committed(tmp_path: Path, capsys) -> None:
    """A producer's bug (a step that is no number, a row of the wrong length) costs its own rows,
    counted in the end record, not every flush after it: kept for the next flush, such a
    row failed that one too, so nothing more was stored."""
    w = TraceWriter(tmp_path, flush_interval_s=3600, targets=SMALL)
    w.write_meta({"model": {"kv_blocks": 4}})
    buf = w.buffer("probes")
    buf.extend([probe_row(0), probe_row(1)[:-1], probe_row(1), (*probe_row(2)[:-1], "two"), probe_row(2)])
    w.flush()
    buf.extend(probe_row(i) for i in range(3, 5))
    w.flush()
    w.close({"model": {"kv_blocks": 4}, "run": {"status": "complete"}})
    assert steps_of(tmp_path) == list(range(5))
    writer = json.loads((tmp_path / "meta.json").read_text())["run"]["writer"]
    assert writer["refused"]["probes"] == 2 and writer["rows"]["probes"] == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "probes rows its columns cannot hold are set aside" in err[0]


def test_a_tap_that_raises_costs_its_own_view_not_the_writers_bookkeeping_or_close(tmp_path: Path, capsys) -> None:
    """A live view's tap raising after a commit (serve's cost table): the rows are committed
    and counted, the next taps run, and close() completes (it raised on every flush after)."""
    w = TraceWriter(tmp_path, flush_interval_s=3600, targets=SMALL)
    w.write_meta({"model": {"kv_blocks": 4}})
    seen: list[int] = []

    def broken(t: pa.Table) -> None:
        raise ValueError("a view's bug")

    w.tap("probes", broken)
    w.tap("probes", lambda t: seen.append(t.num_rows))
    buf = w.buffer("probes")
    for f in range(2):
        buf.extend(probe_row(3 * f + i) for i in range(3))
        w.flush()
    w.close({"model": {"kv_blocks": 4}, "run": {"status": "complete"}})
    assert seen == [3, 3] and w.rows_written("probes") == 6 and isinstance(w.last_error, ValueError)
    err = capsys.readouterr().err.strip().splitlines()  # said once, not every flush
    assert len(err) == 1 and "a live view of the probes rows failed" in err[0] and "a view's bug" in err[0]
    assert steps_of(tmp_path) == list(range(6))
