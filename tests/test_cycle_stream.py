"""The cost table's views read a window of probe rows at a time (viewer/analysis/cycle_stream.py):
the same sums as the whole-table computation, exactly, whatever the windows; memory that
follows the window, not the trace."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.support.tiny_runs import TinyRuns
from tracing.consistency import read_consistent
from tracing.reader import Trace
from tracing.schema import PROBES
from tracing.writer import parquet_options
from viewer.analysis.collectives import trace_stragglers
from viewer.analysis.cycle_stream import Cycles, stream_views
from viewer.analysis.cycle_views import cycle_bounds, per_cycle

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "traces"


@pytest.fixture(scope="module")
def tp2(tiny_runs: TinyRuns) -> Path:
    return tiny_runs("--tp", "2", "--requests", "12", "--shared-prefix", "0.5", "-q").out


def _small_groups(src: Path, dst: Path, rows: int) -> Path:
    """A copy of a trace whose probes (and collectives) parts are rewritten in row groups of
    `rows` rows (the manifest's counts still hold): many windows from a small trace."""
    shutil.copytree(src, dst)
    for part in [*(dst / "probes").glob("*.parquet"), *(dst / "collectives").glob("*.parquet")]:
        t = pq.read_table(part)
        pq.write_table(t, part, row_group_size=rows, **parquet_options(t.schema))
    return dst


def _assert_same_views(root: Path) -> None:
    whole_trace = Trace.open(root)
    t = read_consistent(whole_trace, {"probes": ["ts_ns", "dur_ns", "boundary", "stream", "rank"],
                                      "steps": ["step", "ts_ns", "dur_ns", "collect_ns"]})
    colls = whole_trace.table("collectives") if whole_trace.has_table("collectives") else None
    ranks = sorted(pc.unique(t["probes"]["rank"]).to_pylist())
    for totals, chunk in ((True, 1), (False, 1), (False, 3)):
        for window in (1, 7, 50, 1 << 21):
            trace = Trace.open(root)
            got = stream_views(trace, Cycles.of(trace, t["steps"]), totals, window, chunk=chunk)
            assert got.ranks == ranks
            assert got.rows == t["probes"].num_rows
            assert trace.status.clipped == whole_trace.status.clipped
            # the straggler join rides on the stream's read of the collectives
            assert got.stragglers == trace_stragglers(Trace.open(root))
            for r in ranks:
                want = per_cycle(t["probes"], t["steps"], r if len(ranks) > 1 else 0, colls, totals, chunk)
                assert want.keys() == got.by_rank[r].keys()
                for k, v in want.items():  # integer-valued float sums: equal, not close
                    assert np.array_equal(v, got.by_rank[r][k]), (root.name, totals, chunk, window, r, k)


@pytest.mark.parametrize("sample", ["sample-serial", "sample-overlap"])
def test_chunks_sum_their_cycles(sample: str) -> None:
    """`chunk` consecutive cycles to an entry: each entry the sums of its cycles' entries,
    bounded by its first start and last end (the last entry holds what is left), and the
    cycles' own lengths kept beside them."""
    trace = Trace.open(SAMPLES / sample)
    t = read_consistent(trace, {"probes": ["ts_ns", "dur_ns", "boundary", "stream", "rank"],
                                "steps": ["step", "ts_ns", "dur_ns", "collect_ns"]})
    each = per_cycle(t["probes"], t["steps"])
    n = len(each["start_ns"])
    for chunk in (2, 5, n - 1, n + 3):
        got = per_cycle(t["probes"], t["steps"], chunk=chunk)
        heads = np.arange(0, n, chunk)
        assert np.array_equal(got["start_ns"], each["start_ns"][heads])
        assert np.array_equal(got["end_ns"], each["end_ns"][np.minimum(heads + chunk, n) - 1])
        assert np.array_equal(got["cycles"], np.diff(np.append(heads, n)))
        assert np.array_equal(got["series:cycle_ns"], each["cycle_ns"])
        assert got.keys() - {"cycles", "series:cycle_ns"} == each.keys()
        for k, v in each.items():
            if k not in ("start_ns", "end_ns"):
                assert np.array_equal(got[k], np.add.reduceat(v, heads)), (sample, chunk, k)


@pytest.mark.parametrize("sample", ["sample-serial", "sample-overlap", "sample-deadlock"])
def test_windows_of_any_size_give_the_whole_traces_views(sample: str, tmp_path: Path) -> None:
    """Serial and overlap runs (kv fences nested in bookkeeping, two device streams) and a
    deadlocked one (an unfinished run: its last round's rows clipped as a whole read clips them),
    each in row groups of 3 rows, so a window holds from one row group to all of them."""
    _assert_same_views(_small_groups(SAMPLES / sample, tmp_path / sample, 3))


def test_tp2_windows_give_every_ranks_views(tp2: Path, tmp_path: Path) -> None:
    """Two ranks (each rank's rows against rank 0's cycles, all_reduce from the collectives
    table), in row groups of 7 rows interleaved across the ranks' parts; every third
    collective moved to start exactly where a cycle does (a window's edge: it belongs to the
    window that starts there)."""
    root = _small_groups(tp2, tmp_path / "tp2", 7)
    S, _ = cycle_bounds(read_consistent(Trace.open(root), {"steps": ["ts_ns", "dur_ns"]})["steps"])
    moved = 0
    for part in (root / "collectives").glob("*.parquet"):
        t = pq.read_table(part)
        issue = t["issue_ns"].to_numpy().copy()
        at = np.searchsorted(S, issue, "right") - 1  # the start at or before: still done (end >= issue)
        pick = np.zeros(len(issue), dtype=bool)
        pick[::3] = True
        pick &= at >= 0
        issue[pick] = S[at[pick]]
        moved += int(pick.sum())
        t = t.set_column(t.schema.get_field_index("issue_ns"), "issue_ns", pa.array(issue))
        pq.write_table(t, part, row_group_size=7, **parquet_options(t.schema))
    assert moved > 10
    _assert_same_views(root)


def test_a_window_holds_a_windows_rows_not_the_traces(tmp_path: Path) -> None:
    """2 M probe rows in 2,000 row groups, read in windows of 20 k rows: Arrow's memory peaks
    at a small fraction of the probes table (the whole read holds all of it), and the views
    still count every row."""
    rounds, per = 200_000, 10
    n = rounds * per
    start = np.arange(rounds, dtype=np.int64) * 1_000_000 + 10**9
    ts = (start[:, None] + np.arange(per, dtype=np.int64) * 90_000).ravel()
    names = ["device_compute", "scheduler_barrier", "bookkeeping", "batch_prepare", "response_send"]
    code = np.tile(np.arange(per, dtype=np.int32) % len(names), rounds)
    probes = pa.table([pa.array(ts), pa.array(np.full(n, 80_000, np.int64)),
                       pa.DictionaryArray.from_arrays(pa.array(code), names),
                       pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), ["host"]),
                       pa.array(np.zeros(n, np.int32)), pa.array(np.repeat(np.arange(rounds), per))], schema=PROBES)
    (tmp_path / "probes").mkdir()
    half = n // 2
    for i in range(2):
        pq.write_table(probes.slice(i * half, half), tmp_path / "probes" / f"part-{i:06d}.parquet",
                       row_group_size=1000, **parquet_options(PROBES))
    (tmp_path / "meta.json").write_text(json.dumps({"schema_version": 1, "run": {"steps": rounds}}))
    code_ = ("import numpy as np, pyarrow as pa; from tracing.reader import Trace; "
             "from viewer.analysis.cycle_stream import Cycles, stream_views; "
             f"s = np.arange({rounds}, dtype=np.int64) * 1_000_000 + 10**9; "
             "steps = pa.table({'ts_ns': s, 'dur_ns': np.full(len(s), 1_000_000)}); "
             f"tr = Trace.open({str(tmp_path)!r}); v = stream_views(tr, Cycles.of(tr, steps), window_rows=20_000); "
             "print(v.rows, int(v.by_rank[0]['count:bookkeeping'][0]), pa.default_memory_pool().max_memory())")
    p = subprocess.run([sys.executable, "-c", code_], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows, bookkeeping, peak = map(int, p.stdout.split())
    assert (rows, bookkeeping) == (n, rounds * 2)
    assert peak < probes.nbytes / 10, (peak, probes.nbytes)


@pytest.mark.parametrize("column", ["boundary", "stream"])
def test_a_plain_string_column_in_chunks_gives_the_same_views(column: str) -> None:
    """A caller's own table (not a trace's read) may hold `boundary` or `stream` as plain
    strings in several chunks, each chunk its own allocation: one dictionary chunk of codes
    then spans chunks of times that end sooner (the C split read past them)."""
    t = read_consistent(Trace.open(SAMPLES / "sample-overlap"), {"probes": None, "steps": None})
    probes, steps = t["probes"], t["steps"]
    want = per_cycle(probes, steps, totals=True)
    half = probes.num_rows // 2
    apart = pa.concat_tables([pa.Table.from_pylist(probes.slice(a, b).to_pylist(), schema=probes.schema)
                              for a, b in ((0, half), (half, probes.num_rows - half))])
    apart = apart.set_column(apart.schema.get_field_index(column), column, apart[column].cast(pa.string()))
    assert apart[column].num_chunks == apart["ts_ns"].num_chunks == 2
    got = per_cycle(apart, steps, totals=True)
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert np.array_equal(v, got[k]), k


@pytest.mark.parametrize("high", [5, 1 << 13])
def test_the_ranks_come_from_statistics_and_the_groups_that_could_hold_one_between(tp2: Path, tmp_path: Path,
                                                                                   high: int) -> None:
    """Row groups that mix ranks, as a compacted trace's do: each group's least and greatest
    rank are present; a rank strictly between them is looked for (3 is in one group's
    middle, 2 and 4 in none), and a span too wide to look through reads the column whole."""
    from tracing.sweep import Sweep
    from viewer.analysis.cycle_stream import _ranks

    root = _small_groups(tp2, tmp_path / "tp2", 7)
    part = sorted((root / "probes").glob("*.parquet"))[0]
    t = pq.read_table(part)
    rank = t["rank"].to_numpy().copy()
    assert len(rank) > 30
    rank[14], rank[17], rank[20] = 0, 3, high  # the third group: 0 ... 3 ... high
    pq.write_table(t.set_column(t.schema.get_field_index("rank"), "rank", pa.array(rank)), part,
                   row_group_size=7, **parquet_options(t.schema))
    trace = Trace.open(root)
    want = sorted(pc.unique(trace.table("probes", ["rank"])["rank"]).to_pylist())
    assert 3 in want and high in want and 2 not in want
    assert _ranks(trace, Sweep(trace, "probes", ["ts_ns"], ranges=("rank",))) == want
