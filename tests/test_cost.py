"""The cost attribution on hand-built tables: exact numbers, no engine."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tracing.schema import PROBES, STEPS
from viewer.analysis import native
from viewer.analysis.cost import cost_table
from viewer.analysis.intervals import Coverage as _Coverage


@pytest.fixture(params=["native", "numpy"])
def kernels(request, monkeypatch):
    """Both implementations of the inner loops: the C ones and numpy's fallback."""
    if request.param == "native" and not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    monkeypatch.setattr(native, "AVAILABLE", request.param == "native")
    return request.param


def test_the_c_loops_are_built_where_there_is_a_compiler():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler: the numpy fallback is what runs")
    assert native.AVAILABLE, "setup.sh's install should have built viewer/analysis/_kernels.c"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-100, 100), max_size=40), st.lists(st.integers(-120, 120), max_size=40))
def test_the_c_searches_equal_numpys(s, q):
    if not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    s_ = np.sort(np.array(s, dtype=np.int64))
    q_ = np.array(q, dtype=np.int64)  # any order: the search gallops both ways
    assert native.search_right(s_, q_).tolist() == np.searchsorted(s_, q_, side="right").tolist()
    ln = np.diff(s_, append=s_[-1] + 3 if len(s_) else 0) // 2  # disjoint: each shorter than its gap
    cum = np.concatenate([[0], np.cumsum(ln)]).astype(np.int64)
    want = [sum(max(min(x, a + d) - a, 0) for a, d in zip(s_.tolist(), ln.tolist(), strict=True)) for x in q]
    assert native.busy_before(s_, ln, cum, q_).tolist() == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.integers(0, 2)), max_size=20), min_size=1,
                max_size=4),
       st.booleans(), st.sampled_from([None, 0, 1, 2]))
def test_the_c_split_is_a_stable_sort_by_key(chunks, with_host, want):
    """`want`: one rank's rows of the chunks (a TP window's), the others skipped."""
    if not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    codes = [np.array([c for c, _, _ in ch], dtype=np.int32) for ch in chunks]
    host = [np.array([h for _, h, _ in ch], dtype=bool) for ch in chunks] if with_host else None
    rank = [np.array([r for _, _, r in ch], dtype=np.int64) for ch in chunks] if want is not None else None
    ts = [np.arange(len(ch), dtype=np.int64) + 100 * k for k, ch in enumerate(chunks)]
    dur = [t * 7 for t in ts]
    off, ts_out, dur_out = native.split_by_key(codes, host, 4, ts, dur, rank, want or 0)
    key = np.concatenate(codes).astype(np.int64)
    if host is not None:
        key = key * 2 + ~np.concatenate(host)
    mine = np.concatenate(rank) == want if rank is not None else np.ones(len(key), dtype=bool)
    key, ts_all, dur_all = key[mine], np.concatenate(ts)[mine], np.concatenate(dur)[mine]
    order = np.argsort(key, kind="stable")
    assert ts_out.tolist() == ts_all[order].tolist()
    assert dur_out.tolist() == dur_all[order].tolist()
    assert off.tolist() == [0, *np.cumsum(np.bincount(key, minlength=len(off) - 1)).tolist()]


def test_the_c_split_refuses_a_code_outside_the_dictionary():
    if not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    one = [np.array([0, 5], dtype=np.int32)]
    with pytest.raises(ValueError, match="boundary code 5"):
        native.split_by_key(one, None, 2, [np.zeros(2, np.int64)], [np.zeros(2, np.int64)])
    # another rank's row is not read: its code is not this rank's to check
    off, _, _ = native.split_by_key(one, None, 2, [np.zeros(2, np.int64)], [np.zeros(2, np.int64)],
                                    [np.array([0, 1], np.int64)], 0)
    assert off.tolist() == [0, 1, 1]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 50)), min_size=0, max_size=30),
       st.lists(st.tuples(st.integers(-50, 1100), st.integers(0, 300)), min_size=1, max_size=30))
def test_coverage_matches_brute_force(kernels, dev, queries):
    s = np.array([a for a, _ in dev], dtype=np.int64)
    e = np.array([a + d for a, d in dev], dtype=np.int64)
    cov = _Coverage(s, e)
    busy = np.zeros(1500, dtype=bool)
    for a, d in dev:
        busy[a + 100 : a + d + 100] = True
    a = np.array([q for q, _ in queries], dtype=np.int64)
    b = a + np.array([d for _, d in queries], dtype=np.int64)
    want = [int(busy[x + 100 : y + 100].sum()) for x, y in zip(a, b, strict=True)]
    assert cov.covered(a, b).tolist() == want


def table(schema, rows):
    cols = list(zip(*rows, strict=True))
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, schema, strict=True)],
                                schema=schema)


MS = 1_000_000


def _serial(cycles: int = 2, with_bookkeeping: bool = True) -> tuple[pa.Table, pa.Table]:
    """10 ms cycles: 1 ms bookkeeping, 1 ms prepare, device busy 6 ms, barrier wait 6.5 ms,
    0.5 ms send, then 1 ms that no probe covers (9 ms .. 10 ms)."""
    steps = table(STEPS, [(i, "serial", i * 10 * MS, 9 * MS, 3 * MS, 6 * MS, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)
                          for i in range(cycles)])
    rows = []
    for i in range(cycles):
        t = i * 10 * MS
        rows += [(t, MS, "bookkeeping", "host", 0, i)] if with_bookkeeping else []
        rows += [(t + MS, MS, "batch_prepare", "host", 0, i), (t + 2 * MS, 6 * MS, "device_compute", "main", 0, i),
                 (t + 2 * MS, int(6.5 * MS), "scheduler_barrier", "host", 0, i),
                 (t + int(8.5 * MS), MS // 2, "response_send", "host", 0, i)]
    return table(PROBES, rows), steps


def views(c) -> tuple[dict[str, float], dict[str, float]]:
    return ({b.boundary: b.share for b in c.boundaries if b.share is not None},
            {b.boundary: b.host_share for b in c.boundaries if b.host_share is not None})


def test_serial_cycle_both_views_exactly():
    c = cost_table(*_serial())
    assert c.cycles == 2 and c.cycle_ms == 9.5  # the last cycle ends at its hand-off (9 ms)
    # every row is measured; the 1 ms no probe covers is unattributed, not the barrier's
    c = cost_table(*_serial(3))
    dev, host = views(c)
    per = 10 * 2 + 9  # ms in three cycles
    assert dev["device_compute"] == pytest.approx(18 / per)
    assert dev["bookkeeping"] == pytest.approx(3 / per) and dev["batch_prepare"] == pytest.approx(3 / per)
    assert dev["scheduler_barrier"] == pytest.approx(1.5 / per)  # 6.5 ms wait, 6 ms of it under compute
    assert dev["response_send"] == pytest.approx(1.5 / per)
    assert dev["unattributed"] == pytest.approx(2 / per)  # 9..10 ms of the first two cycles
    assert host["scheduler_barrier"] == pytest.approx(19.5 / per)
    assert host["unattributed"] == pytest.approx(2 / per)
    assert {b.boundary: b.hidden for b in c.boundaries}["scheduler_barrier"] is None  # a wait is not hidden
    assert c.share_sum == pytest.approx(1) and c.host_share_sum == pytest.approx(1) and not c.negative


def test_deleted_rows_show_as_unattributed_not_barrier():
    full, gone = cost_table(*_serial(3)), cost_table(*_serial(3, with_bookkeeping=False))
    (df, hf), (dg, hg) = views(full), views(gone)
    assert "bookkeeping" not in dg
    assert dg["scheduler_barrier"] == df["scheduler_barrier"] and hg["scheduler_barrier"] == hf["scheduler_barrier"]
    assert dg["unattributed"] == pytest.approx(df["unattributed"] + df["bookkeeping"])
    assert hg["unattributed"] == pytest.approx(hf["unattributed"] + hf["bookkeeping"])


def test_nested_fence_is_charged_once_to_the_innermost():
    """A kv_fence query inside bookkeeping: its time leaves bookkeeping in both views."""
    steps = table(STEPS, [(0, "overlap", 0, 10 * MS, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)])
    rows = [(0, 4 * MS, "bookkeeping", "host", 0, 0), (MS, MS, "kv_fence", "host", 0, 0),
            (4 * MS, 6 * MS, "scheduler_barrier", "host", 0, 0)]
    dev, host = views(cost_table(table(PROBES, rows), steps))
    assert dev["kv_fence"] == host["kv_fence"] == pytest.approx(0.1)
    assert dev["bookkeeping"] == host["bookkeeping"] == pytest.approx(0.3)
    assert sum(dev.values()) == pytest.approx(1) and dev["unattributed"] == pytest.approx(0)


def test_prefill_stagger_is_its_own_row():
    """A deliberate delay on the device stream: the device's idle time under it is the stagger's."""
    steps = table(STEPS, [(0, "serial", 0, 10 * MS, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)])
    rows = [(0, MS, "batch_prepare", "host", 0, 0), (MS, 9 * MS, "scheduler_barrier", "host", 0, 0),
            (MS, 2 * MS, "prefill_stagger", "prefill", 0, 0), (3 * MS, 7 * MS, "device_compute", "prefill", 0, 0)]
    dev, host = views(cost_table(table(PROBES, rows), steps))
    assert dev["prefill_stagger"] == pytest.approx(0.2)
    assert dev["scheduler_barrier"] == pytest.approx(0) and dev["unattributed"] == pytest.approx(0)
    assert host["scheduler_barrier"] == pytest.approx(0.9) and "prefill_stagger" not in host


def test_overlapping_host_probes_are_flagged_negative():
    steps = table(STEPS, [(0, "serial", 0, 10 * MS, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)])
    rows = [(0, 6 * MS, "bookkeeping", "host", 0, 0), (2 * MS, 6 * MS, "batch_prepare", "host", 0, 0)]
    c = cost_table(table(PROBES, rows), steps)
    assert "unattributed (device view)" in c.negative and "unattributed (host view)" in c.negative


def test_host_work_under_device_compute_is_hidden():
    steps = table(STEPS, [(0, "overlap", 0, 10 * MS, 0, 8 * MS, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)])
    rows = [(0, 8 * MS, "device_compute", "main", 0, 0), (MS, 2 * MS, "bookkeeping", "host", 0, 0),
            (9 * MS, MS, "bookkeeping", "host", 0, 0)]
    c = cost_table(table(PROBES, rows), steps)
    got = {b.boundary: b for b in c.boundaries}
    assert got["bookkeeping"].hidden == 2 / 3 and got["bookkeeping"].share == 0.1
    assert got["bookkeeping"].host_share == pytest.approx(0.3)
    assert got["unattributed"].share == pytest.approx(0.1)  # 8..9 ms: device idle, no probe


def test_comm_waits_cut_device_compute_and_keep_the_device_from_idling(kernels):
    """A TP rank: all_reduce waits cut its compute (2-3 ms inside it, 5-9 ms across its end);
    host work at 8.5-9.5 ms is exposed only where neither compute nor a wait holds the device."""
    steps = table(STEPS, [(0, "serial", 0, 10 * MS, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)])
    rows = [(0, 8 * MS, "device_compute", "main", 0, 0), (2 * MS, MS, "all_reduce", "main", 0, 0),
            (5 * MS, 4 * MS, "all_reduce", "main", 0, 0), (int(8.5 * MS), MS, "batch_prepare", "host", 0, 0)]
    dev, _ = views(cost_table(table(PROBES, rows), steps))
    assert dev["device_compute"] == pytest.approx(0.4)  # 0-2 and 3-5 ms
    assert dev["all_reduce"] == pytest.approx(0.5)
    assert dev["batch_prepare"] == pytest.approx(0.05)  # 9-9.5 ms
    assert dev["unattributed"] == pytest.approx(0.05)  # 9.5-10 ms


_BOUNDARIES = ("device_compute", "scheduler_barrier", "bookkeeping", "batch_prepare", "response_send",
               "kv_fence", "all_reduce", "prefill_stagger", "tokenize", "idle")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12),
       st.lists(st.tuples(st.integers(-30, 400), st.integers(0, 40), st.sampled_from(_BOUNDARIES),
                          st.sampled_from(("host", "main", "prefill"))), min_size=0, max_size=60))
def test_cost_table_totals_are_the_sums_of_the_per_cycle_views(kernels, gaps, probe_rows):
    """The cost table sums the cycles without keeping them (per_cycle's totals mode): the same
    numbers as summing per-cycle arrays, on any rows, in or out of the cycles, overlapping or not."""
    from viewer.analysis.cycle_views import per_cycle

    starts = np.cumsum([0, *gaps[:-1]]).tolist()
    steps = table(STEPS, [(i, "serial", s, gaps[i], 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)
                          for i, s in enumerate(starts)])
    probes = table(PROBES, [(a, d, b, st_, 0, 0) for a, d, b, st_ in probe_rows]) if probe_rows else PROBES.empty_table()
    full = per_cycle(probes, steps)
    tot = per_cycle(probes, steps, totals=True)
    assert set(full) | {"cycles"} == set(tot)
    assert tot["cycles"].tolist() == [len(steps)]
    for k, v in full.items():
        if k == "start_ns":
            assert tot[k].tolist() == v[:1].tolist()
        elif k == "end_ns":
            assert tot[k].tolist() == v[-1:].tolist()
        else:
            assert tot[k].tolist() == [pytest.approx(float(v.sum()), abs=1e-6)], k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(-30, 300), st.integers(0, 40), st.sampled_from(_BOUNDARIES),
                          st.sampled_from(("host", "main")), st.sampled_from((0, 1, 1, None))), max_size=50),
       st.sampled_from((0, 1)))
def test_a_ranks_views_are_its_own_rows_with_rank_0s_idle_rows(kernels, gaps, probe_rows, rank):
    """A TP window's rows are split by rank without copying them into a table per rank: the same
    views as that rank's rows alone, with rank 0's idle rows for its own (cycles are rank 0's;
    a null rank is nobody's)."""
    from viewer.analysis.cycle_views import per_cycle

    starts = np.cumsum([0, *gaps[:-1]]).tolist()
    steps = table(STEPS, [(i, "serial", s, gaps[i], 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0)
                          for i, s in enumerate(starts)])
    rows = [(a, d, b, s, r, 0) for a, d, b, s, r in probe_rows]
    # (a table of one rank's rows alone, nulls aside, is that rank's, idle rows too)
    assume(any(x[4] is not None and x[4] != rank for x in rows))
    mine = [x for x in rows if x[4] == rank and (rank == 0 or x[2] != "idle")]
    if rank != 0:
        mine += [(a, d, b, s, rank, 0) for a, d, b, s, r, _ in rows if r == 0 and b == "idle"]
        mine.sort(key=lambda x: x[0])  # (one rank's rows come in time order)
    def probes(r: list) -> pa.Table:
        return table(PROBES, r) if r else PROBES.empty_table()
    got = per_cycle(probes(rows), steps, rank=rank)
    want = per_cycle(probes(mine), steps, rank=rank)
    assert set(got) == set(want)
    for k in got:
        assert got[k].tolist() == pytest.approx(want[k].tolist(), abs=1e-6), k
