"""The sync-cost table: where each scheduling cycle's time goes.

Device-view attribution (docs/report.md). A cycle is one scheduling round,
from its start to the next round's start, minus any time the engine sat idle
with no work. Over each cycle the device is either
  * computing (the union of device_compute intervals on any stream), or
  * idle while the scheduling thread is inside one of the host boundaries
    (bookkeeping, batch_prepare, response_send, kv_fence, batch_broadcast,
    and the host-side wait of all_reduce), or
  * idle otherwise: the scheduler barrier, plus launch and Python overhead.
These shares add up to 100% of cycle time by construction, so the table
reconciles with the measured wall time. For each boundary we also report its
raw time and the fraction of it hidden under device compute: overlap
scheduling moves time from exposed to hidden, which `diff` shows.

Tensor/pipeline parallel runs (scheduler/parallel/). Cycles are always rank 0's
(the scheduler's steps and idle time); any rank's rows are attributed against
them (every rank's timestamps are on rank 0's clock). A rank's communication
waits (all_reduce, pp_bubble, batch_broadcast) happen on the thread that is its
device, inside its device_compute intervals: they are taken out of device-busy
time, so they count as exposed, not as compute. all_reduce follows HTA's
comm/compute overlap: with the `collectives` table, its raw time is each
collective's issue -> completion, its hidden fraction the part of that during
which the rank computed, and its exposed share the host wait (the probe rows).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from probes import boundaries as B

# Boundaries that run on the scheduling thread, one at a time: their
# device-idle parts are disjoint, so they partition the idle time exactly.
# pp_bubble: a TP/PP rank's device thread waiting for its input (or, on rank 0, for the last
# stage's tokens) while the scheduling thread sits in the barrier: disjoint from the others.
HOST_EXCLUSIVE = (B.BOOKKEEPING, B.BATCH_PREPARE, B.RESPONSE_SEND, B.KV_FENCE, B.BATCH_BROADCAST, B.ALL_REDUCE,
                  B.DEFRAG, B.PP_BUBBLE)
# Off the scheduling thread (tokenizer pool) or on a stream: informational rows.
CONCURRENT = (B.TOKENIZE, B.STREAM_WAIT, B.RESPONSE_DELIVER)
ORDER = (B.SCHEDULER_BARRIER, B.ALL_REDUCE, B.PP_BUBBLE, B.BOOKKEEPING, B.BATCH_PREPARE, B.RESPONSE_SEND,
         B.KV_FENCE, B.BATCH_BROADCAST, B.DEFRAG, B.TOKENIZE, B.RESPONSE_DELIVER, B.STREAM_WAIT, B.DEVICE_COMPUTE)
# A rank's communication waits: its device thread blocks in them, so they are not device-busy.
COMM_WAITS = (B.ALL_REDUCE, B.PP_BUBBLE, B.BATCH_BROADCAST)


@dataclass(slots=True)
class BoundaryCost:
    boundary: str
    mean_ms: float  # raw time per cycle
    count: int
    share: float | None  # exposed (device-idle) share of cycle time; None: not on the critical path
    hidden: float | None  # fraction of raw time overlapped by device compute
    removable: str


@dataclass(slots=True)
class CostTable:
    cycles: int
    cycle_ms: float  # mean cycle length
    cycle_total_s: float
    idle_s: float  # engine had no work (excluded from cycles)
    wall_s: float  # first cycle start .. last cycle end
    device_busy: float  # share of cycle time the device computes
    boundaries: list[BoundaryCost] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def share_sum(self) -> float:
        return sum(b.share or 0.0 for b in self.boundaries)


class _Coverage:
    """Prefix sums over the merged device-busy intervals: covered(a, b) = busy time in [a, b)."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray) -> None:
        if len(starts):
            order = np.argsort(starts, kind="stable")
            s, e = starts[order], ends[order]
            # merge overlapping intervals (two streams busy at once count once)
            run_end = np.maximum.accumulate(e)
            new = np.empty(len(s), dtype=bool)
            new[0] = True
            new[1:] = s[1:] > run_end[:-1]
            grp = np.cumsum(new) - 1
            ms = s[new]
            me = np.zeros(len(ms), dtype=np.int64)
            np.maximum.at(me, grp, run_end)
        else:
            ms = me = np.zeros(0, dtype=np.int64)
        self.s, self.e = ms, me
        self.cum = np.concatenate([[0], np.cumsum(me - ms)])

    def before(self, x: np.ndarray) -> np.ndarray:
        if len(self.s) == 0:
            return np.zeros(len(x), dtype=np.int64)
        i = np.searchsorted(self.s, x, side="right") - 1
        ic = np.clip(i, 0, None)
        part = np.clip(x - self.s[ic], 0, self.e[ic] - self.s[ic])
        return np.where(i >= 0, self.cum[ic] + part, 0)

    def covered(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Busy time in [a, b). One binary search per row: a probe interval almost
        never spans the start of another device interval, so b's index is a's
        (or the next one), and only the rare exceptions are searched again."""
        s, e = self.s, self.e
        if len(s) == 0:
            return np.zeros(len(a), dtype=np.int64)
        i = np.searchsorted(s, a, side="right") - 1
        ic = np.clip(i, 0, None)
        nxt = np.minimum(i + 1, len(s) - 1)
        far = (i + 1 < len(s)) & (b >= s[nxt])
        j = i.copy()
        if far.any():
            j[far] = np.searchsorted(s, b[far], side="right") - 1
        jc = np.clip(j, 0, None)
        at_a = np.where(i >= 0, self.cum[ic] + np.clip(a - s[ic], 0, e[ic] - s[ic]), 0)
        at_b = np.where(j >= 0, self.cum[jc] + np.clip(b - s[jc], 0, e[jc] - s[jc]), 0)
        return at_b - at_a


def _subtract(s: np.ndarray, e: np.ndarray, cs: np.ndarray, ce: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals [s, e) minus the union of [cs, ce), as sorted disjoint intervals.

    One sweep over all endpoints: a segment between consecutive endpoints is kept when some
    [s, e) is open and no [cs, ce) is (zero-length segments at tied endpoints drop out).
    """
    if not len(cs) or not len(s):
        return s, e
    t = np.concatenate([s, e, cs, ce])
    n, m = len(s), len(cs)
    busy = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64), np.zeros(2 * m, np.int64)])
    wait = np.concatenate([np.zeros(2 * n, np.int64), np.ones(m, np.int64), -np.ones(m, np.int64)])
    order = np.argsort(t, kind="stable")
    t, b, w = t[order], np.cumsum(busy[order]), np.cumsum(wait[order])
    keep = (b[:-1] > 0) & (w[:-1] == 0) & (t[1:] > t[:-1])
    return t[:-1][keep], t[1:][keep]


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[str]]:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_encode()
    return arr.indices.to_numpy(zero_copy_only=False), arr.dictionary.to_pylist()


def per_cycle(probes: pa.Table, steps: pa.Table, rank: int | None = 0,
              collectives: pa.Table | None = None) -> dict[str, np.ndarray]:
    """The attribution behind `cost_table`, kept per cycle (what `diff` resamples).

    `rank` selects one rank's rows (None: all); `collectives` (the table of that name, any
    ranks) gives all_reduce its HTA raw/hidden times (module docstring).

    Every array has one entry per cycle, in time order (float64 ns unless noted):
      start_ns, end_ns   cycle bounds (int64)
      cycle_ns           cycle length minus idle (no-work) time
      idle_ns            no-work time inside the cycle
      device_ns          device-busy time (union of device_compute intervals)
      raw_ns:<b>         raw time of boundary b, by the cycle its interval starts in;
                         rows before the first / after the last cycle count to that
                         cycle, so the sums equal the trace totals the table reports
      hidden_ns:<b>      the part of raw_ns:<b> under device compute (absent for device_compute)
      count:<b>          probe rows of b
      exposed_ns:<b>     device-idle time charged to b: host-exclusive boundaries,
                         scheduler_barrier (the remainder) and device_compute (= device_ns)
    scheduler_barrier and device_compute are always present; other boundaries only
    when they have rows. Empty dict when there are no steps.
    """
    st = steps.sort_by("ts_ns")
    S = st["ts_ns"].to_numpy()
    D = st["dur_ns"].to_numpy()
    n = len(S)
    if n == 0:
        return {}
    E = np.empty(n, dtype=np.int64)
    E[:-1] = S[1:]
    E[-1] = S[-1] + D[-1]

    idle_from: tuple[np.ndarray, np.ndarray] | None = None  # (ts, dur) of idle rows, when not `rank`'s own
    if rank is not None and probes.num_rows:
        lo_hi = pc.min_max(probes["rank"]).as_py()
        if (lo_hi["min"], lo_hi["max"]) != (rank, rank):  # the filter copies every column: skip it when it is a no-op
            if rank != 0:
                # cycles are rank 0's, and so is the no-work time taken out of them
                r0 = probes.filter(pc.equal(probes["rank"], 0))
                c0, n0 = _codes(r0["boundary"]) if r0.num_rows else (np.zeros(0, np.int64), [])
                m0 = c0 == (n0.index(B.IDLE) if B.IDLE in n0 else -1)
                idle_from = (r0["ts_ns"].to_numpy()[m0], r0["dur_ns"].to_numpy()[m0])
            probes = probes.filter(pc.equal(probes["rank"], rank))
    codes, names = _codes(probes["boundary"]) if probes.num_rows else (np.zeros(0, np.int64), [])
    # Group rows by boundary once (a stable sort keeps each group in time
    # order): every boundary is then a contiguous slice, not a mask + gather.
    # uint8 codes make numpy's stable sort a radix sort: O(n) on 10 M rows, not O(n log n)
    small = codes.astype(np.uint8) if len(names) < 256 else codes
    order = np.argsort(small, kind="stable")
    ts = probes["ts_ns"].to_numpy()[order]
    dur = probes["dur_ns"].to_numpy()[order]
    bounds = np.searchsorted(small[order], np.arange(len(names) + 1))
    code = {name: i for i, name in enumerate(names)}

    def rows(name: str) -> slice:
        i = code.get(name)
        return slice(0, 0) if i is None else slice(int(bounds[i]), int(bounds[i + 1]))

    dev = rows(B.DEVICE_COMPUTE)
    waits = [rows(b) for b in COMM_WAITS]
    ws = np.concatenate([ts[m] for m in waits])
    cov = _Coverage(*_subtract(ts[dev], ts[dev] + dur[dev], ws, ws + np.concatenate([dur[m] for m in waits])))

    def cycle_of(t: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(S, t, side="right") - 1, 0, n - 1)

    def in_cycles(t: np.ndarray) -> np.ndarray:
        return (t >= S[0]) & (t < E[-1])

    def per(t: np.ndarray | None, w: np.ndarray | None = None, ci: np.ndarray | None = None) -> np.ndarray:
        idx = cycle_of(t) if ci is None else ci  # type: ignore[arg-type]
        return np.bincount(idx, weights=w, minlength=n).astype(np.float64)

    # idle time (no work) comes off the cycle length
    idle_m = rows(B.IDLE)
    idle_ts, idle_end = (ts[idle_m], ts[idle_m] + dur[idle_m]) if idle_from is None else \
        (idle_from[0], idle_from[0] + idle_from[1])
    cycle_len = (E - S).astype(np.float64)
    idle_per = np.zeros(n)
    if len(idle_ts):
        keep = in_cycles(idle_ts)
        idle_per = per(idle_ts[keep], (idle_end - idle_ts)[keep])
        cycle_len -= idle_per
    dev_per = cov.covered(S, E).astype(np.float64)
    out: dict[str, np.ndarray] = {"start_ns": S, "end_ns": E, "cycle_ns": cycle_len, "idle_ns": idle_per,
                                  "device_ns": dev_per}

    def attribute(name: str) -> dict[str, np.ndarray]:
        m = rows(name)
        a, d = ts[m], dur[m]
        hid = cov.covered(a, a + d).astype(np.float64)
        ci = cycle_of(a)
        # integer-valued float sums are exact, so these add up to the same totals
        # as summing the rows directly
        res = {f"raw_ns:{name}": per(None, d.astype(np.float64), ci), f"hidden_ns:{name}": per(None, hid, ci),
               f"count:{name}": per(None, None, ci)}
        if name in HOST_EXCLUSIVE:
            keep = in_cycles(a)  # exposed time must partition the cycles: drop rows outside them
            res[f"exposed_ns:{name}"] = per(None, (d - hid)[keep], ci[keep])
        return res

    names_present = [nm for nm in (B.SCHEDULER_BARRIER, *HOST_EXCLUSIVE, *CONCURRENT)
                     if nm == B.SCHEDULER_BARRIER or rows(nm).stop > rows(nm).start]
    # Boundaries are independent and numpy's searches and ufuncs release the
    # GIL: two threads use both cores on a long trace.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for res in pool.map(attribute, names_present):
            out.update(res)
    exposed_sum = np.zeros(n)
    for name in HOST_EXCLUSIVE:
        if f"exposed_ns:{name}" in out:
            exposed_sum += out[f"exposed_ns:{name}"]
    if collectives is not None and collectives.num_rows:
        _collective_times(out, collectives, rank, cov, cycle_of, per)
    out[f"exposed_ns:{B.SCHEDULER_BARRIER}"] = cycle_len - dev_per - exposed_sum
    out[f"raw_ns:{B.DEVICE_COMPUTE}"] = dev_per
    out[f"count:{B.DEVICE_COMPUTE}"] = per(ts[dev])
    out[f"exposed_ns:{B.DEVICE_COMPUTE}"] = dev_per
    return out


def _collective_times(out: dict[str, np.ndarray], colls: pa.Table, rank: int | None, cov: _Coverage,
                      cycle_of: Any, per: Any) -> None:
    """all_reduce's raw, hidden and count from the collectives table (HTA's comm/compute overlap):
    raw = issue -> completion of each completed collective, hidden = the part of it during which
    the rank's device computed. The exposed share stays the host waits' (the probe rows)."""
    if rank is not None:
        colls = colls.filter(pc.equal(colls["rank"], rank))
    issue, end = colls["issue_ns"].to_numpy(), colls["end_ns"].to_numpy()
    done = end >= issue  # in flight at the end (end -1): no duration
    issue, end = issue[done], end[done]
    if not len(issue):
        return
    ci = cycle_of(issue)
    b = B.ALL_REDUCE
    out[f"raw_ns:{b}"] = per(None, (end - issue).astype(np.float64), ci)
    out[f"hidden_ns:{b}"] = per(None, cov.covered(issue, end).astype(np.float64), ci)
    out[f"count:{b}"] = per(None, None, ci)


def cost_table(probes: pa.Table, steps: pa.Table, rank: int | None = 0,
               collectives: pa.Table | None = None) -> CostTable:
    """Pure function from the probes and steps tables to the cost table (sums of `per_cycle`)."""
    pcy = per_cycle(probes, steps, rank, collectives)
    if not pcy:
        return CostTable(0, 0.0, 0.0, 0.0, 0.0, 0.0, [])
    n = len(pcy["cycle_ns"])
    total = float(pcy["cycle_ns"].sum())
    out: list[BoundaryCost] = []
    for name in ORDER:
        if f"raw_ns:{name}" not in pcy:
            continue
        rsum = float(pcy[f"raw_ns:{name}"].sum())
        exposed = pcy.get(f"exposed_ns:{name}")
        share = None if exposed is None else (float(exposed.sum()) / total if total else 0.0)
        hidden: float | None = None
        if name == B.SCHEDULER_BARRIER:
            hidden = float(pcy[f"hidden_ns:{name}"].sum()) / rsum if rsum else None
        elif name != B.DEVICE_COMPUTE:
            hidden = float(pcy[f"hidden_ns:{name}"].sum()) / rsum if rsum else 0.0
        out.append(BoundaryCost(name, rsum / n / 1e6, int(pcy[f"count:{name}"].sum()), share, hidden,
                                B.REMOVABLE[name]))
    S, E = pcy["start_ns"], pcy["end_ns"]
    return CostTable(
        cycles=n,
        cycle_ms=total / n / 1e6,
        cycle_total_s=total / 1e9,
        idle_s=float(pcy["idle_ns"].sum()) / 1e9,
        wall_s=float(E[-1] - S[0]) / 1e9,
        device_busy=float(pcy["device_ns"].sum()) / total if total else 0.0,
        boundaries=out,
    )
