"""`mstrace whatif`: predict a scheduling change from one trace (docs/whatif.md).

The trace's rounds are cut into the model's components (viewer/analysis/whatif_model.py),
the model replays the run as measured (its fit), then as asked (another mode, or some
boundaries faster or slower), and every request's tokens are re-timed at their batch's
predicted collect. The serving numbers use the report's own definitions
(viewer/analysis/serving.py), so a prediction and the other run's report compare directly.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probes import boundaries as B
from tracing.reader import Trace, TraceError
from tracing.run_status import RunStatus
from viewer.analysis.records import JsonRecord
from viewer.analysis.serving import Dist, itl_rounds
from viewer.analysis.whatif_model import (
    COMPONENTS,
    SCALES,
    Batches,
    Timeline,
    critical_path,
    replicates,
    simulate,
)

MODES = ("serial", "timeslice", "overlap")
DRAWS = 200  # replicate runs behind each interval (viewer/analysis/whatif_model.py: replicates)
# Which boundary each component is, for the critical-path table.
COMPONENT_BOUNDARY = {"P_book": B.BOOKKEEPING, "P_prep": B.BATCH_PREPARE, "L": B.SCHEDULER_BARRIER, "T": B.SCHEDULER_BARRIER,
                      "D": B.DEVICE_COMPUTE, "C": B.SCHEDULER_BARRIER, "W": B.SCHEDULER_BARRIER, "Q_book": B.BOOKKEEPING,
                      "Q_send": B.RESPONSE_SEND, "Q_defrag": B.DEFRAG, "G": "unattributed", "idle": B.IDLE}


class WhatIfError(ValueError):
    """A trace or a question the model cannot answer; str(e) is one line."""


@dataclass(slots=True)
class Speedup:
    boundary: str
    factor: float | None = None  # times this
    delta_ms: float | None = None  # or plus this per round

    @classmethod
    def parse(cls, spec: str) -> Speedup:
        name, sep, value = spec.partition("=")
        if not sep or name not in SCALES:
            raise WhatIfError(f"--speedup takes BOUNDARY=FACTOR or BOUNDARY=+-MSms with BOUNDARY one of "
                              f"{', '.join(SCALES)}, got {spec!r}")
        try:
            if value.endswith("ms"):
                return cls(name, delta_ms=float(value[:-2]))
            factor = float(value)
        except ValueError:
            raise WhatIfError(f"--speedup {name}: {value!r} is neither a factor nor +-MSms") from None
        if not factor >= 0 or factor == float("inf"):
            raise WhatIfError(f"--speedup {name}: the factor must be a finite number >= 0, got {value!r}")
        return cls(name, factor=factor)

    def label(self) -> str:
        return f"{self.boundary}={self.delta_ms:+g}ms" if self.delta_ms is not None else f"{self.boundary}={self.factor:g}"


@dataclass(slots=True)
class Figures:
    """One run's serving numbers, measured or predicted, in the report's names and units;
    None where the run has none (no token followed another: no ITL)."""

    cycle_ms: float | None  # busy time / rounds (waits for arrivals excluded), as the report's
    output_tok_per_s: float | None
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    itl_ms_p50: float | None
    itl_ms_p90: float | None

    def array(self) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in astuple(self)], dtype=np.float64)

    @classmethod
    def of(cls, values: np.ndarray) -> Figures:
        return cls(*(None if np.isnan(v) else float(v) for v in values))


@dataclass(slots=True)
class PathRow:
    boundary: str
    ms_per_round: float  # the component's mean time per round, predicted
    on_path_ms_per_round: float  # of it, on the critical path
    slack_ms_per_round: float  # the rest: it could grow by this before the run does


@dataclass(slots=True)
class WhatIfResult(JsonRecord):
    """Everything `whatif` shows (its to_json() is what --json prints)."""

    trace: str  # the trace folder, as given
    status: RunStatus
    mode: str  # the trace's
    target_mode: str
    speedups: list[str]
    batches: int
    measured: Figures  # the trace's own numbers (the report's)
    replayed: Figures  # the model replaying the trace as it ran: its fit
    predicted: Figures
    predicted_low: Figures  # the 95% interval of each predicted number, from the rounds' own variation
    predicted_high: Figures
    critical_path: list[PathRow]
    device_bound_batches: int  # predicted batches the device started straight after the one before
    host_bound_batches: int  # ... it started only once the host launched them: it sat idle before


@dataclass(slots=True)
class _Run:
    """What the model needs from a trace: the batches, and how tokens map onto them."""

    batches: Batches
    t0: int  # the first round's start, ns
    collect_round: np.ndarray  # per batch: the step number of the round that collected it
    steps: np.ndarray  # every round's step number
    collect_ns: np.ndarray  # every round's collect moment (0: none)
    requests: pa.Table
    trace: Trace
    first_idx: np.ndarray  # per served request: the index (into steps) of its first token's round
    last_idx: np.ndarray  # ... of its last token's round
    arrival: np.ndarray  # per served request, ns
    output_tokens: int


def _host_rows(tr: Trace) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rank 0's host rows per boundary: (step, ts, end)."""
    p = tr.table("probes", ["ts_ns", "dur_ns", "boundary", "stream", "rank", "step"], dictionary=("boundary", "stream"))
    keep = pc.and_(pc.equal(p["rank"], 0), pc.is_in(p["stream"], pa.array(["host", "main", "prefill"])))
    p = p.filter(keep)
    out = {}
    for b in (B.BOOKKEEPING, B.BATCH_PREPARE, B.RESPONSE_SEND, B.DEFRAG, B.IDLE, B.DEVICE_COMPUTE,
              B.SCHEDULER_BARRIER):
        t = p.filter(pc.equal(p["boundary"], b))
        ts = t["ts_ns"].to_numpy()
        out[b] = (t["step"].to_numpy(), ts, ts + t["dur_ns"].to_numpy())
    return out


def _per_step(rows: tuple[np.ndarray, np.ndarray, np.ndarray], steps: np.ndarray, what: str) -> np.ndarray:
    """Per round (aligned with `steps`): sum of durations, or first start / last end."""
    step, ts, end = rows
    idx = np.searchsorted(steps, step)
    ok = (idx < len(steps)) & (steps[np.minimum(idx, len(steps) - 1)] == step)
    idx, ts, end = idx[ok], ts[ok], end[ok]
    if what == "sum":
        return np.bincount(idx, weights=end - ts, minlength=len(steps))
    if what == "first":
        out = np.full(len(steps), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(out, idx, ts)
        return out
    out = np.zeros(len(steps), dtype=np.int64)
    np.maximum.at(out, idx, end)
    return out


def _median(x: np.ndarray) -> float | None:
    return float(np.median(x)) if len(x) else None


def _held_back(a_seen: np.ndarray, b_seen: np.ndarray, a_held: np.ndarray, a_guess: np.ndarray | float,
               b_guess: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """Two latencies behind one moment (moment = max(x + a, y + b)): where the trace shows a
    held it, a is what it shows and b a guess; elsewhere the other way round. A guess is
    capped at what the trace shows, so the one that held stays the one that held."""
    a = np.where(a_held, a_seen, np.minimum(a_guess, a_seen))
    b = np.where(a_held, np.minimum(b_guess, b_seen), b_seen)
    return a, b


def load(root: str | Path) -> _Run:
    tr = Trace.open(root)
    if "import" in tr.meta:
        raise WhatIfError(f"{root} is an imported profiler trace: its rounds have no launch and collect "
                          "moments for the model; whatif reads traces of mstrace run/serve")
    cfg = tr.meta.get("config", {})
    if int(cfg.get("tp", 1) or 1) * int(cfg.get("pp", 1) or 1) > 1:
        raise WhatIfError(f"{root} is a TP/PP trace: the model has no collectives yet (docs/whatif.md)")
    s = tr.table("steps", ["step", "mode", "ts_ns", "dur_ns", "collect_ns", "num_prefill_reqs", "num_decode_reqs"])
    if s.num_rows < 2:
        raise WhatIfError(f"{root} has {s.num_rows} round(s): nothing to model")
    order = pc.sort_indices(s, [("step", "ascending")])
    s = s.take(order)
    steps = s["step"].to_numpy()
    start = s["ts_ns"].to_numpy()
    housekept = start + s["dur_ns"].to_numpy()
    collect = s["collect_ns"].to_numpy()
    overlap = s["mode"][0].as_py() == "overlap"
    rows = _host_rows(tr)
    # the round's first bookkeeping row (it starts with the round) is intake and scheduling,
    # before the launch; the others are the collect and housekeeping after the barrier
    bk_step, bk_ts, bk_end = rows[B.BOOKKEEPING]
    first = np.isin(bk_ts, start)
    pre_book = _per_step((bk_step[first], bk_ts[first], bk_end[first]), steps, "sum")
    post_book = _per_step((bk_step[~first], bk_ts[~first], bk_end[~first]), steps, "sum")
    prep = _per_step(rows[B.BATCH_PREPARE], steps, "sum")
    prep_end = _per_step(rows[B.BATCH_PREPARE], steps, "last")
    send = _per_step(rows[B.RESPONSE_SEND], steps, "sum")
    sent = np.maximum(_per_step(rows[B.RESPONSE_SEND], steps, "last"), housekept)
    defrag = _per_step(rows[B.DEFRAG], steps, "sum")
    dev_first = _per_step(rows[B.DEVICE_COMPUTE], steps, "first")
    dev_last = _per_step(rows[B.DEVICE_COMPUTE], steps, "last")
    launched_any = prep > 0
    launched = np.where(launched_any, prep_end, start + pre_book)
    # idle waits for arrivals between one round's hand-off and the next round
    it_step, it_ts, it_end = rows[B.IDLE]
    idle_between = np.zeros(len(steps))
    if len(it_ts):
        k = np.searchsorted(start, it_ts, side="right") - 1  # the round before the wait
        ok = k >= 0
        np.add.at(idle_between, k[ok], (it_end - it_ts)[ok])
    nxt = np.append(start[1:], sent[-1])
    gap = np.maximum(nxt - sent - idle_between, 0)

    b_idx = np.flatnonzero(launched_any)
    if len(b_idx) < 2:
        raise WhatIfError(f"{root} launched {len(b_idx)} batch(es): nothing to model")
    col = b_idx + 1 if overlap else b_idx  # the round that collected each batch
    if col[-1] >= len(steps):
        raise WhatIfError(f"{root} ends before its last batch was collected (a truncated run)")
    dev_s = dev_first[b_idx].astype(np.float64)
    dev_e = dev_last[b_idx].astype(np.float64)
    if np.any(dev_e <= 0):
        raise WhatIfError(f"{root} has batches without device_compute rows: the model needs the device view")
    # A batch starts once launched (after L) and once the device is done with the one before
    # (after T); the trace shows the one that held it back. The other is the median of the
    # batches it held back, or, never seen (a serial run never waits on its device), the
    # other's median: the device picking up work after a launch or after its last batch.
    prev_e = np.concatenate([[-np.inf], dev_e[:-1]])
    lb = launched[b_idx]
    by_launch = lb >= prev_e
    L_seen, T_seen = dev_s - lb, dev_s - prev_e
    med_L, med_T = _median(L_seen[by_launch]), _median(T_seen[~by_launch])
    seen = med_L if med_L is not None else med_T
    assert seen is not None  # a batch was held by one or the other
    L, T = _held_back(L_seen, T_seen, by_launch, seen if med_L is None else med_L, seen if med_T is None else med_T)
    L = np.maximum(L, 0)
    D = dev_e - dev_s
    T = np.maximum(T, -np.concatenate([[0.0], D[:-1]]))
    # Likewise the collect: the host holds the tokens once it reached the barrier and passed it
    # (W from the collecting round's launch) and once the device is done (C after it). A barrier
    # row waits for the batch its step names; a batch without one was collected on the way.
    lc = launched[col]
    collected = collect[col].astype(np.float64)
    arrive = _per_step(rows[B.SCHEDULER_BARRIER], steps, "first")[b_idx].astype(np.float64)
    arrive = np.where(arrive < np.iinfo(np.int64).max, arrive, lc)
    by_host = arrive >= dev_e  # the device was done before the host came to wait
    W_seen, C_seen = collected - lc, collected - dev_e
    through = _median((collected - arrive)[by_host]) or 0.0  # the barrier's pass with nothing to wait for
    med_C = _median(C_seen[~by_host])
    W, C = _held_back(W_seen, C_seen, by_host, arrive - lc + through, through if med_C is None else med_C)
    W, C = np.maximum(W, 0), np.maximum(C, 0)
    # arrivals: a batch cannot start before the requests it admits arrived
    rq = tr.table("requests", ["arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns", "output_len",
                               "prompt_len", "token_runs"])
    t0 = int(start[0])
    not_before = np.zeros(len(b_idx))
    fs = rq["first_scheduled_ns"].to_numpy()
    arr = rq["arrival_ns"].to_numpy()
    has = fs > 0
    rb = np.searchsorted(start[b_idx], fs[has], side="right") - 1
    ok = rb >= 0
    np.maximum.at(not_before, rb[ok], (arr[has][ok] - t0).astype(np.float64))
    tail_P = float(pre_book[-1]) if overlap else 0.0
    head_Q = float(post_book[0] + send[0] + defrag[0] + gap[0]) if overlap else 0.0
    bt = Batches(P_book=pre_book[b_idx], P_prep=prep[b_idx].astype(np.float64), L=L, T=T, D=D, C=C, W=W,
                 Q_book=post_book[col], Q_send=send[col].astype(np.float64), Q_defrag=defrag[col].astype(np.float64),
                 G=gap[col].astype(np.float64), not_before=np.maximum(not_before, 0), head_Q=head_Q, tail_P=tail_P)
    runs = rq["token_runs"]
    lens = pc.list_value_length(runs).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(runs).to_numpy()
    served = lens > 0
    ends = np.cumsum(lens)[served]
    first_round, last_round = flat[ends - lens[served]], flat[ends - 2] + flat[ends - 1] - 1
    if not served.any():
        raise WhatIfError(f"{root} served no tokens: nothing to predict")
    return _Run(bt, t0, steps[col], steps, collect, rq, tr, np.searchsorted(steps, first_round),
                np.searchsorted(steps, last_round), rq["arrival_ns"].to_numpy()[served],
                int(rq["output_len"].to_numpy()[served].sum()))


def _figures(run: _Run, b: Batches, tl: Timeline) -> Figures:
    """The serving numbers of a timeline: each token at its batch's predicted collect."""
    collect = np.zeros(len(run.steps), dtype=np.int64)
    collect[np.searchsorted(run.steps, run.collect_round)] = (tl.synced + run.t0).astype(np.int64)
    first, finish = collect[run.first_idx], collect[run.last_idx]
    ttft = (first - run.arrival) / 1e6
    vals, w, _ = itl_rounds(run.requests["token_runs"].chunks, run.steps, collect)
    itl = Dist.weighted(vals, w)
    idle = tl.start - np.concatenate([[0.0], _round_ends(b, tl)[:-1]])
    busy = tl.end - float(np.maximum(idle, 0).sum())
    duration_s = (finish.max() - run.arrival.min()) / 1e9
    return Figures.of(np.array([busy / tl.rounds / 1e6, run.output_tokens / duration_s, np.percentile(ttft, 50),
                                np.percentile(ttft, 90), itl.p50, itl.p90]))


def _round_ends(b: Batches, tl: Timeline) -> np.ndarray:
    """When each predicted round handed off (its next round could start)."""
    post: np.ndarray = tl.synced + b.Q + b.G
    if tl.rounds == b.n:  # serial: round i collects batch i
        return post
    return np.concatenate([[tl.launched[0] + b.head_Q], post])  # overlap: round 0 collects nothing


def _measured(tr: Trace) -> Figures:
    from viewer.analysis.report import build_report

    rep = build_report(tr.root)
    lat = rep.latency
    return Figures(rep.cost.cycle_ms, rep.throughput.output_tok_per_s, lat.ttft_ms.p50, lat.ttft_ms.p90,
                   lat.itl_ms.p50, lat.itl_ms.p90)


def _asked(b: Batches, speedups: list[Speedup]) -> Batches:
    for sp in speedups:
        b = b.sped_up(sp.boundary, sp.factor, sp.delta_ms * 1e6 if sp.delta_ms is not None else None)
    return b


def whatif(root: str | Path, mode: str | None = None, speedups: list[Speedup] | None = None,
           seed: int = 0) -> WhatIfResult:
    run = load(root)
    speedups = speedups or []
    tr_mode = run.trace.meta.get("config", {}).get("mode", "serial")
    target = mode or tr_mode
    if target not in MODES:
        raise WhatIfError(f"--mode must be one of {', '.join(MODES)}, not {target!r}")
    if target == "timeslice" and tr_mode != "timeslice":
        raise WhatIfError("--mode timeslice cuts prefills into other chunks, so its batches are not this "
                          "trace's; the model keeps the batches fixed (docs/whatif.md): predict serial or overlap")
    overlap = target == "overlap"
    b = _asked(run.batches, speedups)
    tl = simulate(b, overlap)
    reps = [_figures(run, rb, simulate(rb, overlap))
            for rb in (_asked(r, speedups) for r in replicates(run.batches, np.random.default_rng(seed), DRAWS))]
    table = np.array([f.array() for f in reps])
    lo, hi = (Figures.of(np.percentile(table, q, axis=0)) for q in (2.5, 97.5))
    host = int(np.isclose(tl.dev_start, tl.launched[:b.n] + b.L).sum())
    replay = simulate(run.batches, tr_mode == "overlap")
    return WhatIfResult(
        trace=str(root), status=run.trace.status, mode=tr_mode, target_mode=target,
        speedups=[s.label() for s in speedups], batches=b.n, measured=_measured(run.trace),
        replayed=_figures(run, run.batches, replay), predicted=_figures(run, b, tl), predicted_low=lo,
        predicted_high=hi, critical_path=_path_table(b, tl, overlap), device_bound_batches=b.n - host,
        host_bound_batches=host,
    )


def _path_table(b: Batches, tl: Timeline, overlap: bool) -> list[PathRow]:
    """The critical path per boundary, ms per round, largest first."""
    path = critical_path(b, tl, overlap)
    rows: dict[str, list[float]] = {}
    for comp in (*COMPONENTS, "idle"):
        total = float(getattr(b, comp).sum()) if comp != "idle" else path["idle"]
        r = rows.setdefault(COMPONENT_BOUNDARY[comp], [0.0, 0.0])
        r[0] += total
        r[1] += path[comp]
    per = tl.rounds * 1e6
    return [PathRow(k, total / per, on / per, max(total - on, 0.0) / per)
            for k, (total, on) in sorted(rows.items(), key=lambda kv: -kv[1][1]) if total > 0]


__all__ = ["MODES", "Speedup", "TraceError", "WhatIfError", "WhatIfResult", "whatif"]
