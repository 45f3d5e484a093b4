"""`mstrace report`: the analyses of one trace assembled into one result (what --json prints).

The result is typed (ReportResult and the dataclasses under it); its JSON is derived from
it field by field (viewer/analysis/records.py), and docs/json.md is checked against it.
The text renders in viewer/render/report.py, the page in viewer/export/html.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracing.consistency import read_consistent, read_steps
from tracing.reader import Trace
from tracing.run_status import RunStatus
from viewer.analysis.advice import (
    HOP_ROWS,
    Backend,
    attacked,
    backend,
    shows_window,
    worth_attacking,
)
from viewer.analysis.bootstrap import cycle_chunk
from viewer.analysis.collectives import StragglerView, trace_stragglers
from viewer.analysis.cost import BoundaryCost, CostTable, table_of
from viewer.analysis.cycle_stream import Cycles, CycleViews, stream_views
from viewer.analysis.imported import ImportedView, imported_view
from viewer.analysis.kv import KvUsage, kv_usage
from viewer.analysis.records import INLINE, OMITTED, JsonRecord, Omitted
from viewer.analysis.serving import Dist, itl_from_runs, serving_metrics
from viewer.analysis.serving_boot import workload_digest
from viewer.analysis.whatif_gains import GainsWindow, cycle_gains, gains_window, predicts

# Only what the analyses read: a long trace's requests table is mostly token lists.
# (The probe rows are read a window at a time: viewer/analysis/cycle_stream.py.)
STEP_COLUMNS = ["step", "ts_ns", "dur_ns", "blocks_used", "collect_ns"]
# What `build_report` reads of them once the probe rows' stream has its cycles: a long trace's
# round times are 200 MB of 13 M rounds (`diff` and an imported trace's view keep them).
REPORT_STEP_COLUMNS = ["step", "blocks_used", "collect_ns"]
REQUEST_COLUMNS = ["arrival_ns", "first_token_ns", "finish_ns", "prompt_len", "output_len",
                   "finish_reason", "num_preemptions", "cached_prefix_len", "token_runs", "delivered_ns"]


@dataclass(slots=True)
class ReportInputs:
    """The tables one trace's report reads, from one consistent snapshot."""

    trace: Trace
    cycles: CycleViews  # the cost table's sums (with `per_cycle`: each cycle's)
    steps: pa.Table
    requests: pa.Table
    fitted: GainsWindow | None = None  # the rounds the round model's predictions take (a long trace's last)

    @property
    def main_rank(self) -> dict[str, np.ndarray]:
        """The views of the rank whose cycles they are (rank 0; a one-rank trace's only one)."""
        c = self.cycles
        return c.by_rank.get(0 if len(c.ranks) > 1 else (c.ranks or [0])[0], {})


@dataclass(slots=True)
class BoundaryRow:
    """A cost-table row, each number named for its view and unit (docs/json.md): the two views'
    ms per cycle are exactly the text table's (share x mean cycle); the rows' own time is
    apart, per cycle and per row, since it is in neither view (it overlaps, it hides)."""

    boundary: str
    device_ms_per_cycle: float | None
    device_share: float | None
    host_ms_per_cycle: float | None
    host_share: float | None
    count: int
    raw_ms_per_cycle: float | None
    mean_row_ms: float | None
    hidden: float | None
    removable: str


@dataclass(slots=True)
class CostView:
    """The sync-cost table of one rank. host_share_sum None: the rank has no scheduling
    thread (not rank 0), and its rows' host columns are None too."""

    cycles: int
    cycle_ms: float
    cycle_total_s: float
    idle_s: float
    wall_s: float
    device_busy: float
    device_share_sum: float
    host_share_sum: float | None
    negative: list[str]
    boundaries: list[BoundaryRow]

    def row(self, boundary: str) -> BoundaryRow | None:
        return next((b for b in self.boundaries if b.boundary == boundary), None)


@dataclass(slots=True)
class Throughput:
    requests: int
    completed: int
    submitted: int | None
    finish_reasons: dict[str, int]
    duration_s: float
    request_per_s: float
    input_tok_per_s: float
    output_tok_per_s: float
    input_tokens: int
    output_tokens: int
    preemptions: int


@dataclass(slots=True)
class DistStats:
    """A latency distribution's summary; None where it has no values."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    count: int

    @classmethod
    def of(cls, d: Dist) -> DistStats:
        def num(v: float) -> float | None:
            return None if isinstance(v, float) and math.isnan(v) else v

        return cls(num(d.mean), num(d.p50), num(d.p90), num(d.p99), d.count)


@dataclass(slots=True)
class Latency:
    ttft_ms: DistStats
    tpot_ms: DistStats
    itl_ms: DistStats
    e2e_ms: DistStats
    # What the client saw, from the sender's side (only a trace that records deliveries): a
    # slow client's requests end long after the engine finished them (arrival -> delivery,
    # and finish -> delivery).
    delivered_e2e_ms: DistStats | Omitted = OMITTED
    delivery_lag_ms: DistStats | Omitted = OMITTED

    def items(self) -> Iterator[tuple[str, DistStats]]:
        """(name, distribution) of each latency this trace has, in order."""
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "delivered_e2e_ms", "delivery_lag_ms"):
            d = getattr(self, name)
            if d is not OMITTED:
                yield name, d


@dataclass(slots=True)
class ReportResult(JsonRecord):
    """Everything `report` shows. `cost` prints inline: its keys are the top level's."""

    trace: str
    status: RunStatus
    model: str | None
    mode: str | None
    dtype: str | None  # what ran (older traces: unknown)
    dtype_choice: str | None  # how --dtype chose it (older traces: unknown)
    weight_pack_choice: str | None  # how --weight-pack chose the CPU's GEMM (older traces: unknown)
    pages: str | None  # what the host's KV pool and weights got on 2 MB pages (a GPU's, older traces: None)
    primitive_cache: str | None  # the oneDNN primitive cache the CPU's GEMMs asked for (a GPU's, older: None)
    workload_digest: str | None
    probes: bool
    backend: Backend
    cost: CostView = field(metadata=INLINE)
    worth_attacking: list[str]
    worth_attacking_rounds: str | None  # A-B: the rounds a long trace's predictions are of (None: the whole run's)
    throughput: Throughput
    latency: Latency
    kv: KvUsage
    # several ranks: every rank's rows against rank 0's cycles (TP/PP: docs/report.md)
    per_rank: dict[str, CostView] | Omitted = OMITTED
    stragglers: StragglerView | None | Omitted = OMITTED  # only with a collectives table
    imported: ImportedView | Omitted = OMITTED  # only a trace `mstrace import` wrote


def load_inputs(root: str | Path, request_columns: list[str] = REQUEST_COLUMNS,
                per_cycle: bool = False) -> ReportInputs:
    """One snapshot's steps and requests whole, its probe rows a window at a time
    (`per_cycle`: keep each cycle's views, what `diff` resamples, not only their sums, and every
    STEP_COLUMNS, a long trace's in chunks of cycles (`bootstrap.cycle_chunk`); else
    REPORT_STEP_COLUMNS)."""
    trace = Trace.open(root)
    # One chunk a column: the ITL's and the cycles' numpy views of them are then not copies.
    steps = read_steps(trace, STEP_COLUMNS).combine_chunks()
    keep = STEP_COLUMNS if per_cycle or "import" in trace.meta else REPORT_STEP_COLUMNS
    cycles = Cycles.of(trace, steps)
    fitted = gains_window(steps) if predicts(trace.meta) else None  # (while the steps hold their times)
    steps = steps.select(keep)  # (both keep what the requests' check reads: step, collect_ns)
    # The probe rows stream beside the requests' read and checks: both mostly decode and
    # numpy, which release the GIL.
    with ThreadPoolExecutor(max_workers=1) as pool:
        job = pool.submit(stream_views, trace, cycles, not per_cycle, head_rows=HOP_ROWS,
                          chunk=cycle_chunk(len(cycles.start_ns)))
        del cycles  # (a long trace's: 107 MB, freed with the stream's totals)
        # its chunks as read: combining them would copy 0.5 GB of a 100 M-row trace's requests
        requests = read_consistent(trace, {"requests": request_columns}, steps=steps,
                                   uncombined=("requests",))["requests"]
        views = job.result()
    return ReportInputs(trace, views, steps, requests, fitted)


def _worth_attacking(inp: ReportInputs, cost: CostTable, config: dict[str, Any],
                     predict: bool) -> tuple[list[str], str | None]:
    """The lines, with the round model's predictions for the rows worth attacking (none for
    another engine's trace; a long trace's fitted on its last rounds, `gains_window`, whose
    A-B comes too)."""
    gains = {}
    if predict and predicts(inp.trace.meta) and cost.cycles:
        gains = cycle_gains(inp.trace.root, attacked(cost), config.get("mode"), inp.fitted)
    fitted = inp.fitted if gains else None
    lines = worth_attacking(cost, config.get("mode"), config, gains, fitted)
    return lines, fitted.rounds if fitted is not None and shows_window(lines, fitted) else None


def build_report(root: str | Path | ReportInputs, predict: bool = True) -> ReportResult:
    """Everything `report` shows (its to_json() is what --json prints); `predict`: with the
    round model's predictions in the "worth attacking" lines (a caller that shows no lines
    leaves the fit out)."""
    inp = root if isinstance(root, ReportInputs) else load_inputs(root)
    meta, steps, requests = inp.trace.meta, inp.steps, inp.requests
    # ITL from token runs and round collect times: exact, and a long trace's tens
    # of millions of per-token gaps never have to be read
    itl = itl_from_runs(requests["token_runs"].chunks, steps["step"].to_numpy(), steps["collect_ns"].to_numpy())
    serving = serving_metrics(requests, itl)
    kv = kv_usage(steps, requests, int(meta.get("model", {}).get("kv_blocks", 0)))
    cost = table_of(inp.main_rank)
    config = meta.get("config", {})
    # no advice from a table no probe filled (--no-probes: every cycle is unattributed)
    attack = _worth_attacking(inp, cost, config, predict) if config.get("probes", True) else ([], None)
    rep = ReportResult(
        trace=str(inp.trace.root),
        status=inp.trace.status,
        model=meta.get("model", {}).get("name"),
        mode=config.get("mode"),
        dtype=meta.get("model", {}).get("dtype"),
        dtype_choice=meta.get("model", {}).get("dtype_choice"),
        weight_pack_choice=meta.get("model", {}).get("weight_pack_choice"),
        pages=meta.get("model", {}).get("pages"),
        primitive_cache=meta.get("model", {}).get("primitive_cache"),
        workload_digest=workload_digest(meta),
        probes=config.get("probes", True),
        backend=backend(meta, inp.cycles.head),
        cost=cost_view(cost),
        worth_attacking=attack[0],
        worth_attacking_rounds=attack[1],
        throughput=Throughput(
            requests=serving.requests, completed=serving.completed, submitted=inp.trace.status.submitted,
            finish_reasons=serving.finish_reasons, duration_s=serving.duration_s,
            request_per_s=serving.request_per_s, input_tok_per_s=serving.input_tok_per_s,
            output_tok_per_s=serving.output_tok_per_s, input_tokens=serving.input_tokens,
            output_tokens=serving.output_tokens, preemptions=serving.preemptions),
        latency=Latency(*(DistStats.of(getattr(serving, k)) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")),
                        *_delivery(requests)),
        kv=kv,
    )
    if len(inp.cycles.ranks) > 1:
        rep.per_rank = {str(r): cost_view(table_of(inp.cycles.by_rank[r]), host_view=r == 0)
                        for r in inp.cycles.ranks}
    # joined as the stream read the collectives (a trace without cycles reads them here)
    rows, sv = inp.cycles.stragglers if inp.cycles.stragglers is not None else trace_stragglers(inp.trace)
    if rows:
        rep.stragglers = sv
    imp = imported_view(inp.trace, steps)
    if imp is not None:
        rep.imported = imp
    return rep


def cost_view(c: CostTable, host_view: bool = True) -> CostView:
    """`host_view`: the rank has a scheduling thread (rank 0); another rank's host columns are
    None, not a table of time no probe covered."""
    rows = [_boundary_row(b, c) for b in c.boundaries]
    if not host_view:
        for r in rows:
            r.host_ms_per_cycle = r.host_share = None
    return CostView(cycles=c.cycles, cycle_ms=c.cycle_ms, cycle_total_s=c.cycle_total_s, idle_s=c.idle_s,
                    wall_s=c.wall_s, device_busy=c.device_busy, device_share_sum=c.share_sum,
                    host_share_sum=c.host_share_sum if host_view else None, negative=c.negative, boundaries=rows)


def _boundary_row(b: BoundaryCost, c: CostTable) -> BoundaryRow:
    cyc = c.cycle_ms
    return BoundaryRow(
        boundary=b.boundary,
        device_ms_per_cycle=None if b.share is None else b.share * cyc, device_share=b.share,
        host_ms_per_cycle=None if b.host_share is None else b.host_share * cyc, host_share=b.host_share,
        count=b.count,
        raw_ms_per_cycle=b.raw_ms_per_cycle if b.count else None,
        mean_row_ms=b.raw_ms_per_cycle * c.cycles / b.count if b.count else None,
        hidden=b.hidden, removable=b.removable)


def _delivery(requests: pa.Table) -> tuple[DistStats, DistStats] | tuple[()]:
    """Delivery latencies (delivered_e2e_ms, delivery_lag_ms) of the served requests whose
    delivery was recorded (none in a trace from before requests.delivered_ns existed)."""
    delivered, first = requests["delivered_ns"].to_numpy(), requests["first_token_ns"].to_numpy()
    m = (delivered > 0) & (first > 0)
    if not m.any():
        return ()
    arrival, finish = requests["arrival_ns"].to_numpy()[m], requests["finish_ns"].to_numpy()[m]
    return (DistStats.of(Dist.of((delivered[m] - arrival) / 1e6)),
            DistStats.of(Dist.of((delivered[m] - finish) / 1e6)))
