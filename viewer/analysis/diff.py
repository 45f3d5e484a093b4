"""Did a change pay? Deltas between two traces, each with a bootstrap interval and p-value.

The seed article's method is a control group: the same workload in serial,
time-slice and overlap modes, compared. Every delta here comes with a 95%
bootstrap percentile interval and a two-sided bootstrap p-value; a delta is
`significant` when it survives Benjamini-Hochberg at q = 0.05 over every row
with an interval (some forty rows are tested at once, so an uncorrected 5%
would star two of them by chance in every diff). What is resampled is the unit
that carries the noise:
  * cost rows and cycle time: *cycles* (`cost.per_cycle`), in circular blocks
    whose length the Politis-White rule picks from the cycle-length series
    (neighbouring cycles share a batch composition and a machine state);
  * ITL: *rounds*. A round's collect-to-collect gap is the gap of every request
    decoding in it, so resampling requests would redraw the same few values and
    give intervals of zero width;
  * throughput, TTFT, TPOT, E2E: *requests*, in arrival order and blocks. When
    both traces ran the same workload (same request ids, same digest) each
    resample draws the same requests for A and B, so what the workload itself
    contributes cancels (a trace against itself: zero width); otherwise A and B
    are drawn independently, and the output says so.
Cycles and rounds of two runs are never paired: round i of A and of B hold
different batches once their timings differ.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracing.reader import Trace
from viewer.analysis import cost
from viewer.analysis.bootstrap import blocks, bootstrap, group_along, shortest_block, widen
from viewer.analysis.cycle_views import CONCURRENT, per_cycle
from viewer.analysis.delta import FDR_Q, LEVEL, Delta, delta, fdr
from viewer.analysis.intervals import search
from viewer.analysis.pooled import QUANTILES, PooledDist, _ratio
from viewer.analysis.records import JsonRecord
from viewer.analysis.report import REQUEST_COLUMNS, ReportResult, build_report, load_inputs
from viewer.analysis.serving import itl_rounds
from viewer.analysis.serving_boot import (
    LATENCIES,
    THROUGHPUT,
    RequestDraws,
    diff_requests,
    may_pair,
    pairing,
    request_boot,
    request_deltas,
    workload_digest,
)

RESAMPLES = 1000
SEED = 0
# Per-boundary metrics, named as `report --json` names them: the rows' own ms per cycle (no
# view), device-view share, hidden fraction, host-view share.
METRICS = ("raw_ms_per_cycle", "device_share", "hidden", "host_share")
__all__ = ["FDR_Q", "LATENCIES", "LEVEL", "METRICS", "QUANTILES", "RESAMPLES", "SEED", "THROUGHPUT", "Delta",
           "Deltas", "DiffResult", "DiffSide", "OwnDraws", "Side", "build_diff", "compare", "cycle_stats", "delta", "diff_cycles",
           "diff_itl", "diff_requests", "fdr", "itl_boot", "pairing", "place_of_b",
           "trace_warnings"]


@dataclass(slots=True)
class Side:
    """One trace as `diff` reads it: each cycle's views (`per_cycle`), its steps and requests."""

    cycles: dict[str, np.ndarray]
    steps: pa.Table
    requests: pa.Table
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, probes: pa.Table, steps: pa.Table, requests: pa.Table, collectives: pa.Table | None = None,
           meta: dict[str, Any] | None = None) -> Side:
        """A side from whole tables (`diff` itself streams the probe rows: `load_inputs`)."""
        return cls(per_cycle(probes, steps, collectives=collectives), steps, requests, meta or {})


def _none(reps: int) -> np.ndarray:
    return np.full(reps + 1, np.nan)


def boundaries_of(keys: Any) -> list[str]:
    """Boundaries with any per-cycle column, in the cost table's order (device-view rows,
    host-view rows, then any other)."""
    present = {k.split(":", 1)[1] for k in keys
               if k.split(":", 1)[0] in ("raw_ns", "hidden_ns", "exposed_ns", "host_ns", *METRICS)}
    order = [*cost.ORDER, *cost.HOST_ORDER]
    seen = list(dict.fromkeys(b for b in order if b in present))
    return seen + sorted(present - set(seen))


def cycle_stats(pcy: dict[str, np.ndarray], w: np.ndarray) -> dict[str, np.ndarray]:
    """Cost-table statistics over each row of `w` (draw counts of cycles); same definitions as cost_table.

    Keys: cycle_ms, device_idle, and per boundary raw_ms_per_cycle:<b> (the host view's time
    where a row has no raw time, as unattributed), device_share:<b>, hidden:<b> (hidden / raw),
    host_share:<b>, for whichever columns are present.
    """
    if not pcy:
        return {}
    return stats_of_sums(*_sums(stat_columns(pcy), w))


def stat_columns(pcy: dict[str, np.ndarray], extra: dict[str, np.ndarray] | None = None,
                 runs: int = 1) -> tuple[list[str], np.ndarray]:
    """The per-cycle columns `cycle_stats` sums (and `extra` ones), as one (cycles, columns)
    matrix, built once for every resample; `runs` > 1: a row per run of that many entries
    (cycles, or chunks of them: `per_cycle`'s chunk), their sums (a million cycles' whole
    matrix is hundreds of MB)."""
    cols = {"cycle": pcy["cycle_ns"], "device": pcy["device_ns"]}
    for k in pcy:  # every view's columns, whatever cost.per_cycle currently emits
        if k.startswith(("raw_ns:", "hidden_ns:", "exposed_ns:", "host_ns:")):
            cols[k] = pcy[k]
    cols.update(extra or {})
    # cycles drawn (an entry of chunked arrays, a row of a grouped matrix, holds several)
    cols["n"] = pcy["cycles"] if "cycles" in pcy else np.ones(len(cols["cycle"]))
    if runs > 1:
        edges = np.arange(0, len(cols["n"]), runs)
        cols = {k: np.add.reduceat(v.astype(np.float64, copy=False), edges) for k, v in cols.items()}
    return list(cols), np.column_stack(list(cols.values())).astype(np.float64, copy=False)


def _sums(columns: tuple[list[str], np.ndarray], w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    names, m = columns
    sums = w @ m  # one product for every statistic
    s = {k: sums[:, i] for i, k in enumerate(names)}
    return s, s["n"]


def stats_of_sums(s: dict[str, np.ndarray], ncyc: np.ndarray) -> dict[str, np.ndarray]:
    """`cycle_stats` from each resample's column sums and cycle count."""
    out = {"cycle_ms": s["cycle"] / ncyc / 1e6, "device_idle": 1 - _ratio(s["device"], s["cycle"])}
    for b in boundaries_of(s):
        raw = s.get(f"raw_ns:{b}", s.get(f"host_ns:{b}"))
        if raw is not None:
            out[f"raw_ms_per_cycle:{b}"] = raw / ncyc / 1e6
        if f"exposed_ns:{b}" in s:
            out[f"device_share:{b}"] = _ratio(s[f"exposed_ns:{b}"], s["cycle"])
        if f"hidden_ns:{b}" in s and f"raw_ns:{b}" in s:
            out[f"hidden:{b}"] = _ratio(s[f"hidden_ns:{b}"], s[f"raw_ns:{b}"])
        if f"host_ns:{b}" in s:
            out[f"host_share:{b}"] = _ratio(s[f"host_ns:{b}"], s["cycle"])
    return out


def cycle_boot(pcy: dict[str, np.ndarray], reps: int,
               rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`cycle_stats` over [sample, reps resamples] of one trace's cycles, in circular blocks
    (Politis-White length from its cycle-length series); plus round_scale, each resample's
    mean round length (idle included) over the sample's: what the run's duration would
    have been, relative to what it was, with those rounds. And how it resampled.

    Chunked arrays (a long trace's, `per_cycle`'s chunk): the block length is the cycle
    series' rounded up to whole chunks, and the runs are of whole chunks."""
    series = pcy.get("series:cycle_ns", pcy.get("cycle_ns", np.zeros(0)))
    n = len(series)
    if not n:
        return {}, {"unit": "cycles", "n": 0, "block": 1, "widen": 1.0}
    chunk = int(pcy["cycles"][0]) if "series:cycle_ns" in pcy else 1
    bl = blocks(series, shortest_block(n), chunk)
    wall = pcy["cycle_ns"] + pcy["idle_ns"]
    info: dict[str, Any] = {"unit": "cycles", "n": n}
    items, block, run = n, bl.length, 1
    grouped = group_along(n, bl.length)
    if grouped is not None:  # runs of consecutive cycles, each drawn whole
        items, block, run = grouped[1], 1, bl.length // chunk
        info["runs"] = items
    elif chunk > 1:
        raise ValueError(f"chunks of {chunk} cycles where {n} cycles are drawn one by one")
    names, m = stat_columns(pcy, {"round": wall}, run)

    def stat(w: np.ndarray) -> dict[str, np.ndarray]:
        s, ncyc = _sums((names, m), w)
        return {**stats_of_sums(s, ncyc), "round_ns": s["round"] / ncyc}

    out = widen(bootstrap(items, reps, rng, [(stat, None)], block)[0], bl.widen)
    out["round_scale"] = _ratio(out.pop("round_ns"), np.full(reps + 1, wall.sum() / n))
    return out, {**info, "block": bl.length, "widen": round(bl.widen, 3)}


def cycle_deltas(sa: dict[str, np.ndarray], sb: dict[str, np.ndarray], reps: int) -> dict[str, Any]:
    """cycle_ms, device_idle and per-boundary {raw_ms_per_cycle, device_share, hidden, host_share} deltas."""
    none = _none(reps)
    out: dict[str, Any] = {k: delta(sa.get(k, none), sb.get(k, none)) for k in ("cycle_ms", "device_idle")}
    out["boundaries"] = {}
    for b in boundaries_of([*sa, *sb]):
        row = {m: delta(sa.get(f"{m}:{b}", none), sb.get(f"{m}:{b}", none)) for m in METRICS
               if f"{m}:{b}" in sa or f"{m}:{b}" in sb}
        if b in CONCURRENT:
            # off the scheduling thread: cycles are not its unit (tokenize runs before the
            # first cycle and would all be drawn with cycle 0), so no interval is claimed
            for d in row.values():
                d.ci_low = d.ci_high = d.p_value = None
                d.significant = False
        out["boundaries"][b] = row
    return out


def diff_cycles(probes_a: pa.Table, steps_a: pa.Table, probes_b: pa.Table, steps_b: pa.Table,
                reps: int = RESAMPLES, seed: int = SEED, colls_a: pa.Table | None = None,
                colls_b: pa.Table | None = None) -> dict[str, Any]:
    """cycle_ms, device_idle and per-boundary {raw_ms_per_cycle, device_share, hidden, host_share} deltas, resampling
    each trace's cycles (`cycle_boot`); ``colls_*``: the collectives tables of TP runs
    (all_reduce's raw/hidden, see cost.per_cycle). "resampling" says how, per side."""
    (sa, ia), (sb, ib) = (cycle_boot(per_cycle(p, s, collectives=c), reps, np.random.default_rng([seed, i]))
                          for i, (p, s, c) in enumerate(((probes_a, steps_a, colls_a), (probes_b, steps_b, colls_b))))
    out = cycle_deltas(sa, sb, reps)
    fdr(out)
    out["resampling"] = {"a": ia, "b": ib}
    return out


def round_gaps(requests: pa.Table, steps: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every inter-token gap as (value ms, multiplicity, cycle index), and the collect-to-collect
    series of the rounds in time order (what the block length is chosen from)."""
    step, collect, ts = (steps[c].to_numpy() for c in ("step", "collect_ns", "ts_ns"))
    # cycles, as cost.per_cycle orders them (one rank's rounds are written in time order)
    by_time = None if bool(np.all(ts[1:] >= ts[:-1])) else np.argsort(ts, kind="stable")
    vals, mult, rounds = itl_rounds(requests["token_runs"].chunks, step, collect)
    keep = mult > 0
    vals, mult, rounds = vals[keep], mult[keep], rounds[keep]
    st = step if by_time is None else step[by_time]
    if not len(st) or not len(rounds):
        at = np.zeros(0, np.int64)
    elif bool(np.all(st[1:] >= st[:-1])):  # steps numbered in time order: each round's first cycle, searched in place
        at = np.minimum(search(st, rounds - 1, int(rounds.min()) - 1, int(rounds.max()) - 1), len(st) - 1)
    else:
        srt = np.argsort(st, kind="stable")
        at = srt[np.minimum(np.searchsorted(st[srt], rounds), len(st) - 1)]
    ok = st[at] == rounds if len(at) else np.zeros(0, bool)
    return vals[ok], mult[ok], at[ok], np.diff(collect if by_time is None else collect[by_time]).astype(np.float64)


def itl_boot(requests: pa.Table, steps: pa.Table, reps: int,
             rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """ITL mean and percentiles over [sample, reps resamples] of one trace's rounds, in
    circular blocks; and how it resampled."""
    n = steps.num_rows
    if not n or "token_runs" not in requests.column_names or "collect_ns" not in steps.column_names:
        return {}, {"unit": "rounds", "n": 0, "block": 1, "widen": 1.0}
    vals, mult, owner, series = round_gaps(requests, steps)
    bl = blocks(series, shortest_block(n, pooled=True))
    info: dict[str, Any] = {"unit": "rounds", "n": n}
    items, block = n, bl.length
    grouped = group_along(n, bl.length, pooled=True)
    if grouped is not None:  # runs of consecutive rounds, each drawn whole
        owner, items, block = owner // bl.length, grouped[1], 1
        info["runs"] = items
    info.update(block=bl.length, widen=round(bl.widen, 3))
    dist = PooledDist(vals, owner, items, mult=mult)
    del vals, mult, owner, series  # the distribution holds its own sorted copies (13 M rounds: 0.4 GB)
    return widen(bootstrap(items, reps, rng, [(dist, None)], block)[0], bl.widen), info


def itl_deltas(sa: dict[str, np.ndarray], sb: dict[str, np.ndarray], reps: int) -> dict[str, Any]:
    """The ITL rows' deltas from each side's `itl_boot` (before BH)."""
    none = _none(reps)
    return {"itl_ms": {k: delta(sa.get(k, none), sb.get(k, none)) for k in ("mean", *(f"p{q}" for q in QUANTILES))}}


def diff_itl(req_a: pa.Table, steps_a: pa.Table, req_b: pa.Table, steps_b: pa.Table,
             reps: int = RESAMPLES, seed: int = SEED, same: bool = False) -> dict[str, Any]:
    """ITL mean and percentiles, resampling each trace's rounds in circular blocks
    (same: one run on both sides, drawn alike)."""
    (sa, ia), (sb, ib) = (itl_boot(r, s, reps, np.random.default_rng([seed, 4 + (0 if same else i)]))
                          for i, (r, s) in enumerate(((req_a, steps_a), (req_b, steps_b))))
    out = itl_deltas(sa, sb, reps)
    fdr(out)
    out["resampling"] = {"a": ia, "b": ib}
    return out


Boot = tuple[dict[str, np.ndarray], dict[str, Any]]


@dataclass(slots=True)
class OwnDraws:
    """One side's own resamples, under way: its cycles' (`cycle_boot`) and its rounds'
    (`itl_boot`), each from the generator of the side's place (A's, or B's unless both
    sides are one run), so when and on which thread they run changes nothing."""

    cycles: Future[Boot]
    rounds: Future[Boot]

    @classmethod
    def start(cls, side: Side, place: int, reps: int, seed: int, pool: ThreadPoolExecutor) -> OwnDraws:
        return cls(pool.submit(cycle_boot, side.cycles, reps, np.random.default_rng([seed, place])),
                   pool.submit(itl_boot, side.requests, side.steps, reps, np.random.default_rng([seed, 4 + place])))


def same_run(a: Side, b: Side) -> bool:
    """Whether both sides are one run (a trace diffed against itself): identical rounds."""
    sa, sb = a.steps, b.steps
    return (sa.num_rows == sb.num_rows and a.cycles.keys() == b.cycles.keys()
            and all(np.array_equal(sa[c].to_numpy(), sb[c].to_numpy()) for c in ("ts_ns", "dur_ns"))
            and all(np.array_equal(v, b.cycles[k]) for k, v in a.cycles.items()))


def place_of_b(a: Side, b: Side) -> int:
    """The generator place B's own resamples draw from: A's when both sides are one run (its
    noise is one realisation, so both get the same draws and every interval has zero width;
    otherwise two runs' rounds are never paired)."""
    return 0 if same_run(a, b) else 1


def compare(a: Side, b: Side, reps: int = RESAMPLES, seed: int = SEED, probes: bool = True,
            keep: set[tuple[str, str]] | None = None,
            draws: tuple[OwnDraws, OwnDraws] | None = None,
            requests: Future[RequestDraws] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """All of diff's deltas (B - A) and how they were resampled, with BH over every row.

    probes False (a side recorded with --no-probes): no boundary or device-idle rows.
    keep: the (boundary, metric) rows to compare (those the report shows); None: all.
    draws, requests: each side's own resamples and the requests', started already
    (`build_diff` starts A's while B is read, the others beside the reports)."""
    # The units are independent (each draws from its own seeded generator, so the answer
    # does not depend on the order they run in) and mostly numpy, which releases the GIL:
    # each side's cycles and rounds run on a pool, the requests on this thread unless
    # started already (scaled by both sides' cycles once those are done).
    if draws is None:
        with ThreadPoolExecutor(max_workers=2) as pool:
            return compare(a, b, reps, seed, probes, keep, (OwnDraws.start(a, 0, reps, seed, pool),
                                                            OwnDraws.start(b, place_of_b(a, b), reps, seed, pool)),
                           requests)
    da, db = draws
    drawn = requests.result() if requests else request_boot(a.requests, b.requests, a.meta, b.meta, reps, seed)
    (ca, ia), (cb, ib) = da.cycles.result(), db.cycles.result()
    req = request_deltas(*drawn, reps, (ca.get("round_scale"), cb.get("round_scale")))
    (ta, ra), (tb, rb) = da.rounds.result(), db.rounds.result()
    itl = itl_deltas(ta, tb, reps)
    itl["resampling"] = {"a": ra, "b": rb}
    cyc = cycle_deltas(ca, cb, reps)
    cyc["resampling"] = {"a": ia, "b": ib}
    if not probes:
        cyc["boundaries"] = {}
        cyc["device_idle"] = Delta(None, None, None, None, None, None, False)
    if keep is not None:
        cyc["boundaries"] = {bd: {m: d for m, d in row.items() if (bd, m) in keep}
                             for bd, row in cyc["boundaries"].items()}
        cyc["boundaries"] = {bd: row for bd, row in cyc["boundaries"].items() if row}
    resampling = {"cycles": cyc.pop("resampling"), "rounds": itl.pop("resampling"),
                  "requests": req.pop("resampling")}
    lat = req.pop("latency")
    out = {**cyc, **req, "latency": {k: itl["itl_ms"] if k == "itl_ms" else lat[k] for k in LATENCIES}}
    tested = fdr(out)
    return out, {"resampling": resampling, "fdr": {"method": "Benjamini-Hochberg", "q": FDR_Q, "rows": tested}}


def trace_warnings(meta_a: dict[str, Any], meta_b: dict[str, Any]) -> list[str]:
    """What makes A and B not a fair control group (a different mode is the point, so not that)."""
    out = []
    wa, wb = (workload_digest(m) for m in (meta_a, meta_b))
    if wa is None or wb is None:
        out.append("a trace has no workload digest: cannot tell whether both ran the same workload")
    elif wa != wb:
        out.append(f"the two traces ran different workloads (digest {wa[:12]} vs {wb[:12]})")
    ma, mb = meta_a.get("model", {}), meta_b.get("model", {})
    differ = [f"{k} {ma.get(k)} vs {mb.get(k)}" for k in ("name", "path", "architecture") if ma.get(k) != mb.get(k)]
    if differ:
        out.append("the two traces ran different models: " + "; ".join(differ))
    # how the device computed: either moves its time (traces from before weight_pack have none)
    numerics = [f"{k} {ma.get(k)} vs {mb.get(k)}" for k in ("dtype", "weight_pack")
                if None not in (ma.get(k), mb.get(k)) and ma.get(k) != mb.get(k)]
    if numerics:
        out.append("the two traces computed differently: " + "; ".join(numerics))
    da, db = (m.get("host", {}).get("device") for m in (meta_a, meta_b))
    if da != db:
        out.append(f"the two traces ran on different devices ({da} vs {db})")
    return out


# ---- the result of `diff` --------------------------------------------------------------
@dataclass(slots=True)
class DiffSide(ReportResult):
    """One trace's report, as diff shows it: with the share of the cycle its device was idle
    (None: a side recorded with --no-probes, or no cycles)."""

    device_idle: float | None = None


@dataclass(slots=True)
class Deltas:
    """Every compared number, B - A: per boundary and metric, per throughput metric, per
    latency and statistic."""

    cycle_ms: Delta
    device_idle: Delta
    boundaries: dict[str, dict[str, Delta]]
    throughput: dict[str, Delta]
    latency: dict[str, dict[str, Delta]]


@dataclass(slots=True)
class Fdr:
    method: str
    q: float
    rows: int  # compared numbers tested


@dataclass(slots=True)
class Bootstrap:
    """How the intervals were made, and what they cover."""

    resamples: int
    seed: int
    level: float
    resampling: dict[str, dict[str, Any]]  # per unit: cycles, rounds, requests
    fdr: Fdr
    covers: str


@dataclass(slots=True)
class DiffResult(JsonRecord):
    """Everything `diff` shows (its to_json() is what --json prints)."""

    a: DiffSide
    b: DiffSide
    delta: Deltas
    warnings: list[str]
    bootstrap: Bootstrap


def build_diff(a_root: str | Path, b_root: str | Path, reps: int = RESAMPLES, seed: int = SEED) -> DiffResult:
    """Both traces' reports, and every delta between them with its interval."""
    # Read one after the other: a read keeps both cores busy already; two beside each other
    # took as long, with more memory. A's own resamples fill what B's read leaves of them, on
    # a thread of their own, then the requests'; B's run beside the reports on another.
    # Both traces open first, so a bad one fails before any read; their ids are read only if
    # the requests may pair (a string column: 0.1 s of a 10 M-row trace of short requests).
    ids = ["request_id"] if may_pair(*(Trace.open(r).meta for r in (a_root, b_root))) else []
    columns = list(dict.fromkeys([*REQUEST_COLUMNS, "token_runs", *ids]))
    early, late = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)
    try:
        inputs = [load_inputs(a_root, columns, per_cycle=True)]
        tables = [Side(inputs[0].main_rank, inputs[0].steps, inputs[0].requests, inputs[0].trace.meta)]
        a_draws = OwnDraws.start(tables[0], 0, reps, seed, early)
        inputs.append(load_inputs(b_root, columns, per_cycle=True))
        tables.append(Side(inputs[1].main_rank, inputs[1].steps, inputs[1].requests, inputs[1].trace.meta))
        b_draws = OwnDraws.start(tables[1], place_of_b(*tables), reps, seed, late)  # beside the reports
        req = early.submit(request_boot, tables[0].requests, tables[1].requests, tables[0].meta, tables[1].meta,
                           reps, seed)  # (after A's own)
        reports = [build_report(inp) for inp in inputs]
        probes_ok = all(r.probes for r in reports)
        # compare exactly the boundary metrics the report shows (a "—" on both sides is not a row)
        keep = {(row.boundary, m) for r in reports for row in r.cost.boundaries for m in METRICS
                if getattr(row, m) is not None}
        delta, how = compare(tables[0], tables[1], reps, seed, probes_ok, keep, (a_draws, b_draws), req)
    finally:
        # a bad trace B (or Ctrl-C) is said at once, not after A's resamples: what has not
        # started is dropped (what has finishes on its thread)
        for pool in (early, late):
            pool.shutdown(wait=False, cancel_futures=True)
    warnings = [f"trace {side} is {inp.trace.status.state}: {inp.trace.status.headline()}"
                for side, inp in zip("AB", inputs, strict=True) if not inp.trace.status.complete]
    warnings += trace_warnings(inputs[0].trace.meta, inputs[1].trace.meta)
    sides = []
    for side, r in zip("AB", reports, strict=True):
        # with --no-probes every cycle would count as barrier: no cost comparison at all
        idle = 1 - r.cost.device_busy if probes_ok and r.cost.cycles else None
        sides.append(DiffSide(**{f.name: getattr(r, f.name) for f in fields(r)}, device_idle=idle))
        if not r.probes:
            warnings.append(f"trace {side} was recorded with --no-probes: no boundary or device-idle comparison")
    if not how["resampling"]["requests"]["paired"]:
        warnings.append("requests resampled independently (" + how["resampling"]["requests"]["why"]
                        + "): serving intervals include the workload's own spread")
    return DiffResult(
        a=sides[0], b=sides[1],
        delta=Deltas(delta["cycle_ms"], delta["device_idle"], delta["boundaries"], delta["throughput"],
                     delta["latency"]),
        warnings=warnings,
        bootstrap=Bootstrap(resamples=reps, seed=seed, level=LEVEL, resampling=how["resampling"],
                            fdr=Fdr(**how["fdr"]),
                            covers="noise within these two runs (their rounds and requests resampled), "
                                   "not run-to-run variation"),
    )
