"""`mstrace report`: every table written, shares that add up, a truthful
bookkeeping row, an interrupted run's status, and bad traces refused
(SIGKILL: tests/test_kill.py; generated corruptions: tests/test_corrupt.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.cli import REPO, TAG, mstrace, tagged_pids
from tracing.reader import read_table

CORE = {"scheduler_barrier", "device_compute", "bookkeeping", "response_send", "tokenize", "batch_prepare"}


def report_json(path):
    p = mstrace("report", str(path), "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def rows(rep):
    return {b["boundary"]: b for b in rep["boundaries"]}


def test_every_table_written_and_non_empty(tiny_trace):
    for t in ("requests", "timeline", "steps", "probes", "memory", "spans"):
        try:
            n = read_table(tiny_trace, t).num_rows
        except Exception as e:  # spans arrive with the OpenTelemetry sink
            pytest.skip(f"{t}: {e}") if t == "spans" else pytest.fail(str(e))
        assert n > 0, t
    mem = read_table(tiny_trace, "memory").to_pydict()
    assert "snapshot_begin" in mem["kind"] and "snapshot" in mem["kind"]


def test_report_lists_core_boundaries_in_both_views(tiny_trace):
    rep = report_json(tiny_trace)
    got = rows(rep)
    assert CORE <= set(got)
    assert rep["cycle_ms"] > 0 and rep["cycles"] > 0
    # both views, each row measured: tests/support/views.py checks they sum to the cycle; here, that
    # the scheduling thread's own time is where it should be
    assert got["device_compute"]["device_share"] > 0.2 and got["device_compute"]["host_share"] is None
    assert got["scheduler_barrier"]["host_share"] > 0.2  # serial: the host waits out the forward
    assert got["tokenize"]["device_share"] is None and got["tokenize"]["host_share"] is None  # off-thread
    assert rep["backend"]["name"] in ("cpu-process", "cpu-thread", "cuda") and rep["worth_attacking"]
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert rep["latency"][k]["p50"] > 0
    assert rep["throughput"]["output_tok_per_s"] > 0 and rep["kv"]["peak_blocks"] > 0


def test_overlap_with_split_streams_records_kv_fences(overlap_trace):
    """kv_fence exists only where a free must wait for another stream: split streams."""
    got = rows(report_json(overlap_trace))
    assert got["kv_fence"]["count"] > 0
    assert got["kv_fence"]["host_share"] > 0  # nested in bookkeeping, charged to the fence


def test_no_probes_keeps_requests(tmp_path):
    out = tmp_path / "np"
    p = mstrace("run", "--model", "tiny", "--requests", "6", "--no-probes", "--out", str(out), "-q")
    assert p.returncode == 0, p.stderr
    assert read_table(out, "requests").num_rows == 6
    assert read_table(out, "probes").num_rows == 0 and read_table(out, "memory").num_rows == 0
    assert "no-probes" in mstrace("report", str(out)).stdout
    # no advice drawn from a table no probe filled, in --json and on the HTML page alike
    rep = json.loads(mstrace("report", str(out), "--json").stdout)
    assert rep["probes"] is False and rep["worth_attacking"] == []
    page = tmp_path / "np.html"
    assert mstrace("report", str(out), "--html", str(page)).returncode == 0
    text = page.read_text()
    assert "recorded with --no-probes: no cost table" in text and "the device computes" not in text
    assert "worth attacking" not in text.lower()


@pytest.mark.slow
def test_ctrl_c_flushes_the_trace_and_stops_the_device_process(tmp_path):
    """Ctrl-C reaches the whole foreground process group, the device process included."""
    out, tag = tmp_path / "i", uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "viewer.cli", "run", "--model", "tiny", "--requests", "400", "--output-len",
         "200-400", "--cpu-device", "process", "--out", str(out), "-q"], cwd=REPO, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, env={**os.environ, TAG: tag}, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell's `&` would ignore it
    try:
        deadline = time.monotonic() + 120
        while not (list((out / "steps").glob("part-*.parquet")) and list((out / "requests").glob("part-*.parquet"))):
            assert proc.poll() is None and time.monotonic() < deadline, "run never flushed"
            time.sleep(0.1)
        assert len(tagged_pids(tag)) >= 2  # the host and its device process (positive control)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert f"interrupted: trace flushed to {out}" in err and "Traceback" not in err, err
    # a bound on outliving, not on speed: test_kill's same check needed more than 5 s beside a
    # CPU hog (ci36)
    deadline = time.monotonic() + 60
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tagged_pids(tag), "the device process outlived the run"
    rep = report_json(out)
    assert rep["cycles"] > 0 and 0 < rep["throughput"]["requests"] < 400
    st = rep["status"]
    assert st["state"] == "interrupted" and st["workload"] == 400
    assert rep["throughput"]["requests"] <= st["submitted"] <= 400  # submitted, not only finished
    first = mstrace("report", str(out)).stdout.splitlines()[0]
    assert first.startswith(f"INTERRUPTED (Ctrl-C) after {st['submitted']} of 400 requests were submitted"), first


def test_missing_trace(tmp_path):
    p = mstrace("report", str(tmp_path / "nope"))
    assert p.returncode == 2 and "trace not found" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_truncated_part_and_wrong_schema(tiny_trace, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_trace, bad)
    part = sorted((bad / "probes").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    p = mstrace("report", str(bad))
    assert p.returncode == 2 and "corrupt probes" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr

    old = tmp_path / "old"
    shutil.copytree(tiny_trace, old)
    meta = json.loads((old / "meta.json").read_text())
    meta["schema_version"] = 99
    (old / "meta.json").write_text(json.dumps(meta))
    p = mstrace("report", str(old))
    assert p.returncode == 2 and "schema_version 99" in p.stderr and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags", [["--mode", "overlap"], ["--kv-blocks", "24", "--mode", "serial"],
                                   ["--mode", "timeslice", "--timeslice-chunk", "32"]])
def test_itl_from_token_runs_equals_per_token_gaps(tmp_path, flags):
    """The report's ITL (weighted, from runs) is exactly the pooled per-token gaps."""
    from viewer.analysis.serving import itl_from_runs, serving_metrics

    out = tmp_path / "itl"
    p = mstrace("run", "--model", "tiny", "--requests", "16", "--out", str(out), "-q", *flags)
    assert p.returncode == 0, p.stderr
    req, steps = read_table(out, "requests"), read_table(out, "steps")
    want = serving_metrics(req).itl_ms
    got = itl_from_runs(req["token_runs"].chunks, steps["step"].to_numpy(), steps["collect_ns"].to_numpy())
    assert got.count == want.count > 0
    for k in ("mean", "p50", "p90", "p99"):
        assert getattr(got, k) == pytest.approx(getattr(want, k), rel=1e-5)


def test_deleted_bookkeeping_rows_move_to_unattributed_on_a_real_trace(tiny_trace):
    """Every bookkeeping row of a real run removed: its time shows as unattributed in both
    views, and the barrier (once the remainder that absorbed it) does not move."""
    import pyarrow.compute as pc

    from viewer.analysis.cost import cost_table

    probes = read_table(tiny_trace, "probes")
    steps = read_table(tiny_trace, "steps")
    full = {b.boundary: b for b in cost_table(probes, steps).boundaries}
    gone = {b.boundary: b for b in cost_table(probes.filter(pc.not_equal(probes["boundary"], "bookkeeping")),
                                              steps).boundaries}
    assert "bookkeeping" not in gone and full["bookkeeping"].host_share > 0
    for view in ("share", "host_share"):  # the cost table's fields (device view, host view)
        f, g = ({k: getattr(v, view) for k, v in t.items()} for t in (full, gone))
        assert g["scheduler_barrier"] == pytest.approx(f["scheduler_barrier"], abs=1e-12)
        assert g["unattributed"] == pytest.approx(f["unattributed"] + f["bookkeeping"], abs=1e-9)
