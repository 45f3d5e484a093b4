"""`mstrace report` as text: the sync-cost table, throughput and latency, KV usage."""

from __future__ import annotations

from collections.abc import Callable

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from viewer.analysis.collectives import StragglerView
from viewer.analysis.imported import ImportedView
from viewer.analysis.report import CostView, ReportResult
from viewer.render.text import ms, pct, status_line, trace_heading

LATENCY_ROWS = (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms"),
                ("delivered_e2e_ms", "E2E delivered ms"), ("delivery_lag_ms", "delivery lag ms"))


def render_cost(console: Console, c: CostView, title: str, whose: str = "the device") -> None:
    """Both views side by side, in ms per cycle and shares; each view's column sums to the cycle.
    A table without a host view (a rank with no scheduling thread) has the device's only.
    Simple box and short headers: the table fits 80 columns."""
    host = c.host_share_sum is not None
    t = Table(title=title, header_style="bold", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("boundary", no_wrap=True)
    heads = ("device\nms/cyc", "device\nshare", *(("host\nms/cyc", "host\nshare") if host else ()), "count", "hidden")
    for head in heads:
        t.add_column(head, justify="right", no_wrap=True)
    cyc = c.cycle_ms
    for b in c.boundaries:
        hv = (ms(b.host_ms_per_cycle), pct(b.host_share)) if host else ()
        t.add_row(b.boundary, ms(b.device_ms_per_cycle), pct(b.device_share), *hv,
                  str(b.count) if b.count else "", pct(b.hidden) if b.hidden is not None else "")
    t.add_section()
    hv = (ms(cyc * c.host_share_sum), pct(c.host_share_sum)) if c.host_share_sum is not None else ()
    t.add_row("cycle", ms(cyc * c.device_share_sum), pct(c.device_share_sum), *hv, str(c.cycles), "")
    console.print(t)
    barrier = c.row("scheduler_barrier")
    waits = f"; the scheduling thread waits for the device {pct(barrier.host_share)} of it" \
        if barrier and barrier.host_share is not None else ""
    console.print(
        f"cycle {ms(cyc)} ms: {whose} computes {pct(c.device_busy)} of it{waits}.\n"
        f"wall {c.wall_s:.2f} s = {c.cycle_total_s:.2f} s in {c.cycles} cycles "
        f"+ {c.idle_s:.2f} s idle (no work)",
        highlight=False,
    )
    if c.negative:
        console.print(f"[bold red]negative rows: {escape(', '.join(c.negative))}: probes overlap there, "
                      "so these shares double-count[/]", highlight=False)


def render_report(console: Console, rep: ReportResult) -> None:
    status_line(console, rep.status, rep.trace)
    dtype = f"  dtype={rep.dtype}" if rep.dtype else ""
    trace_heading(console, rep.trace, f"  model={rep.model}  mode={rep.mode}{dtype}")
    if rep.dtype_choice and rep.dtype_choice != "asked":
        console.print(f"[dim]dtype {escape(rep.dtype_choice)}[/]", highlight=False)
    if rep.weight_pack_choice and rep.weight_pack_choice.startswith("auto"):
        console.print(f"[dim]weight pack {escape(rep.weight_pack_choice)}[/]", highlight=False)
    if rep.pages:
        console.print(f"[dim]pages {escape(rep.pages)}[/]", highlight=False)
    if rep.primitive_cache:
        console.print(f"[dim]oneDNN primitive cache {escape(rep.primitive_cache)}[/]", highlight=False)
    imp = rep.imported if isinstance(rep.imported, ImportedView) else None
    if imp is not None and imp.format == "otlp":
        console.print("request spans received over OTLP: latencies and tokens per request; no rounds, no device")
    elif not rep.probes:
        console.print("[yellow]this trace was recorded with --no-probes: no cost table[/]")
    else:
        render_cost(console, rep.cost, "sync-cost table: each cycle in the device's and the host's view")
        for line in rep.worth_attacking:
            console.print(f"worth attacking: {escape(line)}", highlight=False)
        be = rep.backend
        for note in be.notes:
            how = " (emulated)" if be.emulated else ""
            console.print(f"[dim]{be.name}{how}: {escape(note)}[/]", highlight=False)
    per_rank = rep.per_rank if isinstance(rep.per_rank, dict) else {}
    for r, c in per_rank.items():
        if r != "0":  # rank 0's is the table above: the scheduler's rank
            render_cost(console, c, f"rank {r} (against rank 0's cycles; no scheduling thread, so the device's view "
                                    "only)", whose=f"rank {r}'s device")
    if per_rank:
        render_comm(console, rep, per_rank)
    if imp is not None and imp.format != "otlp":
        render_imported(console, imp)
        if not rep.throughput.requests:  # a profiler trace has no requests: no latency, no KV
            return

    tp = rep.throughput
    t = Table(title="throughput and latency", header_style="bold", title_justify="left")
    t.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        t.add_column(col, justify="right")
    have = dict(rep.latency.items())
    for name, label in LATENCY_ROWS:
        d = have.get(name)
        if d is not None:
            t.add_row(label, ms(d.mean), ms(d.p50), ms(d.p90), ms(d.p99))
    console.print(t)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(tp.finish_reasons.items()))
    submitted = f", {tp.submitted} submitted" if rep.status.state == "interrupted" else ""
    console.print(
        f"{tp.completed}/{tp.requests} requests{submitted} ({reasons}) in {tp.duration_s:.2f} s: "
        f"{tp.input_tok_per_s:.1f} input tok/s, {tp.output_tok_per_s:.1f} output tok/s, "
        f"{tp.request_per_s:.2f} req/s; {tp.preemptions} preemptions",
        highlight=False,
    )
    kv = rep.kv
    if imp is not None:  # no engine's block table in another engine's spans
        return
    console.print(
        f"KV: peak {kv.peak_blocks}/{kv.num_blocks} blocks ({pct(kv.peak_occupancy)}), "
        f"mean occupancy {pct(kv.mean_occupancy)}, prefix-sharing hit rate {pct(kv.prefix_hit_rate)} "
        f"({kv.prefix_hit_tokens} of {kv.prompt_tokens} prompt tokens)",
        highlight=False,
    )


def render_comm(console: Console, rep: ReportResult, per_rank: dict[str, CostView]) -> None:
    """TP/PP: all_reduce exposed vs hidden per rank (HTA's comm/compute overlap), then stragglers."""
    t = Table(title="all_reduce per rank: exposed (host wait) vs hidden (rank computing)",
              header_style="bold", title_justify="left")
    for col in ("rank", "collectives", "raw ms/cyc", "exposed", "hidden", "pp_bubble exposed"):
        t.add_column(col, justify="right")
    for r, c in per_rank.items():
        ar, pb = c.row("all_reduce"), c.row("pp_bubble")
        t.add_row(r, str(ar.count) if ar else "0", ms(ar.raw_ms_per_cycle) if ar else "—",
                  pct(ar.device_share) if ar else "—", pct(ar.hidden) if ar else "—",
                  pct(pb.device_share) if pb else "—")
    console.print(t)
    sv = rep.stragglers
    if not isinstance(sv, StragglerView):  # none, or the trace has no collectives table
        return
    st = Table(title=f"stragglers: which rank issued each collective last ({sv.collectives} collectives; "
                     f"lateness p50 {sv.lateness_p50_ms:.3f} ms, p99 {sv.lateness_p99_ms:.3f} ms)",
               header_style="bold", title_justify="left")
    for col in ("rank", "last", "share", "mean late ms", "max late ms"):
        st.add_column(col, justify="right")
    for x in sv.ranks:
        st.add_row(str(x.rank), str(x.last), pct(x.share), f"{x.mean_ms:.3f}", f"{x.max_ms:.3f}")
    console.print(st)
    worst = ", ".join(f"{w.group} #{w.seq} (step {w.step}): rank {w.rank} +{w.late_ms:.2f} ms" for w in sv.worst)
    console.print(f"latest arrivals: {worst}", highlight=False)


def render_modes(console: Console, reps: dict[str, ReportResult]) -> None:
    """`run --mode all`'s control-group table: one column per mode."""
    t = Table(title="same workload, three modes", header_style="bold", title_justify="left")
    t.add_column("metric")
    for m in reps:
        t.add_column(m, justify="right")

    def row(label: str, f: Callable[[ReportResult], float | None], fmt: str) -> None:
        t.add_row(label, *("—" if (v := f(r)) is None else format(v, fmt) for r in reps.values()))

    def exposed(name: str) -> Callable[[ReportResult], float | None]:
        return lambda r: next((100 * (b.device_share or 0) for b in r.cost.boundaries if b.boundary == name), None)

    row("output tok/s", lambda r: r.throughput.output_tok_per_s, ".1f")
    row("cycle ms", lambda r: r.cost.cycle_ms, ".2f")
    row("device busy %", lambda r: 100 * r.cost.device_busy, ".1f")
    row("barrier exposed %", exposed("scheduler_barrier"), ".1f")
    row("bookkeeping exposed %", exposed("bookkeeping"), ".1f")
    row("batch_prepare exposed %", exposed("batch_prepare"), ".1f")
    def quantile(k: str, q: str) -> Callable[[ReportResult], float | None]:
        return lambda r: getattr(getattr(r.latency, k), q)

    for k, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        row(f"{label} p50 ms", quantile(k, "p50"), ".1f")
        row(f"{label} p99 ms", quantile(k, "p99"), ".1f")
    console.print(t)


def render_imported(console: Console, v: ImportedView) -> None:
    """What an imported profiler trace adds: its batches, launch lead, HTA's breakdown, waits, collectives."""
    devices = ", ".join(v.devices) or "no device named"
    console.print(f"imported {v.format} ({v.files} file(s), {devices}); rounds: {escape(v.round)} "
                  f"(preset {v.preset})", highlight=False, soft_wrap=True)
    for b in v.batches:
        parts = ([f"extend {b.prefill_reqs} with {b.prefill_tokens:,} tokens"] if b.prefill_reqs else []) + \
            ([f"decode {b.decode_reqs}"] if b.decode_reqs else [])
        console.print(f"batch: {' + '.join(parts)} ({b.rounds} rounds)", highlight=False)
    la = v.launch
    if la is not None and la.launched:
        console.print(f"launch: the host runs {la.host_lead_ms_p50:.3f} ms ahead of the device (median launch -> "
                      f"start; p90 {la.host_lead_ms_p90:.3f} ms); HTA's launch delay p50 {la.launch_delay_us_p50:.1f} us, "
                      f"p90 {la.launch_delay_us_p90:.1f} us ({la.launched} launches)", highlight=False)
    if v.temporal_breakdown:
        t = Table(title="device time, HTA's temporal breakdown", header_style="bold", title_justify="left")
        # HTA's own unit (us), as --json has them: one number, one meaning
        for col in ("rank", "kernels", "busy us", "span us", "idle", "compute", "non-compute"):
            t.add_column(col, justify="right")
        for r in v.temporal_breakdown:
            t.add_row(str(r.rank), str(r.kernels), f"{r.kernel_busy_us:.0f}", f"{r.kernel_time_us:.0f}",
                      f"{r.idle_pct:.2f}%", f"{r.compute_pct:.2f}%", f"{r.non_compute_pct:.2f}%")
        console.print(t)
        for r in v.temporal_breakdown:
            console.print(f"rank {r.rank}, HTA's idle time breakdown over its streams: host wait "
                          f"{r.host_wait_us:.0f} us, kernel wait {r.kernel_wait_us:.0f} us, other "
                          f"{r.other_idle_us:.0f} us", highlight=False)
    if v.idle_by_range:
        t = Table(title="device idle by the host range open at the time (innermost op or annotation of the "
                        "scheduling thread)", header_style="bold", title_justify="left")
        for col, j in (("rank", "right"), ("range", "left"), ("idle ms", "right"), ("of idle", "right")):
            t.add_column(col, justify=j)  # type: ignore[arg-type]
        for x in v.idle_by_range:
            t.add_row(str(x.rank), escape(x.range or "(no range open)")[:60], f"{x.idle_ms:.3f}", pct(x.idle_share))
        console.print(t)
    if v.waits:
        t = Table(title="the scheduling thread's waits on the device, by caller", header_style="bold",
                  title_justify="left")
        for col, j in (("wait", "left"), ("caller", "left"), ("count", "right"), ("total ms", "right")):
            t.add_column(col, justify=j)  # type: ignore[arg-type]
        for w in v.waits:
            t.add_row(escape(w.what), escape(w.caller or "(top level)"), str(w.count), f"{w.total_ms:.3f}")
        console.print(t)
    if v.collectives:
        console.print("collectives: " + ", ".join(f"{c.collective} x{c.count} {c.total_ms:.3f} ms"
                                                  for c in v.collectives), highlight=False)
    for line in v.truncated:
        console.print(f"[bold yellow]TRUNCATED[/] {escape(line)}", highlight=False, soft_wrap=True)
