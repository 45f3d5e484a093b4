"""The trace cut into the round model's components (viewer/analysis/whatif_model.py):
which constraint held each moment back, and what the trace shows of the other (docs/whatif.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probes import boundaries as B
from tracing.reader import Trace
from viewer.analysis.whatif_model import COLD_GAP_NS, Batches
from viewer.analysis.whatif_streams import rounds_mode, split_on
from viewer.export.window import Window, first_of_last, table_in, with_run_edges


class WhatIfError(ValueError):
    """A trace or a question the model cannot answer; str(e) is one line."""


def tp_pp(cfg: dict[str, Any]) -> tuple[int, int]:
    """The run's tensor- and pipeline-parallel sizes, from its meta.json's config."""
    return int(cfg.get("tp", 1) or 1), int(cfg.get("pp", 1) or 1)


@dataclass(slots=True)
class Run:
    """What the model needs from a trace: the batches, and how tokens map onto them."""

    batches: Batches
    t0: int  # the first round's start, ns
    collect_round: np.ndarray  # per batch: the step number of the round that collected it
    batch_step: np.ndarray  # per batch: the step number of the round that launched it
    dev_start: np.ndarray  # per batch: its device work's first start over rank 0's streams, ns
    dev_end: np.ndarray  # ... and its last end
    broadcast: np.ndarray  # per batch: rank 0's broadcast of it to the other ranks (TP, PP), ns
    steps: np.ndarray  # every round's step number
    requests: pa.Table
    trace: Trace
    first_idx: np.ndarray  # per served request: the index (into steps) of its first token's round
    last_idx: np.ndarray  # ... of its last token's round
    arrival: np.ndarray  # per served request, ns
    output_tokens: int
    # the report's duration runs over every request row, the unserved (rejected, aborted
    # before a token) too, which no prediction moves: their earliest arrival, latest finish
    unserved_bounds: tuple[int, int] | None
    split: bool  # decodes and prefills ran on two streams (overlap mode's (b))
    decode_tokens: np.ndarray  # per batch
    prefill_tokens: np.ndarray  # per batch
    parts: np.ndarray  # per batch, split streams: main start, main end, prefill start, prefill end (nan: none)
    cold_at: np.ndarray  # per batch: its main (or only) part, its prefill part began on an idle device
    window: Window | None = None  # the rounds modelled (whatif --rounds/--time); None: the whole run
    left_out: int = 0  # a window's requests that began before it or ended after it (not in `requests`)
    probes: pa.Table | None = None  # a window's probe rows (its measured cycle), as `_rows` read them

    def table(self, name: str, columns: list[str]) -> pa.Table:
        """The trace's table, whole or only the rows that reach the window."""
        return table_in(self.trace, name, columns, self.window)


PROBE_COLUMNS = ["ts_ns", "dur_ns", "boundary", "stream", "rank", "step"]


def _rows(p: pa.Table) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rank 0's rows per boundary: (step, ts, end). Rank 0 hands the tokens to the scheduler, so
    its device rows span a TP or PP batch: its own work and its waits for the other ranks (the
    all-reduces, on its comm stream; the pipeline's later stages, inside its pp_bubble)."""
    p = p.filter(pc.equal(p["rank"], 0))
    on_thread = pc.is_in(p["stream"], pa.array(["host", "main", "prefill"]))
    out = {}
    comm = pc.equal(p["stream"], "comm")
    for b in (B.BOOKKEEPING, B.BATCH_PREPARE, B.RESPONSE_SEND, B.DEFRAG, B.IDLE, B.DEVICE_COMPUTE,
              B.SCHEDULER_BARRIER, B.ALL_REDUCE, B.BATCH_BROADCAST):
        t = p.filter(pc.and_(pc.equal(p["boundary"], b), comm if b in (B.ALL_REDUCE, B.BATCH_BROADCAST) else on_thread))
        ts = t["ts_ns"].to_numpy()
        out[b] = (t["step"].to_numpy(), ts, ts + t["dur_ns"].to_numpy())
    for stream in ("main", "prefill"):  # split streams: each batch's part on each
        t = p.filter(pc.and_(pc.equal(p["boundary"], B.DEVICE_COMPUTE), pc.equal(p["stream"], stream)))
        ts = t["ts_ns"].to_numpy()
        out[f"{B.DEVICE_COMPUTE}@{stream}"] = (t["step"].to_numpy(), ts, ts + t["dur_ns"].to_numpy())
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


def _cold_starts(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Which stretches of device work (nan: none) began after the device had idled COLD_GAP_NS
    or more (the first always)."""
    ok = ~np.isnan(start)
    order = np.flatnonzero(ok)[np.argsort(start[ok], kind="stable")]
    before = np.maximum.accumulate(np.concatenate([[-np.inf], end[order][:-1]]))
    out = np.zeros(len(start), dtype=bool)
    out[order] = start[order] - before >= COLD_GAP_NS
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


# A latency seen on fewer batches than this is no estimate where the other was seen on more
# (a median of one to four read -3.6 to +1.8 ms where a hundred batches of the other agreed)
MIN_SEEN = 5


def _hand_over_guesses(L_seen: np.ndarray, T_seen: np.ndarray, by_launch: np.ndarray) -> tuple[float, float]:
    """The L guessed for the batches the device held back, and the T for those their launch
    held: the median of the batches that showed it; where fewer than MIN_SEEN did and the
    other was seen on more, the other's median (the device picking up work after a launch or
    after its last batch: a serial run never waits on its device, an overlap run's device is
    busy at nearly every launch). Not the first batch's L: its launch wakes a device idle
    since start-up, never the typical hand-over (an overlap run often holds that batch alone
    by its launch: its one sample read 0.03-1.1 ms where the serial runs of the same
    workloads showed 0.05-0.16)."""
    L_s, T_s = L_seen[1:][by_launch[1:]], T_seen[~by_launch]

    def guess(own: np.ndarray, other: np.ndarray) -> float:
        if len(own) >= MIN_SEEN or len(own) >= len(other):
            got = _median(own)
            assert got is not None  # two batches or more: the second was held by one or the other
            return got
        # borrowed, a hand-over's: never negative (in a split trace T is mostly negative, a
        # batch's prefill begun beside the batch before; as every batch's L its median put
        # prefills 6.6 ms before their launch)
        return max(float(np.median(other)), 0.0)

    return guess(L_s, T_s), guess(T_s, L_s)



def _drains(overlap: bool, b_idx: np.ndarray, pre_book: np.ndarray, post: np.ndarray, left: np.ndarray,
            queued: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Overlap's rounds that launch or collect nothing (`Batches.drained`, `head`, `tail_P`).
    An overlap trace shows them: a batch whose next round launched nothing. A serial trace
    has none, but an overlap run of it would after each batch that left no request running
    or waiting (`left`, counted at the round's end) and none arrived by then (`queued`: one
    of the next batch's requests did; the count misses those still on the tokenizer's
    queue). The draining round's intake and the next round's hand-off, which that trace
    never ran, are its rounds' medians. `post`: per round, its POST parts (n x 4)."""
    if overlap:
        drained = np.append(b_idx[1:] != b_idx[:-1] + 1, True)
        fresh = np.concatenate([[True], drained[:-1]])
        return (drained, np.where(fresh[:, None], post[b_idx], 0.0).astype(np.float64),
                np.where(drained, pre_book[b_idx + 1], 0.0).astype(np.float64))
    drained = np.append((left[:-1] == 0) & ~queued[1:], True)
    fresh = np.concatenate([[True], drained[:-1]])
    return (drained, np.where(fresh[:, None], np.median(post[b_idx], axis=0), 0.0),
            np.where(drained, float(np.median(pre_book[b_idx])), 0.0))


REQUEST_COLUMNS = ["arrival_ns", "first_scheduled_ns", "output_len", "token_runs", "finish_ns"]
# and what a window's own measured figures read (the report's serving_metrics)
WINDOW_REQUEST_COLUMNS = ["first_token_ns", "prompt_len", "finish_reason", "num_preemptions"]


def _token_rounds(rq: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request, how many token runs it has, and of the served (runs > 0) their first and
    last token's rounds (step numbers)."""
    runs = rq["token_runs"]
    lens = pc.list_value_length(runs).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(runs).to_numpy()
    ends = np.cumsum(lens)[lens > 0]
    served = lens[lens > 0]
    return lens, flat[ends - served], flat[ends - 2] + flat[ends - 1] - 1


def _within(rq: pa.Table, t0: int, end: int, first_collect: int, last_collect: int) -> np.ndarray:
    """The requests a window holds whole: admitted by one of its rounds (from `t0`, the first
    one's start), every token collected by one of its batches; one that got none, arrived and
    finished inside it. A request queued before the window counts where the window admitted it:
    its wait is fixed, as every arrival is in the model."""
    lens, first_round, last_round = _token_rounds(rq)
    served = lens > 0
    keep = np.zeros(rq.num_rows, dtype=bool)
    keep[served] = ((rq["first_scheduled_ns"].to_numpy()[served] >= t0) & (first_round >= first_collect)
                    & (last_round <= last_collect))
    fin, arr = rq["finish_ns"].to_numpy()[~served], rq["arrival_ns"].to_numpy()[~served]
    keep[~served] = (arr >= t0) & (fin > 0) & (fin <= end)
    return keep


def _refuse_long(tr: Trace, max_rounds: int) -> None:
    """A run of more than `max_rounds` rounds, refused in one line that names a window of its last
    ones, counted from the manifest (its probe rows and its steps' other columns never read)."""
    parts = tr.parts.get("steps", [])
    if any(p.rows is None for p in parts) or sum(p.rows or 0 for p in parts) <= max_rounds:
        return  # (a legacy trace's are counted once read)
    step = tr.table("steps", ["step"])["step"].to_numpy()  # (the last rounds by row: see first_of_last)
    raise WhatIfError(f"{tr.root} has {len(step):,} rounds; the model replays each round hundreds of times and "
                      f"takes at most {max_rounds:,}: give it a window of them, as --rounds "
                      f"{first_of_last(step, max_rounds)}-{int(step.max())} (the last ones) or --time START-END")


def _unserved_bounds(rq: pa.Table, served: np.ndarray) -> tuple[int, int] | None:
    if served.all():
        return None
    arr, fin = rq["arrival_ns"].to_numpy()[~served], rq["finish_ns"].to_numpy()[~served]
    return int(arr.min()), int(fin.max())


STEP_COLUMNS = ["step", "mode", "ts_ns", "dur_ns", "collect_ns", "num_decode_tokens", "num_prefill_tokens",
                "num_waiting", "num_running"]


def load(root: str | Path, max_rounds: int | None = None, window: Window | None = None) -> Run:
    """The run's rounds fitted; `max_rounds`: refused past that many (before its probe rows are read).
    `window` (`parse_window`'s, one span of whole rounds): only its rounds, and only the requests
    that it admitted and whose every token it collected (`Run.left_out`: the others)."""
    tr = Trace.open(root)
    if "import" in tr.meta:
        imp = tr.meta["import"]
        what = ("request spans received over OTLP" if isinstance(imp, dict) and imp.get("format") == "otlp"
                else "an imported profiler trace")
        raise WhatIfError(f"{root} is {what}: its rounds have no launch and collect moments for the model; "
                          "whatif reads traces of mstrace run/serve")
    if not tr.meta.get("config", {}).get("probes", True):
        raise WhatIfError(f"{root} was recorded with --no-probes: the model is fitted to each round's probe rows")
    if window is not None and len(window.spans) != 1:
        raise WhatIfError(f"whatif models consecutive rounds: {window.what} is {len(window.spans)} stretches")
    if window is None and max_rounds is not None:
        _refuse_long(tr, max_rounds)
    s = table_in(tr, "steps", STEP_COLUMNS, window)
    if s.num_rows < 2:
        raise WhatIfError(f"{root} has {s.num_rows} round(s){' in ' + window.what if window else ''}: nothing to model")
    if max_rounds is not None and s.num_rows > max_rounds:
        raise WhatIfError(f"{root}'s {window.what if window else 'run'} holds {s.num_rows:,} rounds; the model "
                          f"replays each round hundreds of times and takes at most {max_rounds:,}: a shorter "
                          f"window (--rounds A-B, --time START-END)")
    order = pc.sort_indices(s, [("step", "ascending")])
    s = s.take(order)
    steps = s["step"].to_numpy()
    start = s["ts_ns"].to_numpy()
    housekept = start + s["dur_ns"].to_numpy()
    collect = s["collect_ns"].to_numpy()
    overlap = rounds_mode(tr.meta.get("config", {})) == "overlap"
    probes = table_in(tr, "probes", PROBE_COLUMNS, with_run_edges(window)) if window is not None else \
        tr.table("probes", PROBE_COLUMNS, dictionary=("boundary", "stream"))
    rows = _rows(probes)
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
    _, it_ts, it_end = rows[B.IDLE]
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
    if col[-1] >= len(steps) and window is not None:  # collected after the window: not in it
        b_idx, col = b_idx[:-1], col[:-1]
        if len(b_idx) < 2:
            raise WhatIfError(f"{root}: {window.what} holds {len(b_idx)} whole batch(es): nothing to model")
    if col[-1] >= len(steps):
        raise WhatIfError(f"{root} ends before its last batch was collected (a truncated run)")
    dev_s = dev_first[b_idx].astype(np.float64)
    dev_e = dev_last[b_idx].astype(np.float64)
    if np.any(dev_e <= 0):
        raise WhatIfError(f"{root} has batches without device_compute rows: the model needs the device view")
    # A batch starts once launched (after L) and once the device is done with the one before
    # (after T); the trace shows the one that held it back, the other is guessed
    prev_e = np.concatenate([[-np.inf], dev_e[:-1]])
    lb = launched[b_idx]
    by_launch = lb >= prev_e
    L_seen, T_seen = dev_s - lb, dev_s - prev_e
    L, T = _held_back(L_seen, T_seen, by_launch, *_hand_over_guesses(L_seen, T_seen, by_launch))
    split = split_on(tr.meta.get("config", {}), s["mode"][0].as_py())
    # L < 0 is kept: one batch_prepare row holds a split round's two launches, whose first part
    # can start before the row ends; and on one stream the device can start before the row's
    # end is stamped (the host descheduled after its send). Clamped to 0, a serial replay ran
    # long by their sum (+9.5% on a process-device trace at --rate 20). Never before the row began.
    L = np.maximum(L, -prep[b_idx])
    span = dev_e - dev_s
    T = np.maximum(T, -np.concatenate([[0.0], span[:-1]]))
    A = np.minimum(_per_step(rows[B.ALL_REDUCE], steps, "sum")[b_idx], span)
    D, D_pre = span - A, np.zeros(len(b_idx))
    parts = np.full((len(b_idx), 4), np.nan)
    if split:  # each stream's part as it ran, beside the other's (whatif_streams undoes that)
        for at, stream in ((0, "main"), (2, "prefill")):
            rs = rows[f"{B.DEVICE_COMPUTE}@{stream}"]
            lo, hi = _per_step(rs, steps, "first")[b_idx], _per_step(rs, steps, "last")[b_idx]
            has = hi > 0
            parts[has, at], parts[has, at + 1] = lo[has], hi[has]
        D, D_pre = (np.nan_to_num(parts[:, c + 1] - parts[:, c]) for c in (0, 2))
        # T: the main stream's turn, from the end of the batch before (both its parts: the
        # decodes wait for the prompts it finished) to this batch's decodes
        before = np.concatenate([[-np.inf], np.fmax(parts[:-1, 1], parts[:-1, 3])])
        by_device = np.isfinite(parts[:, 0]) & (before > lb)
        med = _median((parts[:, 0] - before)[by_device])
        T = np.where(by_device, parts[:, 0] - before, med if med is not None else T)
        T = np.maximum(np.nan_to_num(T), 0.0)
        cold_at = _cold_starts(parts[:, [0, 2]].ravel(), parts[:, [1, 3]].ravel()).reshape(-1, 2)
    else:
        cold_at = np.column_stack([_cold_starts(dev_s, dev_e), np.zeros(len(b_idx), dtype=bool)])
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
    rq = table_in(tr, "requests", REQUEST_COLUMNS + (WINDOW_REQUEST_COLUMNS if window is not None else []), window)
    t0 = int(start[0])
    not_before = np.zeros(len(b_idx))
    fs = rq["first_scheduled_ns"].to_numpy()
    arr = rq["arrival_ns"].to_numpy()
    # (not a request a round after the last batch admitted: a window's next round, or overlap's
    # last round, whose batch is not in it, would hold the last one back until its arrival)
    after = min(int(start[b_idx[-1] + 1]) if b_idx[-1] + 1 < len(start) else np.iinfo(np.int64).max,
                int(window.spans[0][1]) if window is not None else np.iinfo(np.int64).max)
    has = (fs > 0) & (fs < after)
    rb = np.searchsorted(start[b_idx], fs[has], side="right") - 1
    ok = rb >= 0
    np.maximum.at(not_before, rb[ok], (arr[has][ok] - t0).astype(np.float64))
    # per batch: one of the requests it admits had arrived by the end of the round before it
    ended = np.concatenate([[-np.inf], (sent - t0)[b_idx][:-1]])
    queued = np.zeros(len(b_idx), dtype=bool)
    np.logical_or.at(queued, rb[ok], (arr[has][ok] - t0) <= ended[rb[ok]])
    drained, head, tail_P = _drains(overlap, b_idx, pre_book, np.column_stack([post_book, send, defrag, gap]),
                                    (s["num_waiting"].to_numpy() + s["num_running"].to_numpy())[b_idx], queued)
    bt = Batches(P_book=pre_book[b_idx], P_prep=prep[b_idx].astype(np.float64), L=L, T=T, D=D, A=A, D_pre=D_pre,
                 C=C, W=W,
                 Q_book=post_book[col], Q_send=send[col].astype(np.float64), Q_defrag=defrag[col].astype(np.float64),
                 G=gap[col].astype(np.float64), not_before=np.maximum(not_before, 0), drained=drained,
                 head=head, tail_P=tail_P)
    whole = rq.num_rows
    if window is not None:  # what the window's batches admitted and served in full
        rq = rq.filter(_within(rq, t0, int(window.spans[0][1]), int(steps[col[0]]), int(steps[col[-1]])))
    lens, first_round, last_round = _token_rounds(rq)
    served = lens > 0
    if not served.any() and window is not None:
        raise WhatIfError(f"{root}: no request was both admitted and served in full in {window.what}: nothing to "
                          "predict (a longer window)")
    if not served.any():
        raise WhatIfError(f"{root} served no tokens: nothing to predict")
    broadcast = _per_step(rows[B.BATCH_BROADCAST], steps, "sum")[b_idx]
    return Run(bt, t0, steps[col], steps[b_idx], dev_s, dev_e, broadcast, steps, rq, tr, np.searchsorted(steps, first_round),
                np.searchsorted(steps, last_round), rq["arrival_ns"].to_numpy()[served],
                int(rq["output_len"].to_numpy()[served].sum()), _unserved_bounds(rq, served), split,
                s["num_decode_tokens"].to_numpy()[b_idx].astype(np.float64),
                s["num_prefill_tokens"].to_numpy()[b_idx].astype(np.float64), parts, cold_at, window,
               whole - rq.num_rows, probes if window is not None else None)
