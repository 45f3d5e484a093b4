"""Resampling for `diff`: circular block draws, the block length, p-values, FDR control.

Resamples are draw-count matrices W (row r: how often each item, a cycle or a
request, was drawn in resample r), so a statistic over every resample is one
matrix product, never a copy of the data. Row 0 of what `bootstrap` returns is
the sample itself (all ones), so the point estimate and the intervals come
from the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Stat = Callable[[np.ndarray], dict[str, np.ndarray]]

BLOCK_ELEMS = 4_000_000  # draw counts per pass: bounds memory on long traces
# More items than this (a long trace's cycles, rounds or requests) are resampled as runs of
# consecutive items, one run per draw (`group_along`): the cost of a resample follows the
# runs, not the items (10 M probe rows, 1.3 M cycles: minutes otherwise).
GROUPS_MAX = 20_000
# Past GROUPS_MAX, units whose statistics are pooled percentiles (the rounds' ITL, the
# requests' latencies: `pooled`) are cut into at most this many runs: each resample costs a
# product per run and chunk of values, not one sum per run (620 k requests paired, 1,000
# resamples: 2.1 s in 19,400 runs). Still runs enough that one run is 1/5,000 of a
# resample's span and of its values. (Up to GROUPS_MAX items they are drawn one by one.)
POOLED_GROUPS_MAX = 5_000
# Items from which `resample_weights` counts each resample's draws on its own (fewer: all
# resamples in one count, not a Python loop over thousands of short rows)
ROW_BINCOUNT = 4096
# Fewer resamples than this beyond 0 and the count cannot resolve p (1000 resamples:
# p < 0.012); the tail is then extrapolated from a normal fit to the resamples.
TAIL_MIN = 5


def resample_weights(n: int, reps: int, rng: np.random.Generator, block: int = 1) -> np.ndarray:
    """(reps, n) bootstrap draw counts: how often each of n items was drawn in each resample.

    block > 1: a circular block bootstrap; each resample is ceil(n / block) runs of
    `block` consecutive items (wrapping past the end, so every item is drawn once on
    average, the first and last cycles included), cut to n draws.
    """
    if n == 0:
        return np.zeros((reps, 0))
    block = max(1, min(block, n))
    if block == 1:
        idx = rng.integers(0, n, size=(reps, n))
    else:
        starts = rng.integers(0, n, size=(reps, -(-n // block)))
        idx = ((starts[:, :, None] + np.arange(block)) % n).reshape(reps, -1)[:, :n]
    if n >= ROW_BINCOUNT:  # a row at a time: its counts stay in cache (a 20,000-item row: half the time)
        out = np.empty((reps, n))
        for r in range(reps):
            out[r] = np.bincount(idx[r], minlength=n)
        return out
    idx += (np.arange(reps) * n)[:, None]
    return np.bincount(idx.ravel(), minlength=reps * n).reshape(reps, n).astype(np.float64)


# A long trace's cycles reach `diff` summed in chunks of consecutive cycles, at most this many
# chunks (`cycle_chunk`): a chunk is then at most ceil(n / 160,000) cycles and a run at least
# ceil(n / 20,000), so rounding a run up to whole chunks adds less than a chunk, at most an
# eighth of the run.
CHUNKS_MAX = 8 * GROUPS_MAX


def cycle_chunk(n: int) -> int:
    """Cycles per entry of `diff`'s per-cycle arrays for a trace of n cycles (`per_cycle`'s
    chunk): 1 (every cycle its own) up to CHUNKS_MAX cycles, then as few as make at most
    CHUNKS_MAX entries; so never more than 1 where the cycles are drawn one by one
    (n <= GROUPS_MAX)."""
    return -(-n // CHUNKS_MAX) if n > CHUNKS_MAX else 1


def shortest_block(n: int, pooled: bool = False) -> int:
    """The block length below which n items make more than GROUPS_MAX blocks (`blocks`'s
    at_least for a series of n items that `group_along` will cut; `pooled`: more than
    POOLED_GROUPS_MAX blocks, past GROUPS_MAX items)."""
    if n <= GROUPS_MAX:
        return 1
    return -(-n // (POOLED_GROUPS_MAX if pooled else GROUPS_MAX))


def group_along(n: int, length: int, order: np.ndarray | None = None,
                pooled: bool = False) -> tuple[np.ndarray, int] | None:
    """For more than GROUPS_MAX items: each item's run of `length` consecutive items along
    `order` (item order[k] is k-th; `length` from `blocks(x, shortest_block(n, pooled))`, so
    at most GROUPS_MAX runs, or POOLED_GROUPS_MAX), and the number of runs; None for fewer
    items. Drawing whole runs at random is the non-overlapping block bootstrap (Carlstein
    1986): the circular one's answer, from as many blocks as the trace holds, each as long
    as its series asks for."""
    if n <= GROUPS_MAX:
        return None
    pos = np.arange(n) if order is None else np.empty(n, np.int64)
    if order is not None:
        pos[order] = np.arange(n)
    return pos // length, -(-n // length)


def _autocov(e: np.ndarray, lags: int) -> np.ndarray:
    """R(0..lags) of a centred series, the biased (1/n) estimator, by FFT: a million
    cycles' autocovariances in milliseconds instead of a dot product per lag."""
    n = len(e)
    # zero padding to n + lags leaves lags 0..lags free of circular wrap-around; a 5-smooth
    # length keeps the FFT fast (a power of two past 2n was 3.6x the work at 1.3 M cycles)
    size = _smooth_length(n + lags)
    f = np.fft.rfft(e, size)
    return np.fft.irfft(f * np.conj(f), size)[: lags + 1] / n


def _smooth_length(at_least: int) -> int:
    """The smallest 2^a 3^b 5^c >= at_least: lengths the FFT splits into small radices."""
    best = 1 << max(at_least - 1, 0).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            best = min(best, p35 << max(-(-at_least // p35) - 1, 0).bit_length())
            p35 *= 3
        p5 *= 5
    return best


@dataclass(slots=True)
class Blocks:
    """How one series is resampled: the block length, and the factor on each resample's
    deviation from the sample that undoes the block bootstrap's known narrowness."""

    length: int
    widen: float


def block_length(x: np.ndarray) -> int:
    """Block length for the circular block bootstrap of the mean of series `x` (`blocks`)."""
    return blocks(x).length


def blocks(x: np.ndarray, at_least: int = 1, multiple: int = 1) -> Blocks:
    """Politis & White (2004), "Automatic block-length selection for the dependent
    bootstrap", with the correction of Patton, Politis & White (2009):
      b = (2 G^2 / D)^(1/3) n^(1/3),  D = (4/3) g^2,
      g = sum_k lam(k/M) R(k),  G = sum_k lam(k/M) |k| R(k)   (k = -M..M),
    lam the flat-top lag window (1 up to 1/2, then linear to 0 at 1), and M twice
    the smallest lag after which K_N = 5 consecutive autocorrelations are
    insignificant (|rho| < 2 sqrt(log10(n) / n)). The constants are the authors'
    (their code's m-hat, one past the paper's). Capped at ceil(min(3 sqrt(n), n / 3)).
    A constant series needs no blocks: 1.

    widen: blocks of length b see V_b = sum_{|k|<b} (1 - |k|/b) R(k) of the long-run
    variance g (the bias -G/b the rule above trades against variance): at the chosen b
    that leaves intervals ~12% narrow for AR(1) 0.8 and 400 rounds, and 40 rows tested at
    once turn that into false stars. So deviations are scaled by sqrt(g / V_b), with the
    same flat-top g, clipped to [1, sqrt 2] (never narrower; a noisy g never more than
    doubles a variance).

    at_least: the blocks will be this long whatever the rule says (`group_along`); the
    widening is then that length's. multiple: the length rounded up to a multiple of it
    (runs of whole chunks, `cycle_chunk`); the widening again that length's.
    """
    return _blocks(x, max(1, at_least), multiple)


def _blocks(x: np.ndarray, at_least: int, multiple: int) -> Blocks:
    def up(b: int) -> int:
        return -(-b // multiple) * multiple

    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    n = len(x)
    if n < 8:
        return Blocks(up(at_least), 1.0)
    e = x - x.mean()
    kn = max(5, math.ceil(math.sqrt(math.log10(n))))
    m_max = min(math.ceil(math.sqrt(n)) + kn, n - 1)
    b_max = math.ceil(min(3 * math.sqrt(n), n / 3))
    # lags enough for any length this returns (rounded up to `multiple` too): one FFT, not two
    acov = _autocov(e, max(m_max, up(max(b_max, at_least))))
    if not acov[0] > 0:
        return Blocks(up(at_least), 1.0)
    rho = acov[1: m_max + 1] / acov[0]  # lags 1 .. m_max
    small = np.abs(rho) < 2 * math.sqrt(math.log10(n) / n)
    runs = np.convolve(small, np.ones(kn, dtype=np.int64), mode="valid")  # runs[j]: lags j+1 .. j+kn
    hit = np.flatnonzero(runs == kn)
    if len(hit):
        m_hat = int(hit[0]) + 1
    else:  # no run of insignificant lags: the last significant one
        sig = np.flatnonzero(~small)
        m_hat = int(sig[-1]) + 1 if len(sig) else 1
    big_m = min(2 * m_hat, m_max)
    k = np.arange(1, big_m + 1)
    lam = np.where(k / big_m <= 0.5, 1.0, 2 * (1 - k / big_m))
    g = acov[0] + 2 * float((lam * acov[1: big_m + 1]).sum())
    big_g = 2 * float((lam * k * acov[1: big_m + 1]).sum())
    if g <= 0:  # no spectral mass at 0 by this estimate: as long as allowed
        return Blocks(up(max(b_max, at_least)), 1.0)
    b = int(min(max(1, math.ceil((2 * big_g**2 / (4 / 3 * g**2)) ** (1 / 3) * n ** (1 / 3))), b_max))
    b = up(max(b, at_least))
    if b > len(acov):
        acov = _autocov(e, b)
    j = np.arange(1, b)
    v_b = acov[0] + 2 * float(((1 - j / b) * acov[1:b]).sum())
    widen = math.sqrt(min(max(g / v_b, 1.0), 2.0)) if v_b > 0 else math.sqrt(2)
    return Blocks(b, widen)


def widen(stats: dict[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """Each resample's deviation from the sample (row 0) scaled by `factor` (`Blocks.widen`)."""
    if factor == 1.0:
        return stats
    return {k: np.concatenate([v[:1], v[0] + factor * (v[1:] - v[0])]) for k, v in stats.items()}


def bootstrap(n: int, reps: int, rng: np.random.Generator, stats: Sequence[tuple[Stat, np.ndarray | None]],
              block: int = 1, order: np.ndarray | None = None) -> list[dict[str, np.ndarray]]:
    """Each `stat` over [the sample itself, reps resamples] of the *same* draws of n items.

    Each entry is (stat, cols): cols None gives the stat the draws as they are; an
    index array gives it `w[:, cols]`, the draws mapped onto its own items (paired
    traces: for each of B's requests, the row of A's request with the same id), so
    A and B see the same resampled workload. `order`: the sequence the blocks run
    along (position k holds item order[k]; requests in arrival order).
    Rows go through the stats in chunks of ~4M draw counts so memory stays bounded.
    """
    chunk = max(1, BLOCK_ELEMS // max(n, 1))  # resamples per pass
    parts: list[list[dict[str, np.ndarray]]] = [[] for _ in stats]
    for r0 in range(0, reps + 1, chunk):
        rows = min(chunk, reps + 1 - r0)
        w = resample_weights(n, rows - (r0 == 0), rng, block)
        if order is not None:
            placed = np.empty_like(w)
            placed[:, order] = w
            w = placed
        if r0 == 0:
            w = np.vstack([np.ones((1, n)), w])
        for out, (stat, cols) in zip(parts, stats, strict=True):
            out.append(stat(w if cols is None else w[:, cols]))
    return [{k: np.concatenate([p[k] for p in ps]) for k in ps[0]} if ps else {} for ps in parts]


def p_value(d: np.ndarray) -> float | None:
    """Two-sided bootstrap p-value of "no difference" from resampled differences `d`:
    twice the share of resamples on the far side of 0 (the smallest level at which
    the percentile interval would exclude 0), with the +1 of Davison & Hinkley so a
    finite number of resamples never claims p = 0. Where fewer than TAIL_MIN
    resamples lie beyond 0 the count cannot resolve p, and a normal fit to the
    resamples extrapolates the tail (never above the count's bound)."""
    d = d[np.isfinite(d)]
    r = len(d)
    if r == 0:
        return None
    far = int(min((d <= 0).sum(), (d >= 0).sum()))
    counted = min(1.0, 2 * (far + 1) / (r + 1))
    if far >= TAIL_MIN:
        return counted
    sd = float(d.std())
    if sd == 0:  # every resample the same non-zero difference: the count's bound is all we know
        return counted
    return min(counted, math.erfc(abs(float(d.mean())) / sd / math.sqrt(2)))


def bh_adjust(p: Iterable[float]) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values: row i is significant at FDR q iff adj[i] <= q."""
    pv = np.asarray(list(p), dtype=np.float64)
    m = len(pv)
    if m == 0:
        return pv
    order = np.argsort(pv, kind="stable")
    ranked = pv[order] * m / np.arange(1, m + 1)
    adj = np.minimum(np.minimum.accumulate(ranked[::-1])[::-1], 1.0)
    out = np.empty(m)
    out[order] = adj
    return out
