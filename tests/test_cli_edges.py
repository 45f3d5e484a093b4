"""Rough edges a new user hit (issue 25): paths and statuses in brackets printed whole, write
failures as one line and exit 2, and output into a pipe that closes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import REPO, mstrace

BRACKETS = "dir [x]"


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("edges") / BRACKETS / "tr [bold]"
    p = mstrace("run", "--model", "tiny", "--requests", "4", "--out", str(out))
    assert p.returncode == 0, p.stderr
    # rich would have taken "[x]" and "[bold]" for markup and dropped them
    assert f"trace written to {out}" in " ".join(p.stdout.split()), p.stdout[-400:]
    return out


def test_paths_in_brackets_are_printed_whole(trace: Path, tmp_path: Path) -> None:
    p = mstrace("compact", str(trace))
    assert p.returncode == 0 and p.stdout.startswith(f"{trace}:"), p.stdout
    pf = tmp_path / "out [1].pftrace"
    p = mstrace("export", str(trace), "--perfetto", str(pf))
    assert p.returncode == 0 and p.stdout.startswith(f"{pf}:"), p.stdout
    p = mstrace("report", str(tmp_path / "nowhere [x]"))
    assert p.returncode == 2 and "nowhere [x]" in p.stderr, p.stderr


def test_the_view_header_shows_the_status_in_brackets(trace: Path) -> None:
    from viewer.tui.view_app import ViewApp

    async def go() -> str:
        app = ViewApp(trace)
        async with app.run_test(size=(160, 48)) as pilot:
            await pilot.pause()
            return str(app.query_one("#status").render())

    head = asyncio.run(go())
    assert str(trace) in head and head.endswith("[complete]"), head


def test_a_trace_that_cannot_be_written_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # /sys refuses new folders even to root (a read-only mount is the same error path)
    out = Path("/sys") / f"mstrace-{os.getpid()}" / "t"
    p = mstrace("run", "--model", "tiny", "--requests", "2", "--out", str(out))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "cannot write a trace to" in lines[0], p.stderr
    assert "flushed" not in p.stderr and not out.parent.exists()


def test_compact_that_cannot_write_is_one_line_and_exit_2(trace: Path, tmp_path: Path) -> None:
    import shutil

    t = tmp_path / "t"
    shutil.copytree(trace, t)
    lock = next(t.glob(".writer-r*.lock"), t / ".writer-r0.lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()  # the writer's lock cannot be opened: compact's first write fails
    p = mstrace("compact", str(t))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: cannot compact"), p.stderr
    assert "Traceback" not in p.stderr


def test_output_into_a_closed_pipe_exits_141_quietly(trace: Path) -> None:
    """`mstrace report T | true`: the reader is gone before the report is written."""
    cmd = f"set -o pipefail; {sys.executable} -m viewer.cli sql '{trace}' 'select * from probes' | true"
    p = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr)


def test_stalls_are_numbered_in_the_order_they_were_noticed() -> None:
    import pyarrow as pa

    from tracing.schema import STALLS
    from viewer.analysis.stalls import stall_records

    ts = [2_023_000_000, 2_021_000_000, 2_022_000_000]
    cols = {f.name: [None] * 3 for f in STALLS}
    cols.update(ts_ns=ts, rank=[0, 0, 1], step=[5, 5, 5], waited_ns=[2_000_000_000] * 3)
    recs = stall_records(pa.Table.from_pydict(cols, schema=STALLS))
    assert [r.ts_ns for r in recs] == sorted(ts)


def test_the_kv_line_and_request_lists_read_as_a_person_expects() -> None:
    from viewer.analysis.order import natural_key
    from viewer.render.stalls import kv_line

    assert sorted(["req-10", "req-2", "req-100", "req-1"], key=natural_key) == ["req-1", "req-2", "req-10", "req-100"]
    line = kv_line({"num_blocks": 64, "free": 3, "fenced": 2, "holders": {"req-10": 12, "req-2": 7},
                    "largest_free_run": None})
    assert line == "KV pool: 64 blocks, 3 free, 2 fenced; held by req-2 (7), req-10 (12)"
    assert "{" not in line and "None" not in line
