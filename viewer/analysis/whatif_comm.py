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

from viewer.analysis.whatif_fit import Run, WhatIfError, tp_pp
from viewer.analysis.whatif_model import Batches


@dataclass(slots=True)
class Segments:
    """Batches of one shape as rank 0 ran them, one row each: their compute segments (per
    micro-batch where the trace split them), the collective each ends with, the tail after
    the last and the head before the first."""

    split: bool
    compute: np.ndarray  # [m, K], or [m, K, 2] (A, B) when split
    numel: np.ndarray  # the same shape: each segment's collective's elements
    latency: np.ndarray  # the same shape, ns: issue -> completion (split), issue -> rank 0 resumes (whole)
    tail: np.ndarray  # [m]
    head: np.ndarray  # [m]: the batch's broadcast, once a batch whatever the setting (not in compute)
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


def stretched(c: np.ndarray, inflight: np.ndarray, contention: float) -> np.ndarray:
    """Segments of compute `c` begun while another collective had `inflight` ns to go: a core
    shared with the transport (gloo's threads on the CPU emulation; 0 on a GPU, whose NCCL
    kernels run on their own SMs) charges the compute `contention` of the overlap."""
    out: np.ndarray = c + contention * np.minimum(c, np.maximum(inflight, 0.0))
    return out


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


def overlapped_span(a: np.ndarray, b: np.ndarray, lat_a: np.ndarray, lat_b: np.ndarray, tail: np.ndarray,
                    head: np.ndarray, contention: float = 0.0) -> np.ndarray:
    """The device span of each batch ([m, K] segments) with comm overlap on (the schedule in
    the module docstring), batches side by side."""
    t = np.array(head, dtype=np.float64)
    done_a, done_b = np.zeros_like(t), np.zeros_like(t)
    for k in range(a.shape[1]):
        t = np.maximum(t, done_a)
        t = t + stretched(a[:, k], done_b - t, contention)  # B's collective of the op before in flight
        done_a = t + lat_a[:, k]
        t = np.maximum(t, done_b)
        t = t + stretched(b[:, k], done_a - t, contention)
        done_b = t + lat_b[:, k]
    out: np.ndarray = np.maximum(t, np.maximum(done_a, done_b)) + tail
    return out


def _after(first: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`first` [m] then the columns of `x` [m, n]."""
    return np.concatenate([np.asarray(first, dtype=np.float64)[:, None], x], axis=1)


def segments(issue: np.ndarray, end: np.ndarray, wait: np.ndarray, numel: np.ndarray, split: bool,
             start: np.ndarray, stop: np.ndarray, head: np.ndarray) -> Segments:
    """Rank 0's collectives of m batches ([m, n], each row in issue order) cut into their
    compute segments; `head` of the time before the first is the batch's broadcast."""
    start = start + head
    if not split:  # issue, wait at once, resume
        resume = np.maximum(end, issue + wait)
        return Segments(False, issue - _after(start, resume[:, :-1]), numel, resume - issue, stop - resume[:, -1],
                        head)
    ia, ib, wa, wb = issue[:, 0::2], issue[:, 1::2], wait[:, 0::2], wait[:, 1::2]
    # A's op k follows B's issue of op k-1 and A's wait for its op k-1; B's follows A's issue and its own wait
    began_a = _after(start, ib[:, :-1] + wa[:, :-1])
    began_b = ia + _after(np.zeros(len(ia)), wb[:, :-1])
    # done by the end of its wait at the latest (A's wait follows B's issue, B's follows A's
    # next issue): gloo's completion stamp waits for the GIL, so it can be late, up to that end
    waited_a = ib + wa
    waited_b = np.concatenate([ia[:, 1:], (ib[:, -1] + wa[:, -1])[:, None]], axis=1) + wb
    done_a, done_b = np.minimum(end[:, 0::2], waited_a), np.minimum(end[:, 1::2], waited_b)
    # in flight at a segment's start: B's collective of the op before A's, A's of the same op B's
    inflight = np.stack([_after(np.zeros(len(ia)), np.maximum(done_b[:, :-1] - began_a[:, 1:], 0)),
                         np.maximum(done_a - began_b, 0)], axis=-1)
    return Segments(True, np.stack([ia - began_a, ib - began_b], axis=-1), numel.reshape(len(ia), -1, 2),
                    np.stack([done_a - ia, done_b - ib], axis=-1), stop - ib[:, -1] - wa[:, -1] - wb[:, -1], head,
                    inflight)


def fit_ops(groups: list[Segments]) -> np.ndarray:
    """[K, 2] alpha_k, beta_k: segment k's cost as alpha + beta x elements, least squares over
    every segment seen, both non-negative (alpha 0, proportional, where the sizes never vary)."""
    k = max(g.compute.shape[1] for g in groups)
    out = np.zeros((k, 2))
    for i in range(k):
        c = np.concatenate([np.ravel(g.compute[:, i]) for g in groups if g.compute.shape[1] > i])
        x = np.concatenate([np.ravel(g.numel[:, i]) for g in groups if g.compute.shape[1] > i]).astype(np.float64)
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
    col = run.table("collectives", ["rank", "step", "seq", "numel", "overlapped", "issue_ns", "end_ns", "dur_wait_ns"])
    col = col.filter(pc.equal(col["rank"], 0))
    col = col.take(pc.sort_indices(col, [("step", "ascending"), ("seq", "ascending")]))
    step = col["step"].to_numpy()
    issue, end, wait, numel = (col[c].to_numpy().astype(np.float64) for c in ("issue_ns", "end_ns", "dur_wait_ns",
                                                                                "numel"))
    overlapped = col["overlapped"].to_numpy(zero_copy_only=False)
    n = len(run.batch_step)
    lo, hi = np.searchsorted(step, run.batch_step, "left"), np.searchsorted(step, run.batch_step, "right")
    count = hi - lo

    def how_many(flags: np.ndarray) -> np.ndarray:
        """Per batch, its collectives that have the flag."""
        c = np.concatenate([[0], np.cumsum(flags)])
        out: np.ndarray = c[hi] - c[lo]
        return out

    split = how_many(overlapped) == count
    # none, one never completed (a killed run), or not in pairs: such a batch keeps its own
    usable = (count > 0) & (how_many(end < 0) == 0) & ~(split & (count % 2 == 1))
    # batches of one shape (split or whole, so many collectives) are cut side by side
    groups: list[tuple[np.ndarray, Segments]] = []
    for sp, c in sorted({(bool(a), int(b)) for a, b in zip(split[usable], count[usable], strict=True)}):
        idx = np.flatnonzero(usable & (split == sp) & (count == c))
        rows = lo[idx][:, None] + np.arange(c)
        groups.append((idx, segments(issue[rows], end[rows], wait[rows], numel[rows], sp, run.dev_start[idx],
                                     run.dev_end[idx], run.broadcast[idx])))
    ratio, exposed = np.ones(n), np.full(n, np.nan)
    if not groups:
        return ratio, exposed
    alone = [(idx, replace(g, compute=g.alone(contention), inflight=None), g) for idx, g in groups]
    ab = fit_ops([g for _, g, _ in alone])

    def cost(x: np.ndarray) -> np.ndarray:
        """The fit's cost of ops 0 .. K-1 at sizes x ([m, K] or [m, K, 2])."""
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        out: np.ndarray = ab[: x.shape[1], 0].reshape(shape) + ab[: x.shape[1], 1].reshape(shape) * x
        return out

    def per_batch(x: np.ndarray) -> np.ndarray:
        out: np.ndarray = x.reshape(len(x), -1).sum(axis=1)
        return out

    comp = _composition(run) if on else []
    for idx, g, traced in alone:
        before = per_batch(traced.compute) + g.tail + g.head
        if on:  # an off trace: every batch ran whole
            if g.split:
                continue
            f = np.array([np.nan if (v := split_share(*comp[i])) is None else v for i in idx])
            keep = ~np.isnan(f)  # one sequence: on runs it synchronously too
            idx, f, before = idx[keep], f[keep, None], before[keep]
            compute, numel, lat, tail, head = (x[keep] for x in (g.compute, g.numel, g.latency, g.tail, g.head))
            whole = cost(numel)
            scale = np.where(whole > 0, compute / np.where(whole > 0, whole, 1.0), 0.0)
            a, b = scale * cost(f * numel), scale * cost((1 - f) * numel)
            span = overlapped_span(a, b, lat, lat, tail, head, contention)
            after = per_batch(a) + per_batch(b) + tail + head
        else:
            if not g.split:
                continue  # ran synchronously already (one sequence)
            halves, whole = cost(g.numel).sum(axis=2), cost(g.numel.sum(axis=2))
            c = g.compute.sum(axis=2) * np.where(halves > 0, whole / np.where(halves > 0, halves, 1.0), 1.0)
            after = per_batch(c) + g.tail + g.head
            span = after + per_batch(g.latency.mean(axis=2))
        ratio[idx] = np.where(before > 0, after / np.where(before > 0, before, 1.0), 1.0)
        # the model's D is the span less the all-reduce rows, which end when rank 0 resumes (a
        # little after `segments`' completion): the predicted span is kept whole, D + A
        exposed[idx] = np.maximum(span - run.batches.D[idx] * ratio[idx], 0.0)
    return ratio, exposed


def _composition(run: Run) -> list[tuple[int, int, int]]:
    """(decode rows, prefill chunks, prefill tokens) of each batch, from its round's steps row."""
    s = run.table("steps", ["step", "num_decode_reqs", "num_prefill_reqs", "num_prefill_tokens"])
    s = s.take(pc.sort_indices(s, [("step", "ascending")]))
    idx = np.searchsorted(s["step"].to_numpy(), run.batch_step)
    cols = [s[c].to_numpy()[idx] for c in ("num_decode_reqs", "num_prefill_reqs", "num_prefill_tokens")]
    return [(int(d), int(p), int(t)) for d, p, t in zip(*cols, strict=True)]
