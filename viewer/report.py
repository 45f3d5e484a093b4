"""`mstrace report`: assemble the analyses for one trace and render them."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tracing.consistency import read_consistent
from tracing.reader import Trace
from tracing.run_status import RunStatus
from viewer.analysis.advice import backend, worth_attacking
from viewer.analysis.collectives import COLUMNS as COLLECTIVE_COLUMNS
from viewer.analysis.collectives import straggler_view
from viewer.analysis.cost import BoundaryCost, CostTable, cost_table
from viewer.analysis.kv import kv_usage
from viewer.analysis.serving import Dist, itl_from_runs, serving_metrics

# Only what the analyses read: a long trace's requests table is mostly token lists.
PROBE_COLUMNS = ["ts_ns", "dur_ns", "boundary", "rank"]  # rank: only read when the run had several
# Boundaries with rows on the scheduling thread and on a device stream (defrag: the host's
# pause and the device's copy): only then is `stream` read, to tell the host view's rows
# apart. A column chunk per row group costs ~10 us to decode: on a long uncompacted trace a
# column read for nothing is 0.1-0.2 s.
BOTH_SIDES = ("defrag",)
STEP_COLUMNS = ["step", "ts_ns", "dur_ns", "blocks_used", "collect_ns"]
REQUEST_COLUMNS = ["arrival_ns", "first_token_ns", "finish_ns", "prompt_len", "output_len",
                   "finish_reason", "num_preemptions", "cached_prefix_len", "token_runs", "delivered_ns"]
# What the client saw, from the sender's side: a slow client's requests end long after the
# engine finished them (arrival -> delivery, and finish -> delivery).
DELIVERY = (("delivered_e2e_ms", "E2E delivered ms"), ("delivery_lag_ms", "delivery lag ms"))


@dataclass(slots=True)
class ReportInputs:
    """The tables one trace's report reads, from one consistent snapshot."""

    trace: Trace
    probes: pa.Table
    steps: pa.Table
    requests: pa.Table
    collectives: pa.Table | None


def load_inputs(root: str | Path, request_columns: list[str] = REQUEST_COLUMNS) -> ReportInputs:
    trace = Trace.open(root)
    ranks = trace.meta.get("ranks")
    # A long trace's probes are most of its bytes: skip the rank column when the run had one rank.
    probe_cols = PROBE_COLUMNS if not isinstance(ranks, dict) or len(ranks) > 1 else PROBE_COLUMNS[:-1]
    want: dict[str, list[str] | None] = {"probes": probe_cols, "steps": STEP_COLUMNS, "requests": request_columns}
    t = read_consistent(trace, want)
    names = {n for c in t["probes"]["boundary"].chunks for n in c.dictionary.to_pylist()}
    if names & set(BOTH_SIDES):
        t["probes"] = read_consistent(trace, {"probes": [*probe_cols, "stream"]})["probes"]
    return ReportInputs(trace, t["probes"], t["steps"], t["requests"], read_collectives(trace))


def build_report(root: str | Path | ReportInputs) -> dict[str, Any]:
    """Everything `report` shows, as plain data (what --json prints)."""
    inp = root if isinstance(root, ReportInputs) else load_inputs(root)
    meta, probes, steps, requests, colls = inp.trace.meta, inp.probes, inp.steps, inp.requests, inp.collectives
    # The cost table runs beside the request metrics: both are numpy passes that release the GIL.
    with ThreadPoolExecutor(max_workers=1) as pool:
        cost_job = pool.submit(cost_table, probes, steps, collectives=colls)
        # ITL from token runs and round collect times: exact, and a long trace's tens
        # of millions of per-token gaps never have to be read
        itl = itl_from_runs(requests["token_runs"].chunks, steps["step"].to_numpy(), steps["collect_ns"].to_numpy())
        serving = serving_metrics(requests, itl)
        kv = kv_usage(steps, requests, int(meta.get("model", {}).get("kv_blocks", 0)))
        cost = cost_job.result()
    rep: dict[str, Any] = {
        "trace": str(inp.trace.root),
        "status": inp.trace.status.to_dict(),
        "model": meta.get("model", {}).get("name"),
        "mode": meta.get("config", {}).get("mode"),
        "dtype": meta.get("model", {}).get("dtype"),  # what ran (older traces: unknown)
        "workload_digest": meta.get("workload", {}).get("digest"),
        "probes": meta.get("config", {}).get("probes", True),
        "backend": backend(meta, probes).to_dict(),
        **_cost_dict(cost),
        "worth_attacking": worth_attacking(cost, meta.get("config", {}).get("mode"), meta.get("config", {})),
        "throughput": {
            "requests": serving.requests,
            "completed": serving.completed,
            "submitted": inp.trace.status.submitted,
            "finish_reasons": serving.finish_reasons,
            "duration_s": serving.duration_s,
            "request_per_s": serving.request_per_s,
            "input_tok_per_s": serving.input_tok_per_s,
            "output_tok_per_s": serving.output_tok_per_s,
            "input_tokens": serving.input_tokens,
            "output_tokens": serving.output_tokens,
            "preemptions": serving.preemptions,
        },
        "latency": {k: _dist(getattr(serving, k)) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
        "kv": kv.to_dict(),
    }
    rep["latency"].update(_delivery(requests))
    ranks = pc.unique(probes["rank"]).to_pylist() if probes.num_rows and "rank" in probes.column_names else []
    if len(ranks) > 1:
        # every rank's rows against rank 0's cycles (TP/PP: docs/report.md)
        rep["per_rank"] = {str(r): _cost_dict(cost_table(probes, steps, rank=r, collectives=colls), host_view=r == 0)
                           for r in sorted(ranks)}
    if colls is not None:
        sv = straggler_view(colls)
        rep["stragglers"] = sv.to_dict() if sv is not None else None
    return rep


def read_collectives(trace: Trace) -> pa.Table | None:
    """The collectives table (TP runs), or None: traces from before it existed have no folder."""
    if not trace.has_table("collectives"):
        return None
    t = trace.table("collectives", COLLECTIVE_COLUMNS)
    return t if t.num_rows else None


def status_line(console: Console, status: dict[str, Any], trace: str) -> None:
    """The first line of every command on a trace that is not complete."""
    rs = RunStatus(**status)
    line = rs.headline()
    if line is None:
        return
    if rs.state == "stalled":
        line += f"; see `mstrace stalls {trace}`"
    console.print(f"[bold yellow]{escape(line)}[/]", highlight=False, soft_wrap=True)


def trace_heading(console: Console, trace: str, tail: str, lead: str = "") -> None:
    """A trace's path and what follows it as one line that the terminal wraps, not rich: rich
    would break a long path at the width (or the words after it), and a broken path no longer
    pastes into a shell."""
    console.print(Text.assemble((lead, "bold"), (str(trace), "bold"), tail), highlight=False, soft_wrap=True)


def _cost_dict(c: CostTable, host_view: bool = True) -> dict[str, Any]:
    """`host_view`: the rank has a scheduling thread (rank 0); another rank's host columns are
    null, not a table of time no probe covered."""
    d: dict[str, Any] = {
        "cycles": c.cycles,
        "cycle_ms": c.cycle_ms,
        "cycle_total_s": c.cycle_total_s,
        "idle_s": c.idle_s,
        "wall_s": c.wall_s,
        "device_busy": c.device_busy,
        "device_share_sum": c.share_sum,
        "host_share_sum": c.host_share_sum,
        "negative": c.negative,
        "boundaries": [_boundary_dict(b, c) for b in c.boundaries],
    }
    if not host_view:
        d["host_share_sum"] = None
        for b in d["boundaries"]:
            b["host_ms_per_cycle"] = b["host_share"] = None
    return d


def _boundary_dict(b: BoundaryCost, c: CostTable) -> dict[str, Any]:
    """A row as JSON, each number named for its view and unit (docs/json.md): the two views'
    ms per cycle are exactly the text table's (share x mean cycle); the rows' own time is
    apart, per cycle and per row, since it is in neither view (it overlaps, it hides)."""
    cyc = c.cycle_ms
    return {"boundary": b.boundary,
            "device_ms_per_cycle": None if b.share is None else b.share * cyc, "device_share": b.share,
            "host_ms_per_cycle": None if b.host_share is None else b.host_share * cyc, "host_share": b.host_share,
            "count": b.count,
            "raw_ms_per_cycle": b.raw_ms_per_cycle if b.count else None,
            "mean_row_ms": b.raw_ms_per_cycle * c.cycles / b.count if b.count else None,
            "hidden": b.hidden, "removable": b.removable}


def _delivery(requests: pa.Table) -> dict[str, dict[str, float | int | None]]:
    """Delivery latencies of the served requests whose delivery was recorded (none in a trace
    from before requests.delivered_ns existed)."""
    delivered, first = requests["delivered_ns"].to_numpy(), requests["first_token_ns"].to_numpy()
    m = (delivered > 0) & (first > 0)
    if not m.any():
        return {}
    arrival, finish = requests["arrival_ns"].to_numpy()[m], requests["finish_ns"].to_numpy()[m]
    return {"delivered_e2e_ms": _dist(Dist.of((delivered[m] - arrival) / 1e6)),
            "delivery_lag_ms": _dist(Dist.of((delivered[m] - finish) / 1e6))}


def _dist(d: Dist) -> dict[str, float | int | None]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in (("mean", d.mean), ("p50", d.p50), ("p90", d.p90), ("p99", d.p99), ("count", d.count))}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _ms(x: float | int | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def render_cost(console: Console, c: dict[str, Any], title: str, whose: str = "the device") -> None:
    """Both views side by side, in ms per cycle and shares; each view's column sums to the cycle.
    A table without a host view (a rank with no scheduling thread) has the device's only.
    Simple box and short headers: the table fits 80 columns."""
    host = c["host_share_sum"] is not None
    t = Table(title=title, header_style="bold", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("boundary", no_wrap=True)
    heads = ("device\nms/cyc", "device\nshare", *(("host\nms/cyc", "host\nshare") if host else ()), "count", "hidden")
    for head in heads:
        t.add_column(head, justify="right", no_wrap=True)
    cyc = c["cycle_ms"]
    for b in c["boundaries"]:
        hv = (_ms(b["host_ms_per_cycle"]), _pct(b["host_share"])) if host else ()
        t.add_row(b["boundary"], _ms(b["device_ms_per_cycle"]), _pct(b["device_share"]), *hv,
                  str(b["count"]) if b["count"] else "", _pct(b["hidden"]) if b["hidden"] is not None else "")
    t.add_section()
    hv = (_ms(cyc * c["host_share_sum"]), _pct(c["host_share_sum"])) if host else ()
    t.add_row("cycle", _ms(cyc * c["device_share_sum"]), _pct(c["device_share_sum"]), *hv, str(c["cycles"]), "")
    console.print(t)
    barrier = next((b for b in c["boundaries"] if b["boundary"] == "scheduler_barrier"), None)
    waits = f"; the scheduling thread waits for the device {_pct(barrier['host_share'])} of it" \
        if barrier and barrier["host_share"] is not None else ""
    console.print(
        f"cycle {_ms(cyc)} ms: {whose} computes {_pct(c['device_busy'])} of it{waits}.\n"
        f"wall {c['wall_s']:.2f} s = {c['cycle_total_s']:.2f} s in {c['cycles']} cycles "
        f"+ {c['idle_s']:.2f} s idle (no work)",
        highlight=False,
    )
    if c.get("negative"):
        console.print(f"[bold red]negative rows: {escape(', '.join(c['negative']))}: probes overlap there, "
                      "so these shares double-count[/]", highlight=False)


def render_report(console: Console, rep: dict[str, Any]) -> None:
    status_line(console, rep["status"], rep["trace"])
    dtype = f"  dtype={rep['dtype']}" if rep.get("dtype") else ""
    trace_heading(console, rep["trace"], f"  model={rep['model']}  mode={rep['mode']}{dtype}")
    if not rep["probes"]:
        console.print("[yellow]this trace was recorded with --no-probes: no cost table[/]")
    else:
        render_cost(console, rep, "sync-cost table: each cycle in the device's and the host's view")
        for line in rep["worth_attacking"]:
            console.print(f"worth attacking: {escape(line)}", highlight=False)
        be = rep["backend"]
        for note in be["notes"]:
            console.print(f"[dim]{be['name']} backend (emulated): {escape(note)}[/]", highlight=False)
    for r, c in rep.get("per_rank", {}).items():
        if r != "0":  # rank 0's is the table above: the scheduler's rank
            render_cost(console, c, f"rank {r} (against rank 0's cycles; no scheduling thread, so the device's view "
                                    "only)", whose=f"rank {r}'s device")
    if rep.get("per_rank"):
        render_comm(console, rep)

    tp = rep["throughput"]
    t = Table(title="throughput and latency", header_style="bold", title_justify="left")
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")
    rows = (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms"), *DELIVERY)
    for name, label in rows:
        d = rep["latency"].get(name)
        if d is not None:
            t.add_row(label, *(_ms(d[k]) for k in ("mean", "p50", "p90", "p99")))
    console.print(t)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(tp["finish_reasons"].items()))
    submitted = f", {tp['submitted']} submitted" if rep["status"]["state"] == "interrupted" else ""
    console.print(
        f"{tp['completed']}/{tp['requests']} requests{submitted} ({reasons}) in {tp['duration_s']:.2f} s: "
        f"{tp['input_tok_per_s']:.1f} input tok/s, {tp['output_tok_per_s']:.1f} output tok/s, "
        f"{tp['request_per_s']:.2f} req/s; {tp['preemptions']} preemptions",
        highlight=False,
    )
    kv = rep["kv"]
    console.print(
        f"KV: peak {kv['peak_blocks']}/{kv['num_blocks']} blocks ({_pct(kv['peak_occupancy'])}), "
        f"mean occupancy {_pct(kv['mean_occupancy'])}, prefix-sharing hit rate {_pct(kv['prefix_hit_rate'])} "
        f"({kv['prefix_hit_tokens']} of {kv['prompt_tokens']} prompt tokens)",
        highlight=False,
    )


def render_comm(console: Console, rep: dict[str, Any]) -> None:
    """TP/PP: all_reduce exposed vs hidden per rank (HTA's comm/compute overlap), then stragglers."""
    t = Table(title="all_reduce per rank: exposed (host wait) vs hidden (rank computing)",
              header_style="bold", title_justify="left")
    for col in ("rank", "collectives", "raw ms/cyc", "exposed", "hidden", "pp_bubble exposed"):
        t.add_column(col, justify="right")
    for r, c in rep["per_rank"].items():
        b = {x["boundary"]: x for x in c["boundaries"]}
        ar, pb = b.get("all_reduce"), b.get("pp_bubble")
        t.add_row(r, str(ar["count"]) if ar else "0", _ms(ar["raw_ms_per_cycle"]) if ar else "—",
                  _pct(ar["device_share"]) if ar else "—", _pct(ar["hidden"]) if ar else "—",
                  _pct(pb["device_share"]) if pb else "—")
    console.print(t)
    sv = rep.get("stragglers")
    if not sv:
        return
    st = Table(title=f"stragglers: which rank issued each collective last ({sv['collectives']} collectives; "
                     f"lateness p50 {sv['lateness_p50_ms']:.3f} ms, p99 {sv['lateness_p99_ms']:.3f} ms)",
               header_style="bold", title_justify="left")
    for col in ("rank", "last", "share", "mean late ms", "max late ms"):
        st.add_column(col, justify="right")
    for x in sv["ranks"]:
        st.add_row(str(x["rank"]), str(x["last"]), _pct(x["share"]), f"{x['mean_ms']:.3f}", f"{x['max_ms']:.3f}")
    console.print(st)
    worst = ", ".join(f"{w['group']} #{w['seq']} (step {w['step']}): rank {w['rank']} +{w['late_ms']:.2f} ms"
                      for w in sv["worst"])
    console.print(f"latest arrivals: {worst}", highlight=False)
