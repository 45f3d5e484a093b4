"""The sync-cost table: where each scheduling cycle's time goes, in two views.

`cycle_views.per_cycle` attributes every cycle twice, the device's view (compute,
device-side waits, idle charged to the host probe that kept it idle) and the
scheduling thread's (the barrier, bookkeeping, ...), each with an explicit
`unattributed` row for the time no probe covers (docs/report.md, "Two views").
Here their sums over the cycles become the table `report` prints.

Tensor/pipeline parallel runs (scheduler/parallel/): cycles are always rank 0's
(the scheduler's steps and idle time); any rank's rows are attributed against
them (every rank's timestamps are on rank 0's clock). A rank's communication
waits (all_reduce, pp_bubble, batch_broadcast) happen on the thread that is its
device, inside its device_compute intervals: they are taken out of device-busy
time and charged as device-side waits. all_reduce follows HTA's comm/compute
overlap: with the `collectives` table, its raw time is each collective's issue ->
completion, its hidden fraction the part of that during which the rank computed,
and its share the wait itself (the probe rows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from probes import boundaries as B
from viewer.analysis.cycle_views import CONCURRENT, HOST_VIEW, UNATTRIBUTED, per_cycle

# Device-view rows (`share`), then the informational rows off the scheduling thread.
ORDER = (B.DEVICE_COMPUTE, B.DEVICE_COMM, B.DEVICE_COPY, B.SCHEDULER_BARRIER, B.ALL_REDUCE, B.PP_BUBBLE, B.BATCH_BROADCAST, B.BOOKKEEPING,
         B.BATCH_PREPARE, B.RESPONSE_SEND, B.KV_FENCE, B.DEFRAG, B.PREFILL_STAGGER, UNATTRIBUTED, *CONCURRENT)
# Host-view rows (`host_share`): the scheduling thread's probes.
HOST_ORDER = (*HOST_VIEW, UNATTRIBUTED)
REMOVABLE = {**B.REMOVABLE, UNATTRIBUTED: "add a probe where it goes"}
# A share below this is an overlap of probes, not rounding (shares are exact sums of integer ns).
NEGATIVE = -1e-9


@dataclass(slots=True)
class BoundaryCost:
    boundary: str
    raw_ms_per_cycle: float  # its rows' own time per cycle, overlaps included: no view (unattributed: the host view's)
    count: int
    share: float | None  # device view: share of cycle time charged to it; None: not in that view
    host_share: float | None  # host view: share of cycle time the scheduling thread spent in it
    hidden: float | None  # fraction of raw time under device compute; None for waits and device rows
    removable: str


@dataclass(slots=True)
class CostTable:
    cycles: int
    cycle_ms: float  # mean cycle length
    cycle_total_s: float
    idle_s: float  # engine had no work (excluded from cycles)
    wall_s: float  # first cycle start .. last cycle end
    device_busy: float  # share of cycle time the device computes
    boundaries: list[BoundaryCost] = field(default_factory=list)  # sorted by device-view share

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def share_sum(self) -> float:
        return sum(b.share or 0.0 for b in self.boundaries)

    @property
    def host_share_sum(self) -> float:
        return sum(b.host_share or 0.0 for b in self.boundaries)

    @property
    def negative(self) -> list[str]:
        """Rows that came out negative: probes that overlap (reported, never clamped)."""
        return [f"{b.boundary} ({view})" for b in self.boundaries
                for view, x in (("device view", b.share), ("host view", b.host_share)) if x is not None and x < NEGATIVE]


# Hidden under device compute means nothing for a wait that blocks until the device is done.
_NO_HIDDEN = (B.SCHEDULER_BARRIER, B.DEVICE_COMPUTE, UNATTRIBUTED)


def cost_table(probes: pa.Table, steps: pa.Table, rank: int | None = 0,
               collectives: pa.Table | None = None) -> CostTable:
    """Pure function from the probes and steps tables to the cost table (sums of `per_cycle`)."""
    return table_of(per_cycle(probes, steps, rank, collectives, totals=True))


def table_of(pcy: dict[str, np.ndarray]) -> CostTable:
    """The cost table of `per_cycle`'s arrays, per cycle or summed (`totals`): sums of them."""
    if not pcy:
        return CostTable(0, 0.0, 0.0, 0.0, 0.0, 0.0, [])
    n = int(pcy["cycles"].sum()) if "cycles" in pcy else len(pcy["start_ns"])  # totals or chunks, or per cycle
    total = float(pcy["cycle_ns"].sum())

    def frac(key: str, of: float) -> float | None:
        if key not in pcy:
            return None
        return float(pcy[key].sum()) / of if of else 0.0

    out: list[BoundaryCost] = []
    for name in ORDER:
        raw_key = f"raw_ns:{name}" if name != UNATTRIBUTED else f"host_ns:{name}"
        if raw_key not in pcy:
            continue
        rsum = float(pcy[raw_key].sum())
        hidden = None if name in _NO_HIDDEN else (frac(f"hidden_ns:{name}", rsum) if rsum else 0.0)
        count = int(pcy[f"count:{name}"].sum()) if f"count:{name}" in pcy else 0
        out.append(BoundaryCost(name, rsum / n / 1e6, count, frac(f"exposed_ns:{name}", total),
                                frac(f"host_ns:{name}", total), hidden, REMOVABLE[name]))
    out.sort(key=lambda b: -1.0 if b.share is None else b.share, reverse=True)
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
