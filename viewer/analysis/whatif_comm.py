"""`whatif --comm-overlap on|off`: a TP trace's all-reduces rescheduled as the other setting
runs them (scheduler/parallel/tp.py, `TPRunner`), batch by batch, from rank 0's rows of the
`collectives` table (the rank that samples: its waits delay the tokens).

Off, rank 0 computes a segment, issues a layer's all-reduce and waits for it at once: a batch's
device span is its head (the batch's broadcast to the other ranks, once a batch), its segments
c_0 .. c_K and, between them, each collective's latency l_k as rank 0 saw it (issue to resume,
the peer's lateness included). On, the rows are cut at a sequence into micro-batches A and B,
and each waits only for its own collective of the op before:

    for k in 0 .. K-1:  A: wait A's collective k-1, compute a_k, issue (done l_k later)
                        B: wait B's collective k-1, compute b_k, issue
    then wait both, compute c_K on the re-joined rows (norm, logits, sampling)

A segment's cost is not proportional to its rows: each op has a fixed part (the launches, the
framework's per-op work) that a micro-batch pays again. Per op position k the trace's
segments are fitted as alpha_k + beta_k x (x: the collective's elements, proportional to the
rows), over every batch (an on trace sees both halves' sizes; an off trace, batches of many
sizes); a batch's own segment is then scaled by the fit's ratio, so its measured level stays.
The other assumptions: a micro-batch's collective takes as long as the whole batch's did (small
all-reduces are latency-bound; from an on trace, an op's whole collective takes the mean of
its halves' latencies), and the collectives' transport slows the compute beside it by the
`contention` share of their overlap (`stretched`): 0 for NCCL on its own SMs, more for gloo's
threads on the CPU emulation's shared cores (docs/whatif.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow.compute as pc

from tracing.reader import Trace
from viewer.analysis.whatif_fit import Run, WhatIfError, tp_pp
from viewer.analysis.whatif_model import Batches


@dataclass(slots=True)
class Segments:
    """One batch as rank 0 ran it: its compute segments (per micro-batch when split), the
    collective each ends with, and the tail after the last."""

    compute: np.ndarray  # [K] whole, or [K, 2] (A, B) when the trace split the batch
    numel: np.ndarray  # the same shape: each segment's collective's elements
    latency: np.ndarray  # the same shape, ns: issue -> completion (split), issue -> rank 0 resumes (whole)
    tail: float
    head: float  # the batch's broadcast, once a batch whatever the setting (not in compute[0])
    # split only: how long the other half's collective was still in flight when the segment
    # began (the share it overlapped, which a shared core charges the compute for)
    inflight: np.ndarray | None = None

    def alone(self, contention: float) -> np.ndarray:
        """The compute had nothing been in flight beside it: `stretched`'s inverse."""
        if self.inflight is None or not contention:
            return self.compute
        k, c, ov = contention, self.compute, self.inflight
        out: np.ndarray = np.where(c <= ov * (1 + k), c / (1 + k), c - k * ov)
        return out


def stretched(c: float, inflight: float, contention: float) -> float:
    """A segment of compute `c` begun while another collective had `inflight` ns to go: a core
    shared with the transport (gloo's threads on the CPU emulation; 0 on a GPU, whose NCCL
    kernels run on their own SMs) charges the compute `contention` of the overlap."""
    return c + contention * min(c, max(inflight, 0.0))


def split_share(decode: int, prefills: int, prefill_tokens: int) -> float | None:
    """Micro-batch A's share of the rows as `tp.split_row` cuts them (decode rows first, each
    a sequence; prefill chunks never cut, taken as equally long); None with one sequence."""
    tokens = decode + prefill_tokens
    if decode + prefills < 2:
        return None
    cuts = [*range(1, decode), *(decode + j * prefill_tokens / prefills for j in range(prefills))]
    cuts = [c for c in cuts if 0 < c < tokens]
    if not cuts:
        return None
    return float(min(cuts, key=lambda c: abs(c - tokens / 2))) / tokens


def overlapped_span(a: np.ndarray, b: np.ndarray, lat_a: np.ndarray, lat_b: np.ndarray, tail: float,
                    head: float = 0.0, contention: float = 0.0) -> float:
    """The device span of one batch with comm overlap on (the schedule in the module docstring)."""
    t, done_a, done_b = head, 0.0, 0.0
    for k in range(len(a)):
        t = max(t, done_a)
        t += stretched(a[k], done_b - t, contention)  # B's collective of the op before in flight
        done_a = t + lat_a[k]
        t = max(t, done_b)
        t += stretched(b[k], done_a - t, contention)
        done_b = t + lat_b[k]
    return max(t, done_a, done_b) + tail


def segments(issue: np.ndarray, end: np.ndarray, wait: np.ndarray, numel: np.ndarray, split: bool,
             start: float, stop: float, head: float = 0.0) -> Segments:
    """Rank 0's collectives of one batch (in issue order) cut into its compute segments; `head`
    of the time before the first is the batch's broadcast."""
    start += head
    if not split:  # issue, wait at once, resume
        resume = np.maximum(end, issue + wait)
        prev = np.concatenate([[start], resume[:-1]])
        return Segments(issue - prev, numel, resume - issue, stop - resume[-1], head)
    ia, ib, wa, wb = issue[0::2], issue[1::2], wait[0::2], wait[1::2]
    # A's op k follows B's issue of op k-1 and A's wait for its op k-1; B's follows A's issue and its own wait
    began_a = np.concatenate([[start], ib[:-1] + wa[:-1]])
    began_b = ia + np.concatenate([[0.0], wb[:-1]])
    # done by the end of its wait at the latest (A's wait follows B's issue, B's follows A's
    # next issue): gloo's completion stamp waits for the GIL, so it can be late, up to that end
    waited_a = ib + wa
    waited_b = np.append(ia[1:], ib[-1] + wa[-1]) + wb
    done_a, done_b = np.minimum(end[0::2], waited_a), np.minimum(end[1::2], waited_b)
    lat = np.column_stack([done_a - ia, done_b - ib])
    # in flight at a segment's start: B's collective of the op before A's, A's of the same op B's
    inflight = np.column_stack([np.concatenate([[0.0], np.maximum(done_b[:-1] - began_a[1:], 0)]),
                                np.maximum(done_a - began_b, 0)])
    return Segments(np.column_stack([ia - began_a, ib - began_b]), numel.reshape(-1, 2), lat,
                    stop - ib[-1] - wa[-1] - wb[-1], head, inflight)


def fit_ops(segs: list[Segments]) -> np.ndarray:
    """[K, 2] alpha_k, beta_k: segment k's cost as alpha + beta x elements, least squares over
    every segment seen, both non-negative (alpha 0, proportional, where the sizes never vary)."""
    k = max(len(s.compute) for s in segs)
    out = np.zeros((k, 2))
    for i in range(k):
        c = np.concatenate([np.ravel(s.compute[i]) for s in segs if len(s.compute) > i])
        x = np.concatenate([np.ravel(s.numel[i]) for s in segs if len(s.compute) > i]).astype(np.float64)
        if np.ptp(x) > 0:
            alpha, beta = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), c, rcond=None)[0]
            if beta < 0:
                alpha, beta = float(c.mean()), 0.0
            elif alpha < 0:
                alpha, beta = 0.0, float((c * x).sum() / (x * x).sum())
        else:
            alpha, beta = 0.0, float(c.mean() / max(x[0], 1.0))
        out[i] = alpha, beta
    return out


def trace_setting(meta: dict[str, Any]) -> str | None:
    """A TP trace's --comm-overlap ("on", "off"); None without TP, or with PP, which the
    model does not reschedule (a later stage's all-reduces hide inside rank 0's pp_bubble)."""
    tp, pp = tp_pp(meta.get("config", {}))
    if tp < 2 or pp > 1:
        return None
    return "on" if meta.get("config", {}).get("comm_overlap", True) else "off"


def with_comm_overlap(run: Run, b: Batches, on: bool, contention: float = 0.0) -> Batches:
    """`b` (the run's batches, perhaps already changed) with the all-reduces as `on` runs them:
    b's compute scaled as the trace's would be, its exposed waits the trace's prediction (a
    change made to b.D before, such as the contention's, carries into the span)."""
    ratio, exposed = rescheduled(run, on, contention)
    return replace(b, D=b.D * ratio, A=np.where(np.isnan(exposed), b.A, exposed))


def rescheduled(run: Run, on: bool, contention: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per batch, (its compute's ratio to the trace's, its exposed collective time in ns) with
    comm overlap `on`, from a trace that ran with the other setting; `contention` as in
    `stretched` (what the compute lost to an overlapped transport counts as exposed). A batch
    the other setting runs the same way (one sequence), or whose collectives the trace lacks,
    keeps its own (ratio 1, exposed NaN: the caller keeps the trace's)."""
    tr = run.trace
    if not tr.has_table("collectives"):
        raise WhatIfError(f"{tr.root} has no collectives table (written since TP traces record each "
                          "all-reduce): --comm-overlap cannot be predicted from it")
    col = tr.table("collectives", ["rank", "step", "seq", "numel", "overlapped", "issue_ns", "end_ns", "dur_wait_ns"])
    col = col.filter(pc.equal(col["rank"], 0))
    col = col.take(pc.sort_indices(col, [("step", "ascending"), ("seq", "ascending")]))
    step = col["step"].to_numpy()
    issue, end, wait, numel = (col[c].to_numpy().astype(np.float64) for c in ("issue_ns", "end_ns", "dur_wait_ns",
                                                                                "numel"))
    overlapped = col["overlapped"].to_numpy(zero_copy_only=False)
    lo, hi = np.searchsorted(step, run.batch_step, "left"), np.searchsorted(step, run.batch_step, "right")
    segs: list[Segments | None] = []
    for i in range(len(run.batch_step)):
        r = slice(lo[i], hi[i])
        split = bool(overlapped[r].all())
        if hi[i] == lo[i] or end[r].min() < 0 or (split and (hi[i] - lo[i]) % 2):
            segs.append(None)  # none, one never completed (a killed run), or not in pairs
            continue
        segs.append(segments(issue[r], end[r], wait[r], numel[r], split, float(run.dev_start[i]),
                             float(run.dev_end[i]), float(run.broadcast[i])))
    alone = [None if s is None else replace(s, compute=s.alone(contention), inflight=None) for s in segs]
    seen = [s for s in alone if s is not None]
    ratio, exposed = np.ones(len(segs)), np.full(len(segs), np.nan)
    if not seen:
        return ratio, exposed
    ab = fit_ops(seen)
    comp = _composition(tr, run.batch_step) if on else []

    def cost(x: np.ndarray) -> np.ndarray:
        """The fit's cost of ops 0 .. len(x) - 1 at sizes x ([K] or [K, 2])."""
        fixed, per = ab[: len(x), 0], ab[: len(x), 1]
        if x.ndim == 2:
            fixed, per = fixed[:, None], per[:, None]
        out: np.ndarray = fixed + per * x
        return out

    for i, (s, traced) in enumerate(zip(alone, segs, strict=True)):
        if s is None or traced is None:
            continue
        g = cost(s.numel)
        before = float(traced.compute.sum()) + s.tail + s.head
        if on:  # an off trace: every batch ran whole
            f = split_share(*comp[i])
            if f is None:
                continue  # one sequence: on runs it synchronously too
            scale = np.where(g > 0, s.compute / np.where(g > 0, g, 1.0), 0.0)
            a, b = scale * cost(f * s.numel), scale * cost((1 - f) * s.numel)
            span = overlapped_span(a, b, s.latency, s.latency, s.tail, s.head, contention)
            after = float(a.sum() + b.sum()) + s.tail + s.head
        else:
            if s.compute.ndim == 1:
                continue  # ran synchronously already (one sequence)
            whole, g_sum = cost(s.numel.sum(axis=1)), g.sum(axis=1)
            c = s.compute.sum(axis=1) * np.where(g_sum > 0, whole / np.where(g_sum > 0, g_sum, 1.0), 1.0)
            after = float(c.sum()) + s.tail + s.head
            span = after + float(s.latency.mean(axis=1).sum())
        ratio[i] = after / before if before > 0 else 1.0
        # the model's D is the span less the all-reduce rows, which end when rank 0 resumes (a
        # little after `segments`' completion): the predicted span is kept whole, D + A
        exposed[i] = max(span - run.batches.D[i] * ratio[i], 0.0)
    return ratio, exposed


def _composition(tr: Trace, batch_steps: np.ndarray) -> list[tuple[int, int, int]]:
    """(decode rows, prefill chunks, prefill tokens) of each batch, from its round's steps row."""
    s = tr.table("steps", ["step", "num_decode_reqs", "num_prefill_reqs", "num_prefill_tokens"])
    s = s.take(pc.sort_indices(s, [("step", "ascending")]))
    idx = np.searchsorted(s["step"].to_numpy(), batch_steps)
    cols = [s[c].to_numpy()[idx] for c in ("num_decode_reqs", "num_prefill_reqs", "num_prefill_tokens")]
    return [(int(d), int(p), int(t)) for d, p, t in zip(*cols, strict=True)]
