"""The cost attribution on hand-built tables: exact numbers, no engine."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from tracing.schema import PROBES, STEPS
from viewer.analysis.cost import cost_table
from viewer.analysis.intervals import Coverage as _Coverage


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 50)), min_size=0, max_size=30),
       st.lists(st.tuples(st.integers(-50, 1100), st.integers(0, 300)), min_size=1, max_size=30))
def test_coverage_matches_brute_force(dev, queries):
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


def test_serial_cycle_adds_up_exactly():
    # two 10 ms cycles: 1 ms bookkeeping, 1 ms prepare, device busy 6 ms, barrier wait 6.5 ms, 0.5 ms send
    ms = 1_000_000
    steps = table(STEPS, [(i, "serial", i * 10 * ms, 10 * ms, 4 * ms, 6 * ms, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0)
                          for i in range(2)])
    rows = []
    for i in range(2):
        t = i * 10 * ms
        rows += [(t, ms, "bookkeeping", "host", 0, i), (t + ms, ms, "batch_prepare", "host", 0, i),
                 (t + 2 * ms, 6 * ms, "device_compute", "main", 0, i),
                 (t + 2 * ms, int(6.5 * ms), "scheduler_barrier", "host", 0, i),
                 (t + int(8.5 * ms), ms // 2, "response_send", "host", 0, i)]
    c = cost_table(table(PROBES, rows), steps)
    got = {b.boundary: b for b in c.boundaries}
    assert c.cycles == 2 and c.cycle_ms == 10.0
    assert got["device_compute"].share == 0.6
    assert got["bookkeeping"].share == 0.1 and got["bookkeeping"].hidden == 0.0
    assert got["batch_prepare"].share == 0.1
    assert got["response_send"].share == 0.05
    assert abs(got["scheduler_barrier"].share - 0.15) < 1e-12  # the unclaimed idle remainder
    assert abs(c.share_sum - 1.0) < 1e-12
    assert abs(got["scheduler_barrier"].hidden - 6 / 6.5) < 1e-12


def test_host_work_under_device_compute_is_hidden():
    ms = 1_000_000
    steps = table(STEPS, [(0, "overlap", 0, 10 * ms, 0, 8 * ms, 0, 0, 1, 1, 1, 1, 0, 1, 0, 0)])
    rows = [(0, 8 * ms, "device_compute", "main", 0, 0), (ms, 2 * ms, "bookkeeping", "host", 0, 0),
            (9 * ms, ms, "bookkeeping", "host", 0, 0)]
    c = cost_table(table(PROBES, rows), steps)
    got = {b.boundary: b for b in c.boundaries}
    assert got["bookkeeping"].hidden == 2 / 3 and got["bookkeeping"].share == 0.1
    assert abs(c.share_sum - 1.0) < 1e-12
