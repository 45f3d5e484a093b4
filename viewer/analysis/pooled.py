"""Pooled mean and percentiles under resampling of the groups that own the values.

`diff` resamples units (requests, rounds) and needs, for every resample, the
mean/p50/p90/p99 of all values their units own, pooled. Materialising each
resample would copy the values a thousand times; `PooledDist` computes the
same numbers from one matrix product per block of resamples.
"""

from __future__ import annotations

import numpy as np

QUANTILES = (50, 90, 99)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), np.nan)


class PooledDist:
    """mean/p50/p90/p99 of pooled values under resampling of their groups.

    Groups are what is resampled: requests for TTFT and E2E, rounds for ITL
    (every request decoding in a round shares its gap, so `mult` gives each
    value how many times its group holds it: a round's gap once per request).
    Prepared once (sorted values, per-chunk counts), then evaluated on blocks of
    draw-count rows. Exact without materialising any resample: the sorted values
    are cut in chunks of `step`, and `fan` chunks make a coarse chunk. Each row's
    cumulative count through every coarse chunk is one matrix product; then, for
    each coarse chunk that holds a wanted rank in some row, its chunks' counts
    (another product, of that chunk's columns only); then only the chunk holding
    each wanted rank is scanned. A resample's percentiles lie close to the
    sample's, so few coarse chunks are ever opened: on 20,000 groups of 620 k
    values, half the products and scans of one level of chunks. Percentiles
    interpolate like Dist.of (numpy's linear).
    """

    def __init__(self, values: np.ndarray, owner: np.ndarray, groups: int, scale: float = 1.0,
                 step: int | None = None, mult: np.ndarray | None = None, fan: int | None = None) -> None:
        # not a stable sort (3x slower on a million floats): tied values are one value wherever
        # they fall, and a group's sum of them is the same to rounding
        order = np.argsort(values)
        # (the gathers are copies already; groups and multiplicities fit 32 bits)
        self.v = values[order].astype(np.float64, copy=False)
        self.g = owner[order].astype(np.int64 if groups >= 2**31 else np.int32, copy=False)
        self.m = None if mult is None else mult[order].astype(np.int64, copy=False)
        self.scale = scale
        self.groups = groups
        n = len(self.v)
        # Sizes balancing the products (a multiply-add per group and column, ~0.03 ns) against
        # the scans (a gather per value of the chunk, ~130 times that) for the six ranks a row
        # asks for, each coarse chunk they open costing `fan` columns: the two costs' sum is
        # least near these sizes (on 4,850 groups of 620 k values, a half or a quarter of the
        # step, with wider fans, cost as much or up to 1.5x).
        self.step = step or int(np.clip(round((groups * np.sqrt(6 * n) / 780) ** (2 / 3)), 1, max(n, 1)))
        self.fan = fan or int(np.clip(round(np.sqrt(n / (6 * self.step))), 1, 64))
        self.k = -(-n // self.step) if n else 0  # chunks
        self.kc = -(-self.k // self.fan) if n else 0  # coarse chunks
        m = None if self.m is None else self.m.astype(np.float64)
        span = self.step * self.fan
        counts = np.bincount(self.g.astype(np.int64) * self.kc + np.arange(n) // span, weights=m, minlength=groups * self.kc)
        # per group: value count, value sum, cumulative count through each coarse chunk; `w @ columns`
        # gives every resample's n, sum and per-coarse-chunk cumulative counts at once
        self.columns = np.column_stack([np.bincount(self.g, weights=m, minlength=groups),
                                        np.bincount(self.g, weights=self.v * (1 if m is None else m),
                                                    minlength=groups),
                                        np.cumsum(counts.reshape(groups, self.kc), axis=1)]).astype(np.float64)
        self._fine: dict[int, np.ndarray] = {}

    def __call__(self, w: np.ndarray, sums: np.ndarray | None = None,
                 wi: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """`sums` (= w @ self.columns) and `wi` (= w as int32) may be passed in, computed once
        for several distributions over the same draws."""
        reps, g_n = w.shape[0], len(self.v)
        if g_n == 0:
            return {k: np.full(reps, np.nan) for k in ("mean", *(f"p{q}" for q in QUANTILES))}
        sums = w @ self.columns if sums is None else sums
        n, cum = sums[:, 0], sums[:, 2:]  # values in each resample; count through the end of each coarse chunk
        out = {"mean": _ratio(sums[:, 1], n) * self.scale}
        last = np.maximum(n - 1, 0).astype(np.int64)[:, None]
        pos = last * np.array(QUANTILES) / 100  # as Dist.of: (n - 1) * q / 100
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, last)
        rows = np.broadcast_to(np.arange(reps)[:, None], lo.shape).ravel()
        wi = w.astype(np.int32) if wi is None else wi  # draw counts are small integers: narrower gathers
        at_lo, at_hi = self._locate(w, wi, cum, rows, lo.ravel(), hi.ravel())
        missed = at_hi < 0  # hi fell past the chunk that holds lo: look it up on its own
        if missed.any():
            at_hi[missed] = self._locate(w, wi, cum, rows[missed], hi.ravel()[missed])[0]
        vlo, vhi = self.v[at_lo].reshape(lo.shape), self.v[at_hi].reshape(lo.shape)
        pct = (vlo + (vhi - vlo) * (pos - lo)) * self.scale
        pct[n == 0] = np.nan
        for i, q in enumerate(QUANTILES):
            out[f"p{q}"] = pct[:, i]
        return out

    def _fine_columns(self, c: int) -> np.ndarray:
        """Per group, the cumulative count through each chunk of coarse chunk c (from its start)."""
        got = self._fine.get(c)
        if got is None:
            span = self.step * self.fan
            sl = slice(c * span, min((c + 1) * span, len(self.v)))
            fan = -(-(sl.stop - sl.start) // self.step)
            local = np.arange(sl.stop - sl.start) // self.step
            counts = np.bincount(self.g[sl].astype(np.int64) * fan + local, minlength=self.groups * fan,
                                 weights=None if self.m is None else self.m[sl].astype(np.float64))
            got = self._fine[c] = np.cumsum(counts.reshape(self.groups, fan), axis=1).astype(np.float64)
        return got

    def _chunks(self, w: np.ndarray, cum: np.ndarray, rows: np.ndarray,
                ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chunk holding each rank (0-based) in its row's resample, and the row's count
        before that chunk."""
        # coarse chunk = number of coarse chunks whose count is <= the rank; one searchsorted
        # over all rows at once, each row shifted past the previous one
        kc = self.kc
        shift = cum[:, -1].max() + 1
        flat = (cum + (np.arange(len(cum)) * shift)[:, None]).ravel()
        cc = np.minimum(np.searchsorted(flat, ranks + rows * shift, side="right") - rows * kc, kc - 1)
        before = np.where(cc > 0, cum[rows, np.maximum(cc - 1, 0)], 0.0)  # (only empty resamples hit kc - 1 past their end)
        chunk, prior = np.empty(len(ranks), np.int64), np.empty(len(ranks))
        opened = np.unique(cc)
        fine = [self._fine_columns(int(c)) for c in opened]
        # every opened coarse chunk's columns in one product: the draws are read once (each
        # product on its own read all of them again, and that was most of its cost); only
        # the rows asked for, where they are few (a look-up of the ranks the first one missed)
        need, at = np.unique(rows, return_inverse=True)
        few = 2 * len(need) < len(w)
        counts = (w[need] if few else w) @ (fine[0] if len(fine) == 1 else np.hstack(fine))
        row_of = at if few else rows
        off = 0
        for c, cols in zip(opened, fine, strict=True):
            q = np.flatnonzero(cc == c)
            run = before[q][:, None] + counts[row_of[q], off:off + cols.shape[1]]
            f = np.minimum((run <= ranks[q][:, None]).sum(axis=1), cols.shape[1] - 1)
            chunk[q] = c * self.fan + f
            prior[q] = np.where(f > 0, run[np.arange(len(q)), np.maximum(f - 1, 0)], before[q])
            off += cols.shape[1]
        return chunk, prior

    def _locate(self, w: np.ndarray, wi: np.ndarray, cum: np.ndarray, rows: np.ndarray, ranks: np.ndarray,
                ranks2: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sorted position of the value at `ranks` (0-based) in each row's resample; also of
        `ranks2` (>= ranks) where it lies in the same chunk, else -1."""
        g_n, step = len(self.v), self.step
        c, prior_all = self._chunks(w, cum, rows, ranks)
        flat, width = np.ascontiguousarray(wi).ravel(), wi.shape[1]  # flat gathers: 2-3x a 2-D index's speed
        at, at2 = np.empty(len(ranks), np.int64), np.full(len(ranks), -1, np.int64)
        span = max(1, 2_000_000 // step)  # bounded memory: span queries x step at a time
        for q0 in range(0, len(ranks), span):
            sl = slice(q0, q0 + span)
            cq, rq = c[sl], rows[sl]
            prior = prior_all[sl].astype(np.int64)
            idx = cq[:, None] * step + np.arange(step)
            at_v = np.minimum(idx, g_n - 1)
            cnt = np.where(idx < g_n, flat[(rq * width)[:, None] + self.g[at_v]], 0)
            if self.m is not None:
                cnt = cnt * self.m[at_v]
            cw = prior[:, None] + np.cumsum(cnt, axis=1)
            # first position whose cumulative count passes the rank
            j = (cw <= ranks[sl][:, None]).sum(axis=1)
            at[sl] = np.minimum(cq * step + j, g_n - 1)
            if ranks2 is not None:
                j2 = (cw <= ranks2[sl][:, None]).sum(axis=1)
                at2[sl] = np.where(j2 < step, np.minimum(cq * step + j2, g_n - 1), -1)
        return at, at2
