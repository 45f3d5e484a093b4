"""The tracing cost a trace records about itself (issue 10, item 4): the writer's CPU time
and rows (meta.json run.writer), the run's CPU time (run.cpu). No timing assertions:
only that the figures are there, add up, and that the row counts are the trace's."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from probes.cpu import child_cpu_ns, cpu_record, sample_cpu
from tests.support.cli import mstrace
from tracing.reader import read_meta, read_table
from tracing.schema import TABLES
from tracing.writer import TraceWriter


def _rows_on_disk(root: Path) -> dict[str, int]:
    return {name: read_table(root, name).num_rows for name in TABLES}


def _check_writer_record(w: dict, rows: dict[str, int]) -> None:
    assert w["rows"] == rows
    assert w["thread_cpu_ns"] > 0 and w["close_cpu_ns"] >= 0
    assert w["cpu_ns"] == w["thread_cpu_ns"] + w["close_cpu_ns"]
    assert set(w["table_cpu_ns"]) == set(TABLES) and min(w["table_cpu_ns"].values()) >= 0
    # every table's share was taken on the writer's thread or in close(): within the total
    assert sum(w["table_cpu_ns"].values()) <= w["cpu_ns"]
    assert all(w["table_cpu_ns"][t] > 0 for t, n in rows.items() if n)
    assert w["flushes"] >= 1


def test_writer_records_its_cpu_time_and_the_rows_it_committed(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "t", flush_interval_s=0.02)

    def produce(k: int) -> None:
        probes, memory = w.buffer("probes"), w.buffer("memory")
        for i in range(500):
            probes.append((i, 1, "bookkeeping", "host", 0, k))
            memory.append((i, k, "alloc", i, f"req-{k}", 1))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 10
    while w.rows_written("probes") == 0 and time.monotonic() < deadline:  # one flush on the writer's thread
        time.sleep(0.01)
    w.buffer("timeline").append((5, "req-0", "queued", 1, 0))  # left for close()'s last flush
    w.close({"run": {"status": "complete"}})

    meta = read_meta(tmp_path / "t")
    rows = _rows_on_disk(tmp_path / "t")
    assert rows["probes"] == rows["memory"] == 1000 and rows["timeline"] == 1
    _check_writer_record(meta["run"]["writer"], rows)
    assert w.stats().to_dict() == meta["run"]["writer"]


def test_close_without_an_end_of_run_record_adds_none(tmp_path: Path) -> None:
    w = TraceWriter(tmp_path / "t", flush_interval_s=0.02)
    w.buffer("probes").append((1, 1, "bookkeeping", "host", 0, 1))
    w.close({"tool": "mstrace"})
    meta = read_meta(tmp_path / "t")
    assert "run" not in meta and "writer" not in meta


def test_cpu_record_counts_this_process_its_threads_and_live_children() -> None:
    assert (child_cpu_ns(os.getpid()) or 0) >= 0 and child_cpu_ns(2 ** 31) is None
    start = sample_cpu()

    def spin() -> None:
        x = 0
        for i in range(200_000):
            x += i

    t = threading.Thread(target=spin, name="spinner")
    t.start()
    t.join()
    rec = cpu_record(start, sample_cpu())
    assert rec["process_ns"] > 0 and rec["total_ns"] == rec["process_ns"] + rec["children_ns"]
    assert "MainThread" in rec["threads_ns"] and "spinner" not in rec["threads_ns"]  # ended before the sample


def test_a_run_records_its_cpu_time_and_the_writers_rows_match_the_trace(tmp_path: Path) -> None:
    out = tmp_path / "t"
    # Enough decoding for the device process to pass many of /proc's 10 ms CPU ticks: with
    # 4 requests of 2-6 tokens its CPU inside the run's window was at times under one tick (0).
    p = mstrace("run", "--model", "tiny", "--requests", "16", "--prompt-len", "8-32", "--output-len", "24-32",
                "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    meta = read_meta(out)
    run = meta["run"]
    _check_writer_record(run["writer"], _rows_on_disk(out))
    cpu = run["cpu"]
    assert cpu["process_ns"] > 0 and cpu["total_ns"] == cpu["process_ns"] + cpu["children_ns"]
    if meta["host"]["device"] == "cpu" and meta["config"]["cpu_device"] == "process":
        # the CPU device process (and multiprocessing's resource tracker: every process of the run counts)
        assert cpu["children"] >= 1 and cpu["children_ns"] > 0
    assert {"MainThread", "trace-writer", "sender"} <= set(cpu["threads_ns"])
    assert set(cpu["threads_switches"]) <= set(cpu["threads_ns"]) and min(cpu["threads_switches"].values()) >= 0
