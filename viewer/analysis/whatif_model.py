"""The round as a small timing model, fitted to one trace (docs/whatif.md).

Every batch b carries these measured durations:

  P  prepare   round start -> launch done (bookkeeping before the launch, batch_prepare)
  L  launch    launch done -> the device starts b (the hand-over to the device)
  T  turn      the device ends b-1 -> it starts b (negative: b began on another stream
               while b-1 still ran, as a trace's prefill stream did beside decodes); with
               split streams, the main stream's turn: b-1 (both parts) ends -> b's decodes start
  D  device    b's device work on rank 0, first start to last end over its streams, less A
               (TP, PP: rank 0's span holds its waits for the other ranks); with split
               streams, its main stream's part (the decodes) alone
  D_pre        with split streams, its prefill stream's part alone (0: none); one stream
               runs D + D_pre one after the other
  A  comm      rank 0's all-reduce waits inside that span (TP), so the device holds b for D + A
  C  collect   the device ends b -> the host holds b's tokens (the barrier's wake-up)
  W  reach     the collecting round's launch -> the host holds b's tokens, had the device
               been done (the host's way to the barrier and through it)
  Q  post      tokens held -> hand-off done (bookkeeping, defrag, response_send)
  G  gap       hand-off done -> the next round starts, less idle waits for arrivals

and two modes put them in order. Serial (and timeslice): P, L, D, C (or W, whichever ends
later), Q, G one after another. Overlap: round r prepares and launches batch r, then waits for batch r-1:

  launched[r] = start[r] + P[r]
  dev_start[r] = max(launched[r] + L[r], dev_end[r-1] + T[r])
  synced[r-1] = max(launched[r] + W[r-1], dev_end[r-1] + C[r-1])   (the barrier on r-1)
  start[r+1]  = max(synced[r-1] + Q[r-1] + G[r-1], arrival of r+1's new requests)

Overlap's first round collects nothing (its post work is `head`) and its last launches
nothing (its prepare is `tail_P`); so does every round after one that found nothing to launch
mid-run (`drained`: the running requests all finished with the batch in flight), which
collects that batch at once rather than with the next arrival's launch. Split streams
(`StreamShare`) put each batch's D and D_pre on two queues of their own (`two_streams`).

The batches themselves (who runs in which round) are the trace's: the model moves
moments, not requests. Each token's time is its batch's `synced`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

# The boundaries a speedup may name, and the component each scales.
SCALES: dict[str, tuple[str, ...]] = {
    "device_compute": ("D", "D_pre"),
    "all_reduce": ("A",),  # TP's collectives, as far as the device span waited on them
    "batch_prepare": ("P_prep",),
    "bookkeeping": ("P_book", "Q_book"),
    "response_send": ("Q_send",),
    "defrag": ("Q_defrag",),
    "scheduler_barrier": ("L", "T", "C", "W"),  # the barrier's own cost: hand-over and wake-up latency, not the device's work
    "unattributed": ("G",),
}
# Components that are the two inputs of one max(): a change per batch is shared between the
# groups in proportion to their size, and each input of a group takes its group's whole share
# (shared four ways, +1 ms on the barrier added 0.63 ms a round: half of it went to the inputs
# the max() did not take)
MAX_INPUTS: dict[str, tuple[tuple[str, ...], ...]] = {"scheduler_barrier": (("L", "T"), ("C", "W"))}


@dataclass(slots=True)
class Batches:
    """Per batch b (the round that launched it), in ns. Rounds that launched nothing
    (overlap's draining rounds) have no batch; their prepare time is the `tail_P` of the
    batch they collect."""

    P_book: np.ndarray
    P_prep: np.ndarray
    L: np.ndarray
    T: np.ndarray  # at least -D of the batch before: a batch never starts before that one did
    D: np.ndarray
    A: np.ndarray  # exposed collective waits inside the batch's device span (0 on one rank)
    D_pre: np.ndarray  # of its device work, what a prefill stream of its own runs (split streams)
    C: np.ndarray
    W: np.ndarray
    Q_book: np.ndarray
    Q_send: np.ndarray
    Q_defrag: np.ndarray
    G: np.ndarray
    not_before: np.ndarray  # the latest arrival among the requests the batch admits (0: none)
    # overlap: the batch is collected by a round that launches nothing (the last batch always;
    # mid-run, where its requests all finished with it and none was waiting), so the round
    # launching the next batch collects nothing
    drained: np.ndarray
    # overlap, where the round launching the batch collects nothing: that round's POST parts
    # (n x 4), its hand-off and gap
    head: np.ndarray
    tail_P: np.ndarray  # overlap, where the batch is drained: the draining round's intake
    cold: float = 0.0  # what a forward takes longer when the device idled COLD_GAP_NS or more before it

    @property
    def n(self) -> int:
        return len(self.D)

    @property
    def drains(self) -> np.ndarray:
        """Overlap: the batches a round launching nothing collects (`drained`, and the last)."""
        out: np.ndarray = np.append(self.drained[:-1], True)
        return out

    @property
    def fresh(self) -> np.ndarray:
        """Overlap: the round launching each batch collects nothing (the first, and after a drain)."""
        out: np.ndarray = np.concatenate([[True], self.drained[:-1]])
        return out

    @property
    def head_Q(self) -> np.ndarray:
        out: np.ndarray = self.head.sum(axis=1)
        return out

    @property
    def P(self) -> np.ndarray:
        out: np.ndarray = self.P_book + self.P_prep
        return out

    @property
    def Q(self) -> np.ndarray:
        out: np.ndarray = self.Q_book + self.Q_send + self.Q_defrag
        return out

    def sped_up(self, boundary: str, factor: float | None, delta_ns: float | None) -> Batches:
        """`boundary` times `factor`, or plus `delta_ns` per batch (floor 0), shared among
        its components in proportion to their size. A negative T (a batch begun beside the one
        before) is overlap, not cost: it stays as it is."""
        parts = {name: getattr(self, name) for name in SCALES[boundary]}
        if factor is not None:
            out = {k: np.where(v > 0, v * factor, v) for k, v in parts.items()}
        else:
            groups = MAX_INPUTS.get(boundary, tuple((k,) for k in parts))
            sizes = [np.maximum.reduce([np.maximum(parts[k], 0) for k in g]) for g in groups]
            total = sum(sizes)
            safe = np.where(total > 0, total, 1.0)
            out = {}
            for g, size in zip(groups, sizes, strict=True):
                share = np.where(total > 0, size / safe, 1.0 / len(groups))
                for k in g:
                    v = parts[k]
                    out[k] = np.where(v >= 0, np.maximum(v + float(delta_ns or 0) * share, 0.0), v)
        new = replace(self, **out)
        # a launch can start the device before its prepare row ends (L < 0), never before it began
        return replace(new, L=np.maximum(new.L, -new.P_prep))


POST = ("Q_book", "Q_send", "Q_defrag", "G")  # a round's work after its barrier, in order (`Batches.head`)


WINDOW = 9  # batches in the running median a batch's noise is measured against
# A forward that starts after the device idled this long pays `Batches.cold` (a serial round's
# host works 1-9 ms between two forwards; overlap's batches follow each other 0.2-0.4 ms apart)
COLD_GAP_NS = 500_000


def replicates(b: Batches, rng: np.random.Generator, k: int) -> Iterator[Batches]:
    """`k` runs the trace could as well have been, for the intervals: each component's value
    per batch is its local level (the running median over WINDOW batches of those that have
    it: neighbouring batches are alike in size) times another batch's ratio to its own level,
    drawn with replacement among the batches that have one (one draw for every component
    that all batches have, as a batch's components come together), the ratios scaled so that
    a replicate's total of each component is the trace's on average. A part of the device's
    work a batch does not have (0: no decodes or no prefill on split streams) stays 0. T and
    L, which can be negative, take another batch's difference instead, never below the
    trace's own least (0 where it had none below). The batches, arrivals and the run's level
    stay the trace's: run-to-run drift is not in it."""
    parts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None, float]] = {}
    for name in COMPONENTS:
        x = getattr(b, name)
        if name in ("T", "L"):  # either can be negative (L: a split round's first part)
            pad = np.pad(x, WINDOW // 2, mode="edge")
            level = np.median(np.lib.stride_tricks.sliding_window_view(pad, WINDOW), axis=1)
            parts[name] = (level, x - level, None, min(float(x.min()), 0.0))
            continue
        has = x > 0 if name in ("D", "D_pre") else np.ones(b.n, dtype=bool)
        pad = np.pad(np.where(has, x, np.nan), WINDOW // 2, mode="edge")
        with warnings.catch_warnings():  # a window where no batch has it: all nan, kept as is
            warnings.simplefilter("ignore", RuntimeWarning)
            level = np.nanmedian(np.lib.stride_tricks.sliding_window_view(pad, WINDOW), axis=1)
        level = np.where(has & (level > 0), level, 0.0)  # 0: kept as it is
        some = np.flatnonzero(level > 0)
        ratio = x[some] / level[some]
        # a ratio drawn onto another batch's level: where levels differ (a rare long gap among
        # short ones), the drawn total is not the trace's; scaled so that it is, on average
        drawn = float(ratio.mean() * level[some].sum()) if len(some) else 0.0
        ratio *= float(x[some].sum()) / drawn if drawn > 0 else 1.0
        parts[name] = (level, ratio, some, 0.0)
    for _ in range(k):  # one at a time: a replicate is every batch's components again
        idx = rng.integers(0, b.n, b.n)
        new = {}
        for name, (level, noise, has_it, floor) in parts.items():
            if has_it is None:  # additive, no lower than the trace went (one stream: L, T >= 0)
                new[name] = np.maximum(level + noise[idx], floor)
            elif len(has_it) == b.n:  # every batch has it: one draw for all components, as they come together
                new[name] = level * noise[idx]
            else:  # drawn among the batches that have it
                pick = noise[rng.integers(0, len(has_it), b.n)] if len(has_it) else np.ones(b.n)
                new[name] = np.where(level > 0, level * pick, getattr(b, name))
        yield replace(b, **new)


def round_plan(b: Batches, overlap: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per round, the batch it launches and the batch it collects (-1: none). Serial: round i
    both launches and collects batch i. Overlap: round i launches batch i and collects the
    one launched a round before, if any; a drained batch gets a round of its own that
    launches nothing (the last batch's always)."""
    if not overlap:
        r = np.arange(b.n)
        return r, r
    drained = b.drains
    launches = np.arange(b.n)
    rounds = np.insert(launches, np.flatnonzero(drained) + 1, -1)  # -1: a draining round
    collects = np.full(len(rounds), -1)
    at = np.flatnonzero(rounds >= 0)
    collects[at[~b.fresh]] = launches[~b.fresh] - 1  # launching i collects i-1 unless fresh
    collects[rounds < 0] = np.flatnonzero(drained)
    return rounds, collects


@dataclass(slots=True)
class Timeline:
    """Predicted moments, ns from the first round's start. `start`, `launched`, `ended`,
    `launches` and `collects` have one entry per round; the rest one per batch."""

    start: np.ndarray
    launched: np.ndarray
    ended: np.ndarray  # the round's hand-off plus its gap: the next round may start
    launches: np.ndarray  # the batch the round launches (-1: none, a draining round)
    collects: np.ndarray  # the batch it collects (-1: none)
    dev_start: np.ndarray
    dev_end: np.ndarray
    synced: np.ndarray  # the batch's tokens are on the host
    end: float  # the last round's hand-off plus its gap
    held: np.ndarray  # per batch: the device, not its launch, decided when it started
    turn: np.ndarray  # per batch: its start less the batch before's end (negative: begun beside it)
    busy: np.ndarray  # every stretch of device work: (start, end) rows, one a part (or a batch)

    @property
    def rounds(self) -> int:
        return len(self.start)

    @property
    def launch_round(self) -> np.ndarray:
        """Per batch: the round that launched it."""
        out: np.ndarray = np.flatnonzero(self.launches >= 0)
        return out

    @property
    def collect_round(self) -> np.ndarray:
        """Per batch: the round that collected it."""
        at = np.flatnonzero(self.collects >= 0)
        out: np.ndarray = at[np.argsort(self.collects[at], kind="stable")]
        return out


@dataclass(slots=True, frozen=True)
class StreamShare:
    """Split streams: while both run, the share of its own speed the main stream's decodes
    and the prefill stream's chunk each keep (0.5 and 0.5: no faster together than one after
    the other)."""

    main: float = 0.5
    prefill: float = 0.5


def two_streams(r0: float, main_end: float, pre_end: float, turn: float, main: float, pre: float,
                s: StreamShare) -> tuple[float, float, float, float]:
    """One split batch: its prefill part (`pre`, ns alone) starts at r0 on its own stream; its
    main part (`main`) `turn` after the main stream's last work (which runs alone until r0 and
    ends at `main_end` if nothing joins it) and the prefill stream's (`pre_end`: the prompts
    it finished decode now). While both streams work each goes at its share (a turn is no
    work: the prefill goes at full speed beside it). Returns when the main stream's earlier
    work ends, and the batch's main start, main end, prefill end (a part of 0 ends where it
    starts)."""
    rest = max(main_end - r0, 0.0)
    wait = turn if rest > 0 else max(max(main_end, pre_end) + turn - r0, 0.0)
    queue = [rest, wait if main > 0 else 0.0, main]  # work, turn, work
    ends = [r0, r0, r0]
    pre_left, pre_end, t = pre, r0, r0
    for k in range(3):
        left = queue[k]
        while left > 1e-9:
            if pre_left <= 0:
                t, left = t + left, 0.0
                break
            rate = 1.0 if k == 1 else s.main
            dt = min(left / rate, pre_left / (1.0 if k == 1 else s.prefill))  # until the first of the two ends
            left -= dt * rate
            pre_left -= dt * (1.0 if k == 1 else s.prefill)
            t += dt
            if pre_left <= 1e-9:
                pre_left, pre_end = 0.0, t
        ends[k] = t
    if pre_left > 0:
        pre_end = t + pre_left
    return ends[0], ends[1], ends[2], pre_end


def _cold(cold: float, work: float) -> float:
    """The cold start a part of `work` (ns, warm) pays: what the fit took off it
    (whatif_probe.warm takes at most half of a part as it ran)."""
    return min(cold, work)


def simulate(b: Batches, overlap: bool, split: StreamShare | None = None,
             cold_at: np.ndarray | None = None) -> Timeline:
    """`replay` (its doc) in C where the install built viewer/analysis/_kernels.c: the same
    timeline to the bit, 40-50x faster (the intervals replay every round 400 times)."""
    from viewer.analysis import native

    if not native.AVAILABLE:
        return replay(b, overlap, split, cold_at)
    launches, collects = round_plan(b, overlap)
    rows = [b.P, b.Q, b.head_Q, b.tail_P, b.not_before, b.L, b.T, b.D, b.D_pre, b.A, b.C, b.W, b.G]
    out_r, out_b, held, busy, end = native.replay_rounds(launches, collects, rows, b.cold, cold_at,
                                                         None if split is None else (split.main, split.prefill))
    start, launched, ended = out_r
    dev_start, dev_end, synced = out_b
    turns = dev_start - np.concatenate([[0.0], dev_end[:-1]])
    return Timeline(start, launched, ended, launches, collects, dev_start, dev_end, synced, end, held, turns,
                    busy.reshape(-1, 2))


def replay(b: Batches, overlap: bool, split: StreamShare | None = None,
           cold_at: np.ndarray | None = None) -> Timeline:
    """The moments of every round and batch (overlap: `whatif_share.shared` first where host
    and device slow each other). `split`: decodes and prefills on two streams; a batch's
    decodes wait for the prefill of the batch before (its finished prompts decode now).
    `cold_at` (per batch: its main part, its prefill part): which parts start cold, for a
    replay of the trace as it ran (the parts the fit took a cold start out of); None: those
    that start after the device idled COLD_GAP_NS, which a replay's gaps, rebuilt from the
    components, can put on the other side of the threshold from the trace's own."""
    n = b.n
    launches, collects = round_plan(b, overlap)
    rounds = len(launches)
    # Python floats, not numpy scalars: the loop replays every round hundreds of times for the
    # intervals, and a numpy element's look-up and arithmetic cost several times a float's
    P, Q, head_Q, tail_P, not_before = (x.tolist() for x in (b.P, b.Q, b.head_Q, b.tail_P, b.not_before))
    L, T, D, D_pre, A, C, W, G = (x.tolist() for x in (b.L, b.T, b.D, b.D_pre, b.A, b.C, b.W, b.G))
    cold_main = cold_at[:, 0].tolist() if cold_at is not None else None
    cold_pre = cold_at[:, 1].tolist() if cold_at is not None else None
    start, launched, ended = [0.0] * rounds, [0.0] * rounds, [0.0] * rounds
    dev_start, dev_end, synced = [0.0] * n, [0.0] * n, [0.0] * n
    held = [False] * n
    nan = float("nan")
    busy = [[nan, nan, nan, nan] for _ in range(n)]  # per batch: its main (or only) part, its prefill part
    main_end = pre_end = 0.0
    t = 0.0
    for r, (i, j) in enumerate(zip(launches.tolist(), collects.tolist(), strict=True)):
        t = max(t, not_before[i]) if i >= 0 else t
        start[r] = t
        launched[r] = t + (P[i] if i >= 0 else tail_P[j])
        if i >= 0:
            ready = launched[r] + L[i]
            idle_since = max(main_end, pre_end) if i else -math.inf  # the device's last work (one stream: main_end)
            if split is None:
                by_device = dev_end[i - 1] + T[i] if i else 0.0
                held[i] = by_device > ready
                dev_start[i] = max(ready, by_device)
                work = D[i] + D_pre[i] + A[i]
                starts_cold = cold_main[i] if cold_main is not None else dev_start[i] - idle_since >= COLD_GAP_NS
                cold = _cold(b.cold, D[i] + D_pre[i]) if starts_cold else 0.0  # the parts warm() took it from
                dev_end[i] = dev_start[i] + work + cold
                busy[i][0], busy[i][1] = dev_start[i], dev_end[i]
                main_end = max(main_end, dev_end[i])
            else:
                r0 = max(ready, pre_end)
                turn = T[i] if i else 0.0
                has_main, has_pre = D[i] + A[i] > 0, D_pre[i] > 0
                # the first part to start on an idle device pays the cold start: the prefill,
                # or the decodes where there is none (after the main stream's turn, if it idled)
                if cold_main is not None and cold_pre is not None:  # as the trace ran: each part as the fit found it
                    pre_cold, main_cold = has_pre and cold_pre[i], has_main and cold_main[i]
                else:
                    pre_cold = has_pre and r0 - idle_since >= COLD_GAP_NS
                    main_cold = has_main and not has_pre and max(r0, idle_since + turn) - idle_since >= COLD_GAP_NS
                c_pre = _cold(b.cold, D_pre[i]) if pre_cold else 0.0
                c_main = _cold(b.cold, D[i]) if main_cold else 0.0  # not the all-reduces: warm() took it from D
                before, m_start, m_end, p_end = two_streams(r0, main_end, pre_end, turn, D[i] + A[i] + c_main,
                                                            D_pre[i] + c_pre, split)
                if main_end > r0:  # the main stream still ran batch i-1 (a serial round never gets here)
                    dev_end[i - 1] = max(dev_end[i - 1], before)
                    busy[i - 1][1] = before
                if has_main:
                    busy[i][0], busy[i][1] = m_start, m_end
                if has_pre:
                    busy[i][2], busy[i][3] = r0, p_end
                # the batch's device time runs from the start of the part that ended last: the
                # decodes, held by the main stream or the prompts before them, or the prefill
                last_main = has_main and (m_end >= p_end or not has_pre)
                dev_start[i] = m_start if last_main else r0
                held[i] = dev_start[i] > ready
                dev_end[i] = m_end if last_main else p_end
                main_end = m_end if has_main else before
                pre_end = p_end if has_pre else pre_end
        if j < 0:  # overlap: nothing in flight to collect yet
            t = launched[r] + head_Q[i]
        else:
            synced[j] = max(launched[r] + W[j], dev_end[j] + C[j])
            t = synced[j] + Q[j] + G[j]
        ended[r] = t
    dev_s, dev_e = np.array(dev_start), np.array(dev_end)
    turns = dev_s - np.concatenate([[0.0], dev_e[:-1]])
    return Timeline(np.array(start), np.array(launched), np.array(ended), launches, collects, dev_s, dev_e,
                    np.array(synced), t, np.array(held), turns, np.array(busy).reshape(-1, 2))


def busy_ns(tl: Timeline) -> float:
    """The run's length less its waits for arrivals (the report's cycles exclude them too)."""
    idle = tl.start - np.concatenate([[0.0], tl.ended[:-1]])
    return tl.end - float(np.maximum(idle, 0).sum())


COMPONENTS = ("P_book", "P_prep", "L", "T", "D", "A", "D_pre", "C", "W", "Q_book", "Q_send", "Q_defrag", "G")


def critical_path(b: Batches, tl: Timeline) -> dict[str, float]:
    """ns of each component on the run's critical path, walked back from its end through
    whichever input each max() took. `idle`: waiting for requests to arrive. The values
    sum to the run's length; whatever is not on the path is slack."""
    on = dict.fromkeys((*COMPONENTS, "idle"), 0.0)
    D = tl.dev_end - tl.dev_start  # as simulated, A included

    def device(k: int, cut: float) -> None:
        """Batch k's device time up to `cut` before its end; A's share of it is A's."""
        x = D[k] + cut
        a = x * b.A[k] / D[k] if D[k] > 0 else 0.0
        on["A"] += a
        on["D"] += x - a

    def post(r: int) -> None:
        """Round r's hand-off and gap: its collect's, or, collecting nothing, its `head`."""
        j = int(tl.collects[r])
        for k, name in enumerate(POST):
            on[name] += getattr(b, name)[j] if j >= 0 else b.head[tl.launches[r], k]

    def prepare(r: int) -> None:
        i = int(tl.launches[r])
        if i < 0:  # a draining round: its intake
            on["P_book"] += b.tail_P[tl.collects[r]]
            return
        on["P_book"] += b.P_book[i]
        on["P_prep"] += b.P_prep[i]

    launch_round = tl.launch_round
    r = tl.rounds - 1
    post(r)
    while True:
        j = int(tl.collects[r])
        # batch j's tokens: round r collected them, once its own launch and the device were done
        if j >= 0 and tl.dev_end[j] + b.C[j] >= tl.launched[r] + b.W[j]:
            on["C"] += b.C[j]
            k, cut = j, 0.0
            while k > 0 and tl.held[k]:
                device(k, cut)
                on["T"] += max(tl.turn[k], 0.0)
                cut = min(tl.turn[k], 0.0)  # k began before k-1 ended: only k-1's time until then is on the path
                k -= 1
            device(k, cut)
            on["L"] += b.L[k]
            r = int(launch_round[k])  # the device chain began with round r's launch
        elif j >= 0:
            on["W"] += b.W[j]
        prepare(r)
        # round r began when the round before it handed off, or when its requests arrived
        if r == 0 or tl.start[r] > tl.ended[r - 1]:
            on["idle"] += tl.start[r]
            break
        r -= 1
        post(r)
    return on
