"""Interval arithmetic of the cost views (viewer/analysis/intervals.py): a rank's device-busy
time is its device rows less its comm waits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.kernels import c_loops
from viewer.analysis import native
from viewer.analysis.intervals import subtract, union


def test_subtract_intervals() -> None:
    a = np.array
    s, e = subtract(a([0, 100]), a([50, 200]), a([10, 40, 150]), a([20, 120, 160]))
    assert list(zip(s.tolist(), e.tolist(), strict=True)) == [(0, 10), (20, 40), (120, 150), (160, 200)]
    s, e = subtract(a([0]), a([10]), a([], dtype=np.int64), a([], dtype=np.int64))
    assert (s.tolist(), e.tolist()) == ([0], [10])


def _by_points(s: list[int], e: list[int], cs: list[int], ce: list[int]) -> list[tuple[int, int]]:
    """The difference by brute force: every integer instant inside some [s, e) and no [cs, ce),
    as maximal runs."""
    inside = sorted({t for a, b in zip(s, e, strict=True) for t in range(a, b)}
                    - {t for a, b in zip(cs, ce, strict=True) for t in range(a, b)})
    runs: list[tuple[int, int]] = []
    for t in inside:
        if runs and runs[-1][1] == t:
            runs[-1] = (runs[-1][0], t + 1)
        else:
            runs.append((t, t + 1))
    return runs


_intervals = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=25)


@pytest.mark.parametrize("c", [True, False], ids=["native", "numpy"])
@settings(max_examples=300, deadline=None)
@given(rows=_intervals, waits=_intervals)
def test_subtract_is_the_pointwise_difference(c: bool, rows: list[tuple[int, int]],
                                              waits: list[tuple[int, int]]) -> None:
    """Overlapping, touching, nested, zero-length and unordered intervals on both sides (two
    device streams; waits of several boundaries concatenated)."""
    s, e = [a for a, _ in rows], [a + d for a, d in rows]
    cs, ce = [a for a, _ in waits], [a + d for a, d in waits]
    with c_loops(c):
        got_s, got_e = subtract(np.array(s, np.int64), np.array(e, np.int64), np.array(cs, np.int64),
                                np.array(ce, np.int64))
    assert np.all(got_e > got_s) or not len(cs)
    merged = union(got_s, got_e)  # (without waits the rows come back as they are, empty ones too)
    got = [(a, b) for a, b in zip(merged[0].tolist(), merged[1].tolist(), strict=True) if b > a]
    assert got == _by_points(s, e, cs, ce)


def _numpy_union(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with c_loops(False):
        return union(s, e)


# sorted runs of intervals, ties and zero or negative lengths included (a bad trace's
# negative durations make the order of tied starts matter: the stable sort's is the answer)
_runs = st.lists(st.lists(st.tuples(st.integers(0, 60), st.integers(-8, 25)), max_size=20), max_size=7)


@settings(max_examples=400, deadline=None)
@given(_runs)
def test_the_c_union_merges_sorted_runs_as_the_stable_sort_does(runs: list[list[tuple[int, int]]]) -> None:
    if not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    rows = [sorted(r, key=lambda x: x[0]) for r in runs]
    s = np.array([a for r in rows for a, _ in r], dtype=np.int64)
    e = np.array([a + d for r in rows for a, d in r], dtype=np.int64)
    want = _numpy_union(s, e)
    got = native.union_runs(s, e)
    assert got is not None
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert union(s, e)[0].tolist() == want[0].tolist()


def test_the_c_union_leaves_many_runs_to_the_sort() -> None:
    if not native.AVAILABLE:
        pytest.skip("the C loops were not built")
    rng = np.random.default_rng(3)
    s = rng.integers(0, 10_000, 5_000).astype(np.int64)
    e = s + rng.integers(0, 30, len(s))
    assert native.union_runs(s, e, max_runs=native.MAX_RUNS) is None  # about 2,500 runs
    got, want = union(s, e), _numpy_union(s, e)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    order = np.argsort(s, kind="stable")
    one = native.union_runs(s[order], e[order], max_runs=1)
    assert one is not None and one[0].tolist() == want[0].tolist() and one[1].tolist() == want[1].tolist()


@settings(max_examples=300, deadline=None)
@given(_intervals, _intervals)
def test_the_c_subtract_gives_numpys_pieces(rows: list[tuple[int, int]], waits: list[tuple[int, int]]) -> None:
    s = np.array([a for a, _ in rows], np.int64)
    e = s + np.array([d for _, d in rows], np.int64)
    cs = np.array([a for a, _ in waits], np.int64)
    ce = cs + np.array([d for _, d in waits], np.int64)
    with c_loops(True):
        got = subtract(s, e, cs, ce)
    with c_loops(False):
        want = subtract(s, e, cs, ce)
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
