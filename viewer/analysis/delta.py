"""One row of `diff`: a delta B - A with its interval, p-value and FDR decision."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from viewer.analysis.bootstrap import bh_adjust, p_value

LEVEL = 0.95
FDR_Q = 0.05


@dataclass(slots=True)
class Delta:
    a: float | None
    b: float | None
    delta: float | None  # b - a
    rel: float | None  # (b - a) / |a|
    ci_low: float | None  # 95% bootstrap percentile interval of b - a
    ci_high: float | None
    significant: bool  # Benjamini-Hochberg at FDR_Q over every row with a p-value
    p_value: float | None = None  # two-sided bootstrap p-value of b - a = 0
    p_adjusted: float | None = None  # BH-adjusted: significant iff <= FDR_Q


def delta(sa: np.ndarray, sb: np.ndarray, level: float = LEVEL) -> Delta:
    """Delta of one statistic, given its values over [sample, resample 1, ...] for A and B.

    `significant` is set here from the row's own p-value; `fdr` replaces it with the
    family-wide decision."""
    a = float(sa[0]) if np.isfinite(sa[0]) else None
    b = float(sb[0]) if np.isfinite(sb[0]) else None
    if a is None or b is None:
        return Delta(a, b, None, None, None, None, False)
    rel = (b - a) / abs(a) if a else None
    d = sb[1:] - sa[1:]
    d = d[np.isfinite(d)]
    if not len(d):
        return Delta(a, b, b - a, rel, None, None, False)
    tail = 100 * (1 - level) / 2
    lo, hi = (float(x) for x in np.percentile(d, [tail, 100 - tail]))
    p = p_value(d)
    return Delta(a, b, b - a, rel, lo, hi, p is not None and p <= FDR_Q, p)


def deltas(tree: Any) -> Iterator[Delta]:
    """Every Delta in a nested dict, in order."""
    if isinstance(tree, Delta):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from deltas(v)


def fdr(tree: Any, q: float = FDR_Q) -> int:
    """Benjamini-Hochberg over every row of `tree` with a p-value: sets p_adjusted and
    significant in place. Returns how many rows were tested."""
    rows = [d for d in deltas(tree) if d.p_value is not None]
    for d, adj in zip(rows, bh_adjust(d.p_value for d in rows if d.p_value is not None), strict=True):
        d.p_adjusted = float(adj)
        d.significant = bool(adj <= q)
    return len(rows)
