"""Did a change pay? Deltas between two traces, each with a bootstrap interval.

The seed article's method is a control group: the same workload in serial,
time-slice and overlap modes, compared. A single run is noisy, so every delta
here comes with a 95% percentile bootstrap interval, and a delta is flagged
`significant` only when that interval excludes 0:
  * cycle statistics (per-boundary ms/cycle, exposed share, hidden fraction,
    cycle time, device idle) resample *cycles* (`cost.per_cycle`), in circular
    blocks of about n^(1/3) consecutive cycles: neighbouring cycles share a batch
    composition and a machine state, so drawing them one by one would treat
    correlated cycles as independent and give intervals too narrow;
  * serving statistics (throughput, TTFT/TPOT/ITL/E2E mean and percentiles)
    resample *requests*; ITL pools every gap of the resampled requests.
A and B are resampled independently. Resamples are draw-count matrices
W (row r: how often each cycle/request was drawn), so a statistic over all
resamples is one matrix product, never a copy of the data; row 0 is all ones,
the sample itself, so the point estimate and the intervals come from the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from viewer.analysis.cost import CONCURRENT, ORDER, per_cycle

RESAMPLES = 1000
SEED = 0
BLOCK_ELEMS = 4_000_000
LEVEL = 0.95
QUANTILES = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
THROUGHPUT = ("output_tok_per_s", "input_tok_per_s", "request_per_s")


@dataclass(slots=True)
class Delta:
    a: float | None
    b: float | None
    delta: float | None  # b - a
    rel: float | None  # (b - a) / |a|
    ci_low: float | None  # 95% bootstrap percentile interval of b - a
    ci_high: float | None
    significant: bool  # the interval excludes 0


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
    idx = idx + (np.arange(reps) * n)[:, None]
    return np.bincount(idx.ravel(), minlength=reps * n).reshape(reps, n).astype(np.float64)


def cycle_block(n: int) -> int:
    """Block length for resampling n consecutive cycles (the usual n^(1/3) rule)."""
    return max(1, round(n ** (1 / 3)))


def bootstrap(n: int, reps: int, rng: np.random.Generator,
              stat: Callable[[np.ndarray], dict[str, np.ndarray]], block: int = 1) -> dict[str, np.ndarray]:
    """`stat` over [the sample itself, reps resamples] of n items: arrays of reps + 1 values.

    Row 0 (all ones) is the point estimate. Rows go through `stat` in chunks of
    ~4M draw counts so memory stays bounded on long traces.
    """
    chunk = max(1, BLOCK_ELEMS // max(n, 1))  # resamples per pass
    parts: list[dict[str, np.ndarray]] = []
    for r0 in range(0, reps + 1, chunk):
        rows = min(chunk, reps + 1 - r0)
        w = resample_weights(n, rows - (r0 == 0), rng, block)
        parts.append(stat(np.vstack([np.ones((1, n)), w]) if r0 == 0 else w))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def delta(sa: np.ndarray, sb: np.ndarray, level: float = LEVEL) -> Delta:
    """Delta of one statistic, given its values over [sample, resample 1, ...] for A and B."""
    a = float(sa[0]) if np.isfinite(sa[0]) else None
    b = float(sb[0]) if np.isfinite(sb[0]) else None
    if a is None or b is None:
        return Delta(a, b, None, None, None, None, False)
    d = sb[1:] - sa[1:]
    d = d[np.isfinite(d)]
    if not len(d):
        return Delta(a, b, b - a, (b - a) / abs(a) if a else None, None, None, False)
    tail = 100 * (1 - level) / 2
    lo, hi = (float(x) for x in np.percentile(d, [tail, 100 - tail]))
    return Delta(a, b, b - a, (b - a) / abs(a) if a else None, lo, hi, lo > 0 or hi < 0)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), np.nan)


def cycle_stats(pcy: dict[str, np.ndarray], w: np.ndarray) -> dict[str, np.ndarray]:
    """Cost-table statistics over each row of `w` (draw counts of cycles); same definitions as cost_table.

    Keys: cycle_ms, device_idle, and mean_ms:<b>, share:<b>, hidden:<b> for each boundary present.
    """
    if not pcy:
        return {}
    cols = {"cycle": pcy["cycle_ns"], "device": pcy["device_ns"]}
    for k in pcy:
        if k.startswith(("raw_ns:", "hidden_ns:", "exposed_ns:")):
            cols[k] = pcy[k]
    names = list(cols)
    sums = w @ np.column_stack([cols[k] for k in names])  # one product for every statistic
    s = {k: sums[:, i] for i, k in enumerate(names)}
    ncyc = w.sum(axis=1)
    out = {"cycle_ms": s["cycle"] / ncyc / 1e6, "device_idle": 1 - _ratio(s["device"], s["cycle"])}
    for b in ORDER:
        if f"raw_ns:{b}" not in s:
            continue
        out[f"mean_ms:{b}"] = s[f"raw_ns:{b}"] / ncyc / 1e6
        if f"exposed_ns:{b}" in s:
            out[f"share:{b}"] = _ratio(s[f"exposed_ns:{b}"], s["cycle"])
        if f"hidden_ns:{b}" in s:
            out[f"hidden:{b}"] = _ratio(s[f"hidden_ns:{b}"], s[f"raw_ns:{b}"])
    return out


def diff_cycles(probes_a: pa.Table, steps_a: pa.Table, probes_b: pa.Table, steps_b: pa.Table,
                reps: int = RESAMPLES, seed: int = SEED, colls_a: pa.Table | None = None,
                colls_b: pa.Table | None = None) -> dict[str, Any]:
    """cycle_ms, device_idle and per-boundary {mean_ms, share, hidden} deltas, resampling cycles.
    ``colls_*``: the collectives tables of TP runs (all_reduce's raw/hidden, see cost.per_cycle)."""
    stats = []
    for i, (p, s, c) in enumerate(((probes_a, steps_a, colls_a), (probes_b, steps_b, colls_b))):
        pcy = per_cycle(p, s, collectives=c)
        n = len(pcy.get("cycle_ns", ()))
        stats.append(bootstrap(n, reps, np.random.default_rng([seed, i]), lambda w, pcy=pcy: cycle_stats(pcy, w),
                               cycle_block(n)))
    sa, sb = stats
    none = np.full(reps + 1, np.nan)
    out: dict[str, Any] = {k: delta(sa.get(k, none), sb.get(k, none)) for k in ("cycle_ms", "device_idle")}
    present = {k.split(":", 1)[1] for k in (*sa, *sb) if k.startswith("mean_ms:")}
    out["boundaries"] = {}
    for b in ORDER:
        if b not in present:
            continue
        row = {m: delta(sa.get(f"{m}:{b}", none), sb.get(f"{m}:{b}", none)) for m in ("mean_ms", "share", "hidden")}
        if b in CONCURRENT:
            # off the scheduling thread: cycles are not its unit (tokenize runs before the
            # first cycle and would all be drawn with cycle 0), so no interval is claimed
            for d in row.values():
                d.ci_low = d.ci_high = None
                d.significant = False
        out["boundaries"][b] = row
    return out


def token_gaps(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Every gap between consecutive output tokens (ns, the dur_itl_ns lists) and its request row."""
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
    flat = pc.list_flatten(col).to_numpy()
    return flat, np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


class PooledDist:
    """mean/p50/p90/p99 of pooled values under resampling of their groups (requests).

    Prepared once (sorted values, per-chunk counts), then evaluated on blocks of
    draw-count rows. Exact without materialising any resample: each row's
    cumulative count per chunk of the sorted values is one matrix product, and
    only the chunk holding each wanted rank is scanned. Percentiles interpolate
    like Dist.of (numpy's linear).
    """

    def __init__(self, values: np.ndarray, owner: np.ndarray, groups: int, scale: float = 1.0,
                 step: int | None = None) -> None:
        order = np.argsort(values, kind="stable")
        self.v = values[order].astype(np.float64)
        self.g = owner[order].astype(np.int64)
        self.scale = scale
        n = len(self.v)
        # chunk size balancing the product (groups x chunks) against the scan (chunk
        # length per rank); at most 2048 chunks
        self.step = step or int(np.clip(np.sqrt(groups * n / 2000), 1, max(n, 1)))
        self.step = max(self.step, -(-n // 2048))
        self.k = -(-n // self.step) if n else 0
        counts = np.bincount(self.g * self.k + np.arange(n) // self.step, minlength=groups * self.k)
        # per group: value count, value sum, cumulative count through each chunk; `w @ columns`
        # gives every resample's n, sum and per-chunk cumulative counts at once
        self.columns = np.column_stack([np.bincount(self.g, minlength=groups),
                                        np.bincount(self.g, weights=self.v, minlength=groups),
                                        np.cumsum(counts.reshape(groups, self.k), axis=1)]).astype(np.float64)

    def __call__(self, w: np.ndarray, sums: np.ndarray | None = None,
                 wi: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """`sums` (= w @ self.columns) and `wi` (= w as int32) may be passed in, computed once
        for several distributions over the same draws."""
        reps, g_n = w.shape[0], len(self.v)
        if g_n == 0:
            return {k: np.full(reps, np.nan) for k in ("mean", *(f"p{q}" for q in QUANTILES))}
        sums = w @ self.columns if sums is None else sums
        n, cum = sums[:, 0], sums[:, 2:]  # values in each resample; count through the end of each chunk
        out = {"mean": _ratio(sums[:, 1], n) * self.scale}
        last = np.maximum(n - 1, 0).astype(np.int64)[:, None]
        pos = last * np.array(QUANTILES) / 100  # as Dist.of: (n - 1) * q / 100
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, last)
        rows = np.broadcast_to(np.arange(reps)[:, None], lo.shape).ravel()
        wi = w.astype(np.int32) if wi is None else wi  # draw counts are small integers: narrower gathers
        at_lo, at_hi = self._locate(wi, cum, rows, lo.ravel(), hi.ravel())
        missed = at_hi < 0  # hi fell past the chunk that holds lo: look it up on its own
        if missed.any():
            at_hi[missed] = self._locate(wi, cum, rows[missed], hi.ravel()[missed])[0]
        vlo, vhi = self.v[at_lo].reshape(lo.shape), self.v[at_hi].reshape(lo.shape)
        pct = (vlo + (vhi - vlo) * (pos - lo)) * self.scale
        pct[n == 0] = np.nan
        for i, q in enumerate(QUANTILES):
            out[f"p{q}"] = pct[:, i]
        return out

    def _locate(self, wi: np.ndarray, cum: np.ndarray, rows: np.ndarray, ranks: np.ndarray,
                ranks2: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sorted position of the value at `ranks` (0-based) in each row's resample; also of
        `ranks2` (>= ranks) where it lies in the same chunk, else -1."""
        g_n, step, k = len(self.v), self.step, self.k
        # chunk holding each rank = number of chunks whose count is <= the rank; one
        # searchsorted over all rows at once, each row shifted past the previous one
        shift = cum[:, -1].max() + 1
        flat = (cum + (np.arange(len(cum)) * shift)[:, None]).ravel()
        c = np.searchsorted(flat, ranks + rows * shift, side="right") - rows * k
        c = np.minimum(c, k - 1)  # only for empty resamples (their values are dropped)
        at, at2 = np.empty(len(ranks), np.int64), np.full(len(ranks), -1, np.int64)
        span = max(1, 2_000_000 // step)  # bounded memory: span queries x step at a time
        for q0 in range(0, len(ranks), span):
            sl = slice(q0, q0 + span)
            cq, rq = c[sl], rows[sl]
            prior = np.where(cq > 0, cum[rq, np.maximum(cq - 1, 0)], 0.0).astype(np.int64)
            idx = cq[:, None] * step + np.arange(step)
            cnt = np.where(idx < g_n, wi[rq[:, None], self.g[np.minimum(idx, g_n - 1)]], 0)
            cw = prior[:, None] + np.cumsum(cnt, axis=1)
            # first position whose cumulative count passes the rank
            j = (cw <= ranks[sl][:, None]).sum(axis=1)
            at[sl] = np.minimum(cq * step + j, g_n - 1)
            if ranks2 is not None:
                j2 = (cw <= ranks2[sl][:, None]).sum(axis=1)
                at2[sl] = np.where(j2 < step, np.minimum(cq * step + j2, g_n - 1), -1)
        return at, at2


class RequestStats:
    """serving_metrics' throughput and latency, as a function of request draw counts.

    Called on (rows, requests) draw counts; returns output_tok_per_s,
    input_tok_per_s, request_per_s and <latency>:<mean|p50|p90|p99>, one value per row.
    """

    def __init__(self, requests: pa.Table) -> None:
        self.n = requests.num_rows
        arrival = requests["arrival_ns"].to_numpy()
        first = requests["first_token_ns"].to_numpy()
        finish = requests["finish_ns"].to_numpy()
        out_len = requests["output_len"].to_numpy()
        in_len = requests["prompt_len"].to_numpy()
        served = first > 0
        self.arrival, self.finish = arrival.astype(np.float64), finish.astype(np.float64)
        self.tokens = np.column_stack([np.where(served, out_len, 0), np.where(served, in_len, 0),
                                       served]).astype(np.float64)
        rows = np.arange(self.n)
        multi = served & (out_len > 1)
        gaps, gap_owner = token_gaps(requests["dur_itl_ns"])
        self.series = {  # the same expressions as serving_metrics, so row 0 reproduces the report
            "ttft_ms": PooledDist((first[served] - arrival[served]) / 1e6, rows[served], self.n),
            "tpot_ms": PooledDist((finish[multi] - first[multi]) / 1e6 / (out_len[multi] - 1), rows[multi],
                                  self.n),
            "itl_ms": PooledDist(gaps, gap_owner, self.n, 1e-6),
            "e2e_ms": PooledDist((finish[served] - arrival[served]) / 1e6, rows[served], self.n),
        }
        # one matrix product per block for everything: on a busy machine each BLAS call
        # costs milliseconds of thread hand-off whatever its size
        self.columns = np.column_stack([self.tokens, *(d.columns for d in self.series.values())])
        self.cuts = np.cumsum([self.tokens.shape[1], *(d.columns.shape[1] for d in self.series.values())])

    def __call__(self, w: np.ndarray) -> dict[str, np.ndarray]:
        drawn = w > 0
        # a resample's duration is its own first arrival .. last finish, as for the sample
        dur = (np.where(drawn, self.finish, -np.inf).max(axis=1)
               - np.where(drawn, self.arrival, np.inf).min(axis=1)) / 1e9
        tok, *sums = np.split(w @ self.columns, self.cuts[:-1], axis=1)
        wi = w.astype(np.int32)
        out = {k: _ratio(tok[:, i], dur) for i, k in enumerate(THROUGHPUT)}
        for (name, dist), s in zip(self.series.items(), sums, strict=True):
            for k, arr in dist(w, s, wi).items():
                out[f"{name}:{k}"] = arr
        return out


def diff_requests(req_a: pa.Table, req_b: pa.Table, reps: int = RESAMPLES,
                  seed: int = SEED) -> dict[str, Any]:
    """Throughput and latency deltas, resampling requests."""
    sa, sb = ({} if not t.num_rows else bootstrap(t.num_rows, reps, np.random.default_rng([seed, 2 + i]),
                                                   RequestStats(t)) for i, t in enumerate((req_a, req_b)))
    none = np.full(reps + 1, np.nan)
    return {
        "throughput": {k: delta(sa.get(k, none), sb.get(k, none)) for k in THROUGHPUT},
        "latency": {lat: {k: delta(sa.get(f"{lat}:{k}", none), sb.get(f"{lat}:{k}", none))
                          for k in ("mean", *(f"p{q}" for q in QUANTILES))} for lat in LATENCIES},
    }


def trace_warnings(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[str]:
    """What makes A and B not a fair control group (a different mode is the point, so not that)."""
    out = []
    wa, wb = (m.get("workload", {}).get("digest") for m in (meta_a, meta_b))
    if wa is None or wb is None:
        out.append("a trace has no workload digest: cannot tell whether both ran the same workload")
    elif wa != wb:
        out.append(f"the two traces ran different workloads (digest {wa[:12]} vs {wb[:12]})")
    ma, mb = meta_a.get("model", {}), meta_b.get("model", {})
    differ = [f"{k} {ma.get(k)} vs {mb.get(k)}" for k in ("name", "path", "architecture") if ma.get(k) != mb.get(k)]
    if differ:
        out.append("the two traces ran different models: " + "; ".join(differ))
    da, db = (m.get("host", {}).get("device") for m in (meta_a, meta_b))
    if da != db:
        out.append(f"the two traces ran on different devices ({da} vs {db})")
    return out
