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
from viewer.analysis.intervals import Coverage, CycleSums, blocks, subtract

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
    S, D = steps["ts_ns"].to_numpy(), steps["dur_ns"].to_numpy()
    n = len(S)
    if n == 0:
        return {}
    if not bool(np.all(S[1:] >= S[:-1])):  # one rank's rounds are written in order
        order = np.argsort(S, kind="stable")
        S, D = S[order], D[order]
    E = np.empty(n, dtype=np.int64)
    E[:-1] = S[1:]
    E[-1] = S[-1] + D[-1]

    idle_from: tuple[np.ndarray, np.ndarray] | None = None  # (ts, dur) of idle rows, when not `rank`'s own
    if rank is not None and probes.num_rows and "rank" in probes.column_names:
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
    small = codes.astype(np.uint8) if len(names) < 256 else codes
    ts, dur = probes["ts_ns"].to_numpy(), probes["dur_ns"].to_numpy()
    # only boundaries with rows: a filtered or clipped column keeps its whole dictionary
    have = np.bincount(small, minlength=len(names)) if len(names) else np.zeros(0, np.int64)
    code = {name: i for i, name in enumerate(names) if have[i]}

    def rows(name: str) -> tuple[np.ndarray, np.ndarray]:
        """A boundary's rows in file order. A mask and a gather of increasing
        indices per boundary beat one argsort by boundary and a random gather of
        every row (10 M rows: 0.22 s against 0.38 s), and run on both threads."""
        i = code.get(name)
        if i is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        idx = np.flatnonzero(small == i)
        return ts[idx], dur[idx]

    dev_ts, dev_dur = rows(B.DEVICE_COMPUTE)
    waits = [rows(b) for b in COMM_WAITS]
    ws = np.concatenate([w[0] for w in waits])
    cov = Coverage(*subtract(dev_ts, dev_ts + dev_dur, ws, ws + np.concatenate([w[1] for w in waits])))
    bins = CycleSums(S)

    def in_cycles(t: np.ndarray) -> np.ndarray:
        return (t >= S[0]) & (t < E[-1])

    # idle time (no work) comes off the cycle length
    idle_ts, idle_dur = rows(B.IDLE) if idle_from is None else idle_from
    cycle_len = (E - S).astype(np.float64)
    idle_per = bins.zeros()
    if len(idle_ts):
        keep = in_cycles(idle_ts)
        bins.add(idle_per, bins.cycle_of(idle_ts[keep]), idle_dur[keep])
        cycle_len -= idle_per
    dev_per = np.concatenate([cov.covered(S[b], E[b]) for b in blocks(n)]).astype(np.float64)
    out: dict[str, np.ndarray] = {"start_ns": S, "end_ns": E, "cycle_ns": cycle_len, "idle_ns": idle_per,
                                  "device_ns": dev_per}

    def attribute(name: str) -> dict[str, np.ndarray]:
        a_all, d_all = rows(name)
        raw, hid, cnt = bins.zeros(), bins.zeros(), bins.zeros()
        exposed = bins.zeros() if name in HOST_EXCLUSIVE else None
        for blk in blocks(len(a_all)):
            a, d = a_all[blk], d_all[blk]
            h = cov.covered(a, a + d)
            ci = bins.cycle_of(a)
            # integer-valued float sums are exact, so these add up to the same totals
            # as summing the rows directly
            bins.add(raw, ci, d)
            bins.add(hid, ci, h)
            bins.add(cnt, ci)
            if exposed is not None:
                keep = in_cycles(a)  # exposed time must partition the cycles: drop rows outside them
                bins.add(exposed, ci[keep], (d - h)[keep])
        res = {f"raw_ns:{name}": raw, f"hidden_ns:{name}": hid, f"count:{name}": cnt}
        if exposed is not None:
            res[f"exposed_ns:{name}"] = exposed
        return res

    names_present = [nm for nm in (B.SCHEDULER_BARRIER, *HOST_EXCLUSIVE, *CONCURRENT)
                     if nm == B.SCHEDULER_BARRIER or nm in code]
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
        _collective_times(out, collectives, rank, cov, bins)
    out[f"exposed_ns:{B.SCHEDULER_BARRIER}"] = cycle_len - dev_per - exposed_sum
    out[f"raw_ns:{B.DEVICE_COMPUTE}"] = dev_per
    dev_count = bins.zeros()
    for blk in blocks(len(dev_ts)):
        bins.add(dev_count, bins.cycle_of(dev_ts[blk]))
    out[f"count:{B.DEVICE_COMPUTE}"] = dev_count
    out[f"exposed_ns:{B.DEVICE_COMPUTE}"] = dev_per
    return out


def _collective_times(out: dict[str, np.ndarray], colls: pa.Table, rank: int | None, cov: Coverage,
                      bins: CycleSums) -> None:
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
    b = B.ALL_REDUCE
    raw, hid, cnt = bins.zeros(), bins.zeros(), bins.zeros()
    for blk in blocks(len(issue)):
        ci = bins.cycle_of(issue[blk])
        bins.add(raw, ci, end[blk] - issue[blk])
        bins.add(hid, ci, cov.covered(issue[blk], end[blk]))
        bins.add(cnt, ci)
    out[f"raw_ns:{b}"], out[f"hidden_ns:{b}"], out[f"count:{b}"] = raw, hid, cnt


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
