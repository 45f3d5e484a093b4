"""`mstrace leaks`: replaying hand-built memory tables (clean, leaked, reclaimed,
fragmented), and the stalls/leaks commands on a real tiny run."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tests.cli import mstrace
from tracing.schema import MEMORY, REQUESTS
from viewer.analysis.leaks import HeldBlocks, frag_point, largest_run, leak_report

CAP = 10


def memory(rows: list[tuple]) -> pa.Table:
    """rows: (ts_ns, kind, block_id, request_id, ref_count); step = ts for simplicity."""
    cols = list(zip(*rows, strict=True)) if rows else [[]] * 5
    return pa.table({"ts_ns": cols[0], "step": cols[0], "kind": cols[1], "block_id": cols[2],
                     "request_id": cols[3], "ref_count": cols[4]}, schema=MEMORY)


def requests(done: dict[str, str]) -> pa.Table:
    return pa.table({"request_id": list(done), "finish_reason": list(done.values())},
                    schema=pa.schema([REQUESTS.field("request_id"), REQUESTS.field("finish_reason")]))


def test_clean_replay_reports_nothing():
    mem = memory([
        (1, "alloc", 0, "r1", 1), (2, "alloc", 1, "r1", 1),
        (3, "ref", 0, "r2", 2),  # r2 shares r1's prefix block
        (4, "alloc", 2, "r2", 1),
        (5, "free", 1, "r1", 0), (5, "unref", 0, "r1", 1),  # same ts: file order decides
        (6, "free", 2, "r2", 0), (6, "free", 0, "r2", 0),
        (7, "ref", 0, "r3", 1),  # a free prefix block revived by a ref
        (8, "free", 0, "r3", 0),
    ])
    rep = leak_report(mem, requests({"r1": "eos", "r2": "length", "r3": "eos"}), CAP, run_ended=True)
    assert rep.leaks == [] and rep.still_running == [] and rep.reclaimed == {}
    assert rep.num_anomalies == 0, rep.anomalies
    assert (rep.final_free, rep.final_held, rep.capacity, rep.events) == (CAP, 0, CAP, 10)
    assert rep.to_dict()["leaked_blocks"] == 0


def test_finished_request_still_holding_blocks_is_a_leak_with_exactly_its_blocks():
    mem = memory([
        (1, "alloc", 3, "r1", 1), (2, "alloc", 4, "r1", 1), (3, "alloc", 5, "r1", 1),
        (4, "ref", 4, "r2", 2), (5, "alloc", 6, "r2", 1),
        (6, "free", 6, "r2", 0), (6, "unref", 4, "r2", 1),  # r2 released everything
        (7, "free", 3, "r1", 0),  # r1 freed only one of its three blocks
        (8, "alloc", 7, "r9", 1),  # r9 never finished
    ])
    req = requests({"r1": "eos", "r2": "eos"})
    rep = leak_report(mem, req, CAP, run_ended=True)
    assert rep.leaks == [HeldBlocks("r1", "finished", "eos", [4, 5]), HeldBlocks("r9", "unknown", None, [7])]
    assert rep.leaked_blocks == 3 and rep.final_free == CAP - 3 and rep.num_anomalies == 0
    # A killed run: r9 was simply still running; r1 is finished, so still a leak.
    rep = leak_report(mem, req, CAP, run_ended=False)
    assert [h.request_id for h in rep.leaks] == ["r1"]
    assert rep.still_running == [HeldBlocks("r9", "running", None, [7])]


def test_reclaimed_blocks_are_reclaimed_not_leaked():
    mem = memory([
        (1, "alloc", 0, "r1", 1), (2, "alloc", 1, "r1", 1),
        (3, "ref", 0, "r2", 2), (4, "alloc", 2, "r2", 1),
        # The GC takes r2's references back: block 2 becomes free, shared block 0 keeps r1.
        (5, "reclaim", 2, "r2", 0), (5, "reclaim", 0, "r2", 1),
        (6, "free", 1, "r1", 0), (6, "free", 0, "r1", 0),
    ])
    rep = leak_report(mem, requests({"r1": "eos", "r2": "aborted"}), CAP, run_ended=True)
    assert rep.leaks == [] and rep.num_anomalies == 0, rep.anomalies
    assert rep.reclaimed == {"r2": [0, 2]} and rep.reclaimed_blocks == 2
    assert rep.final_free == CAP


def test_inconsistent_events_are_flagged_not_crashed_on():
    mem = memory([(1, "alloc", 0, "r1", 1), (2, "free", 0, "r1", 0), (3, "free", 0, "r1", 0),
                   (4, "unref", 5, "r4", 1), (5, "bogus", 1, "r1", 0)])
    rep = leak_report(mem, requests({"r1": "eos"}), CAP, run_ended=True)
    assert rep.num_anomalies == 3 and rep.leaks == []
    assert "already free" in rep.anomalies[0] and "does not hold" in rep.anomalies[1]


def test_fragmentation_on_a_hand_built_snapshot():
    held = [0, 1, 4, 5, 9]
    mem = memory(
        [(10, "snapshot_begin", -1, "", 5)] + [(10, "snapshot", b, "r1", 1) for b in held]
        + [(20, "alloc", 2, "r2", 1),  # held by the replay but not listed (e.g. behind a fence)
           (30, "snapshot_begin", -1, "", 4)] + [(30, "snapshot", b, "r1", 1) for b in held]
        + [(40, "free", 2, "r2", 0), (50, "snapshot_begin", -1, "", CAP)]
    )
    rep = leak_report(mem, requests({"r2": "eos"}), CAP, run_ended=True)
    f1, f2, f3 = rep.fragmentation
    # free {2,3,6,7,8}: ratio 0.5, largest run 6-8 = 3, index 1 - 3/5
    assert (f1.step, f1.free_blocks, f1.free_reported, f1.largest_free_run) == (10, 5, 5, 3)
    assert f1.free_ratio == pytest.approx(0.5) and f1.frag_index == pytest.approx(0.4)
    # free {3,6,7,8}: the replay's block 2 counts as held
    assert (f2.free_blocks, f2.free_reported, f2.largest_free_run) == (4, 4, 3)
    assert f2.frag_index == pytest.approx(0.25)
    # an empty pool: one run of everything, no fragmentation
    assert (f3.free_blocks, f3.largest_free_run, f3.frag_index, f3.free_ratio) == (CAP, CAP, 0.0, 1.0)
    assert rep.frag_range() == (0.0, pytest.approx(0.4))
    assert rep.events == 2 and rep.num_anomalies == 0  # snapshots change no state


def test_run_helpers():
    assert largest_run([]) == 0 and largest_run([5]) == 1 and largest_run([1, 2, 4, 5, 6, 9]) == 3
    full = frag_point(0, 0, [], 8)
    assert (full.free_blocks, full.frag_index, full.free_ratio) == (0, 0.0, 0.0)


def test_capacity_inferred_without_meta():
    rep = leak_report(memory([(1, "alloc", 6, "r1", 1), (2, "free", 6, "r1", 0)]), requests({}), 0, True)
    assert rep.capacity == 7 and rep.capacity_inferred and rep.final_free == 7


# ---------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("lk") / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "8", "-q", "--out", str(out), "--snapshot-every", "5")
    assert p.returncode == 0, p.stderr
    return out


def test_leaks_on_a_tiny_run_finds_none(tiny_trace):
    p = mstrace("leaks", str(tiny_trace), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["leaks"] == [] and d["leaked_blocks"] == 0 and d["num_anomalies"] == 0, d["anomalies"]
    assert d["run_ended"] and d["events"] > 0 and d["final_free"] == d["capacity"] > 0
    assert d["fragmentation"] and 0.0 <= d["frag_index_min"] <= d["frag_index_max"] < 1.0
    # The replay agrees with the engine's own free count at every snapshot.
    assert all(f["free_blocks"] == f["free_reported"] for f in d["fragmentation"])
    p = mstrace("leaks", str(tiny_trace))
    assert p.returncode == 0, p.stderr
    assert "no leaks" in p.stdout and "fragmentation over" in p.stdout


def test_stalls_on_a_tiny_run_finds_none(tiny_trace):
    p = mstrace("stalls", str(tiny_trace), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["count"] == 0 and d["stalls"] == []
    p = mstrace("stalls", str(tiny_trace))
    assert p.returncode == 0 and "no stalls" in p.stdout


@pytest.mark.parametrize("cmd", ["stalls", "leaks"])
def test_missing_trace_is_one_line_exit_2(tmp_path, cmd):
    for args in ([str(tmp_path / "nope")], [str(tmp_path / "nope"), "--json"]):
        p = mstrace(cmd, *args)
        assert p.returncode == 2
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and "trace not found" in lines[0] and "Traceback" not in p.stderr


def test_stalls_and_leaks_do_not_import_torch_or_the_engine(tiny_trace):
    import subprocess
    import sys

    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom viewer.cli import app\n"
        f"for c in ('stalls', 'leaks'):\n    assert CliRunner().invoke(app, [c, {str(tiny_trace)!r}]).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('scheduler')))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
