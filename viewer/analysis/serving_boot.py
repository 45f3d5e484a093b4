"""`diff`'s serving rows resampled by request: throughput, TTFT, TPOT, E2E.

Requests are drawn in circular blocks along their arrival order (requests that
arrive together queue together, so neighbours are not independent), with the
Politis-White block length of their E2E series. When A and B ran the same
workload, each resample draws the same requests for both: request i's own
length and position in the queue are the same on both sides, so only how each
run served it is left in the difference. ITL is resampled by round instead
(viewer/analysis/diff.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from viewer.analysis.bootstrap import blocks, bootstrap, group_along, shortest_block, widen
from viewer.analysis.delta import delta, fdr
from viewer.analysis.pooled import QUANTILES, PooledDist, _ratio
from viewer.analysis.serving import RequestTimes

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
THROUGHPUT = ("output_tok_per_s", "input_tok_per_s", "request_per_s")
BY_REQUEST = ("ttft_ms", "tpot_ms", "e2e_ms")  # ITL's unit is the round


class RequestStats:
    """serving_metrics' throughput and per-request latencies, as a function of request draw counts.

    Called on (rows, requests) draw counts; returns output_tok_per_s, input_tok_per_s,
    request_per_s and <ttft_ms|tpot_ms|e2e_ms>:<mean|p50|p90|p99>, one value per row.
    """

    def __init__(self, rt: RequestTimes, group: np.ndarray | None = None, groups: int = 0) -> None:
        """`group`: each request's run of requests, drawn whole (`bootstrap.group_along`),
        `groups` of them; the draws are then of runs."""
        served, arrival = rt.served, rt.arrival
        rows = np.arange(len(arrival))
        self.n: int = len(arrival) if group is None else groups
        owner = rows if group is None else group
        self.arrival, self.finish = np.full(self.n, np.inf), np.full(self.n, -np.inf)
        np.minimum.at(self.arrival, owner, arrival.astype(np.float64))
        np.maximum.at(self.finish, owner, rt.finish.astype(np.float64))
        # the groups by arrival, and by finish from the last: a resample's first arrival is its
        # first drawn group's in the one order, its last finish its first drawn one's in the other
        self.by_arrival = np.argsort(self.arrival, kind="stable")
        self.by_finish = np.argsort(-self.finish, kind="stable")
        self.tokens = np.column_stack([np.bincount(owner, weights=x, minlength=self.n)
                                       for x in (np.where(served, rt.out_len, 0), np.where(served, rt.in_len, 0),
                                                 served)]).astype(np.float64)
        self.series = {  # serving_metrics' own definitions, so row 0 reproduces the report
            "ttft_ms": PooledDist(rt.ttft_ms(), owner[served], self.n),
            "tpot_ms": PooledDist(rt.tpot_ms(), owner[rt.multi], self.n),
            "e2e_ms": PooledDist(rt.e2e_ms(), owner[served], self.n),
        }
        # one matrix product per block for everything: on a busy machine each BLAS call
        # costs milliseconds of thread hand-off whatever its size
        self.columns = np.column_stack([self.tokens, *(d.columns for d in self.series.values())])
        self.cuts = np.cumsum([self.tokens.shape[1], *(d.columns.shape[1] for d in self.series.values())])

    def __call__(self, w: np.ndarray) -> dict[str, np.ndarray]:
        drawn = w > 0
        # a resample's duration is its own first arrival .. last finish, as for the sample
        # (found with a bool gather and a scan that stops at the first draw: two float passes
        # over every row took a quarter of this call)
        some = drawn.any(axis=1)
        first = np.where(some, self.arrival[self.by_arrival[drawn[:, self.by_arrival].argmax(axis=1)]], np.inf)
        last = np.where(some, self.finish[self.by_finish[drawn[:, self.by_finish].argmax(axis=1)]], -np.inf)
        dur = (last - first) / 1e9
        tok, *sums = np.split(w @ self.columns, self.cuts[:-1], axis=1)
        wi = w.astype(np.int32)
        out = {k: _ratio(tok[:, i], dur) for i, k in enumerate(THROUGHPUT)}
        for (name, dist), s in zip(self.series.items(), sums, strict=True):
            for k, arr in dist(w, s, wi).items():
                out[f"{name}:{k}"] = arr
        return out


def sequence(rt: RequestTimes) -> tuple[np.ndarray, np.ndarray]:
    """The requests' arrival order (ties, a burst at t = 0, by row: the sequence blocks run
    along) and each one's E2E in ms (NaN where never served)."""
    return (np.argsort(rt.arrival, kind="stable"),
            np.where(rt.served, (rt.finish - rt.arrival) / 1e6, np.nan))


def workload_digest(meta: dict[str, Any] | None) -> str | None:
    """The digest of the workload a trace ran, None where none was known up front: a served
    run's is whatever arrived (traces from before that was recorded as null carry the empty
    workload's digest, which every served run shared)."""
    w = (meta or {}).get("workload", {})
    return None if str(w.get("source", "")).startswith("serve:") else w.get("digest")


def may_pair(meta_a: dict[str, Any] | None, meta_b: dict[str, Any] | None) -> bool:
    """Whether two traces' metadata allow them one workload (their digests, where both have
    one, equal): only then are their requests paired, and their ids read."""
    da, db = (workload_digest(m) for m in (meta_a, meta_b))
    return da is None or db is None or da == db


def pairing(req_a: pa.Table, req_b: pa.Table, meta_a: dict[str, Any] | None = None,
            meta_b: dict[str, Any] | None = None) -> tuple[np.ndarray | None, str]:
    """For each of B's requests, the row of A's request with the same id (each of A's rows
    once), when both ran the same workload; else None. With the reason, for the output.
    (Ids are unique in every trace mstrace writes; where an id repeats, equal ids may still
    pair one to one, or the pairing fails and the sides are drawn independently.)"""
    if not may_pair(meta_a, meta_b):
        return None, "the traces ran different workloads"
    if "request_id" not in req_a.column_names or "request_id" not in req_b.column_names:
        return None, "a trace has no request ids"
    ia, ib = (_ids(t["request_id"]) for t in (req_a, req_b))
    if ia.null_count or ib.null_count:
        return None, "a trace has requests without ids"
    differ = None, "the traces did not finish the same requests"
    if len(ia) != len(ib) or not len(ia) or ia.type != ib.type:  # ("1" is not 1)
        return differ
    # Two runs of one workload finish most requests in the same order: those rows pair in
    # place, and only the others are hashed (in Arrow: a Python dict of a long trace's 620 k
    # ids took 0.9 s, all of them in Arrow 0.2 s).
    pair = np.arange(len(ia))
    rest = np.flatnonzero(~pc.equal(ia, ib).to_numpy(zero_copy_only=False))
    if len(rest):
        at = pc.index_in(ib.take(rest), value_set=ia.take(rest).combine_chunks())
        if at.null_count:  # an id of B's that A never finished
            return differ
        pair[rest] = rest[at.to_numpy()]
    # each of A's rows once (an id A repeats maps to its first row only, so with as many rows
    # as B another row is hit twice)
    if np.bincount(pair, minlength=len(ia)).max() != 1:
        return differ
    return pair, "same workload"


def _ids(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Request ids as plain values of one type per kind (dictionary-decoded; strings as
    `string`, integers as `int64`), so two traces' ids compare by value."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    if pa.types.is_integer(col.type):
        return col.cast(pa.int64())
    return col


def diff_requests(req_a: pa.Table, req_b: pa.Table, meta_a: dict[str, Any] | None = None,
                  meta_b: dict[str, Any] | None = None, reps: int = 1000, seed: int = 0,
                  round_scale: tuple[np.ndarray | None, np.ndarray | None] = (None, None)) -> dict[str, Any]:
    """Throughput and per-request latency deltas, resampling requests (paired when A and B
    ran the same workload). "resampling" says how.

    round_scale: per side, each resample's mean round length over the sample's (from the
    cycle bootstrap, `diff.cycle_boot`). A run's duration and every request's latency are
    sums of round lengths, so much of their noise lives in the rounds, and requests alone
    leave it out: two runs of one workload, paired, differ by the same few rounds in every
    request (all requests of a burst share them), which would give intervals of near-zero
    width around whatever the two runs happened to differ by. Each resample's throughput
    is divided by its side's factor and its latencies multiplied by it, adding that noise.
    """
    return request_deltas(*request_boot(req_a, req_b, meta_a, meta_b, reps, seed), reps, round_scale)


Stats = dict[str, np.ndarray]
RequestDraws = tuple[Stats, Stats, dict[str, Any]]  # A's resamples, B's, and how they were drawn


def request_boot(req_a: pa.Table, req_b: pa.Table, meta_a: dict[str, Any] | None = None,
                 meta_b: dict[str, Any] | None = None, reps: int = 1000, seed: int = 0) -> RequestDraws:
    """`diff_requests`' resamples of each side (unscaled: they need no rounds), and how they
    were drawn."""
    pair, why = pairing(req_a, req_b, meta_a, meta_b)
    ta, tb = RequestTimes.of(req_a), RequestTimes.of(req_b)
    (oa, ea), (ob, eb) = sequence(ta), sequence(tb)
    info: dict[str, Any]
    if pair is not None:
        # the block length of what is left after pairing: B's E2E minus A's, request by request
        inverse = np.empty_like(pair)  # pair's inverse permutation (no sort: it is one)
        inverse[pair] = np.arange(len(pair))
        series = (eb - ea[pair])[inverse][oa]
        n = req_a.num_rows
        bl = blocks(series, shortest_block(n, pooled=True))
        grouped = group_along(n, bl.length, oa, pooled=True)
        info = {"unit": "requests", "paired": True, "why": why, "n": n}
        stats: list[tuple[RequestStats, np.ndarray | None]]
        along: np.ndarray | None
        if grouped is None:
            items, block, along = n, bl.length, oa
            stats = [(RequestStats(ta), None), (RequestStats(tb), pair)]
        else:  # runs of A's arrival order, each drawn whole, B's requests in their A twin's run
            group, items = grouped
            block, along = 1, None
            stats = [(RequestStats(ta, group, items), None), (RequestStats(tb, group[pair], items), None)]
            info["runs"] = items
            del group, grouped
        del ta, tb, ea, eb, series, inverse  # the stats hold their own (6 M requests: 0.4 GB a side)
        sa, sb = (widen(x, bl.widen) for x in bootstrap(items, reps, np.random.default_rng([seed, 2]),
                                                        stats, block, along))
        info.update(block=bl.length, widen=round(bl.widen, 3))
    else:
        sides, info = [], {"unit": "requests", "paired": False, "why": why}
        for i, (rt, order, e2e) in enumerate(((ta, oa, ea), (tb, ob, eb))):
            n = len(rt.arrival)
            bl = blocks(e2e[order], shortest_block(n, pooled=True))
            info["ab"[i]] = {"n": n}
            grouped = group_along(n, bl.length, order, pooled=True)
            if grouped is None:
                r, items, block, along = RequestStats(rt), n, bl.length, order
            else:
                items = grouped[1]
                r, block, along = RequestStats(rt, grouped[0], items), 1, None
                info["ab"[i]]["runs"] = items
            info["ab"[i]].update(block=bl.length, widen=round(bl.widen, 3))
            rng = np.random.default_rng([seed, 2 + i])
            sides.append({} if not n else
                         widen(bootstrap(items, reps, rng, [(r, None)], block, along)[0], bl.widen))
        sa, sb = sides
    return sa, sb, info


def request_deltas(sa: Stats, sb: Stats, info: dict[str, Any], reps: int,
                   round_scale: tuple[np.ndarray | None, np.ndarray | None] = (None, None)) -> dict[str, Any]:
    """`diff_requests` from `request_boot`'s resamples, scaled by each side's rounds."""
    for side, scale in zip((sa, sb), round_scale, strict=True):
        if scale is None or not side:
            continue
        for k in side:
            side[k] = side[k] / scale if k in THROUGHPUT else side[k] * scale
    none = np.full(reps + 1, np.nan)
    out: dict[str, Any] = {
        "throughput": {k: delta(sa.get(k, none), sb.get(k, none)) for k in THROUGHPUT},
        "latency": {lat: {k: delta(sa.get(f"{lat}:{k}", none), sb.get(f"{lat}:{k}", none))
                          for k in ("mean", *(f"p{q}" for q in QUANTILES))} for lat in BY_REQUEST},
    }
    fdr(out)
    out["resampling"] = info
    return out
