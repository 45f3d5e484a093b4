"""The public probes API (mstrace/api.py, docs/api.md): an engine that is not ours writes a
trace `report`, `stalls` and `top` read; transformers' continuous batching, instrumented by
examples/transformers_cb.py without modifying transformers, is the engine."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

import mstrace
from tests.support.cli import REPO
from tests.support.cli import mstrace as cli
from tracing.reader import read_table


@pytest.fixture(scope="module")
def hf_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("hf") / "cb"
    p = subprocess.run([sys.executable, str(REPO / "examples" / "transformers_cb.py"), "--out", str(out),
                        "--requests", "8", "--max-new-tokens", "12"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    return out


def test_the_transformers_example_reports_its_rounds_and_both_views(hf_trace):
    p = cli("report", str(hf_trace), "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["cycles"] == read_table(hf_trace, "steps").num_rows > 0
    rows = {b["boundary"]: b for b in rep["boundaries"]}
    assert {"device_compute", "scheduler_barrier", "batch_prepare", "bookkeeping"} <= set(rows)
    assert rep["device_share_sum"] == pytest.approx(1.0) and rep["host_share_sum"] == pytest.approx(1.0)
    assert rep["throughput"]["completed"] == 8 and rep["latency"]["ttft_ms"]["count"] == 8
    assert rep["backend"]["name"].startswith("transformers ") and "probes API v1" in rep["backend"]["name"]
    steps = read_table(hf_trace, "steps").to_pylist()
    assert steps[0]["num_prefill_reqs"] > 0 and any(s["num_decode_reqs"] for s in steps)
    s = cli("stalls", str(hf_trace))
    assert s.returncode == 0 and "0 stall(s)" in s.stdout, s.stderr  # a healthy run: the watchdog saw none


def test_top_reads_the_examples_trace(hf_trace):
    from viewer.tui.top_app import TopApp

    async def go() -> None:
        app = TopApp(hf_trace)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.5)
            assert app.view is not None and app.view.finished == 8

    asyncio.run(go())


def test_a_wait_that_never_ends_is_caught_by_the_watchdog_and_named(tmp_path):
    """Fault injection through the API: a wait nobody signals. The watchdog reports it while it
    lasts, the wait raises at its timeout, and the trace says STALLED with the wait's names."""
    out = tmp_path / "t"
    never = threading.Event()
    with pytest.raises(mstrace.WaitTimeout):
        with mstrace.Tracer(out, engine="toy", wait_timeout_s=1.0) as tr:
            r = tr.begin_round()
            with tr.probe(mstrace.BATCH_PREPARE):
                pass
            tr.end_round(r, decode_reqs=1, decode_tokens=1)
            tr.begin_round()
            tr.wait(never.wait, what="event forward#2", signaller="device")
    p = cli("stalls", str(out), "--json")
    assert p.returncode == 1, p.stderr  # findings
    st = json.loads(p.stdout)["stalls"]
    assert st and st[0]["what"] == "event forward#2" and st[0]["signaller"] == "device"
    assert any("wait" in f for s in st[0]["stacks"] for f in s["frames"])  # the waiting thread's stack, live
    first = cli("report", str(out)).stdout.splitlines()[0]
    assert first.startswith("STALLED")
    # the clock anchor under the keys every reader takes (the API wrote others: a stall said "ts N")
    clock = json.loads((out / "meta.json").read_text())["clock"]
    assert {"anchor_monotonic_ns", "anchor_unix_ns"} <= clock.keys()
