"""`mstrace whatif`: predict a scheduling change from one trace (docs/whatif.md).

The trace's rounds are cut into the model's components (viewer/analysis/whatif_model.py),
the model replays the run as measured (its fit), then as asked (another mode, or some
boundaries faster or slower), and every request's tokens are re-timed at their batch's
predicted collect. The serving numbers use the report's own definitions
(viewer/analysis/serving.py), so a prediction and the other run's report compare directly.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from probes import boundaries as B
from scheduler.config import MODES  # (no torch: the viewer stays light)
from tracing.reader import Trace
from tracing.run_status import RunStatus
from viewer.analysis.records import OMITTED, JsonRecord, Omitted
from viewer.analysis.serving import Dist, itl_rounds
from viewer.analysis.whatif_comm import trace_setting, with_comm_overlap
from viewer.analysis.whatif_fit import Run, WhatIfError, load, tp_pp
from viewer.analysis.whatif_model import (
    COMPONENTS,
    POST,
    SCALES,
    Batches,
    StreamShare,
    Timeline,
    busy_ns,
    critical_path,
    replicates,
    simulate,
)
from viewer.analysis.whatif_probe import Probe, measured, own, replayed, rounds
from viewer.analysis.whatif_share import Rates, as_run
from viewer.analysis.whatif_streams import converted, rounds_mode, split_on
from viewer.export.window import Window

DRAWS = 200  # replicate runs on each side of an interval (_interval; viewer/analysis/whatif_model.py: replicates)
# The model replays every round 2 * DRAWS + 1 times, with each replicate's own components
# drawn, shared and its figures taken: 9-15 s for 100,000 rounds here, the replay in C (the
# Python loop: 2-3 us a round, two to three minutes). Past this, one line naming a window.
MAX_ROUNDS = 100_000
# Which boundary each component is, for the critical-path table: SCALES read backwards.
COMPONENT_BOUNDARY = {c: boundary for boundary, comps in SCALES.items() for c in comps} | {"idle": B.IDLE}


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
            number = float(value[:-2] if value.endswith("ms") else value)
        except ValueError:
            raise WhatIfError(f"--speedup {name}: {value!r} is neither a factor nor +-MSms") from None
        if value.endswith("ms"):
            if not math.isfinite(number):
                raise WhatIfError(f"--speedup {name}: the change must be a finite number of ms, got {value!r}")
            return cls(name, delta_ms=number)
        factor = number
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
class Check:
    """The prediction beside a measured run of what it predicts (`--against`): the model
    checked on the user's own machine, as bench/bench_whatif.py checks it here."""

    trace: str  # the other run's folder, as given (a complete run: a partial one is refused)
    mode: str  # its mode: the target's
    measured: Figures  # its report's numbers
    error_pct: Figures  # predicted / measured - 1, in percent
    # per figure, whether the measured value lies inside the prediction's 95% interval (None: a value missing)
    inside_interval: dict[str, bool | None]
    figures_inside: int  # figures whose measured value lies inside
    figures_checked: int  # figures with a measured value, a prediction and an interval


@dataclass(slots=True)
class WhatIfResult(JsonRecord):
    """Everything `whatif` shows (its to_json() is what --json prints)."""

    trace: str  # the trace folder, as given
    status: RunStatus
    mode: str  # the trace's
    target_mode: str
    speedups: list[str]
    comm_overlap: str | None  # the TP trace's --comm-overlap (on/off); None without TP or with PP
    target_comm_overlap: str | None  # the setting predicted (the trace's unless --comm-overlap)
    # while host and device both work, the share of its own speed each keeps, beside the host's
    # batch_prepare and beside its other (pure-Python) work (--contention K: 1 - K and 1 for both)
    rates_beside_prepare: Rates
    rates_beside_python: Rates
    contention_source: str  # given (--contention), measured at start-up, or none measured (why)
    split_streams: bool  # the trace's decodes and prefills ran on two streams (overlap mode's (b))
    target_split_streams: bool  # ... and the prediction's (the target mode's default)
    rates_between_streams: StreamShare  # split streams: the share of its speed each keeps beside the other
    streams_source: str  # measured at start-up, or not measured (why)
    # what a forward took longer after the device idled 0.5 ms or more (a serial run's every
    # batch) than straight after other work (meta.json's contention.cold_ms; 0 where not measured)
    cold_start_ms: float
    backend: str  # cuda, cpu-process, cpu-thread: where the contention comes from
    batches: int
    window: str | None  # the rounds modelled (--rounds, --time); None: the whole run
    window_requests: int  # the requests the figures count: the window's admitted and served in it
    window_requests_left_out: int  # the window's requests that began before it or ended after it
    measured: Figures  # the trace's own numbers (the report's)
    replayed: Figures  # the model replaying the trace as it ran: its fit
    predicted: Figures
    predicted_low: Figures  # the 95% interval of what a run of the prediction measures (_interval)
    predicted_high: Figures
    critical_path: list[PathRow]
    device_bound_batches: int  # predicted batches the device started straight after the one before
    host_bound_batches: int  # ... it started only once the host launched them: it sat idle before
    against: Check | Omitted = OMITTED  # only with --against: the prediction beside the run it predicts


def _figures(run: Run, b: Batches, tl: Timeline) -> Figures:
    """The serving numbers of a timeline: each token at its batch's predicted collect."""
    collect = np.zeros(len(run.steps), dtype=np.int64)
    collect[np.searchsorted(run.steps, run.collect_round)] = (tl.synced + run.t0).astype(np.int64)
    first, finish = collect[run.first_idx], collect[run.last_idx]
    ttft = (first - run.arrival) / 1e6
    vals, w, _ = itl_rounds(run.requests["token_runs"].chunks, run.steps, collect)
    itl = Dist.weighted(vals, w)
    busy = busy_ns(tl)
    lo, hi = int(run.arrival.min()), int(finish.max())
    if run.unserved_bounds is not None:  # the report's span: every request row's
        lo, hi = min(lo, run.unserved_bounds[0]), max(hi, run.unserved_bounds[1])
    duration_s = (hi - lo) / 1e9
    return Figures.of(np.array([busy / tl.rounds / 1e6, run.output_tokens / duration_s, np.percentile(ttft, 50),
                                np.percentile(ttft, 90), itl.p50, itl.p90]))


def _measured(tr: Trace) -> Figures:
    from viewer.analysis.report import build_report

    rep = build_report(tr.root, predict=False)
    lat = rep.latency
    return Figures(rep.cost.cycle_ms, rep.throughput.output_tok_per_s, lat.ttft_ms.p50, lat.ttft_ms.p90,
                   lat.itl_ms.p50, lat.itl_ms.p90)


def _measured_in(run: Run, window: Window) -> Figures:
    """A window's own numbers, by the report's definitions: its rounds' cycles (the last ending
    where the window does) and the requests it holds whole (`load`)."""
    from viewer.analysis.cost import table_of
    from viewer.analysis.cycle_views import per_cycle
    from viewer.analysis.serving import itl_from_runs, serving_metrics
    from viewer.export.window import window_cycles

    steps = run.table("steps", ["step", "ts_ns", "dur_ns", "collect_ns"])
    steps = steps.take(pc.sort_indices(steps, [("ts_ns", "ascending")]))
    assert run.probes is not None  # (load keeps a window's)
    cost = table_of(per_cycle(run.probes, steps, 0, totals=True, bounds=window_cycles(steps, window)))
    serving = serving_metrics(run.requests, itl_from_runs(run.requests["token_runs"].chunks,
                                                          steps["step"].to_numpy(), steps["collect_ns"].to_numpy()))
    return Figures(cost.cycle_ms, serving.output_tok_per_s, serving.ttft_ms.p50, serving.ttft_ms.p90,
                   serving.itl_ms.p50, serving.itl_ms.p90)


def _asked(b: Batches, speedups: list[Speedup]) -> Batches:
    for sp in speedups:
        b = b.sped_up(sp.boundary, sp.factor, sp.delta_ms * 1e6 if sp.delta_ms is not None else None)
    return b


def whatif(root: str | Path, mode: str | None = None, speedups: list[Speedup] | None = None,
           contention: float | None = None, seed: int = 0, comm_overlap: str | None = None,
           against: str | Path | None = None, window: Window | None = None) -> WhatIfResult:
    """`contention` None: host and device slow each other as the engine measured at start-up
    (not at all where it did not). `against`: a run of what is predicted, to check the
    prediction against (`Check`). `window` (`parse_window`'s): only those rounds (`load`)."""
    if window is not None and against is not None:
        raise WhatIfError("--against compares whole runs; a window's rounds have no counterpart in another run "
                          "(drop --rounds / --time, or --against)")
    run = load(root, MAX_ROUNDS, window)
    other = Trace.open(against) if against is not None else None
    point, source, streams_source = measured(run.trace.meta, contention)
    share, streams = point.share, point.streams
    speedups = speedups or []
    tr_mode = rounds_mode(run.trace.meta.get("config", {}))
    tr_comm = trace_setting(run.trace.meta)
    _comm_asked(run, tr_comm, comm_overlap)
    target = mode or tr_mode
    if target not in MODES:
        raise WhatIfError(f"--mode must be one of {', '.join(MODES)}, not {target!r}")
    if target == "overlap" and tp_pp(run.trace.meta.get("config", {})) != (1, 1):
        raise WhatIfError("--mode overlap: the engine runs TP and PP rounds serially or time-sliced, never "
                          "overlapped; predict --comm-overlap or a --speedup instead")
    if target == "timeslice" and tr_mode != "timeslice":
        raise WhatIfError("--mode timeslice cuts prefills into other chunks, so its batches are not this "
                          "trace's; the model keeps the batches fixed (docs/whatif.md): predict serial or overlap")
    overlap, was_overlap = target == "overlap", tr_mode == "overlap"
    split = run.split if target == tr_mode else split_on(run.trace.meta.get("config", {}), target)
    if other is not None:  # refused before the model runs
        _comparable(other, str(against), root, run, target, split, comm_overlap or tr_comm)

    def base_of(p: Probe) -> Batches:
        """Each side's work alone (the trace's cold starts, its two streams' and its host and
        device's sharing taken out), in the target's streams and comm setting."""
        return _comm(run, converted(run, own(run, p, was_overlap), split), tr_comm, comm_overlap,
                     1 - p.share.python.device)

    # nothing asked: the run as it ran, its cold starts where the trace had them (the fit's replay)
    as_ran = target == tr_mode and split == run.split and not speedups and comm_overlap in (None, tr_comm)

    def predict(b: Batches, p: Probe) -> tuple[Batches, Timeline]:
        x = as_run(_asked(b, speedups), p.share, overlap)
        return x, simulate(x, overlap, p.streams if split else None, run.cold_at if as_ran else None)

    b, tl = predict(base_of(point), point)
    # each replicate with one of the probe's measurements (its medians where it kept none)
    rng = np.random.default_rng(seed)
    variants = rounds(run.trace.meta, point, contention is not None) or [point]
    picks = rng.integers(0, len(variants), DRAWS)
    counts = np.bincount(picks, minlength=len(variants))
    reps = [_figures(run, *predict(r, p))
            for p, c in zip(variants, counts, strict=True) if c for r in replicates(base_of(p), rng, int(c))]
    table = np.array([f.array() for f in reps])
    # the run predicted has rounds of its own: as many replicates again, at the probe's medians
    own_rounds = np.array([_figures(run, *predict(r, point)).array() for r in replicates(base_of(point), rng, DRAWS)])
    predicted = _figures(run, b, tl)
    lo, hi = _interval(own_rounds, table, predicted.array())
    host = int((~tl.held).sum())
    fit, fit_tl = replayed(run, point, was_overlap, as_ran)  # "vs fit": cold starts found as the prediction finds them
    check = OMITTED if other is None else _check(other, str(against), predicted, lo, hi)
    return WhatIfResult(
        trace=str(root), status=run.trace.status, mode=tr_mode, target_mode=target,
        speedups=[s.label() for s in speedups], comm_overlap=tr_comm, target_comm_overlap=comm_overlap or tr_comm,
        rates_beside_prepare=share.prepare, rates_beside_python=share.python, contention_source=source,
        split_streams=run.split, target_split_streams=split, rates_between_streams=streams,
        streams_source=streams_source, cold_start_ms=point.cold_ns / 1e6, backend=_backend(run.trace),
        batches=b.n, window=None if window is None else window.what, window_requests=run.requests.num_rows,
        window_requests_left_out=run.left_out,
        measured=_measured(run.trace) if window is None else _measured_in(run, window),
        replayed=_figures(run, fit, fit_tl),
        predicted=predicted, predicted_low=lo, predicted_high=hi,
        critical_path=_path_table(b, tl), device_bound_batches=b.n - host, host_bound_batches=host,
        against=check,
    )


def _comparable(other: Trace, name: str, root: str | Path, run: Run, target: str, split: bool,
                comm: str | None) -> None:
    """Refuse, in one line, a run that is not of what is predicted: unfinished, the trace the
    prediction is made from, another mode, streams, parallel layout or comm setting, another
    workload, model (its architecture, sizes and dtype) or device."""
    from viewer.analysis.serving_boot import workload_digest

    if not other.status.complete:
        raise WhatIfError(f"--against: {name} is {other.status.state}, not a complete run: its numbers are not "
                          "the whole run's")
    if Path(other.root).resolve() == Path(root).resolve():
        raise WhatIfError(f"--against: {name} is the trace the prediction is made from")
    cfg = other.meta.get("config", {})
    mode = rounds_mode(cfg)
    if mode != target:
        raise WhatIfError(f"--against: {name} ran in {mode} mode; this prediction is of {target} mode")
    if split_on(cfg, str(cfg.get("mode", "serial"))) != split:
        raise WhatIfError(f"--against: {name} ran with split streams {'on' if not split else 'off'}; this "
                          f"prediction has them {'on' if split else 'off'}")
    layout = tp_pp(run.trace.meta.get("config", {}))
    if tp_pp(cfg) != layout:
        raise WhatIfError(f"--against: {name} ran with tp {tp_pp(cfg)[0]}, pp {tp_pp(cfg)[1]}; this trace with "
                          f"tp {layout[0]}, pp {layout[1]}")
    if trace_setting(other.meta) != comm:
        def said(c: str | None) -> str:
            return f"--comm-overlap {c}" if c else "no TP all-reduces to schedule (no TP, or with PP)"

        raise WhatIfError(f"--against: {name} ran with {said(trace_setting(other.meta))}; this prediction has "
                          f"{said(comm)}")
    # a served run knows no workload up front (no digest): then its requests are counted
    digests = [workload_digest(t.meta) for t in (run.trace, other)]
    n = other.table("requests", ["request_id"]).num_rows
    if None in digests and n != run.requests.num_rows:
        raise WhatIfError(f"--against: {name} holds {n} requests and this trace {run.requests.num_rows}: not the "
                          "same workload")
    mine, its = digests
    if mine is not None and its is not None and mine != its:
        raise WhatIfError(f"--against: {name} ran another workload (its digest {its[:12]}, this trace's {mine[:12]})")
    # the model by what it is, not by its path (a folder moves between machines)
    # weight_pack moves the device's time as a dtype does; traces from before it have none
    for what, where, keys in (("model", "model", ("architecture", "num_layers", "hidden_size", "vocab_size", "dtype",
                                                  "weight_pack")),
                              ("device", "host", ("device",)), ("device backend", "config", ("cpu_device",))):
        a, b = run.trace.meta.get(where, {}), other.meta.get(where, {})
        differ = [f"{k} {b.get(k)} against {a.get(k)}" for k in keys if b.get(k) != a.get(k)
                  and not (k == "weight_pack" and None in (a.get(k), b.get(k)))]
        if differ:
            raise WhatIfError(f"--against: {name} ran another {what} ({'; '.join(differ)})")


def _check(other: Trace, name: str, predicted: Figures, lo: Figures, hi: Figures) -> Check:
    """The prediction beside `other`, a run of what it predicts (`_comparable`)."""
    m = _measured(other)
    got, p, low, high = (f.array() for f in (m, predicted, lo, hi))
    has = ~np.isnan(got) & ~np.isnan(p)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.where(has & (got != 0), 100 * (p / got - 1), np.nan)
    bounded = has & ~np.isnan(low) & ~np.isnan(high)
    inside = bounded & (low <= got) & (got <= high)
    names = [f.name for f in fields(Figures)]
    return Check(name, rounds_mode(other.meta.get("config", {})), m, Figures.of(err),
                 {k: bool(inside[i]) if bounded[i] else None for i, k in enumerate(names)},
                 int(inside.sum()), int(bounded.sum()))


def _interval(own: np.ndarray, table: np.ndarray, point: np.ndarray) -> tuple[Figures, Figures]:
    """The 95% interval of what a run of the prediction measures: the prediction plus the
    spread of `own[i] - table[j]` over all pairs. A measured run differs from the prediction
    by its own rounds' noise (`own`: replicates at the probe's medians) less the noise the
    prediction inherited from the trace's rounds and the probe (`table`: replicates, each with
    one of the probe's measurements). Differences of replicates, not their spread about the
    median: noise drawn onto other batches lengthens a chain of max()es more than the trace's
    own noise lengthened its run, so the replicates' middle is not the prediction, and the
    difference of two cancels that shift."""
    diff = (own[:, None, :] - table[None, :, :]).reshape(-1, own.shape[1])
    q = np.percentile(diff, (2.5, 97.5), axis=0)
    # every figure is a time or a rate: a spread wider than the point stops at 0 (TTFT p50 read
    # -26 to 89 ms on a short, noisy trace)
    return Figures.of(np.maximum(point + q[0], 0.0)), Figures.of(point + q[1])


def _comm_asked(run: Run, now: str | None, asked: str | None) -> None:
    """`--comm-overlap asked` refused where it is no setting or the trace has none to change."""
    if asked not in (None, "on", "off"):
        raise WhatIfError(f"--comm-overlap must be on or off, not {asked!r}")
    if asked is not None and now is None:
        tp, pp = tp_pp(run.trace.meta.get("config", {}))
        raise WhatIfError("--comm-overlap predicts the all-reduces of a TP trace with one pipeline stage; "
                          f"this one has tp {tp}, pp {pp}")


def _comm(run: Run, b: Batches, now: str | None, asked: str | None, contention: float) -> Batches:
    """The batches with their all-reduces as `--comm-overlap asked` (`_comm_asked`) would run them."""
    return b if asked is None or asked == now else with_comm_overlap(run, b, asked == "on", contention)


def _backend(tr: Trace) -> str:
    from viewer.analysis.advice import backend

    return backend(tr.meta, None).name


def replayed_path(root: str | Path, window: Window | None = None) -> list[PathRow] | None:
    """The critical path of the run as it ran (the model's fit; no intervals), for the HTML
    report; of `window`'s rounds where given (`gains_window`: a long trace's); None where the
    model cannot read the trace, or it is too long to replay whole and no window is given."""
    from viewer.analysis.whatif_gains import GAINS_MAX_ROUNDS

    try:
        run = load(root, GAINS_MAX_ROUNDS if window is None else None, window)  # (a window is bounded already)
    except WhatIfError:
        return None
    overlap = rounds_mode(run.trace.meta.get("config", {})) == "overlap"
    b, tl = replayed(run, measured(run.trace.meta)[0], overlap)
    return _path_table(b, tl)


def _device_busy(tl: Timeline) -> float:
    """ns the device worked: the union of its work's stretches (two streams' parts overlap)."""
    iv = tl.busy[~np.isnan(tl.busy[:, 0])]
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    before = np.maximum.accumulate(np.concatenate([[-np.inf], iv[:-1, 1]]))
    return float(np.maximum(iv[:, 1] - np.maximum(iv[:, 0], before), 0.0).sum())


def _path_table(b: Batches, tl: Timeline) -> list[PathRow]:
    """The critical path per boundary, ms per round, largest first."""
    path = critical_path(b, tl)
    # of the two inputs of a max() (L or T: what held the batch's start; C or W: its collect)
    # only the one it took is time the run spent; counting both showed the barrier slack it
    # does not have (a speedup of it "within its slack" still lengthened the run)
    by_c = tl.dev_end + b.C >= tl.launched[tl.collect_round] + b.W
    taken = {"L": np.where(tl.held, 0.0, b.L), "T": np.where(tl.held, np.maximum(b.T, 0), 0.0),  # (as the path counts them)
             "C": np.where(by_c, b.C, 0.0), "W": np.where(by_c, 0.0, b.W)}
    # overlap's rounds that launch or collect nothing: their intake and their hand-off
    drains, fresh = tl.launches < 0, tl.collects < 0
    taken["P_book"] = np.append(b.P_book, b.tail_P[tl.collects[drains]])
    for k, name in enumerate(POST):
        taken[name] = np.append(getattr(b, name), b.head[tl.launches[fresh], k])
    rows: dict[str, list[float]] = {}
    for comp in (*COMPONENTS, "idle"):
        if comp == "D_pre":  # inside the batches' device spans, which D's row counts
            continue
        total = path["idle"] if comp == "idle" else _device_busy(tl) - float(b.A.sum()) if comp == "D" \
            else float(taken[comp].sum()) if comp in taken else float(getattr(b, comp).sum())
        r = rows.setdefault(COMPONENT_BOUNDARY[comp], [0.0, 0.0])
        r[0] += total
        r[1] += path[comp]
    per = tl.rounds * 1e6
    return [PathRow(k, total / per, on / per, max(total - on, 0.0) / per)
            for k, (total, on) in sorted(rows.items(), key=lambda kv: -kv[1][1]) if total > 0]


__all__ = ["MODES", "Check", "Speedup", "WhatIfError", "WhatIfResult", "whatif"]

