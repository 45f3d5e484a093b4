"""Throughput and latency, computed the way SGLang's bench_serving does:
  duration    first arrival .. last finish
  TTFT        first token - arrival, per request
  TPOT        (e2e - TTFT) / (output_len - 1), per request with >1 output token
  ITL         every gap between consecutive output tokens of a request, all requests pooled
  E2E         finish - arrival, per request
Percentiles are linear-interpolated (numpy's default)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from viewer.analysis.intervals import blocks


@dataclass(slots=True)
class Dist:
    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def weighted(cls, values: np.ndarray, weights: np.ndarray, scale: float | None = None,
                 overwrite: bool = False) -> Dist:
        """Exactly Dist.of(np.repeat(values, weights)) (the mean to rounding), without
        expanding the repeats. `scale`: `values` are integers, the distribution is of
        values * scale (each converted as `values.astype(float64) * scale` would), sorted as
        integers. `overwrite`: `values` and `weights` are the caller's to lose (like
        np.percentile's overwrite_input): reordered and overwritten in place, not copied (a
        long trace's rounds: two arrays of 107 MB)."""
        keep = weights > 0
        if overwrite:
            v, w = _compress_in_place(keep, values, weights)
        else:
            v, w = values[keep], weights[keep]
        del keep
        n = int(w.sum())
        if n == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        # in the rows' order (a sort orders ties as it likes, which would move the last
        # digit), a block at a time: float copies of a block, not of the arrays
        total = math.fsum(float(np.dot(v[b].astype(np.float64), w[b].astype(np.float64))) for b in blocks(len(v)))
        total *= 1.0 if scale is None else scale
        if scale is None:
            # ties are equal values: any order gives the same percentiles
            order = np.argsort(v)
            v, w = v[order], w[order]
        else:  # v and w are this function's own now (copies, or given up by the caller)
            v, w = _sort_pairs(v, w)
            f = v.view(np.float64)
            for b in blocks(len(v)):  # as astype(float64) * scale, in place (numpy copies an overlap)
                np.multiply(v[b], scale, out=f[b])
            v = f
        # in place where the weights are int64 (the caller's to lose, or a copy); a narrower
        # type would overflow
        cw = np.cumsum(w, out=w) if w.dtype == np.int64 else np.cumsum(w, dtype=np.int64)

        def at(k: int) -> float:  # the k-th smallest of the expanded multiset
            return float(v[np.searchsorted(cw, k, side="right")])

        vals = []
        for q in (50, 90, 99):
            p = (n - 1) * q / 100
            lo, hi = int(p), min(int(p) + 1, n - 1)
            vals.append(at(lo) + (at(hi) - at(lo)) * (p - lo))
        return cls(total / n, vals[0], vals[1], vals[2], n)

    @classmethod
    def of(cls, xs: np.ndarray, scale: float = 1.0) -> Dist:
        """Exact linear-interpolated percentiles; partitions `xs` in place (no copy)."""
        n = len(xs)
        if n == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        pos = [(n - 1) * q / 100 for q in (50, 90, 99)]
        kth = sorted({int(p) for p in pos} | {min(int(p) + 1, n - 1) for p in pos})
        xs.partition(kth)
        vals = []
        for p in pos:
            lo, hi = int(p), min(int(p) + 1, n - 1)
            vals.append((float(xs[lo]) + (float(xs[hi]) - float(xs[lo])) * (p - lo)) * scale)
        return cls(float(xs.mean()) * scale, vals[0], vals[1], vals[2], n)


def _sort_pairs(v: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer values and their weights, in value order. Where both fit, each pair is packed
    in one int64 and sorted as one (numpy's SIMD sort; an argsort of ten million values
    took 5-7x as long here), in place: `v` and `w` (both int64) are returned overwritten."""
    lo, hi, wmax = int(v.min()), int(v.max()), int(w.max())
    wbits = max(wmax.bit_length(), 1)
    if lo >= 0 and hi.bit_length() + wbits <= 63 and v.dtype == w.dtype == np.int64:
        key = v
        key <<= wbits
        key |= w
        key.sort()
        np.bitwise_and(key, (1 << wbits) - 1, out=w)
        key >>= wbits
        return key, w
    order = np.argsort(v)
    return v[order].astype(np.int64, copy=False), w[order].astype(np.int64, copy=False)


def _compress_in_place(keep: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each array's `keep` entries moved to its front, in order, a block at a time (a copy of
    a block, not of the array); returns those fronts (views)."""
    j = 0
    for b in blocks(len(keep)):
        k = keep[b]
        m = int(np.count_nonzero(k))
        for a in arrays:
            a[j:j + m] = a[b][k]  # j <= b.start: the block is read (copied) before it is written
        j += m
    return tuple(a[:j] for a in arrays)


@dataclass(slots=True)
class Serving:
    requests: int
    completed: int
    finish_reasons: dict[str, int]
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_per_s: float
    input_tok_per_s: float
    output_tok_per_s: float
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RequestTimes:
    """The requests columns the serving metrics read and the latencies they derive: one
    definition for the report and for diff's resampling (serving_boot), so both agree."""

    arrival: np.ndarray
    first: np.ndarray
    finish: np.ndarray
    out_len: np.ndarray
    in_len: np.ndarray
    served: np.ndarray  # got a first token
    multi: np.ndarray  # served with more than one output token (has a TPOT)

    @classmethod
    def of(cls, requests: pa.Table) -> RequestTimes:
        first, out_len = requests["first_token_ns"].to_numpy(), requests["output_len"].to_numpy()
        served = first > 0
        return cls(requests["arrival_ns"].to_numpy(), first, requests["finish_ns"].to_numpy(), out_len,
                   requests["prompt_len"].to_numpy(), served, served & (out_len > 1))

    def ttft_ms(self) -> np.ndarray:
        return np.asarray((self.first[self.served] - self.arrival[self.served]) / 1e6)

    def tpot_ms(self) -> np.ndarray:
        m = self.multi
        return np.asarray((self.finish[m] - self.first[m]) / 1e6 / (self.out_len[m] - 1))

    def e2e_ms(self) -> np.ndarray:
        return np.asarray((self.finish[self.served] - self.arrival[self.served]) / 1e6)


def serving_metrics(requests: pa.Table, itl: Dist | None = None) -> Serving:
    """`itl`: precomputed (see `itl_from_runs`), so a long trace never materialises
    its tens of millions of gaps; otherwise pooled from the dur_itl_ns lists."""
    n = requests.num_rows
    reasons: dict[str, int] = {}
    for row in pc.value_counts(requests["finish_reason"]).to_pylist() if n else []:
        reasons[row["values"]] = row["counts"]
    rt = RequestTimes.of(requests)
    served, out_len, in_len = rt.served, rt.out_len, rt.in_len
    duration = (rt.finish.max() - rt.arrival.min()) / 1e9 if n else 0.0  # empty after an early kill
    ttft, tpot, e2e = rt.ttft_ms(), rt.tpot_ms(), rt.e2e_ms()
    if itl is None:
        itl = Dist.of(inter_token_ms(requests["dur_itl_ns"].chunks))
    out_tok = int(out_len[served].sum())
    in_tok = int(in_len[served].sum())
    return Serving(
        requests=n,
        completed=int(served.sum()),
        finish_reasons=reasons,
        duration_s=float(duration),
        input_tokens=in_tok,
        output_tokens=out_tok,
        request_per_s=float(served.sum()) / duration if duration else 0.0,
        input_tok_per_s=in_tok / duration if duration else 0.0,
        output_tok_per_s=out_tok / duration if duration else 0.0,
        ttft_ms=Dist.of(ttft),
        tpot_ms=Dist.of(tpot),
        itl_ms=itl,
        e2e_ms=Dist.of(e2e),
        preemptions=int(pc.sum(requests["num_preemptions"]).as_py() or 0) if n else 0,
    )


def inter_token_ms(chunks: Iterable[pa.ListArray]) -> np.ndarray:
    """All requests' inter-token gaps (the dur_itl_ns lists), pooled, in ms as
    float32: tens of millions of values on a long trace, and float32 keeps 7
    significant digits, plenty for a percentile."""
    parts = []
    for chunk in chunks:
        flat = pc.list_flatten(chunk).to_numpy()
        if len(flat):
            parts.append((flat * 1e-6).astype(np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def itl_from_runs(runs: Iterable[pa.ListArray], step: np.ndarray, collect_ns: np.ndarray) -> Dist:
    """ITL pooled over all requests, exactly, from per-request token runs (see `itl_rounds`)."""
    return Dist.weighted(*itl_gaps_ns(runs, step, collect_ns)[:2], 1e-6, overwrite=True)


def itl_rounds(runs: Iterable[pa.ListArray], step: np.ndarray,
               collect_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`itl_gaps_ns` with the gaps in ms and the round each ends in (a step number)."""
    gaps, weights, extra_rounds = itl_gaps_ns(runs, step, collect_ns)
    base = int(step.min()) if len(step) else 0
    rounds = np.concatenate([np.arange(len(gaps) - len(extra_rounds), dtype=np.int64) + base, extra_rounds])
    return gaps.astype(np.float64) * 1e-6, weights, rounds


def itl_gaps_ns(runs: Iterable[pa.ListArray], step: np.ndarray,
                collect_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every inter-token gap, as (value ns, how many gaps have it), one per round from the
    first (the gap its collect time ends), then the gaps between two runs of one request,
    and those gaps' rounds (step numbers).

    Every token of a run [s0, s0 + n) was collected at the end of consecutive
    rounds, so the run's gaps are the collect-time intervals of rounds
    s0+1 .. s0+n-1: a difference array counts how many runs cover each round
    interval, and a weighted percentile over ~one value per round replaces tens
    of millions of per-token values. Gaps between two runs of one request
    (after a preemption or a skipped round) are added one by one. The round
    (a step number) is what `diff` resamples: every request decoding in a
    round shares that round's gap, so the round, not the request, carries its noise.
    """
    if not bool(np.all(step[1:] >= step[:-1])):  # one rank's rounds are written in order
        order = np.argsort(step)
        step, collect_ns = step[order], collect_ns[order]
    if len(step) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    base = int(step[0])
    c = np.zeros(int(step[-1]) - base + 2, dtype=np.int64)
    c[step - base] = collect_ns
    opens: list[np.ndarray] = []
    closes: list[np.ndarray] = []
    extra: list[np.ndarray] = []
    extra_round: list[np.ndarray] = []
    for chunk in runs:
        flat = pc.list_flatten(chunk).to_numpy()
        if not len(flat):
            continue
        s0, cnt = flat[0::2] - base, flat[1::2]
        # rounds s0+1 .. s0+cnt-1 each contribute one gap (c[i] - c[i-1])
        opens.append(s0 + 1)
        closes.append(s0 + cnt)
        # gaps between consecutive runs of the same request
        owner = np.repeat(np.arange(len(chunk)), pc.list_value_length(chunk).to_numpy() // 2)
        same = owner[1:] == owner[:-1]
        if same.any():
            end_prev = (s0 + cnt - 1)[:-1][same]
            start_next = s0[1:][same]
            extra.append(c[start_next] - c[end_prev])
            extra_round.append(start_next + base)
    # The gaps: one per round (its collect time less the one before), then those between runs
    # of one request; written where they end up (a long trace's rounds: 107 MB an array).
    m, ne = len(c), sum(len(e) for e in extra)
    vals = np.empty(m + ne, dtype=np.int64)
    vals[0] = 0
    np.subtract(c[1:], c[:-1], out=vals[1:m])
    del c
    vals[m:] = np.concatenate(extra) if extra else 0
    # how many runs cover each round: one bincount over every chunk's runs (not np.add.at,
    # nor a round-sized count per chunk)
    weights = np.empty(m + ne, dtype=np.int64)
    weights[m:] = 1
    if opens:
        cover = np.bincount(np.concatenate(opens), minlength=m + 1)
        del opens
        cover -= np.bincount(np.concatenate(closes), minlength=m + 1)
        del closes
        np.cumsum(cover[:m], out=weights[:m])
        del cover
    else:
        weights[:m] = 0
    return vals, weights, np.concatenate([np.zeros(0, np.int64), *extra_round])
