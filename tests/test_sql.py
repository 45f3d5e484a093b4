"""`mstrace sql`: every documented query runs, the helper views agree with the report, and
nothing can write."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.cli import REPO, mstrace
from tests.support.tiny_runs import TinyRuns
from viewer.analysis.report import build_report
from viewer.export.sql import SqlError, TraceDb

QUERIES = re.findall(r"```sql\n(.*?)```", (REPO / "docs" / "sql.md").read_text(), re.S)


@pytest.fixture(scope="module")
def trace(tiny_runs: TinyRuns) -> Path:
    return tiny_runs("--requests", "48", "--shared-prefix", "0.5", "-q").out


def test_the_page_has_ten_queries() -> None:
    assert len(QUERIES) == 10


@pytest.mark.parametrize("n", range(1, 11))
def test_each_documented_query_runs(trace: Path, n: int) -> None:
    res = TraceDb(trace).query(QUERIES[n - 1])
    assert res.columns
    if n not in (6,):  # 6 lists spikes, which a short quiet run may not have
        assert res.rows, f"query {n} returned nothing"


def test_the_cost_shares_equal_the_report(trace: Path) -> None:
    rows = TraceDb(trace).query(QUERIES[0]).rows
    rep = build_report(trace)
    got = {b: (d, h) for b, d, h in rows}
    want = {b["boundary"]: (b["device_share"], b["host_share"]) for b in rep["boundaries"]}
    assert set(want) <= set(got) | {"tokenize", "response_deliver", "stream_wait"}
    for b, (share, host) in want.items():
        if share is None and host is None:
            continue
        d, h = got[b]
        assert d == pytest.approx(share, abs=1e-12) if share is not None else d is None
        assert h == pytest.approx(host, abs=1e-12) if host is not None else h is None


def test_request_latency_agrees_with_the_report(trace: Path) -> None:
    q = TraceDb(trace).query("SELECT quantile_cont(ttft_ms, 0.5), quantile_cont(e2e_ms, 0.99), COUNT(*) "
                             "FROM request_latency").rows[0]
    lat = build_report(trace)["latency"]
    assert q[0] == pytest.approx(lat["ttft_ms"]["p50"], rel=1e-9)
    assert q[1] == pytest.approx(lat["e2e_ms"]["p99"], rel=1e-9)
    assert q[2] == 48


@pytest.mark.parametrize("stmt", [
    "DELETE FROM steps",
    "CREATE TABLE x AS SELECT 1",
    "COPY steps TO 'out.csv'",
    "SET enable_external_access = true",
    "ATTACH 'other.db'",
    "SELECT 1; DROP VIEW steps",
])
def test_a_write_statement_is_refused_in_one_line(trace: Path, stmt: str, tmp_path: Path) -> None:
    before = sorted(p.name for p in trace.rglob("*"))
    p = mstrace("sql", str(trace), stmt)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error:"), p.stderr
    assert "Traceback" not in p.stderr
    assert sorted(p.name for p in trace.rglob("*")) == before


def test_a_select_cannot_reach_the_file_system(trace: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.csv"
    secret.write_text("a\n1\n")
    with pytest.raises(SqlError, match="disabled"):
        TraceDb(trace).query(f"SELECT * FROM read_csv('{secret}')")


def test_formats_and_the_listing(trace: Path) -> None:
    p = mstrace("sql", str(trace), "SELECT step, num_running FROM steps ORDER BY step LIMIT 3", "--format", "json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows) and len(rows) == 3 and set(rows[0]) == {"step", "num_running"}
    p = mstrace("sql", str(trace), "SELECT 'a,b' AS x, 2 AS y", "--format", "csv")
    assert p.stdout.splitlines() == ["x,y", '"a,b",2']
    p = mstrace("sql", str(trace))
    assert p.returncode == 0
    for view in ("probes:", "steps:", "cycles:", "cycle_cost:", "request_latency:"):
        assert view in p.stdout
    assert "exposed_ns DOUBLE" in p.stdout


def test_bad_input_is_one_line(trace: Path, tmp_path: Path) -> None:
    for args in (("sql", str(tmp_path / "none"), "SELECT 1"), ("sql", str(trace), "SELEC 1"),
                 ("sql", str(trace), "SELECT * FROM nothing"), ("sql", str(trace), "SELECT 1", "--format", "xml")):
        p = mstrace(*args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, (args, p.stderr)


def test_show_tables_install_and_a_piped_table(trace: Path) -> None:
    """SHOW TABLES lists the views; INSTALL is refused by its own name; a table printed into a
    pipe keeps whole values (it was cut at 80 columns: `scheduler_bar…`)."""
    p = mstrace("sql", str(trace), "SHOW TABLES", "--format", "json")
    assert p.returncode == 0, p.stderr
    assert {r["name"] for r in json.loads(p.stdout)} >= {"probes", "steps", "requests", "cycles", "cycle_cost",
                                                        "request_latency"}
    p = mstrace("sql", str(trace), "INSTALL httpfs")
    assert p.returncode == 2 and "(INSTALL refused)" in p.stderr, p.stderr
    p = mstrace("sql", str(trace), "SELECT boundary, stream, rank, step, ts_ns, dur_ns, ts_ns + dur_ns AS end_ns, "
                "'a-long-literal-value-to-widen-the-table' AS pad FROM probes WHERE boundary = 'scheduler_barrier' LIMIT 2")
    assert p.returncode == 0 and "…" not in p.stdout and p.stdout.count("scheduler_barrier") == 2, p.stdout
