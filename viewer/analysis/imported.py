"""What only an imported profiler trace can say (`mstrace import`): where it came from, how far
the host runs ahead of the device, the device's time in HTA's temporal breakdown, the
collectives, the waits by caller, and the rounds' batches.

HTA's temporal breakdown (hta/analyzers/breakdown_analysis.py, v0.5), per rank: the span is
the first device event's start to the last one's end (`kernel_time`); idle is the span
minus the union of all device events; compute is the union of compute kernels; non-compute
is the rest. Its device events are those on a stream (cuda_sync's "Stream Sync" included:
HTA counts the device side of a stream synchronisation as time on the device), and when
the trace has two ProfilerSteps or more, only those launched before the last one starts
(HTA drops the last iteration). The numbers here follow those rules, so they match HTA's
on the same file (tests/test_import_kineto.py checks five public traces), including HTA's
rounding of nanosecond timestamps to whole microseconds (start up, end down).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracing.reader import Trace
from viewer.analysis.intervals import Coverage
from viewer.analysis.records import JsonRecord

KERNEL_COLUMNS = ["rank", "stream", "kind", "name", "ts_ns", "dur_ns", "launch_ns", "dur_launch_delay_ns"]
CONSECUTIVE_KERNEL_DELAY_US = 30  # HTA's default `consecutive_kernel_delay`
_COLLECTIVE = re.compile(r"(?:nccl|rccl)\w*?(?:Kernel|DevKernel)_([A-Za-z]+)", re.I)


@dataclass(slots=True)
class TemporalBreakdown:
    """One rank's device time, HTA's definitions (module docstring)."""

    rank: int
    kernels: int  # device events counted (HTA's set)
    kernel_busy_us: float  # the union of their intervals
    kernel_time_us: float  # first start .. last end
    idle_pct: float
    compute_pct: float
    non_compute_pct: float
    # HTA's idle time breakdown, summed over the rank's streams: each gap between consecutive
    # kernels on a stream is host wait (the next one's launch came after the gap began),
    # kernel wait (shorter than 30 us: back-to-back launch overhead) or other
    host_wait_us: float = 0.0
    kernel_wait_us: float = 0.0
    other_idle_us: float = 0.0


@dataclass(slots=True)
class LaunchLead:
    """Each launch (a runtime call with a correlation id) against its device activity."""

    launched: int  # device activities whose launch is in the trace
    launch_delay_us_p50: float | None  # HTA's launch delay: start - the call's end, clipped at 0
    launch_delay_us_p90: float | None
    host_lead_ms_p50: float | None  # start - the call's start: how far ahead of the device the host runs
    host_lead_ms_p90: float | None


@dataclass(slots=True)
class WaitRow:
    what: str
    caller: str
    count: int
    total_ms: float


@dataclass(slots=True)
class CollectiveRow:
    collective: str
    count: int
    total_ms: float


@dataclass(slots=True)
class BatchRow:
    """Rounds with the same batch, as the engine's annotation named it."""

    prefill_reqs: int
    prefill_tokens: int
    decode_reqs: int
    decode_tokens: int
    rounds: int


@dataclass(slots=True)
class IdleRange:
    """Device idle time over the rounds, charged to the scheduling thread's innermost operator or
    annotation open at each idle instant (range "" : none was open)."""

    rank: int
    range: str
    idle_ms: float
    idle_share: float  # of the rank's device idle time over the rounds


@dataclass(slots=True)
class ImportedView(JsonRecord):
    format: str
    preset: str
    round: str
    files: int
    devices: list[str]
    truncated: list[str]
    temporal_breakdown: list[TemporalBreakdown] = field(default_factory=list)
    launch: LaunchLead | None = None
    waits: list[WaitRow] = field(default_factory=list)  # the longest first (at most 8)
    collectives: list[CollectiveRow] = field(default_factory=list)
    batches: list[BatchRow] = field(default_factory=list)
    idle_by_range: list[IdleRange] = field(default_factory=list)


def imported_view(trace: Trace, steps: pa.Table) -> ImportedView | None:
    imp = trace.meta.get("import")
    if not isinstance(imp, dict):
        return None
    src = imp.get("ranks") or {}
    view = ImportedView(
        format=str(imp.get("format")), preset=str(imp.get("preset")), round=str(imp.get("round")),
        files=len(imp.get("files") or []),
        devices=sorted({d for s in src.values() for d in s.get("devices") or [] if d}),
        truncated=[f"rank {r}: {s['truncated']}" for r, s in sorted(src.items()) if s.get("truncated")])
    k = trace.table("kernels", KERNEL_COLUMNS) if trace.has_table("kernels") else None
    if k is not None and k.num_rows:
        last_ps = _last_profiler_step(steps, imp)
        view.temporal_breakdown = [temporal_breakdown(k.filter(pc.equal(k["rank"], r)), r, last_ps)
                                   for r in pc.unique(k["rank"]).to_pylist()]
        view.launch = _launch(k)
        view.collectives = _collectives(k)
    if trace.has_table("waits"):
        view.waits = _waits(trace.table("waits"))
    view.batches = _batches(trace.table("steps"))
    view.idle_by_range = _idle_ranges(src)
    return view


def _idle_ranges(src: dict[str, Any]) -> list[IdleRange]:
    out = []
    for r, s in sorted(src.items(), key=lambda x: int(x[0])):
        idle = s.get("device_idle") or {}
        total = idle.get("idle_ns") or 0
        rows = [(x["range"], x["idle_ns"]) for x in idle.get("ranges", [])]
        rows += [("(other ranges)", idle.get("other_ranges_ns", 0)), ("", idle.get("no_range_ns", 0))]
        out += [IdleRange(int(r), n, v / 1e6, v / total if total else 0.0) for n, v in rows if v > 0]
    return out


def temporal_breakdown(k: pa.Table, rank: int, last_profiler_step_ns: int | None) -> TemporalBreakdown:
    stream = k["stream"].to_numpy()
    ts, dur = k["ts_ns"].to_numpy(), k["dur_ns"].to_numpy()
    m = stream != -1
    if last_profiler_step_ns is not None:
        launch = k["launch_ns"].to_numpy()
        m &= (launch != 0) & (launch < last_profiler_step_ns)
    kind = np.asarray(k["kind"].to_pylist(), dtype=object)[m] if m.any() else np.zeros(0, object)
    # HTA's timestamps are whole microseconds: an event's start rounded up, its end down
    # (hta/common/trace_parser.py round_down_time_stamps)
    s, e = -(-ts[m] // 1000) * 1000, (ts[m] + dur[m]) // 1000 * 1000
    if not len(s):
        return TemporalBreakdown(rank, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    busy = Coverage(s, e)
    busy_ns = float(busy.len.sum())
    span = float(busy.e[-1] - busy.s[0])
    comp = kind == "compute"
    comp_ns = float(Coverage(s[comp], e[comp]).len.sum()) if comp.any() else 0.0
    idle = span - busy_ns
    tb = TemporalBreakdown(rank, int(m.sum()), busy_ns / 1e3, span / 1e3, _pct(idle, span), _pct(comp_ns, span),
                           _pct(busy_ns - comp_ns, span))
    launch = k["launch_ns"].to_numpy()[m]
    launch_us = np.where(launch != 0, -(-launch // 1000), -1)  # rounded as HTA rounds a start
    _idle_breakdown(tb, stream[m][kind != "sync"], s[kind != "sync"] // 1000, e[kind != "sync"] // 1000,
                    launch_us[kind != "sync"])
    return tb


def _idle_breakdown(tb: TemporalBreakdown, stream: np.ndarray, s: np.ndarray, e: np.ndarray,
                    launch: np.ndarray) -> None:
    """HTA's get_idle_time_breakdown (its `_analyze_idle_time_for_stream`), in whole us."""
    o = np.lexsort((s, stream))
    stream, s, e, launch = stream[o], s[o], e[o], launch[o]
    same = np.zeros(len(s), bool)
    same[1:] = stream[1:] == stream[:-1]  # a kernel after another on its stream: the gap before it
    gap = np.zeros(len(s), np.int64)
    gap[1:] = s[1:] - e[:-1]
    prev_end = np.zeros(len(s), np.int64)
    prev_end[1:] = e[:-1]
    host = same & (launch > prev_end) & (launch >= 0)
    kernel = same & ~host & (gap < CONSECUTIVE_KERNEL_DELAY_US)
    other = same & ~host & ~kernel
    tb.host_wait_us, tb.kernel_wait_us, tb.other_idle_us = (float(gap[x].sum()) for x in (host, kernel, other))


def _pct(x: float, of: float) -> float:
    return round(100 * x / of, 2) if of else 0.0


def _last_profiler_step(steps: pa.Table, imp: dict[str, Any]) -> int | None:
    """HTA drops the last ProfilerStep's work when there are two or more of them."""
    if not re.search(r"ProfilerStep", str(imp.get("round"))) or steps.num_rows < 2:
        return None
    return int(pc.max(steps["ts_ns"]).as_py())


def _launch(k: pa.Table) -> LaunchLead:
    launch = k["launch_ns"].to_numpy()
    m = launch != 0
    if not m.any():
        return LaunchLead(0, None, None, None, None)
    delay = k["dur_launch_delay_ns"].to_numpy()[m] / 1e3
    lead = (k["ts_ns"].to_numpy()[m] - launch[m]) / 1e6
    return LaunchLead(int(m.sum()), float(np.percentile(delay, 50)), float(np.percentile(delay, 90)),
                      float(np.percentile(lead, 50)), float(np.percentile(lead, 90)))


def _collectives(k: pa.Table) -> list[CollectiveRow]:
    comm = k.filter(pc.equal(k["kind"], "comm"))
    acc: dict[str, list[float]] = {}
    for name, d in zip(comm["name"].to_pylist(), comm["dur_ns"].to_pylist(), strict=True):
        m = _COLLECTIVE.search(name)
        a = acc.setdefault(m.group(1) if m else name.split("(")[0][:40], [0, 0.0])
        a[0] += 1
        a[1] += d / 1e6
    return sorted((CollectiveRow(c, int(n), t) for c, (n, t) in acc.items()), key=lambda r: -r.total_ms)


def _waits(w: pa.Table) -> list[WaitRow]:
    if not w.num_rows:
        return []
    g = pa.table({"what": w["what"].cast(pa.string()), "caller": w["caller"].cast(pa.string()),
                  "dur_ns": w["dur_ns"]}).group_by(["what", "caller"]).aggregate([("dur_ns", "sum"),
                                                                                   ("dur_ns", "count")])
    rows = [WaitRow(a, b, int(n), s / 1e6) for a, b, s, n in zip(
        g["what"].to_pylist(), g["caller"].to_pylist(), g["dur_ns_sum"].to_pylist(), g["dur_ns_count"].to_pylist(),
        strict=True)]
    return sorted(rows, key=lambda r: -r.total_ms)[:8]


def _batches(steps: pa.Table) -> list[BatchRow]:
    cols = ["num_prefill_reqs", "num_prefill_tokens", "num_decode_reqs", "num_decode_tokens"]
    if not steps.num_rows:
        return []
    g = steps.select(cols).group_by(cols).aggregate([("num_prefill_reqs", "count")])
    rows = [BatchRow(int(a), int(b), int(c), int(d), int(n)) for a, b, c, d, n in zip(
        *(g[c].to_pylist() for c in cols), g["num_prefill_reqs_count"].to_pylist(), strict=True)]
    return sorted((r for r in rows if r.prefill_reqs or r.decode_reqs), key=lambda r: -r.rounds)
