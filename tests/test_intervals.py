"""Interval arithmetic of the cost views (viewer/analysis/intervals.py): a rank's device-busy
time is its device rows less its comm waits."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=300, deadline=None)
@given(_intervals, _intervals)
def test_subtract_is_the_pointwise_difference(rows: list[tuple[int, int]], waits: list[tuple[int, int]]) -> None:
    """Overlapping, touching, nested, zero-length and unordered intervals on both sides (two
    device streams; waits of several boundaries concatenated)."""
    s, e = [a for a, _ in rows], [a + d for a, d in rows]
    cs, ce = [a for a, _ in waits], [a + d for a, d in waits]
    got_s, got_e = subtract(np.array(s, np.int64), np.array(e, np.int64), np.array(cs, np.int64),
                            np.array(ce, np.int64))
    assert np.all(got_e > got_s) or not len(cs)
    merged = union(got_s, got_e)  # (without waits the rows come back as they are, empty ones too)
    got = [(a, b) for a, b in zip(merged[0].tolist(), merged[1].tolist(), strict=True) if b > a]
    assert got == _by_points(s, e, cs, ce)
