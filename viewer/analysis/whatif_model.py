"""The round as a small timing model, fitted to one trace (docs/whatif.md).

Every batch b carries these measured durations:

  P  prepare   round start -> launch done (bookkeeping before the launch, batch_prepare)
  L  launch    launch done -> the device starts b (the hand-over to the device)
  T  turn      the device ends b-1 -> it starts b (negative: b began on another stream
               while b-1 still ran, as a prefill stream does beside decodes)
  D  device    b's device work on rank 0, first start to last end over its streams, less A
               (TP, PP: rank 0's span holds its waits for the other ranks)
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
  start[r+1]  = max(synced[r] + Q[r-1] + G[r-1], arrival of r+1's new requests)

Overlap's first round collects nothing (its post work is `head_Q`) and its last launches
nothing (its prepare is `tail_P`).

The batches themselves (who runs in which round) are the trace's: the model moves
moments, not requests. Each token's time is its batch's `synced`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# The boundaries a speedup may name, and the component each scales.
SCALES: dict[str, tuple[str, ...]] = {
    "device_compute": ("D",),
    "all_reduce": ("A",),  # TP's collectives, as far as the device span waited on them
    "batch_prepare": ("P_prep",),
    "bookkeeping": ("P_book", "Q_book"),
    "response_send": ("Q_send",),
    "defrag": ("Q_defrag",),
    "scheduler_barrier": ("L", "T", "C", "W"),  # the barrier's own cost: hand-over and wake-up latency, not the device's work
    "unattributed": ("G",),
}


@dataclass(slots=True)
class Batches:
    """Per batch b (the round that launched it), in ns. Rounds that launched nothing
    (overlap's last, draining round) have no batch; their prepare time is in `tail_P`."""

    P_book: np.ndarray
    P_prep: np.ndarray
    L: np.ndarray
    T: np.ndarray  # at least -D of the batch before: a batch never starts before that one did
    D: np.ndarray
    A: np.ndarray  # exposed collective waits inside the batch's device span (0 on one rank)
    C: np.ndarray
    W: np.ndarray
    Q_book: np.ndarray
    Q_send: np.ndarray
    Q_defrag: np.ndarray
    G: np.ndarray
    not_before: np.ndarray  # the latest arrival among the requests the batch admits (0: none)
    head_Q: float  # overlap's first round: hand-off and gap, with nothing collected
    tail_P: float  # overlap's draining round: intake, with nothing launched

    @property
    def n(self) -> int:
        return len(self.D)

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
            return replace(self, **{k: np.where(v > 0, v * factor, v) for k, v in parts.items()})
        total = sum(np.maximum(v, 0) for v in parts.values())
        safe = np.where(total > 0, total, 1.0)
        out = {}
        for k, v in parts.items():
            share = np.where(total > 0, np.maximum(v, 0) / safe, 1.0 / len(parts))
            out[k] = np.where(v >= 0, np.maximum(v + float(delta_ns or 0) * share, 0.0), v)
        return replace(self, **out)


WINDOW = 9  # batches in the running median a batch's noise is measured against


def replicates(b: Batches, rng: np.random.Generator, k: int) -> list[Batches]:
    """`k` runs the trace could as well have been, for the intervals: each component's value
    per batch is its local level (the running median over WINDOW batches: neighbouring
    batches are alike in size) times another batch's ratio to its own level, drawn with
    replacement. T, which can be negative, takes another batch's difference instead. The
    batches, arrivals and the run's level stay the trace's: run-to-run drift is not in it."""
    parts = {}
    for name in COMPONENTS:
        x = getattr(b, name)
        pad = np.pad(x, WINDOW // 2, mode="edge")
        level = np.median(np.lib.stride_tricks.sliding_window_view(pad, WINDOW), axis=1)
        if name == "T":
            parts[name] = (level, x - level, True)
        else:
            ok = level > 0
            parts[name] = (level, np.where(ok, x / np.where(ok, level, 1.0), 1.0), False)
    out = []
    for _ in range(k):
        idx = rng.integers(0, b.n, b.n)
        new = {}
        for name, (level, noise, additive) in parts.items():
            drawn = level + noise[idx] if additive else np.where(level > 0, level * noise[idx], getattr(b, name))
            new[name] = drawn
        out.append(replace(b, **new))
    return out


@dataclass(slots=True)
class Timeline:
    """Predicted moments, ns from the first round's start. `start` and `launched` have one
    entry per round (overlap's draining round last); the rest one per batch."""

    start: np.ndarray
    launched: np.ndarray
    dev_start: np.ndarray
    dev_end: np.ndarray
    synced: np.ndarray  # the batch's tokens are on the host
    end: float  # the last round's hand-off plus its gap

    @property
    def rounds(self) -> int:
        return len(self.start)


def simulate(b: Batches, overlap: bool) -> Timeline:
    """The moments of every round and batch (overlap: `whatif_share.shared` first where host
    and device slow each other)."""
    n = b.n
    P, Q = b.P, b.Q
    rounds = n + 1 if overlap else n
    start, launched = np.zeros(rounds), np.zeros(rounds)
    dev_start, dev_end, synced = np.zeros(n), np.zeros(n), np.zeros(n)
    t = 0.0
    for i in range(rounds):
        t = max(t, b.not_before[i]) if i < n else t
        start[i] = t
        launched[i] = t + (P[i] if i < n else b.tail_P)
        if i < n:
            dev_start[i] = max(launched[i] + b.L[i], dev_end[i - 1] + b.T[i] if i else 0.0)
            dev_end[i] = dev_start[i] + b.D[i] + b.A[i]
        j = i - 1 if overlap else i  # the batch this round collects
        if j < 0:
            t = launched[i] + b.head_Q  # overlap's first round: nothing to collect yet
            continue
        synced[j] = max(launched[i] + b.W[j], dev_end[j] + b.C[j])
        t = synced[j] + Q[j] + b.G[j]
    return Timeline(start, launched, dev_start, dev_end, synced, t)


def busy_ns(b: Batches, tl: Timeline) -> float:
    """The run's length less its waits for arrivals (the report's cycles exclude them too)."""
    post = tl.synced + b.Q + b.G  # when each round handed off, so the next could start
    ends = post if tl.rounds == b.n else np.concatenate([[tl.launched[0] + b.head_Q], post])
    idle = tl.start - np.concatenate([[0.0], ends[:-1]])
    return tl.end - float(np.maximum(idle, 0).sum())


COMPONENTS = ("P_book", "P_prep", "L", "T", "D", "A", "C", "W", "Q_book", "Q_send", "Q_defrag", "G")


def critical_path(b: Batches, tl: Timeline, overlap: bool) -> dict[str, float]:
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

    def post(j: int) -> None:
        for k in ("Q_book", "Q_send", "Q_defrag", "G"):
            on[k] += getattr(b, k)[j]

    n = b.n
    j = n - 1
    post(j)
    while True:
        # batch j's tokens: round i collected them, once its own launch and the device were done
        i = j + 1 if overlap else j
        if tl.dev_end[j] + b.C[j] >= tl.launched[i] + b.W[j]:
            on["C"] += b.C[j]
            k, cut = j, 0.0
            while k > 0 and tl.dev_end[k - 1] + b.T[k] > tl.launched[k] + b.L[k]:
                device(k, cut)
                on["T"] += max(b.T[k], 0.0)
                cut = min(b.T[k], 0.0)  # k began before k-1 ended: only k-1's time until then is on the path
                k -= 1
            device(k, cut)
            on["L"] += b.L[k]
            i = k  # the device chain began with round k's launch
        else:
            on["W"] += b.W[j]
        if i < n:
            on["P_book"] += b.P_book[i]
            on["P_prep"] += b.P_prep[i]
        else:
            on["P_book"] += b.tail_P
        # round i began when the round before it handed off, or when its requests arrived
        prev = i - 2 if overlap else i - 1  # the batch whose post work ended round i-1
        ready = tl.synced[prev] + b.Q[prev] + b.G[prev] if prev >= 0 else (
            tl.launched[0] + b.head_Q if overlap and i == 1 else 0.0)
        if tl.start[i] > ready or i == 0:
            on["idle"] += tl.start[i] if i == 0 or tl.start[i] > ready else 0.0
            break
        if overlap and i == 1:  # round 0 collected nothing: its launch and hand-off ended it
            on["Q_book"] += b.head_Q
            on["P_book"] += b.P_book[0]
            on["P_prep"] += b.P_prep[0]
            on["idle"] += tl.start[0]
            break
        j = prev
        post(j)
    return on
